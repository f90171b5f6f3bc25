"""gpt-oss on CUDA (attention sinks and sliding windows in the paged decode and prefill kernels, the fused MoE
kernel's gpt-oss options, decode steps in CUDA graphs): greedy tokens in fp32 equal the CPU path (itself equal
to transformers), and fp8 experts and KV cache served through the same kernels. Skipped without a GPU."""

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_engine_exact import make_prompts
from tests.engine.test_gpt_oss_exact import GPT_OSS, WINDOW
from tests.model_factory import make_tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MAX_NEW = 8


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpt-oss-fp32"), dtype=torch.float32, **GPT_OSS)


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_greedy_on_cuda_equals_the_cpu_path(fp32_dir, eager):
    """Prompts up to 40 tokens (five windows of 8) in chunks of at most 64 tokens a step, so prefill runs over
    cached context and fresh prompts alike; decode steps in graphs unless eager. The reference is this engine's
    CPU path, which test_gpt_oss_exact holds equal to the locked transformers in float64: a GPU machine's own
    transformers may be another release (5.17 computes gpt-oss differently from the lock's 5.25)."""
    prompts = make_prompts(n=10)
    assert max(len(p) for p in prompts) > 4 * WINDOW
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [
        o.token_ids
        for o in fp32_engine(fp32_dir, "cpu", eager=True).generate(prompt_token_ids=prompts, sampling_params=greedy)
    ]
    llm = fp32_engine(fp32_dir, "cuda", eager)
    assert (llm.engine.runner.graphs is None) == eager
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.num_free_blocks == 128


def fp32_engine(model_dir, device: str, eager: bool) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype="float32",
        device=device,
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enforce_eager=eager,
    )


def test_fp8_experts_run_the_triton_kernel_as_the_cpu_path_computes_them(tmp_path):
    """--quantization fp8 on CUDA: a layer's e4m3 experts through the fused Triton kernel (the block's forward)
    equal the CPU path (the torch reference on the dequantized weights) on the same routing, within bf16
    rounding (the routing is taken from the GPU's: a near-tie could pick other experts on the CPU)."""
    import torch.nn.functional as F

    from splitserve.engine.worker.loader import load_model
    from splitserve.engine.worker.models.gpt_oss_moe import route_topk_softmax
    from splitserve.kernels.fused_moe import fused_moe

    path = make_tiny_model_dir(tmp_path, dtype=torch.bfloat16, **GPT_OSS)
    net, _ = load_model(path, dtype="bfloat16", device="cuda", quantization="fp8")
    block = net.model.layers[0].mlp
    experts = block.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    weights, ids = route_topk_softmax(F.linear(x, block.router.weight, block.router.bias), block.top_k)
    tensors = (experts.gate_up_proj, experts.down_proj, weights, ids)
    options = dict(
        w13_scale=experts.gate_up_scale,
        w2_scale=experts.down_scale,
        w13_bias=experts.gate_up_proj_bias,
        w2_bias=experts.down_proj_bias,
        clamped_swiglu=(block.alpha, block.limit),
        interleaved=True,
    )
    got = block(x)
    assert torch.equal(got, fused_moe(x, *tensors, **options, impl="triton"))
    on_cpu = {name: value.cpu() if torch.is_tensor(value) else value for name, value in options.items()}
    want = fused_moe(x.cpu(), *(t.cpu() for t in tensors), **on_cpu, impl="ref")
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fp8_experts_and_kv_cache_serve_with_graphs_and_give_every_block_back(tmp_path):
    """bf16 with --quantization fp8 and --kv-cache-dtype fp8: the sinks and windows run in the decode upcast
    kernel over the e4m3 cache (graphed) and the prefill kernel; every request runs to its length, no block
    leaks, and the first token of every prompt (a prefill over the cache) equals the eager engine's."""
    path = make_tiny_model_dir(tmp_path, dtype=torch.bfloat16, **GPT_OSS)
    prompts = make_prompts(n=10)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    firsts = []
    for eager in (False, True):
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            device="cuda",
            block_size=16,
            num_kv_blocks=128,
            max_num_seqs=16,
            quantization="fp8",
            kv_cache_dtype="fp8",
            enforce_eager=eager,
        )
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
        assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_NEW for o in outs)
        assert llm.engine.num_free_blocks == 128
        firsts.append([o.token_ids[0] for o in outs])
    assert firsts[0] == firsts[1]
