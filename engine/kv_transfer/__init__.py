"""KV transfer: moving a request's prompt blocks from a prefill's pool into a decode's.

The scheduler side (which blocks, leases) lives in the services; this package is the
data side. Every transport gathers the source blocks and scatters them into blocks the
decode allocated itself; nothing writes into another process's live blocks.
"""
