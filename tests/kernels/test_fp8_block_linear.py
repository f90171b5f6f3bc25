"""kernels/fp8_block_linear.py on a GPU of capability >= 8.9 against its torch reference (the same per-group fp32
dots and scales): rows across its three tile shapes, output columns not a multiple of the tile, groups of 32-256,
with and without a bias, bf16 and fp16 out; and the shapes it refuses, named."""

import pytest
import torch

from splitserve.kernels.fp8_block_linear import block_config, fp8_block_linear, fp8_block_linear_ref, supported
from tests.kernels.conftest import DEVICE

FP8 = torch.float8_e4m3fn
CAPABLE = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
gpu = pytest.mark.skipif(not CAPABLE, reason="needs a CUDA GPU with e4m3 tensor cores (capability >= 8.9)")


def _operands(m, n, k, group, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_q = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    w_q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, k // group, generator=gen) * 1e-2 + 1e-3
    w_scale = torch.rand(n, k // group, generator=gen) * 1e-2 + 1e-3
    bias = torch.randn(n, generator=gen)
    return x_q, x_scale, w_q, w_scale, bias


@gpu
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 65, 300])
@pytest.mark.parametrize(("n", "k", "group"), [(200, 256, 128), (64, 512, 256), (96, 64, 32), (72, 4096, 128)])
def test_matches_the_reference(m, n, k, group):
    x_q, x_scale, w_q, w_scale, bias = _operands(m, n, k, group, seed=m + n)
    for with_bias, dtype in ((True, torch.bfloat16), (False, torch.float16)):
        b = bias.to(dtype).cuda() if with_bias else None
        args = (x_q.cuda(), x_scale.cuda(), w_q.cuda(), w_scale.cuda(), b, dtype)
        got = fp8_block_linear(*args)
        want = fp8_block_linear_ref(*args)
        assert got.dtype == dtype and got.shape == (m, n)
        # fp32 sums in another order (from 64 rows Hopper's e4m3 wgmma, whose sums keep fewer bits: 7e-4 relative,
        # as cuBLASLt's), one rounding to 16 bits
        err = (got.float() - want.float()).cpu()
        assert float(err.norm() / want.float().norm()) < 2e-3 and float(err.abs().max()) <= 1e-2 * float(
            want.float().abs().max()
        ), f"M {m} N {n} K {k} G {group}"


@gpu
def test_every_config_tile_gives_the_same_result():
    x_q, x_scale, w_q, w_scale, bias = (t.cuda() for t in _operands(40, 136, 256, 128, seed=3))
    want = fp8_block_linear(x_q, x_scale, w_q, w_scale, bias.bfloat16(), torch.bfloat16)
    for m, n in ((1, 136), (1, 20000), (40, 136), (40, 20000), (500, 136)):
        got = fp8_block_linear(x_q, x_scale, w_q, w_scale, bias.bfloat16(), torch.bfloat16, block_config(m, n))
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-3, (m, n)


def test_supported_groups_and_named_refusals():
    assert supported(4096, 128) and supported(64, 32) and supported(512, 256)
    assert not supported(4096, 16) and not supported(4096, 512) and not supported(96, 48) and not supported(100, 32)
    x_q, x_scale, w_q, w_scale, _ = _operands(3, 8, 64, 32)
    with pytest.raises(ValueError, match=r"do not agree on \(M, K, N, K / G\)"):
        fp8_block_linear(x_q, x_scale, w_q[:, :32], w_scale)
    with pytest.raises(ValueError, match=r"groups of 16 features over K 64 \(a power of two in \[32, 256\]\)"):
        fp8_block_linear(x_q, x_scale.repeat(1, 2), w_q, w_scale.repeat(1, 2))


@pytest.mark.parametrize(("rows", "k", "group"), [(1, 4096, 128), (7, 14336, 128), (33, 96, 32), (2, 512, 256)])
def test_group_quantizer_writes_the_references_bytes(device, rows, k, group):
    """kernels.fp8_quant.quantize_per_token_group (Triton: the GPU, or the interpreter) against its torch reference:
    the same scales, and on the GPU the same e4m3 bytes, a row of zeros and a group of zeros included."""
    from splitserve.kernels.fp8_quant import quantize_per_token_group, quantize_per_token_group_ref

    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 5).to(torch.bfloat16)
    x[0, :group] = 0
    if rows > 1:
        x[-1] = 0
    x = x.to(device)
    q, scale = quantize_per_token_group(x, group, 1.0 / (448 * 512), impl="triton")
    want_q, want_scale = quantize_per_token_group_ref(x, group, 1.0 / (448 * 512))
    assert scale.shape == (rows, k // group) and q.dtype == FP8 and torch.equal(scale, want_scale)
    if device == "cuda":  # the interpreter casts to e4m3 its own way (tests/kernels/test_fp8_fused_quant.py)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # token-fastest scales (cuBLASLt's block scaling): the same values, each group's column padded to 4 tokens
    q4, scale4 = quantize_per_token_group(x, group, 1.0 / (448 * 512), impl="triton", column_major=4)
    assert scale4.shape == (rows, k // group) and scale4.stride() == (1, -(-rows // 4) * 4)
    assert torch.equal(scale4, want_scale) and torch.equal(q4.view(torch.uint8), q.view(torch.uint8))


def test_group_quantizer_names_what_it_cannot_take():
    from splitserve.kernels.fp8_quant import quantize_per_token_group

    with pytest.raises(ValueError, match=r"got \(2, 96\) in groups of 64"):
        quantize_per_token_group(torch.zeros(2, 96), 64, 1e-6)
    with pytest.raises(ValueError, match=r"got \(2, 96\) in groups of 48"):
        quantize_per_token_group(torch.zeros(2, 96), 48, 1e-6)
