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
