"""The offline API, shaped like vLLM's so one benchmark script drives both.

from splitserve.engine import LLM, SamplingParams
llm = LLM(model="path/to/hf_dir", dtype="float32", device="cpu")
outs = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24))
outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.common.config import EngineConfig
from splitserve.common.model_source import resolve_model_config
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer, load_tokenizer
from splitserve.engine.engine_core import EngineCore


@dataclass
class GenerationOutput:
    """One prompt's result. `outputs` is `[self]`, for scripts written against vLLM."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (as vLLM)
    prompt_logprobs: list | None = None
    error: str | None = None  # why the engine ended it, with finish_reason "error" (e.g. a grammar's dead end)

    @property
    def outputs(self) -> list[GenerationOutput]:
        return [self]


class LLM:
    """Runs an EngineCore in this process until every prompt is done."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, **engine_args) -> None:
        # the caller's own specs, never a hostile client's, and nobody aborts: compiled on a thread of this process
        # unless asked otherwise (worker processes would each load torch first)
        engine_args.setdefault("structured_output_compile_workers", 0)
        self.config = resolve_model_config(EngineConfig(model=str(model or ""), **engine_args), name_by_hub_id=True)
        self.engine = EngineCore(self.config, offline=True)
        self.tokenizer = self._load_tokenizer(tokenizer or self.config.resolved_model())
        self._counter = 0

    def close(self) -> None:
        """Free the engine (weights, KV pool, graphs: its device memory), so another LLM fits in this process;
        `del llm` and leaving a `with LLM(...)` block do the same. The LLM cannot generate afterwards."""
        engine = self.__dict__.get("engine")  # absent when __init__ failed
        if engine is None:
            return
        self.engine = None
        froze = engine.froze_collector
        engine.close()
        del engine
        if froze:  # its own reference cycles were frozen: collect them now (elsewhere the collector's turn comes)
            gc.collect()
            EngineCore.refreeze()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    @staticmethod
    def _load_tokenizer(path: str) -> Tokenizer | None:
        """The directory's tokenizer; None when it has no tokenizer files (prompts must then be ids).
        A directory with tokenizer_config.json but no tokenizer.json is refused by load_tokenizer."""
        directory = Path(path)
        if (
            not directory.is_dir()
            or not (directory / "tokenizer.json").exists()
            and not (directory / "tokenizer_config.json").exists()
        ):
            return None
        return load_tokenizer(directory)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("generate needs prompts or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer; pass prompt_token_ids")
            # special tokens included (BOS where the tokenizer adds one), as transformers and vLLM do
            prompt_token_ids = [self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        n = len(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
        if len(params_list) != n:
            raise ValueError(f"got {len(params_list)} sampling_params for {n} prompts")
        return self._run([list(p) for p in prompt_token_ids], params_list, prompts)

    def _run(
        self, token_lists: list[list[int]], params_list: list[SamplingParams], prompts: Sequence[str] | None
    ) -> list[GenerationOutput]:
        from splitserve.common.detokenizer import IncrementalDetokenizer

        if self.engine is None:
            raise RuntimeError("this LLM is closed: make a new one")
        results: dict[str, GenerationOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for i, (ids, params) in enumerate(zip(token_lists, params_list)):
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, ids, params)
            results[request_id] = GenerationOutput(
                request_id, prompts[i] if prompts else None, ids, logprobs=[] if params.logprobs is not None else None
            )
            if self.tokenizer is not None:
                detoks[request_id] = IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    prompt_token_ids=ids,
                )
            order.append(request_id)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                result = results[out.request_id]
                result.token_ids.extend(out.new_token_ids)
                if result.logprobs is not None:
                    result.logprobs.extend(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = [None, *out.prompt_logprobs]
                result.num_cached_tokens = out.num_cached_tokens
                detok = detoks.get(out.request_id)
                if detok is not None:
                    delta = detok.push(out.new_token_ids)
                    result.text += delta.text
                    if delta.stop_str is not None and not out.finished:
                        self.engine.abort(out.request_id)
                        result.finish_reason, result.stop_reason = "stop", delta.stop_str
                        continue
                    if out.finished:
                        result.text += detok.flush()
                if out.finished and result.finish_reason is None:
                    result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
                    result.error = out.error
        return [results[r] for r in order]
