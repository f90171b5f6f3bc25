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

Tensor parallel (either side): rank 0 holds every rank's pool and the pair is one group per (prefill rank,
decode rank) the transfer plan joins, each carrying that decode rank's heads from that prefill rank; one pull's
links move in parallel (nccl_links.py). A failed link drops the whole pair.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.kv_connectors.base import KvConnector, Moved, PullTarget, SendWanted
from splitserve.engine.kv_connectors.block_copies import block_run
from splitserve.engine.kv_connectors.link_keepalive import gpu_uuid, local_index
from splitserve.engine.kv_connectors.nccl_links import (
    LAYOUT_KEY,
    PairLinks,
    layout_bytes,
    layout_of,
    plan_links,
    rank_pool,
    synchronize,
    tensor_parallel,
)
from splitserve.engine.kv_connectors.rank_pools import TpRankPools, place_rank_pools
from splitserve.engine.worker.kv_cache import as_bytes

log = logging.getLogger("splitserve.kv")

FINISH_POLL_S = 50e-6  # how often a CUDA send/receive is checked for completion


class NcclConnector(KvConnector):
    """Transfers over per-pair process groups: NCCL between GPUs, gloo on CPU (how CI tests this path)."""

    transport = "nccl"
    moves_tensor_parallel = True

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self.groups: dict[str, object] = {}  # pair name -> its process group, or its PairLinks (tensor parallel)
        self.layout: KvLayout | None = None  # this instance's (one rank's pool), set by place_pool
        self._rank_pools: TpRankPools | None = None  # tensor parallel: every rank's pool, rank 0's first
        self._stores: dict[str, object] = {}
        self._listeners: dict[str, socket.socket] = {}  # pair -> the socket its store (rank 0) serves on
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the comm, keep the process

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        self.layout = layout
        if layout.tensor_parallel_size > 1:  # every rank's pool where this rank 0 runs their links
            self._rank_pools = place_rank_pools(self.instance, self.start_epoch, layout, num_blocks, device)
            kv_cache = self._rank_pools.tensors[0]
        else:
            kv_cache = super().place_pool(layout, num_blocks, device)
        if self.exports and device.type == "cuda":
            # a decode that sees this GPU (same host) can keep the link to it awake
            self.endpoint = {"gpu_uuid": gpu_uuid(device.index)}
        return kv_cache

    def rank_pool_openers(self) -> list | None:
        return self._rank_pools.openers() if self._rank_pools is not None else None

    def _own_pools(self, kv_cache: torch.Tensor | None) -> list:
        """This instance's pools by rank: every rank's (tensor parallel), else [kv_cache]."""
        return self._rank_pools.tensors if self._rank_pools is not None else [kv_cache]

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
        pair = pair_name(spec.prefill_instance, self.instance)
        if isinstance(self.groups.get(pair), PairLinks):
            return self._recv_links(pair, spec, indices, dst_blocks, target)
        return self._recv(spec, indices, dst_blocks, target)

    def _recv_links(self, pair: str, spec, indices, dst_blocks, target: PullTarget) -> Moved:
        """Tensor parallel: every link's heads into its decode rank's pool, the links' receives in parallel."""
        joined: PairLinks = self.groups[pair]
        if spec.layout != joined.prefill:
            raise RuntimeError(
                f"the KV handle's layout [{spec.layout.describe()}] is not the one paired with "
                f"[{joined.prefill.describe()}] (the prefill restarted?)"
            )
        pools = [as_bytes(pool) for pool in self._own_pools(target.kv_cache)]
        buffers = [link.buffer(rank_pool(pools, link.decode_rank), dst_blocks) for link, _ in joined.links]
        with self._side_stream(pools[0]):  # rank 0's pool: after the core's queued work
            target.ask_send(SendWanted(spec.request_id, pair, indices))
            deadline = time.monotonic() + self.timeout_s
            try:
                works = [group.recv([buf], 1, spec.tag) for (_, group), (buf, _) in zip(joined.links, buffers)]
                for work, (buf, _) in zip(works, buffers):
                    self._finish(work, buf, deadline)
                self._check_still_paired(pair, joined)
            except Exception:
                self.drop_pair(pair, joined)
                raise
            for (link, _), (buf, direct) in zip(joined.links, buffers):
                if not direct:
                    link.scatter(buf, pools[link.decode_rank], dst_blocks)
            synchronize(pools)
        return Moved(sum(buf.numel() * buf.element_size() for buf, _ in buffers))

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
        if isinstance(group, PairLinks):
            return self._send_links(pair, group, block_ids, kv_cache, tag)
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

    def _send_links(self, pair: str, joined: PairLinks, block_ids: list[int], kv_cache, tag: int) -> dict:
        """Tensor parallel: every link's heads of the blocks from its prefill rank's pool, sent in parallel."""
        start = time.perf_counter_ns()
        pools = [as_bytes(pool) for pool in self._own_pools(kv_cache)]
        with self._side_stream(pools[0]):  # rank 0's pool: after the core's queued work
            messages = [link.gather(rank_pool(pools, link.prefill_rank), block_ids) for link, _ in joined.links]
            deadline = time.monotonic() + self.timeout_s
            try:
                works = [group.send([msg], 0, tag) for (_, group), msg in zip(joined.links, messages)]
                for work, msg in zip(works, messages):
                    self._finish(work, msg, deadline)
                self._check_still_paired(pair, joined)
            except Exception:
                self.drop_pair(pair, joined)
                raise
            synchronize(pools)
        num_bytes = sum(msg.numel() * msg.element_size() for msg in messages)
        return {"num_bytes": num_bytes, "transfer_ns": time.perf_counter_ns() - start, "device_ns": 0}

    def _finish(self, work, tensor: torch.Tensor, deadline: float | None = None) -> torch.cuda.Event | None:
        """Wait for one send or receive, at most timeout_s (TimeoutError after it). On CUDA the current
        stream waits for the transfer and an event recorded behind that wait is polled every ~50 us, and
        returned (timing enabled): torch's `wait(timeout)` polls in whole milliseconds, which made each
        side return up to a millisecond late and put that delay inside events timed around the send.
        Once the work reads as completed (finished, or failed: `is_completed` checks the communicator),
        `wait(timeout)` returns at once or raises the error NCCL reported. `deadline` (time.monotonic()): one
        shared by several transfers, else timeout_s from now."""
        if deadline is None:
            deadline, timeout = time.monotonic() + self.timeout_s, datetime.timedelta(seconds=self.timeout_s)
        else:
            timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        if not tensor.is_cuda:
            work.wait(timeout)
            return None
        work.wait()  # stream-level: the current stream waits for the transfer; the host does not block
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream(tensor.device))
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
        """Join the pair `pair` (rank 0 = decode, hosting the store): one 2-rank group, or (either side tensor
        parallel) one per link of the two layouts' transfer plan (nccl_links.py), the layouts swapped through the
        store first. Blocks until every group is joined and one message has crossed each, so the communicators
        exist before the first transfer."""
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} is not one of gloo, nccl")
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
        self._stores[pair] = store  # the groups need their store alive
        prefixed = dist.PrefixStore(pair, store)
        join = (backend, timeout, local_host or host)
        try:
            prefixed.set(f"{LAYOUT_KEY}{rank}", layout_bytes(self.layout))
            peer = layout_of(prefixed.get(f"{LAYOUT_KEY}{1 - rank}"))
            if not tensor_parallel(self.layout, peer):
                group = self.groups[pair] = self._join(prefixed, rank, device, *join)
                self._probe(pair, group, rank, device, backend, timeout)
            else:
                self._pair_links(pair, prefixed, rank, device, peer, join)
        except Exception:
            self.drop_pair(pair)  # its store and listener too: nothing of a failed pairing stays
            raise
        log.info("paired %s as rank %d over %s", pair, rank, backend)

    def _pair_links(self, pair: str, store, rank: int, device: torch.device, peer, join: tuple) -> None:
        """One group per link of the plan from the prefill's layout to the decode's, each on the device of this
        side's rank of the link."""
        import torch.distributed as dist

        if self.layout is None or peer is None:
            raise ValueError(f"pairing {pair}: a tensor-parallel pair needs both sides' KV layouts")
        prefill, decode = (peer, self.layout) if rank == 0 else (self.layout, peer)
        links = plan_links(prefill, decode)  # ValueError naming both when none maps them
        joined = PairLinks(prefill, decode, [])
        self.groups[pair] = joined
        for link in links:
            own = rank_pool(self._own_pools(None), link.decode_rank if rank == 0 else link.prefill_rank)
            on = own.device if own is not None else device
            group = self._join(dist.PrefixStore(f"link/{link.prefill_rank}-{link.decode_rank}", store), rank, on, *join)
            joined.links.append((link, group))
            self._probe(pair, group, rank, on, join[0], join[1], joined)

    def _join(self, store, rank: int, device: torch.device, backend: str, timeout, hostname: str):
        """A 2-rank group on `store` over `backend`, this side as `rank`."""
        if backend == "gloo":
            from torch._C._distributed_c10d import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
            return ProcessGroupGloo(store, rank, 2, opts)
        from torch._C._distributed_c10d import ProcessGroupNCCL

        torch.cuda.set_device(device)
        return ProcessGroupNCCL(store, rank, 2, ProcessGroupNCCL.Options())

    def _probe(self, pair: str, group, rank: int, device: torch.device, backend: str, timeout, whole=None) -> None:
        """One tiny exchange now: NCCL creates a group's communicator on its first send/recv, which the pair's
        first request would otherwise wait for (docs/performance.md, "Findings that set defaults"). Rank 1
        (prefill) sends. A failure drops the pair (`whole`: what was stored for it)."""
        probe = torch.zeros(1, device=device if backend == "nccl" else "cpu")
        try:
            (group.recv([probe], 1, 0) if rank == 0 else group.send([probe], 0, 0)).wait(timeout)
        except Exception:
            self.drop_pair(pair, whole if whole is not None else group)
            raise

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
        if self._rank_pools is not None:
            self._rank_pools.close()
            self._rank_pools = None


def transfer_tag(epoch: int) -> int:
    """The send/recv tag of one lease's transfer (fits gloo's and NCCL's int tags)."""
    return epoch % (2**31 - 1)


def pair_name(prefill_instance: str, decode_instance: str) -> str:
    return f"{prefill_instance}->{decode_instance}"
