"""An fp8 (e4m3) KV cache: the write quantizes (x / scale, clamped), paged decode and prefill attention
read fp8 caches (Triton on a GPU, the references on CPU), the engine's attention folds per-layer scales
in (CPU torch path, and the CUDA path on a GPU), and the fused per-token activation quantizer."""

import pytest
import torch

from splitserve.engine.worker.attention import attention_forward
from splitserve.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from splitserve.kernels.fp8_quant import quantize_per_token
from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton
from splitserve.kernels.paged_decode_config import decode_config, resolve_config
from tests.kernels.conftest import PagedKv, dense_attention
from tests.model_factory import SeqSpec, build_meta

FP8 = torch.float8_e4m3fn
ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
IMPLS = [pytest.param("triton", marks=needs_gpu), "ref"]
DEVICE = "cuda" if ON_GPU else "cpu"


def _device(impl: str) -> str:
    return "cuda" if impl == "triton" else "cpu"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_quantizes_with_scales_and_clamps(impl, src_dtype):
    device = _device(impl)
    num_tokens, heads, dim, block_size = 9, 2, 16, 4
    kv = torch.zeros(4, 3, 2, block_size, heads, dim, dtype=FP8, device=device)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(num_tokens, heads, dim, generator=gen) * 3).to(src_dtype)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(src_dtype)
    key[0, 0, 0], value[1, 1, 1] = 1e4, -1e4  # past 448 * scale: clamped to +-448, never nan
    slots = torch.tensor([3, 0, 1, 2, 15, 14, -1, 8, 9])
    write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), impl=impl, k_scale=0.5, v_scale=4.0)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k = (key[t].float() / 0.5).clamp(-448, 448).to(FP8)
        want_v = (value[t].float() / 4.0).clamp(-448, 448).to(FP8)
        got_k, got_v = k_cache[slot // block_size, slot % block_size], v_cache[slot // block_size, slot % block_size]
        assert torch.equal(got_k.cpu().view(torch.uint8), want_k.view(torch.uint8)), f"token {t} keys"
        assert torch.equal(got_v.cpu().view(torch.uint8), want_v.view(torch.uint8)), f"token {t} values"
    assert k_cache[0, 3].float().max() == 448 and v_cache[0, 0].float().min() == -448
    assert kv[:, [0, 2]].float().abs().sum() == 0  # other layers untouched


def _fp8_paged(seq_lens, device, seed=0):
    """A PagedKv whose caches are fp8 (random e4m3 values; its dense keys/values are those values exactly)."""
    return PagedKv(seq_lens, 2, 32, 4, FP8, device, seed=seed)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_attention_reads_fp8(impl, q_dtype, num_splits):
    device = _device(impl)
    seq_lens = [1, 13, 64, 7]
    paged = _fp8_paged(seq_lens, device)
    q = torch.randn(len(seq_lens), 4, 32, generator=torch.Generator().manual_seed(1)).to(q_dtype).to(device)
    scale = 32**-0.5
    out = paged_decode_attention(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, num_splits=num_splits, impl=impl
    )
    _check_decode(out, q, paged, seq_lens, scale, q_dtype)


@needs_gpu
@pytest.mark.parametrize("config", [dict(DOT_F16=False), dict(BLOCK_N=64, num_warps=4, num_stages=3)])
def test_decode_attention_fp8_tile_variants(config):
    """The bf16 upcast (not the f16 default) and another tile, as benchmarks/kernel_timings.py's fp8 sweep runs them."""
    seq_lens = [1, 13, 200, 7]
    paged = _fp8_paged(seq_lens, "cuda")
    q = torch.randn(len(seq_lens), 4, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    scale = 32**-0.5
    out = paged_decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, config=config
    )
    _check_decode(out, q, paged, seq_lens, scale, torch.bfloat16)


def _check_decode(out, q, paged, seq_lens, scale, q_dtype):
    assert out.dtype == q_dtype
    for b, n in enumerate(seq_lens):
        want = dense_attention(q[b : b + 1], paged.keys[b], paged.values[b], scale, first_pos=n - 1)
        tol = 2e-5 if q_dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(out[b : b + 1].double().cpu(), want, atol=tol, rtol=tol)


def test_fp8_caches_get_the_measured_decode_tile():
    assert decode_config(128, torch.bfloat16, False, FP8) == dict(
        VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2
    )
    assert decode_config(96, torch.bfloat16, False, FP8) == dict(BLOCK_N=128, num_warps=4, num_stages=2)  # upcast
    assert decode_config(128, torch.bfloat16, False, torch.bfloat16) == dict(BLOCK_N=64, num_warps=4, num_stages=2)


def test_an_override_without_a_variant_and_strided_caches_take_the_upcast_kernel():
    """On the GPU an fp8 cache defaults to the rows variant; an override naming no VARIANT (the tests' and the
    bench's upcast configs) gets the upcast kernel's tile under it, and so do caches whose head dim is not
    contiguous (the variants read words along it)."""
    cache = torch.zeros(4, 16, 8, 128, dtype=FP8)
    upcast = dict(BLOCK_N=128, num_warps=4, num_stages=2)
    assert resolve_config(128, torch.bfloat16, False, cache, cache) == dict(
        VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2
    )
    assert resolve_config(128, torch.bfloat16, False, cache, cache, dict(DOT_F16=False)) == dict(upcast, DOT_F16=False)
    assert resolve_config(128, torch.bfloat16, False, cache, cache, dict(VARIANT="tokens", BLOCK_N=128)) == dict(
        VARIANT="tokens", HEADS_FIRST=True, BLOCK_N=128, num_warps=4, num_stages=2
    )
    strided = torch.zeros(4, 16, 128, 8, dtype=FP8).transpose(2, 3)  # (4, 16, 8, 128), head dim stride 8
    assert resolve_config(128, torch.bfloat16, False, cache, strided) == upcast
    assert resolve_config(128, torch.bfloat16, False, strided, cache) == upcast


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_reads_fp8(impl, q_dtype):
    device = _device(impl)
    seqs = [(9, 9), (20, 5), (70, 33)]  # (context after the step, new tokens)
    paged = _fp8_paged([n for n, _ in seqs], device, seed=2)
    q_lens = [m for _, m in seqs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), 4, 32, generator=torch.Generator().manual_seed(3)).to(q_dtype).to(device)
    scale = 32**-0.5
    out = paged_prefill_attention(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        qsl.to(device),
        paged.seq_lens,
        max(q_lens),
        scale,
        impl=impl,
    )
    for b, (n, m) in enumerate(seqs):
        start = int(qsl[b])
        want = dense_attention(q[start : start + m], paged.keys[b], paged.values[b], scale, first_pos=n - m)
        tol = 2e-5 if q_dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(out[start : start + m].double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_gpu), "cpu"])
def test_engine_attention_folds_kv_scales(device):
    """attention_forward over an fp8 cache with k_scale 0.25, v_scale 2: a prefill step, then a step of one
    decode beside a chunk; each equals fp64 attention over the dequantized cache (scale x stored value)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    heads, kv_heads, dim, bs = 4, 2, 32, 4
    kv = torch.zeros(12, 1, 2, bs, kv_heads, dim, dtype=FP8, device=device)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    gen = torch.Generator().manual_seed(4)
    k_scale, v_scale = 0.25, 2.0
    steps = [
        [SeqSpec(0, 6, (3, 1)), SeqSpec(0, 3, (5,))],
        [SeqSpec(6, 1, (3, 1)), SeqSpec(3, 5, (5, 7))],
    ]
    for specs in steps:
        meta = build_meta(specs, bs, device)
        num_tokens = sum(s.num_new for s in specs)
        q, k, v = (
            torch.randn(num_tokens, h, dim, generator=gen).to(dtype).to(device) for h in (heads, kv_heads, kv_heads)
        )
        out = attention_forward(q, k, v, k_cache, v_cache, meta, dim**-0.5, k_scale, v_scale)
        row = 0
        for spec in specs:
            n = spec.num_computed + spec.num_new
            ids = torch.tensor(spec.block_ids, device=device)
            keys = k_cache[ids].reshape(-1, kv_heads, dim)[:n].double() * k_scale  # what the cache means
            values = v_cache[ids].reshape(-1, kv_heads, dim)[:n].double() * v_scale
            want = dense_attention(q[row : row + spec.num_new], keys, values, dim**-0.5, first_pos=spec.num_computed)
            tol = 2e-5 if dtype == torch.float32 else 1.6e-2
            torch.testing.assert_close(out[row : row + spec.num_new].double().cpu(), want, atol=tol, rtol=tol)
            # and what was stored is the new keys / k_scale in e4m3
            stored = k_cache[ids].reshape(-1, kv_heads, dim)[spec.num_computed : n].cpu()
            want_k = (k[row : row + spec.num_new].float().cpu() / k_scale).clamp(-448, 448).to(FP8)
            assert torch.equal(stored.view(torch.uint8), want_k.view(torch.uint8))
            row += spec.num_new


@needs_gpu
@pytest.mark.parametrize("shape", [(1, 4096), (7, 14336), (128, 100)])
def test_fused_per_token_quantization_matches_reference(shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16).cuda()
    x[0] = 0.0  # a zero row: the smallest scale, zeros out
    got_q, got_s = quantize_per_token(x, 1e-6, impl="triton")
    want_q, want_s = quantize_per_token(x, 1e-6, impl="ref")
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    # the kernel multiplies by 1/scale, the reference divides: at most one e4m3 step apart, nearly always equal
    diff = (got_q.float() - want_q.float()).abs()
    assert bool((diff <= want_q.float().abs() * 2**-3 + 2**-9).all())
    assert (diff > 0).float().mean() < 0.01
