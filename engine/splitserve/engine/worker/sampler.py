"""Token sampler: one call per engine step, on the device that holds the logits.

Order of processing for each row (vLLM semantics):

    logits ─► structured output: tokens the row's grammar forbids -> -inf (engine/grammar.py)
    raw logits ──► logprobs (log_softmax of the raw logits, if asked)
        │
        ├─ min_tokens: EOS ids and stop_token_ids -> -inf while fewer outputs than min_tokens
        ├─ logit_bias: the request's per-token biases added
        ├─ penalties: repetition (HF, prompt + output), frequency and presence (OpenAI, output)
        ├─ greedy rows ──► argmax
        └─ other rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► exponential race

Randomness is counter-based: the uniform draw for (row, vocab id) is an integer hash of
(seed, output_position, vocab id), so a token depends only on the row's own logits, its seed
and its output position: never on the batch it runs in, the device or the process. Picking
argmax(probs / -log(u)) with u ~ U(0, 1) i.i.d. samples exactly from probs (the smallest of
independent exponentials E_i / p_i wins with probability p_i).

All per-row work is vectorized: the Python loops here only gather per-row settings into
lists that become (B,) tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from splitserve.common.logprobs import TokenLogprobs
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.grammar import TokenMask, apply_token_mask
from splitserve.engine.worker.layers import cpu_ops_for

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits.

    seed: the effective seed (params.seed, or the one the engine drew at request creation).
    output_position: index in the output of the token being sampled (0 = first token); also the
    number of outputs before it, which min_tokens counts.
    prompt_token_ids, output_token_ids: read only by penalties; the engine fills them only for
    rows with penalties, after reading their pending tokens (asynchronous scheduling), and
    leaves them empty otherwise.
    """

    params: SamplingParams
    seed: int
    output_position: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class DeviceSample:
    """One step's sampled tokens, and the logprobs asked for, still where the logits were.

    `copy_to_host` queues their copies to (pinned) host memory without waiting; `read` gives the host
    lists, after the caller has waited for those copies (an event behind them), or at once on CPU."""

    token_ids: torch.Tensor  # (S,) int64
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs
    chosen_logprobs: torch.Tensor | None = None  # (L,) raw logprob of each such row's token
    top_logprobs: torch.Tensor | None = None  # (L, n_max) the top raw logprobs, descending
    top_ids: torch.Tensor | None = None  # (L, n_max)
    num_top: list[int] = field(default_factory=list)  # n asked by each such row

    def copy_to_host(self) -> DeviceSample:
        if not self.token_ids.is_cuda:
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return DeviceSample(
            host(self.token_ids),
            self.logprob_rows,
            host(self.chosen_logprobs),
            host(self.top_logprobs),
            host(self.top_ids),
            self.num_top,
        )

    def read(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprob_rows:
            chosen_lp = self.chosen_logprobs.tolist()
            top_vals = self.top_logprobs.tolist() if self.top_logprobs is not None else [[]] * len(chosen_lp)
            top_ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(chosen_lp)
            for j, (i, n) in enumerate(zip(self.logprob_rows, self.num_top)):
                pairs = list(zip(top_ids[j][:n], top_vals[j][:n]))
                logprobs[i] = TokenLogprobs(token_ids[i], chosen_lp[j], pairs)
        return SamplerOutput(token_ids, logprobs)


# ---------------------------------------------------------------- counter-based randomness


def _mix64(x: int) -> int:
    """splitmix64 finalizer on Python ints (a bijection of [0, 2**64))."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, output_position: int) -> int:
    """64-bit key of one random draw: depends only on (seed, output_position)."""
    return _mix64(_mix64((seed + _GOLDEN64) & _M64) ^ (output_position & _M64))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, with no intermediate overflow.

    x = hi * 2**16 + lo, so x * c = lo * c + (hi * c mod 2**16) * 2**16 (mod 2**32);
    every product stays below 2**49.
    """
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection with full avalanche), on int64 tensors."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_uniform(keys: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Uniform draws in (0, 1), float32, shape (len(keys), vocab_size).

    Entry (i, v) is a function of (keys[i], v) only: the vocab id is hashed once per call
    (V work), mixed with the key's low half and hashed again (B * V work, the only full-size
    hash), then whitened with the key's high half. Values are (2m + 1) / 2**24 for the top
    23 bits m of the hash: 2m + 1 < 2**24 is exact in float32, so u is never 0 or 1.
    """
    key_halves = [[k & _M32, (k >> 32) & _M32] for k in keys]
    k = _as_tensor(key_halves, torch.int64, device)  # (B, 2)
    ops = cpu_ops_for(k, (torch.int64,))
    if ops is not None:  # the same bits in one pass: the torch path took most of a CPU decode step of 256 rows
        return ops.random_uniform_cpu(k, vocab_size)
    return random_uniform_torch(k, vocab_size)


def random_uniform_torch(key_halves: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """random_uniform in torch ops (every device; the reference of the CPU op): key_halves (B, 2) int64."""
    k = key_halves
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=k.device)  # (V,)
    vocab_hash = _fmix32(_mul32(vocab, 0x9E3779B1))  # (V,)
    h = _fmix32(vocab_hash[None, :] ^ k[:, 0:1]) ^ k[:, 1:2]  # (B, V)
    return (((h >> 9) << 1) + 1).to(torch.float32) * (2.0**-24)  # (B, V)


# ---------------------------------------------------------------- masks and penalties


def _as_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a tensor on `device`; on CUDA through pinned memory without waiting for the device
    (a plain copy from pageable memory would wait for every step queued before it)."""
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Keep, per row, the logits >= the k-th largest (ties kept); k <= 0 means off. In place."""
    vocab_size = logits.shape[-1]
    ks = [min(int(k), vocab_size) if int(k) > 0 else 0 for k in top_k]
    k_max = max(ks, default=0)
    if k_max == 0:
        return logits
    k = _as_tensor(ks, torch.int64, logits.device)  # (B,)
    values = logits.topk(k_max, dim=-1).values  # (B, k_max)
    kth = values.gather(1, (k - 1).clamp(min=0)[:, None])  # (B, 1)
    kth = kth.masked_fill((k == 0)[:, None], float("-inf"))  # rows with top-k off
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose mass reaches top_p.

    A token is kept when the probability mass of the tokens sorted before it is < top_p;
    every token as likely as the least likely kept one is kept too, so ties never depend
    on the sort order. top_p = 1 means off. In place.
    """
    p = _as_tensor(top_p, logits.dtype, logits.device)  # (B,)
    probs = logits.softmax(dim=-1)  # (B, V)
    sorted_probs = probs.sort(dim=-1, descending=True).values  # (B, V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
    num_keep = (mass_before < p[:, None]).sum(dim=-1).clamp(min=1)  # (B,)
    cutoff = sorted_probs.gather(1, (num_keep - 1)[:, None])  # (B, 1)
    mask = (probs < cutoff) & (p < 1.0)[:, None]  # (B, V)
    return logits.masked_fill_(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability. In place."""
    m = _as_tensor(min_p, logits.dtype, logits.device)  # (B,)
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = m[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """(B, V) tensor of how often each vocab id occurs in each row's ids (dtype of `like`).

    Flattens the rows into one index tensor built on the CPU, moves it once, and
    scatter-adds into a flat (B * V,) buffer.
    """
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)  # (B,)
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)  # (N,)
    flat_rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)  # (N,)
    index = (flat_rows * vocab_size + flat_ids).to(like.device)  # (N,)
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=like.dtype, device=like.device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=like.dtype))
    return counts.view(len(token_ids), vocab_size)  # (B, V)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: Sequence[float] | torch.Tensor,
    presence_penalties: Sequence[float] | torch.Tensor,
    frequency_penalties: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (HF: on tokens seen in prompt or output, logit > 0 -> /p, else *p),
    then frequency (- f * count) and presence (- p * [count > 0]) over output tokens only.
    Returns a new tensor."""
    batch, vocab_size = logits.shape
    device, dtype = logits.device, logits.dtype
    rep = _as_tensor(repetition_penalties, dtype, device)[:, None]  # (B, 1)
    presence = _as_tensor(presence_penalties, dtype, device)[:, None]  # (B, 1)
    frequency = _as_tensor(frequency_penalties, dtype, device)[:, None]  # (B, 1)
    output_counts = token_counts(output_token_ids, vocab_size, logits)  # (B, V)
    seen = (token_counts(prompt_token_ids, vocab_size, logits) > 0) | (output_counts > 0)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)  # (B, V)
    logits = torch.where(seen, penalized, logits)  # (B, V)
    logits = logits - frequency * output_counts
    return logits - presence * (output_counts > 0).to(dtype)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask EOS ids and stop_token_ids while a row has fewer outputs than min_tokens. In place."""
    vocab_size = logits.shape[-1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if params.min_tokens and row.output_position < params.min_tokens:
            ids = sorted({*row.eos_token_ids, *params.stop_token_ids})
            ids = [t for t in ids if 0 <= t < vocab_size]
            row_index.extend([i] * len(ids))
            token_index.extend(ids)
    if row_index:
        r = _as_tensor(row_index, torch.int64, logits.device)
        t = _as_tensor(token_index, torch.int64, logits.device)
        logits[r, t] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's logit_bias (token id -> bias; ids unique per row) to its logits. In place."""
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            row_index.append(i)
            token_index.append(token_id)
            biases.append(bias)
    if row_index:
        r = _index(row_index, logits.device)  # (N,)
        t = _index(token_index, logits.device)  # (N,)
        logits.index_put_((r, t), _as_tensor(biases, logits.dtype, logits.device), accumulate=True)
    return logits


# ---------------------------------------------------------------- the sampler


def plain_greedy_at(params: SamplingParams, output_position: int) -> bool:
    """Whether a row of these params at this output position takes the argmax and nothing else (min_tokens no
    longer masks its stop tokens there)."""
    return params.plain_greedy and output_position >= params.min_tokens


def _is_plain_greedy(row: SamplingRow) -> bool:
    return plain_greedy_at(row.params, row.output_position)


def _index(indices: list[int], device: torch.device) -> torch.Tensor:
    return _as_tensor(indices, torch.int64, device)


class Sampler:
    """Picks one token per row of (B, V) logits, on the logits' device.

    Stateless: everything a row needs is in its `SamplingRow`, so the same row gives the
    same token whatever else is in the batch. Works for any float dtype; the math runs in
    float64 for float64 logits and in float32 otherwise.
    """

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """Sample and read the result on the host (waits for the device)."""
        return self.sample(logits, rows, token_mask).read()

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_mask: TokenMask | None = None
    ) -> DeviceSample:
        """Sample without waiting for the device: the tokens (and logprobs) stay where the logits are.
        `token_mask`: the structured-output rows' allowed tokens, applied to the logits first (in place), so
        logprobs, greedy and sampled rows all see the grammar's distribution, as vLLM's do."""
        batch, vocab_size = logits.shape
        if batch != len(rows):
            raise ValueError(f"logits have {batch} rows but {len(rows)} sampling rows were given")
        if all(_is_plain_greedy(row) for row in rows):  # fast path: no per-row tensor work
            return self.greedy(logits, token_mask)
        logits = apply_token_mask(logits, token_mask)

        work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        work = logits.to(dtype=work_dtype, copy=True)  # (B, V)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:  # from the raw logits, before any processing
            raw_logprobs = work[_index(logprob_rows, work.device)].log_softmax(dim=-1)  # (L, V)

        apply_min_tokens(work, rows)
        apply_logit_bias(work, rows)
        penalty_rows = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if penalty_rows:
            work = self._penalize(work, rows, penalty_rows)

        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if len(random_rows) == batch:  # no greedy row: no argmax of the whole batch, no copy of its rows
            tokens = self._sample(work, rows)
        else:
            tokens = work.argmax(dim=-1)  # (B,) right for greedy rows
            if random_rows:
                index = _index(random_rows, work.device)
                tokens[index] = self._sample(work[index], [rows[i] for i in random_rows])

        if raw_logprobs is None:
            return DeviceSample(tokens)
        chosen = tokens[_index(logprob_rows, work.device)]  # (L,)
        return _with_logprobs(tokens, logprob_rows, raw_logprobs, chosen, [rows[i] for i in logprob_rows])

    @staticmethod
    def greedy(logits: torch.Tensor, token_mask: TokenMask | None = None) -> DeviceSample:
        """`sample` for rows that are all plain greedy (the caller knows, without building their SamplingRows:
        params.plain_greedy and past min_tokens): the argmax of each row, after the grammar's mask."""
        return DeviceSample(apply_token_mask(logits, token_mask).argmax(dim=-1))

    @staticmethod
    def _penalize(work: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> torch.Tensor:
        index = _index(idx, work.device)
        sub = [rows[i] for i in idx]
        work[index] = apply_penalties(
            work[index],
            [row.prompt_token_ids for row in sub],
            [row.output_token_ids for row in sub],
            [row.params.repetition_penalty for row in sub],
            [row.params.presence_penalty for row in sub],
            [row.params.frequency_penalty for row in sub],
        )
        return work

    @staticmethod
    def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race. (R, V) -> (R,)."""
        params = [row.params for row in rows]
        temperature = _as_tensor([p.temperature for p in params], logits.dtype, logits.device)
        logits = logits / temperature[:, None]  # (R, V)
        if any(p.top_k > 0 for p in params):
            apply_top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            apply_top_p(logits, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(logits, [p.min_p for p in params])
        probs = logits.softmax(dim=-1)  # (R, V)
        keys = [row_key(row.seed, row.output_position) for row in rows]
        u = random_uniform(keys, logits.shape[-1], logits.device)  # (R, V)
        exponential = -torch.log(u).to(probs.dtype)  # (R, V), > 0
        return (probs / exponential).argmax(dim=-1)  # (R,)


def _with_logprobs(
    tokens: torch.Tensor,
    logprob_rows: list[int],
    raw_logprobs: torch.Tensor,
    chosen: torch.Tensor,
    rows: Sequence[SamplingRow],
) -> DeviceSample:
    """The chosen token's raw logprob and the top-n raw logprobs of each row asking for them."""
    chosen_lp = raw_logprobs.gather(1, chosen[:, None]).squeeze(1)  # (L,)
    ns = [row.params.logprobs for row in rows]
    n_max = max(ns)
    top_values = top_ids = None
    if n_max > 0:
        top = raw_logprobs.topk(min(n_max, raw_logprobs.shape[-1]), dim=-1)  # (L, n_max)
        top_values, top_ids = top.values, top.indices
    return DeviceSample(tokens, logprob_rows, chosen_lp, top_values, top_ids, ns)
