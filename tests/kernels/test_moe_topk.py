"""MoE routing in one launch (Triton; the interpreter on CPU) against transformers' torch sequence."""

import pytest
import torch

from splitserve.kernels.moe_topk import moe_topk, moe_topk_ref


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,renormalize",
    [(5, 8, 2, True), (9, 128, 8, False), (6, 60, 4, True), (3, 6, 6, True)],
)
def test_ids_equal_and_weights_match_the_reference(num_tokens, num_experts, top_k, renormalize, device):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(device)
    weights, ids = moe_topk(logits, top_k, renormalize, torch.float32, impl="triton")
    want_weights, want_ids = moe_topk_ref(logits, top_k, renormalize, torch.float32)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(num_tokens, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_give_weights_in_the_asked_dtype(dtype, device):
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    weights, ids = moe_topk(logits, 2, True, dtype, impl="triton")
    want_weights, want_ids = moe_topk_ref(logits, 2, True, dtype)
    assert weights.dtype == dtype
    assert torch.equal(ids.sort(1).values.cpu(), want_ids.sort(1).values.cpu())  # ties may come in either order
    torch.testing.assert_close(weights.sort(1).values, want_weights.sort(1).values, atol=4e-3, rtol=8e-3)


def test_a_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"^moe_topk: top_k 9 must be in \[1, 8\] \(the number of experts\)$"):
        moe_topk(torch.zeros(2, 8), 9, True, torch.float32)
