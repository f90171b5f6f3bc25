"""KV transfer: moving a request's prompt blocks from a prefill's pool into a decode's.

The scheduler side (which blocks, leases) lives in the services; this package is the
data side: `io` (the transports), `lanes` (the worker threads transfers run on) and
`transfers` (the core loop's side: pins, results, deadlines). Every transport gathers the
source blocks and scatters them into blocks the decode allocated itself; nothing writes
into another process's live blocks.
"""
