"""The engine's frozen configuration (one per process) and the run-time info derived from it."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.config_fields import ConfigError, option, validate_fields

ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float16", "bfloat16", "float32", "float64")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8_e4m3: vLLM's other name for fp8
DEVICES = ("auto", "cpu", "cuda") + tuple(f"cuda:{i}" for i in range(16))


def default_model_dir() -> str:
    """The embedded default model shipped with the package."""
    from splitserve.common.default_model_path import default_model_path

    return str(default_model_path())


@dataclass(frozen=True)
class EngineConfig:
    """What an engine instance serves and how much it may hold at once.

    Frozen: values derived at run time (number of KV blocks, EOS ids, context limit)
    live in `RuntimeInfo`, never written back here.
    """

    model: str = option(
        "",
        "model directory (Hugging Face layout), a Hugging Face id (org/name, through the hub cache: HF_HUB_CACHE "
        "or HF_HOME, HF_HUB_OFFLINE honoured) or, with --load-format dummy, a config.json; "
        "empty = the embedded default model",
    )
    revision: str = option("", "branch, tag or commit of a Hugging Face id; empty = main; ignored for a directory")
    model_id: str = option("", "id the model is served under; empty = the Hugging Face id, else the directory name")
    dtype: str = option("auto", "weights and KV dtype; auto = bfloat16 on CUDA, float32 on CPU", choices=DTYPES)
    device: str = option("auto", "where to run; auto = cuda when available", choices=DEVICES)
    quantization: str | None = option(
        None,
        "fp8: quantize the projections of an unquantized checkpoint to float8 e4m3 at load (per-channel weight "
        "scales, per-token activation scales); unset = as the checkpoint is (an fp8 checkpoint loads as fp8)",
        choices=QUANTIZATIONS,
    )
    fp8_w8a16_max_rows: int = option(
        0,
        "fp8 projections (--quantization fp8 or an fp8 checkpoint) of steps with at most this many rows keep "
        "the activations in --dtype (W8A16: on CUDA capability >= 8.9 the fp8_skinny_linear Triton kernel, "
        "elsewhere its torch reference) instead of quantizing them per token for torch._scaled_mm (W8A8); "
        "0 = off, W8A8 at every size (batch-invariant, as vLLM). 16 takes the Llama-3-8B decode step at batch 1 "
        "from 5.2 ms (W8A8) to 2.8 ms (docs/performance.md); on, a token's output depends on its step's row count",
        min=0,
        max=16,  # kernels.fp8_skinny_linear.MAX_ROWS (tests/engine/test_fp8.py checks they agree)
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache element type; auto = --dtype's; fp8 (or fp8_e4m3, as vLLM also names it) = float8 e4m3 with "
        "per-layer k/v scales (the checkpoint's, else 1.0), half the bytes of bfloat16 to store, read and transfer",
        choices=KV_CACHE_DTYPES,
    )
    load_format: str = option("auto", "auto reads safetensors; dummy makes random weights", choices=("auto", "dummy"))
    block_size: int = option(16, "tokens per KV block", min=1, max=256)
    num_kv_blocks: int | None = option(None, "KV blocks in the pool; unset = sized from memory", min=1, max=10_000_000)
    kv_cache_memory_fraction: float = option(
        0.9,
        "share of the CUDA device's memory this instance may allocate (weights, KV, activations); other "
        "processes on the device are not counted, so instances sharing a GPU split it (up does); "
        "--gpu-memory-utilization is vLLM's name for it",
        min=0.0,
        max=0.98,
        min_exclusive=True,
        aliases=("--gpu-memory-utilization",),
    )
    kv_cache_cpu_bytes: int = option(
        1 << 30,
        "KV pool bytes on CPU when --num-kv-blocks is unset (capped, as on CUDA, at 2 x max-num-seqs x max_model_len)",
        min=1 << 16,
        max=1 << 40,
    )
    max_num_seqs: int | None = option(
        None,
        "most requests in the running batch; unset = 128 for a service on CPU (vLLM's CPU server default: each "
        "token of every running request waits one step, and a CPU step's time grows with its rows), 256 for the "
        "offline LLM on CPU and on CUDA",
        min=1,
        max=4096,
    )
    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one step (chunks long prompts); unset = vLLM's rule: on a CUDA device of 70 GiB or more "
        "(not an A100) 16,384 for the offline LLM and 8,192 for a service, on other CUDA devices 8,192 / 2,048, "
        "on CPU 2,048",
        min=1,
        max=1 << 20,
    )
    max_model_len: int | None = option(None, "context limit in tokens; unset = the model's", min=1, max=1 << 22)
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of shared prompt prefixes")
    scheduling_policy: str = option("fcfs", "order of waiting requests", choices=("fcfs", "priority"))
    role: str = option("both", "prefill (prompt work only), decode (imported KV) or both", choices=ROLES)
    seed: int = option(0, "seed for dummy weights and for requests without a seed", min=0, max=2**63 - 1)
    enforce_eager: bool = option(False, "disable CUDA graphs")
    async_scheduling: bool | None = option(
        None,
        "schedule and prepare step N+1 while step N runs, reading N's tokens a step later (outputs are the "
        "same); unset = on with CUDA, off on CPU (where nothing overlaps)",
    )
    num_threads: int = option(0, "torch CPU threads; 0 = torch's default", min=0, max=1024)
    structured_output_compile_timeout_s: float = option(
        10.0,
        "a structured output spec that takes longer to compile is refused (400 naming this flag); the compile runs "
        "in a worker process that is killed then, or when every request waiting for it was aborted",
        min=0.0,
        max=3600.0,
        min_exclusive=True,
    )
    structured_output_max_spec_bytes: int = option(
        128 << 10,
        "a structured output spec (JSON schema, regex, grammar, or the choices together) larger than this is "
        "refused before it is parsed",
        min=16,
        max=64 << 20,
    )
    structured_output_cache_mb: int = option(
        512,
        "compiled grammars kept by spec (vLLM's VLLM_XGRAMMAR_CACHE_MB), counted by the resident memory each "
        "holds; a spec whose grammar alone holds more is refused",
        min=1,
        max=1 << 20,
    )
    structured_output_compile_workers: int = option(
        2,
        "worker processes that compile specs on trial (each loads torch and xgrammar when first needed, ~350 MB); "
        "0 = compile on a thread of the engine, where --structured-output-compile-timeout-s cannot stop it",
        min=0,
        max=64,
    )
    tensor_parallel_size: int = option(
        1,
        "ranks (one process and device each) the model's layers are split over: heads, MLP rows and vocabulary "
        "sharded, the KV cache by KV head (replicated where KV heads < ranks); on CUDA ranks use --device's GPU "
        "and the ones after it, on CPU they share the cores",
        min=1,
        max=64,
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            # the ranks > 0 get each step's inputs from the host: a token must be read before it is an input
            raise ConfigError("--async-scheduling is not supported with --tensor-parallel-size > 1 yet")
        if self.max_model_len is not None and self.num_kv_blocks is not None:
            if self.num_kv_blocks * self.block_size < 1:
                raise ConfigError("--num-kv-blocks must hold at least one token")

    @property
    def fp8_kv_cache(self) -> bool:
        """--kv-cache-dtype fp8 or fp8_e4m3: the e4m3 cache."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def resolved_model(self) -> str:
        return self.model or default_model_dir()


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts the engine derives at start (never written back into EngineConfig)."""

    model_id: str
    device: str
    dtype: str
    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_num_batched_tokens: int  # the config's, else default_max_num_batched_tokens
    max_num_seqs: int  # the config's, else default_max_num_seqs


def default_max_num_batched_tokens(device_type: str, total_memory: int, device_name: str, offline: bool) -> int:
    """A step's token budget when --max-num-batched-tokens is unset, by vLLM's rule: a large budget where the
    device has the memory and compute for it (fewer, device-bound prefill steps), small on CPU.

    `total_memory` in bytes (CUDA only), `offline` = the offline LLM API (a throughput job, no latency to keep).
    """
    if device_type != "cuda":
        return 2048
    if total_memory >= 70 * 2**30 and "a100" not in device_name.lower():
        return 16384 if offline else 8192
    return 8192 if offline else 2048


def default_max_num_seqs(device_type: str, offline: bool) -> int:
    """The running batch's cap when --max-num-seqs is unset. On CPU, vLLM's CPU defaults: 128 for a service
    (a step's time grows with its rows, and every running request's next token waits for the whole step), 256
    for the offline LLM (a throughput job); 256 on CUDA, where a decode step's time barely grows with its rows.
    docs/performance.md ("Findings that set defaults") has the CPU measurement."""
    if device_type != "cuda":
        return 256 if offline else 128
    return 256
