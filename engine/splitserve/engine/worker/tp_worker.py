"""The ranks > 0 of a tensor-parallel instance, and rank 0's handle on them.

    rank 0 (the engine core)                          rank r > 0 (`run_rank`, a process of its own)
    listen on a loopback port, start ranks 1..N-1  →  join the TpGroup (store on rank 0's port)
    join; load its shards; size the pool              load its shards; size the pool
    blocks = min over ranks                        ↔  blocks = min over ranks
    each step: schedule, build inputs, send TpStep →  receive TpStep, run the same forward
               forward + logits (collectives)      ↔  forward + logits (collectives), result dropped
               sample (rank 0 alone)
    close: send None                               →  exit 0

Only rank 0 schedules and samples; the other ranks hold no requests, only their KV heads of every
block. A rank that exits fails the next collective at once (its sockets close): rank 0 raises
`TensorParallelError` naming it, and a rank whose rank 0 is gone exits non-zero the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, field

import torch

from splitserve.engine.worker.attention import AttentionMetadata
from splitserve.engine.worker.prompt_logprobs import PromptRows, compute_prompt_logprobs
from splitserve.engine.worker.tensor_parallel import TensorParallelError, TpGroup

log = logging.getLogger("splitserve.engine.tp")

START_TIMEOUT_S = 300.0  # a rank that has not reached the group by then (importing, starting) failed
EXIT_WAIT_S = 5.0  # how long rank 0 waits for a rank's exit code when a collective failed


@dataclass
class TpStep:
    """One step's model inputs as rank 0 built them (host tensors), so every rank runs the same forward."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # (S,) rows rank 0 samples from; None: it computes no logits
    prompt_rows: list[PromptRows] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks copied first

    def to(self, device: torch.device) -> TpStep:
        """The same step with its tensors on `device`."""
        meta = dataclasses.replace(
            self.meta,
            **{f.name: getattr(self.meta, f.name).to(device) for f in _TENSOR_FIELDS},
        )
        indices = None if self.logits_indices is None else self.logits_indices.to(device)
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            meta=meta,
            logits_indices=indices,
        )


_TENSOR_FIELDS = [f for f in dataclasses.fields(AttentionMetadata) if f.type in ("torch.Tensor", torch.Tensor)]


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) src -> dst, on the cache's device and stream."""
    if pairs:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64).to(kv_cache.device)  # (N,)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64).to(kv_cache.device)  # (N,)
        kv_cache.index_copy_(0, dst, kv_cache.index_select(0, src))  # block-major: dim 0 is the block


@torch.inference_mode()
def run_step(model, kv_cache: torch.Tensor, step: TpStep) -> None:
    """A rank > 0's part of one step: the same forward and logits calls as rank 0's, in the same order."""
    copy_blocks(kv_cache, step.block_copies)
    hidden = model(step.input_ids, step.positions, kv_cache, step.meta)  # (T, H)
    if step.prompt_rows:
        compute_prompt_logprobs(model.compute_logits, hidden, step.prompt_rows)
    if step.logits_indices is not None:
        model.compute_logits(hidden[step.logits_indices])


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank, else the rank-th GPU from rank 0's."""
    return device if device.type == "cpu" else torch.device("cuda", device.index + rank)


class TpWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the group, sends steps, turns failures into
    `TensorParallelError`, stops them. `setup(tp)` (given to `start`) loads a rank's shard and returns
    its KV tensor and model; every rank runs it."""

    def __init__(self, group: TpGroup, processes: list) -> None:
        self.group = group
        self.processes = processes  # rank r is processes[r - 1]
        self.closed = False

    @classmethod
    def start(cls, setup, size: int, device: torch.device) -> TpWorkers:
        """Start ranks 1..size-1 running `setup` (a module-level function: it is pickled), join as rank 0."""
        from multiprocessing.connection import wait

        listener, port = TpGroup.listen()
        ctx = mp.get_context("forkserver")
        # torch and the loader imported once: each rank forks from the server in a fraction of a second
        ctx.set_forkserver_preload([__name__, "splitserve.engine.worker.rank_setup", "splitserve.engine.worker.loader"])
        processes, hellos = [], []
        with _children_allowed():
            for rank in range(1, size):
                processes.append(cls._start_rank(ctx, setup, rank, size, port, device, hellos))
        for rank, (process, hello) in enumerate(zip(processes, hellos), start=1):
            # each rank says so before it joins: one that dies starting is seen here, not as a store timeout
            if not wait([hello, process.sentinel], START_TIMEOUT_S) or not hello.poll():
                cls._stop(processes)
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start (exit code {process.exitcode})")
        return cls(TpGroup(0, size, port, device, listener), processes)

    @staticmethod
    def _start_rank(ctx, setup, rank: int, size: int, port: int, device: torch.device, hellos: list):
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_rank,
            args=(setup, rank, size, port, rank_device(device, rank), send),
            name=f"splitserve-tp{rank}",
            daemon=True,  # ends with its rank 0 (which also closes its sockets: the rank's next collective fails)
        )
        process.start()
        send.close()
        hellos.append(receive)
        return process

    def send_step(self, step: TpStep) -> None:
        with self.guard():
            self.group.send_object(step)

    @contextlib.contextmanager
    def guard(self):
        """Collectives inside raise `TensorParallelError` naming a rank that exited, if one did."""
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, TensorParallelError):
                raise
            raise self.failure(exc) from exc

    def failure(self, cause: BaseException | str) -> TensorParallelError:
        """The error a failed collective means: the rank that exited and its exit code, when one did."""
        from multiprocessing.connection import wait

        wait([process.sentinel for process in self.processes], EXIT_WAIT_S)  # the one that failed it is exiting
        return self.dead_rank() or TensorParallelError(f"tensor-parallel collective failed: {cause}")

    def dead_rank(self) -> TensorParallelError | None:
        """A rank that has exited (checked before a step: cheaper than a failed collective to read)."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return TensorParallelError(
                    f"tensor-parallel rank {rank} of {self.group.size} exited (exit code {process.exitcode})"
                )
        return None

    def close(self) -> None:
        """Tell the ranks to exit and wait for them (killed after EXIT_WAIT_S). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.dead_rank() is None:
            with contextlib.suppress(Exception):
                self.group.send_object(None)
        self._stop(self.processes)

    @staticmethod
    def _stop(processes: list) -> None:
        for process in processes:
            process.join(EXIT_WAIT_S)
            if process.exitcode is None:
                process.kill()
                process.join(EXIT_WAIT_S)


@contextlib.contextmanager
def _children_allowed():
    """Let a daemonic process (a service's engine core, daemonic so that it ends with its service) start its
    ranks: multiprocessing refuses children to daemonic processes only so that none is orphaned, and the
    ranks are daemonic themselves (terminated when it exits) and fail at once when its sockets close."""
    config = mp.current_process()._config
    daemonic = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemonic is not None:
            config["daemon"] = daemonic


def run_rank(setup, rank: int, size: int, port: int, device: torch.device, hello) -> None:
    """Entry point of rank `rank` > 0: join, load its shard (`setup`), then run every step rank 0 sends
    until it sends None. Exits non-zero when rank 0 is gone (a failed collective)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its rank 0 decides when it stops
    hello.send(os.getpid())
    hello.close()
    try:
        tp = TpGroup(rank, size, port, device)
        model, kv_cache = setup(tp)
        while True:
            step = tp.recv_object()
            if step is None:
                return
            run_step(model, kv_cache, step.to(device) if device.type != "cpu" else step)
    except RuntimeError as exc:  # rank 0 (or a peer) is gone: say so and exit non-zero
        log.error("tensor-parallel rank %d of %d stops: %s", rank, size, exc)
        raise SystemExit(1) from None
