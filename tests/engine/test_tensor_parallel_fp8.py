"""fp8 checkpoints under tensor parallelism: every format the engine loads at TP 1 (compressed-tensors per channel and
per tensor, vLLM's fp8 per tensor with static activations and KV scales, block-wise as vLLM's weight_block_size and
llm-compressor's FP8_BLOCK) loads at TP 2 and 4 with each rank's dequantized weights exactly TP 1's slices, gives TP 1's
greedy tokens at TP 2, and a block-wise checkpoint whose shards would cut tiles is refused naming the layer.

The checkpoints are the tiny float64 Llama (hidden 64, 4 query heads of 16, 2 KV heads, FFN 96) quantized here as
test_fp8.py writes them. Shard loading needs no processes: the loader reads only the group's rank and size.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.worker.fp8 import Fp8Linear
from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.tensor_parallel import kv_heads_of_rank
from tests.engine.test_engine_exact import make_prompts
from tests.engine.test_fp8 import COMPRESSED_TENSORS, _write_block_checkpoint, _write_fp8_checkpoint
from tests.model_factory import TINY_MODELS, make_tiny_model_dir

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, FFN = 64, 16, 4, 2, 96
NUM_BLOCKS = 96
MAX_NEW = 6


def _ct_config(weights: dict, acts: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    group["input_activations"] = None if acts is None else {"num_bits": 8, "type": "float", **acts}
    return {**COMPRESSED_TENSORS, "config_groups": {"group_0": group}}


def _vllm_block(block: list[int]) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}


def _ct_block(block: list[int]) -> dict:
    acts = {"strategy": "group", "group_size": block[1], "dynamic": True}
    return _ct_config({"strategy": "block", "block_structure": block}, acts)


KV_SCALES = [(0.5, 0.25), (2.0, 1.0)]
VLLM_STATIC = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
CT_TENSOR = _ct_config({"strategy": "tensor"}, {"strategy": "token", "dynamic": True})
# name -> (model, its quantization_config, how the checkpoint is written: per-channel / per-tensor scales (with
# static input scales and KV scales) or block-wise tiles)
FORMATS = {
    "ct-channel": ("qwen2-bias", COMPRESSED_TENSORS, dict(per_tensor=False)),
    "ct-tensor": ("llama-gqa2", CT_TENSOR, dict(per_tensor=True)),
    "vllm-tensor-static-kv": ("llama-gqa2", VLLM_STATIC, dict(per_tensor=True, kv_scales=KV_SCALES)),
    "vllm-block-16x8": ("llama-gqa2", _vllm_block([16, 8]), dict(block=(16, 8))),
    "vllm-block-8x8": ("llama-gqa2", _vllm_block([8, 8]), dict(block=(8, 8))),
    "ct-block-8x16": ("llama-gqa2", _ct_block([8, 16]), dict(block=(8, 16))),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The float64 models the checkpoints quantize."""
    root = tmp_path_factory.mktemp("tp-fp8-models")
    return {name: make_tiny_model_dir(root, name=name, **TINY_MODELS[name]) for name in ("llama-gqa2", "qwen2-bias")}


def _write(model_dir, path, quantization_config: dict, **how):
    """An fp8 checkpoint of `model_dir` at `path`: block-wise when `how` names a block, else per channel / tensor."""
    if "block" not in how:
        return _write_fp8_checkpoint(model_dir, path, quantization_config, **how)
    scale_name = "weight_scale_inv" if quantization_config["quant_method"] == "fp8" else "weight_scale"
    return _write_block_checkpoint(model_dir, path, quantization_config, how["block"], scale_name)


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory):
    """name -> an fp8 checkpoint directory of FORMATS, written once."""
    root = tmp_path_factory.mktemp("tp-fp8")
    return {name: _write(models[model], root / name, qc, **how) for name, (model, qc, how) in FORMATS.items()}


def _dequantized(layer: Fp8Linear) -> torch.Tensor:
    """The layer's weight as the float64 values it multiplies by: e4m3 times its row's (or tile's) scale."""
    if layer.block is not None:
        return layer.weight.double() * layer.row_scale.double().repeat_interleave(layer.block[1], 1)
    return layer.weight.double() * layer.weight_scale.double()[:, None]


def _rank_slices(rank: int, size: int) -> dict[str, tuple[int, list[range]]]:
    """module -> (dim it splits, the ranges of each fused part's rows, or of the input columns) for `rank` of
    `size`, from the model's shape alone (kv heads: tensor_parallel.kv_heads_of_rank, tested on its own)."""
    q, f = NUM_HEADS * HEAD_DIM // size, FFN // size
    heads = kv_heads_of_rank(NUM_KV_HEADS, size, rank)
    kv = range(heads.start * HEAD_DIM, heads.stop * HEAD_DIM)
    return {
        "self_attn.qkv_proj": (0, [range(rank * q, (rank + 1) * q), kv, kv]),
        "self_attn.o_proj": (1, [range(rank * q, (rank + 1) * q)]),
        "mlp.gate_up_proj": (0, [range(rank * f, (rank + 1) * f)] * 2),
        "mlp.down_proj": (1, [range(rank * f, (rank + 1) * f)]),
    }


def _slice_of(whole: Fp8Linear, values: torch.Tensor, dim: int, ranges: list[range]) -> torch.Tensor:
    """`values` (rows: whole's fused parts one after another) cut to `ranges`: each part's rows, or the columns."""
    if dim == 1:
        return values[:, ranges[0].start : ranges[0].stop]
    parts = values.split(list(whole.output_sizes))
    return torch.cat([part[r.start : r.stop] for part, r in zip(parts, ranges)])


CASES = [
    ("ct-channel", 2),
    ("ct-channel", 4),
    ("ct-tensor", 2),
    ("vllm-tensor-static-kv", 4),
    ("vllm-block-16x8", 2),
    ("vllm-block-8x8", 4),
    ("ct-block-8x16", 2),
]


@pytest.mark.parametrize(("fmt", "size"), CASES, ids=[f"{fmt}-tp{size}" for fmt, size in CASES])
def test_each_rank_holds_exactly_tp1_dequantized_slices(checkpoints, fmt, size):
    """Every rank's e4m3 values and dequantized weights are TP 1's slices bit for bit: column-parallel rows of each
    fused part with their scale rows (block-wise: tile rows), row-parallel columns with their tile columns, per-tensor
    and per-channel scales of row-parallel layers whole; static input scales, biases (a row-parallel one on rank 0
    only) and the checkpoint's KV scales as TP 1's. At TP 4 the 2 KV heads are each replicated on 2 ranks."""
    path = checkpoints[fmt]
    whole = load_model(path, dtype="float64", device="cpu")[0]
    for rank in range(size):
        net = load_model(path, dtype="float64", device="cpu", tp=SimpleNamespace(rank=rank, size=size))[0]
        assert net.checkpoint_kv_scales == whole.checkpoint_kv_scales
        for i, layer in enumerate(net.model.layers):
            for module, (dim, ranges) in _rank_slices(rank, size).items():
                mine, full = layer.get_submodule(module), whole.model.layers[i].get_submodule(module)
                assert isinstance(mine, Fp8Linear) and mine.block == full.block
                want_q = _slice_of(full, full.weight.view(torch.uint8), dim, ranges)
                assert torch.equal(mine.weight.view(torch.uint8), want_q), (module, rank)
                assert torch.equal(_dequantized(mine), _slice_of(full, _dequantized(full), dim, ranges)), (module, rank)
                if mine.input_scale is not None:
                    assert torch.equal(mine.input_scale, full.input_scale)
                if full.bias is not None and dim == 0:
                    assert torch.equal(mine.bias, _slice_of(full, full.bias[:, None], 0, ranges)[:, 0])
    if fmt == "ct-channel":  # qwen2's qkv biases, sharded with their rows
        assert net.model.layers[0].self_attn.qkv_proj.bias is not None
    if fmt == "vllm-tensor-static-kv":
        assert whole.checkpoint_kv_scales == KV_SCALES


def _claiming_block(checkpoints, tmp_path, block: list[int]):
    """The 16 x 8 checkpoint's tensors under a config claiming `block` tiles: the refusal comes before any tensor
    is read (TP 1 loads partial last tiles of any block: test_fp8.py)."""
    src = checkpoints["vllm-block-16x8"]
    path = tmp_path / "claims-block"
    path.mkdir()
    config = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": _vllm_block(block)}))
    (path / "model.safetensors").symlink_to(src / "model.safetensors")
    return path


K_PROJ_REFUSAL = (
    "block-wise fp8 under tensor_parallel_size 2: model.layers.0.self_attn.k_proj has 16 output rows "
    "(output_partition_size) on each rank, not a multiple of the 32 of weight_block_size [32, 8]; choose a "
    "tensor_parallel_size that splits every projection into whole blocks"
)


@pytest.mark.parametrize(
    ("block", "size", "message"),
    [
        ([32, 8], 2, K_PROJ_REFUSAL),  # k_proj: 2 KV heads of 16 over 2 ranks, 16 rows each
        (  # gate and up: 96 rows over 4 ranks, 24 each
            [16, 8],
            4,
            "block-wise fp8 under tensor_parallel_size 4: model.layers.0.mlp.gate_proj has 24 output rows "
            "(output_partition_size) on each rank, not a multiple of the 16 of weight_block_size [16, 8]; choose a "
            "tensor_parallel_size that splits every projection into whole blocks",
        ),
        (  # down: 96 input columns over 2 ranks, 48 each
            [16, 32],
            2,
            "block-wise fp8 under tensor_parallel_size 2: model.layers.0.mlp.down_proj has 48 input columns "
            "(input_size_per_partition) on each rank, not a multiple of the 32 of weight_block_size [16, 32]; choose "
            "a tensor_parallel_size that splits every projection into whole blocks",
        ),
    ],
    ids=["column-k_proj", "column-gate_proj", "row-down_proj"],
)
def test_block_shards_that_cut_tiles_are_refused_naming_the_layer(checkpoints, tmp_path, block, size, message):
    path = _claiming_block(checkpoints, tmp_path, block)
    with pytest.raises(ValueError) as err:
        load_model(path, dtype="float64", device="cpu", tp=SimpleNamespace(rank=size - 1, size=size))
    assert str(err.value) == message


@pytest.mark.slow
def test_an_engine_refuses_a_shard_that_cuts_tiles_and_leaves_no_rank_running(checkpoints, tmp_path):
    """The same refusal from a TP 2 engine: every rank refuses at load, rank 0 raises it and closes rank 1."""
    path = _claiming_block(checkpoints, tmp_path, [32, 8])
    before = set(mp.active_children())
    with pytest.raises(ValueError) as err:
        LLM(model=str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=16, tensor_parallel_size=2)
    assert str(err.value) == K_PROJ_REFUSAL
    assert set(mp.active_children()) == before


def test_a_kv_scale_of_several_values_is_refused_by_name(checkpoints, tmp_path):
    """KV cache scales are one per layer, applied by every rank to its heads; a per-head tensor is refused."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["vllm-tensor-static-kv"]
    path = tmp_path / "per-head-kv"
    path.mkdir()
    (path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([1.0, 0.5])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_model(path, dtype="float64", device="cpu")
    assert str(err.value) == (
        "KV cache scale 'model.layers.1.self_attn.v_scale' in model.safetensors has 2 values; only one per layer "
        "(per-tensor) is supported"
    )


# -- engines: TP 2 against TP 1 on the same checkpoint ---------------------------------------------------------
# (format, engine flags): block-wise W8A8 (activations per token per bk features: a row-parallel rank's groups are
# TP 1's, its shard being whole tiles); per-channel W8A16 (every step at most 16 rows: activations unquantized);
# per-tensor W8A8 with static activation scales (the same scale on every rank) and an fp8 KV cache with the
# checkpoint's scales. Dynamic per-token W8A8 on per-channel weights is left out: a row-parallel rank scales its
# input over its own columns, as vLLM does, which TP 1 does not match bit for bit (test_tensor_parallel.py's
# --quantization fp8 test says the same).
ENGINE_CASES = [
    ("vllm-block-16x8", {}),
    ("ct-channel", dict(fp8_w8a16_max_rows=16, max_num_batched_tokens=16)),
    ("vllm-tensor-static-kv", dict(kv_cache_dtype="fp8")),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "flags"), ENGINE_CASES, ids=[fmt for fmt, _ in ENGINE_CASES])
def test_fp8_checkpoints_give_tp1_greedy_tokens_at_tp2(checkpoints, fmt, flags):
    prompts = make_prompts(n=6)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens, layouts = {}, {}
    for size in (1, 2):
        args = dict(dtype="float64", device="cpu", block_size=4, num_kv_blocks=NUM_BLOCKS, tensor_parallel_size=size)
        with LLM(model=str(checkpoints[fmt]), **{"max_num_batched_tokens": 48, **args, **flags}) as llm:
            tokens[size] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            assert llm.engine.num_free_blocks == NUM_BLOCKS
            layout = llm.engine.layout
            layouts[size] = (layout.dtype, layout.k_scales, layout.v_scales, layout.num_kv_heads)
    assert tokens[2] == tokens[1] and [len(t) for t in tokens[1]] == [MAX_NEW] * len(prompts)
    dtype, k_scales, v_scales, _ = layouts[1]
    assert layouts[2] == (dtype, k_scales, v_scales, NUM_KV_HEADS // 2)  # rank 0's pool: its one KV head
    if fmt == "vllm-tensor-static-kv":
        assert (dtype, k_scales, v_scales) == ("float8_e4m3fn", (0.5, 2.0), (0.25, 1.0))
