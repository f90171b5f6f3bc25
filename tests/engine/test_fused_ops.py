"""engine.fused_ops inside the decoder: the fused layer path computes what the unfused one does.

On CPU the fused layer path runs each op's torch reference (the Triton kernels are checked against the same
references in tests/kernels/); here the layer is forced onto the fused path, so its wiring (norm weights, eps,
the residual stream, the SiLU input) is what is compared, step by step over a chunked schedule.
"""

import pytest
import torch

from splitserve.engine.worker import fused_ops
from splitserve.engine.worker.attention import attention_forward
from splitserve.engine.worker.layers import build_cos_sin_cache, rotary_embedding
from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.models import llama
from splitserve.kernels.tuned_configs import tuned_configs
from tests.engine.test_models import run_engine
from tests.model_factory import SeqSpec, build_meta, make_tiny_model_dir, step_positions

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


GPT_OSS_SMALL = dict(
    num_kv_heads=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5
)  # a window shorter than both sequences: dropping it (or the sinks) on the fused path changes the logits


@pytest.mark.parametrize(
    "arch,kwargs",
    [("llama", dict(num_kv_heads=2)), ("qwen2", dict(num_kv_heads=1)), ("gpt_oss", GPT_OSS_SMALL)],
)
def test_fused_layers_equal_unfused(tmp_path, monkeypatch, arch, kwargs):
    path = make_tiny_model_dir(tmp_path, arch, vocab_size=503, dtype=torch.float32, **kwargs)
    net, config = load_model(path, dtype=torch.float32, device="cpu")
    net.fused_ops = False
    want = run_engine(net, config, torch.float32)
    calls = []
    real_norm_linear = llama.norm_linear

    def counted(norm, linear, x, residual):
        calls.append(x.shape[0])
        return real_norm_linear(norm, linear, x, residual)

    monkeypatch.setattr(llama, "norm_linear", counted)
    forward = type(net.model.layers[0]).forward
    monkeypatch.setattr(
        type(net.model.layers[0]), "forward", lambda self, *a: forward(self, *a[:6], True)
    )  # the fused path on CPU tensors
    got = run_engine(net, config, torch.float32)
    assert calls, "the fused path did not run"
    for name in ("A", "B"):
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)


class OnCuda:
    """What gemv_tiles reads of a tensor, answered as a CUDA tensor on cuda:0 would."""

    def __init__(self, t):
        self.t, self.is_cuda, self.shape, self.dtype, self.device = t, True, t.shape, t.dtype, torch.device("cuda", 0)

    def dim(self):
        return self.t.dim()


def test_the_one_row_gemv_applies_only_to_measured_shapes_of_one_row(monkeypatch):
    """fused_ops.GEMV_TILES, when set, names the (N, K) shapes whose one-row product runs as the few-row kernel
    (bench variants); a listed shape applies to CUDA one-row inputs of the weight's dtype only."""
    w = torch.zeros(48, 64, dtype=torch.bfloat16)
    one_row = torch.zeros(1, 64, dtype=torch.bfloat16)
    tiles = dict(DOT=False, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3, SPLIT_K=1)
    monkeypatch.setattr(fused_ops, "GEMV_TILES", {(48, 64): tiles})
    assert fused_ops.gemv_tiles(one_row, w) is None  # a CPU tensor: the kernel is for CUDA only
    assert fused_ops.gemv_tiles(OnCuda(one_row), w) == tiles
    assert fused_ops.gemv_tiles(OnCuda(torch.zeros(2, 64, dtype=torch.bfloat16)), w) is None  # two rows
    assert fused_ops.gemv_tiles(OnCuda(one_row.float()), w) is None  # x not of the weight's dtype
    assert fused_ops.gemv_tiles(OnCuda(one_row.float()), w.float()) is None  # float32: cuBLAS, never the kernel
    strided = torch.zeros(64, 48, dtype=torch.bfloat16).t()  # (48, 64), its rows not contiguous
    assert fused_ops.gemv_tiles(OnCuda(one_row), strided) is None
    assert fused_ops.gemv_tiles(OnCuda(one_row), torch.zeros(40, 64, dtype=torch.bfloat16)) is None  # unmeasured
    monkeypatch.setattr(fused_ops, "GEMV_TILES", {})  # splitserve:cublas
    assert fused_ops.gemv_tiles(OnCuda(one_row), w) is None


@pytest.mark.parametrize(
    "name,applies", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False), ("NVIDIA A100-SXM4-80GB", False)]
)
def test_by_default_only_the_measured_gpu_runs_the_gemv_on_the_measured_shapes(monkeypatch, name, applies):
    """Unset (None), GEMV_TILES is the device's tuned table (a data file): an H200's holds Llama-3-8B's four
    projections; other GPUs (an H100 too: other bandwidth, other SM count) keep cuBLAS until tuned."""
    monkeypatch.setattr(fused_ops, "GEMV_TILES", None)
    monkeypatch.setattr(fused_ops, "_tuned", {})
    monkeypatch.setattr(fused_ops, "_device_name", lambda device: name)
    x = OnCuda(torch.zeros(1, 4096, dtype=torch.bfloat16))
    qkv = torch.zeros(6144, 4096, dtype=torch.bfloat16)
    h200 = tuned_configs("fp8_skinny_linear", "NVIDIA H200", "w16a16")["gemv"]
    expected = h200[(6144, 4096)] if applies else None
    assert fused_ops.gemv_tiles(x, qkv) == expected
    assert fused_ops.gemv_tiles(x, torch.zeros(1024, 4096, dtype=torch.bfloat16)) is None  # a shape not tuned
    assert set(h200) == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    assert h200[(6144, 4096)] == dict(DOT=False, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=1, SPLIT_K=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_linear_with_measured_tiles_runs_the_gemv_at_one_row(monkeypatch):
    from splitserve.engine.worker.models.llama import Linear
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_linear_error_bound, fp8_skinny_linear_ref

    gen = torch.Generator().manual_seed(0)
    lin = Linear(4096, [1024, 256, 256], bias=False, dtype=torch.bfloat16, device="cuda")
    lin.weight.copy_((torch.randn(1536, 4096, generator=gen) * 0.02).to("cuda", torch.bfloat16))
    tiles = dict(DOT=False, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3, SPLIT_K=2)
    monkeypatch.setattr(fused_ops, "GEMV_TILES", {(1536, 4096): tiles})
    x = torch.randn(1, 4096, generator=gen).to("cuda", torch.bfloat16)
    got = lin(x)
    assert lin.gemv_counters is not None and int(lin.gemv_counters.abs().sum()) == 0  # the kernel ran, split 2
    err = (got.double() - fp8_skinny_linear_ref(x, lin.weight, None).double()).abs()
    assert bool((err <= fp8_skinny_linear_error_bound(x, lin.weight, None).double()).all())
    x2 = torch.randn(2, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(lin(x2), torch.nn.functional.linear(x2, lin.weight))  # two rows: cuBLAS


def test_the_fused_rotary_write_applies_on_cuda_into_a_cache_of_ks_dtype_or_fp8():
    k = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    assert fused_ops.fused_write_applies(OnCuda(q), k, cache)
    assert fused_ops.fused_write_applies(OnCuda(q), k, cache.to(torch.float8_e4m3fn))
    assert not fused_ops.fused_write_applies(OnCuda(q), k, cache.half())  # a 16-bit cache of another dtype
    assert not fused_ops.fused_write_applies(q, k, cache)  # CPU: the unfused ops (the C++ CPU ops)


# a step of fresh prompts, a decode beside a chunk, then a decode-only step (block size 4)
FP8_STEPS = [
    [SeqSpec(0, 6, (3, 1)), SeqSpec(0, 3, (5,))],
    [SeqSpec(6, 1, (3, 1)), SeqSpec(3, 5, (5, 7))],
    [SeqSpec(7, 1, (3, 1)), SeqSpec(8, 1, (5, 7, 2))],
]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu]), "cpu"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fp8_cache_fused_rotary_write_equals_the_unfused_ops(device, k_scale, v_scale, gpt_oss):
    """Into an fp8 cache with per-layer scales, over three steps: the fused path (rotary_kv_write, then paged
    attention with the scales folded in) leaves the cache bytes and rotated q the unfused ops (rotary_embedding,
    attention_forward) leave; q, k and the output equal theirs bit for bit on a GPU (the same kernels and folding;
    rope_write_attend routes there), within float32 rounding on CPU (kernel references against the CPU path).
    `gpt_oss`: with attention sinks and a window of 5 positions, which both paths pass to the attention."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, kv_heads, dim, bs = 4, 2, 32, 4
    extras = {}
    if gpt_oss:
        extras = dict(sinks=torch.linspace(-1.0, 2.0, heads, device=device, dtype=dtype), sliding_window=5)
    kv = torch.full((12, 2, 2, bs, kv_heads, dim), 7.0, dtype=torch.float8_e4m3fn, device=device)
    want_kv = kv.clone()
    cos_sin = build_cos_sin_cache(dim, 64, 10000.0, None, dtype, device=device)
    gen = torch.Generator().manual_seed(3)
    for specs in FP8_STEPS:
        meta, positions = build_meta(specs, bs, device), step_positions(specs, device)
        num_tokens = positions.shape[0]
        q, k, v = (
            (torch.randn(num_tokens, h, dim, generator=gen) * 3).to(device, dtype) for h in (heads, kv_heads, kv_heads)
        )
        want_q, want_k = q.clone(), k.clone()
        args = (k, v, cos_sin, kv[:, 1, 0], kv[:, 1, 1], meta, dim**-0.5, k_scale, v_scale)
        if device == "cuda":
            assert fused_ops.fused_write_applies(q, k, kv)
            out = fused_ops.rope_write_attend(positions, q, *args, **extras)
        else:
            out = fused_ops.rope_write_attend_fused(positions, q, *args, **extras)
        rotary_embedding(positions, want_q, want_k, cos_sin)
        want = attention_forward(
            want_q, want_k, v, want_kv[:, 1, 0], want_kv[:, 1, 1], meta, dim**-0.5, k_scale, v_scale, **extras
        )
        assert torch.equal(kv.view(torch.uint8), want_kv.view(torch.uint8))
        for got, expected in ((q, want_q), (k, want_k), (out, want)):
            if device == "cuda":
                assert torch.equal(got, expected)
            else:  # the C++ CPU rotary and the torch attention round apart from the kernel references
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert int((kv[:, 1, 0].float() != 7.0).any(-1).any(-1).sum()) == 17  # every new token's key slot written


def test_qwen3_qk_norms_taken_into_the_fused_write():
    """rope_write_attend_fused with Qwen3's q/k norms (CPU: the kernels' references) equals the unfused layer's
    ops: the norm modules, rotary_embedding, attention_forward, over a prompt step and a decode step."""
    from splitserve.engine.worker.models.llama import RMSNorm

    heads, kv_heads, dim, bs = 4, 2, 32, 4
    gen = torch.Generator().manual_seed(4)
    q_norm, k_norm = RMSNorm(dim, 1e-6, torch.float32, "cpu"), RMSNorm(dim, 1e-6, torch.float32, "cpu")
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
        k_norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    kv = torch.zeros(8, 2, 2, bs, kv_heads, dim)
    want_kv = kv.clone()
    cos_sin = build_cos_sin_cache(dim, 64, 10000.0, None, torch.float32)
    for specs in ([SeqSpec(0, 6, (3, 1))], [SeqSpec(6, 1, (3, 1))]):
        meta, positions = build_meta(specs, bs, "cpu"), step_positions(specs, "cpu")
        q, k, v = (torch.randn(positions.shape[0], h, dim, generator=gen) * 3 for h in (heads, kv_heads, kv_heads))
        want_q, want_k = q_norm(q), k_norm(k)
        args = (v, cos_sin, kv[:, 1, 0], kv[:, 1, 1], meta, dim**-0.5)
        out = fused_ops.rope_write_attend_fused(positions, q, k, *args, qk_norm=(q_norm, k_norm))
        rotary_embedding(positions, want_q, want_k, cos_sin)
        want = attention_forward(want_q, want_k, v, want_kv[:, 1, 0], want_kv[:, 1, 1], meta, dim**-0.5)
        for got, expected in ((q, want_q), (k, want_k), (out, want), (kv, want_kv)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert int((kv[:, 1, 0] != 0).any(-1).any(-1).sum()) == 7  # the seven tokens' key slots written
