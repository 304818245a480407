"""Which form of a bench method the host's memory holds, decided before anything is built."""
import pytest

import torch

from dostune.host_memory import fit_host_memory
from dostune.dsconfig import OffloadSettings
from dostune.errors import DostuneError
from dostune.models.decoder import DecoderConfig, DecoderLM
from dostune.models.registry import resolve_model
from dostune.optim.schedule import ScheduleConfig
from dostune.perfmodel.subgroups import param_numels

GiB = 2**30
# two decoders of 6.2-6.3B parameters whose pinned ZeRO-Offload state comes near a 125 GiB host's memory
LLAMA_6_2B = DecoderConfig("llama", layers=34, hidden=4096, heads=32, vocab=32000, max_positions=4096, ffn=10880,
                           kv_heads=8)
GPT2_6_3B = DecoderConfig("gpt2", layers=40, hidden=3584, heads=28, vocab=50304, max_positions=1024)


def _numels(cfg: DecoderConfig) -> list[int]:
    with torch.device("meta"):  # sizes only: no memory, no init
        return [p.numel() for p in DecoderLM(cfg).parameters()]


def test_llama_7b_on_a_125_gib_host_runs_zero_offload_without_pinning_and_dostune_as_tuned():
    # measured on the H100 host (125 GiB): ZeRO-Offload with pin_memory was killed by the OOM killer at its first
    # step, without it peaked at 115.0 GiB; dostune at 114.7 GiB
    numels = param_numels(resolve_model("llama-7b"))
    zo, note = fit_host_memory("zero-offload", OffloadSettings(sub_group_size=100_000_000), numels, "bf16", 124 * GiB)
    assert not zo.pin_memory and note.startswith("pin_memory false: pinned it needs about 134 GiB")
    dos = OffloadSettings(sub_group_size=100_000_000, pin_memory=False, schedule=ScheduleConfig(gpu_fraction=0.25))
    assert fit_host_memory("dostune", dos, numels, "bf16", 124 * GiB) == (dos, "")
    # the CPU lane during backward keeps shadow states of ~5e9 parameters (56 GiB), though it holds no fp32 gradients
    # for them (it reads the half-precision ones): 154 GiB, more than the host has
    with pytest.raises(DostuneError, match="not run: its optimizer state needs about 15[0-9].[0-9] GiB"):
        fit_host_memory("dostune", dos.__class__(**{**dos.__dict__, "schedule": ScheduleConfig(
            gpu_fraction=0.25, overlap_backward=True)}), numels, "bf16", 124 * GiB)
    with pytest.raises(DostuneError, match=r"not run: .*115.0 GiB of host memory \(134.3 pinned\), 100.0 GiB"):
        fit_host_memory("zero-offload", OffloadSettings(sub_group_size=100_000_000), numels, "bf16", 100 * GiB)


def test_pinned_buffers_that_would_leave_the_host_no_room_are_not_pinned():
    # measured on an H200 host (125 GiB): the model profile's ZeRO-Offload of LLAMA_6_2B, its pinned buffers estimated
    # at 122.7 GiB, filled the host and was killed by the OOM killer; GPT2_6_3B's (120.0 GiB) had run
    for cfg, pinned in ((LLAMA_6_2B, "123"), (GPT2_6_3B, "120")):
        numels = _numels(cfg)
        zo, note = fit_host_memory("zero-offload", OffloadSettings(sub_group_size=100_000_000), numels, "bf16",
                                   124 * GiB)
        assert not zo.pin_memory
        assert note == (f"pin_memory false: pinned it needs about {pinned} GiB of host memory, 124 GiB are "
                        "available, of which it may take 95%")
    # what needs more than 95% of the available memory is not started at all: GPT2_6_3B unpinned, 108.5 GiB of 110
    with pytest.raises(DostuneError, match=r"needs about 108.5 GiB .*\(120.0 pinned\), 110.0 GiB are available, of "
                                           r"which it may take 95%"):
        fit_host_memory("zero-offload", OffloadSettings(sub_group_size=100_000_000), numels, "bf16", 110 * GiB)


def test_a_host_with_room_keeps_every_method_as_it_is():
    numels = param_numels(resolve_model("gpt2-1.3b"))
    for off in (OffloadSettings(), OffloadSettings(ratio=0.5), OffloadSettings(ratio=0.0)):
        assert fit_host_memory("m", off, numels, "bf16", 124 * GiB) == (off, "")
    assert fit_host_memory("zero-offload", OffloadSettings(), numels, "bf16", None) == (OffloadSettings(), "")


def test_twin_flow_is_fitted_on_the_subgroups_it_offloads():
    # measured on the H100 host (125 GiB): Twin-Flow at dostune's memory (ratio 0.978) with pin_memory was killed by
    # the OOM killer in its iterations; it keeps one of 50 subgroups on the GPU
    numels = param_numels(resolve_model("llama-7b"))
    twin, note = fit_host_memory("twin-flow-mem", OffloadSettings(sub_group_size=100_000_000, ratio=0.978), numels,
                                 "bf16", 124 * GiB)
    assert not twin.pin_memory and twin.ratio == 0.978 and note.startswith("pin_memory false: pinned it needs about 13")
    # half on the GPU: half the state on the host, pinned
    half = OffloadSettings(sub_group_size=100_000_000, ratio=0.5)
    assert fit_host_memory("twin-flow-0.5", half, numels, "bf16", 124 * GiB) == (half, "")
