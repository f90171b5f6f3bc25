"""Grammar compiles under budgets: a spec past its time budget is refused and its worker killed, an aborted
request's compile is killed, requests that need no compile are never held behind one, and the cache of compiled
grammars is bounded by the memory it really holds. The default model (its tokenizer), float64 on the CPU."""

from __future__ import annotations

import json

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.engine.core_process import messages as m
from splitserve.engine.grammar import check_spec
from splitserve.engine.grammar_backend import GrammarBackend, GrammarLimits, spec_key
from splitserve.engine.grammar_workers import rss_bytes, trim_heap
from tests.engine.test_core_loop import Driver, FakeConnector, Gate
from tests.service_harness import wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def slow_schema(num_properties: int) -> str:
    """An object of many required properties, some with patterns: compiling it takes about 2 ms a property."""
    props = {
        f"p{k}": {"type": ("string", "integer", "boolean")[k % 3]}
        | ({"pattern": f"[a-z]{{2,{k % 9 + 3}}}"} if k % 3 == 0 else {})
        for k in range(num_properties)
    }
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def enum_schema(tag: int) -> str:
    """12,000 distinct strings: a grammar holding 27 to 35 MiB resident, by machine (20 to 26 MiB at 9,000)."""
    return json.dumps({"enum": [f"{tag}-{k}-" + "abcdefghij"[k % 10] * (k % 7) for k in range(12_000)]})


@pytest.fixture
def core():
    """A CoreLoop on a thread around a colocated engine of the default model whose compiles run in one worker
    process with a 6 s budget."""
    from splitserve.common.config import EngineConfig
    from splitserve.engine.engine_core import EngineCore

    config = EngineConfig(
        dtype="float64",
        device="cpu",
        block_size=4,
        num_kv_blocks=128,
        num_threads=1,
        structured_output_compile_workers=1,
        structured_output_compile_timeout_s=6.0,
        structured_output_max_spec_bytes=4 << 20,
    )
    engine = EngineCore(config)
    steps = []
    step = engine.step
    engine.step = lambda: steps.append(1) or step()  # counts the steps the loop runs
    driver = Driver(engine, FakeConnector(Gate(opened=True))).start()
    driver.steps = steps
    yield driver, engine
    if driver.thread.is_alive():
        driver.stop()
    engine.close()
    driver.loop.connector.close()


def compiling_pid(engine, timeout_s: float = 120) -> int:
    """The worker compiling a spec now (waiting through its start-up: it imports torch and xgrammar)."""
    (pid,) = wait_until(lambda: engine.grammars.compiling_pids, timeout_s, "no worker began compiling the spec")
    return pid


def served_while_compiling(driver, engine, rid: str, pid: int) -> None:
    """`rid` (no spec) is served in exactly max_tokens steps, each taken while `pid` still compiles."""
    before = len(driver.steps)
    driver.send(m.AddRequest(rid, [5, 6, 7, 8], GREEDY))
    driver.until(lambda: rid in driver.finished, 30, f"{rid} was not served during the compile")
    out = driver.finished[rid]
    assert (out.finish_reason, len(driver.tokens[rid]), len(driver.steps) - before) == ("length", 4, 4)
    assert engine.grammars.compiling_pids == [pid]  # the compile was still running all along


@pytest.mark.slow
def test_a_compile_past_its_budget_or_aborted_is_killed_while_others_are_served(core):
    driver, engine = core
    prompt = [5, 6, 7, 8]
    slow = SamplingParams(temperature=0, max_tokens=4, structured_output=StructuredOutput(json=slow_schema(20_000)))
    driver.send(m.AddRequest("slow", prompt, slow))
    first = compiling_pid(engine)
    worker = engine.grammars.slots[0].worker
    served_while_compiling(driver, engine, "free", first)
    driver.until(lambda: "slow" in driver.finished, 30, "the compile was not stopped at its budget")
    assert (driver.finished["slow"].finish_reason, driver.finished["slow"].error) == (
        "error",
        "structured output: JSON schema did not compile within 6 s (--structured-output-compile-timeout-s)",
    )
    assert worker.process.returncode == -9  # killed, and reaped
    # the same spec again is refused at once from what the engine remembers: no second compile
    driver.send(m.AddRequest("again", prompt, slow))
    driver.until(lambda: "again" in driver.finished, 5, "the refused spec was not refused again")
    assert driver.finished["again"].error == driver.finished["slow"].error and engine.grammars.compiling_pids == []
    # another slow spec runs in a new worker; its request aborted, that worker is killed at once
    other = SamplingParams(temperature=0, max_tokens=4, structured_output=StructuredOutput(json=slow_schema(20_001)))
    driver.send(m.AddRequest("gone", prompt, other))
    second = compiling_pid(engine)
    worker = engine.grammars.slots[0].worker
    assert second != first
    served_while_compiling(driver, engine, "free2", second)
    driver.send(m.Abort(["gone"]))
    driver.until(lambda: "gone" in driver.finished, 5, "no abort output for the compiling request")
    assert driver.finished["gone"].finish_reason == "abort"
    wait_until(lambda: worker.process.poll() == -9, 5, "the aborted request's compile worker still runs")
    wait_until(lambda: engine.grammars.slots[0].worker is None, 5, "the killed worker was not dropped")
    assert engine.grammars.compiling_pids == [] and len(engine.grammars.cache) == 0
    assert driver.stats()["num_free_blocks"] == 128


def test_the_cache_holds_no_more_resident_memory_than_its_limit():
    """Six distinct grammars of 27 to 35 MiB resident each (the measure differs between machines, so the limit
    leaves room for one and never two) through a 48 MiB cache: it keeps the newest, and the process's resident
    memory grows by at most 2.5 times the limit (what it keeps and the heap the last compile left behind: 68-77
    MiB on this machine), where keeping all six would take 162 MiB or more. Three ~20 MiB grammars through
    xgrammar's own cache at 40 MiB grew the process by 177 MiB while it counted 42 MiB: it counts less than its
    grammars hold, and the compiles' freed pages stay with the process."""
    from splitserve.common.default_model_path import default_model_path

    limit = 48 << 20
    limits = GrammarLimits(cache_bytes=limit, num_workers=0, max_spec_bytes=1 << 20)
    backend = GrammarBackend(str(default_model_path()), 8192, (0,), limits)
    specs = [StructuredOutput(json=enum_schema(tag)) for tag in range(6)]
    backend.matcher(StructuredOutput(regex="a+"))  # the tokenizer and the compiler, loaded once
    trim_heap()
    start = rss_bytes()
    for spec in specs:
        backend.matcher(spec)
    growth = rss_bytes() - start
    assert backend.cache.total_bytes <= limit and len(backend.cache) == 1
    assert growth <= 5 * limit // 2, f"resident memory grew {growth >> 20} MiB for a {limit >> 20} MiB cache"
    kept = backend.cache.get(spec_key(specs[5]))  # the newest is the one kept
    assert kept is not None and backend.cache.get(spec_key(specs[0])) is None
    backend.close()


def test_a_spec_over_the_size_budget_is_refused_naming_the_flag_before_it_is_parsed():
    spec = StructuredOutput(regex="(" * 200)  # not even valid: the size is checked first
    message = (
        "structured output: regex is 200 bytes; this engine compiles at most 100 (--structured-output-max-spec-bytes)"
    )
    with pytest.raises(ValueError) as err:
        check_spec(spec, 100)
    assert str(err.value) == message
    backend = GrammarBackend("/nonexistent", 64, (0,), GrammarLimits(max_spec_bytes=100))
    future = backend.prepare(spec)
    assert future.done() and str(future.exception()) == message and backend.slots == []  # nothing started
    choices = StructuredOutput(choice=("ab", "cd" * 50))
    with pytest.raises(ValueError) as err:
        check_spec(choices, 101)
    assert str(err.value) == message.replace("regex is 200", "choice is 102").replace("100", "101")


def test_a_spec_its_prefill_compiled_is_compiled_without_a_trial():
    """A decode's import: the prefill compiled the spec within its budget, so no worker runs a trial of it."""
    from splitserve.common.default_model_path import default_model_path

    backend = GrammarBackend(str(default_model_path()), 8192, (0,), GrammarLimits(num_workers=1))
    compiled = backend.prepare(StructuredOutput(regex=r"\d{3}"), vetted=True).result(timeout=60)
    workers = [slot.worker for slot in backend.slots]  # (started with the first spec, for the specs to come)
    assert compiled.tokenizer_info.vocab_size == 8192 and [w.num_trials if w else 0 for w in workers] == [0]
    assert backend.prepare(StructuredOutput(regex=r"\d{3}")).result() is compiled  # cached by spec
    backend.close()
