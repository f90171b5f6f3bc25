"""Compiling structured output specs for one engine: a time budget, a size budget, a cancel, and a cache bounded
by the memory it really holds.

    prepare(spec) ─┬─ larger than --structured-output-max-spec-bytes, or refused before ─▶ refused at once
                   ├─ in the cache (by spec key), or compiling for another request ───────▶ that result
                   └─ a job on the queue ─▶ a slot thread: the trial in its worker process (grammar_workers.py),
                      killed past --structured-output-compile-timeout-s or when `cancel` finds nobody waiting;
                      then the compile in this process (as long as the trial took), cached
    matcher(spec): a matcher on the cached grammar (blocking on `prepare` when it is not there: the offline API)

The compiler (the model's tokenizer) is made when the engine starts (`load_compiler`), and xgrammar is imported with
grammar.py: made by the first spec on a slot thread, their Python held the GIL for seconds beside the step loop. The
core loop holds a request back until its future is done and steps the others meanwhile (xgrammar releases the GIL
while it compiles); so a compile never delays, nor runs ahead of, requests that need none. Each engine (the
prefill's and the decode's) compiles a spec once and keeps it by spec key: a compiled grammar is not handed from
the prefill to the decode, since moving one takes several times longer than compiling it (grammar_workers.py);
but a decode compiles a spec that its prefill has compiled within the budget (an imported request) without a
trial, so it costs the decode one compile, not two.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.common.structured_output import REFUSAL_PREFIX, StructuredOutput
from splitserve.engine.grammar import (
    KIND_LABELS,
    RequestGrammar,
    check_spec_size,
    compile_spec,
    load_tokenizer_info,
)
from splitserve.engine.grammar_workers import CompileTimeout, CompileWorker, WorkerGone, rss_bytes, trim_heap

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger("splitserve.grammar")

# verdicts remembered per spec key: a refused spec is refused again at once, and one that passed its trial and was
# evicted from the cache since is compiled again without a second trial
NUM_VERDICTS_KEPT = 1024


@dataclass(frozen=True)
class GrammarLimits:
    """What one engine spends on compiling specs (EngineConfig's structured_output_* fields)."""

    compile_timeout_s: float = 10.0
    max_spec_bytes: int = 128 << 10
    cache_bytes: int = 512 << 20
    num_workers: int = 2  # 0: compile on a thread of this process (no time budget: nothing can stop it)

    @classmethod
    def from_config(cls, config) -> GrammarLimits:
        """The limits an EngineConfig sets."""
        return cls(
            compile_timeout_s=config.structured_output_compile_timeout_s,
            max_spec_bytes=config.structured_output_max_spec_bytes,
            cache_bytes=config.structured_output_cache_mb << 20,
            num_workers=config.structured_output_compile_workers,
        )


def spec_key(spec: StructuredOutput) -> str:
    """A stable key of `spec` (its fields, sorted), the same in every process."""
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()


class GrammarCache:
    """Compiled grammars by spec key, least recently used first out, bounded by the resident bytes each holds as
    measured when it was compiled (not xgrammar's count). Not thread-safe: its backend's lock guards it."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> xgrammar.CompiledGrammar | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, compiled: xgrammar.CompiledGrammar, num_bytes: int) -> None:
        """Keep `compiled` (at most limit_bytes: the caller refuses bigger ones), evicting the oldest to make room."""
        evicted = False
        while self._entries and self.total_bytes + num_bytes > self.limit_bytes:
            _, (_, size) = self._entries.popitem(last=False)
            self.total_bytes -= size
            evicted = True
        self._entries[key] = (compiled, num_bytes)
        self.total_bytes += num_bytes
        if evicted:
            trim_heap()  # the evicted grammars' pages go back to the system, not only to the heap


@dataclass
class _Job:
    key: str
    spec: StructuredOutput
    future: Future
    vetted: bool = False  # compiled within its budget elsewhere: no trial here
    worker: CompileWorker | None = None  # the worker running its trial, while it runs
    cancelled: bool = False


class _Cancelled(Exception):
    pass


class _Slot:
    """One compile at a time: a thread and (with workers) the worker process it drives."""

    def __init__(self) -> None:
        self.worker: CompileWorker | None = None

    def drop_worker(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


class GrammarBackend:
    """Compiles specs against one model's tokenizer (loaded by the first compile) and starts matchers; see the
    module docstring for the budgets. `prepare` and `cancel` are called from one thread (the core loop)."""

    def __init__(
        self, model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...], limits: GrammarLimits | None = None
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the lm_head's width: the bitmask covers every logit
        self.stop_token_ids = stop_token_ids
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits.cache_bytes)
        self._lock = threading.Lock()  # the cache and the job tables (held briefly: the core loop takes it)
        self._compiler_lock = threading.Lock()  # the compiler is made once (loading the tokenizer: seconds)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info_json = ""  # the tokenizer info as workers receive it
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._compiling: dict[str, _Job] = {}  # by spec key
        self._job_of: dict[Future, _Job] = {}
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._passed: OrderedDict[str, int] = OrderedDict()  # key -> the bytes its grammar held in the trial
        self.slots: list[_Slot] = []

    def load_compiler(self) -> None:
        """Make the compiler now, at engine start (the model's tokenizer loaded: 0.1 s for the default model, once
        xgrammar is imported), not on a slot thread when the first spec comes: there its Python ran beside the step
        loop for the GIL and made steps several times slower. A model without a tokenizer is left as it is (each
        spec is refused with that message), and so is a tokenizer that fails to load (each spec tries again)."""
        try:
            self._get_compiler()
        except ValueError:
            pass
        except Exception:  # noqa: BLE001 - structured output is one feature: the engine serves without it
            log.warning("loading the tokenizer for structured output failed; each spec tries again", exc_info=True)

    # -- the core loop's side ------------------------------------------------------------------
    def prepare(self, spec: StructuredOutput, vetted: bool = False) -> Future:
        """A future of `spec`'s compiled grammar; its exception is a ValueError (REFUSAL_PREFIX ...) to end the
        request with. `vetted`: another engine compiled it within its budget already (a prefill, for a request
        this decode imports), so it is compiled here without a trial."""
        future: Future = Future()
        try:
            check_spec_size(spec, self.limits.max_spec_bytes)
        except ValueError as exc:
            future.set_exception(exc)
            return future
        key = spec_key(spec)
        with self._lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                future.set_result(compiled)
            elif key in self._refused:
                self._refused.move_to_end(key)
                future.set_exception(ValueError(self._refused[key]))
            elif key in self._compiling:
                return self._compiling[key].future
            else:
                job = _Job(key, spec, future, vetted=vetted)
                self._compiling[key] = self._job_of[future] = job
                self._start_slots()
                self._jobs.put(job)
        return future

    def cancel(self, future: Future) -> None:
        """Nobody waits for `future` any more (its requests were aborted): a trial running for it is killed, a
        queued one dropped. A compile past its trial ends and is cached (it is bounded and nearly done)."""
        with self._lock:
            job = self._job_of.pop(future, None)
            if job is None:
                return
            job.cancelled = True
            if self._compiling.get(job.key) is job:
                del self._compiling[job.key]  # the same spec asked again compiles afresh
            if job.worker is not None:
                job.worker.kill()

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher of `spec` (ValueError, REFUSAL_PREFIX ..., when refused); waits for the compile when
        the cache does not hold it (the core loop prepared it first: it does)."""
        import xgrammar

        return RequestGrammar(xgrammar.GrammarMatcher(self.prepare(spec).result()))

    @property
    def compiling_pids(self) -> list[int]:
        """The worker processes compiling a spec now (for metrics and tests)."""
        workers = [slot.worker for slot in self.slots]  # (read once: a slot thread may drop one meanwhile)
        return [worker.pid for worker in workers if worker is not None and worker.compiling]

    def close(self) -> None:
        """Stop the slot threads and their workers."""
        with self._lock:
            slots, self.slots = self.slots, []
        for _ in slots:
            self._jobs.put(None)
        for slot in slots:
            if slot.worker is not None:
                slot.worker.kill()

    # -- the slot threads ----------------------------------------------------------------------
    def _start_slots(self) -> None:
        while len(self.slots) < max(1, self.limits.num_workers):
            slot = _Slot()
            self.slots.append(slot)
            threading.Thread(target=self._run_slot, args=(slot,), name="grammar", daemon=True).start()

    def _run_slot(self, slot: _Slot) -> None:
        self._start_worker(slot)
        while (job := self._jobs.get()) is not None:
            try:
                compiled, num_bytes = self._compile_job(slot, job)
            except _Cancelled:
                self._finish(job, error="the request was aborted while its grammar compiled", remember=False)
            except ValueError as exc:
                self._finish(job, error=str(exc), remember=True)
            except Exception as exc:  # noqa: BLE001 - one spec's failure ends its requests, never the engine
                log.exception("compiling a structured output spec failed")
                self._finish(job, error=f"{REFUSAL_PREFIX}compiling failed: {type(exc).__name__}: {exc}")
            else:
                self._finish(job, compiled=compiled, num_bytes=num_bytes)
        slot.drop_worker()

    def _compile_job(self, slot: _Slot, job: _Job) -> tuple[xgrammar.CompiledGrammar, int]:
        compiler = self._get_compiler()
        with self._lock:
            trial_bytes = self._passed.get(job.key)
        if trial_bytes is None:
            trial_bytes = self._trial(slot, job) if self.limits.num_workers and not job.vetted else 0
            with self._lock:
                _remember(self._passed, job.key, trial_bytes)
        with self._lock:
            if job.cancelled:
                raise _Cancelled
        trim_heap()
        before = rss_bytes()
        compiled = compile_spec(compiler, job.spec)
        trim_heap()
        # other threads allocate meanwhile too: the larger of the two measures (the worker's is clean)
        return compiled, max(trial_bytes, rss_bytes() - before, compiled.memory_size_bytes)

    def _start_worker(self, slot: _Slot) -> None:
        """Every slot's worker starts with the first spec (it imports torch: seconds), so that a small spec sent
        while a large one compiles finds one ready. One killed is replaced when the next spec comes."""
        if not self.limits.num_workers:
            return
        try:
            self._get_compiler()
        except ValueError:
            return  # no tokenizer: each spec is refused with that message
        with self._lock:
            if slot.worker is None and slot in self.slots:
                slot.worker = CompileWorker(self._info_json)

    def _trial(self, slot: _Slot, job: _Job) -> int:
        """Run `job`'s trial in `slot`'s worker (started if needed): the bytes its grammar holds; ValueError
        (refused, or past the budget), _Cancelled (killed by `cancel`)."""
        with self._lock:
            if job.cancelled:
                raise _Cancelled
            if slot.worker is None:
                slot.worker = CompileWorker(self._info_json)
            job.worker = slot.worker
        timeout_s = self.limits.compile_timeout_s
        try:
            trial = slot.worker.trial(job.spec, timeout_s)
        except CompileTimeout:
            slot.drop_worker()
            raise ValueError(
                f"{REFUSAL_PREFIX}{KIND_LABELS[job.spec.kind]} did not compile within {timeout_s:g} s "
                "(--structured-output-compile-timeout-s)"
            ) from None
        except WorkerGone:
            slot.drop_worker()  # killed by cancel (or it crashed): the next job starts a new one
            if job.cancelled:
                raise _Cancelled from None
            raise ValueError(f"{REFUSAL_PREFIX}{KIND_LABELS[job.spec.kind]} crashed the compiler") from None
        finally:
            with self._lock:
                job.worker = None
        if trial.error is not None:
            raise ValueError(trial.error)
        return trial.held_bytes

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = load_tokenizer_info(self.model_dir, self.vocab_size, self.stop_token_ids)
                self._info_json = info.serialize_json()
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def _finish(self, job: _Job, compiled=None, num_bytes: int = 0, error: str | None = None, remember=False):
        """Settle `job`: cache its grammar (refused when it alone would overflow the cache) or remember its
        refusal, then answer whoever waits."""
        with self._lock:
            if self._compiling.get(job.key) is job:
                del self._compiling[job.key]
            self._job_of.pop(job.future, None)
            if error is None and num_bytes > self.cache.limit_bytes:
                error = (
                    f"{REFUSAL_PREFIX}{KIND_LABELS[job.spec.kind]} compiles to a grammar of {num_bytes >> 20} MiB, "
                    f"more than the {self.cache.limit_bytes >> 20} MiB the grammar cache may hold "
                    "(--structured-output-cache-mb)"
                )
                remember, compiled = True, None
            if error is None:
                self.cache.put(job.key, compiled, num_bytes)
            elif remember:
                _remember(self._refused, job.key, error)
        if error is None:
            job.future.set_result(compiled)
        else:
            job.future.set_exception(ValueError(error))


def _remember(verdicts: OrderedDict, key: str, value) -> None:
    verdicts[key] = value
    verdicts.move_to_end(key)
    while len(verdicts) > NUM_VERDICTS_KEPT:
        verdicts.popitem(last=False)
