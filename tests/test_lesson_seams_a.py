"""The seams and timelines lessons 01b, 02 and 04 run the learner's code through: ddp's mean_loss
(the debugging lab's fix inside a strategy), zero2's bucket hooks and their overlap timeline, and
zero3's unit timeline re-timed on a cluster (projection.fsdp_timeline)."""

import pytest
import torch
import torch.distributed as dist

from minitrain import TrainConfig, train
from minitrain.planning.analysis import OTHER_COMPUTE, hidden_fraction, merge_intervals
from minitrain.parallel.zero import reduce_scatter_when_full, wait_for_shards
from minitrain.planning.projection import MODEL_SIZES, fsdp_timeline, project

CFG = TrainConfig(steps=4, batch_size=12, seed=0)


@pytest.fixture(scope="module")
def single(clusters):
    return train(CFG, cluster=clusters(1))


def mean_loss(loss):
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def mean_loss_over_4(loss):  # the lab's 4 ranks written in
    dist.all_reduce(loss)
    return loss / 4


def test_ddp_reports_the_mean_loss_through_its_seam(clusters, single):
    run = train(CFG.with_(strategy="ddp", world_size=3), cluster=clusters(3),
                seams={"mean_loss": mean_loss})
    assert run.losses == pytest.approx(single.losses, rel=1e-5)
    wrong = train(CFG.with_(strategy="ddp", world_size=3), cluster=clusters(3),
                  seams={"mean_loss": mean_loss_over_4})
    assert wrong.losses == pytest.approx([v * 3 / 4 for v in single.losses], rel=1e-5)


def test_zero2_with_the_hooks_trains_like_one_process_and_keeps_a_shard(clusters, single):
    cfg = CFG.with_(strategy="zero2", world_size=2, options={"bucket_mb": 0.05, "timeline": True})
    run = train(cfg, cluster=clusters(2),
                seams={"zero2_hooks": (reduce_scatter_when_full, wait_for_shards)})
    assert run.losses == pytest.approx(single.losses, rel=1e-5)
    rep = run.summary.report[0]
    psi = run.summary.params
    assert run.summary.memory[0]["bytes"]["gradients"] == pytest.approx(4 * psi / 2, rel=1e-3)
    buckets = len(rep["bucket_bytes"])
    assert buckets > 1 and all(len(step["buckets"]) == buckets for step in rep["timeline"])
    for step in rep["timeline"]:  # every reduce-scatter launched during backward, completed later
        assert all(step["backward_start"] <= b["start"] <= step["backward_end"] + 1e-3
                   and b["start"] <= b["end"] for b in step["buckets"])
    assert all(0 <= o <= 1 for o in rep["overlap"])
    sent = run.summary.comm[0]["reduce_scatter"]["sent_bytes"] / cfg.steps
    assert sent == pytest.approx((2 - 1) / 2 * 4 * psi, rel=0.01)


def test_a_zero3_timeline_is_redrawn_on_the_cluster(clusters):
    run = train(CFG.with_(strategy="zero3", world_size=2, precision="fp32",
                          options={"timeline": True}), cluster=clusters(2), record_events=True)
    reports = run.summary.report
    assert len(reports[0]["timeline"]) == CFG.steps and len(reports[0]["hidden"]) == CFG.steps
    p = project(run, "dgx-h100", "7b")
    drawn = fsdp_timeline(run, p)
    measured = reports[0]["timeline"][p.step]
    assert [(e["unit"], e["kind"]) for e in sorted(measured, key=lambda e: e["start"])] == \
        [(e["unit"], e["kind"]) for e in drawn[0] if e["unit"] != OTHER_COMPUTE]
    # the drawn step computes what the replay computes: its units' spans and the rest
    for rank, tl in enumerate(drawn):
        replayed = merge_intervals((e["start"], e["end"]) for e in p.timeline[rank]
                                   if e["op"] == "compute")
        shown = merge_intervals((e["start"], e["end"]) for e in tl if e["kind"] == "compute")
        assert sum(b - a for a, b in shown) == pytest.approx(sum(b - a for a, b in replayed),
                                                             rel=1e-6)
    gathers = [e for e in drawn[0] if e["kind"] == "gather"]
    assert gathers and all(0 <= e["start"] <= e["end"] <= p.step_time_s * (1 + 1e-9)
                           for e in gathers)
    # a gather carries its unit at the 7B size: it takes the replay's time for those bytes
    comm = [e for e in p.timeline[0] if e.get("tag") == "params-unit0"]
    assert gathers[0]["end"] - gathers[0]["start"] >= comm[0]["end"] - comm[0]["start"] - 1e-12
    assert 0 <= hidden_fraction(drawn[0]) <= 1
    assert MODEL_SIZES["7b"].num_params() == p.params
