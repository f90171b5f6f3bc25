"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

There are no prefill and decode phases: each request's `num_computed_tokens` catches up
to its `num_tokens` under a per-step token budget. One step, in named phases:

    1. _schedule_running   running requests (decodes take 1 token, unfinished prompts take
       and _admit          a chunk) and waiting ones admitted while budget, sequence cap and
                           blocks allow (reusing their cached prefix blocks), in one order:
                           lower shares first, a running request before a waiting one of
                           its share; at most max_num_seqs in a step. When blocks run out a
                           running request preempts, by recompute, the one of the largest
                           share (then lowest priority, then newest); an admitted one only
                           larger shares. No admission after a preemption in the step.
    3. _advance            the scheduled tokens count as computed at once, and a
                           sampling step adds a pending token (its id stays on the device)
    4. (runner executes)   then update_from_output appends the sampled tokens and finishes

Asynchronous scheduling: step N+1 is scheduled while step N still runs, so N's sampled
tokens are pending when N+1 is built (the runner feeds them to N+1 on the device) and
update_from_output(N) comes after N+1 is launched. A request that N's tokens end may thus
be in step N+1: that step's token for it is discarded, and its blocks are freed once N+1
has been read (`in_flight`), never while a step that writes them may still run. The
synchronous loop is the same code with update_from_output right after each launch.

Fair share: each request carries its caller's `share` (the caller's sequences in flight at the gateway when
it was admitted; protos PrefillRequest.share). When the engine is saturated, lower shares are admitted, ordered
and kept first, so one caller's thousand sequences cannot hold back another caller's one. The sequence cap
holds for every step, also when imports (decode role) made the running batch larger than the cap: the
sequences past it wait for a step with room. An import waiting for blocks (core_process/kv_scheduler.py)
sets `import_share`: requests of larger shares are not admitted meanwhile, and `make_room` preempts them.

Roles: "prefill" admits prompt work and parks each request as PREFILLED after its
first token, keeping its blocks until release; "decode" takes requests whose KV was
imported (they arrive with num_computed_tokens = prompt length); "both" does it all.
"""

from __future__ import annotations

import heapq
import itertools
import time

from splitserve.common.structured_output import REFUSAL_PREFIX
from splitserve.engine.grammar import GrammarDeadEnd
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager
from splitserve.engine.scheduling.output import ScheduledRequest, SchedulerOutput
from splitserve.engine.scheduling.request import Request, RequestStatus


class WaitingQueue:
    """Waiting requests, lower shares first; then FCFS (a preempted request in front) or priority (lower first,
    then arrival). The share comes before the caller-chosen priority, so no priority buys a larger share."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple] = []
        self._counter = itertools.count()
        self._removed: set[str] = set()
        self._size = 0

    def _key(self, request: Request, front: bool) -> tuple:
        order = -next(self._counter) if front else next(self._counter)
        if self.policy == "priority":
            return (request.share, request.priority, request.arrival_time, order)
        return (request.share, 0 if front else 1, order)

    def push(self, request: Request, front: bool = False) -> None:
        heapq.heappush(self._heap, (*self._key(request, front), request))
        self._size += 1

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][-1] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._removed.add(request.request_id)
        self._size -= 1

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][-1].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[-1].request_id)

    def __len__(self) -> int:
        return self._size

    def __iter__(self):
        return (e[-1] for e in sorted(self._heap) if e[-1].request_id not in self._removed)


class Scheduler:
    """Decides, each step, which requests compute how many tokens."""

    def __init__(
        self,
        kv: KvCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        role: str = "both",
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.role = role
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_launched = 0  # steps launched so far; SchedulerOutput.step_number of the latest
        self.in_flight: set[str] = set()  # request ids of the latest launched step until it is read
        self._free_when_read: list[tuple[int, list[int]]] = []  # (step number, blocks) waiting for it
        self.import_share: int | None = None  # lowest share of the imports waiting for blocks (decode role)

    # -- intake ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose KV is already in place (decode import) to the running batch."""
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """End a request wherever it is; free its blocks unless they stay held (prefill role). Blocks of a
        request in the launched step not yet read are freed when it is read (`step_read`)."""
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        request.status = status
        if free_blocks:
            if request.request_id in self.in_flight:
                blocks = self.kv.blocks_of(request.request_id)
                self.kv.pool.touch(blocks)  # our own reference until the step is read
                self._free_when_read.append((self.num_launched, blocks))
            self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def step_launched(self, out: SchedulerOutput) -> None:
        """`out` runs now; update_from_output reads it later (after the next launch, when asynchronous)."""
        self.num_launched += 1
        out.step_number = self.num_launched
        self.in_flight = {s.request.request_id for s in out.scheduled}

    def _step_read(self, out: SchedulerOutput) -> None:
        """Step `out` has ended and been read: free the blocks that waited for it (each request's tail first).
        Preempted requests free theirs at once: only the next steps reuse them, in stream order after this
        one, and a KV transfer's side stream starts after the work queued before it (kv_connectors/base.py,
        `_side_stream`)."""
        if out.step_number == self.num_launched:
            self.in_flight = set()
        waiting = []
        for step_number, blocks in self._free_when_read:
            if step_number <= out.step_number:
                self.kv.pool.free(reversed(blocks))
            else:
                waiting.append((step_number, blocks))
        self._free_when_read = waiting

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        running = sorted(self.running, key=_share)  # stable: arrival order within a share
        i, admitting = 0, True
        while budget > 0 and len(out.scheduled) < self.max_num_seqs:
            head = self._admissible_head() if admitting and not out.preempted else None
            if i < len(running) and (head is None or running[i].share <= head.share):
                budget -= self._schedule_running(running[i], budget, out, scheduled_ids)
                i += 1
            elif head is not None:
                admitted = self._admit(head, budget, out, scheduled_ids)
                admitting = admitted > 0
                budget -= admitted
            else:
                break
        self._advance(out)
        return out

    @staticmethod
    def _advance(out: SchedulerOutput) -> None:
        """The scheduled tokens count as computed now (the next step may be scheduled before this one is
        read); a sampling step adds the pending token it will produce."""
        for s in out.scheduled:
            s.request.num_computed_tokens = s.num_computed_after
            if s.samples:
                s.request.num_pending_tokens += 1

    def _needs_no_step(self, request: Request) -> bool:
        """Its pending tokens already end it (by length, or the prefill role's hand-off after the first
        token): scheduling it again would compute a token that is discarded."""
        if self.role == "prefill" and request.num_computed_tokens >= request.num_prompt_tokens:
            return True
        return request.num_pending_tokens > 0 and request.ends_by_length(self.max_model_len)

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput, scheduled_ids: set[str]) -> int:
        """Schedule a running request's next tokens; the number scheduled (0: it needs no step, or was preempted)."""
        if request.status != RequestStatus.RUNNING:
            return 0  # preempted earlier in this step
        num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
        if num_new <= 0 or (request.num_pending_tokens or self.role == "prefill") and self._needs_no_step(request):
            return 0
        while not self.kv.allocate_slots(request, num_new):
            victim = self._pick_victim(exclude=scheduled_ids)
            if victim is None or victim is request:
                self._preempt(request, out.preempted)
                return 0
            self._preempt(victim, out.preempted)
        out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
        scheduled_ids.add(request.request_id)
        return num_new

    def _pick_victim(self, exclude: set[str], above_share: int = -1) -> Request | None:
        """The running request to preempt: largest share, then lowest priority, then latest arrival; only shares
        above `above_share`."""
        candidates = [
            r
            for r in self.running
            if r.request_id not in exclude and r.share > above_share and not self._needs_no_step(r)
        ]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.share, r.priority, r.arrival_time))

    def make_room(self, num_blocks: int, share: int) -> list[Request]:
        """Preempt running requests of shares above `share` (largest first) until `num_blocks` blocks are free or
        will be once the launched step is read (its requests' blocks are freed then, never under it): an import
        of that share waits for them. Returns the preempted requests."""
        preempted: list[Request] = []
        pending = sum(len(blocks) for _, blocks in self._free_when_read)
        while self.kv.pool.num_free_blocks + pending < num_blocks:
            victim = self._pick_victim(exclude=set(), above_share=share)
            if victim is None:
                break
            if victim.request_id in self.in_flight:
                blocks = self.kv.blocks_of(victim.request_id)
                self.kv.pool.touch(blocks)  # our own reference until the step is read
                self._free_when_read.append((self.num_launched, blocks))
                pending += len(blocks)
            self._preempt(victim, preempted)
        return preempted

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)
        preempted.append(request)

    def _admissible_head(self) -> Request | None:
        """The first waiting request, if it may be admitted now."""
        request = self.waiting.peek()
        if request is None or request.num_pending_tokens or not self._has_seat(request):
            return None  # a preempted request's last token is still on the device: it is read first
        return request

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, scheduled_ids: set[str]) -> int:
        """Admit the first waiting request: the number of tokens scheduled (0: no blocks for it)."""
        # a request asking for prompt logprobs computes every prompt position: no cached prefix (as vLLM)
        reads_cache = request.num_computed_tokens == 0 and not request.needs_prompt_logprobs
        cached = self.kv.find_cached_prefix(request) if reads_cache else []
        num_computed = len(cached) * self.kv.block_size
        num_new = min(request.num_tokens - num_computed, budget)
        if not self._allocate_for_admission(request, num_new, cached, out, scheduled_ids):
            return 0
        self.waiting.pop()
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = min(num_computed, request.num_prompt_tokens)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, num_computed))
        scheduled_ids.add(request.request_id)
        return num_new

    def _has_seat(self, request: Request) -> bool:
        """Under the sequence cap counting only the running requests of its share or lower (larger shares give up
        their seats in each step), and no import of a lower share waits for the blocks it would take."""
        if self.import_share is not None and request.share > self.import_share:
            return False
        return sum(1 for r in self.running if r.share <= request.share) < self.max_num_seqs

    def _allocate_for_admission(
        self, request: Request, num_new: int, cached: list[int], out: SchedulerOutput, scheduled_ids: set[str]
    ) -> bool:
        """Blocks for a request being admitted, preempting running requests of larger shares (largest first, none
        of this step) while it is short."""
        while not self.kv.allocate_slots(request, num_new, cached):
            victim = self._pick_victim(scheduled_ids, above_share=request.share)
            if victim is None:
                return False
            self._preempt(victim, out.preempted)
        return True

    # -- after the runner ------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple[int, object]]) -> list[Request]:
        """Read a step that has ended: append its sampled tokens, register full blocks, finish requests.
        Returns the requests that got a token or finished. A request that ended (or was aborted) after
        the step was launched gets nothing: its token lies past its end and is discarded, never shown.
        A request preempted after the launch keeps its token (it was computed before the preemption)."""
        changed = []
        for s in out.scheduled:
            request = s.request
            if s.samples:
                request.num_pending_tokens -= 1
            status = request.status
            if status == RequestStatus.RUNNING:
                self.kv.cache_blocks(request, s.num_computed_after)
            elif status != RequestStatus.WAITING:
                continue  # ended after this step was launched: its token is past its end
            if request.request_id in out.prompt_logprobs:  # computed before any preemption, as the token
                request.store_prompt_logprobs(*out.prompt_logprobs[request.request_id])
            if not s.samples:
                continue
            token_id, logprobs = sampled[request.request_id]
            try:
                request.append_output(token_id, logprobs)
            except GrammarDeadEnd:  # the grammar allowed no token (the sampler had to pick a masked one): it ends alone
                request.error = (
                    f"{REFUSAL_PREFIX}the grammar allows no token after {request.num_output_tokens} output tokens "
                    "(a dead end in the spec)"
                )
                self.finish(request, RequestStatus.FINISHED_ERROR)
                changed.append(request)
                continue
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            stop = request.check_stop(self.max_model_len)
            if stop is not None:
                self.finish(request, stop)
            elif self.role == "prefill" and status == RequestStatus.RUNNING:
                self.finish(request, RequestStatus.PREFILLED, free_blocks=False)
            changed.append(request)
        self._step_read(out)
        return changed


def _share(request: Request) -> int:
    return request.share
