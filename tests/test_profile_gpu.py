"""The profiles' schema-3 measurements on a GPU, at tiny sizes (marked gpu; on a GPU machine run them with
scripts/gpu-tests.sh): what the performance model's coefficients come from (docs/performance-model.md)."""
import pytest

pytestmark = pytest.mark.gpu


def test_pageable_device_to_host_copies_are_measured():
    from dostune.profile.copies import measure_copies

    c = measure_copies([1 << 20, 4 << 20], repeats=2)
    assert [p.size for p in c.d2h_pageable.points] == [1 << 20, 4 << 20]
    assert c.d2h_pageable.fit.rate_per_s > 1e8  # anything slower than 0.1 GB/s is a broken measurement
    assert all(p.seconds.median > 0 for p in c.d2h_pageable.points)


def test_model_profile_measures_backward_alone_and_beside_the_lane_on_the_gpu():
    from dostune.perfmodel.coefficients import Coefficients
    from dostune.perfmodel.inputs import ModelInputs, NodeInputs
    from dostune.profile.identity import gpu_info, node_name
    from dostune.profile.model import MODEL_EFFORT, ModelProfileOptions, measure_model
    from dostune.profile.paths import shipped_profile
    from dostune.profile.record import load_node_profile

    prof = measure_model(ModelProfileOptions(model="gpt2-tiny", micro_batch=2, seq=32, sub_group_size=20_000,
                                             reduce_bucket_size=3_000, iters=2, warmup=1, lane_elements=1_000_000,
                                             probe_seconds=1.0),
                         command="pytest")
    assert prof.device == "cuda" and prof.offload_pin_memory is True
    # the standard mode's counts, and the node named as the node profile names it by default
    assert prof.mode == "standard" and prof.node == node_name(gpu_info(0))
    assert prof.backward_no_copy_s.median > 0
    # dropping the copies leaves less to do than ZeRO-Offload's backward with them
    assert prof.backward_no_copy_s.median < 1.5 * prof.phases["bwd"].time_s.median
    lane = prof.backward_lane
    assert lane is not None and lane.lane_beside_s.n >= 1 and lane.backward_s.median > 0
    # page-locked copies of every gradient partition: the model's bytes, a backward that ran
    copied = prof.backward_pinned_copy
    assert copied is not None and copied.bytes == 2 * sum(s.numel for s in prof.subgroups)
    # schema 8: the probes ran round after round for a second, each round with its page-locked pass
    rounds = prof.probe_rounds
    assert len(rounds) > 2 and copied.backward_s.n == len(rounds) and copied.backward_s.median > 0
    assert all(r.pinned_copy_s > 0 and r.beside_lane_s > 0 for r in rounds)
    # schema 10: the step's lane from memory, alone and beside copies both ways that really streamed
    step = prof.step_lane
    assert step is not None and step.subgroups >= 2 and step.elements == 1_000_000
    rounds_of_step_lane = MODEL_EFFORT["standard"].step_lane_rounds
    assert step.alone_s.n == step.subgroups * rounds_of_step_lane and step.beside_copies_s.n >= rounds_of_step_lane
    assert step.h2d_gbps > 1 and step.d2h_gbps > 1 and step.copies_slowdown > 0.5
    assert prof.ds_cpu_adam is not None and len(prof.ds_cpu_adam.points) == len(prof.subgroups)
    assert prof.step_parts_s["_partition_all_parameters"] > 0
    # schema 11: the step's second window is --thorough's (the standard mode leaves it out)
    assert prof.later_window is None
    m = ModelInputs.from_profile(prof)
    c = Coefficients.of(NodeInputs.from_profile(load_node_profile(shipped_profile())), m,
                        [s.numel for s in prof.subgroups])
    assert not [n for n in c.notes if "re-profile the model" in n]
    assert c.backward.slowdown >= 1.0 and 0 < c.shape.release_share <= c.shape.prologue_share <= 1
    assert c.shape.lane_step_contention is not None


def test_queued_copies_stream_both_ways_and_the_contention_probe_reads_them():
    import math

    import torch

    from dostune.profile.copy_load import QUEUE_GBPS, DuplexCopies
    from dostune.profile.throughput import measure_contention

    chunk = 8 << 20
    copies = DuplexCopies(torch.device("cuda", 0), chunk, host_chunks=3)
    queued = copies.queue(0.005)
    h2d, d2h = queued.chunk_ends()
    # sized for three times the work at the queue's rate, each direction's chunks back to back from the start
    assert len(h2d) == len(d2h) == max(4, math.ceil(3 * 0.005 * QUEUE_GBPS * 1e9 / chunk))
    for ends in (h2d, d2h):
        assert all(b > a for a, b in zip(ends, ends[1:])) and ends[0] > 0
        assert len(ends) * chunk / ends[-1] > 1e9  # slower than 1 GB/s is a broken measurement
    c = measure_contention(1_000_000, 2, repeats=2, chunk_bytes=chunk)
    assert c.with_dma_s.n == 2 and c.dma_gbps_during > 1 and c.gpus == 1


def test_tune_takes_this_nodes_profile_from_profiles_by_default(tmp_path, monkeypatch):
    """On a GPU machine `dostune tune` without --profile reads profiles/NODE.json, the file `dostune profile` writes
    there by default, and says which; before it exists, one line says how to make it."""
    from typer.testing import CliRunner

    from dostune.cli.app import app
    from dostune.profile.identity import gpu_info, node_name

    monkeypatch.chdir(tmp_path)
    # no model profile here: the GPU memory budget given, as the hint says
    tune = ["tune", "--model", "gpt2-1.3b", "--trials", "2", "--output-dir", "tuned", "--gpu-memory-budget", "10"]
    r = CliRunner().invoke(app, tune)
    assert r.exit_code == 2 and "dostune profile" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(app, ["profile", "--quick"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, tune + ["--verbose"])  # --verbose names the profiles read
    assert r.exit_code == 0, r.output
    assert f"node profile: profiles/{node_name(gpu_info(0))}.json" in " ".join(r.output.split())
