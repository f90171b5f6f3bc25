"""splitserve's shared runtime: config, scheduler, KV cache, models, sampler, offline API."""

from splitserve.common.sampling_params import SamplingParams


def __getattr__(name):
    # The offline API loads torch and the model code; import it only when asked for.
    if name == "LLM":
        from splitserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
