"""Core <-> service messages cross a pipe pickled: every field of a step's outputs arrives as sent."""

import multiprocessing
from dataclasses import fields

from splitserve.engine.core_process import messages as m
from splitserve.engine.outputs import RequestOutput


def test_a_step_batch_crosses_a_pipe_with_every_output_field_intact():
    outputs = [
        RequestOutput("a", [5, 6], [{"5": -0.1}], True, "stop", "</s>", 32, None, 1234, [{"7": -2.5}]),
        RequestOutput("b", [], finished=True, finish_reason="error", error="KV pull failed: x"),
        RequestOutput("c", [9]),
    ]
    defaults = RequestOutput("a", [])
    assert all(
        getattr(outputs[0], f.name) != getattr(defaults, f.name)
        for f in fields(RequestOutput)
        if f.name not in ("request_id", "error")
    )  # every field but error set (error: the second one)
    batch = m.StepBatch(outputs, [m.HeldKv("a", [3, 4], [b"h"], 20)], {"num_running": 2}, 777)
    here, there = multiprocessing.Pipe()
    here.send([batch])
    (got,) = there.recv()
    assert got == batch and [type(o) for o in got.outputs] == [RequestOutput] * 3
    assert got.outputs[1].error == "KV pull failed: x" and got.outputs[2].new_logprobs == []
