"""Build a model and fill its weights from a Hugging Face directory (or randomly).

    model_dir/
      config.json                     read through transformers.AutoConfig
      generation_config.json          optional: eos_token_id overrides config.json's
      model.safetensors               one file, or shards listed in
      model.safetensors.index.json    ("weight_map": tensor name -> shard file)

Tensor parallel (`tp`): each rank reads only its slices of each tensor (`safe_open`'s `get_slice`), as
the model's `checkpoint_shards` names them; `quantization="fp8"` then quantizes each rank's shard (row-parallel
rows scaled as whole rows: fp8_checkpoint.quantize_model). An fp8 checkpoint's scales shard with their weights
(fp8_checkpoint.fp8_scale_shards: per-channel rows, block-wise tile rows or columns; per-tensor, input and KV
scales whole), so each rank's dequantized shard is exactly that slice of the whole dequantized weight.

Every checkpoint tensor must map to a parameter of the model (fused q|k|v and gate|up
rows included) with the same shape; every parameter must be filled. Any violation is a
ValueError naming the tensor; missing files are FileNotFoundError naming the path.

FP8: a checkpoint whose config.json has an fp8 `quantization_config` loads its e4m3 weights and
scales as they are (worker/fp8_checkpoint.py); `quantization="fp8"` quantizes an unquantized
checkpoint after loading. MXFP4 (gpt-oss's experts, X_blocks + X_scales): dequantized into the model dtype as
they load, into the views the model's `mxfp4_targets` names (worker/mxfp4.py). KV cache scales found in the
checkpoint are kept on the model as `checkpoint_kv_scales` (the engine applies them when the KV cache is fp8).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.worker.fp8_checkpoint import (
    Fp8Scheme,
    finalize_fp8_model,
    fp8_scale_shards,
    kv_scale_of,
    prepare_fp8_model,
    quantize_model,
    read_fp8_scheme,
)
from splitserve.engine.worker.kv_cache import dtype_from_name
from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models import model_class
from splitserve.engine.worker.models.llama import FUSED_PARTS
from splitserve.engine.worker.mxfp4 import load_mxfp4_pair, mxfp4_base_name
from splitserve.engine.worker.tensor_parallel import TpGroup, TpShard, check_shardable

INDEX_NAME = "model.safetensors.index.json"
PROGRESS_MIN_BYTES = 1 << 30  # always show the bar above this (and whenever stderr is a TTY)
DUMMY_STD = 0.02


def load_model(
    model: str | Path,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    model_id: str | None = None,
    quantization: str | None = None,
    fp8_w8a16_max_rows: int = 0,
    tp: TpGroup | None = None,
    model_config: ModelConfig | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Load `model` (a directory; for load_format="dummy" also a config JSON file).

    dtype: a torch dtype or its name ("bfloat16", ...), or "auto" for the checkpoint's own
    dtype (float32 when the config names none). load_format "dummy" fills weights with
    N(0, DUMMY_STD) from `seed` (norm weights 1). quantization "fp8" quantizes the projections of
    an unquantized checkpoint (an fp8 checkpoint loads as fp8 either way); fp8_w8a16_max_rows: steps
    of up to that many rows keep activations unquantized in fp8 projections (EngineConfig's option of that
    name). tp: this rank's tensor-parallel group; the model holds only its slices. Returns (model in eval
    mode, config). model_config: the directory's, already read (a tensor-parallel rank > 0 gets rank 0's
    and so never imports transformers).
    """
    path = Path(model)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported; choose 'auto' or 'dummy'")
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    if load_format == "auto":
        if not path.is_dir():
            raise FileNotFoundError(
                f"model path {path} is not a directory (a config file alone needs load_format='dummy')"
            )
        weight_files = checkpoint_files(path)
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization {quantization!r} is not supported; choose fp8 or none")
    config = model_config or ModelConfig.from_pretrained(path, model_id=model_id)
    torch_dtype = resolve_dtype(dtype, config)
    scheme = read_fp8_scheme(path) if load_format == "auto" else None
    net = _build(config, torch_dtype, torch.device(device), tp)
    if scheme is not None:
        prepare_fp8_model(net, scheme, FUSED_PARTS)
    if load_format == "dummy":
        init_dummy_weights(net, seed)
    else:
        load_safetensors(net, weight_files, path, scheme)
    if scheme is not None:
        finalize_fp8_model(net, fp8_w8a16_max_rows)
    elif quantization == "fp8":
        quantize_model(net, fp8_w8a16_max_rows)
    if hasattr(net, "pack_for_cpu"):
        net.pack_for_cpu()  # float32 on CPU: GEMM weights packed for oneDNN or MKL (engine.worker.cpu_gemm)
    return net.eval(), config


def _build(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TpGroup | None) -> nn.Module:
    """The model's module, this rank's slices only under tensor parallelism (refusals name the field)."""
    cls = model_class(config)
    if tp is None or tp.size == 1:
        return cls(config, dtype, device)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{config.architecture} does not support tensor_parallel_size > 1 (got {tp.size})")
    moe = getattr(config, "moe", None)
    experts = moe.intermediate_size if moe is not None else 0
    check_shardable(config.num_heads, config.num_kv_heads, config.intermediate_size, tp.size, experts)
    return cls(config, dtype, device, tp=tp)


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return dtype_from_name(config.checkpoint_dtype or "float32")
    return dtype_from_name(dtype)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, else every *.safetensors."""
    index = path / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for name in names:
            if not (path / name).is_file():
                raise FileNotFoundError(f"{INDEX_NAME} in {path} names shard {name} which does not exist")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path}")
    return files


def load_safetensors(net: nn.Module, files: list[Path], path: Path, scheme: Fp8Scheme | None = None) -> None:
    """Copy every tensor of `files` into `net` (converting dtype and device), checking names and shapes;
    `scheme`: the fp8 checkpoint's, whose scales a tensor-parallel rank reads in pieces as their weights."""
    from safetensors import safe_open

    targets = net.checkpoint_targets()
    shards = net.checkpoint_shards() if hasattr(net, "checkpoint_shards") else {}
    if scheme is not None and shards:
        shards = {**shards, **fp8_scale_shards(shards, targets, scheme)}
    packed = net.mxfp4_targets() if hasattr(net, "mxfp4_targets") else {}  # name -> view its values fill
    packed_shards = net.mxfp4_shards() if hasattr(net, "mxfp4_shards") else {}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 tensor's part read before its other part
    loaded: set[str] = set()
    kv_scales: dict[tuple[int, str], float] = {}
    progress = Progress("loading weights", sum(f.stat().st_size for f in files))
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    target = targets.get(name)
                    split = mxfp4_base_name(name) if target is None else None
                    if split is not None and split[0] in packed:
                        part = reader.get_tensor(name)
                        if load_mxfp4_pair(pending, *split, part, packed[split[0]], packed_shards.get(split[0])):
                            loaded.add(split[0])
                        continue
                    if target is None:
                        kv_scale = kv_scale_of(name)
                        if kv_scale is not None:
                            kv_scales[kv_scale] = _one_kv_scale(reader.get_tensor(name), name, file.name)
                            continue
                        if net.is_ignored_checkpoint_tensor(name):
                            continue
                        raise ValueError(
                            f"unexpected tensor {name!r} in {file.name}: {net.config.architecture} has no such weight"
                        )
                    shard = shards.get(name)
                    tensor = reader.get_tensor(name) if shard is None else _read_shard(reader, name, shard)
                    target.copy_(_fitted(tensor, target, name, file.name))
                    loaded.add(name)
                    progress.advance(tensor.numel() * tensor.element_size())
    progress.close()
    net.checkpoint_kv_scales = _kv_scale_pairs(kv_scales, net.config.num_layers) if kv_scales else None
    for base, parts in pending.items():
        raise ValueError(f"checkpoint in {path} has MXFP4 {base + next(iter(parts))!r} but not its other part")
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint in {path} is missing tensor {missing[0]!r}{more}")


def _read_shard(reader, name: str, shard: TpShard) -> torch.Tensor:
    """Only `shard`'s piece of tensor `name` (the rest is never read from the file). A scale of one value is a
    per-tensor scale, read whole: every row of every rank's shard shares it."""
    piece = reader.get_slice(name)
    if name.endswith("_scale") and math.prod(piece.get_shape()) == 1:
        return reader.get_tensor(name)
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.size),)
    return piece[index]


def _one_kv_scale(tensor: torch.Tensor, name: str, file_name: str) -> float:
    """A layer's K or V cache scale: one value (per-tensor; every tensor-parallel rank applies it to its heads)."""
    if tensor.numel() != 1:
        raise ValueError(
            f"KV cache scale {name!r} in {file_name} has {tensor.numel()} values; only one per layer (per-tensor) "
            "is supported"
        )
    return float(tensor.float().reshape(()))


def _fitted(tensor: torch.Tensor, target: torch.Tensor, name: str, file_name: str) -> torch.Tensor:
    """`tensor` in `target`'s shape: equal shapes; a (N, 1) per-channel scale for (N,) rows; a
    per-tensor scale ((), (1,)) repeated over the rows of its part. An fp8 weight only into fp8."""
    fp8_target = target.dtype == torch.float8_e4m3fn
    if fp8_target != (tensor.dtype == torch.float8_e4m3fn):
        raise ValueError(
            f"tensor {name!r} in {file_name} is {str(tensor.dtype).removeprefix('torch.')}, expected "
            f"{str(target.dtype).removeprefix('torch.')} (quantization_config and the tensors disagree)"
        )
    if tuple(tensor.shape) == tuple(target.shape):
        return tensor
    if name.endswith("_scale") and tensor.numel() in (1, target.numel()):
        return tensor.reshape(-1).expand(target.shape) if tensor.numel() == 1 else tensor.reshape(target.shape)
    raise ValueError(f"tensor {name!r} in {file_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")


def _kv_scale_pairs(found: dict[tuple[int, str], float], num_layers: int) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) from the checkpoint's KV scale tensors (each layer needs both)."""
    pairs = []
    for layer in range(num_layers):
        both = found.get((layer, "kv"))
        k, v = found.get((layer, "k"), both), found.get((layer, "v"), both)
        if k is None or v is None:
            raise ValueError(
                f"the checkpoint has KV cache scales but none for layer {layer}'s {'k' if k is None else 'v'}"
            )
        if not (k > 0 and v > 0):
            raise ValueError(f"layer {layer}'s KV cache scales must be positive, got k={k}, v={v}")
        pairs.append((k, v))
    return pairs


def init_dummy_weights(net: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: N(0, DUMMY_STD) everywhere, norm weights exactly 1."""
    generator = None
    with torch.no_grad():
        for name, param in net.named_parameters():
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if name.endswith(("norm.weight", "_scale")):  # fp8 scales of dummy weights too
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)


class Progress:
    """A one-line progress bar on stderr, shown for loads above PROGRESS_MIN_BYTES or on a TTY."""

    def __init__(self, label: str, total_bytes: int, width: int = 30):
        self.label, self.total, self.width = label, max(total_bytes, 1), width
        self.done = 0
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.enabled = total_bytes > PROGRESS_MIN_BYTES or sys.stderr.isatty()

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        now = time.monotonic()
        if self.enabled and now - self.last_draw >= 0.2:
            self.last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self.done = self.total
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * self.width)
        sys.stderr.write(
            f"\r{self.label}: {frac:4.0%} |{bar:<{self.width}}| "
            f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {now - self.start:.1f} s"
        )
        sys.stderr.flush()
