import json

import pytest
from typer.testing import CliRunner

from dostune.cli.app import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("dostune ")


@pytest.mark.parametrize("cmd", [[], ["profile"]])
def test_help_for_every_command(cmd):
    r = runner.invoke(app, cmd + ["--help"])
    assert r.exit_code == 0
    assert "Usage" in r.stdout


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    for name in ("profile",):
        assert name in r.stdout


def test_profile_quick_writes_json(tmp_path):
    out = tmp_path / "node.json"
    r = runner.invoke(app, ["profile", "--quick", "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "dostune.node-profile"
    assert json.loads(out.read_text()) == data


def test_profile_refuses_to_overwrite(tmp_path):
    out = tmp_path / "node.json"
    out.write_text("precious")
    r = runner.invoke(app, ["profile", "--quick", "--output", str(out)])
    assert r.exit_code == 2
    assert "already exists" in r.output
    assert out.read_text() == "precious"


def test_profile_bad_option_is_a_clear_error():
    r = runner.invoke(app, ["profile", "--quick", "--copy-sizes-mib", "4,lots"])
    assert r.exit_code == 2
    assert "--copy-sizes-mib" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["profile", "--dtype", "fp8", "--quick"])
    assert r.exit_code == 2 and "bf16 or fp16" in r.output


def test_profile_schema():
    r = runner.invoke(app, ["profile", "--schema"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["title"] == "NodeProfile"


@pytest.mark.parametrize("cmd", ["profile", "tune", "plan", "refit", "train", "bench", "check", "ops", "ops build"])
def test_flags_show_no_value_placeholder(cmd):
    r = runner.invoke(app, [*cmd.split(), "--help"])
    assert r.exit_code == 0 and "<bool>" not in r.stdout
    r = runner.invoke(app, ["--help"])
    assert "<bool>" not in r.stdout


@pytest.mark.parametrize("cmd", [[], ["profile"], ["tune"], ["plan"], ["refit"], ["train"], ["bench"], ["check"],
                                 ["ops"], ["ops", "build"]])
def test_help_is_not_cut_without_a_terminal(cmd, monkeypatch):
    """Help piped to a file or a log (stdout not a terminal, no COLUMNS) is not cut at 80 columns with '…'."""
    from typer import rich_utils

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", None)  # TERMINAL_WIDTH, read when typer is imported
    r = runner.invoke(app, cmd + ["--help"])
    assert r.exit_code == 0 and "Usage" in r.stdout
    assert "…" not in r.stdout, r.stdout
    assert rich_utils.MAX_WIDTH is None  # put back for whatever prints next


def test_help_width_keeps_a_terminals(monkeypatch):
    from dostune.cli.common import HELP_WIDTH, help_width

    class Stream:
        def __init__(self, tty):
            self.isatty = lambda: tty

    monkeypatch.delenv("COLUMNS", raising=False)
    assert help_width(Stream(True)) is None and help_width(Stream(False)) == HELP_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert help_width(Stream(False)) is None


def test_quiet_stdout_drops_deepspeeds_build_note(capsys):
    """DeepSpeed's "... built successfully" on every CPU run is dropped; anything else printed goes to stderr."""
    import sys

    from dostune.cli.common import quiet_stdout

    with quiet_stdout():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("Error building extension 'deepspeed_shm_comm'")
        print("DeepSpeed deepspeed.ops.comm.deepspeed_ccl_comm_op built successfully", flush=True)
        sys.stdout.write("no newline")
    out, err = capsys.readouterr()
    assert out == "" and "built successfully" not in err
    assert err == "Error building extension 'deepspeed_shm_comm'\nno newline"


def test_one_rule_for_percentages():
    from dostune.cli.common import parse_fraction
    from dostune.errors import DostuneError

    for text in ("10%", "0.1", " 10% ", 0.1):
        assert parse_fraction(text, "--x") == pytest.approx(0.1)
    assert parse_fraction("150%", "--x") == pytest.approx(1.5) and parse_fraction("1", "--x") == 1.0
    for bad in ("10", "-1%", "lots", "nan"):
        with pytest.raises(DostuneError, match="--x"):
            parse_fraction(bad, "--x")


def test_tables_are_not_cut_in_a_log(monkeypatch, tmp_path):
    """Without a terminal (a log, CI) the console is wide enough for the tuning tables."""
    from dostune.cli.common import LOG_WIDTH, _console
    from dostune.cli.tune import render_summary, render_trials
    from dostune.tune.search import TuneOptions, run_tune

    monkeypatch.delenv("COLUMNS", raising=False)
    console = _console(stderr=True)
    assert console.width == LOG_WIDTH
    res, _, _ = run_tune(TuneOptions(trials=3, output_dir=tmp_path, profile=None if not _cuda() else _node()))
    for table in (render_trials(res), render_summary(res)):
        with console.capture() as cap:
            console.print(table)
        assert "…" not in cap.get() and "sub_group_size" in cap.get()


def _cuda():
    import torch

    return torch.cuda.is_available()


def _node():
    from dostune.profile.paths import shipped_profile

    return shipped_profile()


def test_one_default_sub_group_size():
    """Every place that runs ZeRO-3 without a sub_group_size given takes the same one: a profile taken at one size
    and a validation or bench run at another would compare different steps."""
    import inspect

    from dostune.bench.run import BenchOptions
    from dostune.cli.bench import bench
    from dostune.cli.profile import profile
    from dostune.dsconfig import DEFAULT_SUB_GROUP_SIZE, OffloadSettings
    from dostune.profile.model import ModelProfileOptions

    cli = [inspect.signature(f).parameters["sub_group_size"].default.default for f in (bench, profile)]
    assert cli == [DEFAULT_SUB_GROUP_SIZE] * 2
    assert {BenchOptions().sub_group_size, ModelProfileOptions().sub_group_size,
            OffloadSettings().sub_group_size} == {DEFAULT_SUB_GROUP_SIZE}


def test_progress_in_a_log_is_a_line_per_phase_as_it_ends():
    # a log (a file, a pipe, CI) gets each phase's line when the phase ends, not the whole display at exit
    import io

    from rich.console import Console

    from dostune.cli.common import LogProgress, RichProgress, progress_display

    log = io.StringIO()
    console = Console(file=log, width=200)
    progress = progress_display(console)
    assert isinstance(progress, LogProgress)
    with progress:
        progress.start("zero-offload: building DeepSpeed's engine", 1)
        progress.advance()
        assert log.getvalue() == ""  # the phase has not ended
        progress.start("zero-offload: 2 warm-up + 5 timed iterations", 7)
        assert log.getvalue() == "  zero-offload: building DeepSpeed's engine  1/1  0:00:00\n"
        progress.advance(3)
    # stopped part-way (an error, Ctrl-C): the last phase's line says how far it got
    assert log.getvalue().splitlines()[-1] == "  zero-offload: 2 warm-up + 5 timed iterations  3/7  0:00:00"
    assert isinstance(progress_display(Console(file=io.StringIO(), force_terminal=True)), RichProgress)
