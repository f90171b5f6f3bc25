"""The splitserve command: every subcommand has --help; bad flags exit 2 naming the flag."""

import pytest

from engine.cli import SUBCOMMANDS, build_parser, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: splitserve {command}")
    assert SUBCOMMANDS[command][0] in out


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in out


def test_generate_help_shows_engine_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--max-num-batched-tokens" in out and "SPLITSERVE_BLOCK_SIZE" in out


def test_invalid_flag_value_exits_2_with_the_message(capsys):
    assert main(["generate", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "splitserve generate: error: --block-size=0 is out of range; allowed [1, 256]" in err


def test_bench_lists_benchmarks_on_an_unknown_name(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "splitserve bench: unknown benchmark 'nope'; choose one of:" in err
    assert "offline_throughput" in err and "serve" in err


def test_bench_runs_a_benchmark_with_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--help"])
    assert info.value.code == 0
    assert "--request-rate" in capsys.readouterr().out
