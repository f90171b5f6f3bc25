"""What every rank of an engine sets up the same way: its model (shard), KV layout and pool size.

Rank 0 (the engine core) and the ranks > 0 of a tensor-parallel instance (`worker/tp_worker.py`) run
the same functions, so their layouts and pools agree block for block.
"""

from __future__ import annotations

import gc
import os

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.kv_layout import FP8_KV_DTYPE, KvLayout
from splitserve.engine.worker.kv_cache import allocate_kv_cache, dtype_from_name
from splitserve.engine.worker.kv_sizing import DeviceMemory, cap_blocks, cpu_kv_blocks, gpu_kv_blocks
from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.tensor_parallel import TpGroup


def read_model_config(config: EngineConfig) -> ModelConfig:
    """The model directory's config (through transformers: rank 0 reads it once for every rank)."""
    return ModelConfig.from_pretrained(config.resolved_model(), model_id=config.model_id or None)


def load_rank_model(
    config: EngineConfig,
    device: torch.device,
    dtype_name: str,
    tp: TpGroup | None = None,
    model_config: ModelConfig | None = None,
):
    """(model, ModelConfig) of this rank: the whole model, or its slices under tensor parallelism."""
    from splitserve.engine.worker.loader import load_model

    return load_model(
        config.resolved_model(),
        dtype=dtype_from_name(dtype_name),
        device=device,
        load_format=config.load_format,
        seed=config.seed,
        model_id=config.model_id or None,
        quantization=config.quantization,
        fp8_w8a16_max_rows=config.fp8_w8a16_max_rows,
        tp=tp,
        model_config=model_config,
    )


def kv_layout_for(model, model_config, config: EngineConfig, dtype_name: str, tp: TpGroup | None = None) -> KvLayout:
    """The KV layout of --kv-cache-dtype: the model's dtype, or fp8 with per-layer scales (the
    checkpoint's, else 1.0), which the model's attention then applies. Under tensor parallelism a rank's
    pool holds its KV heads only (the layout names every rank's)."""
    size = tp.size if tp is not None else 1
    if not config.fp8_kv_cache:
        return model_config.kv_layout(config.block_size, dtype_name, tensor_parallel_size=size)
    scales = getattr(model, "checkpoint_kv_scales", None) or [(1.0, 1.0)] * model_config.num_layers
    model.set_kv_scales(scales)
    return model_config.kv_layout(config.block_size, FP8_KV_DTYPE, scales, tensor_parallel_size=size)


def max_model_len_of(config: EngineConfig, model_config) -> int:
    """The context limit: --max-model-len, never above the model's positions."""
    limit = model_config.max_position_embeddings
    return min(config.max_model_len or limit, limit)


def size_pool(
    config: EngineConfig, layout: KvLayout, device: torch.device, max_model_len: int, max_num_seqs: int
) -> int:
    """Blocks of a pool: --num-kv-blocks, else sized from memory (worker/kv_sizing.py), per instance on CUDA;
    `max_num_seqs`: the resolved cap (--max-num-seqs, else common/config.py's default_max_num_seqs)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    cap = cap_blocks(max_num_seqs, max_model_len, config.block_size)
    if device.type != "cuda":
        return cpu_kv_blocks(config.kv_cache_cpu_bytes, layout.block_nbytes, cap)
    gc.collect()
    torch.cuda.empty_cache()  # memory cached by an earlier engine in this process is free to take
    free, total = torch.cuda.mem_get_info(device)
    memory = DeviceMemory(total_bytes=total, free_bytes=free, own_bytes=torch.cuda.memory_reserved(device))
    return gpu_kv_blocks(memory, config.kv_cache_memory_fraction, layout.block_nbytes, cap, str(device))


def set_up_rank(config: EngineConfig, model_config: ModelConfig, dtype_name: str, max_num_seqs: int, tp: TpGroup):
    """A rank > 0: its model shard and KV tensor, the pool as large as the smallest rank's allows
    (rank 0 runs the same steps in EngineCore). Module-level: it is pickled to the rank."""
    # on CPU the ranks share the cores: without --num-threads each takes its share, not torch's default of all
    threads = config.num_threads or (max(1, (os.cpu_count() or 1) // tp.size) if tp.device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    model, model_config = load_rank_model(config, tp.device, dtype_name, tp, model_config)
    layout = kv_layout_for(model, model_config, config, dtype_name, tp)
    max_model_len = max_model_len_of(config, model_config)
    num_blocks = tp.min_over_ranks(size_pool(config, layout, tp.device, max_model_len, max_num_seqs))
    openers = tp.recv_object()  # rank 0's KvConnector may have placed this rank's pool (shared memory)
    if openers is None:
        return model, allocate_kv_cache(layout, num_blocks, tp.device)
    return model, openers[tp.rank](layout, num_blocks, tp.device)
