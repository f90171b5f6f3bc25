"""Fp8Linear.forward_silu (the MLP's down projection from [gate | up]) and fused_ops.silu_linear's route to it.

Rows the W8A16 kernel runs, up to quant.SILU_FUSED_MAX_ROWS (0: measured slower on an H200; the tests raise it to 16 to
cover the tensor-core loop), take one launch with the SiLU-mul in its loads; more rows, or a layer without the
kernel, take silu_and_mul then the layer. On CPU the kernel runs under Triton's interpreter: the tests switch it
on the way finalize does on an sm_89+ GPU (use_skinny_kernel, split counters), and watch
engine.layers.silu_and_mul (wrapped, not replaced) to see which route ran.
"""

import pytest
import torch

from splitserve.engine.worker import fp8 as quant
from splitserve.engine.worker import fused_ops, layers
from splitserve.engine.worker.fp8 import MAX_W8A16_ROWS, Fp8Linear
from splitserve.kernels import activation
from splitserve.kernels.fp8_skinny_linear import MIN_BLOCK_N, fp8_skinny_linear_triton

N, K = 40, 100  # K not a multiple of the interpreter's 32-wide steps
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled on a GPU, interpreted on CPU


def _layer(dtype, w8a16_max_rows: int, kernel: bool, bias: bool = True) -> Fp8Linear:
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter((torch.randn(N, K, generator=gen) * 0.1).to(DEVICE, dtype), False)
    linear.bias = torch.nn.Parameter(torch.randn(N, generator=gen).to(DEVICE, dtype), False) if bias else None
    linear.output_sizes = (N,)
    layer = Fp8Linear.from_linear(linear, w8a16_max_rows)
    layer.use_skinny_kernel = kernel  # what finalize sets on an sm_89+ GPU (or, False, elsewhere)
    if kernel:
        layer.split_counters = torch.zeros(-(-N // MIN_BLOCK_N), dtype=torch.int32, device=DEVICE)
    return layer


@pytest.fixture
def silu_calls(monkeypatch):
    """The rows of each engine.layers.silu_and_mul call (the unfused route), the op itself still running."""
    calls = []
    plain = layers.silu_and_mul

    def counted(x):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return plain(x)

    monkeypatch.setattr(layers, "silu_and_mul", counted)
    return calls


def _gate_up(rows: int, dtype) -> torch.Tensor:
    return (4 * torch.randn(rows, 2 * K, generator=torch.Generator().manual_seed(rows))).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, MAX_W8A16_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_take_one_launch_equal_to_silu_and_mul_then_the_kernel(monkeypatch, silu_calls, dtype, rows, bias):
    monkeypatch.setattr(quant, "SILU_FUSED_MAX_ROWS", MAX_W8A16_ROWS)
    layer = _layer(dtype, MAX_W8A16_ROWS, kernel=True, bias=bias)
    gate_up = _gate_up(rows, dtype)
    got = layer.forward_silu(gate_up)
    assert silu_calls == []  # no separate SiLU-mul
    act = activation.silu_and_mul(gate_up, impl="triton")  # what the GPU's silu_and_mul launch computes
    want = fp8_skinny_linear_triton(act, layer.weight, layer.weight_scale, layer.bias, layer.split_counters)
    assert got.dtype == dtype and got.shape == (rows, N)
    assert torch.equal(got, want)
    assert torch.equal(layer(act), want)  # the layer's own unfused W8A16 call: the same bits


def test_measured_tiles_reach_the_fused_launch(monkeypatch, silu_calls):
    """skinny_tiles (W8A16_TILES of the weight's (N, K), K the intermediate size) choose the fused launch's tiles."""
    monkeypatch.setattr(quant, "SILU_FUSED_MAX_ROWS", MAX_W8A16_ROWS)
    layer = _layer(torch.bfloat16, MAX_W8A16_ROWS, kernel=True)
    layer.skinny_tiles = {"dot": dict(DOT=True, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1, SPLIT_K=2)}
    gate_up = _gate_up(2, torch.bfloat16).reshape(2, 1, 2 * K)  # leading dims are kept
    got = layer.forward_silu(gate_up)
    act = activation.silu_and_mul(gate_up.reshape(2, 2 * K), impl="triton")
    want = fp8_skinny_linear_triton(act, layer.weight, layer.weight_scale, layer.bias, config=layer.skinny_tiles["dot"])
    assert silu_calls == [] and got.shape == (2, 1, N)
    assert torch.equal(got.reshape(2, N), want)


@pytest.mark.parametrize(
    "fused_max_rows,max_rows,kernel,rows",
    [
        (1, MAX_W8A16_ROWS, True, 2),  # the default: the kernel's tensor-core loop without the SiLU
        (MAX_W8A16_ROWS, 4, True, 5),
        (MAX_W8A16_ROWS, MAX_W8A16_ROWS, True, MAX_W8A16_ROWS + 1),
        (MAX_W8A16_ROWS, MAX_W8A16_ROWS, False, 1),
        (MAX_W8A16_ROWS, 0, False, 1),
    ],
)
def test_more_rows_or_no_kernel_take_silu_and_mul_then_the_layer(
    monkeypatch, silu_calls, fused_max_rows, max_rows, kernel, rows
):
    """Above SILU_FUSED_MAX_ROWS, above w8a16_max_rows (W8A8), without the kernel (its reference), or W8A16 off:
    the two ops, exactly."""
    monkeypatch.setattr(quant, "SILU_FUSED_MAX_ROWS", fused_max_rows)
    layer = _layer(torch.bfloat16, max_rows, kernel=kernel)
    gate_up = _gate_up(rows, torch.bfloat16)
    got = layer.forward_silu(gate_up)
    assert silu_calls == [rows]
    assert torch.equal(got, layer(layers.silu_and_mul(gate_up)))


def test_silu_linear_sends_an_fp8_layer_to_forward_silu(silu_calls, monkeypatch):
    monkeypatch.setattr(quant, "SILU_FUSED_MAX_ROWS", 1)
    layer = _layer(torch.bfloat16, MAX_W8A16_ROWS, kernel=True)
    gate_up = _gate_up(1, torch.bfloat16)
    got = fused_ops.silu_linear(layer, gate_up)
    assert silu_calls == []
    assert torch.equal(got, layer.forward_silu(gate_up))


def test_a_gate_up_of_the_wrong_width_names_the_field_and_the_size():
    layer = _layer(torch.bfloat16, MAX_W8A16_ROWS, kernel=True)
    with pytest.raises(
        ValueError,
        match=r"forward_silu: gate_up must be \(\.\.\., 2 \* in_features\) = \(\.\.\., 200\), got \(1, 100\)",
    ):
        layer.forward_silu(_gate_up(1, torch.bfloat16)[:, :K])
