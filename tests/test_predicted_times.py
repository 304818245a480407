"""The performance model's predictions for fixed models and schedules on the shipped profiles must not move unless
the change says so: tests/data/predicted-times.json declares the cases and pins their predictions
(tools/predicted_times.py rewrites it)."""
import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the rewrite tool, beside the package
from tools import predicted_times  # noqa: E402

PINNED = ROOT / "tests" / "data" / "predicted-times.json"


@pytest.fixture(scope="module")
def pinned():
    return json.loads(PINNED.read_text())


@pytest.fixture(scope="module")
def current(pinned):
    return predicted_times.compute(pinned)


def test_predictions_match_the_pinned_file(pinned, current):
    lines = predicted_times.moved(pinned, current)
    assert not lines, ("the performance model's predictions moved:\n  " + "\n  ".join(lines) + "\nIf the change "
                       f"means to move them, regenerate the file with `{predicted_times.UPDATE_COMMAND}` and say why "
                       "in the commit message.")
    assert pinned["update_with"] == predicted_times.UPDATE_COMMAND


def test_every_schedule_feature_and_both_profile_kinds_are_pinned(current):
    cases = current["cases"].values()
    used = {k for c in cases for k in c["schedule"]}
    assert {"gpu_fraction", "overlap_backward", "resident_subgroups", "adaptive_swing",
            "grads_on_gpu", "upload", "staging_buffers", "gpu_placement"} <= used
    assert any(c["predicted"]["iter_s"] is None for c in cases)  # node profile only: the step alone
    assert all(c["predicted"]["step_s"] > 0 for c in cases)
    assert len({c["sub_group_size"] for c in cases}) >= 2


def test_moved_names_the_case_the_value_and_the_change(current):
    pinned = copy.deepcopy(current)
    name = next(iter(pinned["cases"]))
    pinned["cases"][name]["predicted"]["step_s"] *= 1.1
    del pinned["cases"][list(pinned["cases"])[-1]]
    lines = predicted_times.moved(pinned, current)
    assert len(lines) == 2
    assert any(line.startswith(f"{name}: step_s ") and "(-9.091%)" in line for line in lines)
    assert any(line.endswith("computed but not pinned") for line in lines)
    # the last bits of a float may differ between machines
    pinned = copy.deepcopy(current)
    pinned["cases"][name]["predicted"]["step_s"] *= 1 + 1e-12
    assert predicted_times.moved(pinned, current) == []


def test_the_tool_writes_a_new_cases_predictions_and_checks_them(tmp_path, capsys, pinned):
    data = copy.deepcopy(pinned)
    name = next(iter(data["cases"]))
    data["cases"] = {name: data["cases"][name],
                     "added": {"model": "gpt2-1.3b", "model_profile": data["cases"][name]["model_profile"],
                               "sub_group_size": 50_000_000, "schedule": {"gpu_fraction": 0.3}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert predicted_times.main(["--check", str(path)]) == 1  # the new case has no prediction yet
    assert predicted_times.main(["--write", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written["cases"][name] == pinned["cases"][name] and written["cases"]["added"]["predicted"]["step_s"] > 0
    assert predicted_times.main(["--check", str(path)]) == 0
    written["cases"][name]["predicted"]["iter_s"] = 9.0
    path.write_text(json.dumps(written))
    assert predicted_times.main(["--check", str(path)]) == 1
    assert capsys.readouterr().out.endswith("1 prediction(s) moved\n")
