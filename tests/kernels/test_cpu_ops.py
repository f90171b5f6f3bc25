"""The CPU C++ ops against torch references: paged decode attention (fp32, fp64, GQA, ragged),
RMSNorm(+residual), rotary, SiLU-mul, KV write, the sampler's counter-based uniforms."""

import pytest
import torch

from splitserve.kernels import cpu_ops


def dense_reference(q, k_cache, v_cache, tables, seq_lens, scale):
    """float64 attention over each sequence's gathered context (zeros for an empty one)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = k_cache[tables[b].long()].reshape(-1, *k_cache.shape[2:])[:n].double()  # (n, Hkv, D)
        v = v_cache[tables[b].long()].reshape(-1, *v_cache.shape[2:])[:n].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, Hq, D)
        probs = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


ISAS = ("generic", "avx2", "avx512")  # narrowest first


def runnable_isas() -> list[str]:
    """Every build this CPU can run: the AVX2 and plain-loop builds also on an AVX-512 machine."""
    return list(ISAS[: ISAS.index(cpu_ops.cpu_isa()) + 1])


@pytest.fixture(scope="module", params=runnable_isas())
def op(request):
    """Each build this CPU runs, installed as the module's active one for the tests using it."""
    module = cpu_ops.build_isa(request.param)
    assert module is not None, "the C++ op did not build (needs g++ and ninja; see scripts/install.sh)"
    # a build's vector path follows its -march: the plain one compiles no intrinsics on any x86 CPU
    assert module.isa() == request.param
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_ops, "_module", module)
        patch.setattr(cpu_ops, "_tried", True)
        yield module


@pytest.mark.parametrize(
    "capability, isa",
    [("AVX512", "avx512"), ("AVX2", "avx2"), ("DEFAULT", "generic"), ("SVE256", "generic")],
)
def test_the_build_follows_torchs_cpu_capability(monkeypatch, capability, isa):
    """Any machine checks the choice an AVX-512 one makes: the build AVX-512 CPUs always had (-march=native),
    and the narrower builds reachable through the override."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.delenv("SPLITSERVE_CPU_ISA", raising=False)
    assert (cpu_ops.cpu_isa(), cpu_ops.chosen_isa()) == (isa, isa)
    for narrower in ISAS[: ISAS.index(isa)]:
        monkeypatch.setenv("SPLITSERVE_CPU_ISA", narrower)
        assert cpu_ops.chosen_isa() == narrower
    assert cpu_ops.ISA_CFLAGS["avx512"] == ("-O3", "-march=native", "-fopenmp")  # the pre-AVX2 build's flags


def test_isa_choice_follows_the_cpu_and_the_override(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_CPU_ISA", raising=False)
    assert cpu_ops.chosen_isa() == cpu_ops.cpu_isa()
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "generic")
    assert cpu_ops.chosen_isa() == "generic"
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA='sse9': choose one of auto, avx512, avx2, generic"):
        cpu_ops.chosen_isa()
    if cpu_ops.cpu_isa() != "avx512":
        monkeypatch.setenv("SPLITSERVE_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match=f"this CPU runs at most {cpu_ops.cpu_isa()}"):
            cpu_ops.chosen_isa()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])  # 32/64/128: the float32 vector path; 24: generic
def test_matches_reference(op, dtype, tol, num_q_heads, num_kv_heads, block_size, head_dim):
    torch.manual_seed(0)
    num_blocks, layers = 64, 3
    kv = torch.randn(num_blocks, layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype)  # block-major
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    seq_lens = torch.tensor([1, block_size + 3, 5 * block_size, 2, 0], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:6] for _ in seq_lens]).int()
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype)
    got = cpu_ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, 0.3)
    want = dense_reference(q, k_cache, v_cache, tables, seq_lens, 0.3)
    assert torch.allclose(got.double(), want, atol=tol, rtol=0)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # seq_len 0 -> zeros


@pytest.mark.parametrize("batch", [2, 64])  # few sequences: a task per KV head; many: a task per sequence
def test_long_contexts_and_task_splits(op, batch):
    """Contexts of many blocks (online softmax across blocks, prefetch past the last block), a large
    score range (exp of very negative differences), every length modulo the block size."""
    torch.manual_seed(1)
    block_size, num_q_heads, num_kv_heads, head_dim = 16, 8, 2, 64
    max_blocks = 40
    kv = torch.randn(batch * max_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    seq_lens = torch.tensor([(17 * b) % (max_blocks * block_size) + 1 for b in range(batch)], dtype=torch.int32)
    tables = torch.randperm(batch * max_blocks).view(batch, max_blocks).int()
    q = torch.randn(batch, num_q_heads, head_dim) * 4  # scores spread over ~+-100
    got = cpu_ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, 0.125)
    want = dense_reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [4, 7, 16])
def test_more_query_heads_than_rows_ahead(op, block_size):
    """A task per sequence with more query heads than a block has rows: the rows of the blocks ahead are
    requested a few before each head's pass, so some heads request none, and the last block ahead is
    partial or past the end (contexts of every length modulo the block size, a table ending where the
    context does)."""
    torch.manual_seed(2)
    batch, num_q_heads, num_kv_heads, head_dim = 16, 8, 4, 64
    seq_lens = torch.tensor([1 + 5 * b for b in range(batch)], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    kv = torch.randn(batch * max_blocks, 3, 2, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = kv[:, 2, 0], kv[:, 2, 1]
    tables = torch.randperm(batch * max_blocks).view(batch, max_blocks).int()
    q = torch.randn(batch, num_q_heads, head_dim)
    got = cpu_ops.paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, 0.125)
    want = dense_reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert torch.allclose(got.double(), want, atol=2e-6, rtol=0)


# ---- elementwise ops (float32) -------------------------------------------------------------------


def test_rms_norm_matches_torch(op):
    from splitserve.kernels.rmsnorm import rms_norm_ref

    torch.manual_seed(2)
    for rows, hidden in [(1, 512), (7, 100), (300, 256)]:  # 100: a tail shorter than one vector
        x, residual, weight = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
        want_out, want_res = rms_norm_ref(x, weight, 1e-6, residual)
        out, res = cpu_ops.rms_norm_cpu(x, weight, 1e-6, residual)
        assert torch.equal(res, want_res)  # the add is exact
        assert torch.allclose(out, want_out, atol=2e-6, rtol=1e-5)
        assert torch.allclose(
            cpu_ops.rms_norm_cpu(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), atol=2e-6, rtol=1e-5
        )
    x3 = torch.randn(2, 3, 64)  # leading dims are flattened and restored
    assert cpu_ops.rms_norm_cpu(x3, torch.ones(64), 1e-6).shape == (2, 3, 64)


def test_rotary_matches_torch_in_place(op):
    from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding

    torch.manual_seed(3)
    num_tokens, hq, hkv, d = 9, 8, 2, 64
    cache = build_cos_sin_cache(d, 4096, 10000.0, None, torch.float32)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d)  # q and k are strided views of one fused row
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(num_tokens, hq, d), k.view(num_tokens, hkv, d)
    positions = torch.tensor([0, 1, 5, 17, 100, 2047, 3, 3, 4095])
    want_q, want_k = q.clone(), k.clone()
    rotary_embedding(positions, want_q, want_k, cache, impl="ref")
    cpu_ops.rotary_cpu(positions, q, k, cache)
    assert torch.allclose(q, want_q, atol=1e-5, rtol=0) and torch.allclose(k, want_k, atol=1e-5, rtol=0)


def test_silu_and_mul_matches_torch(op):
    torch.manual_seed(4)
    for rows, ffn in [(1, 1408), (5, 40), (64, 17)]:  # 40 and 17: partial vectors
        x = torch.randn(rows, 2 * ffn) * 6  # silu over a wide range (exp of large |x|)
        x[0, 0], x[0, 1] = -100.0, 100.0
        want = torch.nn.functional.silu(x[:, :ffn]) * x[:, ffn:]
        assert torch.allclose(cpu_ops.silu_and_mul_cpu(x), want, atol=1e-5, rtol=1e-5)


def test_write_kv_scatters_and_skips_padding(op):
    torch.manual_seed(5)
    blocks, bs, hkv, d = 6, 4, 2, 8
    kv = torch.zeros(blocks, 3, 2, bs, hkv, d)  # block-major, layer 1
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    fused = torch.randn(5, 3 * hkv * d)  # key/value are strided views of a fused row
    key = fused[:, hkv * d : 2 * hkv * d].view(5, hkv, d)
    value = fused[:, 2 * hkv * d :].view(5, hkv, d)
    slots = torch.tensor([0, 7, -1, 23, 9])
    cpu_ops.write_kv_cpu(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // bs, slot % bs], key[t])
            assert torch.equal(v_cache[slot // bs, slot % bs], value[t])
    written = {0, 7, 23, 9}
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert all(k_cache[s // bs, s % bs].abs().sum() == 0 for s in untouched)
    assert kv[:, 0].abs().sum() == 0 and kv[:, 2].abs().sum() == 0  # other layers untouched


def test_bad_block_tables_and_slots_are_refused_not_read(op):
    """A block id or slot outside the pool raises (naming it) instead of touching memory past the pool."""
    kv = torch.zeros(4, 1, 2, 4, 2, 8)  # 4 blocks of 4 tokens
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    q = torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="sequence 0 block 1 is 9; the pool has blocks 0..3"):
        cpu_ops.paged_decode_attention_cpu(q, k_cache, v_cache, torch.tensor([[0, 9]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="sequence 0 has length 9; its block table holds at most 8 tokens"):
        cpu_ops.paged_decode_attention_cpu(q, k_cache, v_cache, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)
    key = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="write_kv: slot 16 is past the pool's 16 slots"):
        cpu_ops.write_kv_cpu(key, key, k_cache, v_cache, torch.tensor([16]))
    assert kv.abs().sum() == 0


@pytest.mark.parametrize("batch, vocab", [(1, 1), (3, 7), (5, 8192), (2, 151_936)])
def test_random_uniform_equals_the_samplers_torch_path_bit_for_bit(op, batch, vocab):
    """Every seeded token depends on these bits (prefill and decode, CPU and CUDA must agree): each build's
    vectorized loop gives exactly the torch path's uniforms, for keys at both ends of the 64-bit range."""
    from splitserve.engine.worker.sampler import random_uniform_torch

    gen = torch.Generator().manual_seed(batch * vocab)
    halves = torch.randint(0, 2**32, (batch, 2), generator=gen, dtype=torch.int64)
    halves[0] = torch.tensor([0, 0]) if batch == 1 else torch.tensor([2**32 - 1, 2**32 - 1])
    got = cpu_ops.random_uniform_cpu(halves, vocab)
    assert got.dtype == torch.float32 and got.shape == (batch, vocab)
    assert torch.equal(got, random_uniform_torch(halves, vocab))


@pytest.mark.slow
def test_a_built_library_loads_even_with_a_leftover_build_lock(op):
    """torch's builder waits forever on its lock file; a process killed while holding it (crash tests kill
    services at start) must not hang every later start: an up-to-date build is imported without the lock."""
    import os
    import subprocess
    import sys
    import time

    from torch.utils.cpp_extension import _get_build_directory

    name = cpu_ops.module_name(cpu_ops.chosen_isa())
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    made = not os.path.exists(lock)
    if made:
        open(lock, "w").close()
    try:
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", "from splitserve.kernels import cpu_ops; print(cpu_ops.load() is not None)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == "True", out.stderr[-2000:]
        assert time.monotonic() - start < 30
    finally:
        if made:
            os.unlink(lock)
