"""The engine on CUDA: exact against transformers in fp32 (tiny models of each architecture),
and near-exact in bf16 on the trained default model. Skipped without a GPU."""

import random

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import TINY_MODELS, hf_greedy, make_tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name, eager", [(name, False) for name in sorted(TINY_MODELS)] + [("llama-gqa2", True)])
def test_fp32_greedy_equals_transformers(name, eager, tmp_path):
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, **TINY_MODELS[name])
    prompts = make_prompts()
    expected = hf_greedy(path, prompts, 8, torch.float32, "cuda")
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=16,
        enforce_eager=eager,
    )
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.num_free_blocks == 128


def test_bf16_default_model_matches_transformers_on_most_prompts():
    from splitserve.common.default_model_path import default_model_path

    path = default_model_path()
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=16, num_kv_blocks=256)
    tok = llm.tokenizer
    texts = [
        f"def {name}("
        for name in (
            "fibonacci",
            "parse_args",
            "main",
            "read_file",
            "sort_items",
            "merge",
            "validate",
            "connect",
            "encode",
            "decode",
            "tokenize",
            "flatten",
            "unique",
            "chunks",
            "retry",
            "timer",
        )
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    expected = hf_greedy(path, prompts, 32, torch.bfloat16, "cuda")
    got = [
        o.token_ids
        for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        )
    ]
    same = sum(a == b for a, b in zip(got, expected))
    assert same >= 14, f"only {same} of 16 prompts match transformers in bf16"


def test_async_scheduling_gives_the_sync_loops_tokens_on_cuda(tmp_path):
    """Lagged reads on CUDA (graphs fed on the device from the previous step's tokens): greedy, seeded and
    stop-token requests give the synchronous loop's tokens, and every block comes back. fp32: the two loops
    batch differently (a request ended at the lagged read still rides one step), and near-ties could flip in
    bf16."""
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, **TINY_MODELS["qwen3-qknorm"])
    prompts = make_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for lagged in (False, True):
        llm = LLM(
            model=str(path),
            dtype="float32",
            device="cuda",
            block_size=16,
            num_kv_blocks=128,
            max_num_seqs=16,
            async_scheduling=lagged,
        )
        assert llm.engine.async_scheduling is lagged and llm.engine.runner.graphs is not None
        free_run = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        stops = [o.token_ids[5] for o in free_run]
        params = [
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stops[i]])
            if i % 3 == 0
            else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20 + i, ignore_eos=True)
            if i % 3 == 1
            else SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        results[lagged] = [o.token_ids for o in free_run], [(o.token_ids, o.finish_reason) for o in outs]
        assert llm.engine.num_free_blocks == 128
    assert results[True] == results[False]


def test_a_dropped_llm_gives_its_device_memory_back(tmp_path):
    """Two LLMs one after another in one process, each pool sized from memory (the bench's fixed shapes ran
    bf16 then fp8 so): the first engine froze the collector at start; once dropped, what it allocated is
    back."""
    import gc

    path = make_tiny_model_dir(tmp_path, dtype=torch.bfloat16)
    sizes, left = [], []
    for _ in range(2):
        llm = LLM(model=str(path), dtype="bfloat16", device="cuda", kv_cache_memory_fraction=0.3)
        sizes.append((llm.engine.info.num_kv_blocks, llm.engine.info.num_kv_blocks * llm.engine.layout.block_nbytes))
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
        del llm
        gc.collect()
        # cuBLAS keeps a workspace (32 MiB on an H200) for every stream it has run on, and each engine's graph
        # capture runs on a stream of torch's pool, a new one or one used before depending on what ran earlier
        # in the process: freed here, so that only the engine's own allocations are compared
        torch._C._cuda_clearCublasWorkspaces()
        left.append(torch.cuda.memory_allocated())
    # what stays after the first (kernels' caches made once) is about what stays after the second; an engine
    # left alive would add at least its KV pool
    pool_bytes = sizes[0][1]
    assert abs(left[1] - left[0]) < pool_bytes, f"{(left[1] - left[0]) / 2**20:.1f} MiB more after the second engine"
    assert sizes[0] == sizes[1]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs sm_90",
)
def test_pdl_leaves_the_tokens_unchanged(monkeypatch):
    """kernels.pdl on (the decode graphs' Triton kernels launched with PDL) changes no token, bf16 and fp8."""
    from splitserve.common.default_model_path import default_model_path
    from splitserve.kernels import pdl

    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for options in ({}, {"quantization": "fp8", "kv_cache_dtype": "fp8", "fp8_w8a16_max_rows": 16}):
        tokens = []
        for enabled in (False, True):
            monkeypatch.setattr(pdl, "ENABLED", enabled)
            with LLM(
                model=str(default_model_path()), device="cuda", num_kv_blocks=128, max_num_seqs=16, **options
            ) as llm:
                tokens.append([o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
        assert tokens[1] == tokens[0], f"{options}: PDL changed tokens"


def test_fp8_kv_tokens_are_the_same_with_the_fused_rotary_write(monkeypatch):
    """fp8 weights and KV cache: the fused rotary + KV write (kernels.rotary_kv_write, the default) gives the
    tokens the unfused rotary + write give (each layer's cache bytes and attention output are the same bits:
    tests/test_fused_ops.py), prompts and graphed decode steps alike."""
    from splitserve.common.default_model_path import default_model_path
    from splitserve.engine.worker import fused_ops

    prompts = make_prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls, tokens = [], []
    fused_rule = fused_ops.fused_write_applies
    for fused in (True, False):

        def applies(q, k, k_cache, fused=fused):
            calls.append((fused, k_cache.dtype))
            return fused_rule(q, k, k_cache) if fused else False

        monkeypatch.setattr(fused_ops, "fused_write_applies", applies)
        with LLM(
            model=str(default_model_path()),
            dtype="bfloat16",
            device="cuda",
            num_kv_blocks=128,
            max_num_seqs=16,
            quantization="fp8",
            kv_cache_dtype="fp8",
        ) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
    assert (True, torch.float8_e4m3fn) in calls and (False, torch.float8_e4m3fn) in calls
    assert tokens[0] == tokens[1]


def test_serving_compiles_no_kernel_after_start(tmp_path):
    """The engine compiles at start every kernel variant an eager step picks by its shape (warm_up_kernels, and
    the per-step counts not specialized on): fresh prompts, chunks over cached context and decodes beside
    prefills of every row-tile class, with block tables of many widths, then compile nothing more. A variant
    compiled mid-serving stopped every running stream for 1-2 s on an H100 (docs/performance.md)."""
    import triton

    path = make_tiny_model_dir(
        tmp_path, dtype=torch.bfloat16, max_position_embeddings=4096, **TINY_MODELS["llama-gqa2"]
    )
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        device="cuda",
        block_size=16,
        num_kv_blocks=4096,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=4096,
    )
    rng = random.Random(0)
    lengths = [1, 2, 15, 16, 17, 31, 33, 63, 65, 200, 1000, 1024, 1025, 1500, 3000]
    lengths += [rng.randint(1, 2000) for _ in range(20)]
    prompts = [[rng.randrange(3, 503) for _ in range(n)] for n in lengths]
    compiled = []

    def count(*args, **kwargs):
        compiled.append(kwargs["fn"].name)
        return False

    triton.knobs.runtime.jit_post_compile_hook = count
    try:
        outs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert [len(o.token_ids) for o in outs] == [24] * len(prompts)
    assert compiled == []
    assert llm.engine.num_free_blocks == 4096
