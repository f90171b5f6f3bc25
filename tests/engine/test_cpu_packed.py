"""Packed linear weights (float32 on CPU, oneDNN or MKL: engine.cpu_gemm) give the same logits and tokens
as plain F.linear; the library is chosen by vendor unless SPLITSERVE_CPU_GEMM names one."""

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.worker import cpu_gemm
from splitserve.engine.worker.loader import load_model
from tests.model_factory import make_tiny_model_dir

LIBRARIES = [lib for lib, ok in (("onednn", cpu_gemm._onednn_available()), ("mkl", cpu_gemm._mkl_available())) if ok]


@pytest.mark.parametrize("library", LIBRARIES)
def test_packed_weights_match_plain_linear(tmp_path, monkeypatch, library):
    path = make_tiny_model_dir(tmp_path, "qwen2", dtype=torch.float32)  # qkv with a bias
    monkeypatch.setenv("SPLITSERVE_CPU_GEMM", library)
    packed, _ = load_model(path, dtype=torch.float32, device="cpu")
    monkeypatch.setenv("SPLITSERVE_CPU_PACKED", "0")
    plain, _ = load_model(path, dtype=torch.float32, device="cpu")
    assert (
        packed._lm_head_packed.library == library
        and packed.model.layers[0].self_attn.qkv_proj.packed.library == library
    )
    assert plain._lm_head_packed is None and plain.model.layers[0].mlp.down_proj.packed is None
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        a, b = packed.model.layers[0].get_submodule(name), plain.model.layers[0].get_submodule(name)
        for rows in (1, 37, 300):
            xin = torch.randn(rows, a.weight.shape[1])
            torch.testing.assert_close(a(xin), b(xin), atol=1e-5, rtol=1e-5)
    x = torch.randn(37, packed.config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("library", LIBRARIES)
def test_float32_engine_tokens_with_and_without_packing(tmp_path, monkeypatch, library):
    path = make_tiny_model_dir(tmp_path, "qwen2", dtype=torch.float32)
    prompts = [[5, 9, 13, 200, 7], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    monkeypatch.setenv("SPLITSERVE_CPU_GEMM", library)
    with_packing = [
        o.token_ids for o in LLM(model=str(path), **args).generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    monkeypatch.setenv("SPLITSERVE_CPU_PACKED", "0")
    without = [
        o.token_ids for o in LLM(model=str(path), **args).generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert with_packing == without


@pytest.mark.parametrize("vendor, library", [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")])
def test_auto_picks_mkl_on_intel_and_onednn_elsewhere(monkeypatch, vendor, library):
    if not {"onednn", "mkl"} <= set(LIBRARIES):
        pytest.skip("this torch build lacks one of the two libraries")
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.delenv("SPLITSERVE_CPU_GEMM", raising=False)
    monkeypatch.delenv("SPLITSERVE_CPU_PACKED", raising=False)
    assert cpu_gemm.chosen_library() == library
    assert cpu_gemm.pack(torch.zeros(4, 4)).library == library
    assert cpu_gemm.pack(torch.zeros(4, 4, dtype=torch.float64)) is None  # float32 only


def test_a_bad_library_name_is_refused(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CPU_GEMM", "blis")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_GEMM='blis': choose one of auto, onednn, mkl, off"):
        cpu_gemm.chosen_library()
    monkeypatch.setenv("SPLITSERVE_CPU_GEMM", "off")
    assert cpu_gemm.chosen_library() is None
