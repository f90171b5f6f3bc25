"""engine.fused_ops inside the decoder: the fused layer path computes what the unfused one does.

On CPU the few-row projections run their torch reference (the Triton kernels are checked against
the same references in tests/kernels/test_skinny_linear.py and test_rotary_kv_write.py); here
`skinny_applies` is widened to CPU float32 so the fused layer's wiring (norm weights, eps, the
residual stream, the SiLU input) is what is compared, step by step over a chunked schedule.
"""

import pytest
import torch

from splitserve.engine import fused_ops
from splitserve.engine.loader import load_model
from tests.model_factory import make_tiny_model_dir
from tests.test_models import run_engine


@pytest.mark.parametrize("arch,kwargs", [("llama", dict(num_kv_heads=2)), ("qwen2", dict(num_kv_heads=1))])
def test_fused_layers_equal_unfused(tmp_path, monkeypatch, arch, kwargs):
    path = make_tiny_model_dir(tmp_path, arch, vocab_size=503, dtype=torch.float32, **kwargs)
    net, config = load_model(path, dtype=torch.float32, device="cpu")
    net.fused_ops = False
    want = run_engine(net, config, torch.float32)
    calls = []

    def applies(x, linear):
        calls.append(x.shape[0])
        return x.shape[0] <= 16

    monkeypatch.setattr(fused_ops, "skinny_applies", applies)
    forward = type(net.model.layers[0]).forward
    monkeypatch.setattr(
        type(net.model.layers[0]), "forward", lambda self, *a: forward(self, *a[:6], True)
    )  # the fused path on CPU tensors
    got = run_engine(net, config, torch.float32)
    assert calls, "the fused path did not run"
    for name in ("A", "B"):
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5)
