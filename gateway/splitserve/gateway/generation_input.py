"""What a front end hands the request path: a `GenerationInput`, its `SamplingParams` built and checked from the
request's values (REST JSON or the gRPC message), and the bounds on the work it can ask for, counted before any
tokenizing (gateway/service.py refuses past them).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from splitserve.common import wire
from splitserve.common.sampling_params import MAX_SEQUENCES, SamplingParams
from splitserve.gateway.errors import invalid
from splitserve.protos import common_pb2

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat template fields. continue_final_message leaves the last (assistant) message open
    for the model to continue (no generation prompt then); template_kwargs reach the template as
    variables, as (name, value) pairs."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    tools: tuple[dict, ...] | None = None  # function tools, passed to the template as transformers does
    message_extras: tuple[tuple[tuple[str, Any], ...], ...] = ()  # per turn: tool_calls, tool_call_id, name


@dataclass(frozen=True)
class GenerationInput:
    """One request as both front ends hand it over; exactly one of text/token_ids/chat is set.

    `params` is already validated (stop strings and detokenizer options included);
    `chat` holds (role, content) turns. `max_tokens_param` names the field the client set
    max_tokens with: such a max_tokens must fit in the context with the prompt (else 400).
    None: not set; the default (SamplingParams') applies, cut to what the context holds.
    """

    request_id: str
    model: str
    params: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    priority: int = 0
    max_tokens_param: str | None = None
    add_special_tokens: bool = True  # text prompts: the tokenizer's BOS/EOS, as vLLM's completions API
    chat_options: ChatOptions | None = None  # chat prompts: how the template renders them
    echo: bool = False  # completions' echo: the first message's text starts with the prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the one token computed is dropped)
    # where params.structured_output came from (e.g. "response_format.json_schema.schema", "guided_regex"): a
    # prefill or decode that refuses the spec (xgrammar cannot compile it) is answered 400 naming this field
    structured_field: str = ""
    n: int = 1  # sequences returned (gateway/sequences.py)
    best_of: int | None = None  # sequences generated (None: n); the n best are returned


def check_sequences(n: int, best_of: int | None, stream: bool) -> None:
    """OpenAI's n and vLLM's best_of: 1 <= n <= best_of <= MAX_SEQUENCES; best_of > n is not streamed."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and not 1 <= value <= MAX_SEQUENCES:
            raise invalid(f"{name} must be >= 1 and <= {MAX_SEQUENCES}, got {value}", name)
    if best_of is not None and best_of < n:
        raise invalid(f"best_of must be >= n ({n}), got {best_of}", "best_of")
    if stream and best_of is not None and best_of > n:
        raise invalid(
            f"best_of > n ({best_of} > {n}) cannot be streamed: the best {n} are known only when all {best_of} "
            "have ended; set stream to false or best_of to n",
            "best_of",
        )


def build_sampling_params(values: dict[str, Any], max_stop_strings: int) -> SamplingParams:
    """SamplingParams from request values; INVALID_ARGUMENT naming the field when invalid.

    Float fields travel as float32: a value valid as given but not once rounded (top_p=1e-50
    becomes 0.0) is refused here rather than by the prefill or decode.
    """
    rounded: dict[str, float] = {}
    for name in _FLOAT_FIELDS:
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                as_float = float(value)
            except OverflowError:  # an integer beyond any float
                raise invalid(
                    f"{name} must be a number within its range, got an integer of {len(str(abs(value)))} digits", name
                ) from None
            try:
                rounded[name] = struct.unpack("f", struct.pack("f", as_float))[0]
            except OverflowError:  # beyond float32: outside every allowed range, refused below
                pass
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise invalid(str(exc)) from None
    changed = {k: v for k, v in rounded.items() if v != values[k]}
    if changed:
        try:
            params = SamplingParams.from_dict({**values, **changed})
        except (ValueError, TypeError) as exc:
            raise invalid(f"{exc} (the request's value rounded to float32, as it is sent on)") from None
    if len(params.stop) > max_stop_strings:
        raise invalid(f"stop must have at most {max_stop_strings} strings, got {len(params.stop)}", "stop")
    return params


def sampling_values_from_proto(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields a gRPC caller set, as SamplingParams keyword values."""
    values: dict[str, Any] = {name: getattr(msg, name) for name in wire.OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    values["stop_token_ids"] = list(msg.stop_token_ids)
    values["ignore_eos"] = msg.ignore_eos
    values["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_output"):
        try:
            values["structured_output"] = wire.structured_from_proto(msg.structured_output)
        except ValueError as exc:
            raise invalid(f"sampling.{exc}", "structured_output") from None
    return values


def prompt_tokens_bound(inp: GenerationInput) -> int:
    """At most how many tokens an input's prompt has: its ids, or a text's UTF-8 bytes (a token covers at least
    one byte; counted before tokenizing, so a refusal costs no work)."""
    if inp.token_ids is not None:
        return len(inp.token_ids)
    return len((inp.text or "").encode()) + sum(len(content.encode()) for _, content in inp.chat or ())


def answer_entries(inp: GenerationInput, max_model_len: int) -> int:
    """At most how many token entries (a token, or one of its top alternatives) an input's answer holds: its
    sequences' tokens and, with prompt_logprobs or echo, its prompt's, all capped by the context."""
    params = inp.params
    top = 1 + max(params.logprobs or 0, 0)
    tokens = min(params.max_tokens if params.max_tokens is not None else max_model_len, max_model_len)
    entries = (inp.best_of or inp.n) * tokens * top
    if params.prompt_logprobs is not None or inp.echo:
        prompt = prompt_tokens_bound(inp)
        entries += min(prompt, max_model_len) * (1 + max(params.prompt_logprobs or 0, params.logprobs or 0))
    return entries


def request_tokens(inp: GenerationInput, max_model_len: int) -> int:
    """At most how many tokens an input asks the engines for: each sequence's prompt and output, a sequence
    never past the context (max_tokens unset: up to the context)."""
    max_tokens = inp.params.max_tokens if inp.params.max_tokens is not None else max_model_len
    return (inp.best_of or inp.n) * min(prompt_tokens_bound(inp) + max_tokens, max_model_len)
