"""Config: flags, SPLITSERVE_* variables, validation messages."""

import argparse
import dataclasses

import pytest

from splitserve.common.config import EngineConfig, default_max_num_batched_tokens, default_max_num_seqs
from splitserve.common.config_fields import ConfigError, add_arguments, describe, from_namespace


def parse(argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    return from_namespace(EngineConfig, parser.parse_args(argv), env=env or {})


def test_defaults():
    config = parse([])
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (16, None, None)
    assert config.enable_prefix_caching is True and config.num_kv_blocks is None


GIB = 2**30


@pytest.mark.parametrize(
    "device_type, memory, name, offline, budget",
    [
        ("cuda", 141 * GIB, "NVIDIA H200", True, 16384),  # vLLM's LLM class on an H100/H200
        ("cuda", 141 * GIB, "NVIDIA H200", False, 8192),  # vLLM's OpenAI server there
        ("cuda", 80 * GIB, "NVIDIA A100-SXM4-80GB", True, 8192),  # A100s keep the small budget (vLLM PR 17885)
        ("cuda", 80 * GIB, "NVIDIA A100-SXM4-80GB", False, 2048),
        ("cuda", 24 * GIB, "NVIDIA L4", True, 8192),
        ("cuda", 24 * GIB, "NVIDIA L4", False, 2048),
        ("cpu", 0, "", True, 2048),
        ("cpu", 0, "", False, 2048),
    ],
)
def test_an_unset_token_budget_follows_the_device(device_type, memory, name, offline, budget):
    assert default_max_num_batched_tokens(device_type, memory, name, offline) == budget


def test_the_engine_resolves_the_budget_and_keeps_a_given_one():
    from splitserve.engine import LLM

    assert LLM(load_format="dummy", device="cpu", num_kv_blocks=64).engine.info.max_num_batched_tokens == 2048
    engine = LLM(load_format="dummy", device="cpu", num_kv_blocks=64, max_num_batched_tokens=300).engine
    assert (engine.info.max_num_batched_tokens, engine.scheduler.max_num_batched_tokens) == (300, 300)


@pytest.mark.parametrize(
    "device_type, offline, cap",
    [("cpu", False, 128), ("cpu", True, 256), ("cuda", False, 256), ("cuda", True, 256)],  # vLLM's CPU values
)
def test_an_unset_sequence_cap_follows_the_device(device_type, offline, cap):
    assert default_max_num_seqs(device_type, offline) == cap


def test_the_engine_resolves_the_sequence_cap_and_keeps_a_given_one():
    from splitserve.engine import LLM
    from splitserve.engine.engine_core import EngineCore

    assert LLM(load_format="dummy", device="cpu", num_kv_blocks=64).engine.scheduler.max_num_seqs == 256
    service = EngineCore(EngineConfig(load_format="dummy", device="cpu", num_kv_blocks=64))
    assert (service.info.max_num_seqs, service.scheduler.max_num_seqs) == (128, 128)
    service.close()
    given = EngineCore(EngineConfig(load_format="dummy", device="cpu", num_kv_blocks=64, max_num_seqs=300))
    assert (given.info.max_num_seqs, given.scheduler.max_num_seqs) == (300, 300)
    given.close()


def test_flags_override_env_which_overrides_defaults():
    env = {"SPLITSERVE_BLOCK_SIZE": "8", "SPLITSERVE_MAX_NUM_SEQS": "4"}
    config = parse(["--max-num-seqs", "7", "--no-enable-prefix-caching"], env)
    assert config.block_size == 8
    assert config.max_num_seqs == 7
    assert config.enable_prefix_caching is False


def test_config_is_frozen():
    config = parse([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--block-size", "0"], {}, "--block-size=0 is out of range; allowed [1, 256]"),
        (["--max-num-seqs", "5000"], {}, "--max-num-seqs=5000 is out of range; allowed [1, 4096]"),
        (
            ["--kv-cache-memory-fraction", "0"],
            {},
            "--kv-cache-memory-fraction=0.0 is out of range; allowed (0.0, 0.98]",
        ),
        (
            ["--dtype", "int8"],
            {},
            "--dtype='int8' is not allowed; choose one of auto, float16, bfloat16, float32, float64",
        ),
        (["--role", "router"], {}, "--role='router' is not allowed; choose one of both, prefill, decode"),
        (["--block-size", "big"], {}, "--block-size: expected int, got 'big'"),
        (
            [],
            {"SPLITSERVE_ENABLE_PREFIX_CACHING": "maybe"},
            "--enable-prefix-caching: expected true or false, got 'maybe'",
        ),
        ([], {"SPLITSERVE_NUM_KV_BLOCKS": "-3"}, "--num-kv-blocks=-3 is out of range; allowed [1, 10000000]"),
        (
            ["--kv-cache-memory-fraction", "nan"],
            {},
            "--kv-cache-memory-fraction=nan is not a number; allowed (0.0, 0.98]",
        ),
        (
            ["--kv-cache-memory-fraction", "inf"],
            {},
            "--kv-cache-memory-fraction=inf is out of range; allowed (0.0, 0.98]",
        ),
        (["--tensor-parallel-size", "0"], {}, "--tensor-parallel-size=0 is out of range; allowed [1, 64]"),
        (
            ["--tensor-parallel-size", "2", "--async-scheduling"],
            {},
            "--async-scheduling is not supported with --tensor-parallel-size > 1 yet",
        ),
    ],
)
def test_validation_errors_name_flag_value_and_range(argv, env, message):
    with pytest.raises(ConfigError) as info:
        parse(argv, env)
    assert str(info.value) == message


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError, match=r"--max-num-batched-tokens=0 is out of range"):
        EngineConfig(max_num_batched_tokens=0)


def test_describe_lists_every_field():
    text = describe(parse(["--block-size", "4"]))
    assert text.splitlines()[0] == "EngineConfig:"
    assert "  block_size = 4" in text.splitlines()
