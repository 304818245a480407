"""Every command over a table of bad inputs: each is refused before any work with exit 2, one line naming the
problem and one line with a hint, no traceback, and no output file left behind."""
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.optim.footprint import available_host_bytes
from dostune.optim.schedule import ScheduleConfig
from dostune.profile.paths import shipped_profile

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tests" / "data" / "bench-cpu.json"  # a real bench result, measured on a CPU


def _unwritable_dir(tmp_path: Path):
    """A folder in which creating a file fails, for this user (root writes through chmod, not to sysfs)."""
    candidates = [Path("/sys")]
    if os.geteuid() != 0:
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o555)
        candidates.insert(0, ro)
    for d in candidates:
        try:
            fd, probe = tempfile.mkstemp(dir=d)
        except OSError:
            return d
        os.close(fd)
        os.unlink(probe)
    return None


def _config(path: Path, schedule=None, **zero) -> str:
    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(sub_group_size=20_000, pin_memory=False,
                                                                          schedule=schedule))
    cfg["zero_optimization"].update(zero)
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def paths(tmp_path):
    p = {"tmp": str(tmp_path)}
    (tmp_path / "binary.json").write_bytes(bytes(range(256)) * 8)
    p["bin"] = str(tmp_path / "binary.json")
    (tmp_path / "empty.json").write_text("")
    p["empty"] = str(tmp_path / "empty.json")
    (tmp_path / "a-dir").mkdir()
    p["dir"] = str(tmp_path / "a-dir")
    (tmp_path / "a-file").write_text("x")
    p["file"] = str(tmp_path / "a-file")
    (tmp_path / "exists.json").write_text("{}")
    p["exists"] = str(tmp_path / "exists.json")
    p["missing"] = str(tmp_path / "missing.json")
    p["node"] = str(shipped_profile())
    p["bench"] = str(BENCH)
    future = json.loads(shipped_profile().read_text()) | {"schema_version": 99}
    (tmp_path / "future-node.json").write_text(json.dumps(future))
    p["future_node"] = str(tmp_path / "future-node.json")
    bench = json.loads(BENCH.read_text())
    (tmp_path / "future-bench.json").write_text(json.dumps(bench | {"schema_version": 99}))
    p["future_bench"] = str(tmp_path / "future-bench.json")
    (tmp_path / "other-bench.json").write_text(json.dumps(bench | {"seq": bench["seq"] * 2}))
    p["other_bench"] = str(tmp_path / "other-bench.json")
    # tuned for another model: 26 subgroups (gpt2-tiny has 7 at this sub_group_size); 5 resident of 3 GPU-lane
    p["cfg26"] = _config(tmp_path / "cfg26.json", ScheduleConfig(gpu_fraction=0.25, expected_subgroups=26))
    p["cfg_resident"] = _config(tmp_path / "resident.json", ScheduleConfig(gpu_fraction=0.5, resident_subgroups=5,
                                                                           expected_subgroups=5))
    p["cfg_plain"] = _config(tmp_path / "plain.json")
    p["cfg_stage2"] = _config(tmp_path / "stage2.json", ScheduleConfig(), stage=2)
    from dostune.dsconfig import hf_config
    hf = hf_config(json.loads((tmp_path / "plain.json").read_text()), "trainer")  # "auto" for the Trainer to fill
    (tmp_path / "for-trainer.json").write_text(json.dumps(hf))
    p["cfg_hf"] = str(tmp_path / "for-trainer.json")
    # a Hugging Face config without the model's sizes: transformers would make LlamaConfig's 7B default of it
    (tmp_path / "hf-no-sizes.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512}))
    p["hf_no_sizes"] = str(tmp_path / "hf-no-sizes.json")
    p["out"] = str(tmp_path / "out")  # where an output would go: must not exist after any case
    ro = _unwritable_dir(tmp_path)
    if ro is not None:
        p["ro"] = str(ro)
    return p


# (command line, what the message must say); every case exits 2 and leaves {out} absent
CASES = [
    # profile
    ("profile --quick --output {ro}/node.json", "cannot be written"),
    ("profile --quick --output {file}/node.json", "is a file, not a folder"),
    ("profile --quick --output {dir}", "is a folder, not a file"),
    ("profile --quick --output {exists}", "already exists"),
    ("profile --quick --repeats 0 --output {out}", "--repeats"),
    ("profile --quick --dtype fp8 --output {out}", "bf16 or fp16"),
    ("profile --quick --copy-sizes-mib 4,lots --output {out}", "--copy-sizes-mib"),
    ("profile --model gpt2-tiny --seq 4096 --output {out}", "exceeds"),
    ("profile --model gpt5-giant --output {out}", "unknown model"),
    ("profile --model gpt2-tiny --seq 64 --plot {file}/m.png --output {out}", "is a file, not a folder"),
    # tune
    ("tune --trials 2 --output-dir {ro}/tune", "cannot be written"),
    ("tune --trials 2 --output-dir {file}/tune", "is a file, not a folder"),
    ("tune --trials 2 --output-dir {file}", "is a file, not a folder"),
    ("tune --trials 2 --output-dir {tmp} --storage sqlite:///{file}/study.db", "is a file, not a folder"),
    ("tune --trials 2 --output-dir {out} --storage notadb://x", "not a database URL"),
    ("tune --trials 2 --output-dir {out} --profile {bin}", "binary"),
    ("tune --trials 2 --output-dir {out} --profile {empty}", "is empty"),
    ("tune --trials 2 --output-dir {out} --profile {missing}", "does not exist"),
    ("tune --trials 2 --output-dir {out} --profile {dir}", "is a directory"),
    ("tune --trials 2 --output-dir {out} --profile {bench}", "expected a 'dostune.node-profile'"),
    ("tune --trials 2 --output-dir {out} --profile {future_node}", "newer dostune"),
    ("tune --trials 2 --output-dir {out} --profile {node} --model-profile {node}", "dostune.model-profile"),
    ("tune --trials 2 --output-dir {out} --precision fp8", "--precision must be bf16, fp16 or fp32"),
    ("tune --trials 2 --output-dir {out} --max-peak-increase 10", "ambiguous"),
    ("tune --trials 2 --output-dir {out} --max-peak-increase -5%", "non-negative"),
    ("tune --trials 2 --output-dir {out} --gpu-memory-budget lots", "'auto' or a number"),
    ("tune --trials 2 --output-dir {out} --sampler annealing", "--sampler must be one of"),
    ("tune --trials 0 --output-dir {out}", "--trials"),
    ("tune --trials 2 --output-dir {out} --for nonsense", "unknown config target"),
    ("tune --trials 2 --output-dir {out} --profile {node} --model gpt2-tiny", "no model profile for gpt2-tiny"),
    ("tune --trials 2 --output-dir {out} --hostfile {bin}", "not a text file (it holds binary data)"),
    ("tune --trials 2 --output-dir {out} --hostfile {dir}", "is not a file"),
    ("tune --trials 2 --output-dir {out} --hostfile {missing}", "does not exist"),
    # plan
    ("plan --profile {node} --precision fp8 --config-out {out}", "--precision must be bf16, fp16 or fp32"),
    ("plan --profile {missing} --config-out {out}", "does not exist"),
    ("plan --profile {bin} --config-out {out}", "binary"),
    ("plan --profile {node} --model-profile {node} --config-out {out}", "dostune.model-profile"),
    ("plan --profile {node} --config-out {dir}", "is a folder, not a file"),
    ("plan --profile {node} --config-out {file}/ds_config.json", "is a file, not a folder"),
    ("plan --profile {node} --model gpt5-giant --config-out {out}", "unknown model"),
    ("plan --profile {node} --host-memory-budget lots --config-out {out}", "'auto' or a number"),
    ("plan --profile {node} --num-gpus 2 --hostfile {missing} --config-out {out}", "does not exist"),
    # train
    ("train --config {missing} --model gpt2-tiny --metrics {out}", "does not exist"),
    ("train --config {bin} --model gpt2-tiny --metrics {out}", "binary"),
    ("train --config {dir} --model gpt2-tiny --metrics {out}", "is a directory"),
    ("train --config {empty} --model gpt2-tiny --metrics {out}", "is empty"),
    ("train --config {node} --model gpt2-tiny --metrics {out}", "stage 3"),
    ("train --config {cfg_stage2} --model gpt2-tiny --metrics {out}", "stage 3"),
    ("train --config {cfg_hf} --model gpt2-tiny --metrics {out}", "as \"auto\" for the Hugging Face Trainer"),
    ("train --config {cfg26} --model gpt2-tiny --seq 16 --metrics {out}", "tuned for 26 subgroups but gpt2-tiny has"),
    ("train --config {cfg_resident} --model gpt2-tiny --seq 16 --metrics {out}", "resident_subgroups is 5"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --save-dir {ro}/ckpt", "cannot be written"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --save-dir {file}", "is a file, not a folder"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --metrics {file}/m.jsonl", "is a file, not a folder"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --metrics {dir}", "is a folder, not a file"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 4096 --metrics {out}", "exceeds"),
    ("train --config {cfg_plain} --model gpt2-tiny --steps 0 --metrics {out}", "--steps"),
    ("train --config {cfg_plain} --model gpt2-tiny --resume --metrics {out}", "--resume needs --save-dir"),
    ("train --config {cfg_plain} --model gpt2-tiny --data {missing} --metrics {out}", "does not exist"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --data {empty} --metrics {out}", "is empty"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --data {bin} --metrics {out}", "is not text"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --data {file} --metrics {out}", "fewer than one sequence"),
    ("train --config {cfg_plain} --model gpt2-tiny --seq 16 --save-dir {dir} --resume --metrics {out}",
     "no checkpoint in"),
    ("train --config {cfg_plain} --model hf:{hf_no_sizes} --seq 16 --metrics {out}", "gives no hidden_size"),
    # refit
    ("refit --config {cfg26} --model gpt2-tiny --output {exists}", "already exists"),
    ("refit --config {cfg26} --model gpt2-tiny --output {file}/x.json", "is a file, not a folder"),
    ("refit --config {cfg_stage2} --model gpt2-tiny --output {out} --sub-group-size 0", "--sub-group-size"),
    ("refit --config {bin} --model gpt2-tiny --output {out}", "binary"),
    ("refit --config {node} --model gpt2-tiny --output {out}", "no 'dostune' section"),
    ("refit --config {cfg26} --model gpt5-giant --output {out}", "unknown model"),
    ("refit --config {cfg26} --model hf:{hf_no_sizes} --output {out}", "gives no hidden_size"),
    # bench
    ("bench --model gpt2-tiny --seq 16 --output {ro}/bench.json", "cannot be written"),
    ("bench --model gpt2-tiny --seq 16 --output {file}/bench.json", "is a file, not a folder"),
    ("bench --model gpt2-tiny --seq 16 --output {dir}", "is a folder, not a file"),
    ("bench --model gpt2-tiny --seq 16 --output {tmp}/bench.md", "names the result JSON"),
    ("bench --model gpt2-tiny --seq 16 --methods warp-drive --output {out}", "unknown method"),
    ("bench --model gpt2-tiny --seq 16 --config {bin} --output {out}", "binary"),
    ("bench --model gpt2-tiny --seq 16 --config {node} --output {out}", "no 'dostune' section"),
    ("bench --model gpt2-tiny --seq 16 --config {cfg26} --output {out}", "tuned for 26 subgroups but gpt2-tiny"),
    ("bench --model gpt2-tiny --seq 4096 --output {out}", "exceeds"),
    ("bench --model gpt2-tiny --seq 16 --rounds 0 --output {out}", "--rounds"),
    ("bench --model gpt2-tiny --seq 16 --precision fp8 --output {out}", "bf16, fp16 or fp32"),
    ("bench --model gpt2-tiny --seq 16 --schedule {{nope --output {out}", "not valid JSON"),
    # check
    ("check --baseline {missing} --current {bench} --junit {out}", "does not exist"),
    ("check --baseline {bin} --current {bench} --junit {out}", "binary"),
    ("check --baseline {empty} --current {bench} --junit {out}", "is empty"),
    ("check --baseline {dir} --current {bench} --junit {out}", "is a directory"),
    ("check --baseline {node} --current {bench} --junit {out}", "expected a 'dostune.bench'"),
    ("check --baseline {future_bench} --current {bench} --junit {out}", "newer dostune"),
    ("check --baseline {bench} --current {bin} --junit {out}", "binary"),
    ("check --baseline {bench} --current {other_bench} --junit {out}", "not comparable"),
    ("check --baseline {bench} --current {bench} --junit {ro}/check.xml", "cannot be written"),
    ("check --baseline {bench} --current {bench} --junit {file}/check.xml", "is a file, not a folder"),
    ("check --baseline {bench} --current {bench} --junit {dir}", "is a folder, not a file"),
    ("check --baseline {bench} --current {bench} --max-regression lots --junit {out}", "--max-regression"),
    ("check --baseline {bench} --current {bench} --max-regression 5 --junit {out}", "ambiguous"),
    # usage errors
    ("check --baseline", "requires an argument"),
    ("check --baseline {bench} --bogus", "No such option"),
]


@pytest.mark.parametrize("line,says", CASES, ids=[c[0].split(" --")[0] + ": " + c[1] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(paths, line, says):
    if "{ro}" in line and "ro" not in paths:
        pytest.skip("no folder here refuses a new file to this user")
    if " hf:" in line:
        pytest.importorskip("transformers")
    if " --output-dir " in line and torch.cuda.is_available() and " --profile " not in line:
        line += " --profile {node}"  # with a GPU, tune needs a profile named
    args = [a.format(**paths) for a in line.split()]
    before = set(Path(paths["tmp"]).rglob("*"))
    r = CliRunner().invoke(app, args)
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert lines and lines[0].startswith("error: ") and says in lines[0], r.output
    assert len(lines) == 2 and lines[1].startswith("hint: ") and len(lines[1]) > len("hint: "), r.output
    # what the hint points at holds for a pip install too, which has no tests/ or docs/ folder
    assert not any(where in lines[1] for where in ("tests/", "docs/", "results/")), r.output
    assert not Path(paths["out"]).exists()
    assert set(Path(paths["tmp"]).rglob("*")) == before, "a refused command left files behind"


@pytest.mark.parametrize("line", ["check --baseline", "check --junit", "tune --trials", "check --bogus"])
def test_usage_error_hint_names_the_command(line):
    r = CliRunner().invoke(app, line.split())
    assert r.exit_code == 2 and f"`dostune {line.split()[0]} --help`" in r.output.splitlines()[-1], r.output


def test_unknown_model_offers_the_user_presets_only(paths):
    """The CI-only shapes resolve by name (the suite and the gate use them) but are never offered."""
    from dostune.models.registry import CI_PRESETS, PRESETS, resolve_model

    r = CliRunner().invoke(app, ["refit", "--config", paths["cfg26"], "--model", "gpt5-giant",
                                 "--output", paths["out"]])
    assert r.exit_code == 2
    assert all(name in r.output for name in PRESETS) and not any(name in r.output for name in CI_PRESETS), r.output
    assert all(resolve_model(name).num_params for name in CI_PRESETS)


def test_unreadable_input_hint_is_specific(paths):
    """Binary, empty and folder inputs say what to name instead (not only where --help is)."""
    for line in ("check --baseline {bin} --current {bench}", "tune --trials 2 --output-dir {out} --profile {empty}",
                 "train --config {dir} --model gpt2-tiny", "tune --trials 2 --output-dir {out} --hostfile {bin}",
                 "tune --trials 2 --output-dir {out} --precision fp8",
                 "bench --model gpt2-tiny --seq 4096 --output {out}",
                 "train --config {cfg_plain} --model gpt2-tiny --seq 16 --resume --metrics {out}"):
        r = CliRunner().invoke(app, [a.format(**paths) for a in line.split()])
        hint = r.output.splitlines()[-1]
        assert r.exit_code == 2 and hint.startswith("hint: ") and "--help" not in hint, (line, r.output)
        assert "codec" not in r.output


def test_profile_refuses_to_overwrite_a_shipped_profile_and_says_how_to_keep_it(tmp_path, monkeypatch):
    """On a node whose default name is a shipped profile's (an H200 in a checkout), `dostune profile` stops before
    measuring and says which --name keeps the shipped file."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    node = shipped / "h200-pcie5.json"
    node.write_bytes(shipped_profile().read_bytes())
    monkeypatch.setenv("DOSTUNE_PROFILES", str(shipped))
    r = CliRunner().invoke(app, ["profile", "--quick", "--output", str(node)])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and "it is a profile dostune ships" in lines[0] and "--name" in lines[1], r.output
    assert node.read_bytes() == shipped_profile().read_bytes()



@pytest.mark.skipif((available_host_bytes() or 0) > 200 * 2**30, reason="this host could hold llama-13b's ZeRO-Offload")
def test_a_model_profile_whose_zero_offload_the_host_cannot_hold_stops_in_one_line(tmp_path):
    """The model profile measures ZeRO-Offload: for llama-13b (about 220 GiB of host memory pageable) on a smaller
    host it stops before building anything, says why and where to profile instead, and writes nothing."""
    out = tmp_path / "m.json"
    r = CliRunner().invoke(app, ["profile", "--model", "llama-13b", "--micro-batch", "1", "--seq", "128",
                                 "--output", str(out)])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 2 and "Traceback" not in r.output, r.output
    assert "model profile measures ZeRO-Offload's iterations, which this host cannot hold" in lines[0]
    assert "needs about 220" in lines[0] and lines[1].startswith("hint: profile it where") and not out.exists()


def test_tune_without_a_model_profile_that_no_node_like_this_can_measure_says_what_to_give_instead(tmp_path):
    """llama-13b on the shipped H200 profile (125 GiB host): a model profile runs ZeRO-Offload, which needs about
    220 GiB there, so tune does not send the user to make one; it names the GPU budget to give instead."""
    out = tmp_path / "tune"
    r = CliRunner().invoke(app, ["tune", "--model", "llama-13b", "--profile", str(shipped_profile("h200-pcie5.json")),
                                 "--output-dir", str(out)])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 2 and "Traceback" not in r.output, r.output
    assert "none can be measured there" in lines[0] and "needs about 220" in lines[0]
    assert lines[1].startswith("hint: give --gpu-memory-budget at most 102 GiB on h200-pcie5") and not out.exists()
    # a model whose ZeRO-Offload the node holds: measure its profile, as before
    r = CliRunner().invoke(app, ["tune", "--model", "llama-7b", "--profile", str(shipped_profile("h200-pcie5.json")),
                                 "--output-dir", str(out)])
    assert r.exit_code == 2 and "dostune profile --model llama-7b" in r.output
