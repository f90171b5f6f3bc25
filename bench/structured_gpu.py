"""Structured output on a device: does every grammar hold, do the tokens equal the CPU engine's, and what does a
grammar cost a decode step? (issue 18; on CPU the tests cover the same paths.)

    python -m bench.structured_gpu --device cuda [--json out.json]

The embedded default model in float32 on `--device` (asynchronous scheduling as that device's default) and on
CPU: the same greedy requests under a JSON schema, a regex and a choice, mixed in one batch with free-text
requests; then 64 greedy requests of 64 tokens, free text against the same with a regex each (the mask built on
the host and applied on the device every step). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

CODE = "def f(x):\n    return "
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}
REGEX = r"\d{3}-[a-z]{2,5}"


def _requests():
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.common.structured_output import StructuredOutput

    specs = {
        "json": StructuredOutput(json=json.dumps(SCHEMA)),
        "regex": StructuredOutput(regex=REGEX),
        "choice": StructuredOutput(choice=("yes", "no")),
        "free": None,
    }
    prompts, params, kinds = [], [], []
    for i, (kind, spec) in enumerate(list(specs.items()) * 2):  # each twice, interleaved
        prompts.append(CODE if i < 4 else "The answer is ")
        params.append(SamplingParams(temperature=0, max_tokens=32, structured_output=spec))
        kinds.append(kind)
    return prompts, params, kinds


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, list) and 1 <= len(value) <= 4 and all(isinstance(v, int) for v in value)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in ("yes", "no")
    return True


def _timed(llm, params) -> float:
    prompts = [f"{i}: {CODE}" for i in range(64)]
    llm.generate(prompts[:2], params)  # warm: the grammar compiled, kernels built
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.token_ids) for o in outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.common.structured_output import StructuredOutput
    from splitserve.engine import LLM

    prompts, params, kinds = _requests()
    outs = {}
    rows = []
    for device in (args.device, "cpu"):
        llm = LLM(dtype="float32", device=device, num_kv_blocks=2048)
        results = llm.generate(prompts, params)
        outs[device] = [r.token_ids for r in results]
        for kind, r in zip(kinds, results, strict=True):
            rows.append(
                {
                    "device": device,
                    "async": llm.engine.async_scheduling,
                    "kind": kind,
                    "valid": _valid(kind, r.text),
                    "finish": r.finish_reason,
                    "text": r.text,
                }
            )
        if device == args.device:
            free_s, free_n = _timed(llm, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            regex = StructuredOutput(regex=r"[a-z ]{1,400}")
            gram_s, gram_n = _timed(llm, SamplingParams(temperature=0, max_tokens=64, structured_output=regex))
        del llm
    same = [a == b for a, b in zip(outs[args.device], outs["cpu"], strict=True)]
    print(f"\nstructured output, default model, float32: {args.device} against cpu")
    print(f"{'device':<8}{'async':>6}{'kind':>8}{'valid':>7}{'finish':>8}  text")
    for r in rows:
        print(f"{r['device']:<8}{r['async']!s:>6}{r['kind']:>8}{r['valid']!s:>7}{r['finish']:>8}  {r['text'][:40]!r}")
    print(f"tokens equal to cpu: {sum(same)} of {len(same)}; every output valid: {all(r['valid'] for r in rows)}")
    print(
        f"64 x 64 greedy on {args.device}: free text {free_n / free_s:.0f} tok/s ({free_s:.2f} s), with a regex "
        f"{gram_n / gram_s:.0f} tok/s ({gram_s:.2f} s, {gram_n} tokens)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "same_as_cpu": same,
                    "free_tok_s": free_n / free_s,
                    "grammar_tok_s": gram_n / gram_s,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
