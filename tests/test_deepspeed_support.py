import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dostune import deepspeed_support as ds
from dostune.cli.app import app
from dostune.errors import DostuneError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def installed(monkeypatch):
    def set_version(v):
        monkeypatch.setattr(ds, "installed_deepspeed", lambda: v)

    monkeypatch.delenv(ds.ALLOW_ENV, raising=False)
    return set_version


def test_the_tested_release_and_its_local_builds_pass(installed):
    lo, hi = ds.TESTED_DEEPSPEED
    for v in (lo, hi, f"{hi}+cu124"):
        installed(v)
        assert ds.check_deepspeed() is None


@pytest.mark.parametrize("version", ["0.19.7", "0.19.9", "0.20.0", "1.0.0rc1", "not-a-version"])
def test_other_releases_are_refused_with_the_way_out(installed, version):
    installed(version)
    with pytest.raises(DostuneError, match=f"DeepSpeed {version} is installed but dostune train is tested with "
                                           f"DeepSpeed {ds.tested_range()}") as e:
        ds.check_deepspeed("dostune train")
    assert f"{ds.ALLOW_ENV}={version}" in e.value.hint and "pip install deepspeed==" in e.value.hint


def test_the_override_runs_at_the_users_risk(installed, monkeypatch):
    installed("0.21.0")
    for allowed in ("any", "0.21.0"):
        monkeypatch.setenv(ds.ALLOW_ENV, allowed)
        assert "outside dostune's tested range" in ds.check_deepspeed()
    monkeypatch.setenv(ds.ALLOW_ENV, "0.20.0")  # allowing another release does not allow this one
    with pytest.raises(DostuneError):
        ds.check_deepspeed()


def test_missing_deepspeed(installed):
    installed(None)
    with pytest.raises(DostuneError, match="not installed"):
        ds.check_deepspeed()


def test_pyproject_pins_the_tested_release():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lo, hi = ds.TESTED_DEEPSPEED
    assert lo == hi and f"deepspeed=={lo}" in deps  # one release tested: one release pinned


def test_commands_refuse_before_any_work(installed, tmp_path):
    installed("0.30.0")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}))
    for args in (["train", "--config", str(cfg), "--model", "gpt2-tiny", "--seq", "16"],
                 ["bench", "--model", "gpt2-tiny", "--seq", "16", "--output", str(tmp_path / "b.json")],
                 ["profile", "--quick", "--output", str(tmp_path / "n.json")]):
        r = CliRunner().invoke(app, args)
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert r.exit_code == 2 and lines[0].startswith("error: DeepSpeed 0.30.0 is installed"), r.output
        assert len(lines) == 2 and ds.ALLOW_ENV in lines[1]
    assert list(tmp_path.iterdir()) == [cfg]


def test_py_cpuinfo_is_asked_once_per_process(monkeypatch):
    """DeepSpeed asks py-cpuinfo at every CPU Adam and op load, and each answer runs a subprocess: dostune keeps the
    first (a copy each time), before it builds an engine and when it adopts an optimizer."""
    import cpuinfo

    from dostune.deepspeed_support import remember_cpu_info

    calls = []

    def fresh_answer():
        calls.append(1)
        return {"vendor_id_raw": "GenuineIntel", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", fresh_answer)
    remember_cpu_info()
    remember_cpu_info()  # a second call wraps nothing again
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")  # each caller gets its own copy, as a fresh answer would be
    first["vendor_id_raw"] = "changed"
    assert cpuinfo.get_cpu_info() == {"vendor_id_raw": "GenuineIntel", "flags": ["avx2"]}
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, inside its functions

    assert get_cpu_info()["vendor_id_raw"] == "GenuineIntel" and len(calls) == 1
