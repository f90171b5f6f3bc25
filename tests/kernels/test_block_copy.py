"""copy_blocks_by_index: whole blocks of one pool copied into another by index, bit for bit (Triton on the GPU or
the interpreter, and the torch reference), and the KV pull's use of it on one GPU."""

import pytest
import torch

from splitserve.kernels.block_copy import copy_blocks_by_index, index_rows

ON_GPU = torch.cuda.is_available()


def pools(num_src: int, num_dst: int, block_shape: tuple, dtype: torch.dtype, device: str):
    """A source pool of random bits and a destination of 0x7f bytes, blocks of `block_shape` elements of `dtype`."""
    g = torch.Generator().manual_seed(0)
    byte_shape = (*block_shape[:-1], block_shape[-1] * dtype.itemsize)
    src = torch.randint(0, 256, (num_src, *byte_shape), generator=g, dtype=torch.uint8).view(dtype)
    dst = torch.full((num_dst, *byte_shape), 0x7F, dtype=torch.uint8).view(dtype)
    return src.to(device), dst.to(device)


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize(
    "dtype, block_shape",
    [
        (torch.float32, (2, 2, 4, 2, 32)),  # words of 8 bytes
        (torch.bfloat16, (1, 2, 4, 1, 6)),  # 96 bytes a block: words of 8
        (torch.float8_e4m3fn, (1, 2, 1, 1, 6)),  # 12 bytes a block: words of 4
        (torch.float8_e4m3fn, (1, 1, 1, 1, 7)),  # 7 bytes a block: bytes
    ],
)
def test_the_named_blocks_are_copied_bit_for_bit_and_no_other_is_touched(device, impl, dtype, block_shape):
    src, dst = pools(12, 9, block_shape, dtype, device)
    src_ids, dst_ids = [7, 2, 2, 11, 0], [4, 0, 8, 1, 5]  # a source block read twice is fine
    before = dst.clone()
    moved = copy_blocks_by_index(src, src_ids, dst, dst_ids, impl=impl)
    assert moved == 5 * src[0].numel() * dtype.itemsize
    bits = dst.view(torch.uint8).cpu()
    for d in range(9):
        expected = src[src_ids[dst_ids.index(d)]] if d in dst_ids else before[d]
        assert torch.equal(bits[d], expected.view(torch.uint8).cpu()), d


def test_a_chunked_block_is_copied_whole(device):
    """A block larger than one program's chunk (32 KiB): 40,000 bytes, two programs a block, the last masked."""
    src, dst = pools(3, 3, (1, 1, 1, 1, 40000), torch.uint8, device)
    copy_blocks_by_index(src, [2, 0], dst, [0, 1], impl="triton")
    assert torch.equal(dst[0].cpu(), src[2].cpu()) and torch.equal(dst[1].cpu(), src[0].cpu())
    assert (dst[2].cpu() == 0x7F).all()


def test_bad_requests_are_refused_naming_what_is_wrong(device):
    src, dst = pools(4, 4, (1, 1, 1, 1, 8), torch.uint8, device)
    cases = [
        (([0, 1], [0]), "copy_blocks_by_index: 2 source blocks vs 1 destination blocks"),
        (([3, 4], [0, 1]), "copy_blocks_by_index: source block ids 3..4 outside the pool's 4 blocks"),
        (([0, 1], [-1, 0]), "copy_blocks_by_index: destination block ids -1..0 outside the pool's 4 blocks"),
        (([0, 1], [2, 2]), "copy_blocks_by_index: a destination block appears twice"),
    ]
    for (src_ids, dst_ids), message in cases:
        with pytest.raises(ValueError) as info:
            copy_blocks_by_index(src, src_ids, dst, dst_ids, impl="triton")
        assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        copy_blocks_by_index(src, [0], torch.zeros(4, 1, 1, 1, 1, 9, dtype=torch.uint8, device=device), [0])
    assert str(info.value) == (
        "copy_blocks_by_index: block shapes differ: source (1, 1, 1, 1, 8) x 1 B, destination (1, 1, 1, 1, 9) x 1 B"
    )
    assert (dst.cpu() == 0x7F).all()  # nothing was copied


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_a_pull_of_many_runs_on_one_gpu_takes_the_kernel(monkeypatch):
    import splitserve.engine.kv_connectors.block_copies as copies

    calls = []
    monkeypatch.setattr(copies, "copy_blocks", lambda *args: calls.append("gather"))
    src, dst = pools(64, 40, (2, 2, 16, 2, 64), torch.bfloat16, "cuda")
    src_ids = list(range(0, 64, 2))  # 32 runs
    copies.copy_block_runs(src, src_ids, dst, list(range(32)))
    assert calls == []
    # compared as bytes: random bits hold NaNs, which torch.equal finds unequal to themselves
    assert torch.equal(dst[:32].view(torch.uint8), src[src_ids].view(torch.uint8))


@pytest.mark.parametrize("n", range(1, 10))
def test_the_id_rows_start_16_bytes_apart_whatever_their_length(n):
    """Triton compiles a variant per pointer alignment: both rows start at a 16-byte boundary for any count."""
    src_ids, dst_ids = list(range(n)), list(range(100, 100 + n))
    src_rows, dst_rows = index_rows(src_ids, dst_ids, torch.device("cpu"))
    assert src_rows.tolist() == src_ids and dst_rows.tolist() == dst_ids
    assert src_rows.data_ptr() % 16 == 0 and dst_rows.data_ptr() % 16 == 0
