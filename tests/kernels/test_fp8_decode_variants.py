"""The fp8 decode attention tile variants (kernels/paged_decode_attention_fp8.py) against fp64 attention over
the cache's e4m3 values: every variant, both conversions, split and unsplit, either grid order, a page size
that is not a power of two. On CPU the Triton interpreter runs them with the PTX conversions replaced by
plain operations (same values, same column order); on a GPU the PTX itself runs."""

import pytest
import torch

from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton
from splitserve.kernels.paged_decode_attention_fp8 import FP8_VARIANTS
from tests.kernels.conftest import DEVICE, PagedKv, dense_attention

FP8 = torch.float8_e4m3fn
ON_GPU = DEVICE == "cuda"
# the interpreter: small tiles, no pipelining; a GPU: the sizes the bench sweeps
TILE = dict(BLOCK_N=64, num_warps=4, num_stages=2) if ON_GPU else dict(BLOCK_N=16, num_warps=4, num_stages=1)
# max |error| against fp64 over the same e4m3 values, q float32 (its fp16 rounding: <= 2^-11 relative).
# tokens_qk8 rounds q to e4m3 itself (3 mantissa bits): measured 0.066 on these shapes; the hi + lo pair
# of tokens_qk8x2 brings that to 0.002.
TOL = {"rows": 2e-3, "tokens": 2e-3, "tokens_qk8": 0.1, "tokens_qk8x2": 1e-2}


def _run(variant, conv, num_splits, seq_lens=(1, 13, 64, 7), block_size=4, q_dtype=torch.float32, **options):
    paged = PagedKv(list(seq_lens), 2, 32, block_size, FP8, DEVICE, seed=3)
    q = torch.randn(len(seq_lens), 4, 32, generator=torch.Generator().manual_seed(4)).to(q_dtype).to(DEVICE)
    scale = 32**-0.5
    cfg = dict(TILE, VARIANT=variant, CONV=conv, **options)
    out = paged_decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, num_splits=num_splits, config=cfg
    )
    assert out.dtype == q_dtype
    errs = []
    for b, n in enumerate(seq_lens):
        want = dense_attention(q[b : b + 1], paged.keys[b], paged.values[b], scale, first_pos=n - 1)
        errs.append((out[b : b + 1].double().cpu() - want).abs().max().item())
    return max(errs)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("conv", [0, 1])
@pytest.mark.parametrize("variant", sorted(FP8_VARIANTS))
def test_variant_matches_fp64_attention(variant, conv, num_splits):
    err = _run(variant, conv, num_splits)
    assert err <= TOL[variant], f"{variant} CONV {conv} splits {num_splits}: max error {err:.2e} > {TOL[variant]}"


@pytest.mark.parametrize("variant", ["rows", "tokens"])
def test_heads_first_grid_and_uneven_pages(variant):
    """Programs ordered (KV head, sequence, split), and 6-token pages: groups of 2 rows per block-table entry."""
    err = _run(variant, 0, 2, seq_lens=(5, 31, 40), block_size=6, HEADS_FIRST=True)
    assert err <= TOL[variant], f"{variant}: max error {err:.2e}"


@pytest.mark.parametrize("variant", ["rows", "tokens", "tokens_qk8x2"])
def test_prefetched_words(variant):
    """PREFETCH: each tile's words loaded during the previous tile, the last load wholly past the context."""
    err = _run(variant, 0, 2, seq_lens=(5, 31, 40, 16), PREFETCH=True, num_stages=1)
    assert err <= TOL[variant], f"{variant}: max error {err:.2e}"


def test_bfloat16_q_gives_bfloat16_output():
    err = _run("tokens", 0, 1, q_dtype=torch.bfloat16)
    assert err <= 1.6e-2, f"max error {err:.2e}"  # bf16 output rounding: 2^-9 relative


@pytest.mark.parametrize(
    ("variant", "cache_dtype", "head_dim", "message"),
    [
        ("wide", FP8, 32, "VARIANT 'wide' is not 'upcast' or one of ['rows', 'tokens', 'tokens_qk8', 'tokens_qk8x2']"),
        ("tokens", torch.float32, 32, "VARIANT 'tokens' reads float8_e4m3fn caches, got torch.float32"),
        ("rows", FP8, 24, "VARIANT 'rows' needs a power-of-two head_dim >= 16, got 24"),
    ],
)
def test_unsupported_variant_is_refused(variant, cache_dtype, head_dim, message):
    paged = PagedKv([5], 1, head_dim, 4, torch.float32, "cpu")
    k_cache, v_cache = paged.k_cache.to(cache_dtype), paged.v_cache.to(cache_dtype)
    q = torch.zeros(1, 1, head_dim)
    with pytest.raises(ValueError) as err:
        paged_decode_attention_triton(
            q, k_cache, v_cache, paged.block_tables, paged.seq_lens, 1.0, config=dict(TILE, VARIANT=variant)
        )
    assert str(err.value) == f"paged_decode_attention: {message}"


@pytest.mark.parametrize("hpp", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads_first", [False, True])
def test_rows_over_several_kv_heads_per_program(hpp, num_splits, heads_first):
    """HEADS_PER_PROGRAM: one program reads both KV heads (tile rows = (token, head) pairs, each query row masked
    to its own head's rows); uneven pages, partial last tiles, split and unsplit."""
    err = _run("rows", 1, num_splits, seq_lens=(5, 31, 40, 1), block_size=6, HEADS_FIRST=heads_first,
               HEADS_PER_PROGRAM=hpp)  # fmt: skip
    assert err <= TOL["rows"], f"HEADS_PER_PROGRAM {hpp}, splits {num_splits}: max error {err:.2e}"


def test_rows_over_four_heads_of_a_group_of_two():
    """8 KV heads, 16 query heads (Qwen3's grouping), 4 KV heads a program: 8 query rows of the 16."""
    paged = PagedKv([9, 33], 8, 32, 4, FP8, DEVICE, seed=5)
    q = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    scale = 32**-0.5
    cfg = dict(TILE, VARIANT="rows", HEADS_PER_PROGRAM=4, HEADS_FIRST=True)
    out = paged_decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, num_splits=2, config=cfg
    )
    for b, n in enumerate([9, 33]):
        want = dense_attention(q[b : b + 1], paged.keys[b], paged.values[b], scale, first_pos=n - 1)
        err = (out[b : b + 1].double().cpu() - want).abs().max().item()
        assert err <= TOL["rows"], f"sequence {b}: max error {err:.2e}"


@pytest.mark.parametrize(
    "variant,hpp,message",
    [
        ("rows", 3, "HEADS_PER_PROGRAM 3 must be >= 1 and divide the 2 KV heads"),
        ("rows", 0, "HEADS_PER_PROGRAM 0 must be >= 1 and divide the 2 KV heads"),
        ("tokens", 2, "HEADS_PER_PROGRAM 2 needs VARIANT 'rows', got 'tokens'"),
    ],
)
def test_heads_per_program_is_checked(variant, hpp, message):
    with pytest.raises(ValueError, match=message):
        _run(variant, 0, 1, HEADS_PER_PROGRAM=hpp)


def test_rows_over_two_heads_with_eight_token_tiles():
    """The bench's shape of HEADS_PER_PROGRAM: the token tile cut as the heads grow (8 tokens x 2 heads: 16 rows)."""
    err = _run("rows", 0, 2, seq_lens=(5, 31, 40, 16), block_size=16, HEADS_PER_PROGRAM=2, BLOCK_N=8)
    assert err <= TOL["rows"], f"max error {err:.2e}"
