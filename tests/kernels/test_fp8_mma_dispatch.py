"""Which kernel paged_decode_attention picks for an e4m3 cache on a GPU where the mma kernel runs
(kernels/paged_decode_attention_fp8_mma.py), checked on any machine: the launches are recorded, not run. The mma
kernel once the (sequence, KV head, split) programs are at least the SMs (`fp8_mma.pays`), the Triton rows variant
below (at the 8B step's batch 1 it was 0.04 ms a step faster, docs/perf.md) and whenever a config is given."""

import importlib

import pytest
import torch

from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma

pda = importlib.import_module("splitserve.kernels.paged_decode_attention")  # the module (the package exports the op)
RUNS = fp8_mma.runs

FP8 = torch.float8_e4m3fn


@pytest.fixture
def launches(monkeypatch):
    """A GPU of 132 SMs on which the mma kernel runs: each launch's kernel name and options, recorded."""
    got = []
    monkeypatch.setattr(pda, "interpreting", lambda q: False)
    monkeypatch.setattr(pda, "num_sms", lambda index: 132)
    monkeypatch.setattr(fp8_mma, "runs", lambda *operands: True)
    monkeypatch.setattr(fp8_mma, "launch_fp8_mma", lambda *args: got.append(("mma", args[-1])))
    monkeypatch.setattr(fp8_mma, "supports", lambda *operands: None)
    monkeypatch.setattr(fp8_mma, "available", lambda device: True)
    monkeypatch.setattr(pda, "launch_fp8_decode", lambda *args: got.append((args[-1]["VARIANT"], args[-1])))
    return got


def _attend(num_seqs: int, num_splits: int, config=None):
    q = torch.zeros(num_seqs, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=FP8)
    table = torch.zeros(num_seqs, 1, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    out = torch.zeros_like(q)  # a split launch's merge would run: one split only
    return pda.paged_decode_attention_triton(q, cache, cache, table, seq_lens, 0.1, out, num_splits, config)


@pytest.mark.parametrize(("num_seqs", "num_splits", "kernel"), [(17, 1, "mma"), (16, 1, "rows"), (1, 1, "rows")])
def test_the_mma_kernel_from_one_program_an_sm(launches, num_seqs, num_splits, kernel):
    _attend(num_seqs, num_splits)  # 8 KV heads: 17 sequences are 136 programs, 16 are 128
    assert [name for name, _ in launches] == [kernel], f"{num_seqs} x 8 x {num_splits} programs: {launches}"
    if kernel == "mma":
        assert launches[0][1] == dict(VARIANT="mma")  # its options from the work: choose_warps, AHEAD on
    else:
        assert launches[0][1] == pda.decode_config(128, torch.bfloat16, False, FP8)


def test_a_given_config_is_run_as_given(launches):
    _attend(64, 1, config=dict(VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2))
    _attend(1, 1, config=dict(VARIANT="mma", WARPS=2))
    assert [name for name, _ in launches] == ["rows", "mma"]
    assert (launches[1][1]["VARIANT"], launches[1][1]["WARPS"]) == ("mma", 2)  # over decode_config's keys, unread


def test_pays_and_choose_warps():
    assert fp8_mma.pays(132, 132) and not fp8_mma.pays(131, 132)
    assert [fp8_mma.choose_warps(n, 132) for n in (2048, 1056, 1055, 264, 263, 16)] == [1, 1, 2, 2, 4, 4]


def test_what_the_kernel_cannot_write_or_read_is_named():
    """The output in q's dtype with unit stride, int32 tables and lengths (the kernel reads and writes them raw)."""
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 128, dtype=FP8)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    assert fp8_mma.supports(q, cache, cache, torch.zeros_like(q), table, lens) is None
    assert fp8_mma.supports(q, cache, cache, torch.zeros(2, 8, 128)) == (
        "the output must be torch.bfloat16 with unit stride along head_dim"
    )
    strided = torch.zeros(2, 8, 256, dtype=torch.bfloat16)[..., ::2]
    assert fp8_mma.supports(q, cache, cache, strided).startswith("the output must be")
    assert fp8_mma.supports(q, cache, cache, block_tables=table.long()) == (
        "block tables and sequence lengths must be int32, got torch.int64"
    )


def test_a_kernel_nvrtc_cannot_build_falls_back_to_triton_once(launches, monkeypatch):
    """A toolchain failure at the first build: a warning, the Triton kernel for this call and every later one (no
    second 1-s attempt), and the same failure named when the kernel is asked for by name."""
    calls = []

    def no_nvrtc(source, name):
        calls.append(name)
        raise RuntimeError("CUDA error: NVRTC_ERROR_BUILTIN_OPERATION_FAILURE\nmore")

    monkeypatch.setattr(fp8_mma, "FAILED", None)
    monkeypatch.setattr(torch.cuda, "_compile_kernel", no_nvrtc, raising=False)
    monkeypatch.setattr(fp8_mma, "launch_fp8_mma", lambda *args: fp8_mma._kernel(128, 4, True, True, (("T", 1),)))
    monkeypatch.setattr(fp8_mma, "runs", RUNS)  # itself, over the fixture's available() and supports()
    _attend(64, 1)
    _attend(64, 1)
    assert [name for name, _ in launches] == ["rows", "rows"] and calls == ["splitserve_fp8_decode"]
    assert fp8_mma.FAILED == "RuntimeError: CUDA error: NVRTC_ERROR_BUILTIN_OPERATION_FAILURE"
    with pytest.raises(fp8_mma.CompileError, match="NVRTC failed: RuntimeError: CUDA error: NVRTC_ERROR_BUILTIN"):
        _attend(64, 1, config=dict(VARIANT="mma"))
