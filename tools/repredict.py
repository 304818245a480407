"""Validations re-predicted by the performance model as it is now: every row a `dostune tune --validate` measured,
beside the prediction today's model makes from the same two profiles.

A validation records the predictions of the model of its day. Whether a change to the model helps shows on the rows
already measured: re-predicted, they say how today's model would have done, while the measurements stay what they
were. Rows of a shape the model was changed for are not unseen any more; only a validation run with the model as it
was then is a check on shapes it has not seen.

The profiles are found as `tune` recorded them or, where those paths are gone (a validation measured on another
machine and committed), beside the tune.json: ``MODEL-profile.json`` beside ``MODEL.json``, and of the ``node*.json``
there the one created last before the tune (each machine profiled itself before it tuned, so that is the file the
tune read; a model profile may be older than that node profile).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dostune.errors import ProfileError
from dostune.optim.schedule import REMOVED_KEYS, ScheduleConfig
from dostune.tune.record import TuneResult, Validation
from dostune.tune.search import TuneOptions, build_space, predicted_times, zero_offload_times
from tools.validation_report import load


def _created(path: Path) -> str:
    return json.loads(path.read_text()).get("created") or ""


def profiles_of(result: TuneResult, path: Path) -> tuple[Path, Path]:
    """(node profile, model profile) of the validation in ``path``."""
    node, model = Path(result.node_profile), Path(result.model_profile) if result.model_profile else None
    if node.is_file() and model is not None and model.is_file():
        return node, model
    model = path.with_name(f"{path.stem}-profile.json")
    if not model.is_file():
        raise ProfileError(f"{path}: its model profile is neither at {result.model_profile} nor at {model}")
    nodes = sorted((when, p) for p in path.parent.glob("node*.json") if (when := _created(p)) <= result.created)
    if not nodes:
        raise ProfileError(f"{path}: no node profile beside it created before the tune")
    return nodes[-1][1], model


def prediction_space(result: TuneResult, node: Path, model_profile: Path) -> tuple:
    """What `tune` builds from ``node`` and ``model_profile`` for ``result``'s model (search.build_space): the
    search space first, whose ``predict_schedule`` predicts a validated row."""
    return build_space(TuneOptions(model=result.model, profile=node, model_profile=model_profile,
                                   micro_batch=result.micro_batch, precision=result.precision))


def validated_schedule(v: Validation) -> ScheduleConfig:
    # a schedule key that has since been removed was off in every validated schedule (its default)
    return ScheduleConfig.model_validate({k: x for k, x in (v.schedule or {}).items() if k not in REMOVED_KEYS})


def repredict(result: TuneResult, node: Path, model_profile: Path) -> TuneResult:
    """``result`` with every validated row's predictions (and ZeRO-Offload's) made again by today's model from
    ``node`` and ``model_profile``; the measurements as they were."""
    space, *_, inputs = prediction_space(result, node, model_profile)
    zero_offload = zero_offload_times(space.zero_offload(), inputs)
    rows = []
    for v in result.validation:
        if v.method == "zero-offload":
            p = zero_offload
        else:
            p = predicted_times(space.predict_schedule(v.sub_group_size, validated_schedule(v)))
        rows.append(v.model_copy(update=dict(predicted_fwd_s=p.fwd_s, predicted_bwd_s=p.bwd_s,
                                             predicted_step_s=p.step_s, predicted_iter_s=p.iter_s,
                                             predicted_peak_gpu_gib=p.peak_gpu_gib)))
    return result.model_copy(update={"validation": rows, "ds_offload": zero_offload})


def repredict_file(path: "str | Path", result: Optional[TuneResult] = None) -> TuneResult:
    path = Path(path)
    result = result or load(path)
    return repredict(result, *profiles_of(result, path))
