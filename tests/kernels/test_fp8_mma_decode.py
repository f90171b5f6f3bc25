"""The e4m3-mma decode attention (kernels/paged_decode_attention_fp8_mma.py) against fp64 attention over the
cache's e4m3 values, on a GPU of capability >= 8.9: every head dim it takes, groups of 1-8 query
heads, pages of 4 and 16 tokens, split and unsplit, its options; and two structured cases that pin the
kernel's internal orders (a V that is the same for every token must come back exactly: the dims' order; keys of
zero give the plain mean of V: every token counted once)."""

import pytest
import torch

from splitserve.kernels import paged_decode_attention_fp8_mma as fp8_mma
from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton
from tests.kernels.conftest import DEVICE, PagedKv, dense_attention

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(
    DEVICE != "cuda" or not fp8_mma.available(), reason="needs a CUDA GPU with e4m3 mma (capability >= 8.9)"
)
SEQ_LENS = (1, 13, 64, 7, 100, 33)
# max |error| / max |reference|: q and P rounded to f16 in the kernel (2^-11), q's bf16 (2^-9) and the output's bf16
# rounding (2^-9)
TOL = 1e-2


def _run(head_dim=128, group=4, num_kv_heads=2, block_size=16, num_splits=1, seq_lens=SEQ_LENS, dtype=None, **opts):
    dtype = dtype or torch.bfloat16
    paged = PagedKv(list(seq_lens), num_kv_heads, head_dim, block_size, FP8, DEVICE, seed=head_dim + group)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), group * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention_triton(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        paged.seq_lens,
        scale,
        num_splits=num_splits,
        config=dict(VARIANT="mma", **opts),
    )
    assert out.dtype == dtype and not torch.isnan(out).any()
    want = torch.cat(
        [dense_attention(q[b : b + 1], paged.keys[b], paged.values[b], scale, n - 1) for b, n in enumerate(seq_lens)]
    )
    return (out.double().cpu() - want).abs().max().item() / want.abs().max().item(), paged, q, out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", fp8_mma.HEAD_DIMS)
def test_matches_fp64_attention(head_dim, group, num_splits):
    err = _run(head_dim, group, num_splits=num_splits)[0]
    assert err <= TOL, f"D {head_dim} group {group} splits {num_splits}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "opts",
    [
        dict(WARPS=1),
        dict(WARPS=1, EPI=0),
        dict(WARPS=2, MIN_BLOCKS=5),
        dict(WARPS=8),
        dict(AHEAD=0),
        dict(AHEAD=1, WARPS=2, TILE=16),
        dict(HEADS=2, WARPS=1),
        dict(HEADS=2, WARPS=2),
        dict(HEADS=4, WARPS=1),
        dict(HEADS=4, WARPS=4, TILE=16),
        dict(HEADS=2, AHEAD=0),
        dict(SEQS=2, WARPS=1),
        dict(SEQS=4, WARPS=2),
        dict(SEQS=4, WARPS=1, HEADS=2),
        dict(SEQS=5, WARPS=4, TILE=16),
        dict(SEQS=2, AHEAD=0),
        dict(SEQS=3, WARPS=1, EPI=0),
    ],
    ids=lambda o: ",".join(f"{k}{v}" for k, v in o.items()),
)
def test_options(opts):
    for block_size in (16, 32, 64):  # pages of a tile or more: a tile's tokens share one block
        err = _run(num_kv_heads=4, num_splits=2, block_size=block_size, **opts)[0]
        assert err <= TOL, f"{opts}, pages of {block_size}: relative error {err:.2e} > {TOL}"


def test_float16_queries_and_4_token_pages():
    err = _run(block_size=4, dtype=torch.float16, num_splits=2)[0]
    assert err <= TOL, f"relative error {err:.2e}"


def test_a_value_equal_for_every_token_comes_back_in_its_dims():
    """Every token's V row is the same per KV head: the output is that row (as bf16) for each query head, whatever
    the weights; a wrong dim order in the transposes or the store shows here as a permuted row."""
    paged = PagedKv([45, 70], 2, 128, 16, FP8, DEVICE, seed=1)
    row = (torch.arange(2 * 128, dtype=torch.float32).reshape(2, 128) / 32 - 4).to(FP8)  # distinct e4m3 values
    for b, n in enumerate([45, 70]):
        for pos in range(n):
            blk = int(paged.block_tables[b, pos // 16])
            paged.v_cache[blk, pos % 16] = row.to(DEVICE)
    q = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    want = row.float().repeat_interleave(4, dim=0).to(torch.bfloat16)  # (8 query heads, 128)
    # one warp writes from its registers (EPI), more merge through shared memory; an output whose rows are not
    # 16-byte aligned takes the one-warp store's element path
    for warps, epi, aligned in ((0, 1, True), (1, 1, True), (1, 1, False), (1, 0, True)):
        for splits in (1, 2):
            out = torch.empty(2, 8, 129, device=DEVICE, dtype=torch.bfloat16)[..., 1:] if not aligned else None
            out = paged_decode_attention_triton(
                q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.1, out=out,
                num_splits=splits, config=dict(VARIANT="mma", WARPS=warps, EPI=epi),
            )  # fmt: skip
            for b in range(2):
                assert torch.equal(out[b].cpu(), want), (
                    f"{warps} warps, EPI {epi}, aligned {aligned}, splits {splits}, sequence {b}: {out[b].cpu()}"
                )


def test_zero_keys_give_the_mean_of_the_values():
    """q . k = 0 for every token: equal weights, so the output is the plain mean over exactly the sequence's
    tokens (a token counted twice or a masked one let in moves it)."""
    seq_lens = [1, 31, 32, 33, 97]
    paged = PagedKv(seq_lens, 1, 64, 16, FP8, DEVICE, seed=5)
    for b, n in enumerate(seq_lens):
        for pos in range(n):
            paged.k_cache[int(paged.block_tables[b, pos // 16]), pos % 16] = 0
    q = torch.randn(len(seq_lens), 2, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    for warps, epi in ((1, 1), (1, 0), (2, 1)):
        out = paged_decode_attention_triton(
            q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 1.0,
            config=dict(VARIANT="mma", WARPS=warps, EPI=epi),
        )  # fmt: skip
        for b, n in enumerate(seq_lens):
            want = paged.values[b].double().mean(0)[0]  # (64,)
            err = (out[b].double().cpu() - want).abs().max().item()
            assert err <= 8e-3 * want.abs().max().item() + 1e-3, (
                f"{warps} warps, EPI {epi}, sequence {b} ({n} tokens): error {err:.2e}"
            )


def test_an_empty_sequence_gives_zeros():
    paged = PagedKv([0, 20], 2, 128, 16, FP8, DEVICE)
    q = torch.randn(2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    for splits in (1, 2):
        out = paged_decode_attention_triton(
            q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.1, num_splits=splits,
            config=dict(VARIANT="mma"),
        )  # fmt: skip
        assert torch.equal(out[0].cpu(), torch.zeros(8, 128, dtype=torch.bfloat16)), f"splits {splits}"


def test_what_it_cannot_run_is_named():
    paged = PagedKv([5], 1, 32, 16, FP8, DEVICE)
    q = torch.randn(1, 2, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="VARIANT 'mma' cannot run: head_dim 32 is not one of"):
        paged_decode_attention_triton(
            q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 1.0, config=dict(VARIANT="mma")
        )


def test_an_fp8_cache_on_this_gpu_defaults_to_it_given_one_program_an_sm_of_512_tokens():
    """No config: the mma kernel (its output bit for bit) once (sequence, KV head, split) programs are at least the
    SMs and each covers 512 tokens of the table; else the Triton rows variant (other sums' order: other bits)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = dict(VARIANT="rows", HEADS_FIRST=True, BLOCK_N=64, num_warps=4, num_stages=2)
    gen = torch.Generator().manual_seed(1)
    many = -(-sms // 8)  # 8 KV heads: programs enough at one split
    for num_seqs, tokens, picked in ((many, 512, "mma"), (2, 512, "rows"), (many, 256, "rows")):
        paged = PagedKv([tokens] * num_seqs, 8, 128, 16, FP8, DEVICE, seed=9)
        q = torch.randn(num_seqs, 32, 128, generator=gen).to(torch.bfloat16).to(DEVICE)
        args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.09)
        default = paged_decode_attention_triton(*args, num_splits=1)
        mma = paged_decode_attention_triton(*args, num_splits=1, config=dict(VARIANT="mma"))
        by_rows = paged_decode_attention_triton(*args, num_splits=1, config=rows)
        assert not torch.equal(mma, by_rows), "the two kernels gave the same bits: the test cannot tell them apart"
        assert torch.equal(default, mma if picked == "mma" else by_rows), f"{num_seqs} x {tokens}: not {picked}"
    assert fp8_mma.pays(132, 132, 512) and not fp8_mma.pays(16, 132, 512) and not fp8_mma.pays(256, 132, 256)
    assert fp8_mma.choose_warps(2048, 132) == 1 and fp8_mma.choose_warps(512, 132) == 2
    assert fp8_mma.choose_warps(132, 132) == 4


def test_units_a_program_cover_every_head_and_sequence_once():
    """Several KV heads and sequences a program, each (sequence, KV head)'s V a constant of its own: every query
    head's output is its own constant (a unit skipped, taken twice or read from a neighbour's slots shows here), also
    for a program whose last sequences are past the batch and for sequences of no tokens or fewer tiles than warps."""
    seq_lens = [40, 96, 1, 65, 0, 200, 33]
    paged = PagedKv(seq_lens, 4, 128, 16, FP8, DEVICE, seed=4)
    consts = torch.arange(len(seq_lens) * 4, dtype=torch.float32).view(-1, 4) / 8 - 1.5  # exact in e4m3 and bf16
    for b, n in enumerate(seq_lens):
        for pos in range(n):
            paged.v_cache[int(paged.block_tables[b, pos // 16]), pos % 16] = consts[b].view(4, 1).to(FP8).to(DEVICE)
    q = torch.randn(len(seq_lens), 8, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    want = consts.repeat_interleave(2, dim=1).unsqueeze(-1).expand(-1, -1, 128).clone()
    want[4] = 0  # no tokens: zeros
    want = want.to(torch.bfloat16)
    for opts in (
        dict(HEADS=1, SEQS=1),
        dict(HEADS=2, SEQS=1),
        dict(HEADS=4, SEQS=3),
        dict(HEADS=1, SEQS=2),
        dict(HEADS=2, SEQS=2, EPI=0),
    ):
        for warps in (1, 4):
            for splits in (1, 3):
                out = paged_decode_attention_triton(
                    q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.1, num_splits=splits,
                    config=dict(VARIANT="mma", WARPS=warps, **opts),
                )  # fmt: skip
                assert torch.equal(out.cpu(), want), f"{opts}, {warps} warps, splits {splits}: {out[:, :, 0].cpu()}"
