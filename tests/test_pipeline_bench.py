"""Smoke test of benchmarks/pipeline_bench.py: on 2 ranks, one step of each schedule, ours and
torch.distributed.pipelining both give the single-process loss and record a timeline of every action."""

import pytest

from conftest import benchmark_module

pytest.importorskip("torch.distributed.pipelining")


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("pipeline_bench") as module:
        yield module


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
