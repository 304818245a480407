import json
from xml.etree import ElementTree as ET

import pytest
from typer.testing import CliRunner

from dostune.bench.check import UnusableInput, compare, junit_xml
from dostune.bench.record import BenchResult, MethodResult
from dostune.cli.app import app
from dostune.stats import Stat


def stat(median, spread=0.01, n=10):
    """n samples evenly spread over median * (1 -/+ spread): quartiles at about -/+ spread/2."""
    return Stat.of([median * (1 - spread + 2 * spread * k / (n - 1)) for k in range(n)])


def result(zero_step=1.0, dostune_step=0.3, fwd=0.1, bwd=0.2, spread=0.01, **over):
    def method(name, step):
        s = dict(fwd=stat(fwd, spread), bwd=stat(bwd, spread), step=stat(step, spread),
                 iter=stat(fwd + bwd + step, spread))
        return MethodResult(method=name, description=name, iter_s=s["iter"].median, fwd_s=fwd, bwd_s=bwd,
                            step_s=step, **s)

    base = dict(created="t", command="t", dostune_version="0", deepspeed_version="0.19.8", torch_version="x",
                node="h100", gpu="H100", model="gpt2-1.3b", params=10, micro_batch=8, seq=1024, precision="bf16",
                warmup=1, iters=10, seed=0,
                methods={"zero-offload": method("zero-offload", zero_step), "dostune": method("dostune", dostune_step)})
    base.update(over)
    return BenchResult(**base)


def test_within_tolerance_passes():
    rep = compare(result(), result(dostune_step=0.31), 0.05)
    assert rep.exit_code == 0 and not rep.regressions


def test_slower_dostune_step_is_a_regression():
    rep = compare(result(), result(dostune_step=0.36), 0.05)
    names = {f.name for f in rep.regressions}
    assert "dostune/step" in names and "speedup/step" in names and "dostune/iter" in names
    assert "zero-offload/step" not in names
    assert rep.exit_code == 1


def test_noise_rule_needs_both_tolerance_and_spread():
    # 10% slower but each run's quartiles spread 10%: within the noise, so not reported
    noisy = compare(result(spread=0.2), result(dostune_step=0.33, spread=0.2), 0.05)
    assert not [f for f in noisy.regressions if f.name == "dostune/step"]
    quiet = compare(result(spread=0.005), result(dostune_step=0.33, spread=0.005), 0.05)
    assert [f for f in quiet.regressions if f.name == "dostune/step"]
    # and a slowdown beyond the noise but within the tolerance is not reported either
    assert not compare(result(), result(dostune_step=0.312), 0.05).regressions


def test_ratio_only_ignores_absolute_times_and_the_node():
    slow_machine = result(zero_step=2.0, dostune_step=0.6, fwd=0.2, bwd=0.4, node="other")
    rep = compare(result(), slow_machine, 0.05, ratio_only=True)
    assert rep.exit_code == 0 and {f.name for f in rep.findings} == {"speedup/step", "speedup/iter"}


def test_unusable_inputs():
    with pytest.raises(UnusableInput, match="field 'model'"):
        compare(result(), result(model="gpt2-2.7b"), 0.05)
    with pytest.raises(UnusableInput, match="field 'node'"):
        compare(result(), result(node="a100"), 0.05)
    with pytest.raises(UnusableInput, match="fraction"):
        compare(result(), result(), 50)


def test_junit_xml_parses():
    rep = compare(result(), result(dostune_step=0.4), 0.05)
    root = ET.fromstring(junit_xml(rep))
    assert root.tag == "testsuite" and int(root.get("failures")) == len(rep.regressions) > 0
    assert len(root.findall("testcase")) == len(rep.findings)
    assert root.find("testcase/failure") is not None


def _write(tmp_path, name, res):
    p = tmp_path / name
    p.write_text(res.model_dump_json())
    return p


def test_cli_exit_codes(tmp_path):
    base = _write(tmp_path, "base.json", result())
    ok = _write(tmp_path, "ok.json", result(dostune_step=0.305))
    bad = _write(tmp_path, "bad.json", result(dostune_step=0.45))
    other = _write(tmp_path, "other.json", result(seq=2048))
    junit = tmp_path / "check.xml"
    run = lambda *a: CliRunner().invoke(app, ["check", "--baseline", str(base), *a])  # noqa: E731
    assert run("--current", str(ok)).exit_code == 0
    r = run("--current", str(bad), "--max-regression", "5%", "--junit", str(junit))
    assert r.exit_code == 1 and "REGRESSION" in r.output
    ET.parse(junit)
    r = run("--current", str(other))
    assert r.exit_code == 2 and "field 'seq'" in r.output
    (tmp_path / "garbage.json").write_text('{"schema_version": 99, "kind": "dostune.bench"}')
    r = run("--current", str(tmp_path / "garbage.json"))
    assert r.exit_code == 2 and "schema_version" in r.output
    r = run("--current", str(ok), "--max-regression", "lots")
    assert r.exit_code == 2


def test_update_baseline(tmp_path):
    base = _write(tmp_path, "base.json", result())
    new = _write(tmp_path, "new.json", result(dostune_step=0.45))
    r = CliRunner().invoke(app, ["check", "--baseline", str(base), "--current", str(new), "--update-baseline"])
    assert r.exit_code == 0
    assert json.loads(base.read_text())["methods"]["dostune"]["step_s"] == 0.45


def test_change_column_has_the_values_own_sign(tmp_path):
    """dostune's step slower: its time change reads +, its speedup change reads - (a falling speedup)."""
    base = _write(tmp_path, "base.json", result())
    bad = _write(tmp_path, "bad.json", result(dostune_step=0.45))
    r = CliRunner().invoke(app, ["check", "--baseline", str(base), "--current", str(bad)])
    rows = {line.split("│")[1].strip(): line.split("│")[4].strip() for line in r.output.splitlines()
            if line.startswith("│")}
    assert rows["dostune/step"] == "+50.0%"
    assert rows["speedup/step"] == f"{1.0 / 0.45 / (1.0 / 0.3) - 1:+.1%}" and rows["speedup/step"].startswith("-")
    assert r.exit_code == 1
