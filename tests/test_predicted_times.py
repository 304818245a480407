"""The performance model's predictions for fixed models and schedules on the shipped profiles must not move unless
the change says so: tests/data/predicted-times.json pins them (dostune/bench/predicted.py says how to update it)."""
import copy
import json
from pathlib import Path

import pytest

from dostune.bench import predicted

PINNED = Path(__file__).parent / "data" / "predicted-times.json"


@pytest.fixture(scope="module")
def current():
    return predicted.compute()


def test_predictions_match_the_pinned_file(current):
    lines = predicted.moved(json.loads(PINNED.read_text()), current)
    assert not lines, ("the performance model's predictions moved:\n  " + "\n  ".join(lines) +
                       f"\nIf the change means to move them, regenerate the file with `{predicted.UPDATE_COMMAND}` "
                       "and say why in the commit message.")


def test_every_schedule_feature_and_both_profile_kinds_are_pinned(current):
    cases = current["cases"].values()
    used = {k for c in cases for k in c["schedule"]}
    assert {"gpu_fraction", "overlap_backward", "resident_subgroups", "adaptive_swing",
            "grads_on_gpu", "upload", "staging_buffers", "gpu_placement"} <= used
    assert any(c["predicted"]["iter_s"] is None for c in cases)  # node profile only: the step alone
    assert all(c["predicted"]["step_s"] > 0 for c in cases)


def test_moved_names_the_case_the_value_and_the_change(current):
    pinned = copy.deepcopy(current)
    name = next(iter(pinned["cases"]))
    pinned["cases"][name]["predicted"]["step_s"] *= 1.1
    del pinned["cases"][list(pinned["cases"])[-1]]
    lines = predicted.moved(pinned, current)
    assert len(lines) == 2
    assert any(line.startswith(f"{name}: step_s ") and "(-9.091%)" in line for line in lines)
    assert any(line.endswith("computed but not pinned") for line in lines)
    # the last bits of a float may differ between machines
    pinned = copy.deepcopy(current)
    pinned["cases"][name]["predicted"]["step_s"] *= 1 + 1e-12
    assert predicted.moved(pinned, current) == []


def test_check_command_exit_codes(tmp_path, capsys, monkeypatch, current):
    monkeypatch.setattr(predicted, "compute", lambda: current)
    path = tmp_path / "p.json"
    assert predicted.main(["--write", str(path)]) == 0
    assert predicted.main(["--check", str(path)]) == 0
    data = json.loads(path.read_text())
    data["cases"][next(iter(data["cases"]))]["predicted"]["iter_s"] = 9.0
    path.write_text(json.dumps(data))
    assert predicted.main(["--check", str(path)]) == 1
    assert "1 prediction(s) moved" in capsys.readouterr().out
