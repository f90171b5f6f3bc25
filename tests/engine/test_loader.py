"""The weight loader: sharded checkpoints, fused rows, dtype selection, dummy weights, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.worker import loader
from splitserve.engine.worker.kv_cache import allocate_kv_cache
from splitserve.engine.worker.loader import load_model
from tests.model_factory import hf_logits, load_hf_reference, make_tiny_model_dir

SUPPORTED = (
    "GptOssForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
    "Qwen3ForCausalLM, Qwen3MoeForCausalLM"
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """An untied 2-layer GQA Llama in float64, one safetensors file (copy it before editing)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("models"), "llama", num_kv_heads=2)


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _edit_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load_error(path, **kwargs) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_model(path, dtype=torch.float64, device="cpu", **kwargs)
    return str(err.value)


def test_sharded_checkpoint_fills_fused_rows_exactly(tmp_path):
    path = make_tiny_model_dir(tmp_path, "qwen2", num_kv_heads=1, max_shard_size="100KB")
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2 and shards == {p.name for p in path.glob("*.safetensors")}
    net, config = load_model(path, dtype=torch.float64, device="cpu")
    hf = load_hf_reference(path).state_dict()
    attn, mlp = net.model.layers[1].self_attn, net.model.layers[1].mlp
    prefix = "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight, torch.cat([hf[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([hf[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert attn.o_proj.bias is None
    assert torch.equal(
        mlp.gate_up_proj.weight, torch.cat([hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]])
    )
    assert torch.equal(net.lm_head.weight, hf["lm_head.weight"])
    assert torch.equal(net.model.norm.weight, hf["model.norm.weight"])
    assert config.model_id == path.name


def test_tied_checkpoint_shares_embedding(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama", tie=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    net, _ = load_model(path, dtype=torch.float64, device="cpu")
    assert net.lm_head.weight is net.model.embed_tokens.weight
    hidden = torch.eye(64, dtype=torch.float64)[:3]  # (3, H)
    assert torch.equal(net.compute_logits(hidden), net.model.embed_tokens.weight[:, :3].T)


def test_tied_checkpoint_may_also_hold_lm_head_and_rotary_buffers(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama", tie=True)

    def add_redundant(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_weights(path, add_redundant)
    net, _ = load_model(path, dtype=torch.float64, device="cpu")
    assert torch.equal(
        net.model.embed_tokens.weight, load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    )


def test_dtype_selection(llama_dir):
    hf_q = load_file(llama_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]  # (64, 64)
    for dtype, want in [(torch.bfloat16, torch.bfloat16), ("float32", torch.float32), ("auto", torch.float64)]:
        net, _ = load_model(llama_dir, dtype=dtype, device="cpu")
        weight = net.model.layers[0].self_attn.qkv_proj.weight
        assert weight.dtype == want and net.cos_sin_cache.dtype == want
        assert torch.equal(weight[:64], hf_q.to(want))


def test_model_id_and_eos_from_generation_config(tmp_path, llama_dir):
    path = _copy_dir(llama_dir, tmp_path / "m")
    _, config = load_model(path, dtype=torch.float64, device="cpu", model_id="org/tiny")
    assert (config.model_id, config.eos_token_ids, config.bos_token_id) == ("org/tiny", (2,), 1)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    _, config = load_model(path, dtype=torch.float64, device="cpu")
    assert (config.model_id, config.eos_token_ids) == ("m", (5, 7))


def test_missing_directory_config_and_weights(tmp_path):
    assert _load_error(tmp_path / "nope") == f"model path {tmp_path / 'nope'} does not exist"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _load_error(empty) == f"no config.json in model directory {empty}"
    (empty / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert _load_error(empty) == f"no *.safetensors files in model directory {empty}"
    config_file = empty / "config.json"
    assert _load_error(config_file) == (
        f"model path {config_file} is not a directory (a config file alone needs load_format='dummy')"
    )
    assert _load_error(empty, load_format="pt") == "load_format 'pt' is not supported; choose 'auto' or 'dummy'"


def test_index_naming_a_missing_shard(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama", max_shard_size="100KB")
    shard = sorted(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())[-1]
    (path / shard).unlink()
    assert _load_error(path) == f"model.safetensors.index.json in {path} names shard {shard} which does not exist"


def test_unsupported_architecture(tmp_path, llama_dir):
    path = _copy_dir(llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    assert _load_error(path) == (
        f"architecture 'LlamaForSequenceClassification' is not supported; supported: {SUPPORTED}"
    )


def test_missing_tensors(tmp_path, llama_dir):
    path = _copy_dir(llama_dir, tmp_path / "m")
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert _load_error(path) == f"checkpoint in {path} is missing tensor 'model.layers.1.mlp.up_proj.weight'"
    _edit_weights(path, lambda t: t.pop("lm_head.weight"))  # untied: the head is required
    assert _load_error(path) == f"checkpoint in {path} is missing tensor 'lm_head.weight' (and 1 more)"


def test_unexpected_tensor(tmp_path, llama_dir):
    path = _copy_dir(llama_dir, tmp_path / "m")
    _edit_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)))
    assert _load_error(path) == (
        "unexpected tensor 'model.layers.0.self_attn.q_norm.weight' in "
        "model.safetensors: LlamaForCausalLM has no such weight"
    )


def test_shape_mismatch(tmp_path, llama_dir):
    path = _copy_dir(llama_dir, tmp_path / "m")
    _edit_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.ones(16, 64)))
    assert _load_error(path) == (
        "tensor 'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape (16, 64), expected (32, 64)"
    )


BENCH_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _dummy_logits(net, config) -> torch.Tensor:
    from tests.model_factory import SeqSpec, build_meta, step_positions

    spec = [SeqSpec(0, 5, (0, 1))]
    kv_cache = allocate_kv_cache(config.kv_layout(4, "bfloat16"), 2, "cpu")
    with torch.inference_mode():
        hidden = net(torch.tensor([1, 2, 3, 4, 5]), step_positions(spec), kv_cache, build_meta(spec, 4))
        return net.compute_logits(hidden)  # (5, V)


def test_dummy_load_from_config_json(tmp_path):
    path = tmp_path / "bench-llama.json"
    path.write_text(json.dumps(BENCH_CONFIG))
    net, config = load_model(path, dtype=torch.bfloat16, device="cpu", load_format="dummy", seed=3)
    assert (config.model_id, config.num_layers, config.num_kv_heads, config.vocab_size) == ("bench-llama", 2, 2, 1000)
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in net.named_parameters() if n.endswith("norm.weight"))
    embed = net.model.embed_tokens.weight.float()
    assert abs(embed.std().item() - 0.02) < 0.001 and abs(embed.mean().item()) < 0.001
    again, _ = load_model(path, dtype=torch.bfloat16, device="cpu", load_format="dummy", seed=3)
    other, _ = load_model(path, dtype=torch.bfloat16, device="cpu", load_format="dummy", seed=4)
    logits = _dummy_logits(net, config)
    assert logits.dtype == torch.float32 and logits.shape == (5, 1000) and bool(logits.isfinite().all())
    assert torch.equal(logits, _dummy_logits(again, config))
    assert not torch.equal(net.lm_head.weight, other.lm_head.weight)


def test_dummy_load_from_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**BENCH_CONFIG, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64})
    )
    net, config = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy")
    assert config.qk_norm and net.model.layers[0].self_attn.qkv_proj.weight.shape == (4 * 64 + 2 * 2 * 64, 128)


def test_progress_bar(monkeypatch, capsys, llama_dir):
    load_model(llama_dir, dtype=torch.float64, device="cpu")
    assert "loading weights" not in capsys.readouterr().err  # small load, stderr not a TTY
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_model(llama_dir, dtype=torch.float64, device="cpu")
    err = capsys.readouterr().err
    size_gb = (llama_dir / "model.safetensors").stat().st_size / 1e9
    assert err.startswith("\rloading weights: ")
    last = err.rsplit("\r", 1)[-1]  # the bar redraws in place; the final state ends the line
    assert last.startswith(f"loading weights: 100% |{'#' * 30}| {size_gb:.2f}/{size_gb:.2f} GB ")
    assert last.endswith(" s\n")


def test_loaded_model_matches_transformers(llama_dir):
    """One whole-prompt forward through the loaded model equals the transformers reference."""
    from tests.model_factory import SeqSpec, build_meta, step_positions

    net, config = load_model(llama_dir, dtype=torch.float64, device="cpu")
    tokens = [5, 400, 23, 99, 502, 0, 17]
    spec = [SeqSpec(0, len(tokens), (3, 0))]
    kv_cache = allocate_kv_cache(config.kv_layout(4, "float64"), 4, "cpu")
    with torch.inference_mode():
        logits = net.compute_logits(net(torch.tensor(tokens), step_positions(spec), kv_cache, build_meta(spec, 4)))
    torch.testing.assert_close(logits, hf_logits(load_hf_reference(llama_dir), tokens), atol=1e-10, rtol=0)
