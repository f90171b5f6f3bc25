"""KV pool sizing: per-instance accounting with other processes on the GPU, the cap, the errors."""

import pytest

from splitserve.engine.worker.kv_sizing import (
    NON_TORCH_BYTES,
    RESERVE_BYTES,
    DeviceMemory,
    GiB,
    KvSizingError,
    MiB,
    cap_blocks,
    cpu_kv_blocks,
    gpu_kv_blocks,
)

H200 = 150_000_000_000  # bytes, about what torch reports for an H200
BLOCK = 32 * 1024  # the default model's block in bf16 (8 layers x 2 x 16 tokens x 1 kv head x 64 dims x 2 bytes)


def test_the_cap_is_twice_the_running_batch():
    assert cap_blocks(max_num_seqs=256, max_model_len=1024, block_size=16) == 2 * 256 * 64
    assert cap_blocks(max_num_seqs=4, max_model_len=1000, block_size=16) == 2 * 4 * 63  # a partial block counts


def test_a_small_model_gets_the_cap_not_the_gpu():
    """The default model on an H200: 32,768 blocks (1 GiB), not the 4 M blocks (127 GiB) of 90% of the GPU."""
    memory = DeviceMemory(total_bytes=H200, free_bytes=H200 - 600 * MiB, own_bytes=40 * MiB)
    assert gpu_kv_blocks(memory, 0.9, BLOCK, cap_blocks(256, 1024, 16), "cuda:0") == 32_768


def test_other_processes_memory_is_not_charged_to_this_instance():
    """Two instances on one GPU at 0.45 each: the second is sized from its own allocations, not total - free."""
    cap = 10**9  # uncapped, to see the budget
    own = 16 * GiB  # this process's weights
    first = DeviceMemory(total_bytes=H200, free_bytes=H200 - own, own_bytes=own)
    expected = (int(H200 * 0.45) - own - NON_TORCH_BYTES - RESERVE_BYTES) // BLOCK
    assert gpu_kv_blocks(first, 0.45, BLOCK, cap, "cuda:0") == expected
    # the other instance already holds 0.45 of the GPU: this one's budget does not change
    second = DeviceMemory(total_bytes=H200, free_bytes=H200 - own - int(H200 * 0.45), own_bytes=own)
    assert gpu_kv_blocks(second, 0.45, BLOCK, cap, "cuda:0") == expected


def test_a_fraction_too_small_for_the_weights_names_the_flag_and_the_numbers():
    memory = DeviceMemory(total_bytes=80 * GiB, free_bytes=64 * GiB, own_bytes=16 * GiB)
    with pytest.raises(KvSizingError) as info:
        gpu_kv_blocks(memory, 0.2, BLOCK, 10**9, "cuda:0")
    assert str(info.value) == (
        "--kv-cache-memory-fraction 0.2 gives this instance 16.00 GiB of cuda:0's 80.00 GiB; its weights and "
        "buffers take 16.00 GiB and 1.50 GiB stays for the CUDA context, activations and graphs, leaving "
        "0.00 GiB: not one KV block of 32768 bytes. Raise --kv-cache-memory-fraction, or set --num-kv-blocks"
    )


def test_a_pool_larger_than_what_is_free_names_the_other_processes():
    """The 0.9 default beside an instance that already took 0.6 of the GPU: refused, with the fix."""
    memory = DeviceMemory(total_bytes=100 * GiB, free_bytes=38 * GiB, own_bytes=2 * GiB)
    with pytest.raises(KvSizingError) as info:
        gpu_kv_blocks(memory, 0.9, 1 * MiB, 10**9, "cuda:0")
    num_blocks = (int(100 * GiB * 0.9) - 2 * GiB - NON_TORCH_BYTES - RESERVE_BYTES) // MiB
    assert str(info.value) == (
        f"the KV pool of {num_blocks} blocks ({num_blocks / 1024:.2f} GiB, from --kv-cache-memory-fraction 0.9 of "
        "cuda:0's 100.00 GiB) and 1.00 GiB for activations need more than the 38.00 GiB free now (other "
        "processes hold about 60.00 GiB): lower --kv-cache-memory-fraction of this or the other instances on "
        "cuda:0, or set --num-kv-blocks"
    )


def test_cpu_pools_are_capped_too():
    assert cpu_kv_blocks(1 << 30, BLOCK, cap=1000) == 1000
    assert cpu_kv_blocks(1 << 20, BLOCK, cap=10**9) == 32
    with pytest.raises(KvSizingError, match=r"^--kv-cache-cpu-bytes 1000 holds no KV block of 32768 bytes"):
        cpu_kv_blocks(1000, BLOCK, cap=10)


def _frozen_llm(tmp_path):
    """An LLM on CPU whose engine froze the collector as a CUDA engine does at start."""
    from splitserve.engine import LLM
    from tests.model_factory import make_tiny_model_dir

    llm = LLM(model=str(make_tiny_model_dir(tmp_path)), device="cpu", dtype="float32", num_kv_blocks=16)
    assert not llm.engine._froze_gc  # CPU does not freeze
    llm.engine._freeze_collector()
    return llm


def test_a_dropped_llm_is_collected_although_the_engine_froze_the_collector(tmp_path):
    """On CUDA the engine freezes the collector at start (gc.freeze: its pauses fell on the step loop), which
    also froze the engine's own reference cycles: a deleted LLM kept its weights, KV pool and graphs, and a
    second LLM in the process found the GPU taken (KvSizingError, 77 GiB 'own' on an H200)."""
    import gc
    import weakref

    llm = _frozen_llm(tmp_path)
    engine = weakref.ref(llm.engine)
    try:
        del llm
        assert engine() is None, "the dropped engine is still alive"
        assert gc.get_freeze_count() == 0  # no engine left open: nothing frozen again
    finally:
        gc.unfreeze()


def test_leaving_a_with_block_frees_the_engine_and_the_llm_refuses_to_run(tmp_path):
    import gc
    import weakref

    from splitserve.common.sampling_params import SamplingParams

    try:
        with _frozen_llm(tmp_path) as llm:
            engine = weakref.ref(llm.engine)
            assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))) == 1
        assert engine() is None  # freed on leaving the block, while `llm` is still bound
        with pytest.raises(RuntimeError, match="this LLM is closed: make a new one"):
            llm.generate(prompt_token_ids=[[1, 2, 3]])
        llm.close()  # twice: nothing happens
    finally:
        gc.unfreeze()


def test_closing_one_of_two_frozen_engines_keeps_the_other_frozen(tmp_path):
    """Two LLMs alive: closing the first frees it and freezes again what the second holds, so the second keeps
    the collector out of its step loop; closing the second leaves nothing frozen."""
    import gc
    import weakref

    from splitserve.common.sampling_params import SamplingParams

    try:
        first, second = _frozen_llm(tmp_path / "a"), _frozen_llm(tmp_path / "b")
        gone = weakref.ref(first.engine)
        first.close()
        assert gone() is None and second.engine._froze_gc and gc.get_freeze_count() > 0
        out = second.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_tokens=3))
        assert len(out[0].token_ids) == 3
        kept = weakref.ref(second.engine)
        second.close()
        assert kept() is None and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
