"""RMSNorm and SiLU-mul fused with the per-token fp8 quantizer (kernels.rmsnorm.rms_norm_quant,
kernels.activation.silu_and_mul_quant) against the two launches they replace: the op's Triton kernel,
then kernels.fp8_quant's. The bytes of x_q, the scales and the new residual must be equal, bit for bit
(engine.fused_ops swaps one for the other inside the decode graph)."""

import pytest
import torch

from splitserve.engine.worker.fp8 import MIN_SCALE
from splitserve.kernels.activation import silu_and_mul_quant, silu_and_mul_triton
from splitserve.kernels.fp8_quant import quantize_per_token_triton
from splitserve.kernels.rmsnorm import rms_norm_quant, rms_norm_triton

EPS = 1e-5
MIN_SCALE_F32 = torch.tensor(MIN_SCALE, dtype=torch.float32)  # what the kernels store for a row of zeros
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rows_with_edges(num_rows: int, width: int, dtype, gen, scale=3.0) -> torch.Tensor:
    """(num_rows, width) normal values; with 3+ rows, row 1 is zeros and row 2 large (x100)."""
    x = torch.randn(num_rows, width, generator=gen) * scale
    if num_rows >= 3:
        x[1] = 0.0
        x[2] *= 100.0
    return x.to(dtype)


def assert_same_quantized(got_q, got_scale, want_q, want_scale):
    assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == want_q.shape
    assert got_scale.dtype == torch.float32 and got_scale.shape == want_scale.shape == (want_q.shape[0], 1)
    mismatched = (got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {want_q.numel()} e4m3 bytes differ"
    assert torch.equal(got_scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 3, 130])
@pytest.mark.parametrize("hidden", [256, 640])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_quant_equals_norm_then_quantizer(device, dtype, num_rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_rows * hidden)
    x = rows_with_edges(num_rows, hidden, dtype, gen).to(device)
    residual = rows_with_edges(num_rows, hidden, dtype, gen, scale=1.0).to(device) if with_residual else None
    weight = 1 + 0.1 * torch.randn(hidden, generator=gen)
    weight[::7] = 40.0  # large outputs: up to ~40 x the row's normalized values
    weight = weight.to(dtype).to(device)
    x_q, scale, new_residual = rms_norm_quant(x, weight, EPS, MIN_SCALE, residual, impl="triton")
    if with_residual:
        out, want_residual = rms_norm_triton(x, weight, EPS, residual)
        assert torch.equal(new_residual, want_residual)  # (the interpreter rounds bf16 otherwise than x + residual)
    else:
        out = rms_norm_triton(x, weight, EPS)
        assert new_residual is None
    assert_same_quantized(x_q, scale, *quantize_per_token_triton(out, MIN_SCALE))
    if num_rows >= 3:
        assert scale[1].item() == MIN_SCALE_F32.item() and not x_q[1].float().any()  # the zero row


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(-g) of a large -g: inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feat", [256, 640])
# max_block_f 16384: the row in registers; 128: read twice, 128 features at a time (not at 130 rows: slow here)
@pytest.mark.parametrize("num_rows,max_block_f", [(1, 16384), (3, 16384), (130, 16384), (1, 128), (3, 128)])
def test_silu_and_mul_quant_equals_silu_mul_then_quantizer(device, dtype, num_rows, feat, max_block_f):
    gen = torch.Generator().manual_seed(num_rows + feat)
    x = rows_with_edges(num_rows, 2 * feat, dtype, gen).to(device)  # row 2: |silu(g) * u| up to ~1e5
    if dtype == torch.float16 and num_rows >= 3:
        x[2] = (x[2].float() / 10).to(dtype)  # keep silu(g) * u within fp16's 65504
    x_q, scale = silu_and_mul_quant(x, MIN_SCALE, impl="triton", max_block_f=max_block_f)
    assert_same_quantized(x_q, scale, *quantize_per_token_triton(silu_and_mul_triton(x), MIN_SCALE))
    if num_rows >= 3:
        assert scale[1].item() == MIN_SCALE_F32.item() and not x_q[1].float().any()
        assert x_q[2].float().abs().max().item() == 448.0  # the large row's max reaches e4m3's largest value


def test_leading_dims_flatten_to_rows_and_references_agree(device):
    """(2, 3, H) inputs give (6, H) outputs; impl="ref" (the two torch references) finds the same scales."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 64, generator=gen).to(torch.float16).to(device)  # (the interpreter rounds bf16 its own way)
    res = torch.randn(2, 3, 64, generator=gen).to(torch.float16).to(device)
    w = torch.ones(64, dtype=torch.float16, device=device)
    x_q, scale, new_res = rms_norm_quant(x, w, EPS, MIN_SCALE, res, impl="triton")
    _, ref_scale, ref_res = rms_norm_quant(x, w, EPS, MIN_SCALE, res, impl="ref")
    assert x_q.shape == (6, 64) and scale.shape == (6, 1) and new_res.shape == (2, 3, 64)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(scale, ref_scale)  # (the values: the interpreter casts to e4m3 its own way, no compare here)
    s_q, s_scale = silu_and_mul_quant(torch.cat([x, res], -1), MIN_SCALE, impl="triton")
    assert s_q.shape == (6, 64) and s_scale.shape == (6, 1)


def test_bad_shapes_are_refused_by_name(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match=r"^rms_norm_quant: weight must be \(8,\), got \(4,\)$"):
        rms_norm_quant(x, torch.ones(4, device=device), EPS, MIN_SCALE)
    with pytest.raises(ValueError, match=r"^rms_norm_quant: residual shape \(2, 4\) != x shape \(2, 8\)$"):
        rms_norm_quant(x, torch.ones(8, device=device), EPS, MIN_SCALE, torch.zeros(2, 4, device=device))
    with pytest.raises(ValueError, match=r"^silu_and_mul_quant: last dim must be even \(2F\), got 5$"):
        silu_and_mul_quant(torch.zeros(2, 5, device=device), MIN_SCALE)


@pytest.mark.gpu
@needs_gpu
def test_gpu_8b_shapes_bit_exact():
    """Llama-3-8B's decode at batch 128: the norm with residual over 4096, the SiLU-mul of 2 x 14336."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4096, generator=gen).bfloat16().cuda()
    res = torch.randn(128, 4096, generator=gen).bfloat16().cuda()
    w = (1 + 0.1 * torch.randn(4096, generator=gen)).bfloat16().cuda()
    x_q, scale, new_res = rms_norm_quant(x, w, EPS, MIN_SCALE, res)
    out, want_res = rms_norm_triton(x, w, EPS, res)
    assert torch.equal(new_res, want_res)
    assert_same_quantized(x_q, scale, *quantize_per_token_triton(out, MIN_SCALE))
    gate_up = (torch.randn(128, 2 * 14336, generator=gen) * 2).bfloat16().cuda()
    assert_same_quantized(
        *silu_and_mul_quant(gate_up, MIN_SCALE), *quantize_per_token_triton(silu_and_mul_triton(gate_up), MIN_SCALE)
    )
