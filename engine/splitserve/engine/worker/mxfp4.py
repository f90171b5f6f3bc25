"""MXFP4 weights (OCP microscaling FP4, as gpt-oss checkpoints store their experts), dequantized at load.

A row of K values is stored as K/32 blocks of 32 FP4 (e2m1) codes, two per byte, plus one uint8 exponent per block:

    X_blocks (..., K/32, 16) uint8   byte j of a block: code of value 2j in its low nibble, of value 2j+1 in its high
    X_scales (..., K/32)     uint8   the block's power of two, biased by 127 (E8M0)
    value = E2M1[code] * 2 ** (scale - 127)      E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6, then the same negated

`dequantize_mxfp4` gives (..., K) in the model dtype; `load_mxfp4_pair` is the loader's side: a checkpoint tensor
X is complete once both its _blocks and _scales have been read, then its values fill the model's target.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
VALUES_PER_BLOCK = 32
PARTS = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., G, 16) uint8 codes and (..., G) uint8 exponents -> (..., G * 32) values in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != VALUES_PER_BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks must be "
            f"scales' shape + ({VALUES_PER_BLOCK // 2},)"
        )
    codes = blocks.to(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = values.reshape(*scales.shape, VALUES_PER_BLOCK)  # low nibble first: value 2j, then 2j + 1
    exponents = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS  # (..., G, 1)
    return torch.ldexp(values, exponents).to(dtype).reshape(*scales.shape[:-1], -1)  # (..., K)


def mxfp4_base_name(name: str) -> tuple[str, str] | None:
    """("X", "_blocks" | "_scales") for a checkpoint tensor named X_blocks / X_scales, else None."""
    for part in PARTS:
        if name.endswith(part):
            return name.removesuffix(part), part
    return None


def load_mxfp4_pair(
    pending: dict[str, dict[str, torch.Tensor]],
    base: str,
    part: str,
    tensor: torch.Tensor,
    target: torch.Tensor,
    shard=None,
) -> bool:
    """Keep `tensor` (part `part` of checkpoint tensor `base`) until its other part arrives, then fill `target`
    (the values' shape) with the dequantized values, or (tensor parallel) their `shard` (a `TpShard`: `size`
    entries from `start` along `dim`); returns whether `base` is now loaded."""
    parts = pending.setdefault(base, {})
    parts[part] = tensor
    if len(parts) < len(PARTS):
        return False
    del pending[base]
    values = dequantize_mxfp4(parts["_blocks"], parts["_scales"], target.dtype)
    if shard is not None:
        values = values.narrow(shard.dim, shard.start, shard.size)
    if tuple(values.shape) != tuple(target.shape):
        raise ValueError(
            f"MXFP4 tensor {base!r} dequantizes to shape {tuple(values.shape)}, expected {tuple(target.shape)}"
        )
    target.copy_(values)
    return True
