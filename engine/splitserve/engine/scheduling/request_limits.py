"""A request's limits on one engine, checked before it is built: ids within the vocabulary, prompt and output
within max_model_len and within the KV pool. Each refusal names the value and the limit (RequestError)."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.config import RuntimeInfo
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestError
from splitserve.engine.scheduling.kv_cache_manager import cdiv


def checked_max_tokens(
    prompt_token_ids: Sequence[int], params: SamplingParams, info: RuntimeInfo, block_size: int, num_blocks: int
) -> int:
    """The request's max_tokens (unset: what the context leaves after the prompt) once its prompt and params fit
    this engine (`info`; a pool of `num_blocks` blocks of `block_size` tokens); else RequestError."""
    num_prompt = len(prompt_token_ids)
    max_len = info.max_model_len
    if num_prompt == 0:
        raise RequestError("prompt must contain at least one token")
    vocab = info.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is out of range [0, {vocab})")
    if params.logit_bias and params.logit_bias[-1][0] >= vocab:
        raise RequestError(f"logit_bias token id {params.logit_bias[-1][0]} is out of range [0, {vocab})")
    if num_prompt >= max_len:
        raise RequestError(f"prompt has {num_prompt} tokens; max_model_len is {max_len}, leaving no room to generate")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len - num_prompt
    if num_prompt + max_tokens > max_len:
        raise RequestError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
            f"exceeds max_model_len {max_len}"
        )
    need = cdiv(num_prompt + max_tokens, block_size)
    if need > num_blocks:
        raise RequestError(f"prompt + max_tokens needs {need} KV blocks; the pool has {num_blocks} in all")
    return max_tokens
