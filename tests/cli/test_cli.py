"""The splitserve command: every subcommand has --help; bad flags exit 2 naming the flag."""

import dataclasses
import subprocess
import sys

import pytest

from splitserve.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: splitserve {command}")
    assert SUBCOMMANDS[command][0] in out


def test_top_level_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in out


def test_unknown_subcommand_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sreve"])
    assert info.value.code == 2
    assert "invalid choice: 'sreve'" in capsys.readouterr().err


def test_generate_help_shows_engine_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--max-num-batched-tokens" in out and "SPLITSERVE_BLOCK_SIZE" in out


@pytest.mark.parametrize("command", ["prefill", "decode", "worker", "up", "generate"])
def test_role_is_no_flag(command, capsys):
    """The subcommand decides the role; `--role` is refused rather than printed and overwritten."""
    with pytest.raises(SystemExit) as info:
        main([command, "--role", "decode"])
    assert info.value.code == 2
    assert "unrecognized arguments: --role decode" in capsys.readouterr().err


def test_invalid_flag_value_exits_2_with_the_message(capsys):
    assert main(["generate", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "splitserve generate: error: --block-size=0 is out of range; allowed [1, 256]" in err


def test_bench_names_the_serving_benchmark_on_an_unknown_name(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert err == "splitserve bench: unknown benchmark 'nope'; choose one of: serve\n"


def test_bench_points_repository_benchmarks_to_the_checkout(capsys):
    assert main(["bench", "kernel_timings"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "splitserve bench: unknown benchmark 'kernel_timings'; choose one of: serve; "
        "kernel_timings runs from a checkout: python benchmarks/kernel_timings.py\n"
    )


def test_bench_runs_a_benchmark_with_its_own_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--help"])
    assert info.value.code == 0
    assert "--request-rate" in capsys.readouterr().out


@pytest.mark.slow
def test_help_imports_nothing_of_the_stack():
    """`splitserve --help` loads no subcommand's modules (nor torch)."""
    code = (
        "import sys\nfrom splitserve.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'splitserve.engine', 'splitserve.gateway'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_subcommand_builds_its_parser_without_conflicting_flags(command):
    """Two config classes of one subcommand must not define the same flag (up's once did)."""
    from splitserve.cli import build_parser

    build_parser(command, SUBCOMMANDS[command][1]())


def test_start_up_prints_what_differs_from_the_defaults_and_every_field_at_debug(monkeypatch, capsys):
    import splitserve.cli as cli
    from splitserve.gateway.config import GatewayConfig

    monkeypatch.setitem(cli.SUBCOMMANDS, "gateway", ("gateway", lambda: cli.Loaded((GatewayConfig,), lambda ns, c: 0)))
    monkeypatch.setenv("SPLITSERVE_INTERNAL_TOKEN", "t0ken")
    assert main(["gateway", "--grpc-port", "6000", "--served-model-name", "m"]) == 0
    assert capsys.readouterr().err == ("GatewayConfig: grpc_port=6000, served_model_name='m', internal_token='<set>'\n")
    monkeypatch.setenv("SPLITSERVE_LOG_LEVEL", "debug")
    assert main(["gateway"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "GatewayConfig:" and len(err) == 1 + len(dataclasses.fields(GatewayConfig))
