"""Scheduling: requests, the scheduler and its output types, the KV cache manager and block pool, parallel sampling."""
