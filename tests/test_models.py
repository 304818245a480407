import pytest
import torch

from dostune.errors import DostuneError
from dostune.models.decoder import count_parameters
from dostune.models.registry import CI_PRESETS, PRESETS, resolve_model

SHAPES_BY_NAME = {**PRESETS, **CI_PRESETS}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gpt2-small-test"])
def test_small_presets_build_with_the_analytic_count(name):
    spec = resolve_model(name)
    model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == spec.num_params == count_parameters(SHAPES_BY_NAME[name])
    batch = spec.batch(2, 16, torch.Generator().manual_seed(0), "cpu")
    loss = model(**batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # random init: close to uniform over the vocabulary
    assert abs(loss.item() - torch.log(torch.tensor(float(SHAPES_BY_NAME[name].vocab))).item()) < 1.0


@pytest.mark.parametrize("name", ["gpt2-125m", "gpt2-1.3b", "llama-7b"])
def test_large_presets_match_the_analytic_count_on_meta(name):
    with torch.device("meta"):
        model = resolve_model(name).build()
    assert sum(p.numel() for p in model.parameters()) == count_parameters(PRESETS[name])


def test_reference_shapes():
    assert count_parameters(PRESETS["gpt2-1.3b"]) == 1_313_722_368  # 1.31B, the reference runs' shape
    assert 2.6e9 < count_parameters(PRESETS["gpt2-2.7b"]) < 2.7e9
    assert 3.4e9 < count_parameters(PRESETS["llama-3b"]) < 3.45e9
    assert 6.5e9 < count_parameters(PRESETS["llama-7b"]) < 6.8e9
    assert 12.8e9 < count_parameters(PRESETS["llama-13b"]) < 13.2e9
    assert 0.12e9 < count_parameters(PRESETS["gpt2-125m"]) < 0.13e9


def test_factory_loader_accepts_the_example():
    spec = resolve_model("examples.custom_model:factory")
    model = spec.build()
    loss = model(**spec.batch(2, 8, torch.Generator().manual_seed(0), "cpu"))
    assert loss.dim() == 0


@pytest.mark.parametrize("bad,msg", [
    ("gpt3-175b", "unknown model"),
    ("no_such_module_xyz:factory", "cannot import module"),
    ("examples.custom_model:nope", "has no callable 'nope'"),
    (":factory", "expected a preset name"),
    ("hf:/does/not/exist.json", "transformers|not found"),
])
def test_factory_loader_rejects_bad_specs(bad, msg):
    with pytest.raises(DostuneError, match=msg):
        resolve_model(bad)


def test_factory_must_return_a_pair(tmp_path, monkeypatch):
    (tmp_path / "badfactory.py").write_text("def make():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = resolve_model("badfactory:make")
    with pytest.raises(DostuneError, match=r"must return \(nn.Module, batch_fn\)"):
        spec.build()
