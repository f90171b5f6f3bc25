"""FP8 checkpoints as vLLM and llm-compressor write them, and quantizing a loaded model to FP8.

config.json's `quantization_config` says how a checkpoint is quantized; two FP8 forms load:

    {"quant_method": "fp8", "activation_scheme": "dynamic" | "static", "ignored_layers": [...]}
        (vLLM / AutoFP8: per-tensor `weight_scale`, per-tensor `input_scale` when static)
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [bn, bk], ...}
        (block-wise, as DeepSeek-V3 and Qwen3's FP8 releases: `weight_scale_inv` (ceil(N / bn), K / bk), the
        activations scaled per token per bk features as each step runs)
    {"quant_method": "compressed-tensors", "format": "float-quantized" | "naive-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel" | "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": true, "strategy": "token"}
                             | {..., "dynamic": false, "strategy": "tensor"} | null}},
     "ignore": ["lm_head", "re:...", ...], "kv_cache_scheme": {...} | null}
        (llm-compressor: `weight_scale` (N, 1) per channel or (1,) per tensor, `input_scale` when static;
        its FP8_BLOCK scheme: weights "strategy": "block", "block_structure": [bn, bk], `weight_scale`
        (ceil(N / bn), K / bk), activations dynamic with "strategy": "group", "group_size": bk)

Each quantized projection `P` has `P.weight` (N, K) e4m3 and `P.weight_scale` (block-wise vLLM checkpoints:
`P.weight_scale_inv`, the tiles' scales despite the name); static activations
add `P.input_scale`. KV cache scales are `self_attn.k_scale` / `self_attn.v_scale` (or the older
`self_attn.kv_scale`, or llm-compressor's `k_proj.output_scale` / `v_proj.output_scale`).
A checkpoint without activation quantization (weight-only FP8) runs with dynamic per-token scales.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.worker.fp8 import FP8_DTYPE, Fp8Linear
from splitserve.engine.worker.tensor_parallel import TpShard

SUPPORTED_METHODS = ("fp8", "compressed-tensors")
_CT_FORMATS = ("float-quantized", "naive-quantized")
# layer index, then which scale: k_scale, v_scale, kv_scale (both), k_proj/v_proj.output_scale
KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)")


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint's linear layers are quantized (what `prepare_fp8_model` builds)."""

    method: str  # quant_method of the checkpoint
    static_activations: bool  # per-tensor input_scale tensors in the checkpoint
    ignore: tuple[str, ...]  # module names (or "re:" patterns) left unquantized
    block: tuple[int, int] | None = None  # block-wise: (bn, bk) weight tiles, activations per bk features
    scale_name: str = "weight_scale"  # what the checkpoint calls a projection's weight scales


def read_fp8_scheme(model_dir: Path) -> Fp8Scheme | None:
    """The FP8 scheme of a model directory's config.json; None when it has no quantization_config, or an
    MXFP4 one (gpt-oss's experts, dequantized as they load: engine.worker.mxfp4).

    Any other quantization (int8, nvfp4, ...) is a ValueError naming the field and value.
    """
    config_path = model_dir / "config.json"
    if not model_dir.is_dir() or not config_path.is_file():
        return None
    qc = json.loads(config_path.read_text()).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _vllm_fp8_scheme(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "mxfp4":
        return None  # the model's mxfp4_targets take the _blocks / _scales pairs; any other model refuses them
    raise ValueError(
        f"quantization_config.quant_method {method!r} in {config_path} is not supported; "
        f"supported: {', '.join(SUPPORTED_METHODS)} (fp8 e4m3), mxfp4 (gpt-oss experts)"
    )


def _block_size(field: str, value) -> tuple[int, int]:
    """A [bn, bk] weight tile of two positive ints, else a ValueError naming the field."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise ValueError(f"{field} {value!r} must be two positive integers [rows, columns]")
    return value[0], value[1]


def _vllm_fp8_scheme(qc: dict) -> Fp8Scheme:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported; choose dynamic or static")
    ignore = tuple(qc.get("ignored_layers") or ())
    if qc.get("weight_block_size") is not None:
        block = _block_size("quantization_config.weight_block_size", qc["weight_block_size"])
        if scheme != "dynamic":
            raise ValueError(
                "quantization_config.activation_scheme 'static' with weight_block_size: block-wise fp8 scales "
                "activations per token group as each step runs (dynamic only)"
            )
        return Fp8Scheme("fp8", False, ignore, block, "weight_scale_inv")
    return Fp8Scheme("fp8", scheme == "static", ignore)


def _compressed_tensors_scheme(qc: dict) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"quantization_config.format {fmt!r} (compressed-tensors) is not supported; "
            f"supported: {', '.join(_CT_FORMATS)} with 8-bit float weights"
        )
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups has {len(groups)} groups; exactly one is supported")
    ((name, group),) = groups.items()
    field = f"quantization_config.config_groups.{name}"
    if "Linear" not in (group.get("targets") or ()):
        raise ValueError(f"{field}.targets {group.get('targets')} must include 'Linear'")
    weights = group.get("weights") or {}
    _check_fp8_args(f"{field}.weights", weights, ("tensor", "channel", "block"))
    if weights.get("dynamic"):
        raise ValueError(f"{field}.weights.dynamic must be false (weights carry their scales)")
    ignore = tuple(qc.get("ignore") or ())
    acts = group.get("input_activations")
    if weights["strategy"] == "block":  # FP8_BLOCK: activations dynamic per token per bk features
        block = _block_size(f"{field}.weights.block_structure", weights.get("block_structure"))
        if acts is not None:
            _check_fp8_args(f"{field}.input_activations", acts, ("group",))
            if not acts.get("dynamic", False) or acts.get("group_size") != block[1]:
                raise ValueError(
                    f"{field}.input_activations: block-wise weights need dynamic activations in groups of the "
                    f"block's {block[1]} columns, got dynamic {acts.get('dynamic')} group_size {acts.get('group_size')}"
                )
        return Fp8Scheme("compressed-tensors", False, ignore, block)
    static = False
    if acts is not None:
        _check_fp8_args(f"{field}.input_activations", acts, ("token", "tensor"))
        static = not acts.get("dynamic", False)
        if static and acts.get("strategy") != "tensor":
            raise ValueError(f"{field}.input_activations: static scales must have strategy 'tensor'")
    return Fp8Scheme("compressed-tensors", static, ignore)


def _check_fp8_args(field: str, args: dict, strategies: tuple[str, ...]) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(
            f"{field}: type {args.get('type')!r} with num_bits {args.get('num_bits')} is not supported; "
            "only type 'float' with num_bits 8 (e4m3)"
        )
    if args.get("strategy") not in strategies:
        raise ValueError(f"{field}.strategy {args.get('strategy')!r} is not supported; choose one of {strategies}")
    if args.get("symmetric") is False:
        raise ValueError(f"{field}.symmetric false is not supported; fp8 scales are symmetric")


def is_ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """Whether checkpoint module `name` is listed in `ignore` (exact names, or "re:" regular expressions)."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif entry == name:
            return True
    return False


# projections whose input (and so each weight row) is split over tensor-parallel ranks (models/llama.py)
ROW_PARALLEL = (".o_proj", ".down_proj")


def _linears(net: nn.Module):
    """(module path, module) of every unquantized projection (models.llama.Linear) in `net`."""
    from splitserve.engine.worker.models.llama import Linear

    return [(name, module) for name, module in net.named_modules() if isinstance(module, Linear)]


def _replace(net: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(net.get_submodule(parent), leaf, module)


def prepare_fp8_model(net: nn.Module, scheme: Fp8Scheme, fused_parts: dict[str, tuple[str, ...]]) -> None:
    """Swap each projection the checkpoint quantizes for an empty Fp8Linear (the loader fills it).

    A fused projection (q|k|v) is quantized only as a whole: the checkpoint must quantize all of its
    parts or none (ValueError naming the parts otherwise). A mixture of experts' fp8 experts are refused.
    Tensor parallel (`net.tp`): the Fp8Linear holds this rank's shard; block-wise, a shard must be whole tiles
    (`check_block_shard`).
    """
    tp = getattr(net, "tp", None)
    if getattr(net.config, "moe", None) is not None:
        raise ValueError(
            f"fp8 checkpoints of mixture-of-experts models ({net.config.architecture}) are not supported; "
            "load the bf16 checkpoint with --quantization fp8 (e4m3 experts, W8A16)"
        )
    for path, linear in _linears(net):
        prefix, _, module_name = path.rpartition(".")
        parts = [f"{prefix}.{p}" for p in fused_parts.get(module_name, (module_name,))]
        ignored = [is_ignored(p, scheme.ignore) for p in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"the checkpoint quantizes only some of {', '.join(parts)}, which run as one fused "
                "projection; quantize all of them or none"
            )
        if scheme.block is not None and tp is not None and tp.size > 1:
            check_block_shard(parts, linear, scheme.block, tp.size, path.endswith(ROW_PARALLEL))
        weight = linear.weight
        num_scales = len(linear.output_sizes) if scheme.static_activations else 0
        fp8 = Fp8Linear(
            weight.shape[1],
            list(linear.output_sizes),
            linear.bias is not None,
            weight.dtype,
            weight.device,
            num_scales,
            scheme.block,
            scheme.scale_name,
        )
        _replace(net, path, fp8)


def check_block_shard(parts: list[str], linear: nn.Module, block: tuple[int, int], tp_size: int, row: bool) -> None:
    """A block-wise projection's shard on one of `tp_size` ranks must be whole tiles, so that its scales are whole
    rows (column-parallel) or columns (row-parallel) of the checkpoint's: each part's rows a multiple of bn, or a
    row-parallel shard's input columns a multiple of bk. ValueError naming the layer, its size on each rank, the
    block and the TP size otherwise (vLLM refuses the same shapes: `output_partition_size` / `input_size_per_partition`
    not divisible by block_n / block_k)."""
    bn, bk = block
    if row:
        sizes, what, tile = [(parts[0], linear.weight.shape[1])], "input columns (input_size_per_partition)", bk
    else:
        sizes, what, tile = list(zip(parts, linear.output_sizes)), "output rows (output_partition_size)", bn
    for part, size in sizes:
        if size % tile:
            raise ValueError(
                f"block-wise fp8 under tensor_parallel_size {tp_size}: {part} has {size} {what} on each rank, not "
                f"a multiple of the {tile} of weight_block_size {list(block)}; choose a tensor_parallel_size that "
                "splits every projection into whole blocks"
            )


def fp8_scale_shards(
    shards: dict[str, TpShard], targets: dict[str, torch.Tensor], scheme: Fp8Scheme
) -> dict[str, TpShard]:
    """The piece of each fp8 projection's weight scales a tensor-parallel rank reads, from its weight's piece:

        column-parallel (weight rows [s, s + n))   per-channel scales rows [s, s + n); block-wise tile rows
                                                   [s / bn, (s + n) / bn)
        row-parallel (weight columns [s, s + n))   per-channel scales whole (a row's one scale); block-wise tile
                                                   columns [s / bk, (s + n) / bk)

    A per-tensor scale (one value) is read whole by every rank (the loader's `_read_shard`), as are static
    `input_scale`s. Block-wise shards are whole tiles (`check_block_shard` refused any other)."""
    pieces = {}
    for name, shard in shards.items():
        target = targets.get(name)
        if not name.endswith(".weight") or target is None or target.dtype != FP8_DTYPE:
            continue
        prefix = name.removesuffix("weight")
        if scheme.block is not None:
            tile = scheme.block[shard.dim]
            pieces[prefix + scheme.scale_name] = TpShard(shard.dim, shard.start // tile, shard.size // tile)
        elif shard.dim == 0:
            pieces[prefix + scheme.scale_name] = shard
    return pieces


def finalize_fp8_model(net: nn.Module, w8a16_max_rows: int = 0) -> None:
    """After the weights are loaded: each Fp8Linear picks its multiply paths (steps of up to `w8a16_max_rows`
    rows W8A16, worker/fp8.py)."""
    for module in net.modules():
        if isinstance(module, Fp8Linear):
            module.finalize(w8a16_max_rows)


def quantize_model(net: nn.Module, w8a16_max_rows: int = 0) -> int:
    """Quantize every projection of a loaded unquantized model to FP8 (per output channel), in place; steps
    of up to `w8a16_max_rows` rows W8A16 (worker/fp8.py).

    Embeddings, the LM head and MoE routers stay in the model's dtype (as vLLM's fp8 does); MoE experts become
    e4m3 with per-row scales. Returns the count of projections and expert blocks quantized.

    Tensor parallel (`net.tp`): a row-parallel projection's rows are split by columns over the ranks, so each
    row's scale is the whole row's (the ranks' amax reduced), and every rank holds exactly the unsharded model's
    e4m3 values and scales. A column-parallel one holds whole rows already.
    """
    tp = getattr(net, "tp", None)
    row_max = tp.all_reduce_max if tp is not None else None
    linears = _linears(net)
    for path, linear in linears:
        split_rows = path.endswith(ROW_PARALLEL)
        _replace(net, path, Fp8Linear.from_linear(linear, w8a16_max_rows, row_max if split_rows else None))
    experts = [module for module in net.modules() if hasattr(module, "quantize_fp8")]
    for module in experts:  # a mixture of experts' stacked experts (models/moe.py)
        module.quantize_fp8()
    return len(linears) + len(experts)


def kv_scale_of(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when checkpoint tensor `name` is a KV cache scale, else None."""
    match = KV_SCALE_NAME.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)
