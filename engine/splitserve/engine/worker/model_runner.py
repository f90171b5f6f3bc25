"""The model runner: the one place that builds device inputs, runs the model and samples.

From a SchedulerOutput it builds, as flat lists on the host and then a device tensor each (views of two
pinned copies, one per dtype, each view 16-byte aligned):

    input_ids      (T,)     tokens computed this step, request after request
    positions      (T,)     their positions in their sequences
    slot_mapping   (T,)     block_id * block_size + offset of each token's KV slot
    query_start_loc (B+1,)  where each request's tokens start in the flat batch
    seq_lens       (B,)     context length after the step
    block_tables   (B, M)   each request's block ids, padded with 0

The model reads them; nothing else builds device inputs.

A step is launched without waiting for the device (`launch`): its sampled tokens stay on the
device, their copy to pinned host memory is queued behind them with an event, and
`LaunchedStep.read` waits for that event. A token the host has not read yet (a pending one,
asynchronous scheduling) is the input of its request's next one-token step: that input is
taken on the device from the previous launch's sampled tokens.

Tensor parallel (`tp_workers`): this runner is rank 0's. It sends each step's inputs (and the block
copies since the last step) to the other ranks before its forward (worker/tp_worker.py), which run the
same forward and logits calls; only rank 0 samples. A rank that exited raises `TensorParallelError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.engine.grammar import build_token_mask
from splitserve.engine.scheduling.output import SchedulerOutput
from splitserve.engine.scheduling.request import Request
from splitserve.engine.worker.attention import AttentionMetadata
from splitserve.engine.worker.prompt_logprobs import PromptRows, compute_prompt_logprobs, prompt_rows
from splitserve.engine.worker.sampler import DeviceSample, Sampler, SamplingRow, plain_greedy_at
from splitserve.engine.worker.tp_worker import TpStep, TpWorkers, copy_blocks


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows of the hidden states to sample from
    sampling_requests: list[Request]  # one per row of logits_indices
    prompt_rows: list[PromptRows] = field(default_factory=list)  # rows whose prompt logprobs were asked for

    @property
    def sampling_request_ids(self) -> list[str]:
        return [request.request_id for request in self.sampling_requests]


@dataclass
class LaunchedStep:
    """A launched step's sampled tokens on their way to the host."""

    request_ids: list[str]  # one per sampled row
    sample: DeviceSample | None  # host copies on CUDA (filled when `done` has passed)
    done: torch.cuda.Event | None = None

    def read(self) -> dict[str, tuple[int, object]]:
        """request_id -> (sampled token id, logprobs or None); waits for the step to end."""
        if self.sample is None:
            return {}
        if self.done is not None:
            self.done.synchronize()
        result = self.sample.read()
        return dict(zip(self.request_ids, zip(result.token_ids, result.logprobs)))


class BlockTableRows:
    """Each request's block ids kept in a row of one host array, copied in as its block list grows.

    A request's list (KvCacheManager.req_blocks) only grows while the request holds it, and is a new
    list once freed and allocated again (preemption), so a row is refilled when the list is not the one
    it was filled from. Rows of requests absent from a step are taken back when rows run out; entries
    past a request's blocks are 0.
    """

    def __init__(self, num_rows: int = 64, num_cols: int = 64) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self._rows: dict[str, tuple[list[int], int, int]] = {}  # request_id -> (its list, row, blocks copied)
        self._free = list(range(num_rows - 1, -1, -1))
        self._step_ids: set[str] = set()

    def start_step(self) -> None:
        self._step_ids = set()

    def row_of(self, request_id: str, blocks: list[int]) -> int:
        self._step_ids.add(request_id)
        entry = self._rows.get(request_id)
        if entry is not None and entry[0] is blocks:
            _, row, num_copied = entry
        else:
            row = entry[1] if entry is not None else self._take_row()
            self.table[row] = 0  # a new request, or a new list (its blocks allocated again after preemption)
            num_copied = 0
        if len(blocks) > num_copied:
            if len(blocks) > self.table.shape[1]:
                self._grow(cols=2 * len(blocks))
            self.table[row, num_copied : len(blocks)] = blocks[num_copied:]
        if num_copied != len(blocks) or entry is None or entry[0] is not blocks:
            self._rows[request_id] = (blocks, row, len(blocks))
        return row

    def _take_row(self) -> int:
        if not self._free:  # take back the rows of requests not in this step; grow if that is not enough
            for request_id in [r for r in self._rows if r not in self._step_ids]:
                self._free.append(self._rows.pop(request_id)[1])
        if not self._free:
            rows = self.table.shape[0]
            self._grow(rows=2 * rows)
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old = self.table
        self.table = np.zeros((rows or old.shape[0], cols or old.shape[1]), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old


def _output_position(request: Request) -> int:
    """The output position of the token a request samples next (pending tokens counted in)."""
    return request.num_output_tokens + request.num_pending_tokens - 1


def samples_plain_greedy(request: Request) -> bool:
    """Whether the sampler's row for this request would be plain greedy (Sampler.greedy takes it), decided
    without building the row: most steps of most workloads are, and a row costs microseconds of host time."""
    return plain_greedy_at(request.sampling_params, _output_position(request))


def sampling_row(request: Request) -> SamplingRow:
    """The sampler's view of a request at the token it samples next (pending tokens counted in)."""
    params = request.sampling_params
    penalized = params.has_penalties  # only penalties read the ids (the engine reads pending ones first)
    return SamplingRow(
        params=params,
        seed=request.seed,
        output_position=_output_position(request),
        prompt_token_ids=request.prompt_token_ids if penalized else (),
        output_token_ids=request.output_token_ids if penalized else (),
        eos_token_ids=request.eos_token_ids,
    )


class ModelRunner:
    """Owns the model, the KV cache tensor and the device buffers of one worker."""

    # a decode-only step's rows in order of context length, longest first: the decode attention's programs start
    # in row order, so the longest start first and the short fill in behind them (docs/performance.md, "Findings
    # that set defaults": decode rows longest first)
    LONGEST_FIRST = True

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        tp_workers: TpWorkers | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.graphs = None  # cuda_graphs.DecodeGraphs once captured
        self.pin = device.type == "cuda"
        # the latest launch's sampled tokens (S,) and each sampled request's row in them
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.tables = BlockTableRows()
        self.tp_workers = tp_workers
        self._tp_copies: list[tuple[int, int]] = []  # block copies the other ranks make before the next step

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst here now, and on the other ranks before their next step."""
        copy_blocks(self.kv_cache, pairs)
        if self.tp_workers is not None:
            self._tp_copies += pairs

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode graphs for bucketed batch sizes (CUDA only)."""
        from splitserve.engine.worker.cuda_graphs import DecodeGraphs

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, max_num_seqs, max_blocks)
        self.graphs.capture()

    @torch.inference_mode()
    def warm_up_kernels(self, max_num_batched_tokens: int, max_model_len: int) -> None:
        """Compile before serving the kernel variants a step or a KV pull picks by its shape (the engine calls it on
        CUDA with one rank): a forward of one sequence per row-tile class of the paged prefill kernel (a step's
        longest query picks it), once as a fresh prompt (the fresh-prompt kernel) and once after a cached block
        (paged prefill), with no key or value written (slots < 0) and the output dropped; and the block copy of a
        pull of many runs, block 0 onto itself. Compiled at a step's first need instead, each class stopped every
        running stream for 1-2 s on an H100."""
        from splitserve.kernels.block_copy import copy_blocks_by_index
        from splitserve.kernels.paged_prefill_attention import PREFILL_TILE_QUERY_LENS

        bs = self.block_size
        for query_len in PREFILL_TILE_QUERY_LENS:
            for cached in (0, bs):
                seq_len = cached + query_len
                if query_len > max_num_batched_tokens or seq_len > max_model_len:
                    continue
                meta = AttentionMetadata(
                    query_start_loc=self._to_device([0, query_len], torch.int32),
                    seq_lens=self._to_device([seq_len], torch.int32),
                    block_tables=torch.zeros((1, -(-seq_len // bs)), dtype=torch.int32, device=self.device),
                    slot_mapping=torch.full((query_len,), -1, dtype=torch.int64, device=self.device),
                    max_query_len=query_len,
                    max_seq_len=seq_len,
                    query_start_loc_cpu=[0, query_len],
                    seq_lens_cpu=[seq_len],
                )
                input_ids = torch.zeros(query_len, dtype=torch.int64, device=self.device)
                positions = torch.arange(cached, seq_len, dtype=torch.int64, device=self.device)
                self.model(input_ids, positions, self.kv_cache, meta)
        copy_blocks_by_index(self.kv_cache, [0], self.kv_cache, [0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list → device tensor through pinned memory (asynchronous on CUDA)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.pin)
        return host.to(self.device, non_blocking=True)

    def _table_to_device(self, rows: list[int], width: int) -> torch.Tensor:
        """The step's block tables, rows of `self.tables`, → one (B, width) int32 device tensor padded with 0:
        one gather into pinned memory (filling a fresh table row by row from the lists cost more host time:
        docs/performance.md, "Findings that set defaults": host step)."""
        host = torch.empty((len(rows), width), dtype=torch.int32, pin_memory=self.pin)
        np.take(self.tables.table[:, :width], rows, axis=0, out=host.numpy())
        return host.to(self.device, non_blocking=True)

    def _lists_to_device(self, lists: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Host lists -> device tensors (views of one), in one pinned buffer and one copy: a step's handful of
        small copies cost more host time one by one than the values take to join. Each view starts at a
        16-byte boundary, as a tensor of its own would (Triton compiles a kernel per pointer alignment)."""
        unit = 16 // torch.empty((), dtype=dtype).element_size()
        joined: list[int] = []
        starts = []
        for values in lists:
            starts.append(len(joined))
            joined += values
            joined += [0] * (-len(values) % unit)
        device = self._to_device(joined, dtype)
        return [device[start : start + len(values)] for start, values in zip(starts, lists)]

    def prepare_inputs(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepInputs:
        bs = self.block_size
        self.tables.start_step()
        row_of = self.tables.row_of
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        table_rows: list[int] = []
        width = 0
        max_query_len = 0
        logits_indices: list[int] = []
        sampling_requests: list[Request] = []
        pending_dst: list[int] = []  # rows of input_ids whose token is still on the device ...
        pending_src: list[int] = []  # ... and its row in the latest launch's sampled tokens
        wanted: list[PromptRows] = []
        scheduled = out.scheduled
        if self.LONGEST_FIRST and all(s.num_new_tokens == 1 for s in scheduled):
            scheduled = sorted(scheduled, key=lambda s: -s.num_computed_tokens)
        total = 0  # tokens so far: qsl[-1]
        for s in scheduled:  # per row per step: kept to plain local operations (host time at batch 256)
            request = s.request
            request_id = request.request_id
            start = s.num_computed_tokens
            num_new = s.num_new_tokens
            end = start + num_new
            blocks = block_tables[request_id]
            if num_new == 1:  # a decode step: one token
                token_ids = request.token_ids
                if start < len(token_ids):
                    input_ids.append(token_ids[start])
                else:  # pending: sampled by the latest launch, not read yet
                    pending_dst.append(total)
                    pending_src.append(self._last_rows[request_id])
                    input_ids.append(0)
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                input_ids.extend(request.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if request.sampling_params.prompt_logprobs is not None:  # the cheap test first: rarely asked for
                rows = prompt_rows(request, start, end, total)
                if rows is not None:
                    wanted.append(rows)
            total += num_new
            qsl.append(total)
            seq_lens.append(end)
            table_rows.append(row_of(request_id, blocks))
            if len(blocks) > width:
                width = len(blocks)
            if num_new > max_query_len:
                max_query_len = num_new
            if s.samples:
                logits_indices.append(total - 1)
                sampling_requests.append(request)
        query_start_loc, seq_lens_device = self._lists_to_device([qsl, seq_lens], torch.int32)
        input_ids_device, positions_device, slot_mapping, logits_device, dst, src = self._lists_to_device(
            [input_ids, positions, slots, logits_indices, pending_dst, pending_src], torch.int64
        )
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_device,
            block_tables=self._table_to_device(table_rows, width),
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        if pending_dst:
            input_ids_device.index_copy_(0, dst, self._last_tokens.index_select(0, src))
        return StepInputs(
            input_ids=input_ids_device,
            positions=positions_device,
            meta=meta,
            logits_indices=logits_device,
            sampling_requests=sampling_requests,
            prompt_rows=wanted,
        )

    def _send_step(self, inputs: StepInputs) -> None:
        """Tensor parallel: the step's inputs (host copies) to the other ranks, before rank 0's forward."""
        dead = self.tp_workers.dead_rank()
        if dead is not None:
            raise dead
        cpu = torch.device("cpu")
        step = TpStep(
            input_ids=inputs.input_ids,
            positions=inputs.positions,
            meta=inputs.meta,
            logits_indices=inputs.logits_indices if inputs.sampling_requests else None,
            prompt_rows=inputs.prompt_rows,
            block_copies=self._tp_copies,
        )
        self._tp_copies = []
        self.tp_workers.send_step(step if self.device.type == "cpu" else step.to(cpu))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> LaunchedStep:
        """Queue one step (inputs, model, sampler, the tokens' copy to the host) without waiting for the device."""
        inputs = self.prepare_inputs(out, block_tables)
        if self.tp_workers is None:
            return self._launch(out, inputs)
        self._send_step(inputs)
        with self.tp_workers.guard():
            return self._launch(out, inputs)

    def _launch(self, out: SchedulerOutput, inputs: StepInputs) -> LaunchedStep:
        meta = inputs.meta
        if self.graphs is not None and meta.is_decode_only and self.graphs.bucket_for(meta.num_seqs) is not None:
            hidden = self.graphs.run(
                inputs.input_ids, inputs.positions, meta.slot_mapping, meta.seq_lens, meta.block_tables
            )  # (T, H)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, meta)  # (T, H)
        if inputs.prompt_rows:
            out.prompt_logprobs.update(compute_prompt_logprobs(self.model.compute_logits, hidden, inputs.prompt_rows))
        requests = inputs.sampling_requests
        if not requests:
            self._last_tokens, self._last_rows = None, {}
            return LaunchedStep([], None)
        request_ids = inputs.sampling_request_ids
        # structured output: the host fills the grammar rows' bitmask now, while the device runs the model
        # (a request with a grammar is read before its next step is launched: its matcher is up to date)
        grammars = [(i, request.grammar) for i, request in enumerate(requests) if request.grammar is not None]
        token_mask = (
            build_token_mask(grammars, self.model.config.vocab_size, self.device, self.pin) if grammars else None
        )
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # (S, V)
        if all(samples_plain_greedy(request) for request in requests):
            sample = self.sampler.greedy(logits, token_mask)
        else:
            sample = self.sampler.sample(logits, [sampling_row(request) for request in requests], token_mask)
        self._last_tokens = sample.token_ids
        self._last_rows = {request_id: i for i, request_id in enumerate(request_ids)}
        if not sample.token_ids.is_cuda:
            return LaunchedStep(request_ids, sample)
        host = sample.copy_to_host()
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(request_ids, host, done)
