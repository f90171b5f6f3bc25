"""`splitserve generate`: run prompts through the engine in this process, no servers."""

from __future__ import annotations

import dataclasses
import sys

from splitserve.common.config_fields import option


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """What to generate offline."""

    prompt: str = option("def fibonacci(n):", "prompt text (repeat the command for more prompts)")
    max_tokens: int = option(64, "tokens to generate", min=1, max=1 << 20)
    temperature: float = option(0.0, "sampling temperature; 0 = greedy", min=0.0, max=100.0)
    top_p: float = option(1.0, "nucleus mass", min=0.0, max=1.0, min_exclusive=True)
    request_seed: int | None = option(None, "sampling seed of the request", min=0, max=2**63 - 1)


def run(ns, configs) -> int:
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.engine.llm import LLM

    engine_config = configs["EngineConfig"]
    gen = configs["GenerateConfig"]
    llm = LLM(**{f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)})
    params = SamplingParams(
        temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_tokens, seed=gen.request_seed
    )
    out = llm.generate([gen.prompt], params)[0]
    sys.stdout.write(gen.prompt + out.text + "\n")
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0
