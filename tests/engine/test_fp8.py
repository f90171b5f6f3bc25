"""FP8 weights and KV cache on CPU: the quantization math against float64, Fp8Linear's reference path,
fp8 checkpoints (compressed-tensors and vLLM's fp8) written here, loaded and generating, quantize-at-load,
KV scales, the fp8 KvLayout across the wire and the gateway's refusal, and fp8 blocks moving as bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.common.config import EngineConfig
from splitserve.common.config_fields import ConfigError
from splitserve.common.kv_layout import KvLayout
from splitserve.common.wire import layout_from_proto, layout_to_proto
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_connectors.block_copies import copy_block_runs
from splitserve.engine.kv_connectors.shm_pool import copy_blocks
from splitserve.engine.worker import fp8 as quant
from splitserve.engine.worker.fp8 import (
    FP8_DTYPE,
    MAX_W8A16_ROWS,
    Fp8Linear,
    dequantize,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_group,
    quantize_static,
)
from splitserve.engine.worker.fp8_checkpoint import read_fp8_scheme
from splitserve.engine.worker.loader import load_model
from splitserve.gateway.registry import layout_mismatch
from tests.model_factory import make_tiny_model_dir

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every finite e4m3 value, for exact checks of rounding to the nearest one
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).double()
E4M3_VALUES = E4M3_VALUES[E4M3_VALUES.isfinite()].unique()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 reference of the e4m3 cast: the nearest representable value (ties: even mantissa)."""
    x = x.double().clamp(-448, 448)
    dist = (x[..., None] - E4M3_VALUES).abs()  # (..., 253)
    best = dist.min(dim=-1, keepdim=True).values
    candidates = torch.where(dist == best, E4M3_VALUES, torch.nan)
    low, high = candidates.nan_to_num(float("inf")).min(-1).values, candidates.nan_to_num(-float("inf")).max(-1).values
    even = (low.to(FP8_DTYPE).view(torch.uint8) & 1) == 0
    return torch.where(low == high, low, torch.where(even, low, high))


def test_per_channel_weight_quantization_matches_float64():
    gen = torch.Generator().manual_seed(0)
    w = (
        torch.randn(48, 32, generator=gen, dtype=torch.float64)
        * torch.logspace(-3, 1, 48, dtype=torch.float64)[:, None]
    )
    w[5] = 0.0  # an all-zero row: quantizes to zeros (no division by zero)
    w_q, scale = quantize_per_channel(w)
    assert w_q.dtype == FP8_DTYPE and w_q.shape == (48, 32) and scale.dtype == torch.float32 and scale.shape == (48,)
    amax = w.float().abs().amax(dim=1).double()
    expected_scale = torch.where(amax > 0, amax / 448, torch.tensor(1 / (448 * 512), dtype=torch.float64))
    torch.testing.assert_close(scale.double(), expected_scale, rtol=1e-7, atol=0)
    expected = nearest_e4m3(w.float().double() / scale.double()[:, None])  # what the fp32 division feeds the cast
    assert torch.equal(w_q.double(), nearest_e4m3(w.float() / scale[:, None]))
    torch.testing.assert_close(w_q.double(), expected, rtol=2**-20, atol=0)
    assert w_q.double().abs().amax(dim=1)[amax > 0].eq(448).all()  # each row uses the whole range
    assert torch.equal(w_q[5].double(), torch.zeros(32, dtype=torch.float64))
    # e4m3 keeps 3 mantissa bits: relative error of a normal value at most 2^-4
    err = (dequantize(w_q, scale[:, None], torch.float64) - w).abs()
    assert bool((err <= w.abs() * 2**-4 + scale.double()[:, None] * 2**-9).all())


def test_per_token_and_static_activation_quantization():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 40, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 100, 1000, 0.5])[:, None]
    x_q, scale = quantize_per_token(x)
    assert x_q.dtype == FP8_DTYPE and scale.shape == (7, 1)
    torch.testing.assert_close(scale.double(), x.double().abs().amax(dim=1, keepdim=True) / 448, rtol=1e-6, atol=0)
    assert torch.equal(x_q.double(), nearest_e4m3(x / scale))
    static = torch.tensor(0.01)
    assert torch.equal(quantize_static(x, static).double(), nearest_e4m3((x / static).clamp(-448, 448)))
    assert quantize_static(x, static).double().abs().max() == 448  # clamped, not inf/nan


def _fp8_layer(
    dtype, device="cpu", seed=2, n=48, k=32, output_sizes=(16, 16, 16), w8a16_max_rows=0
) -> tuple[torch.nn.Module, Fp8Linear]:
    """An unquantized linear (models.llama.Linear's attributes) and its Fp8Linear."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Module()
    linear.weight = torch.nn.Parameter((torch.randn(n, k, generator=gen) * 0.1).to(device, dtype), requires_grad=False)
    linear.bias = torch.nn.Parameter(torch.randn(n, generator=gen).to(device, dtype), requires_grad=False)
    linear.output_sizes = output_sizes
    return linear, Fp8Linear.from_linear(linear, w8a16_max_rows)


def _dequantized_weight(layer: Fp8Linear) -> torch.Tensor:
    return layer.weight.double() * layer.weight_scale.double()[:, None]  # (N, K) float64


def _operands_seen(x: torch.Tensor, w8a16: bool) -> torch.Tensor:
    """float64 of the activations a layer multiplies: x itself (W8A16) or its per-token e4m3 values (W8A8)."""
    if w8a16:
        return x.double()
    x_q, x_scale = quantize_per_token(x)
    return x_q.double() * x_scale.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_rows", [0, MAX_W8A16_ROWS])
@pytest.mark.parametrize("rows", [1, MAX_W8A16_ROWS, MAX_W8A16_ROWS + 1, 40])
def test_fp8_linear_reference_paths_match_float64(dtype, max_rows, rows):
    """By default (fp8_w8a16_max_rows 0) every step is W8A8 (per-token activations; batch-invariant); with
    the switch at 16, steps of up to 16 rows keep x unquantized (W8A16, through the kernel's reference)."""
    linear, layer = _fp8_layer(dtype, w8a16_max_rows=max_rows)
    assert not layer.use_scaled_mm and not layer.use_skinny_kernel
    assert layer.weight.dtype == FP8_DTYPE and layer.output_sizes == (16, 16, 16)
    assert layer.w8a16_max_rows == max_rows
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)
    y = layer(x)
    # float64 of what the layer multiplies: exact products of the operands it sees
    expected = _operands_seen(x, rows <= max_rows) @ _dequantized_weight(layer).T + linear.bias.double()
    assert y.dtype == dtype and y.shape == (rows, 48)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)
    # and the quantization error itself stays small against the unquantized product
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    assert (y.double() - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_row_gets_the_same_result_in_any_batch_unless_w8a16_is_on():
    """The default (W8A8 at every size) keeps a token's result independent of the rows beside it (to float64
    rounding); with fp8_w8a16_max_rows 16 it is not: alone the row skips the activation quantization it gets
    in a batch of 40."""
    _, layer = _fp8_layer(torch.float64)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(layer(x[:1]), layer(x)[:1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer(x[3:20]), layer(x)[3:20], rtol=1e-12, atol=1e-12)
    _, w8a16 = _fp8_layer(torch.float64, w8a16_max_rows=MAX_W8A16_ROWS)
    assert (w8a16(x[:1]) - w8a16(x)[:1]).abs().max() > 1e-3


def test_w8a16_switch_limits_and_reaches_every_layer(f64_dir):
    """EngineConfig.fp8_w8a16_max_rows: 0 by default, at most the kernel's rows (one limit in three places),
    and what every Fp8Linear of a model loaded with it (quantized at load or an fp8 checkpoint) runs."""
    from splitserve.kernels.fp8_skinny_linear import MAX_ROWS

    field = EngineConfig.__dataclass_fields__["fp8_w8a16_max_rows"]
    assert field.default == 0 and field.metadata["max"] == MAX_W8A16_ROWS == MAX_ROWS
    with pytest.raises(ConfigError, match="--fp8-w8a16-max-rows"):
        EngineConfig(fp8_w8a16_max_rows=MAX_ROWS + 1)
    with pytest.raises(ValueError, match="w8a16_max_rows is 17; choose 0 \\(off\\) to 16"):
        _fp8_layer(torch.float64, w8a16_max_rows=17)
    for max_rows in (0, 4):
        net, _ = load_model(f64_dir, dtype=torch.float64, device="cpu", quantization="fp8", fp8_w8a16_max_rows=max_rows)
        layers = [m for m in net.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 4 * 2  # qkv, o, gate_up, down in each of the 2 layers
        assert {m.w8a16_max_rows for m in layers} == {max_rows}
        assert f"rows <= {max_rows}: W8A16 reference" in repr(layers[0])
    llm = LLM(
        str(f64_dir),
        dtype="float64",
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        quantization="fp8",
        fp8_w8a16_max_rows=16,
    )
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 8 and {m.w8a16_max_rows for m in layers} == {16}


def test_cpu_scaled_mm_agrees_with_the_reference_path():
    """torch's own e4m3 GEMM (what CUDA runs) on the same operands gives the reference's numbers."""
    gen = torch.Generator().manual_seed(3)
    w_q, w_scale = quantize_per_channel(torch.randn(32, 64, generator=gen))
    x_q, x_scale = quantize_per_token(torch.randn(4, 64, generator=gen))
    try:
        got = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"this torch has no CPU _scaled_mm: {err}")
    expected = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).T
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_rows", [0, MAX_W8A16_ROWS])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 128])
def test_fp8_linear_gpu_paths_match_their_references_on_gpu(max_rows, rows):
    """On sm_89+: the row-wise e4m3 GEMM at every size (the default), or with fp8_w8a16_max_rows 16 the W8A16
    Triton kernel up to 16 rows; each equals the float64 product of the operands it sees (bf16 output
    rounding apart)."""
    linear, layer = _fp8_layer(torch.bfloat16, "cuda", 6, 96, 64, (32, 64), w8a16_max_rows=max_rows)
    if torch.cuda.get_device_capability() < (8, 9):
        assert not layer.use_scaled_mm and not layer.use_skinny_kernel
        pytest.skip("no e4m3 GEMM before compute capability 8.9")
    assert layer.use_scaled_mm and layer.use_skinny_kernel == (max_rows > 0)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)).bfloat16().cuda()
    got = layer(x)
    want = _operands_seen(x, rows <= max_rows) @ _dequantized_weight(layer).T + linear.bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w8a16_tiles_table_reaches_the_kernel_on_gpu(monkeypatch):
    """W8A16_TILES (measured tiles, read at finalize) is what the layer's kernel runs: the same bits as the
    kernel called with those tiles; a layer of another shape keeps the kernel's own."""
    from splitserve.kernels.fp8_skinny_linear import fp8_skinny_linear_triton

    gemv = dict(DOT=True, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT_K=2)
    monkeypatch.setattr(quant, "W8A16_TILES", {("gemv", 96, 64): gemv})
    _, layer = _fp8_layer(torch.bfloat16, "cuda", 6, 96, 64, (32, 64), w8a16_max_rows=MAX_W8A16_ROWS)
    if not layer.use_skinny_kernel:
        pytest.skip("no e4m3 kernel before compute capability 8.9")
    assert layer.skinny_tiles == {"gemv": gemv}
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(7)).bfloat16().cuda()
    want = fp8_skinny_linear_triton(x, layer.weight, layer.weight_scale, layer.bias, config=gemv)
    assert torch.equal(layer(x), want)
    _, other = _fp8_layer(torch.bfloat16, "cuda", 6, 48, 64, w8a16_max_rows=MAX_W8A16_ROWS)
    assert other.skinny_tiles == {}


# -- checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f64_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("fp8"), "llama", num_kv_heads=2)


def _write_fp8_checkpoint(src: Path, dst: Path, quantization_config: dict, per_tensor: bool, kv_scales=None) -> Path:
    """Copy `src` with every projection quantized: e4m3 weights, weight_scale (and input_scale when static)."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    out = {}
    static = quantization_config.get("activation_scheme") == "static"
    for name, tensor in tensors.items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in PROJECTIONS:
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if per_tensor:
            scale = (tensor.float().abs().max() / 448).reshape(())
            out[name] = (tensor.float() / scale).clamp(-448, 448).to(FP8_DTYPE)
            out[prefix + ".weight_scale"] = scale
        else:
            w_q, scale = quantize_per_channel(tensor)
            out[name], out[prefix + ".weight_scale"] = w_q, scale[:, None]  # (N, 1), as llm-compressor writes
        if static:
            out[prefix + ".input_scale"] = torch.tensor(0.05 if "q_proj" in name else 0.02)
    for layer, (k, v) in enumerate(kv_scales or ()):
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def _greedy(model_dir: Path, **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float64", device="cpu", num_kv_blocks=64, block_size=4, **engine_args)
    prompts = [[5, 17, 99, 3, 250], [7, 7, 7], [100, 200, 300, 400, 12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_compressed_tensors_checkpoint_loads_exactly_and_generates_like_quantize_at_load(f64_dir, tmp_path):
    path = _write_fp8_checkpoint(f64_dir, tmp_path / "ct", COMPRESSED_TENSORS, per_tensor=False)
    assert read_fp8_scheme(path).static_activations is False
    net, _ = load_model(path, dtype=torch.float64, device="cpu")
    written = load_file(path / "model.safetensors")
    qkv = net.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.input_scale is None
    parts = [written[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    scales = [written[f"model.layers.1.self_attn.{p}.weight_scale"][:, 0] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight_scale, torch.cat(scales))
    assert net.lm_head.weight.dtype == torch.float64 and net.checkpoint_kv_scales is None
    # the same per-channel quantization, done at load from the float64 checkpoint: the same tokens
    assert _greedy(path) == _greedy(f64_dir, quantization="fp8")


def test_vllm_fp8_static_per_tensor_checkpoint_with_kv_scales(f64_dir, tmp_path):
    config = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    kv = [(0.5, 0.25), (2.0, 1.0)]
    path = _write_fp8_checkpoint(f64_dir, tmp_path / "vllm", config, per_tensor=True, kv_scales=kv)
    net, _ = load_model(path, dtype=torch.float64, device="cpu")
    written = load_file(path / "model.safetensors")
    gate_up = net.model.layers[0].mlp.gate_up_proj
    assert torch.equal(gate_up.input_scale, torch.tensor([0.02, 0.02]))
    qkv = net.model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.input_scale, torch.tensor([0.05, 0.02, 0.02])) and torch.equal(
        qkv._static_scale, torch.tensor([[0.05]])
    )
    q_rows = written["model.layers.0.self_attn.q_proj.weight_scale"].expand(64)  # per-tensor scale on every row
    assert torch.equal(qkv.weight_scale[:64], q_rows)
    assert net.checkpoint_kv_scales == kv
    llm = LLM(str(path), dtype="float64", device="cpu", num_kv_blocks=64, block_size=4, kv_cache_dtype="fp8")
    assert llm.engine.layout.k_scales == (0.5, 2.0) and llm.engine.layout.v_scales == (0.25, 1.0)
    attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn] == kv
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"quant_method": "gptq"}, "quantization_config.quant_method 'gptq' in"),
        (
            {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "static"},
            "quantization_config.activation_scheme 'static' with weight_block_size: block-wise fp8 scales",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            "quantization_config.weight_block_size [128] must be two positive integers [rows, columns]",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [32, 48]},
            "block-wise fp8: weight_block_size [32, 48] needs positive sizes and in_features 64 a multiple of its 48",
        ),
        (
            {**COMPRESSED_TENSORS, "format": "pack-quantized"},
            "quantization_config.format 'pack-quantized' (compressed-tensors) is not supported",
        ),
    ],
)
def test_unsupported_quantization_configs_are_refused_by_name(f64_dir, tmp_path, edit, message):
    path = tmp_path / "bad"
    path.mkdir()
    (path / "model.safetensors").write_bytes((f64_dir / "model.safetensors").read_bytes())
    config = json.loads((f64_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": edit}))
    with pytest.raises(ValueError) as err:
        load_model(path, dtype=torch.float64, device="cpu")
    assert message in str(err.value)


# -- block-wise fp8 checkpoints ----------------------------------------------------------------


def _quantize_blocks(weight: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (e4m3 (N, K), fp32 scales (ceil(N / bn), K / bk)): amax / 448 per tile, as DeepSeek-V3's
    and Qwen3's FP8 releases are written (a last, partial row of tiles scaled over its own rows)."""
    n, k = weight.shape
    rows = -(-n // bn)
    padded = torch.zeros(rows * bn, k, dtype=torch.float64)
    padded[:n] = weight.double()
    tiles = padded.view(rows, bn, k // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448).float()  # (rows, K / bk)
    w_q = nearest_e4m3(tiles / scale.double()[:, None, :, None]).to(FP8_DTYPE).reshape(rows * bn, k)[:n]
    return w_q, scale


def _write_block_checkpoint(src: Path, dst: Path, quantization_config: dict, block, scale_name: str) -> Path:
    """Copy `src` with every projection quantized in `block` tiles: e4m3 weights and their tiles' scales."""
    dst.mkdir()
    out = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module in PROJECTIONS:
            out[name], out[name.removesuffix("weight") + scale_name] = _quantize_blocks(tensor, *block)
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


VLLM_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
CT_BLOCK = {
    **COMPRESSED_TENSORS,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 32]},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
                                  "dynamic": True},
        }
    },
}  # fmt: skip


def test_per_token_group_quantization_matches_float64():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    x[2, 32:64] = 0  # a group of zeros: the smallest scale, zeros out
    x_q, scale = quantize_per_token_group(x, 32)
    want_scale = (x.view(5, 3, 32).abs().amax(2).float() / 448).clamp(min=quant.MIN_SCALE)
    assert x_q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (5, 3)
    assert torch.equal(scale, want_scale)
    want_q = nearest_e4m3(x.float().double().view(5, 3, 32) / want_scale.double()[..., None]).view(5, 96)
    assert torch.equal(x_q.double(), want_q)
    assert torch.equal(x_q[2, 32:64].double(), torch.zeros(32, dtype=torch.float64))


@pytest.mark.parametrize(
    ("config", "block", "scale_name"),
    [(VLLM_BLOCK, (32, 32), "weight_scale_inv"), (CT_BLOCK, (64, 32), "weight_scale")],
    ids=["vllm-fp8", "compressed-tensors"],
)
def test_block_wise_checkpoint_loads_its_tiles_and_multiplies_exactly(f64_dir, tmp_path, config, block, scale_name):
    """A block-wise checkpoint (vLLM's fp8 method with weight_block_size, llm-compressor's FP8_BLOCK) loads its e4m3
    weights and tile scales as written, the fused parts' tiles one after another (64-row tiles over the 32-row k and
    v parts and the 96-row gate and up: partial last tiles); a projection gives exactly the float64 product of the
    dequantized weight and the input quantized per token per 32 features."""
    path = _write_block_checkpoint(f64_dir, tmp_path / "block", config, block, scale_name)
    scheme = read_fp8_scheme(path)
    assert (scheme.block, scheme.scale_name, scheme.static_activations) == (block, scale_name, False)
    net, _ = load_model(path, dtype=torch.float64, device="cpu")
    written = load_file(path / "model.safetensors")
    for module, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj",
                          "up_proj")), ("mlp.down_proj", ("down_proj",))):  # fmt: skip
        layer = net.model.layers[1].get_submodule(module)
        prefix = f"model.layers.1.{module.split('.')[0]}"
        weights = [written[f"{prefix}.{p}.weight"] for p in parts]
        scales = [written[f"{prefix}.{p}.{scale_name}"] for p in parts]
        assert isinstance(layer, Fp8Linear) and layer.block == block and not layer.use_block_kernel
        assert torch.equal(layer.weight.view(torch.uint8), torch.cat(weights).view(torch.uint8))
        assert torch.equal(getattr(layer, scale_name), torch.cat(scales)), module
        assert [s.shape[0] for s in scales] == [-(-w.shape[0] // block[0]) for w in weights]
        w_deq = torch.cat([w.double() * s.double().repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(
            block[1], 1) for w, s in zip(weights, scales)])  # fmt: skip
        x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        groups = x.view(7, -1, block[1])
        x_scale = (groups.abs().amax(2).float() / 448).double()
        x_deq = (nearest_e4m3(groups / x_scale[..., None]) * x_scale[..., None]).view(7, -1)
        torch.testing.assert_close(layer(x), x_deq @ w_deq.t(), rtol=1e-12, atol=1e-12)
    assert "in 32 x 32 blocks" in repr(net) if block == (32, 32) else "in 64 x 32 blocks" in repr(net)


def test_block_wise_formats_generate_the_same_tokens(f64_dir, tmp_path):
    """The same 32 x 32 tiles written as vLLM's fp8 method and as llm-compressor's FP8_BLOCK: the same tokens."""
    ct = json.loads(json.dumps(CT_BLOCK))
    ct["config_groups"]["group_0"]["weights"]["block_structure"] = [32, 32]
    vllm = _write_block_checkpoint(f64_dir, tmp_path / "vllm", VLLM_BLOCK, (32, 32), "weight_scale_inv")
    compressed = _write_block_checkpoint(f64_dir, tmp_path / "ct", ct, (32, 32), "weight_scale")
    tokens = _greedy(vllm)
    assert tokens == _greedy(compressed) and [len(t) for t in tokens] == [8, 8, 8]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs e4m3 tensor cores"
)
def test_block_wise_layers_run_the_kernel_on_gpu(f64_dir, tmp_path):
    """On sm_89+ every block-wise projection multiplies through kernels.fp8_block_linear, agreeing with the CPU
    reference to 1e-2 relative (an activation on an e4m3 tie may round the other way: the CPU's amax / 448 can be one
    ulp off the GPU's); the engine generates with it."""
    path = _write_block_checkpoint(f64_dir, tmp_path / "block", VLLM_BLOCK, (32, 32), "weight_scale_inv")
    on_gpu, _ = load_model(path, dtype=torch.bfloat16, device="cuda")
    on_cpu, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"):
        gpu_layer, cpu_layer = (net.model.layers[0].get_submodule(name) for net in (on_gpu, on_cpu))
        assert gpu_layer.use_block_kernel and not cpu_layer.use_block_kernel
        got, want = gpu_layer(x.cuda()).float().cpu(), cpu_layer(x).float()
        assert float((got - want).norm() / want.norm()) < 1e-2, name
    llm = LLM(str(path), dtype="bfloat16", device="cuda", num_kv_blocks=64, block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]] * 3, sampling_params=greedy)
    assert [len(o.token_ids) for o in out] == [8, 8, 8] and out[0].token_ids == out[1].token_ids == out[2].token_ids
    llm.close()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs e4m3 tensor cores"
)
def test_block_wise_128_tiles_take_scaled_mm_from_17_rows_on_gpu(monkeypatch):
    """128 x 128 tiles whose rows line up with every fused part and K / 128 a multiple of 4: up to 16 rows
    kernels.fp8_block_linear, from 17 torch._scaled_mm's block scaling (rows padded to a multiple of 4); both agree
    with the CPU reference (Hopper's e4m3 tensor-core sums keep fewer bits than fp32: 7e-4 relative; the CPU's
    amax / 448 may be one ulp off the GPU's, moving an activation on an e4m3 tie a step: 1e-2 in all). K / 128 = 2
    or 64-row parts keep the kernel at every size."""
    if not quant.block_scaled_mm_works(0):
        pytest.skip("this torch's _scaled_mm gives no 128 x 128 block-scaled product (quant.block_scaled_mm_works)")
    layers = {}
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(5)  # the same weights on both
        layer = Fp8Linear(512, [128, 128, 256], True, torch.bfloat16, device, block=(128, 128))
        layer.weight.data.copy_((torch.randn(512, 512, generator=gen) * 40).clamp(-448, 448).to(FP8_DTYPE))
        layer.block_scale.data.copy_(torch.rand(4, 4, generator=gen) * 1e-3 + 1e-4)
        layer.bias.data.copy_(torch.randn(512, generator=gen).bfloat16())
        layer.finalize(0)
        layers[device] = layer
    gpu = layers["cuda"]
    assert gpu.use_block_kernel and gpu.use_block_scaled_mm
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for rows in (1, 16, 17, 32, 100, 300):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got, want = gpu(x.cuda()), layers["cpu"](x).float()
        assert got.shape == (rows, 512) and got.dtype == torch.bfloat16
        assert float((got.float().cpu() - want).norm() / want.norm()) < 1e-2, f"{rows} rows"
    assert calls == [20, 32, 100, 300]  # 17 rows padded to 20
    for k, parts in ((256, [128, 128]), (512, [64, 64])):
        other = Fp8Linear(k, parts, False, torch.bfloat16, "cuda", block=(128, 128))
        other.finalize(0)
        assert other.use_block_kernel and not other.use_block_scaled_mm, (k, parts)


def test_block_wise_refuses_w8a16_and_mismatched_activation_groups(f64_dir, tmp_path):
    path = _write_block_checkpoint(f64_dir, tmp_path / "block", VLLM_BLOCK, (32, 32), "weight_scale_inv")
    with pytest.raises(ValueError, match="--fp8-w8a16-max-rows 16: a block-wise fp8 checkpoint runs W8A8 at every"):
        load_model(path, dtype=torch.float64, device="cpu", fp8_w8a16_max_rows=16)
    bad = json.loads(json.dumps(CT_BLOCK))
    bad["config_groups"]["group_0"]["input_activations"]["group_size"] = 64
    (path / "config.json").write_text(
        json.dumps({**json.loads((path / "config.json").read_text()), "quantization_config": bad})
    )
    with pytest.raises(ValueError, match="block-wise weights need dynamic activations in groups of the block's 32 col"):
        read_fp8_scheme(path)


def test_unquantized_tensor_in_an_fp8_checkpoint_is_refused(f64_dir, tmp_path):
    path = f64_dir.parent / "plain-claims-fp8"
    if not path.exists():
        path.mkdir()
        (path / "model.safetensors").write_bytes((f64_dir / "model.safetensors").read_bytes())
        config = json.loads((f64_dir / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": COMPRESSED_TENSORS}))
    with pytest.raises(ValueError) as err:
        load_model(path, dtype=torch.float64, device="cpu")
    assert "is float64, expected float8_e4m3fn (quantization_config and the tensors disagree)" in str(err.value)


# -- the fp8 KV cache -------------------------------------------------------------------------


def test_fp8_kv_cache_engine_generates_and_halves_the_block_bytes(f64_dir):
    llm = LLM(str(f64_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, kv_cache_dtype="fp8")
    layout = llm.engine.layout
    assert layout.dtype == "float8_e4m3fn" and layout.k_scales == (1.0, 1.0) and layout.v_scales == (1.0, 1.0)
    assert layout.block_nbytes == 2 * 2 * 4 * 2 * 16  # layers x (k, v) x tokens x heads x head_dim, one byte each
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    out = llm.generate(
        prompt_token_ids=[[5, 6, 7, 8, 9]], sampling_params=SamplingParams(max_tokens=6, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 6


def test_fp8_e4m3_is_fp8_and_other_kv_dtypes_are_refused_by_name(f64_dir):
    """vLLM's --kv-cache-dtype fp8_e4m3 is the same cache as fp8 (same layout, same tokens); fp8_e5m2 and other
    names are refused naming the flag and the choices."""
    outs = {}
    for name in ("fp8", "fp8_e4m3"):
        llm = LLM(str(f64_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, kv_cache_dtype=name)
        assert llm.engine.layout.dtype == "float8_e4m3fn" and llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        outs[name] = llm.generate(prompt_token_ids=[[5, 6, 7, 8, 9]], sampling_params=params)[0].token_ids
        llm.close()
    assert outs["fp8"] == outs["fp8_e4m3"] and len(outs["fp8"]) == 8
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype='fp8_e5m2' is not allowed; choose one of auto, fp8, "
                       r"fp8_e4m3$"):  # fmt: skip
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_fp8_layout_round_trips_the_wire_and_mismatches_name_both():
    fp8 = KvLayout(2, 2, 16, 4, "float8_e4m3fn", "m", k_scales=(0.5, 1.0), v_scales=(1.0, 1.0))
    assert layout_from_proto(layout_to_proto(fp8)) == fp8
    bf16 = KvLayout(2, 2, 16, 4, "bfloat16", "m")
    text = (
        "KV layouts differ: [num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=float8_e4m3fn, "
        "model_id=m, layout=block_major_v1, k_scales=[0.5,1], v_scales=1x2] vs [num_layers=2, num_kv_heads=2, "
        "head_dim=16, block_size=4, dtype=bfloat16, model_id=m, layout=block_major_v1]"
    )
    assert fp8.mismatch(bf16) == text
    assert layout_mismatch(layout_to_proto(fp8), layout_to_proto(bf16)) == text
    other_scales = KvLayout(2, 2, 16, 4, "float8_e4m3fn", "m", k_scales=(1.0, 1.0), v_scales=(1.0, 1.0))
    assert layout_mismatch(layout_to_proto(fp8), layout_to_proto(other_scales)) is not None
    with pytest.raises(ValueError, match="KV layout of dtype float8_e4m3fn: 0 k_scales and 0 v_scales, expected 2"):
        KvLayout(2, 2, 16, 4, "float8_e4m3fn", "m")


@pytest.mark.parametrize("copy", [copy_block_runs, copy_blocks])
def test_fp8_blocks_copy_bit_exactly(copy):
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(6, 2, 2, 4, 2, 16, generator=gen).to(FP8_DTYPE)
    dst = torch.zeros_like(src)
    num_bytes = copy(src, [4, 0, 1], dst, [1, 2, 3])
    assert num_bytes == 3 * src[0].numel()  # one byte an element
    assert torch.equal(dst[[1, 2, 3]].view(torch.uint8), src[[4, 0, 1]].view(torch.uint8))
    assert torch.equal(dst[[0, 4, 5]].view(torch.uint8), torch.zeros(3, *src.shape[1:], dtype=torch.uint8))


@pytest.mark.parametrize("name,measured", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False)])
def test_w8a16_tiles_default_to_the_devices_measured_table(monkeypatch, name, measured):
    """Unset (None), W8A16_TILES is the device's tuned table (a data file): an H200's holds Llama-3-8B's four
    projections at one row and at 2-16; other GPUs (an H100 too) keep the kernel's own tiles; the CPU has none."""
    monkeypatch.setattr(quant, "W8A16_TILES", None)
    monkeypatch.setattr(quant, "cuda_device_name", lambda device: name)
    table = quant.measured_w8a16_tiles(torch.device("cuda", 0))
    assert quant.measured_w8a16_tiles(torch.device("cpu")) == {}
    if not measured:
        assert table == {}
    else:
        assert {(n, k) for _, n, k in table} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
        assert {kind for kind, _, _ in table} == {"gemv", "dot"}
        assert table[("dot", 4096, 14336)] == dict(
            DOT=True, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=3, SPLIT_K=8
        )
    swept = {("gemv", 96, 64): dict(DOT=False, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1, SPLIT_K=1)}
    monkeypatch.setattr(quant, "W8A16_TILES", swept)  # a sweep's table (bench --fp8-tiles) replaces the measured one
    assert quant.measured_w8a16_tiles(torch.device("cuda", 0)) is swept
