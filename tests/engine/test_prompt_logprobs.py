"""Prompt logprobs (vLLM's prompt_logprobs) and completions' echo, against transformers in float64.

Engine: chunked prefill accumulates them across chunks; a prompt the prefix cache holds is computed
again for a request that asks for them. Services (slow): REST and gRPC, disaggregated (the prefill
computes them and answers them with the first token) and colocated (the worker's core), including
what lm-evaluation-harness sends for loglikelihood (echo, logprobs 1, max_tokens 0 or 1).
"""

import grpc
import httpx
import pytest
import torch

from splitserve.common.default_model_path import default_model_path
from splitserve.common.logprobs import TokenLogprobs
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.scheduling.request import Request
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.model_factory import hf_logits, load_hf_reference, make_tiny_model_dir
from tests.service_harness import Proc, free_port, gateway_args, start_service, wait_until

PROMPTS = [[1, 17, 250, 3, 99, 42, 7, 8, 300, 12, 5], [1, 400, 401], [1, 9]]
TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("plp"), "llama", num_kv_heads=2)
    return path, load_hf_reference(path, torch.float64)


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' float64 log-softmax at every position: row p predicts token p + 1. (L, V)"""
    return hf_logits(model, prompt).log_softmax(dim=-1)


def check_against(ref: torch.Tensor, prompt: list[int], got: list, top: int, tol: float) -> None:
    """`got` (vLLM's shape: None, then one entry per prompt token) equals the reference: logprob within
    `tol`, exact rank, exact top ids."""
    assert got[0] is None and len(got) == len(prompt)
    for p, entry in enumerate(got[1:]):
        row, token = ref[p], prompt[p + 1]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < tol, (p, entry.logprob, row[token].item())
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(top).indices.tolist()
        assert all(abs(v - row[t].item()) < tol for t, v in entry.top)


@pytest.mark.parametrize("budget", [256, 5], ids=["one-chunk", "chunks-of-5"])
def test_prompt_logprobs_equal_transformers_in_float64(tiny, budget):
    path, model = tiny
    llm = LLM(str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        check_against(reference(model, prompt), prompt, out.prompt_logprobs, TOP, 1e-9)


def test_a_cached_prompt_is_computed_again_for_prompt_logprobs(tiny):
    """The prefix cache holds the prompt after the first request; one asking for prompt logprobs reads none
    of it (every position computed: equal values), one that does not ask reads it."""
    path, model = tiny
    llm = LLM(str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=64)
    prompt = PROMPTS[0]
    asks = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=asks)[0]
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=asks)[0]
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=1))[0]
    assert (first.num_cached_tokens, again.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 8)
    assert [e.logprob for e in again.prompt_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs[1:]]
    check_against(reference(model, prompt), prompt, again.prompt_logprobs, 0, 1e-9)
    assert plain.prompt_logprobs is None


def test_a_recomputed_chunk_replaces_its_entries():
    """Preempted mid-prompt and computed again from position 0: the entries are not duplicated."""
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), seed=0, max_tokens=4)
    entry = [TokenLogprobs(t, -1.0, [], 1) for t in (6, 7, 8, 9)]
    request.store_prompt_logprobs(0, entry[:2])
    request.store_prompt_logprobs(0, entry[:3])  # recompute from 0, a chunk further
    request.store_prompt_logprobs(3, entry[3:])
    assert request.prompt_logprobs == entry and request.needs_prompt_logprobs
    request.append_output(11)
    assert not request.needs_prompt_logprobs


def test_out_of_range_prompt_logprobs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be >= 0 and <= 20, got 21$"):
        SamplingParams(prompt_logprobs=21)


# -- services ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reference():
    return load_hf_reference(default_model_path(), torch.float64)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def gateway(request, tmp_path_factory):
    """(REST base url, gRPC target) of a gateway before a prefill (prompts in chunks of 8) + decode, or
    before one colocated worker (chunks of 8 too); the default model in float64."""
    logs = tmp_path_factory.mktemp(f"plp-{request.param}")
    model = default_model_path()
    procs = []
    if request.param == "disaggregated":
        prefill, prefill_addr = start_service(
            "prefill", model, logs, "prefill", service_args=["--kv-transport", "shm"], max_num_batched_tokens=8
        )
        decode, decode_addr = start_service(
            "decode", model, logs, "decode", service_args=["--kv-transport", "shm", "--prefill-peers", prefill_addr]
        )
        procs += [prefill, decode]
    else:
        worker, decode_addr = start_service("worker", model, logs, "worker", max_num_batched_tokens=8)
        procs.append(worker)
        prefill_addr = ""
    for proc in procs:
        proc.wait_ready()
    grpc_port, http_port = free_port(), free_port()
    gw = Proc("gateway", gateway_args(grpc_port, http_port, prefill_addr, decode_addr), logs, "gateway")
    procs.append(gw)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: _serves(base), 60, lambda: "the gateway never served:\n" + gw.log_path.read_text()[-3000:])
        yield base, f"127.0.0.1:{grpc_port}"
    finally:
        for proc in procs:
            proc.stop()


def _serves(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ids(base: str, text: str) -> list[int]:
    return httpx.post(base + "/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]


LM_EVAL_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)"


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request_gets_the_prompt_logprobs(gateway, default_reference, max_tokens):
    """lm-evaluation-harness's loglikelihood: echo, logprobs 1, temperature 0, max_tokens 1 (or 0 in older
    versions): the prompt's tokens with None then their logprobs (transformers' within float32 rounding),
    a top-1 dict at each, then the generated token (max_tokens 1) or nothing (0)."""
    base, _ = gateway
    body = {"prompt": LM_EVAL_PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    prompt = _ids(base, LM_EVAL_PROMPT)
    ref = reference(default_reference, prompt)
    got = choice["logprobs"]
    assert choice["text"].startswith(LM_EVAL_PROMPT) and len(got["tokens"]) == len(prompt) + max_tokens
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert abs(got["token_logprobs"][p] - ref[p - 1, prompt[p]].item()) < 1e-5
        best = ref[p - 1].argmax().item()
        assert max(got["top_logprobs"][p].values()) == pytest.approx(ref[p - 1, best].item(), abs=1e-5)
    if max_tokens == 0:
        assert choice["text"] == LM_EVAL_PROMPT and choice["finish_reason"] == "length"
    else:  # the greedy token after the prompt: the most likely one
        assert got["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=1e-5)
    assert answer["usage"]["prompt_tokens"] == len(prompt) and answer["usage"]["completion_tokens"] == 1
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)


@pytest.mark.slow
def test_prompt_logprobs_field_rest_and_grpc(gateway, default_reference):
    """vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}}, the prompt token first, then its
    top alternatives (ranks 1..n); gRPC's first message carries the same entries and the prompt's ids."""
    base, target = gateway
    text = "import os\nimport sys\n\ndef main():"
    body = {"prompt": text, "prompt_logprobs": 2, "max_tokens": 3, "temperature": 0}
    choice = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    prompt = _ids(base, text)
    ref = reference(default_reference, prompt)
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt) and choice["logprobs"] is None
    for p in range(1, len(prompt)):
        row, token = ref[p - 1], prompt[p]
        entry = plp[p]
        first = next(iter(entry))
        assert int(first) == token
        assert abs(entry[first]["logprob"] - row[token].item()) < 1e-5
        assert entry[first]["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
    request = generation_pb2.GenerateRequest(
        text=text, echo=True, sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    )
    messages = list(stub.Generate(request, timeout=60))
    first = messages[0]
    assert list(first.prompt_token_ids) == prompt and first.text.startswith(text)
    assert [e.token_id for e in first.prompt_logprobs] == prompt[1:]
    assert [e.rank for e in first.prompt_logprobs] == [plp[p][str(prompt[p])]["rank"] for p in range(1, len(prompt))]
    assert all(not m.prompt_logprobs and not m.prompt_token_ids for m in messages[1:])
    assert "".join(m.text for m in messages) == text + choice["text"]


@pytest.mark.slow
def test_chat_prompt_logprobs_ride_at_the_top_of_the_answer(gateway, default_reference):
    """vLLM's chat answer carries prompt_logprobs at its top level (not in the choice): the rendered prompt's."""
    base, _ = gateway
    messages = [{"role": "user", "content": "Sort a list."}]
    body = {"messages": messages, "prompt_logprobs": 0, "max_tokens": 2, "temperature": 0}
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    prompt = httpx.post(base + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    ref = reference(default_reference, prompt)
    plp = answer["prompt_logprobs"]
    assert "prompt_logprobs" not in answer["choices"][0] and plp[0] is None and len(plp) == len(prompt)
    for p in range(1, len(prompt)):
        [(token, entry)] = plp[p].items()
        assert int(token) == prompt[p] and abs(entry["logprob"] - ref[p - 1, prompt[p]].item()) < 1e-5


@pytest.mark.slow
def test_grpc_echo_with_max_tokens_0_answers_the_prompt_alone(gateway):
    """GenerateRequest.echo with max_tokens 0 (vLLM's echo without generation): one message, the prompt's text
    and ids, no output tokens; usage counts the one token computed, as vLLM's."""
    base, target = gateway
    text = "for i in range(10):"
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
    request = generation_pb2.GenerateRequest(text=text, echo=True, sampling=common_pb2.SamplingParams(max_tokens=0))
    [message] = list(stub.Generate(request, timeout=60))
    assert (message.text, list(message.token_ids), message.finish_reason) == (text, [], common_pb2.FINISH_REASON_LENGTH)
    assert list(message.prompt_token_ids) == _ids(base, text) and not message.prompt_logprobs
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (len(message.prompt_token_ids), 1)


@pytest.mark.slow
def test_echo_streams_the_prompt_first_and_prompt_logprobs_do_not_stream(gateway):
    base, _ = gateway
    body = {"prompt": "def f(x):", "echo": True, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert lines[0].startswith('data: {"id"') and '"text":"def f(x):' in lines[0]
    r = httpx.post(base + "/v1/completions", json={**body, "prompt_logprobs": 1}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
