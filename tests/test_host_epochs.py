"""profile/host_epochs.py: the passes timed back to back, and the windows set beside each other."""
import json
from pathlib import Path

import pytest

from dostune.errors import DostuneError
from dostune.profile.host_epochs import WARMUP, main, windows


def _write(path: Path, start: float, rows: list[tuple[float, float, float]]) -> Path:
    path.write_text("".join(json.dumps({"pid": 1, "k": k, "t": start + t, "fwd": f, "bwd": b}) + "\n"
                            for k, (t, f, b) in enumerate(rows)))
    return path


def test_windows_are_medians_per_stretch_of_wall_clock_from_the_first_files_start(tmp_path):
    warm = [(0.0, 9.0, 9.0)] * WARMUP  # slow first iterations: left out
    long = _write(tmp_path / "long.jsonl", 100.0, warm + [(1, .10, .20), (2, .12, .22), (11, .30, .40), (12, .32, .42),
                                                          (13, .34, .44)])
    short = _write(tmp_path / "short.jsonl", 100.0, warm + [(21, .11, .21)])
    rows = windows([long, short], 10.0)
    got = [(r["file"], r["from_s"], r["n"], round(r["fwd_ms"]), round(r["bwd_ms"])) for r in rows]
    assert got == [("long.jsonl", 0.0, 2, 110, 210), ("long.jsonl", 10.0, 3, 320, 420), ("long.jsonl", None, 5, 300, 400),
                   ("short.jsonl", 20.0, 1, 110, 210), ("short.jsonl", None, 1, 110, 210)]


def test_a_file_that_is_not_the_timings_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n" * (WARMUP + 1))
    assert main(["windows", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not the JSON lines")
    with pytest.raises(DostuneError, match="no iterations after the first"):
        windows([_write(tmp_path / "short.jsonl", 0.0, [(0, 1, 1)] * WARMUP)], 10.0)
    assert main(["time", "gpt2-tiny", "--seconds", "0", "-o", str(tmp_path / "x.jsonl")]) == 2
    assert main(["windows", str(bad), "--window", "0"]) == 2
    assert main(["time", "gpt2-tiny", "-o", str(tmp_path / "no" / "such" / "x.jsonl")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --seconds, --micro-batch and --seq must be positive", "error: --window must be positive",
                   f"error: cannot write {tmp_path / 'no' / 'such' / 'x.jsonl'}: no folder {tmp_path / 'no' / 'such'}"]
    assert main(["time", "no-such-model", "-o", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_time_writes_a_line_per_iteration_on_the_cpu(tmp_path):
    out = tmp_path / "t.jsonl"
    assert main(["time", "gpt2-tiny", "--seconds", "0.5", "--micro-batch", "1", "--seq", "32", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and [r["k"] for r in rows] == list(range(len(rows)))
    assert all(r["fwd"] > 0 and r["bwd"] > 0 for r in rows) and rows[-1]["t"] >= rows[0]["t"]


def test_iteration_phases_times_each_phase_inside_the_callers_hook_and_skips_the_step_when_asked():
    import time

    import torch

    from dostune.profile.timing import iteration_phases

    calls = []

    class Engine:
        def __call__(self, **batch):
            calls.append("forward")
            return torch.tensor(batch["x"] * 2.0)

        def backward(self, loss):
            calls.append(f"backward {loss.item():g}")
            time.sleep(0.02)

        def step(self):
            calls.append("step")

    def around(name, fn):
        calls.append(f"<{name}")
        out = fn()
        calls.append(f"{name}>")
        return out

    loss, f, b, s = iteration_phases(Engine(), {"x": 3}, lambda: calls.append("sync"), around=around)
    assert loss.item() == 6 and b >= 0.02 and f < b and s >= 0
    assert calls == ["sync", "<fwd", "forward", "fwd>", "sync", "<bwd", "backward 6", "bwd>", "sync",
                     "<step", "step", "step>", "sync"]
    calls.clear()
    _, _, _, s = iteration_phases(Engine(), {"x": 1}, lambda: None, step=False)
    assert s == 0.0 and calls == ["forward", "backward 2"]
