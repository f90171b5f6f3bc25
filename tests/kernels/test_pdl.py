"""kernels.pdl: which launches get programmatic dependent launch (only CUDA devices of capability 9.0+, only while
ENABLED), and that PDL-aware kernels still compute the same under the interpreter (PDL is a constexpr False there).
On a GPU, tests/test_gpu_engine.py checks that the decode graphs' tokens do not change with PDL on."""

import torch

from splitserve.kernels import pdl


def test_on_by_default_and_never_on_cpu(monkeypatch):
    assert pdl.ENABLED is True
    assert pdl.pdl_launch(torch.zeros(4)) == {"PDL": False}, "the interpreter takes no launch_pdl option"


def test_on_for_a_capable_gpu_only(monkeypatch):
    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # what pdl_launch sees on a GPU (the CPU tests set it)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # e.g. an A100 (capability 8.0)
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": False}


def test_never_under_the_interpreter_or_on_rocm(monkeypatch):
    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": False}
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": False}
    monkeypatch.setattr(torch.version, "hip", None)
    assert pdl.pdl_launch(FakeCuda()) == {"PDL": True, "launch_pdl": True}
