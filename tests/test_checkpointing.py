"""Activation checkpointing: the config section that switches it, the models that honour it, and parity.

With checkpointing each transformer block's forward runs again inside backward. Under ZeRO-3 the block's
parameters were released after the first forward, so the recompute must gather them again through ZeRO-3's
module hooks. On the CPU the recomputed forward is the same arithmetic on the same inputs, so training with it
is expected to equal training without it bit for bit, under DeepSpeed's optimizer and under dostune's."""
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.dsconfig import (CHECKPOINTING_CONTENTS, CHECKPOINTING_SECTION, OffloadSettings, TrainSettings,
                              activation_checkpointing, deepspeed_config, with_activation_checkpointing)
from dostune.errors import ConfigError, DostuneError
from dostune.models.registry import ModelSpec, resolve_model
from dostune.optim.schedule import ScheduleConfig

from parity_helpers import SEQ, SUB_GROUP_SIZE, base_settings, rel_diff
from test_parity import NO_CUTOFF

# Every parameter is released after its module's forward, so that the recompute has to gather it again: the tiny
# models' tensors are all below DeepSpeed's default persistence threshold (kept gathered for good), its default
# reuse distance keeps a parameter gathered from forward until its backward, and its prefetch gathers backward's
# first parameters (here: the whole tiny model) as soon as forward ends.
RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "stage3_prefetch_bucket_size": 0}
# ZeRO-3's prefetch and reuse at work (its trace of the module order then includes the recomputes)
PREFETCHED = {"stage3_param_persistence_threshold": 0}
STEPS = 6
# the GPU lane updates subgroups during backward too: its hooks see the recomputed blocks' gradients
OVERLAP = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", overlap_backward=True)


# --- the switch -------------------------------------------------------------------------------------------------

def test_the_section_is_the_switch_and_stays_valid_for_deepspeed():
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    off = deepspeed_config(TrainSettings(), OffloadSettings())
    on = deepspeed_config(TrainSettings(activation_checkpointing=True), OffloadSettings())
    assert CHECKPOINTING_SECTION not in off and not activation_checkpointing(off)
    assert on[CHECKPOINTING_SECTION] == CHECKPOINTING_CONTENTS and activation_checkpointing(on)
    ds = DeepSpeedActivationCheckpointingConfig(on)
    assert (ds.partition_activations, ds.contiguous_memory_optimization, ds.cpu_checkpointing) == (False,) * 3
    assert activation_checkpointing({CHECKPOINTING_SECTION: {}})  # present is on, whatever it holds
    with pytest.raises(ConfigError, match="must be an object"):
        activation_checkpointing({CHECKPOINTING_SECTION: True})
    # the train --activation-checkpointing override: adds the section, keeps a user's own
    assert activation_checkpointing(with_activation_checkpointing(off)) and CHECKPOINTING_SECTION not in off
    own = {CHECKPOINTING_SECTION: {"partition_activations": True}}
    assert with_activation_checkpointing(own) == own


# --- the models -------------------------------------------------------------------------------------------------

def _block_calls_and_grads(model: torch.nn.Module, blocks, batch) -> tuple[int, float, list[torch.Tensor]]:
    calls = []
    handles = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in blocks]
    loss = model(**batch)
    loss.backward()
    for h in handles:
        h.remove()
    return len(calls), float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_presets_recompute_every_block_with_the_same_gradients(name):
    spec = resolve_model(name)
    batch = spec.batch(2, SEQ, torch.Generator().manual_seed(0), "cpu")
    torch.manual_seed(0)
    plain = spec.build()
    torch.manual_seed(0)
    ckpt = spec.build(checkpointing=True)
    n, loss, grads = _block_calls_and_grads(plain, plain.blocks, batch)
    n_ck, loss_ck, grads_ck = _block_calls_and_grads(ckpt, ckpt.blocks, batch)
    layers = len(plain.blocks)
    assert (n, n_ck) == (layers, 2 * layers)  # each block's forward once more, in backward
    assert loss_ck == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_ck))
    calls = []
    for b in ckpt.blocks:
        b.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():  # nothing to recompute without autograd: the blocks run once, plainly
        assert ckpt(**batch) == plain(**batch)
    assert len(calls) == layers


def _write_factory(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "ckfactory.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.lin = nn.Linear(4, 4)\n        self.got = None\n"
        "    def forward(self, x):\n        return self.lin(x).sum()\n"
        f"{body}\n"
        "def factory():\n    return M(), lambda mb, seq, gen, dev: {'x': torch.ones(mb, 4)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "ckfactory", raising=False)
    return "ckfactory:factory"


@pytest.mark.parametrize("body,got", [
    ("    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):\n"
     "        self.got = gradient_checkpointing_kwargs\n", {"use_reentrant": False}),
    ("    def gradient_checkpointing_enable(self):\n        self.got = 'called'\n", "called"),
    # transformers' current name wins over its deprecated alias
    ("    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):\n        self.got = 'old'\n"
     "    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):\n"
     "        self.got = activation_checkpointing_kwargs\n", {"use_reentrant": False}),
])
def test_factory_modules_are_switched_through_their_own_method(tmp_path, monkeypatch, body, got):
    spec = resolve_model(_write_factory(tmp_path, monkeypatch, body))
    assert spec.build().got is None
    assert spec.build(checkpointing=True).got == got


def test_factory_without_the_method_is_refused_in_one_line():
    spec = resolve_model("examples.custom_model:factory")
    spec.build()  # fine without checkpointing
    with pytest.raises(DostuneError, match="needs the model to offer gradient_checkpointing_enable") as e:
        spec.build(checkpointing=True)
    assert "\n" not in str(e.value) and "use_reentrant=False" in e.value.hint


def _hf_llama() -> ModelSpec:
    pytest.importorskip("transformers")
    return resolve_model(f"hf:{Path(__file__).parent / 'data' / 'tiny-llama.json'}")


def test_hf_models_recompute_every_layer_with_the_same_gradients():
    spec = _hf_llama()
    batch = spec.batch(2, SEQ, torch.Generator().manual_seed(0), "cpu")
    torch.manual_seed(0)
    plain = spec.build()
    torch.manual_seed(0)
    ckpt = spec.build(checkpointing=True)
    # counted on each layer's attention: transformers checkpoints inside the layer's own __call__
    n, loss, grads = _block_calls_and_grads(plain, [x.self_attn for x in plain.inner.model.layers], batch)
    n_ck, loss_ck, grads_ck = _block_calls_and_grads(ckpt, [x.self_attn for x in ckpt.inner.model.layers], batch)
    assert (n, n_ck) == (2, 4)
    assert loss_ck == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_ck))


# --- parity under DeepSpeed ZeRO-3 offload ----------------------------------------------------------------------

def _run(spec: ModelSpec, checkpointing: bool, schedule=None, steps: int = STEPS, zero: dict = RELEASE_ALL,
         seams=None) -> dict:
    """Train ``steps`` seeded steps under ZeRO-3 with the optimizer offloaded (dostune's when ``schedule``), while
    watching the first block's first weight: whether it was released between forward and backward, and whether
    it was gathered whenever its module's forward ran (again, in backward, when checkpointed)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dostune.train.engine import build_engine, master_weights, train_steps

    train = base_settings(precision="bf16", activation_checkpointing=checkpointing)
    cfg = deepspeed_config(train, OffloadSettings(sub_group_size=SUB_GROUP_SIZE, pin_memory=False, schedule=schedule,
                                                  extra_zero=zero))
    engine = build_engine(spec, cfg, seed=0, use_dostune=schedule is not None, seams=seams)
    first = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
    phase, seen, released = ["fwd"], [], []
    # the top-level forward runs only in forward; a recompute re-runs blocks alone
    engine.module.register_forward_pre_hook(lambda *_: phase.__setitem__(0, "fwd"))
    # registered after ZeRO-3's own pre-forward hook, so it sees what that hook gathered
    first.register_forward_pre_hook(lambda m, _: seen.append(
        (phase[0], m.weight.ds_status == ZeroParamStatus.AVAILABLE and m.weight.numel() == m.weight.ds_numel)))

    def before_backward(step, loss):
        released.append(first.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        phase[0] = "bwd"
        return loss

    losses = train_steps(engine, spec, steps, seq=SEQ, seed=1, before_backward=before_backward)
    out = {"losses": losses, "weights": master_weights(engine), "seen": seen, "released": released,
           "type": type(engine.optimizer).__name__, "subgroups": len(engine.optimizer.fp16_groups),
           "overlap": getattr(engine.optimizer, "dostune_overlap_stats", None)}
    engine.destroy()
    return out


def _assert_same_training(ours: dict, ref: dict) -> None:
    assert ours["subgroups"] == ref["subgroups"] >= 4
    assert ours["losses"] == ref["losses"], "losses differ step for step"
    assert torch.equal(ours["weights"], ref["weights"]), \
        f"fp32 master weights differ by {rel_diff(ours['weights'], ref['weights']):.3e} relative"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_checkpointed_training_equals_plain_deepspeed_step_for_step(name):
    spec = resolve_model(name)
    ref = _run(spec, checkpointing=False)
    assert ref["type"] == "DeepSpeedZeroOptimizer_Stage3"
    assert ref["seen"] == [("fwd", True)] * STEPS and all(ref["released"])
    plain = _run(spec, checkpointing=True)
    assert plain["type"] == "DeepSpeedZeroOptimizer_Stage3"
    # released after forward, gathered again for the recompute in backward
    assert all(plain["released"]) and plain["seen"] == [("fwd", True), ("bwd", True)] * STEPS
    _assert_same_training(plain, ref)
    # every update during backward speculates (and is recomputed in the step where clipping triggers)
    ours = _run(spec, checkpointing=True, schedule=OVERLAP, zero=PREFETCHED, seams=NO_CUTOFF)
    assert ours["type"] == "InterleavedZeroOptimizer"
    assert ours["seen"] == [("fwd", True), ("bwd", True)] * STEPS
    _assert_same_training(ours, ref)
    st = ours["overlap"]  # the CPU lane updated its subgroups during the checkpointed backward
    assert st["speculative"] == st["committed"] == STEPS * 2


@pytest.mark.slow
def test_hf_model_checkpointed_under_zero3_equals_plain():
    spec = _hf_llama()
    ref, ours = _run(spec, checkpointing=False, steps=4), _run(spec, checkpointing=True, steps=4)
    assert ours["seen"].count(("bwd", True)) == 4 and all(ours["released"])
    _assert_same_training(ours, ref)


# --- the CLI reaches the model builder --------------------------------------------------------------------------

class _Stop(DostuneError):
    pass


@pytest.fixture
def built_with(monkeypatch):
    """Each ModelSpec.build's checkpointing flag; the build then stops the command (nothing is trained). The
    build on the meta device that sizes the subgroups before any engine goes through; bench's methods run in this
    process (they have processes of their own otherwise, which the patch would not reach)."""
    from dostune.bench import run as bench_run

    flags = []
    real = ModelSpec.build

    def build(self, checkpointing=False):
        if torch.empty(0).device.type == "meta":
            return real(self, checkpointing)
        flags.append(checkpointing)
        raise _Stop("stopped by the test after the model was asked for")

    monkeypatch.setattr(ModelSpec, "build", build)
    monkeypatch.setattr(bench_run, "run_method", bench_run.run_method_here)
    return flags


def _config(tmp_path, name, **train_kw):
    cfg = deepspeed_config(TrainSettings(micro_batch=2, **train_kw),
                           OffloadSettings(sub_group_size=SUB_GROUP_SIZE, pin_memory=False,
                                           schedule=ScheduleConfig(gpu_fraction=0.5)))
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_flags_reach_the_model_builder(tmp_path, built_with):
    runner = CliRunner()
    plain, with_section = _config(tmp_path, "plain.json"), _config(tmp_path, "ck.json", activation_checkpointing=True)
    train = ["train", "--model", "gpt2-tiny", "--seq", "16", "--steps", "1", "--metrics", str(tmp_path / "m.jsonl")]
    bench = ["bench", "--model", "gpt2-tiny", "--seq", "16", "--methods", "dostune",
             "--output", str(tmp_path / "b.json")]
    profile = ["profile", "--model", "gpt2-tiny", "--seq", "16", "--output", str(tmp_path / "p.json")]
    cases = [(train + ["--config", plain], False), (train + ["--config", plain, "--activation-checkpointing"], True),
             (train + ["--config", with_section], True),
             (bench, False), (bench + ["--activation-checkpointing"], True), (bench + ["--config", with_section], True),
             (profile, False), (profile + ["--activation-checkpointing"], True)]
    for args, want in cases:
        r = runner.invoke(app, args)
        # a bench method that fails is a row of the result (exit 0); the other commands stop (exit 2)
        assert r.exit_code == (0 if args[0] == "bench" else 2) and "stopped by the test" in r.output, (args, r.output)
        assert built_with.pop() is want, args


def test_cli_tune_emits_the_section(tmp_path):
    r = CliRunner().invoke(app, ["tune", "--trials", "3", "--output-dir", str(tmp_path), "--activation-checkpointing"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "ds_config.json").read_text())
    assert cfg[CHECKPOINTING_SECTION] == CHECKPOINTING_CONTENTS and "dostune" in cfg


# --- GPU: the memory it frees -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_checkpointing_frees_activation_memory_on_the_gpu():
    """What a forward leaves allocated for backward: every block's saved tensors without checkpointing, only each
    block's input with it. A GPT-2 block saves well over 8 hidden-sized tensors (norm inputs, qkv, attention
    output, MLP input and activations), so at least 6 per block beyond the kept input must be freed; the peak of
    a whole step must fall too."""
    from dostune.models.registry import loss_of
    from dostune.train.engine import build_engine, free_engine_memory

    spec, mb, seq = resolve_model("gpt2-small-test"), 8, 256
    cfg_of = spec.config
    held, peak, first_loss = {}, {}, {}
    for ck in (False, True):
        train = TrainSettings(micro_batch=mb, precision="bf16", activation_checkpointing=ck)
        engine = build_engine(spec, deepspeed_config(train, OffloadSettings()), seed=0, use_dostune=False)
        batch = spec.batch(mb, seq, torch.Generator().manual_seed(1), engine.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = loss_of(engine(**batch))
        torch.cuda.synchronize()
        held[ck] = torch.cuda.memory_allocated() - before
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        peak[ck] = torch.cuda.max_memory_allocated() - before
        first_loss[ck] = float(loss.detach())
        engine.destroy()
        del engine, loss
        free_engine_memory()
    hidden_tensor = mb * seq * cfg_of["hidden"] * 2  # bf16 bytes
    assert held[False] - held[True] >= 6 * cfg_of["layers"] * hidden_tensor, (held, hidden_tensor)
    assert peak[True] < peak[False], peak
    assert first_loss[True] == first_loss[False]  # the same forward arithmetic before any update
