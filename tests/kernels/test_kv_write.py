"""KV-cache write (Triton and reference) into strided block-major caches."""

import pytest
import torch

from splitserve.kernels import write_kv

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def check_write(device, *, num_tokens, num_kv_heads, head_dim, block_size, dtype, src_dtype, impl, pad_every):
    num_layers = 3
    num_blocks = num_tokens // block_size + 2  # enough slots for every token
    kv = torch.full(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device
    )
    k_cache, v_cache = kv[:, 2, 0], kv[:, 2, 1]  # strided views: block stride is 3*2*bs*H*D
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # distinct slots
    slots[::pad_every] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype).to(device)
    write_kv(key, value, k_cache, v_cache, slots.to(device), impl=impl)
    expected = torch.full_like(kv, float("nan"))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 2, 0, slot % block_size] = key[t].to(dtype)
            expected[slot // block_size, 2, 1, slot % block_size] = value[t].to(dtype)
    # equal_nan: every slot not written (other layers, padding) must still hold the poison
    assert torch.equal(kv.isnan(), expected.isnan())
    assert torch.equal(kv.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 4), (3, 24, 8), (1, 32, 16)])
def test_write_matches_expected(device, impl, dtype, num_kv_heads, head_dim, block_size):
    check_write(
        device,
        num_tokens=11,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        src_dtype=dtype,
        impl=impl,
        pad_every=4,
    )


def test_write_casts_to_cache_dtype(device):
    check_write(
        device,
        num_tokens=9,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float16,
        src_dtype=torch.float32,
        impl="triton",
        pad_every=3,
    )


def test_slot_mapping_shape_error(device):
    key = torch.zeros(3, 2, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"^write_kv: slot_mapping must be \(3,\), got \(2,\)$"):
        write_kv(key, key, cache, cache, torch.zeros(2, dtype=torch.int64, device=device))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    check_write(
        "cuda",
        num_tokens=300,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        src_dtype=dtype,
        impl="triton",
        pad_every=7,
    )
