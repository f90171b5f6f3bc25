"""The data side of KV transfer, inside a core process: the pool's placement (shared
memory for `shm`), pulls into freshly allocated blocks, and sends over paired groups.

Transports:
    shm       prefill pool in a named shared-memory segment; decode maps it, gathers, scatters
    cuda_ipc  prefill exports its pool with a CUDA IPC handle; decode maps it and copies on device
    nccl      2-rank group per prefill/decode pair (gloo on CPU); decode receives one staged
              tensor holding all requested blocks, prefill gathers and sends it

Threads: `pull` and `send` run on a transfer worker (engine/kv_transfer/lanes.py), never on the core
loop's thread, and touch only tensors and the transport; on CUDA they copy on a side stream that starts
after the core's stream (so a block freed by an earlier step is done with) and never holds it up. Pool
mappings and pairs change on the core thread (`prepare_pull`, `map_source`) or a pairing thread.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_layout import allocate_kv_cache, as_bytes, torch_dtype
from splitserve.engine.kv_transfer.ipc_handle import check_shape, export_cuda_ipc, load_cuda_ipc, rebuild
from splitserve.engine.kv_transfer.keepalive import CudaLink, LinkKeepalive, gpu_uuid, local_index
from splitserve.engine.kv_transfer.shm import SharedKvPool, copy_blocks, segment_name, unlink_stale

log = logging.getLogger("splitserve.kv")

TRANSPORTS = ("shm", "cuda_ipc", "nccl")
FINISH_POLL_S = 50e-6  # how often a CUDA send/receive is checked for completion


class Moved(NamedTuple):
    """What one pull moved: bytes, and the copy's device time (CUDA events; cuda_ipc only, else 0)."""

    num_bytes: int
    device_ns: int = 0


@dataclass
class PullTarget:
    """What one pull needs besides its spec, gathered on the core thread: the decode's pool, the prefill's
    mapped pool (shm, cuda_ipc: `KvIo.prepare_pull`), and how a receive asks the prefill to send
    (`ask_send(NeedSend)`, called on the worker: the message goes to the service at once)."""

    kv_cache: torch.Tensor  # (N, L, 2, bs, Hkv, D), this process's pool
    ask_send: Callable[[Any], None]
    source: torch.Tensor | None = None  # the prefill's pool, mapped here; None for nccl


class KvIo:
    """One per core process. `options`: transport, instance, start_epoch, role, timeout_s."""

    def __init__(self, options: dict) -> None:
        self.transport = options.get("transport", "shm")
        self.instance = options.get("instance", "local")
        self.start_epoch = int(options.get("start_epoch", time.time_ns()))
        self.role = options.get("role", "both")
        self.timeout_s = float(options.get("timeout_s", 10.0))
        self.endpoint: dict[str, str] = {}
        keepalive_ms = float(options.get("link_keepalive_ms") or 0)
        self.keepalive = LinkKeepalive(keepalive_ms / 1000) if keepalive_ms > 0 else None
        self.device: torch.device | None = None  # this process's KV pool device
        self._core_stream: torch.cuda.Stream | None = None  # the core thread's stream on that device
        self._own_pool: SharedKvPool | None = None
        self._mapped: dict[str, torch.Tensor | SharedKvPool] = {}  # pool key -> mapping
        self._mapped_by_instance: dict[str, str] = {}  # prefill instance -> its current pool key
        self.groups: dict[str, object] = {}  # pair name -> process group
        self._stores: dict[str, object] = {}
        self._listeners: dict[str, socket.socket] = {}  # pair -> the socket its store (rank 0) serves on
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the comm, keep the process

    # -- pool placement --------------------------------------------------------------------
    def kv_cache_factory(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        device = self.device
        if device.type == "cuda":  # called on the core thread: its stream is the one steps run on
            self._core_stream = torch.cuda.current_stream(device)
        exports = self.role in ("prefill", "both")
        if self.transport == "shm" and exports and device.type == "cpu":
            for name in unlink_stale(self.instance):
                log.info("unlinked stale KV segment %s", name)
            name = segment_name(self.instance, self.start_epoch)
            self._own_pool = SharedKvPool.create(name, layout, num_blocks)
            self.endpoint = {"shm_name": name, "num_blocks": str(num_blocks)}
            return self._own_pool.tensor
        kv_cache = allocate_kv_cache(layout, num_blocks, device)
        if self.transport == "cuda_ipc" and exports and device.type == "cuda":
            self.endpoint = {
                "cuda_ipc": export_cuda_ipc(kv_cache),
                "num_blocks": str(num_blocks),
                "device": str(device.index),
            }
        elif self.transport == "nccl" and exports and device.type == "cuda":
            # a decode that sees this GPU (same host) can keep the link to it awake
            self.endpoint = {"gpu_uuid": gpu_uuid(device.index)}
        return kv_cache

    # -- decode side -----------------------------------------------------------------------
    def _source_pool(self, spec) -> torch.Tensor:
        return self.map_source(spec.prefill_instance, spec.transport, spec.endpoint, spec.layout)

    def map_source(self, prefill_instance: str, transport: str, endpoint: dict, layout: KvLayout) -> torch.Tensor:
        """The prefill's KV pool, mapped once per pool (shm segment or CUDA IPC handle); a restarted
        prefill's new pool replaces its old mapping."""
        if "error" in endpoint:
            raise RuntimeError(endpoint["error"])
        key = endpoint.get("shm_name") or endpoint.get("cuda_ipc") or prefill_instance
        pool = self._mapped.get(key)
        if pool is None:
            num_blocks = int(endpoint["num_blocks"])
            if transport == "shm":
                pool = SharedKvPool.open(endpoint["shm_name"], layout, num_blocks)
            elif transport == "cuda_ipc":
                args = load_cuda_ipc(endpoint["cuda_ipc"])
                check_shape(args, tuple(layout.cache_shape(num_blocks)), torch_dtype(layout))
                pool = rebuild(args)
                self._keep_link_awake(pool.device)
            else:
                raise ValueError(f"transport {transport!r} maps no pool; mapped ones: shm, cuda_ipc")
            stale = self._mapped_by_instance.get(prefill_instance)
            if stale is not None and stale in self._mapped:
                old = self._mapped.pop(stale)
                if isinstance(old, SharedKvPool):
                    old.close()
                log.info("%s's KV pool changed (restarted); dropped the old mapping", prefill_instance)
            self._mapped[key] = pool
            self._mapped_by_instance[prefill_instance] = key
        return pool.tensor if isinstance(pool, SharedKvPool) else pool

    def _keep_link_awake(self, peer: torch.device) -> None:
        """With link_keepalive_ms, keep the link peer -> this pool's device awake (once per peer device;
        the link is built on the keep-alive thread, and nothing of it can fail the caller)."""
        own = self.device
        if self.keepalive is None or own is None or own.type != "cuda" or peer == own:
            return
        self.keepalive.add(f"{peer}->{own}", lambda: CudaLink(peer, own))

    def keep_peer_awake(self, uuid: str) -> None:
        """nccl pairs: keep the link to the prefill's GPU awake when this process sees that GPU (same
        host); `uuid` comes from the prefill's own Describe, never from a KV handle."""
        if self.keepalive is not None and uuid:
            index = local_index(uuid)
            if index is not None:
                self._keep_link_awake(torch.device("cuda", index))

    def prepare_pull(self, spec) -> torch.Tensor | None:
        """Core thread, before a pull goes to its worker: the prefill's pool (shm, cuda_ipc), mapped here so
        that mappings change on one thread only (a worker keeps its own reference: a restarted prefill's new
        pool replacing the mapping leaves a running copy's source in place); None for nccl."""
        if spec.transport in ("shm", "cuda_ipc"):
            return self._source_pool(spec)
        if spec.transport != "nccl":
            raise ValueError(f"unknown KV transport {spec.transport!r}; known: {', '.join(TRANSPORTS)}")
        return None

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        """Copy the handle's blocks at `indices` into `dst_blocks` of `target.kv_cache`. Runs on a transfer
        worker and returns when the blocks are in place (a CUDA copy has ended on the device)."""
        if not indices:
            return Moved(0)
        if spec.transport == "nccl":
            return self._recv(spec, indices, dst_blocks, target)
        if spec.transport not in ("shm", "cuda_ipc"):
            raise ValueError(f"unknown KV transport {spec.transport!r}; known: {', '.join(TRANSPORTS)}")
        kv_cache, src = target.kv_cache, target.source
        if src is None:
            raise ValueError(f"a {spec.transport} pull needs the source pool prepare_pull maps")
        src_ids = [spec.block_ids[i] for i in indices]
        with self._side_stream(kv_cache) as stream:
            if stream is None:
                # shm on CPU: runs of consecutive blocks straight from the mapped segment, one pass, no staging
                # tensor (a fresh staging tensor per pull also pays a page fault per 4 KiB)
                return Moved(copy_block_runs(src, src_ids, kv_cache, dst_blocks))
            # timed on the side stream: every way of copying below makes it wait for the copy; torch's
            # cross-device copy_ runs on the source device's stream, as fast as a copy between ordinary
            # tensors (bench/kv_copy_variants.py); split over several streams or issued by the destination is slower
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record(stream)
            num_bytes = copy_block_runs(src, src_ids, kv_cache, dst_blocks)
            events[1].record(stream)
        events[1].synchronize()  # this worker waits; the core's stream runs on
        device_ns = int(events[0].elapsed_time(events[1]) * 1e6) if spec.transport == "cuda_ipc" else 0
        return Moved(num_bytes, device_ns)

    @contextlib.contextmanager
    def _side_stream(self, kv_cache: torch.Tensor) -> Iterator[torch.cuda.Stream | None]:
        """On CUDA: make a side stream of the pool's device current on this (worker) thread, after the work the
        core's stream has queued so far (a block an earlier step freed is done with before a copy lands in it).
        The core's stream never waits for it; the caller waits for its own work. None on CPU."""
        if not kv_cache.is_cuda:
            yield None
            return
        torch.cuda.set_device(kv_cache.device)  # the current device is per thread
        stream = torch.cuda.Stream(kv_cache.device)
        core = self._core_stream if self._core_stream is not None else torch.cuda.default_stream(kv_cache.device)
        stream.wait_stream(core)
        with torch.cuda.stream(stream):
            yield stream

    def _recv(self, spec, indices, dst_blocks, target: PullTarget) -> Moved:
        from splitserve.engine.core_messages import NeedSend

        pair = pair_name(spec.prefill_instance, self.instance)
        group = self.groups.get(pair)
        if group is None:
            raise RuntimeError(f"no communicator with {spec.prefill_instance} (pair {pair} not registered)")
        kv_cache = as_bytes(target.kv_cache)  # fp8 pools move as bytes (neither gloo nor NCCL takes fp8)
        src_ids = [spec.block_ids[i] for i in indices]
        # Receive straight into the destination blocks only over NCCL, whose abort (drop_pair) cancels a
        # timed-out receive; a gloo receive left pending could land in blocks reused by then, so CPU stages.
        direct = kv_cache.is_cuda and block_run(src_ids) is not None and block_run(dst_blocks) is not None
        with self._side_stream(kv_cache) as stream:
            if direct:  # one message straight into the destination blocks (the sender skips its gather too)
                first = dst_blocks[0]
                staging = kv_cache[first : first + len(dst_blocks)]  # (n, L, 2, bs, Hkv, D), contiguous view
            else:
                shape = (len(indices), *kv_cache.shape[1:])
                staging = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
            start = time.perf_counter_ns()
            # asked only now, from the lane that receives: the previous transfer of this pair has ended, so
            # the prefill's sends come in the order of these receives (NCCL matches them by order alone)
            target.ask_send(NeedSend(spec.request_id, pair, indices))
            asked = time.perf_counter_ns()
            try:
                self._finish(group.recv([staging], 1, spec.tag), staging)
                self._check_still_paired(pair, group)
            except Exception:
                self.drop_pair(pair, group)
                raise
            received = time.perf_counter_ns()
            if not direct:
                dst = torch.tensor(dst_blocks, dtype=torch.int64, device=kv_cache.device)
                kv_cache.index_copy_(0, dst, staging)
            if stream is not None:
                stream.synchronize()  # the blocks are in place when this returns
        log.debug(
            "kv timing nccl recv: %d blocks, direct=%s; ask %.3f ms, recv wait %.3f ms, scatter %.3f ms",
            len(indices),
            direct,
            (asked - start) / 1e6,
            (received - asked) / 1e6,
            (time.perf_counter_ns() - received) / 1e6,
        )
        return Moved(staging.numel() * staging.element_size())

    # -- prefill side ----------------------------------------------------------------------
    def send(self, pair: str, block_ids: list[int], kv_cache: torch.Tensor, tag: int = 0) -> dict:
        """Send blocks to the pair's decode. Runs on a transfer worker; on CUDA on a side stream."""
        group = self.groups.get(pair)
        if group is None:
            raise RuntimeError(f"pair {pair} is not registered")
        start = time.perf_counter_ns()
        kv_cache = as_bytes(kv_cache)  # fp8 pools move as bytes, as the receiver takes them
        with self._side_stream(kv_cache) as stream:
            if block_run(block_ids) is not None:  # consecutive blocks: send the pool's own slice, no gather
                staging = kv_cache[block_ids[0] : block_ids[0] + len(block_ids)]  # (n, L, 2, bs, Hkv, D)
            else:
                index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
                staging = kv_cache.index_select(0, index)  # (n, L, 2, bs, Hkv, D), contiguous
            gathered = time.perf_counter_ns()
            start_event = torch.cuda.Event(enable_timing=True) if stream is not None else None
            if start_event is not None:
                start_event.record(stream)
            try:
                end_event = self._finish(group.send([staging], 0, tag), staging)
                self._check_still_paired(pair, group)
            except Exception:
                self.drop_pair(pair, group)
                raise
        device_ns = 0
        if end_event is not None:  # the side stream waited for the send: the interval is the transfer
            device_ns = int(start_event.elapsed_time(end_event) * 1e6)
        log.debug(
            "kv timing nccl send: %d blocks, gather %.3f ms, send wait %.3f ms",
            len(block_ids),
            (gathered - start) / 1e6,
            (time.perf_counter_ns() - gathered) / 1e6,
        )
        return {
            "num_bytes": staging.numel() * staging.element_size(),
            "transfer_ns": time.perf_counter_ns() - start,
            "device_ns": device_ns,
        }

    def _finish(self, work, tensor: torch.Tensor) -> torch.cuda.Event | None:
        """Wait for one send or receive, at most timeout_s (TimeoutError after it). On CUDA the current
        stream waits for the transfer and an event recorded behind that wait is polled every ~50 us, and
        returned (timing enabled): torch's `wait(timeout)` polls in whole milliseconds, which made each
        side return up to a millisecond late and put that delay inside events timed around the send.
        Once the work reads as completed (finished, or failed: `is_completed` checks the communicator),
        `wait(timeout)` returns at once or raises the error NCCL reported."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not tensor.is_cuda:
            work.wait(timeout)
            return None
        work.wait()  # stream-level: the current stream waits for the transfer; the host does not block
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream(tensor.device))
        deadline = time.monotonic() + self.timeout_s
        checked = False
        while not done.query():
            if not checked and work.is_completed():
                work.wait(timeout)  # completed: no polling sleep; raises if it failed
                checked = True
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"KV transfer of {tensor.numel() * tensor.element_size()} bytes did not "
                    f"finish within the transfer timeout ({self.timeout_s:g} s)"
                )
            time.sleep(FINISH_POLL_S)
        if not checked and work.is_completed():
            work.wait(timeout)
        return done

    def _check_still_paired(self, pair: str, group) -> None:
        """A pairing that replaced (and aborted) this transfer's communicator meanwhile ends its kernels
        early: what they moved is not a transfer."""
        if self.groups.get(pair) is not group:
            raise RuntimeError(f"the communicator of pair {pair} was replaced during the transfer")

    # -- pairs -----------------------------------------------------------------------------
    def pair(
        self,
        pair: str,
        rank: int,
        host: str,
        port: int,
        backend: str,
        device: torch.device,
        local_host: str | None = None,
    ) -> None:
        """Join the 2-rank group `pair` (rank 0 = decode, hosting the store). Blocks until both joined
        and one message has crossed, so the communicator exists before the first transfer."""
        import torch.distributed as dist

        self.drop_pair(pair)
        timeout = datetime.timedelta(seconds=max(self.timeout_s, 10.0))
        listener = None
        if rank == 0:  # the store listens on the address the peer dials, not on every interface (its default)
            listener = socket.create_server((host, port), backlog=16)
        store = dist.TCPStore(
            host,
            port,
            2,
            is_master=rank == 0,
            timeout=timeout,
            master_listen_fd=listener.fileno() if listener is not None else None,
        )
        if listener is not None:
            self._listeners[pair] = listener  # the store serves on this socket: keep it open
        prefixed = dist.PrefixStore(pair, store)
        if backend == "gloo":
            from torch._C._distributed_c10d import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=local_host or host)]
            group = ProcessGroupGloo(prefixed, rank, 2, opts)
        elif backend == "nccl":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            torch.cuda.set_device(device)
            group = ProcessGroupNCCL(prefixed, rank, 2, ProcessGroupNCCL.Options())
        else:
            raise ValueError(f"backend {backend!r} is not one of gloo, nccl")
        self._stores[pair] = store  # the group needs its store alive
        self.groups[pair] = group
        # One tiny exchange now: NCCL creates a group's communicator on its first send/recv (0.5-0.7 s on
        # two H200s), which the pair's first request would otherwise wait for. Rank 1 (prefill) sends.
        probe = torch.zeros(1, device=device if backend == "nccl" else "cpu")
        try:
            (group.recv([probe], 1, 0) if rank == 0 else group.send([probe], 0, 0)).wait(timeout)
        except Exception:
            self.drop_pair(pair, group)
            raise
        log.info("paired %s as rank %d over %s", pair, rank, backend)

    def drop_pair(self, pair: str, only=None) -> None:
        """Abort and forget the pair's communicator; with `only`, just when it is still that one (a
        failed transfer must not drop the communicator a new pairing put in its place)."""
        if only is not None and self.groups.get(pair) is not only:
            return
        group = self.groups.pop(pair, None)
        if group is not None:
            try:
                group.abort() if hasattr(group, "abort") else None
            except Exception:  # a transfer's kernels may stay queued on the stream: say so
                log.exception("aborting communicator %s failed", pair)
            log.warning("dropped communicator %s; it is rebuilt on the next pairing", pair)
        self._stores.pop(pair, None)
        listener = self._listeners.pop(pair, None)
        if listener is not None:
            listener.close()

    def close(self) -> None:
        if self.keepalive is not None:
            self.keepalive.close()
        for pair in list(self.groups):
            self.groups.pop(pair, None)
        for pool in self._mapped.values():
            if isinstance(pool, SharedKvPool):
                pool.close()
        self._mapped.clear()
        if self._own_pool is not None:
            self._own_pool.close()


def block_run(ids: list[int]) -> int | None:
    """The first id when `ids` are consecutive (b, b+1, ...), else None. Both sides of an NCCL
    transfer decide from the source ids alone whether the sender skips its gather."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return ids[0]
    return None


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, count) runs where both sides advance by one block."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


MAX_DIRECT_RUNS = 16  # beyond this, per-run copies cost more host time than one gather pass


def copy_block_runs(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> int:
    """Copy blocks src[src_ids] -> dst[dst_ids] (pools are block-major, so a run of consecutive
    blocks is one contiguous range): one device-to-device copy per run, a single pass with no
    staging; more than MAX_DIRECT_RUNS runs fall back to gather + copy + scatter. Returns bytes."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_block_runs: {len(src_ids)} source blocks vs {len(dst_ids)} destination blocks")
    for side, ids, pool in (("source", src_ids, src), ("destination", dst_ids, dst)):
        if ids and not 0 <= min(ids) <= max(ids) < pool.shape[0]:  # a slice past the end would broadcast
            raise ValueError(
                f"copy_block_runs: {side} block ids {min(ids)}..{max(ids)} outside the pool's {pool.shape[0]} blocks"
            )
    src, dst = as_bytes(src), as_bytes(dst)  # fp8 pools move as bytes
    runs = block_runs(src_ids, dst_ids)
    if len(runs) > MAX_DIRECT_RUNS:
        return copy_blocks(src, src_ids, dst, dst_ids)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
    return len(src_ids) * src[0].numel() * src.element_size()


def transfer_tag(epoch: int) -> int:
    """The send/recv tag of one lease's transfer (fits gloo's and NCCL's int tags)."""
    return epoch % (2**31 - 1)


def pair_name(prefill_instance: str, decode_instance: str) -> str:
    return f"{prefill_instance}->{decode_instance}"
