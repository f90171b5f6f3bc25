"""Implementation dispatch shared by every kernel file."""

import pytest
import torch

from splitserve.kernels._common import next_pow2, use_triton


def test_auto_picks_triton_only_for_cuda_tensors():
    assert use_triton("auto", torch.zeros(1), "op") is False
    assert use_triton("triton", torch.zeros(1), "op") is True
    assert use_triton("ref", torch.zeros(1), "op") is False
    if torch.cuda.is_available():
        assert use_triton("auto", torch.zeros(1, device="cuda"), "op") is True


def test_unknown_impl_names_the_op():
    with pytest.raises(ValueError, match=r"^rms_norm: impl='fast' is not one of \('auto', 'triton', 'ref'\)$"):
        use_triton("fast", torch.zeros(1), "rms_norm")


@pytest.mark.parametrize("n,expected", [(0, 1), (1, 1), (2, 2), (3, 4), (24, 32), (128, 128), (129, 256)])
def test_next_pow2(n, expected):
    assert next_pow2(n) == expected
