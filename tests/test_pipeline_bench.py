"""Smoke test of benchmarks/pipeline_bench.py: on 2 ranks, one step of each schedule, ours and
torch.distributed.pipelining both give the single-process loss and record a timeline of every action."""

import pytest
import torch

from conftest import benchmark_module

pytest.importorskip("torch.distributed.pipelining")
#: before 2.6 a PipelineStage must be given example inputs and runs stage 0 on uninitialised token
#: ids to infer the shapes (IndexError in the embedding): the reference needs torch >= 2.6
REFERENCE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("pipeline_bench") as module:
        yield module


@pytest.mark.skipif(not REFERENCE, reason="torch.distributed.pipelining needs torch >= 2.6 here")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_both_pipelines_equal_one_process(bench, clusters, schedule):
    M, batch = 4, 8
    res = clusters(2).run(bench.step_times, "nano", schedule, M, batch, 1, ["minitrain", "torch"], 1)
    ref = bench.single_losses("nano", batch, 2)
    for kind in ("minitrain", "torch"):
        losses = res[-1][kind]["losses"]  # the last stage has the loss (ours: every rank)
        assert losses == pytest.approx(ref, rel=1e-5), kind
        timeline = [e for r in res for e in r[kind]["timelines"][0]]
        assert sorted(e["action"][0] for e in timeline) == ["B"] * 2 * M + ["F"] * 2 * M, kind
        assert 0 <= bench.bubble_fraction(timeline, 2) < 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_the_replay_of_an_ideal_timeline_is_itself(bench, schedule):
    """Replaying a timeline with instant messages changes nothing when nothing waited for one:
    the ideal (simulated) table's bubble is every part of the breakdown."""
    from minitrain.parallel.schedules import make_schedule, simulate

    ideal = simulate(make_schedule(schedule, 3, 6))
    parts = bench.bubble_parts(ideal, 3)
    assert parts["replay"] == pytest.approx(parts["measured"])
    assert parts["unsent"] == pytest.approx(parts["measured"])
    assert parts["even"] == pytest.approx(parts["measured"])
    # a message that arrives late shows as communication: stage 1's first forward (and so all
    # that follows it) starts half a unit late
    late = [dict(e) for e in ideal]
    t = next(e["start"] for e in ideal if str(e["action"]) == "F0@s1")
    for e in late:
        if e["start"] >= t:
            e["start"], e["end"] = e["start"] + 0.5, e["end"] + 0.5
    assert bench.bubble_parts(late, 3)["measured"] > bench.bubble_parts(late, 3)["replay"]
