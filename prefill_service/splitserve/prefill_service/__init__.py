"""The prefill role: computes prompt KV, holds it under leases, serves pulls."""
