"""KV connectors: moving a request's prompt blocks from a prefill's pool into a decode's.

One module per transport (`shm`, `cuda_ipc`, `nccl`: gloo on CPU) behind `base.KvConnector`, chosen once by
`factory` (which names them without importing any); `mapped_pool` (the base of the two that map the prefill's
pool), `shm_pool` (the shared-memory segment), `ipc_handle`, `block_copies`, `lanes` (the worker threads
transfers run on), `link_keepalive`. The core's scheduler side is `core_process.kv_scheduler`; the service's
side (leases, reaching the prefills) lives in the decode service's `pulls` and `peers`. Every transport
scatters into blocks the decode allocated itself; nothing writes into another process's live blocks.
"""
