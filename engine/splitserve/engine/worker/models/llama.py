"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One implementation; `ModelConfig` flags select the variants. Projections that read the
same input are fused (q|k|v -> `qkv_proj`, gate|up -> `gate_up_proj`); `checkpoint_targets`
maps each Hugging Face tensor name to the rows of the fused weight it fills.

A step's tokens are flattened (T rows, any mix of prefill chunks and decodes); attention
reads and writes the paged KV cache through `engine.worker.attention` (layout in `engine.worker.kv_cache`).

Tensor parallel (`tp`, a `TpGroup` of N > 1 ranks): each rank builds only its slices (which ones:
`engine.worker.tensor_parallel`), `checkpoint_shards` says which piece of each checkpoint tensor it reads,
and the forward adds the collectives: the embedding and each row-parallel projection (o_proj, down_proj)
sum over ranks, the logits are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.worker import cpu_gemm
from splitserve.engine.worker.attention import AttentionMetadata, attention_forward
from splitserve.engine.worker.fused_ops import gemv_tiles, norm_linear, rope_write_attend, silu_linear
from splitserve.engine.worker.kv_cache import layer_kv
from splitserve.engine.worker.layers import build_cos_sin_cache, rms_norm, rotary_embedding, silu_and_mul
from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models.moe import mlp_for_layer
from splitserve.engine.worker.tensor_parallel import TpGroup, TpShard, kv_heads_of_rank, vocab_rows

# Fused module name -> the checkpoint modules stacked in its rows, in order.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Checkpoint tensors that carry no weights we need (old Llama checkpoints saved these buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """Uninitialised, frozen weight (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). `output_sizes` are the row blocks of a fused weight (one block if not fused)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype, device):
        super().__init__()
        self.output_sizes = tuple(output_sizes)
        out_features = sum(output_sizes)
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

        self.packed: cpu_gemm.PackedWeight | None = None  # CPU float32: see pack_for_cpu
        self.gemv_counters: torch.Tensor | None = None  # split-K counters of the one-row GEMV (fused_ops.gemv_tiles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2:
            return self.packed(x)
        tiles = gemv_tiles(x, self.weight)
        if tiles is not None:
            return self._gemv(x, tiles)
        return F.linear(x, self.weight, self.bias)

    def _gemv(self, x: torch.Tensor, tiles: dict) -> torch.Tensor:
        from splitserve.kernels.fp8_skinny_linear import MIN_BLOCK_N, fp8_skinny_linear

        if self.gemv_counters is None:  # first made by a graph's eager warm-up, never inside the capture
            self.gemv_counters = torch.zeros(
                -(-self.weight.shape[0] // MIN_BLOCK_N), dtype=torch.int32, device=x.device
            )
        return fp8_skinny_linear(x, self.weight, None, self.bias, self.gemv_counters, config=tiles)

    def pack_for_cpu(self) -> None:
        """Keep a copy of the weight packed for the CPU's GEMM library (engine.worker.cpu_gemm; call after loading)."""
        self.packed = cpu_gemm.pack(self.weight, self.bias)


class RMSNorm(nn.Module):
    """Holds the weight of an RMSNorm over the last `size` elements."""

    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


def _rank_of(tp: TpGroup | None) -> tuple[int, int]:
    """(rank, size) of `tp`; (0, 1) without tensor parallelism."""
    return (tp.rank, tp.size) if tp is not None else (0, 1)


class Attention(nn.Module):
    """Self-attention of one layer over the paged KV cache (GQA/MQA when num_kv_heads < num_heads).
    Under tensor parallelism: this rank's q heads and kv heads; o_proj is row-parallel (summed over ranks)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp: TpGroup | None = None):
        super().__init__()
        rank, size = _rank_of(tp)
        self.tp = tp if size > 1 else None
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads // size
        kv_heads = kv_heads_of_rank(config.num_kv_heads, size, rank)
        self.num_kv_heads = len(kv_heads)
        self.q_head_start, self.kv_head_start = rank * self.num_heads, kv_heads.start
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        # KV cache scales (fp8 KV: cached = k / k_scale); 1.0 unless set_kv_scales gives others
        self.k_scale = self.v_scale = 1.0
        q_size = self.num_heads * config.head_dim
        kv_size = self.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, [q_size, kv_size, kv_size], config.attention_bias, dtype, device)
        # a row-parallel bias is added once: rank 0 holds it
        self.o_proj = Linear(q_size, [config.hidden_size], config.o_proj_bias and rank == 0, dtype, device)
        # gpt-oss: each head's learned sink logit, and the window of its sliding layers (engine.worker.attention)
        self.sinks = _param((self.num_heads,), dtype, device) if config.attention_sinks else None
        self.sliding_window = config.sliding_window if layer_idx in config.sliding_layers else None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), cos_sin_cache, kv_cache, meta)

    def attend(self, positions, qkv, cos_sin_cache, kv_cache, meta: AttentionMetadata, fused: bool = False):
        """Everything after the qkv projection: qkv (T, (Hq + 2 Hkv) D) -> (T, H). `fused`: rotary and
        the KV write in one launch (engine.worker.fused_ops)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        k_cache, v_cache = layer_kv(kv_cache, self.layer_idx)
        scales = (self.k_scale, self.v_scale)
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)
        extras = dict(sinks=self.sinks, sliding_window=self.sliding_window)
        if fused:  # the norms (Qwen3), rotary and the KV write in one launch where it applies
            out = rope_write_attend(
                positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta, self.scale, *scales, qk_norm, **extras
            )
            return self._reduced(self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)))  # (T, H)
        if qk_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary_embedding(positions, q, k, cos_sin_cache)
        out = attention_forward(q, k, v, k_cache, v_cache, meta, self.scale, *scales, **extras)  # (T, Hq, D)
        return self._reduced(self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)))  # (T, H)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over ranks (as it is without tensor parallelism)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def checkpoint_shards(self, prefix: str) -> dict[str, TpShard]:
        """The rows (columns for o_proj) of each checkpoint tensor this rank reads."""
        d = self.head_dim
        q = TpShard(0, self.q_head_start * d, self.num_heads * d)
        kv = TpShard(0, self.kv_head_start * d, self.num_kv_heads * d)
        shards = {f"{prefix}.o_proj.weight": TpShard(1, q.start, q.size)}
        if self.sinks is not None:  # one sink logit per q head
            shards[f"{prefix}.sinks"] = TpShard(0, self.q_head_start, self.num_heads)
        for part, shard in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shards[f"{prefix}.{part}.weight"] = shards[f"{prefix}.{part}.bias"] = shard
        return shards


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x). Under tensor parallelism this rank's F/N rows of
    gate and up, and down_proj row-parallel (summed over ranks)."""

    def __init__(self, config: ModelConfig, dtype, device, tp: TpGroup | None = None):
        super().__init__()
        rank, tp_size = _rank_of(tp)
        self.tp = tp if tp_size > 1 else None
        size = config.intermediate_size // tp_size
        self.row_start = rank * size
        self.gate_up_proj = Linear(config.hidden_size, [size, size], config.mlp_bias, dtype, device)
        self.down_proj = Linear(size, [config.hidden_size], config.mlp_bias and rank == 0, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduced(self.down_proj(silu_and_mul(self.gate_up_proj(x))))  # (T, 2F) -> (T, F) -> (T, H)

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """down_proj's output summed over ranks (as it is without tensor parallelism)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def checkpoint_shards(self, prefix: str) -> dict[str, TpShard]:
        rows = TpShard(0, self.row_start, self.down_proj.weight.shape[1])
        shards = {f"{prefix}.down_proj.weight": TpShard(1, rows.start, rows.size)}
        for part in ("gate_proj", "up_proj"):
            shards[f"{prefix}.{part}.weight"] = shards[f"{prefix}.{part}.bias"] = rows
        return shards


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm fuses the add."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype, device, tp: TpGroup | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(config, layer_idx, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        sparse = mlp_for_layer(config, layer_idx, dtype, device, tp)  # a mixture of experts (models/moe.py)
        self.mlp = MLP(config, dtype, device, tp) if sparse is None else sparse

    def forward(self, positions, x, residual, cos_sin_cache, kv_cache, meta, fused: bool = False):
        """x: this layer's input delta (T, H); residual: the stream before it (None at layer 0).
        `fused`: the GPU's fused launches (engine.worker.fused_ops), same math as the unfused ops."""
        if fused:
            return self._forward_fused(positions, x, residual, cos_sin_cache, kv_cache, meta)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, cos_sin_cache, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def _forward_fused(self, positions, x, residual, cos_sin_cache, kv_cache, meta):
        """The layer through engine.worker.fused_ops: rotary and the KV write in one launch, fresh prompts'
        attention on their own k/v; an fp8 projection's input quantized by the norm or SiLU-mul launch before it."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        h = attn.attend(positions, qkv, cos_sin_cache, kv_cache, meta, fused=True)
        if not isinstance(mlp, MLP):  # a mixture of experts launches its own kernels
            h, residual = self.post_attention_layernorm(h, residual)
            return mlp(h), residual
        gate_up, residual = norm_linear(self.post_attention_layernorm, mlp.gate_up_proj, h, residual)
        return mlp.reduced(silu_linear(mlp.down_proj, gate_up)), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype, device, tp: TpGroup | None = None, vocab_held: int = 0):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param((vocab_held or config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class DecoderForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache.

    forward(input_ids (T,), positions (T,), kv_cache, meta) -> hidden (T, H);
    compute_logits(hidden (N, H)) -> (N, V) in float32 (float64 for a float64 model).
    No state lives between calls other than the weights and the rotary cache.
    With `tp` (N > 1 ranks) every rank calls both in the same order: they hold collectives, and every rank
    gets the full hidden states and logits.
    """

    supports_tensor_parallel = True  # the loader passes `tp` only to classes that say so

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: TpGroup | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        rank, size = _rank_of(tp)
        self.tp = tp if size > 1 else None
        self.vocab = vocab_rows(config.vocab_size, size, rank)  # (first row, rows filled, rows held)
        held = self.vocab[2]
        self.model = DecoderModel(config, dtype, device, tp, held)
        self.lm_head = nn.Module()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = _param((held, config.hidden_size), dtype, device)
        if self.tp is not None:  # the last rank's padding rows: never looked up, their logits cut off
            self.model.embed_tokens.weight.data.zero_()
            self.lm_head.weight.data.zero_()
        cache = build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, dtype, device
        )  # (P, D)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._lm_head_packed = None
        # The fused GPU launches of engine.worker.fused_ops (same math); False runs the unfused ops, which
        # benchmarks/kernel_gaps.py captures side by side. Read at trace time: a captured graph keeps its path.
        self.fused_ops = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self._embed(input_ids)  # (T, H)
        residual = None
        fused = self.fused_ops and x.is_cuda
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, self.cos_sin_cache, kv_cache, meta, fused)
        hidden, _ = self.model.norm(x, residual)  # (T, H)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (T, H); under tensor parallelism each rank looks up its rows, the rest sum as 0."""
        if self.tp is None:
            return F.embedding(input_ids, self.model.embed_tokens.weight)
        start, filled, _ = self.vocab
        local = input_ids - start  # (T,)
        outside = (local < 0) | (local >= filled)
        x = F.embedding(local.masked_fill(outside, 0), self.model.embed_tokens.weight)  # (T, H)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._lm_head_packed is not None:
            logits = self._lm_head_packed(hidden)  # (N, V)
        else:
            logits = F.linear(hidden, self.lm_head.weight)  # (N, V) in the model dtype
        if self.tp is not None:  # (N, V/ranks) each -> (N, V): every rank's rows, padding cut off
            logits = self.tp.all_gather_columns(logits)[:, : self.config.vocab_size]
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def pack_for_cpu(self) -> bool:
        """Pack every linear weight for the CPU's GEMM library (float32 on CPU, engine.worker.cpu_gemm); returns
        whether it did."""
        self._lm_head_packed = cpu_gemm.pack(self.lm_head.weight)
        if self._lm_head_packed is None:
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        return True

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the view of our parameter it fills (same shape).

        A fused weight appears once per part, as the rows that part owns; a tied lm_head
        does not appear (it is the embedding).
        """
        targets: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():  # shared (tied) parameters appear once
            module_path, leaf = name.rsplit(".", 1)
            prefix, _, module_name = module_path.rpartition(".")
            parts = FUSED_PARTS.get(module_name)
            if parts is None:
                targets[name] = param.data
                continue
            module = self.get_submodule(module_path)
            # an fp8 projection's scales: one input_scale a part, block-wise tiles (worker/fp8.py part_rows)
            sizes = module.part_rows(leaf) if hasattr(module, "part_rows") else module.output_sizes
            start = 0
            for part, rows in zip(parts, sizes):
                targets[f"{prefix}.{part}.{leaf}"] = param.data.narrow(0, start, rows)
                start += rows
        if self.tp is not None:  # the vocabulary shard's rows that the checkpoint fills (not the padding)
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in targets:
                    targets[name] = targets[name].narrow(0, 0, self.vocab[1])
        return targets

    def checkpoint_shards(self) -> dict[str, TpShard]:
        """Checkpoint tensor name -> the piece of it this rank reads (tensor parallelism; else empty).
        A name absent here is read whole."""
        if self.tp is None:
            return {}
        vocab = TpShard(0, self.vocab[0], self.vocab[1])
        shards = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab}
        for i, layer in enumerate(self.model.layers):
            shards.update(layer.self_attn.checkpoint_shards(f"model.layers.{i}.self_attn"))
            shards.update(layer.mlp.checkpoint_shards(f"model.layers.{i}.mlp"))
        return shards

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Per-layer (k_scale, v_scale) of an fp8 KV cache: keys are cached as k / k_scale."""
        if len(scales) != self.config.num_layers:
            raise ValueError(f"set_kv_scales: {len(scales)} (k, v) scale pairs for {self.config.num_layers} layers")
        for layer, (k_scale, v_scale) in zip(self.model.layers, scales):
            layer.self_attn.k_scale, layer.self_attn.v_scale = float(k_scale), float(v_scale)

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may hold that we do not load (tied lm_head, rotary buffers)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        if self.tp is not None and self.tp.rank > 0 and name.endswith((".o_proj.bias", ".down_proj.bias")):
            return True  # a row-parallel bias: rank 0 adds it
        return name.endswith(_IGNORED_SUFFIXES)
