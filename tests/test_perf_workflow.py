"""The GPU performance workflow (.github/workflows/perf.yml) is ready to run: its dostune commands parse, name files
that exist, bench what the baseline measured, and its gate passes on the baseline itself."""
import json
import shlex
from pathlib import Path

import typer
import yaml
from typer.testing import CliRunner

from dostune.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "perf.yml"


def _commands():
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["perf"]
    env = job.get("env", {})
    out = {}
    for step in job["steps"]:
        for line in step.get("run", "").replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words and words[0].endswith("/dostune"):
                out[words[1]] = [env.get(w[1:].strip("{}"), w) if w.startswith("$") else w for w in words[2:]]
    return job, out


def _options(args):
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def test_runs_on_a_self_hosted_gpu_runner_and_uploads_the_junit_report():
    job, cmds = _commands()
    assert job["runs-on"] == ["self-hosted", "gpu"]
    assert set(cmds) == {"bench", "check"}
    upload = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload and upload[0]["if"] == "always()"
    assert Path(_options(cmds["check"])["--junit"]).parent.as_posix() == upload[0]["with"]["path"].rstrip("/")


def test_the_bench_measures_what_the_baseline_did():
    _, cmds = _commands()
    bench, check = _options(cmds["bench"]), _options(cmds["check"])
    base = json.loads((ROOT / check["--baseline"]).read_text())
    assert (bench["--model"], int(bench["--micro-batch"]), int(bench["--seq"])) == \
        (base["model"], base["micro_batch"], base["seq"])
    assert (ROOT / bench["--config"]).exists()
    assert check["--current"] == bench["--output"]
    group = typer.main.get_command(app)
    group.commands["bench"].make_context("bench", list(cmds["bench"]))  # every option exists and parses


def test_the_gate_command_passes_on_the_baseline_itself(tmp_path):
    _, cmds = _commands()
    args = list(cmds["check"])
    opts = _options(args)
    args[args.index("--current") + 1] = str(ROOT / opts["--baseline"])
    args[args.index("--baseline") + 1] = str(ROOT / opts["--baseline"])
    args[args.index("--junit") + 1] = str(tmp_path / "check.xml")
    r = CliRunner().invoke(app, ["check", *args])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "check.xml").exists()
