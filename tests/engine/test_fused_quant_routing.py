"""Which fp8 projections take their input quantized by the op before them (Fp8Linear.takes_fused_quant), and
engine.fused_ops' norm_linear / silu_linear on that path: the same numbers as the op, then the layer.

`use_scaled_mm` is what finalize() sets on an sm_89+ GPU; here it is set by hand, and the product runs
torch's CPU `_scaled_mm` (skipped where this torch has none). The fused kernels run their references on
CPU; their Triton kernels are compared byte for byte in tests/kernels/test_fp8_fused_quant.py.
"""

import pytest
import torch

from splitserve.engine.worker import fused_ops
from splitserve.engine.worker.fp8 import Fp8Linear
from splitserve.engine.worker.models.llama import RMSNorm
from splitserve.kernels import activation, rmsnorm

K, N = 64, 48  # multiples of 16, as _scaled_mm needs


def fp8_layer(w8a16_max_rows=0, scaled_mm=True, num_input_scales=0, seed=0) -> Fp8Linear:
    """A (N, K) Fp8Linear of bf16 activations, its weight quantized from random values; finalized."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter((torch.randn(N, K, generator=gen) * 0.1).bfloat16(), requires_grad=False)
    linear.bias = torch.nn.Parameter(torch.randn(N, generator=gen).bfloat16(), requires_grad=False)
    linear.output_sizes = (N,)
    layer = Fp8Linear.from_linear(linear, w8a16_max_rows)
    if num_input_scales:
        layer.input_scale = torch.nn.Parameter(torch.full((num_input_scales,), 0.02), requires_grad=False)
        layer.finalize(w8a16_max_rows)
    layer.use_scaled_mm = scaled_mm
    return layer


@pytest.mark.parametrize(
    "max_rows,rows,static,scaled_mm,fused",
    [
        (0, 1, False, True, True),  # W8A8 at every size: from one row
        (0, 128, False, True, True),
        (16, 16, False, True, False),  # W8A16 up to 16 rows: x is not quantized
        (16, 17, False, True, True),
        (0, 128, True, True, False),  # a checkpoint's static input scale: the unfused quantizer
        (0, 128, False, False, False),  # the reference product (CPU, pre-sm_89, K or N not a multiple of 16)
    ],
)
def test_takes_fused_quant_only_on_the_dynamic_scaled_mm_path(max_rows, rows, static, scaled_mm, fused):
    layer = fp8_layer(max_rows, scaled_mm, num_input_scales=3 if static else 0)
    assert layer.takes_fused_quant(rows) is fused
    assert fused_ops.fused_quant_applies(torch.zeros(rows, K, dtype=torch.bfloat16), layer) is fused
    plain = torch.nn.Linear(K, N)
    assert fused_ops.fused_quant_applies(torch.zeros(rows, K), plain) is False  # not an Fp8Linear


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of the two fused kernels (which still run)."""
    calls = {"norm": 0, "silu": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(rmsnorm, "rms_norm_quant", counted("norm", rmsnorm.rms_norm_quant))
    monkeypatch.setattr(activation, "silu_and_mul_quant", counted("silu", activation.silu_and_mul_quant))
    return calls


def needs_cpu_scaled_mm():
    try:
        torch._scaled_mm(
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
            scale_a=torch.ones(16, 1),
            scale_b=torch.ones(1, 16),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"this torch has no CPU _scaled_mm: {err}")


@pytest.mark.parametrize(
    "max_rows,rows,static,fused",
    [(16, 20, False, True), (16, 3, False, False), (0, 3, False, True), (0, 20, True, False)],
)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_equals_norm_then_layer(fused_calls, max_rows, rows, static, fused, with_residual):
    needs_cpu_scaled_mm()
    layer = fp8_layer(max_rows, num_input_scales=1 if static else 0)
    norm = RMSNorm(K, 1e-5, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(rows)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(K, generator=gen))
    x = (torch.randn(rows, K, generator=gen) * 3).bfloat16()
    x[0] = 0.0  # a row of zeros: the smallest scale
    residual = torch.randn(rows, K, generator=gen).bfloat16() if with_residual else None
    got, got_residual = fused_ops.norm_linear(norm, layer, x, residual)
    if with_residual:
        h, want_residual = norm(x, residual)
    else:
        h, want_residual = norm(x), x
    assert fused_calls == {"norm": int(fused), "silu": 0}
    assert got.shape == (rows, N) and got.dtype == torch.bfloat16
    assert torch.equal(got, layer(h)) and torch.equal(got_residual, want_residual)


@pytest.mark.parametrize(
    "max_rows,rows,static,fused", [(16, 20, False, True), (16, 3, False, False), (0, 20, True, False)]
)
def test_silu_linear_equals_silu_mul_then_layer(fused_calls, max_rows, rows, static, fused):
    needs_cpu_scaled_mm()
    layer = fp8_layer(max_rows, num_input_scales=1 if static else 0)
    gate_up = (torch.randn(rows, 2 * K, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    gate_up[1] = 0.0
    got = fused_ops.silu_linear(layer, gate_up)
    assert fused_calls == {"norm": 0, "silu": int(fused)}
    want = layer(torch.nn.functional.silu(gate_up[:, :K]) * gate_up[:, K:])
    assert got.shape == (rows, N) and torch.equal(got, want)


def test_forward_quantized_is_forward_after_the_quantizer():
    """forward = quantize_input then forward_quantized, on the reference product too."""
    from splitserve.engine.worker.fp8 import quantize_per_token

    for scaled_mm in (False, True):
        if scaled_mm:
            needs_cpu_scaled_mm()
        layer = fp8_layer(scaled_mm=scaled_mm)
        x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).bfloat16()
        assert torch.equal(layer.forward_quantized(*quantize_per_token(x)), layer(x))


def test_a_quantized_decoder_through_the_fused_layers_gives_the_unfused_logits(tmp_path, monkeypatch, fused_calls):
    """The decoder's fused layer path (forced on CPU) with every projection fp8 on the `_scaled_mm` path: the
    norms and SiLU-muls hand their projections quantized input (layer 0's norm without a residual), and the
    logits of a chunked schedule equal the unfused layers', bit for bit."""
    from splitserve.engine.worker.fp8_checkpoint import quantize_model
    from splitserve.engine.worker.loader import load_model
    from tests.engine.test_models import run_engine
    from tests.model_factory import make_tiny_model_dir

    needs_cpu_scaled_mm()
    path = make_tiny_model_dir(tmp_path, "llama", vocab_size=503, dtype=torch.bfloat16, num_kv_heads=2)
    net, config = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert quantize_model(net) == 4 * config.num_layers
    for layer in net.modules():
        if isinstance(layer, Fp8Linear):
            layer.use_scaled_mm = True  # as finalize() sets it on an sm_89+ GPU
    want = run_engine(net, config, torch.bfloat16)
    assert fused_calls == {"norm": 0, "silu": 0}
    forward = type(net.model.layers[0]).forward
    monkeypatch.setattr(type(net.model.layers[0]), "forward", lambda self, *a: forward(self, *a[:6], True))
    got = run_engine(net, config, torch.bfloat16)
    assert fused_calls["norm"] > 0 and fused_calls["silu"] == fused_calls["norm"] // 2
    for name in ("A", "B"):
        assert torch.equal(got[name], want[name]), name
