"""KV transfer: moving a request's prompt blocks from a prefill's pool into a decode's.

One connector class per transport (`connector`: the interface; `mapped`: shm, cuda_ipc; `collective`: nccl,
gloo on CPU), chosen once by `registry`; `lanes` (the worker threads transfers run on) and `scheduling` (the
core's scheduler side: blocks, pins, imports waiting for room, results into messages). The service's side (leases,
reaching the prefills) lives in decode_service/pulls.py and peers.py. Every transport scatters into blocks the
decode allocated itself; nothing writes into another process's live blocks.
"""
