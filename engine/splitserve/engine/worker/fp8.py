"""FP8 (e4m3) quantization: the math, and the linear layer that multiplies in eight bits.

    weight (N, K) -> w_q (N, K) float8_e4m3fn, weight_scale (N,) fp32     w ~= w_q * weight_scale[:, None]
    x (T, K)      -> x_q (T, K) float8_e4m3fn, x_scale (T, 1) fp32         x ~= x_q * x_scale
    y = (x_q @ w_q^T) * x_scale * weight_scale^T (+ bias)                  (T, N) in x's dtype

Weights have one scale per output channel (row), activations one per token (row), computed as
each step runs (dynamic); a checkpoint with static activation scales gives one per layer
(`input_scale`). Scales are amax / 448 (448 = e4m3's largest finite value), so every row uses
the whole range; values are clamped to +-448 before the cast (the cast itself does not saturate).

`Fp8Linear` multiplies in one of two ways, by the number of rows T of the step:

    T <= w8a16_max_rows   W8A16: x stays in its dtype, y = (x @ w_q^T) * weight_scale^T, fp32 sums;
                          on CUDA (capability >= 8.9) kernels.fp8_skinny_linear, which streams the
                          one-byte weight once (a decode step of a few rows is bound by those bytes)
    T >  w8a16_max_rows   W8A8: activations quantized per token as above; on CUDA (capability >= 8.9,
                          K and N multiples of 16, as cuBLASLt/CUTLASS need) `torch._scaled_mm`

w8a16_max_rows comes from EngineConfig.fp8_w8a16_max_rows (at most the kernel's 16 rows) and is 0 by
default: every step W8A8, on every device, as vLLM runs fp8 checkpoints. 16 makes a few-row decode step faster
(docs/performance.md, "Findings that set defaults"); it stays opt-in because with it on, W8A16 and W8A8 differ
by the activations' quantization error, so a token's result depends on how many rows its step had (W8A8 alone
is batch-invariant, as the tests of disaggregated against colocated tokens need). Off the GPU each path runs its
reference: W8A16 the same sums in fp32 (fp64 for fp64 x), W8A8 both operands dequantized to x's dtype and multiplied.
Kernel and reference see the same quantized operands, so they differ only by accumulation order.

Block-wise checkpoints (`block` = (bn, bk), as DeepSeek-V3 and Qwen3's FP8 releases are written) scale the weight per
bn x bk tile and the activations per token per bk-wide group, both dynamic:

    weight (N, K) -> w_q, block scale (ceil(N / bn) per part, K / bk)     w ~= w_q * scale[n // bn, k // bk]
    x (T, K)      -> x_q, x_scale (T, K / bk)                             x ~= x_q * x_scale[t, k // bk]
    y[t, n] = sum over groups g of (x_q[t, g] . w_q[n, g]) * x_scale[t, g] * scale[n // bn, g]

W8A8 at every size (no W8A16 rows); on CUDA capability >= 8.9 kernels.fp8_block_linear up to 16 rows and from 17
`torch._scaled_mm`'s block scaling (128 x 128 tiles whose rows line up with every fused part, where this torch takes
it, K / 128 a multiple of 4: `block_scaled_mm_works`), elsewhere both operands dequantized to the model's dtype and
multiplied. Unlike per-channel W8A8 this is not batch-invariant on a GPU: the kernel (up to 16 rows, one 16-row tile)
and cuBLASLt (from 17, its kernels picked by the row count) sum in their own orders, so a token's result may depend on
its step's row count in the last bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels.tuned_configs import tuned_configs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Smallest scale: a row of zeros quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# (major, minor) compute capability from which cuBLASLt/CUTLASS multiply e4m3 operands (Ada, Hopper),
# and from which Triton converts e4m3 in registers.
SCALED_MM_MIN_CAPABILITY = (8, 9)
# Most rows a W8A16 step may have: kernels.fp8_skinny_linear's MAX_ROWS (one tensor-core tile), kept here so
# that a CPU load does not import Triton; tests/engine/test_fp8.py checks the two (and EngineConfig's limit) agree.
MAX_W8A16_ROWS = 16
# Tiles for kernels.fp8_skinny_linear, {("gemv" (one row) | "dot", N, K): config}, over the kernel's own choice
# (fp8_skinny_config); read when a layer is finalized. None: the device's tuned table
# (kernels/splitserve/kernels/configs, dtype fp8_w8a16), where there is one; a dict replaces it ({}: the
# kernel's own tiles everywhere; benchmarks/offline_throughput.py --fp8-tiles sets a sweep's).
W8A16_TILES: dict[tuple[str, int, int], dict] | None = None


def cuda_device_name(device: torch.device) -> str:
    """The CUDA device's name (what the measured tables are keyed on)."""
    return torch.cuda.get_device_name(device)


def measured_w8a16_tiles(device: torch.device) -> dict[tuple[str, int, int], dict]:
    """W8A16_TILES when set, else the tuned table of `device` ({} on the CPU and on GPUs none was tuned for)."""
    if W8A16_TILES is not None:
        return W8A16_TILES
    if device.type != "cuda":
        return {}
    tables = tuned_configs("fp8_skinny_linear", cuda_device_name(device), "fp8_w8a16")
    return {(mode, n, k): config for mode, table in tables.items() for (n, k), config in table.items()}


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Clamp to +-FP8_MAX and cast to e4m3 (round to nearest even)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(weight: torch.Tensor, row_max=None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (w_q (N, K) e4m3, scale (N,) fp32), one scale per output row. `row_max`: a callable
    taking each row's amax (N,) and returning the whole row's, for a row-parallel shard whose other columns
    are on other ranks (`TpGroup.all_reduce_max`), so every rank scales a row as the unsharded weight does."""
    w = weight.float()
    amax = w.abs().amax(dim=1)  # (N,)
    if row_max is not None:
        amax = row_max(amax)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)  # (N,)
    return to_fp8(w / scale[:, None]), scale


def quantize_experts(experts: nn.Module, down_row_max=None) -> None:
    """A mixture of experts' stacked weights `gate_up_proj` (E, 2F, H) and `down_proj` (E, H, F) to e4m3 in place,
    with one float32 scale per expert and output row as `gate_up_scale` (E, 2F) and `down_scale` (E, H) (W8A16 in
    kernels.fused_moe: activations stay 16-bit); biases, where a family has them, stay in the model dtype.
    `down_row_max`: tensor parallel, where down's rows are split by columns (`quantize_per_channel`'s row_max)."""
    for name, scale_name in (("gate_up_proj", "gate_up_scale"), ("down_proj", "down_scale")):
        weight = getattr(experts, name)
        num_experts, rows, cols = weight.shape
        row_max = down_row_max if name == "down_proj" else None
        w_q, scale = quantize_per_channel(weight.data.reshape(num_experts * rows, cols), row_max)
        setattr(experts, name, nn.Parameter(w_q.view(num_experts, rows, cols), requires_grad=False))
        setattr(experts, scale_name, nn.Parameter(scale.view(num_experts, rows), requires_grad=False))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) -> (x_q (T, K) e4m3, scale (T, 1) fp32), one scale per row (token)."""
    if x.is_cuda:
        from splitserve.kernels.fp8_quant import quantize_per_token as fused

        return fused(x, MIN_SCALE)
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # (T, 1)
    return to_fp8(xf / scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int, column_major: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K), K a multiple of `group` -> (x_q (T, K) e4m3, scale (T, K / group) fp32): one scale per token
    per `group` consecutive features (amax / 448, at least MIN_SCALE). On CUDA one launch (kernels.fp8_quant), the
    scales token-fastest in columns padded to `column_major` tokens when that is > 0 (cuBLASLt's block scaling)."""
    if x.is_cuda and group & (group - 1) == 0:
        from splitserve.kernels.fp8_quant import quantize_per_token_group as quantize

        return quantize(x if x.stride(1) == 1 else x.contiguous(), group, MIN_SCALE, column_major=column_major)
    rows, k = x.shape
    xf = x.float().reshape(rows, k // group, group)
    scale = (xf.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)  # (T, K / group)
    return to_fp8(xf / scale[..., None]).view(rows, k), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (T, K) with one given scale () fp32 -> x_q (T, K) e4m3."""
    return to_fp8(x.float() / scale)


def dequantize(x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_q * scale in `dtype` (scale broadcasts: (N, 1) per row, () per tensor)."""
    return (x_q.to(dtype) * scale.to(dtype)).to(dtype)


def w8a16_ref(x: torch.Tensor, w_q: torch.Tensor, weight_scale: torch.Tensor, bias=None) -> torch.Tensor:
    """x (T, K) times e4m3 w_q (N, K) scaled per row, x unquantized: fp32 sums (fp64 for fp64 x), the
    row scale after the sum, the bias, one rounding to x's dtype (kernels.fp8_skinny_linear's math)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = (x.to(acc) @ w_q.to(acc).t()) * weight_scale.to(acc)  # (T, N)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


# Block-wise steps of at least this many rows multiply through torch._scaled_mm's block scaling (cuBLASLt: 128 x 128
# weight tiles, activations per token per 128 features), fewer through kernels.fp8_block_linear: up to 16 rows the
# kernel's 16-row tiles win; from 17 its 64-row tiles lose on the wide projections (docs/performance.md, "Findings
# that set defaults").
BLOCK_SCALED_MM_MIN_ROWS = 17
# What cuBLASLt's block scaling (through torch 2.11's _scaled_mm) takes: the activations' scales token-fastest with a
# column stride of exactly the row count, a multiple of 4 (so a step's rows are padded to one); the tiles' scales read
# as if each row of them were padded to 4 groups (torch does not check it: other K give wrong sums), so K / 128 must be
# a multiple of 4 (docs/performance.md, "Findings that set defaults").
BLOCK_SCALED_MM_PAD = 4


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x (T, K) in 16 bits times an e4m3 weight (N, K) in 128 x 128 tiles of scales `tiles` (N / 128, K / 128)
    through _scaled_mm's block scaling: x quantized per token per 128 features, its rows padded to a multiple of
    BLOCK_SCALED_MM_PAD -> (T, N) bf16."""
    rows = x.shape[0]
    padded = -(-rows // BLOCK_SCALED_MM_PAD) * BLOCK_SCALED_MM_PAD
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    x_q, x_scale = quantize_per_token_group(x, 128, column_major=BLOCK_SCALED_MM_PAD)  # scales' stride: padded
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=tiles.t(), out_dtype=torch.bfloat16)
    return y[:rows]


@functools.cache
def block_scaled_mm_works(device_index: int) -> bool:
    """Whether this torch's _scaled_mm gives block_scaled_mm's product on CUDA device `device_index` (torch 2.11
    does; older ones raise): one product of random operands at an odd row count, against the reference sums."""
    from splitserve.kernels.fp8_block_linear import fp8_block_linear_ref

    device = torch.device("cuda", device_index)
    lasting = (torch.cuda.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.cuda.OutOfMemoryError))
    with torch.cuda.device(device):  # the Triton quantizer launches on the current device
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(BLOCK_SCALED_MM_MIN_ROWS, 512, device=device, generator=gen).to(torch.bfloat16)
        weight = to_fp8(torch.randn(256, 512, device=device, generator=gen) * 100)
        tiles = torch.rand(2, 4, device=device, generator=gen) + 0.5
        try:
            got = block_scaled_mm(x, weight, tiles).float()
        except lasting:  # the device's trouble, not this torch's recipe: not cached as an answer
            raise
        except (RuntimeError, TypeError, ValueError):  # the scales' shapes are not a recipe this torch knows
            return False
        x_q, x_scale = quantize_per_token_group(x, 128)
        want = fp8_block_linear_ref(x_q, x_scale, weight, tiles.repeat_interleave(128, 0), out_dtype=torch.float32)
        return bool((got - want).norm() <= 2e-3 * want.norm())


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` multiplies e4m3 operands on `device` (CUDA, capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= SCALED_MM_MIN_CAPABILITY


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored in e4m3 and one fp32 scale per output row (block-wise, `block` = (bn, bk):
    one per bn x bk tile, module docstring).

    `output_sizes` are the row blocks of a fused weight (q|k|v, gate|up), as in models.llama.Linear;
    a checkpoint's per-tensor scales fill their rows of `weight_scale`. `num_input_scales` > 0 makes
    activations static: one scale per fused part (a checkpoint's `input_scale`s), of which the
    largest is used, as vLLM does; 0 (default) quantizes each token's activations as it runs. Either
    applies only above `w8a16_max_rows` rows (given to finalize; module docstring); fewer are not quantized.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype,
        device,
        num_input_scales=0,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
    ):
        super().__init__()
        self.output_sizes = tuple(output_sizes)
        out_features = sum(output_sizes)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = dtype  # the model's dtype: what x and y are
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device), False)
        # block-wise (module docstring): the scales of each part's bn x bk tiles, parts one after another, under the
        # checkpoint's name for them (vLLM's fp8 method: weight_scale_inv; compressed-tensors: weight_scale)
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.scale_name = scale_name
        self.row_scale = None  # block-wise: (N, K / bk) fp32, each row's scale per group (finalize)
        self.use_block_kernel = False  # block-wise: kernels.fp8_block_linear (finalize)
        self.use_block_scaled_mm = False  # block-wise: _scaled_mm's block scaling from BLOCK_SCALED_MM_MIN_ROWS rows
        if self.block is not None:
            bn, bk = self.block
            if bn < 1 or bk < 1 or in_features % bk:
                raise ValueError(
                    f"block-wise fp8: weight_block_size {list(self.block)} needs positive sizes and in_features "
                    f"{in_features} a multiple of its {bk} columns"
                )
            rows = sum(-(-n // bn) for n in self.output_sizes)
            scale = torch.ones((rows, in_features // bk), dtype=torch.float32, device=device)
            self.register_parameter(scale_name, nn.Parameter(scale, False))
        else:
            self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        self.input_scale = None
        if num_input_scales:
            self.input_scale = nn.Parameter(torch.ones(num_input_scales, dtype=torch.float32, device=device), False)
        self.use_scaled_mm = False  # decided by finalize(), once the weights sit on their device
        self.use_skinny_kernel = False  # likewise: kernels.fp8_skinny_linear for the W8A16 rows
        self.w8a16_max_rows = 0  # finalize() sets it: 0 = W8A8 at every size
        self.split_counters = None  # the kernel's split-K counters (int32, zero between launches)
        self.skinny_tiles: dict[str, dict] = {}  # "gemv" / "dot" -> tuned tiles for this (N, K) (measured_w8a16_tiles)
        self._static_scale = None

    @classmethod
    def from_linear(cls, linear: nn.Module, w8a16_max_rows: int = 0, row_max=None) -> Fp8Linear:
        """Quantize an unquantized linear (models.llama.Linear) per output channel (`row_max`: a row-parallel
        shard's, `quantize_per_channel`); finalize(w8a16_max_rows)."""
        weight = linear.weight.data
        bias = linear.bias is not None
        layer = cls(weight.shape[1], list(linear.output_sizes), bias, weight.dtype, weight.device)
        w_q, scale = quantize_per_channel(weight, row_max)
        layer.weight.data.copy_(w_q)
        layer.weight_scale.data.copy_(scale)
        if bias:
            layer.bias.data.copy_(linear.bias.data)
        layer.finalize(w8a16_max_rows)
        return layer

    @property
    def block_scale(self) -> torch.Tensor:
        """Block-wise: the tiles' scales (sum over parts of ceil(rows / bn), K / bk)."""
        return getattr(self, self.scale_name)

    def part_rows(self, leaf: str) -> list[int]:
        """Rows of parameter `leaf` that each fused part's checkpoint tensor fills (models.llama's targets): one
        input_scale a part, a block-wise part's ceil(rows / bn) rows of tiles, else the part's rows."""
        if leaf == "input_scale":
            return [1] * len(self.output_sizes)
        if self.block is not None and leaf == self.scale_name:
            return [-(-n // self.block[0]) for n in self.output_sizes]
        return list(self.output_sizes)

    def finalize(self, w8a16_max_rows: int = 0) -> None:
        """After loading: pick the paths (steps of up to `w8a16_max_rows` rows W8A16, 0 = none) and fold
        the static activation scales into one."""
        if not 0 <= w8a16_max_rows <= MAX_W8A16_ROWS:
            raise ValueError(f"w8a16_max_rows is {w8a16_max_rows}; choose 0 (off) to {MAX_W8A16_ROWS}")
        if self.block is not None:
            self._finalize_block(w8a16_max_rows)
            return
        fp8_device = scaled_mm_supported(self.weight.device)
        self.use_scaled_mm = fp8_device and self.in_features % 16 == 0 and self.out_features % 16 == 0
        self.w8a16_max_rows = w8a16_max_rows
        self.use_skinny_kernel = fp8_device and w8a16_max_rows > 0
        if self.use_skinny_kernel:
            from splitserve.kernels.fp8_skinny_linear import MIN_BLOCK_N

            num_tiles = -(-self.out_features // MIN_BLOCK_N)
            self.split_counters = torch.zeros(num_tiles, dtype=torch.int32, device=self.weight.device)
            shape = (self.out_features, self.in_features)
            table = measured_w8a16_tiles(self.weight.device)
            self.skinny_tiles = {kind: table[(kind, *shape)] for kind in ("gemv", "dot") if (kind, *shape) in table}
        if self.input_scale is not None:
            self._static_scale = self.input_scale.data.max().reshape(1, 1)  # (1, 1)

    def _finalize_block(self, w8a16_max_rows: int) -> None:
        """Block-wise: each output row's scales (its part's tile row), and the kernel where it runs."""
        if w8a16_max_rows:
            raise ValueError(
                f"--fp8-w8a16-max-rows {w8a16_max_rows}: a block-wise fp8 checkpoint runs W8A8 at every size "
                "(activations scaled per group, as its weights are); set it to 0"
            )
        bn, bk = self.block
        index, tile_row = [], 0
        for n in self.output_sizes:
            index.append(tile_row + torch.arange(n) // bn)
            tile_row += -(-n // bn)
        rows = torch.cat(index).to(self.weight.device)
        self.row_scale = self.block_scale.data.index_select(0, rows).contiguous()  # (N, K / bk)
        if scaled_mm_supported(self.weight.device):
            from splitserve.kernels.fp8_block_linear import supported

            self.use_block_kernel = supported(self.in_features, bk)
            # cuBLASLt's tiles are 128 x 128 and must line up with the fused weight's rows (every part whole tiles),
            # and K / 128 a multiple of 4 (BLOCK_SCALED_MM_PAD's note)
            tiles_align = (
                self.block == (128, 128)
                and all(n % 128 == 0 for n in self.output_sizes)
                and (self.in_features // 128) % BLOCK_SCALED_MM_PAD == 0
            )
            self.use_block_scaled_mm = tiles_align and block_scaled_mm_works(self.weight.device.index)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, K) -> (x_q, scale (T, 1)): dynamic per token, or the static per-layer scale."""
        if self._static_scale is None:
            return quantize_per_token(x)
        return quantize_static(x, self._static_scale), self._static_scale.expand(x.shape[0], 1)

    def takes_fused_quant(self, rows: int) -> bool:
        """Whether a step of `rows` rows may hand this layer its input already quantized (forward_quantized):
        it runs W8A8 through `_scaled_mm` (rows > w8a16_max_rows, a capable device) on per-token scales.
        fused_ops then quantizes in the launch that makes the input (an RMSNorm, a SiLU-mul) instead of
        in a launch of its own. A static `input_scale` keeps the unfused path (the fused kernels compute
        per-token scales), as do W8A16 steps (not quantized) and the reference (CPU, odd K or N)."""
        return self.use_scaled_mm and self._static_scale is None and rows > self.w8a16_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (T, K)
        if self.block is not None:
            return self._block_forward(x2).reshape(*lead, self.out_features)
        if x2.shape[0] <= self.w8a16_max_rows:
            return self._w8a16(x2).reshape(*lead, self.out_features)
        return self.forward_quantized(*self.quantize_input(x2)).reshape(*lead, self.out_features)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The W8A8 product of an input quantized already: x_q (T, K) e4m3, x_scale (T, 1) fp32 (or the static
        scale expanded) -> (T, N) in the model's dtype; `_scaled_mm` where the layer uses it, else the reference
        (both operands dequantized to the model's dtype)."""
        if self.use_scaled_mm:
            return self._scaled_mm(x_q, x_scale)
        w = dequantize(self.weight, self.weight_scale[:, None], self.out_dtype)  # (N, K)
        return F.linear(dequantize(x_q, x_scale, self.out_dtype), w, self.bias)

    def _w8a16(self, x: torch.Tensor) -> torch.Tensor:
        """x (T <= w8a16_max_rows, K), not quantized, times the e4m3 weight -> (T, N) in x's dtype."""
        if self.use_skinny_kernel:
            from splitserve.kernels.fp8_skinny_linear import fp8_skinny_linear

            tiles = self.skinny_tiles.get("gemv" if x.shape[0] == 1 else "dot")
            return fp8_skinny_linear(x, self.weight, self.weight_scale, self.bias, self.split_counters, "triton", tiles)
        return w8a16_ref(x, self.weight, self.weight_scale, self.bias)

    def _block_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Block-wise W8A8: x (T, K) quantized per token per bk group -> (T, N) in the model's dtype."""
        bk = self.block[1]
        if self.use_block_scaled_mm and x.shape[0] >= BLOCK_SCALED_MM_MIN_ROWS:
            return self._output(block_scaled_mm(x, self.weight, self.block_scale))
        x_q, x_scale = quantize_per_token_group(x, bk)
        if self.use_block_kernel:
            from splitserve.kernels.fp8_block_linear import fp8_block_linear

            return fp8_block_linear(x_q, x_scale, self.weight, self.row_scale, self.bias, self.out_dtype)
        w = dequantize(self.weight, self.row_scale.repeat_interleave(bk, dim=1), self.out_dtype)  # (N, K)
        x_deq = dequantize(x_q, x_scale.repeat_interleave(bk, dim=1), self.out_dtype)
        return F.linear(x_deq, w, self.bias)

    def _scaled_mm(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """Row-wise scaled e4m3 GEMM (bf16 out: what the row-wise kernels produce), bias added after."""
        y = torch._scaled_mm(
            x_q,
            self.weight.t(),  # (K, N) column-major view of the row-major weight
            scale_a=x_scale.contiguous(),  # (T, 1)
            scale_b=self.weight_scale[None, :],  # (1, N)
            out_dtype=torch.bfloat16,
        )
        return self._output(y)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        """A `_scaled_mm` product (bf16: what the scaled kernels produce) in the model's dtype, plus the bias."""
        if y.dtype != self.out_dtype:
            y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        if self.block is not None:
            path = "fp8_block_linear" if self.use_block_kernel else "reference"
            if self.use_block_scaled_mm:
                path += f" (from {BLOCK_SCALED_MM_MIN_ROWS} rows scaled_mm)"
            return (
                f"in={self.in_features}, out={self.out_features}, fp8 e4m3 in {self.block[0]} x {self.block[1]} "
                f"blocks, activations dynamic per token per {self.block[1]} features, {path}"
            )
        path = "scaled_mm" if self.use_scaled_mm else "reference"
        few = "fp8_skinny_linear" if self.use_skinny_kernel else "reference"
        acts = "dynamic per token" if self.input_scale is None else "static"
        return (
            f"in={self.in_features}, out={self.out_features}, fp8 e4m3, rows <= {self.w8a16_max_rows}: W8A16 {few}, "
            f"more: activations {acts}, {path}"
        )
