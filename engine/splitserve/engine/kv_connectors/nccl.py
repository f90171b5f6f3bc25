"""The `nccl` connector (gloo on CPU): a 2-rank group per prefill/decode pair; the decode receives one tensor
holding all the blocks it asked for, the prefill gathers them (a run of consecutive blocks: the pool's own slice)
and sends it.

    decode lane worker                                   prefill lane worker
    pull: SendWanted (now: the pair's previous transfer   send (SendKv → SendBlocks → start_send): gather, send
          has ended, so sends come in receive order) ──▶
          recv into staging (NCCL, consecutive: straight into the blocks), scatter

Pairs join on a pairing thread (`pair`: one message crosses at pairing, so the communicator exists before the
first transfer); a failed or timed-out transfer drops its pair's communicator (rebuilt on the next pairing),
never the process. A CUDA send/receive waits at stream level and polls an event every 50 us up to the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch

from splitserve.engine.kv_connectors.base import KvConnector, Moved, PullTarget, SendWanted
from splitserve.engine.kv_connectors.block_copies import block_run
from splitserve.engine.kv_connectors.link_keepalive import gpu_uuid, local_index
from splitserve.engine.worker.kv_cache import as_bytes

log = logging.getLogger("splitserve.kv")

FINISH_POLL_S = 50e-6  # how often a CUDA send/receive is checked for completion


class NcclConnector(KvConnector):
    """Transfers over per-pair process groups: NCCL between GPUs, gloo on CPU (how CI tests this path)."""

    transport = "nccl"

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.groups: dict[str, object] = {}  # pair name -> process group
        self._stores: dict[str, object] = {}
        self._listeners: dict[str, socket.socket] = {}  # pair -> the socket its store (rank 0) serves on
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the comm, keep the process

    def place_pool(self, layout, num_blocks: int, device: torch.device) -> torch.Tensor:
        kv_cache = super().place_pool(layout, num_blocks, device)
        if self.exports and device.type == "cuda":
            # a decode that sees this GPU (same host) can keep the link to it awake
            self.endpoint = {"gpu_uuid": gpu_uuid(device.index)}
        return kv_cache

    def keep_peer_awake(self, uuid: str) -> None:
        """Keep the link to the prefill's GPU awake when this process sees that GPU (same host); `uuid` comes
        from the prefill's own Describe, never from a KV handle."""
        if self.keepalive is not None and uuid:
            index = local_index(uuid)
            if index is not None:
                self._keep_link_awake(torch.device("cuda", index))

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        """Receive the blocks at `indices` into `dst_blocks`: ask for the send (`target.ask_send`), receive,
        scatter. Returns when they are in place."""
        if not indices:
            return Moved(0)
        return self._recv(spec, indices, dst_blocks, target)

    def _recv(self, spec, indices, dst_blocks, target: PullTarget) -> Moved:
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
            target.ask_send(SendWanted(spec.request_id, pair, indices))
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
        # One tiny exchange now: NCCL creates a group's communicator on its first send/recv, which the pair's
        # first request would otherwise wait for (docs/performance.md, "Findings that set defaults"). Rank 1
        # (prefill) sends.
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

    def release_transport(self) -> None:
        self.groups.clear()


def transfer_tag(epoch: int) -> int:
    """The send/recv tag of one lease's transfer (fits gloo's and NCCL's int tags)."""
    return epoch % (2**31 - 1)


def pair_name(prefill_instance: str, decode_instance: str) -> str:
    return f"{prefill_instance}->{decode_instance}"
