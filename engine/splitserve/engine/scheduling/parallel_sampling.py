"""Parallel sampling (OpenAI's n, best_of): several sequences of one prompt, its KV computed once.

A request with fork ids is the parent (sequence 0); each fork id is a child sequence (seed =
the parent's seed + its index, as vLLM derives them). Children wait here until the parent's
prompt KV is complete (its prefill step ran, or its import committed); then each child takes
the parent's KV of the prompt's first P-1 tokens and computes token P-1 itself, so its first
token is sampled from that position's logits with its own seed:

    parent blocks:  [ b0 full | b1 full | b2: tokens 8..P-1, later the parent's own outputs ]
    child blocks:   [ b0 (+1 ref) | b1 (+1 ref) | copy of b2 ]   num_computed_tokens = P-1
                                                ^ copy-on-write: the child rewrites P-1 and goes on

Full blocks are shared by reference count (scheduling/block_pool.py), the partial last block is
copied on the device before any sequence writes past the prompt. A parent aborted before its
prompt KV exists leaves its children to compute their prompts themselves (the prefix cache still
shares what it can); so does a child whose copy finds no free block. A parent whose pulled KV
failed under kv_load_failure_policy fail ends its children with it (`drop_children`): the policy
says the decode does not prefill that prompt, for any of its sequences.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.engine.scheduling.block_pool import NoFreeBlocksError
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager
from splitserve.engine.scheduling.output import SchedulerOutput
from splitserve.engine.scheduling.request import Request
from splitserve.engine.scheduling.scheduler import Scheduler


class ParallelSampling:
    """Children waiting for their parent's prompt KV, and the fork that hands it to them."""

    def __init__(
        self, kv: KvCacheManager, scheduler: Scheduler, copy_blocks: Callable[[list[tuple[int, int]]], None]
    ) -> None:
        """`copy_blocks(pairs)` copies whole KV blocks src -> dst (the runner's, on every rank)."""
        self._kv = kv
        self._scheduler = scheduler
        self._copy_blocks = copy_blocks
        self._children: dict[str, list[Request]] = {}  # parent id -> children not forked yet
        self._parent_of: dict[str, str] = {}  # child id -> parent id, while waiting

    def expect(self, parent: Request, children: list[Request]) -> None:
        """`children` fork from `parent` once its prompt KV is complete."""
        if children:
            self._children[parent.request_id] = children
            for child in children:
                self._parent_of[child.request_id] = parent.request_id

    def waiting(self, request_id: str) -> bool:
        """True for a child that has not forked yet."""
        return request_id in self._parent_of

    def on_step(self, out: SchedulerOutput) -> None:
        """After the forward pass, before its outputs are applied (a parent may finish then and free
        its blocks): fork the children of every parent whose prompt KV this step completed."""
        if not self._children:
            return
        for s in out.scheduled:
            parent = s.request
            if parent.request_id in self._children and s.num_computed_tokens + s.num_new_tokens >= len(
                parent.prompt_token_ids
            ):
                self.fork(parent)

    def fork(self, parent: Request) -> None:
        """Give each waiting child of `parent` its prompt KV (see the module docstring) and run it."""
        children = self._children.pop(parent.request_id, [])
        num_tokens = len(parent.prompt_token_ids) - 1
        copies = []
        for child in children:
            del self._parent_of[child.request_id]
            try:
                copy = self._kv.fork(parent.request_id, child.request_id, num_tokens)
            except NoFreeBlocksError:  # no block for the copy: the child computes its prompt itself
                self._scheduler.add(child)
                continue
            if copy is not None:
                copies.append(copy)
            child.num_computed_tokens = num_tokens
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
            child.first_scheduled_time = parent.first_scheduled_time
            self._scheduler.add_running(child)
        if copies:
            self._copy_blocks(copies)

    def release(self, parent_id: str) -> None:
        """The parent ended before its prompt KV existed: its children compute their prompts themselves."""
        for child in self._children.pop(parent_id, []):
            del self._parent_of[child.request_id]
            self._scheduler.add(child)

    def drop_children(self, parent_id: str) -> list[str]:
        """Forget the children of `parent_id` not forked yet (they end with it); their ids."""
        children = self._children.pop(parent_id, [])
        for child in children:
            del self._parent_of[child.request_id]
        return [child.request_id for child in children]

    def drop(self, child_id: str) -> bool:
        """Forget a waiting child (aborted); False if `child_id` is none."""
        parent_id = self._parent_of.pop(child_id, None)
        if parent_id is None:
            return False
        self._children[parent_id] = [c for c in self._children[parent_id] if c.request_id != child_id]
        return True

    @property
    def num_waiting(self) -> int:
        return len(self._parent_of)
