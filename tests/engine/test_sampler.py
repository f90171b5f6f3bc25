"""Sampler: counter-based seeded sampling, masks and penalties against direct computations."""

import math

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.worker.sampler import (
    Sampler,
    SamplingRow,
    _mix64,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    random_uniform,
    random_uniform_torch,
    row_key,
)

NEG_INF = float("-inf")


def make_row(params=None, seed=0, position=0, prompt=(1, 2, 3), output=(), eos=(0,)):
    return SamplingRow(
        params=params or SamplingParams(),
        seed=seed,
        output_position=position,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=tuple(eos),
    )


def seeded_logits(batch, vocab, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype)


# ---------------------------------------------------------------- the hash


def _py_fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _py_uniform(key, vocab_id):
    vocab_hash = _py_fmix32((vocab_id * 0x9E3779B1) & 0xFFFFFFFF)
    h = _py_fmix32(vocab_hash ^ (key & 0xFFFFFFFF)) ^ (key >> 32)
    return (2 * (h >> 9) + 1) / 2**24


def test_uniform_draws_equal_a_pure_python_hash():
    """Both paths: the CPU op (random_uniform on a CPU where it is built) and the torch ops (every device)."""
    keys = [row_key(0, 0), row_key(2**63 - 1, 10**6), row_key(12345, 7)]
    u = random_uniform(keys, 1000, torch.device("cpu"))  # (3, 1000)
    halves = torch.tensor([[k & 0xFFFFFFFF, k >> 32] for k in keys], dtype=torch.int64)
    expected = [[_py_uniform(k, v) for v in range(1000)] for k in keys]
    assert u.dtype == torch.float32
    assert u.tolist() == expected
    assert random_uniform_torch(halves, 1000).tolist() == expected
    assert 0.0 < u.min().item() and u.max().item() < 1.0


def test_row_key_is_pinned():
    # Changing the key derivation changes every seeded output: this pins the contract.
    # _mix64 is splitmix64's finalizer: its first two outputs from state 0 are published.
    assert _mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert _mix64(0x3C6EF372FE94F82A) == 0x6E789E6AA1B965F4
    assert row_key(0, 0) == _mix64(0xE220A8397B1DCDAF) == 0x48218226FF3CD4BF
    assert row_key(1234, 5) != row_key(1234, 6) != row_key(1235, 5)


# ---------------------------------------------------------------- seeded sampling


def test_seeded_sampling_reproduces_across_batches_and_slots():
    logits = seeded_logits(6, 500)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    rows = [make_row(params, seed=100 + i, position=i) for i in range(6)]
    sampler = Sampler()
    full = sampler(logits, rows).token_ids
    assert full == sampler(logits.clone(), rows).token_ids  # rerun
    for i in range(6):  # each row alone
        assert sampler(logits[i : i + 1], [rows[i]]).token_ids == [full[i]]
    # reversed order, mixed with greedy and penalized rows of other requests
    others = seeded_logits(3, 500, seed=1)
    other_rows = [
        make_row(SamplingParams(temperature=0)),
        make_row(SamplingParams(temperature=1.3, top_k=5, repetition_penalty=1.5), seed=9),
        make_row(SamplingParams(min_p=0.2, logprobs=2), seed=10, position=4),
    ]
    mixed = torch.cat([others[:2], logits.flip(0), others[2:]])
    out = sampler(mixed, other_rows[:2] + rows[::-1] + other_rows[2:]).token_ids
    assert out[2:8] == full[::-1]


def test_same_seed_different_positions_differ():
    logits = torch.zeros(40, 1000)  # uniform distribution: only the draw decides
    rows = [make_row(SamplingParams(seed=7), seed=7, position=p) for p in range(40)]
    tokens = Sampler()(logits, rows).token_ids
    assert len(set(tokens)) == 40  # 40 draws from 1000 ids: all distinct for this seed
    again = Sampler()(logits, [make_row(seed=8, position=p) for p in range(40)]).token_ids
    assert sum(a == b for a, b in zip(tokens, again)) == 0


def test_pinned_tokens_for_a_seed():
    # Same (seed, position) -> same token in every process and on every device.
    logits = torch.zeros(8, 1000)
    rows = [make_row(seed=2024, position=p) for p in range(8)]
    tokens = Sampler()(logits, rows).token_ids
    assert tokens == [_py_argmin_exponential(row_key(2024, p), 1000) for p in range(8)]


def _py_argmin_exponential(key, vocab):
    # For uniform probs the race winner is the id with the largest u (smallest -log u).
    return max(range(vocab), key=lambda v: _py_uniform(key, v))


def test_exponential_race_matches_probabilities():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 20000
    logits = probs.log().expand(n, 5).contiguous()  # (n, 5)
    rows = [make_row(seed=3, position=p) for p in range(n)]
    tokens = torch.tensor(Sampler()(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=5)
    expected = probs * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 18.5  # chi-square, 4 dof, p = 0.001
    assert counts.tolist() == [7929, 6144, 2939, 2029, 959]  # deterministic


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4).contiguous()
    cold = SamplingParams(temperature=0.25)
    rows = [make_row(cold, seed=11, position=p) for p in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=4)
    p0 = torch.softmax(logits[0] / 0.25, -1)  # [0.982, 0.018, 0.0003, 0.000006]
    assert abs(counts[0].item() / 4000 - p0[0].item()) < 0.01
    assert counts[2:].sum().item() <= 4


# ---------------------------------------------------------------- masks


def ref_top_k(row, k):
    if k <= 0:
        return list(row)
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x if x >= kth else NEG_INF for x in row]


def ref_top_p(row, p):
    if p >= 1.0:
        return list(row)
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64), -1).tolist()
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    mass, kept = 0.0, []
    for i in order:
        if mass >= p:
            break
        kept.append(i)
        mass += probs[i]
    cutoff = min(probs[i] for i in kept)
    return [x if probs[i] >= cutoff else NEG_INF for i, x in enumerate(row)]


def ref_min_p(row, m):
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64), -1).tolist()
    top = max(probs)
    return [x if probs[i] >= m * top else NEG_INF for i, x in enumerate(row)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_equals_direct_computation(dtype):
    logits = seeded_logits(5, 64, seed=2, dtype=dtype)
    kth = logits[4].sort(descending=True).values[10]  # the 11th largest of row 4
    logits[4] = logits[4].clamp(min=kth)  # ids ranked 11..64 now tie at the boundary
    ks = [0, 1, 7, 64, 11]
    out = apply_top_k(logits.clone(), ks)
    assert out.tolist() == [ref_top_k(r, k) for r, k in zip(logits.tolist(), ks)]
    assert (out > NEG_INF).sum(-1).tolist() == [64, 1, 7, 64, 64]  # row 4: all tied at kth
    assert apply_top_k(logits.clone(), [-1] * 5).tolist() == logits.tolist()


def test_top_p_equals_direct_computation():
    logits = seeded_logits(6, 64, seed=3, dtype=torch.float64)
    ps = [1.0, 0.9, 0.5, 0.1, 1e-6, 0.99]
    out = apply_top_p(logits.clone(), ps)
    assert out.tolist() == [ref_top_p(r, p) for r, p in zip(logits.tolist(), ps)]
    assert (out[4] > NEG_INF).sum().item() == 1  # tiny top_p keeps exactly the argmax


def test_min_p_equals_direct_computation():
    logits = seeded_logits(4, 64, seed=4, dtype=torch.float64)
    ms = [0.0, 0.05, 0.3, 1.0]
    out = apply_min_p(logits.clone(), ms)
    assert out.tolist() == [ref_min_p(r, m) for r, m in zip(logits.tolist(), ms)]
    assert (out[3] > NEG_INF).sum().item() == 1


def test_sampled_tokens_stay_inside_the_masks():
    logits = seeded_logits(300, 50, seed=5)
    params = SamplingParams(temperature=1.5, top_k=10, top_p=0.8, min_p=0.1)
    rows = [make_row(params, seed=1, position=p) for p in range(300)]
    tokens = Sampler()(logits, rows).token_ids
    allowed = apply_min_p(apply_top_p(apply_top_k(logits / 1.5, [10] * 300), [0.8] * 300), [0.1] * 300)
    assert all(allowed[i, t].item() > NEG_INF for i, t in enumerate(tokens))


# ---------------------------------------------------------------- penalties and min_tokens


def ref_penalties(row, prompt, output, rep, presence, frequency):
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


def test_penalties_equal_a_reference_loop():
    logits = seeded_logits(3, 40, seed=6, dtype=torch.float64)
    prompts = [[1, 2, 2, 3], [], [5, 6]]
    outputs = [[3, 3, 3, 7], [8, 9, 8], []]
    rep, pres, freq = [1.3, 1.0, 0.7], [0.5, -0.25, 2.0], [0.2, 1.5, -1.0]
    out = apply_penalties(logits.clone(), prompts, outputs, rep, pres, freq)
    expected = [ref_penalties(*args) for args in zip(logits.tolist(), prompts, outputs, rep, pres, freq)]
    assert torch.allclose(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert out[0, 0].item() == logits[0, 0].item()  # unseen tokens untouched


def test_greedy_with_repetition_penalty_avoids_the_repeat():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert Sampler()(logits, [make_row(params, prompt=[1], eos=())]).token_ids == [2]
    assert Sampler()(logits, [make_row(params, prompt=[], eos=())]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0]])  # eos = 0, stop id = 2
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler()
    # the outputs before the sampled token are counted by its position (pending ones have no id on the host)
    assert sampler(logits, [make_row(params, position=1, output=[4], eos=(0,))]).token_ids == [3]
    assert sampler(logits, [make_row(params, position=1, output=[], eos=(0,))]).token_ids == [3]
    assert sampler(logits, [make_row(params, position=2, output=[4, 4], eos=(0,))]).token_ids == [0]
    ignore = SamplingParams(temperature=0, ignore_eos=True)  # ignore_eos alone masks nothing
    assert sampler(logits, [make_row(ignore, eos=(0,))]).token_ids == [0]
    seeded = SamplingParams(min_tokens=3, stop_token_ids=[2])
    rows = [make_row(seeded, seed=s, position=1, output=[4], eos=(0, 1)) for s in range(200)]
    tokens = sampler(logits.expand(200, 5), rows).token_ids
    assert set(tokens) == {3, 4}


# ---------------------------------------------------------------- greedy and logprobs


def test_greedy_fast_path_equals_argmax():
    logits = seeded_logits(16, 300, seed=7, dtype=torch.bfloat16)
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(16)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_logprobs_equal_log_softmax_of_raw_logits():
    logits = seeded_logits(3, 100, seed=8)
    params = [
        SamplingParams(temperature=0, logprobs=5, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, logprobs=0, seed=1),
        SamplingParams(temperature=0),
    ]
    rows = [make_row(p, seed=1, prompt=range(50)) for p in params]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)  # raw: before penalties and temperature
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == ref[0, out.token_ids[0]].item()
    top = ref[0].topk(5)
    assert first.top == list(zip(top.indices.tolist(), top.values.tolist()))
    second = out.logprobs[1]
    assert (second.token_id, second.logprob, second.top) == (out.token_ids[1], ref[1, out.token_ids[1]].item(), [])
    assert out.logprobs[2] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype(dtype):
    logits = seeded_logits(4, 64, seed=9).to(dtype)
    rows = [make_row(SamplingParams(top_k=8), seed=5, position=p) for p in range(4)]
    as_float32 = Sampler()(logits.float(), rows).token_ids
    assert Sampler()(logits, rows).token_ids == as_float32
    assert logits.dtype == dtype  # the caller's logits are not modified or cast


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logits have 2 rows but 1 sampling rows were given"):
        Sampler()(torch.zeros(2, 4), [make_row()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    logits = seeded_logits(64, 5000, seed=10)
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0),
    ]
    rows = [make_row(params[i % 2], seed=i, position=3 * i, prompt=range(i)) for i in range(64)]
    cpu = Sampler()(logits, rows).token_ids
    assert Sampler()(logits.cuda(), rows).token_ids == cpu
    assert torch.equal(
        random_uniform([1, 2**64 - 1], 5000, torch.device("cuda")).cpu(),
        random_uniform([1, 2**64 - 1], 5000, torch.device("cpu")),
    )


def test_math_reference_for_uniform_range():
    assert _py_uniform(0, 0) > 0 and _py_uniform(0, 0) < 1
    assert math.isclose(sum(_py_uniform(row_key(1, 1), v) for v in range(20000)) / 20000, 0.5, abs_tol=0.01)


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_adds_to_each_rows_own_tokens():
    logits = torch.zeros(2, 6)
    rows = [make_row(SamplingParams(logit_bias={1: 2.5, 4: -1})), make_row(SamplingParams(logit_bias={0: 3}))]
    apply_logit_bias(logits, rows)
    assert logits.tolist() == [[0, 2.5, 0, 0, -1, 0], [3, 0, 0, 0, 0, 0]]


def test_plus_100_forces_a_token_and_minus_100_bans_one():
    logits = seeded_logits(3, 50, seed=4)
    greedy = logits.argmax(dim=-1).tolist()
    top2 = logits.topk(2, dim=-1).indices[:, 1].tolist()
    rows = [
        make_row(SamplingParams(temperature=0, logit_bias={17: 100})),  # forced: 17 however unlikely
        make_row(SamplingParams(temperature=0, logit_bias={greedy[1]: -100})),  # banned: the runner-up wins
        make_row(SamplingParams(temperature=0.8, logit_bias={33: 100}), seed=5),  # sampled, still forced
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == [17, top2[1], 33]
    assert greedy[0] != 17 and greedy[2] != 33  # the bias, not the logits, chose them
