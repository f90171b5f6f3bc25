"""Which kernel paged_decode_attention picks for an e4m3 cache on a GPU where the mma kernel runs
(kernels/paged_decode_attention_fp8_mma.py), checked on any machine: the launches are recorded, not run. The mma
kernel once the (sequence, KV head, split) programs are at least the SMs and each covers at least 512 tokens of the
block table (`fp8_mma.pays`), the Triton rows variant otherwise (at the 8B step's batch 1 it was 0.03-0.04 ms a
step faster, docs/performance.md) and whenever a config is given."""

import ctypes
import importlib

import pytest
import torch

from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma
from splitserve.kernels.paged_decode_config import decode_config

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


class _NoMerge:
    """Stands in for the merge kernel of a split launch (recorded launches write no partials)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _attend(num_seqs: int, num_splits: int, config=None, width: int = 32, monkeypatch=None):
    """One decode attention over an e4m3 cache of 8 KV heads, pages of 16 tokens, tables `width` blocks wide."""
    q = torch.zeros(num_seqs, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=FP8)
    table = torch.zeros(num_seqs, width, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    out = torch.zeros_like(q)
    if num_splits > 1:
        monkeypatch.setattr(pda, "_merge_splits_kernel", _NoMerge())
    return pda.paged_decode_attention_triton(q, cache, cache, table, seq_lens, 0.1, out, num_splits, config)


@pytest.mark.parametrize(
    ("num_seqs", "num_splits", "width", "kernel"),
    [
        (17, 1, 32, "mma"),  # 136 programs of 512 tokens
        (16, 1, 32, "rows"),  # 128 programs: fewer than the SMs
        (1, 1, 32, "rows"),
        (17, 1, 31, "rows"),  # 496 tokens a program
        (1, 32, 512, "rows"),  # the 8B step at batch 1 in a graph: 256 programs of 256 tokens
        (4, 16, 2048, "mma"),  # (4, 32768) in 16 splits: 512 programs of 2,048 tokens
    ],
)
def test_mma_from_one_program_an_sm_of_512_tokens(launches, monkeypatch, num_seqs, num_splits, width, kernel):
    _attend(num_seqs, num_splits, width=width, monkeypatch=monkeypatch)
    assert [name for name, _ in launches] == [kernel], f"{num_seqs} x 8 x {num_splits} programs, {width} blocks"
    if kernel == "mma":
        assert launches[0][1] == dict(VARIANT="mma")  # its options from the work: choose_warps, AHEAD on
    else:
        assert launches[0][1] == decode_config(128, torch.bfloat16, False, FP8)


def test_a_given_config_is_run_as_given(launches):
    _attend(64, 1, config=dict(VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2))
    _attend(1, 1, config=dict(VARIANT="mma", WARPS=2))
    assert [name for name, _ in launches] == ["rows", "mma"]
    assert (launches[1][1]["VARIANT"], launches[1][1]["WARPS"]) == ("mma", 2)  # over decode_config's keys, unread


def test_pays_and_choose_warps():
    assert fp8_mma.pays(132, 132, 512) and not fp8_mma.pays(131, 132, 512) and not fp8_mma.pays(132, 132, 511)
    assert [fp8_mma.choose_warps(n, 132) for n in (2048, 1056, 1055, 264, 263, 16)] == [1, 1, 2, 2, 4, 4]


@pytest.mark.parametrize(
    ("num_seqs", "num_splits", "config", "grid", "warps", "seqs"),
    [
        (256, 1, {}, (8, 256, 1), 1, 1),  # 2,048 (sequence, KV head) units: one a one-warp program
        (255, 1, dict(SEQS=2), (8, 128, 1), 1, 2),  # the last program's second sequence is past the batch
        (128, 1, {}, (8, 128, 1), 2, 1),  # 1,024: two warps a program
        (16, 4, {}, (8, 16, 4), 2, 1),  # 512 with the splits: two warps a program
        (4, 1, {}, (8, 4, 1), 4, 1),
        (256, 1, dict(HEADS=4, SEQS=1, WARPS=2), (2, 256, 1), 2, 1),  # asked for
        (256, 1, dict(HEADS=2, SEQS=3), (4, 86, 1), 1, 3),
    ],
)
def test_the_launch_grid(monkeypatch, num_seqs, num_splits, config, grid, warps, seqs):
    """launch_fp8_mma's grid (KV heads / HEADS, sequences / SEQS, splits), block (WARPS x 32) and sequence count on a
    132-SM GPU, 8 KV heads; the launch recorded, not run."""
    got = []
    monkeypatch.setattr(fp8_mma, "num_sms", lambda index: 132)
    monkeypatch.setattr(fp8_mma, "_kernel", lambda *key: lambda *args: got.append((key, args)))
    q = torch.zeros(num_seqs, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=FP8)
    table, lens = torch.zeros(num_seqs, 1, dtype=torch.int32), torch.ones(num_seqs, dtype=torch.int32)
    fp8_mma.launch_fp8_mma(q, cache, cache, table, lens, q, q, q, 0.1, num_splits, dict(VARIANT="mma", **config))
    ((key, (got_grid, block, _, ints, _)),) = got
    assert key[4] is False  # PDL: not for CPU tensors (pdl_launch)
    options = dict(key[-1])
    assert (got_grid, block, options["WARPS"], options["SEQS"]) == (grid, (32 * warps, 1, 1), warps, seqs)
    assert ints[:4] == [num_splits, 4, 32, num_seqs]  # splits, log2 of the page, query heads, sequences


def test_heads_that_do_not_divide_the_kv_heads_are_refused(monkeypatch):
    monkeypatch.setattr(fp8_mma, "num_sms", lambda index: 132)
    monkeypatch.setattr(fp8_mma, "_kernel", lambda *key: pytest.fail("launched"))
    q, cache = torch.zeros(2, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 16, 8, 128, dtype=FP8)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for heads in (3, 0):
        with pytest.raises(ValueError, match=f"VARIANT 'mma' HEADS {heads} does not divide 8"):
            fp8_mma.launch_fp8_mma(q, cache, cache, table, lens, q, q, q, 0.1, 1, dict(VARIANT="mma", HEADS=heads))
    with pytest.raises(ValueError, match="VARIANT 'mma' SEQS must be at least 1, got 0"):
        fp8_mma.launch_fp8_mma(q, cache, cache, table, lens, q, q, q, 0.1, 1, dict(VARIANT="mma", SEQS=0))


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
    build = lambda *args: fp8_mma._kernel(128, 4, True, True, False, (("T", 1),))  # noqa: E731
    monkeypatch.setattr(fp8_mma, "launch_fp8_mma", build)
    monkeypatch.setattr(fp8_mma, "runs", RUNS)  # itself, over the fixture's available() and supports()
    _attend(64, 1)
    _attend(64, 1)
    assert [name for name, _ in launches] == ["rows", "rows"] and calls == ["splitserve_fp8_decode"]
    assert fp8_mma.FAILED == "RuntimeError: CUDA error: NVRTC_ERROR_BUILTIN_OPERATION_FAILURE"
    with pytest.raises(fp8_mma.CompileError, match="NVRTC failed: RuntimeError: CUDA error: NVRTC_ERROR_BUILTIN"):
        _attend(64, 1, config=dict(VARIANT="mma"))


def test_the_pdl_launch_config_has_the_drivers_layout():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on 64-bit hosts: the
    attribute's value union at byte 8 of 72, the config's stream at 32, attributes at 40, their count at 48."""
    attr, config = fp8_mma._LaunchAttribute, fp8_mma._LaunchConfig
    assert (ctypes.sizeof(attr), attr.value.offset) == (72, 8)
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset, ctypes.sizeof(config)) == (
        32,
        40,
        48,
        56,
    )


def test_a_pdl_device_builds_and_launches_the_pdl_kernel(monkeypatch):
    got = []
    monkeypatch.setattr(fp8_mma, "num_sms", lambda index: 132)
    monkeypatch.setattr(fp8_mma, "pdl_launch", lambda t: {"PDL": True, "launch_pdl": True})
    monkeypatch.setattr(fp8_mma, "_kernel", lambda *key: lambda *args: got.append(key))
    q, cache = torch.zeros(2, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 16, 8, 128, dtype=FP8)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    fp8_mma.launch_fp8_mma(q, cache, cache, table, lens, q, q, q, 0.1, 1, dict(VARIANT="mma"))
    assert got[0][4] is True
