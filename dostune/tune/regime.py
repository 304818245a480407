"""Which regime `dostune tune` scores schedules in (perfmodel/lanes.py): whether the training's steps clip their
gradients. overlap_backward's speculation holds only where they do not, so the same schedule runs its iteration
slower where they do, and the best schedule of one regime need not be the best of the other.

``--regime`` takes ``measured`` (the default: the model profile's timed iterations' gradient norms against the
emitted config's ``--clip``), ``clip``, ``no-clip`` or ``both`` (each schedule scored by the worse of its two
predictions: the schedule with the best worst case).
"""
from __future__ import annotations

from typing import Literal, Optional

from ..errors import DostuneError
from ..perfmodel.lanes import Regime
from ..profile.model_record import clipped_count

#: what --regime takes, and what each scores the schedules by
CHOICES = {"measured": None, "clip": "clip", "no-clip": "no_clip", "both": "both"}
Scoring = Literal["no_clip", "clip", "both"]
#: how the summary and the notes name each
NAMES = {"no_clip": "no clipping", "clip": "clipping", "both": "the worse of clipping and no clipping"}


def check_regime(asked: str, clip: float) -> None:
    """Refuse a --regime that is not one, and one that scores clipping for a config that never clips."""
    if asked not in CHOICES:
        raise DostuneError(f"--regime must be one of {', '.join(CHOICES)}, got {asked!r}")
    if clip == 0 and asked in ("clip", "both"):
        raise DostuneError(f"--regime {asked} scores schedules for steps that clip, but --clip 0 turns clipping off",
                           hint="pass the --clip the training uses, or leave --regime out")


def regime_at(norms: list[Optional[float]], clip: float) -> Optional[Regime]:
    """The regime of a training that clips at ``clip`` (0: off), by gradient norms measured on the model: clip where
    more than half of them are over it; None where no norm is known."""
    if clip == 0:
        return "no_clip"
    counted = clipped_count(norms, clip)
    if counted is None:
        return None
    clipped, of = counted
    return "clip" if 2 * clipped > of else "no_clip"


def scoring(asked: str, clip: float, norms: Optional[list[Optional[float]]]) -> tuple[Scoring, str, Optional[str]]:
    """(what the search scores, why, a note for the user or None) for --regime ``asked``; ``norms``: the model
    profile's timed iterations' gradient norms (None without a model profile)."""
    check_regime(asked, clip)
    if asked != "measured":
        return CHOICES[asked], f"--regime {asked}", None
    if norms is None:
        # without a model profile no schedule overlaps backward (the search lacks backward's timing): the two
        # regimes predict alike
        return "no_clip", "no model profile to measure the gradient norm on", None
    if clip == 0:
        return "no_clip", "--clip 0: the training never clips", None
    regime = regime_at(norms, clip)
    if regime is None:
        return "both", "the model profile recorded no gradient norm", (
            "the model profile recorded no gradient norm (an older dostune measured it), so whether the training "
            f"clips at --clip {clip:g} is unknown: each schedule is scored by the worse of its two predictions; "
            "profile the model again with this dostune, or pass --regime clip or no-clip")
    clipped, of = clipped_count(norms, clip)
    why = (f"measured: {clipped} of the model profile's {of} timed iterations had a gradient norm over --clip "
           f"{clip:g}")
    if regime == "clip":
        return "clip", why, (
            f"{why} (a freshly initialised model's): tuned for steps that clip, where overlap_backward's CPU lane "
            "works in the step; to train from pretrained weights whose gradient norm stays under the threshold, tune "
            "with --regime no-clip (or both)")
    return "no_clip", why, None
