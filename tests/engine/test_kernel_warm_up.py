"""ModelRunner.warm_up_kernels: one forward per row-tile class of the paged prefill kernel, as a fresh prompt and
after a cached block, within the step budget and the model length; nothing is written to the KV cache. (On CUDA
the engine runs it at start; tests/engine/test_gpu_engine.py checks that serving then compiles nothing.)"""

import torch

from splitserve.engine import LLM
from tests.model_factory import make_tiny_model_dir


def test_warm_up_runs_each_tile_class_fresh_and_cached_without_writing_kv(tmp_path):
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, max_position_embeddings=2048)
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cpu",
        block_size=16,
        num_kv_blocks=80,
        max_model_len=1040,
        max_num_batched_tokens=1100,
    )
    runner = llm.engine.runner
    forward, calls = runner.model, []

    def recorded(input_ids, positions, kv_cache, meta):
        calls.append(
            (
                meta.max_query_len,
                meta.seq_lens_cpu,
                meta.query_start_loc_cpu,
                positions[0].item(),
                meta.slot_mapping.max().item(),
                tuple(meta.block_tables.shape),
            )
        )
        return forward(input_ids, positions, kv_cache, meta)

    runner.model = recorded
    runner.kv_cache.fill_(0.5)
    runner.warm_up_kernels(max_num_batched_tokens=1100, max_model_len=1040)
    # (longest query, sequence lengths, query starts, first position, largest slot, block table shape); 1,025 new
    # tokens after a cached block make 1,041, past max_model_len
    assert calls == [
        (16, [16], [0, 16], 0, -1, (1, 1)),
        (16, [32], [0, 16], 16, -1, (1, 2)),
        (32, [32], [0, 32], 0, -1, (1, 2)),
        (32, [48], [0, 32], 16, -1, (1, 3)),
        (64, [64], [0, 64], 0, -1, (1, 4)),
        (64, [80], [0, 64], 16, -1, (1, 5)),
        (1025, [1025], [0, 1025], 0, -1, (1, 65)),
    ]
    assert bool((runner.kv_cache == 0.5).all())
    calls.clear()
    runner.warm_up_kernels(max_num_batched_tokens=40, max_model_len=1040)  # a step of at most 40 tokens
    assert [c[0] for c in calls] == [16, 16, 32, 32]
