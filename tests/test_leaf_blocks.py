"""Transformer blocks as ZeRO-3 leaf modules (dostune/leaf_blocks.py): which class is flagged, that every engine
dostune builds flags it, and that it changes no value DeepSpeed's own offload computes."""
import pytest
import torch
from torch import nn

import dostune
from dostune.leaf_blocks import block_class, mark_leaf_blocks
from dostune.models.decoder import Block
from dostune.models.registry import resolve_model
from parity_helpers import base_settings, run, tiny_engine


def test_the_blocks_are_the_modules_of_the_longest_list_of_one_class():
    model = resolve_model("gpt2-tiny").build()
    assert block_class(model) is Block

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)])  # longest, one class
            self.stages = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # two classes
            self.acts = nn.ModuleList([nn.ReLU() for _ in range(5)])  # no parameters

    assert block_class(Mixed()) is nn.Linear
    assert block_class(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) is None  # not a ModuleList
    assert mark_leaf_blocks(nn.Linear(2, 2)) is None


def test_marking_flags_every_block_once_and_keeps_an_authors_own_flags():
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules

    model = resolve_model("gpt2-small-test").build()
    assert dostune.mark_leaf_blocks(model) is Block
    flagged = get_z3_leaf_modules(model)
    assert len(flagged) == 4 and all(isinstance(m, Block) for m in flagged)
    assert mark_leaf_blocks(model) is None and get_z3_leaf_modules(model) == flagged

    own = resolve_model("gpt2-small-test").build()
    set_z3_leaf_modules(own, [nn.LayerNorm])
    assert mark_leaf_blocks(own) is None
    assert not any(isinstance(m, Block) for m in get_z3_leaf_modules(own))


def test_every_engine_dostune_builds_has_its_blocks_as_leaves():
    from deepspeed.utils import get_z3_leaf_modules

    _, engine = tiny_engine(base_settings(), None)
    try:
        flagged = get_z3_leaf_modules(engine.module)
        assert len(flagged) == 2 and all(isinstance(m, Block) for m in flagged)
    finally:
        engine.destroy()


@pytest.mark.slow
def test_leaf_blocks_change_no_value_of_deepspeeds_own_offload(monkeypatch):
    """The same seeded training with every submodule hooked as DeepSpeed does by default: the same losses and the
    same master weights, bit for bit."""
    train = base_settings()
    leaves = run(train, None, steps=8)
    monkeypatch.setattr("dostune.train.engine.mark_leaf_blocks", lambda model: None)
    hooked = run(train, None, steps=8)
    assert leaves["losses"] == hooked["losses"]
    assert torch.equal(leaves["weights"], hooked["weights"])


def test_initialize_and_the_trainer_callback_flag_the_users_model_before_deepspeed_hooks_it():
    from types import SimpleNamespace

    from deepspeed.utils import get_z3_leaf_modules

    from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
    from dostune.optim.schedule import ScheduleConfig
    from dostune.train.engine import ensure_distributed

    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(
        sub_group_size=20_000, pin_memory=False, schedule=ScheduleConfig(gpu_fraction=0.5)))
    model = resolve_model("gpt2-tiny").build()
    ensure_distributed()
    engine, *_ = dostune.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    try:
        assert type(engine.optimizer).__name__ == "InterleavedZeroOptimizer"
        assert [type(m) for m in get_z3_leaf_modules(engine.module)] == [Block, Block]
    finally:
        engine.destroy()

    args = SimpleNamespace(deepspeed_plugin=None, hf_deepspeed_config=SimpleNamespace(config=cfg))
    model = resolve_model("gpt2-tiny").build()
    dostune.HFTrainerCallback().on_init_end(args, None, "control", model=model)
    assert [type(m) for m in get_z3_leaf_modules(model)] == [Block, Block]
