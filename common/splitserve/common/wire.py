"""Conversions between engine types and the v1 protos (shared by every service)."""

from __future__ import annotations

from splitserve.common.kv_layout import KvLayout
from splitserve.common.logprobs import TokenLogprobs
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.protos import common_pb2

OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
)

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_from_proto(pb: common_pb2.SamplingParams, **extra) -> SamplingParams:
    """SamplingParams from the proto; unset optional fields keep the engine defaults.

    Raises ValueError naming the field when a value is out of range.
    """
    values = {name: getattr(pb, name) for name in OPTIONAL_SAMPLING_FIELDS if pb.HasField(name)}
    if "temperature" in values:
        values["temperature"] = float(values["temperature"])
    values["stop_token_ids"] = tuple(pb.stop_token_ids)
    values["ignore_eos"] = pb.ignore_eos
    values["logit_bias"] = dict(pb.logit_bias)
    if pb.HasField("structured_output"):
        values["structured_output"] = structured_from_proto(pb.structured_output)
    values.update(extra)
    return SamplingParams(**values)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, logit_bias=dict(params.logit_bias)
    )
    for name in OPTIONAL_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(pb, name, value)
    if params.structured_output is not None:
        pb.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return pb


# StructuredOutput field -> the proto's oneof member
_STRUCTURED_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "grammar"}


def structured_from_proto(pb: common_pb2.StructuredOutput) -> StructuredOutput:
    """StructuredOutput from the proto; ValueError naming the field when no kind is set or a value is invalid."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output must set one of json_schema, json_object, regex, choice, grammar")
    value = tuple(pb.choice.values) if kind == "choice" else getattr(pb, kind)
    field = next((name for name, member in _STRUCTURED_KINDS.items() if member == kind), kind)
    try:
        return StructuredOutput(**{field: value}, disable_any_whitespace=pb.disable_any_whitespace)
    except ValueError as exc:
        raise ValueError(f"structured_output.{kind} is invalid: {exc}") from None


def structured_to_proto(spec: StructuredOutput) -> common_pb2.StructuredOutput:
    pb = common_pb2.StructuredOutput(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.choice is not None:
        pb.choice.values.extend(spec.choice)
    else:
        setattr(pb, _STRUCTURED_KINDS[spec.kind], getattr(spec, spec.kind))
    return pb


def logprobs_to_proto(lp: TokenLogprobs | None) -> common_pb2.TokenLogprobs | None:
    if lp is None:
        return None
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        rank=lp.rank or 0,
    )


def logprobs_from_proto(pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
    top = [(t.token_id, t.logprob) for t in pb.top]
    return TokenLogprobs(token_id=pb.token_id, logprob=pb.logprob, top=top, rank=pb.rank or None)


def layout_to_proto(layout: KvLayout) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        model_id=layout.model_id,
        layout=layout.layout,
        k_scales=layout.k_scales,
        v_scales=layout.v_scales,
        tensor_parallel_size=layout.tensor_parallel_size,
        rank_kv_heads=[common_pb2.RankKvHeads(heads=heads) for heads in layout.rank_kv_heads],
    )


def layout_from_proto(pb: common_pb2.KvLayout) -> KvLayout:
    return KvLayout(
        num_layers=pb.num_layers,
        num_kv_heads=pb.num_kv_heads,
        head_dim=pb.head_dim,
        block_size=pb.block_size,
        dtype=pb.dtype,
        model_id=pb.model_id,
        layout=pb.layout,
        k_scales=tuple(pb.k_scales),
        v_scales=tuple(pb.v_scales),
        tensor_parallel_size=pb.tensor_parallel_size or 1,
        rank_kv_heads=tuple(tuple(rank.heads) for rank in pb.rank_kv_heads),
    )
