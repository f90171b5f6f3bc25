"""The engine core: add requests, step (schedule → run → update), abort, KV hand-off.

    step():  out = scheduler.schedule()          which requests compute which tokens
             launched = runner.launch(out)       one forward pass + sampling, not waited for
             changed = scheduler.update(...)     read a launched step: append tokens, finish, free blocks
             → one RequestOutput per request that progressed or ended

Asynchronous scheduling (EngineConfig.async_scheduling, on with CUDA): step() launches step N+1
and then reads step N, so the host schedules and prepares N+1 while the device runs N:

    host:    schedule N+1 | prepare, launch N+1 | read N (wait), outputs | schedule N+2 | ...
    device:  ......... step N ..........| step N+1 ...................................|

N's tokens are pending when N+1 is built (fed to it on the device); a request that N's tokens
end may be in N+1, whose token for it is discarded. Synchronously, step() reads what it launched.

Roles (EngineConfig.role): "prefill" parks each request after its first token with its
blocks held (`held_kv`, `release_kv`); "decode" imports prompt KV into blocks it
allocated (`begin_import` → the transport copies → `finish_import`); "both" does all.
A transfer runs off the core thread while the engine steps on: its blocks stay pinned
(`pin_blocks` / `unpin_blocks`) until it has ended, whatever happens to its request.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from splitserve.common.config import EngineConfig, RuntimeInfo, default_max_num_seqs
from splitserve.common.kv_layout import KvLayout
from splitserve.common.prefix_hash import extra_keys_for, hash_full_blocks
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.grammar_backend import GrammarBackend, GrammarLimits
from splitserve.engine.outputs import RequestError, RequestOutput
from splitserve.engine.scheduling.block_pool import BlockPool
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager, cdiv
from splitserve.engine.scheduling.output import SchedulerOutput
from splitserve.engine.scheduling.parallel_sampling import ParallelSampling
from splitserve.engine.scheduling.request import Request, RequestStatus
from splitserve.engine.scheduling.request_limits import checked_max_tokens
from splitserve.engine.scheduling.scheduler import Scheduler
from splitserve.engine.scheduling.step_outputs import request_output
from splitserve.engine.worker.device_setup import (
    default_budget,
    keep_freed_memory,
    resolve_device,
    resolve_dtype,
    start_tp_workers,
)
from splitserve.engine.worker.kv_cache import allocate_kv_cache
from splitserve.engine.worker.rank_setup import (
    kv_layout_for,
    load_rank_model,
    max_model_len_of,
    read_model_config,
    size_pool,
)

if TYPE_CHECKING:
    from splitserve.engine.worker.model_runner import LaunchedStep

log = logging.getLogger("splitserve.engine")


class EngineCore:
    """One engine instance: model, KV pool, scheduler. Not thread-safe: one caller drives it."""

    _frozen_open = 0  # engines not closed whose start froze the collector (CUDA); see close()

    def __init__(
        self,
        config: EngineConfig,
        model=None,
        model_config=None,
        kv_cache_factory=None,
        offline: bool = False,
        rank_pool_openers=None,
    ) -> None:
        """`kv_cache_factory(layout, num_blocks, device)` may supply the KV tensor (e.g. in shared memory), and
        then `rank_pool_openers()` where the other tensor-parallel ranks find theirs (KvConnector's);
        `offline`: the offline LLM API owns this engine (a larger default token budget on large GPUs).
        With --tensor-parallel-size N > 1 this is rank 0: it starts ranks 1..N-1 (worker/tp_worker.py) first."""
        from splitserve.engine.worker.model_runner import ModelRunner

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        if device.type == "cpu":
            keep_freed_memory()
        dtype_name = resolve_dtype(config.dtype, device)
        self.tp_workers = tp = None
        max_num_seqs = config.max_num_seqs or default_max_num_seqs(device.type, offline)
        if config.tensor_parallel_size > 1:
            model_config = model_config or read_model_config(config)
            self.tp_workers = start_tp_workers(config, model_config, device, dtype_name, max_num_seqs)
            tp = self.tp_workers.group
        try:
            if model is None:  # under TP, fp8 quantization reduces split rows' scales over the ranks
                with self.tp_workers.guard() if tp is not None else contextlib.nullcontext():
                    model, model_config = load_rank_model(config, device, dtype_name, tp, model_config)
            self.model_config = model_config
            self.layout: KvLayout = kv_layout_for(model, model_config, config, dtype_name, tp)
            max_model_len = max_model_len_of(config, model_config)
            num_blocks = size_pool(config, self.layout, device, max_model_len, max_num_seqs)
            if tp is not None:
                with self.tp_workers.guard():
                    num_blocks = tp.min_over_ranks(num_blocks)
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise
        self.info = RuntimeInfo(
            model_id=model_config.model_id,
            device=str(device),
            dtype=dtype_name,
            num_kv_blocks=num_blocks,
            max_model_len=max_model_len,
            eos_token_ids=tuple(model_config.eos_token_ids),
            vocab_size=model_config.vocab_size,
            max_num_batched_tokens=config.max_num_batched_tokens or default_budget(device, offline),
            max_num_seqs=max_num_seqs,
        )
        # structured output: the model's tokenizer is loaded now, not beside the step loop at the first grammar
        self.grammars = GrammarBackend(
            config.resolved_model(), model_config.vocab_size, self.info.eos_token_ids, GrammarLimits.from_config(config)
        )
        self.grammars.load_compiler()
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KvCacheManager(self.pool, config.block_size, extra_keys_for(model_config.model_id))
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.info.max_num_batched_tokens,
            max_model_len=max_model_len,
            role=config.role,
            policy=config.scheduling_policy,
        )
        factory = kv_cache_factory or allocate_kv_cache
        kv_cache = factory(self.layout, num_blocks, device)
        if self.tp_workers is not None:  # the other ranks wait for where their pools are (None: their own)
            with self.tp_workers.guard():
                tp.send_object(rank_pool_openers() if rank_pool_openers is not None else None)
        self.runner = ModelRunner(model, kv_cache, config.block_size, device, self.tp_workers)
        # n > 1: sequences sharing a prompt's KV (a partial block copied on every rank)
        self.forks = ParallelSampling(self.kv, self.scheduler, self.runner.copy_blocks)
        # tensor parallel: decode graphs would have to capture every rank's collectives in step (not yet)
        graphs = device.type == "cuda" and not config.enforce_eager and config.tensor_parallel_size == 1
        if graphs and config.role != "prefill":
            self.runner.capture_graphs(max_num_seqs, max_model_len)
        if device.type == "cuda" and self.tp_workers is None:  # the ranks of a TP group would have to step along
            self.runner.warm_up_kernels(self.info.max_num_batched_tokens, max_model_len)
        self.held: dict[str, Request] = {}  # prefill role: requests whose blocks wait for a pull
        self.waiting_for_kv: dict[str, Request] = {}  # decode role: requests whose KV is being pulled
        self._rng = random.Random(config.seed)
        lagged = config.async_scheduling
        # tensor parallel: the ranks > 0 get host inputs, so a token must be read before it is an input
        self.async_scheduling = lagged if lagged is not None else device.type == "cuda" and self.tp_workers is None
        self._unread: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, not read yet
        self._froze_gc = False
        if device.type == "cuda":
            self._freeze_collector()
        self.num_steps = 0
        self.last_step_num_tokens = 0
        log.info(
            "engine ready: model=%s device=%s dtype=%s blocks=%d (%d tokens, %.1f MiB per rank) max_model_len=%d "
            "role=%s tensor_parallel_size=%d%s",
            self.info.model_id,
            device,
            dtype_name,
            num_blocks,
            num_blocks * config.block_size,
            num_blocks * self.layout.block_nbytes / 2**20,
            max_model_len,
            config.role,
            config.tensor_parallel_size,
            " (CUDA graphs and asynchronous scheduling off under TP)" if tp is not None else "",
        )

    def _freeze_collector(self) -> None:
        """What exists now (weights, modules, graphs) lives as long as the engine: keep it out of the
        collector's full passes, whose pauses fall on the step loop (docs/performance.md, "Findings that set
        defaults": collector frozen)."""
        gc.collect()
        gc.freeze()
        self._froze_gc = True
        EngineCore._frozen_open += 1

    def close(self) -> None:
        """The engine will not run again: let the collector reach it once it is dropped. The freeze at start
        covers the engine's own reference cycles, so without this a deleted engine's weights, KV pool and graphs
        stay allocated for the life of the process (a second LLM in one process found its GPU taken). Unfreezes
        every frozen object; once the caller dropped the engine and collected, `refreeze()` freezes again for
        the engines still open. Idempotent."""
        self.grammars.close()
        if self.tp_workers is not None:
            self.tp_workers.close()
        if self._froze_gc:
            self._froze_gc = False
            EngineCore._frozen_open -= 1
            gc.unfreeze()

    @property
    def froze_collector(self) -> bool:
        """Whether this engine froze the collector at start and is not closed yet."""
        return self._froze_gc

    @staticmethod
    def refreeze() -> None:
        """After a closed engine was collected: freeze again what the engines still open hold (see close)."""
        if EngineCore._frozen_open:
            gc.freeze()

    # -- requests --------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        seed: int | None = None,
        share: int = 0,
    ) -> Request:
        """Validate and build a Request (does not queue it). `share`: the caller's fair share (lower runs first,
        scheduling/scheduler.py)."""
        if (
            request_id in self.scheduler.requests
            or request_id in self.held
            or request_id in self.waiting_for_kv
            or self.forks.waiting(request_id)
        ):
            raise RequestError(f"request_id {request_id!r} is already in use")
        max_tokens = checked_max_tokens(
            prompt_token_ids, params, self.info, self.config.block_size, self.pool.num_blocks
        )
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = () if params.ignore_eos else self.info.eos_token_ids
        grammar = None
        if params.structured_output is not None:
            try:
                grammar = self.grammars.matcher(params.structured_output)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            seed=seed,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            priority=priority,
            grammar=grammar,
            share=share,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        fork_ids: Sequence[str] = (),
        **options,
    ) -> Request:
        """Validate, build and queue a request; `options`: make_request's `priority`, `seed` and `share`.
        `fork_ids`: more sequences of the same prompt (scheduling/parallel_sampling.py), sequence i + 1 seeded
        seed + i + 1."""
        request = self.make_request(request_id, prompt_token_ids, params, **options)
        children = self._children(request, fork_ids)
        self.scheduler.add(request)
        self.forks.expect(request, children)
        return request

    def _children(self, parent: Request, fork_ids: Sequence[str]) -> list[Request]:
        """The child sequences of `parent` (validated like it; ids distinct and unused)."""
        if len(set(fork_ids)) != len(fork_ids) or parent.request_id in fork_ids:
            raise RequestError(f"fork ids must be distinct and differ from the request's id, got {list(fork_ids)}")
        return [
            self.make_request(
                fork_id,
                parent.prompt_token_ids,
                parent.sampling_params,
                parent.priority,
                parent.seed + i,
                share=parent.share,
            )
            for i, fork_id in enumerate(fork_ids, start=1)
        ]

    def abort(self, request_id: str) -> bool:
        """Stop a request anywhere (queued, running, held or waiting for its KV); frees its blocks."""
        self.forks.release(request_id)  # children not forked yet compute their prompts themselves
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            return True
        held = self.held.pop(request_id, None) or self.waiting_for_kv.pop(request_id, None)
        if held is not None:
            self.kv.free(request_id)
            held.status = RequestStatus.FINISHED_ABORTED
            return True
        return self.forks.drop(request_id)

    def check_ranks(self) -> None:
        """Raise TensorParallelError when a tensor-parallel rank has exited: the instance cannot step any more
        (the core loop asks every turn, so an idle instance ends too, not only at its next step)."""
        if self.tp_workers is not None:
            dead = self.tp_workers.dead_rank()
            if dead is not None:
                raise dead

    def has_unfinished(self) -> bool:
        """Requests to run, or a launched step still to read."""
        return self.scheduler.num_unfinished > 0 or self._unread is not None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, read the step before it (asynchronous) or this one, and report every
        request that progressed."""
        out = self.scheduler.schedule()
        self.last_step_num_tokens = out.num_tokens  # vllm:iteration_tokens_total
        changed: list[Request] = []
        if self._unread is not None and self._reads_pending_ids(out):
            # penalties read the ids of earlier outputs: learn the pending ones first, and drop what they ended
            changed = self._read()
            out.scheduled = [s for s in out.scheduled if s.request.status == RequestStatus.RUNNING]
        if not out.is_empty:
            launched = self.runner.launch(out, self.kv.req_blocks)  # read only, while it builds the inputs
            self.scheduler.step_launched(out)
            self.forks.on_step(out)  # before this step's outputs apply: a parent ending then still holds its blocks
            self.num_steps += 1
            previous, self._unread = self._unread, (out, launched)
            if previous is not None:
                changed += self._read(previous)
            if not self.async_scheduling:
                changed += self._read()
        elif self._unread is not None:
            changed += self._read()
        return self._outputs(changed)

    @staticmethod
    def _reads_pending_ids(out: SchedulerOutput) -> bool:
        """A row with penalties, or with a grammar (its matcher must have accepted every earlier token before
        the host fills the row's mask), samples on top of a token the host has not read: such a request
        gives up the one-step lag for itself."""
        return any(
            s.request.num_pending_tokens > 1
            and (s.request.sampling_params.has_penalties or s.request.grammar is not None)
            for s in out.scheduled
        )

    def _read(self, step: tuple[SchedulerOutput, LaunchedStep] | None = None) -> list[Request]:
        """Wait for a launched step (the unread one by default) and apply its tokens."""
        if step is None:
            step, self._unread = self._unread, None
        out, launched = step
        return self.scheduler.update_from_output(out, launched.read())

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        """One output per request the step changed; a prefill request parked after its first token is held."""
        for request in changed:
            if request.status == RequestStatus.PREFILLED:
                self.held[request.request_id] = request
        return [request_output(request) for request in changed]

    # -- prefill role: held KV -------------------------------------------------------------
    def held_kv(self, request_id: str) -> tuple[list[int], list[bytes], int]:
        """(block ids, full-block hashes, prompt tokens) of a parked prefill request."""
        request = self.held[request_id]
        hashes = hash_full_blocks(request.prompt_token_ids, self.config.block_size, self.kv.extra_keys)
        blocks = self.kv.blocks_of(request_id)[: cdiv(request.num_prompt_tokens, self.config.block_size)]
        return blocks, hashes, request.num_prompt_tokens

    def release_kv(self, request_id: str) -> bool:
        """Unpin a parked request's blocks (they stay in the prefix cache)."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    # -- decode role: import ---------------------------------------------------------------
    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        first_token_id: int,
        first_logprobs=None,
        priority: int = 0,
        fork_ids: Sequence[str] = (),
        share: int = 0,
    ) -> tuple[list[int], int] | None:
        """Allocate blocks for an incoming prompt's KV, reusing locally cached prefix blocks.

        Returns (block ids for the whole prompt, number of leading blocks already cached
        here and so not to be pulled), or None when the pool cannot hold it now. `fork_ids`:
        as add_request's; they fork when the import commits.
        """
        if not 0 <= first_token_id < self.info.vocab_size:
            raise RequestError(
                f"first_token_id {first_token_id} is not a token id of this model (vocab_size {self.info.vocab_size})"
            )
        request = self.make_request(request_id, prompt_token_ids, params, priority, seed, share)
        children = self._children(request, fork_ids)
        hashes = hash_full_blocks(prompt_token_ids, self.config.block_size, self.kv.extra_keys)
        cached = self.kv.lookup_hashes(hashes)
        if not self.kv.allocate_slots(request, len(prompt_token_ids) - len(cached) * self.config.block_size, cached):
            return None
        self.kv.keep_hashes(request_id, hashes)  # finish_import caches the blocks under these
        request.num_cached_tokens = len(cached) * self.config.block_size
        try:
            request.append_output(first_token_id, first_logprobs)  # a grammar starts over from the spec here
        except ValueError as exc:
            self.kv.free(request_id)
            raise RequestError(f"first_token_id {first_token_id}: {exc}") from None
        request.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[request_id] = request
        self.forks.expect(request, children)
        return self.kv.blocks_of(request_id), len(cached)

    def import_blocks_needed(self, prompt_token_ids: list[int]) -> int:
        """Free blocks an import of this prompt takes (its prefix cached here is adopted, not pulled)."""
        cached = self.kv.lookup_hashes(hash_full_blocks(prompt_token_ids, self.config.block_size, self.kv.extra_keys))
        revived = sum(1 for block in cached if self.pool.ref_counts[block] == 0)
        return cdiv(len(prompt_token_ids), self.config.block_size) - len(cached) + revived

    def finish_import(self, request_id: str) -> RequestOutput | None:
        """The prompt KV is in place: join the running batch (or finish at once if the
        first token already ended the request)."""
        request = self.waiting_for_kv.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request, request.num_prompt_tokens)
        self.forks.fork(request)  # before the parent may end below and free its blocks
        status = request.check_stop(self.info.max_model_len)
        if status is not None:
            request.status = status
            self.kv.free(request_id)
            return RequestOutput(
                request_id,
                [],
                finished=True,
                finish_reason=status.value,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
            )
        self.scheduler.add_running(request)
        return None

    def fail_import(self, request_id: str, recompute: bool) -> list[str]:
        """The pull failed: recompute the prompt locally (its forks fork once it is), or drop the request and
        the forks waiting for its KV. Returns the forks dropped with it."""
        request = self.waiting_for_kv.pop(request_id)
        self.kv.free(request_id)
        if recompute:
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.scheduler.add(request)
            return []
        request.status = RequestStatus.FINISHED_ERROR
        return self.forks.drop_children(request_id)

    # -- transfers in flight: blocks pinned -------------------------------------------------
    def pin_blocks(self, block_ids: list[int]) -> None:
        """Add a reference to blocks a transfer reads or writes off the core thread, so that whatever frees
        their request meanwhile (an abort, a failed import, a released lease) cannot hand them to another
        request before the transfer has ended; `unpin_blocks` drops it then. Only blocks in use are pinned."""
        bad = next((b for b in block_ids if not 0 <= b < self.pool.num_blocks or self.pool.ref_counts[b] == 0), None)
        if bad is not None:
            raise RequestError(
                f"block {bad} is not held by any request (pool of {self.pool.num_blocks}); a transfer pins only "
                "blocks in use"
            )
        self.pool.touch(block_ids)

    def unpin_blocks(self, block_ids: list[int]) -> None:
        """The transfer has ended: drop its references (tail first, as a request frees its blocks)."""
        self.pool.free(reversed(block_ids))

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> dict[str, int]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_held": len(self.held),
            "num_waiting_for_kv": len(self.waiting_for_kv),
            "num_free_blocks": self.pool.num_free_blocks,
            "num_total_blocks": self.pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_query_tokens": self.kv.num_prefix_queries_tokens,
            "prefix_hit_tokens": self.kv.num_prefix_hit_tokens,
            "num_steps": self.num_steps,
            "num_queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
            + sum(r.num_tokens_with_pending - r.num_computed_tokens - 1 for r in self.scheduler.running),
        }
