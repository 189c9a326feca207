"""The data-parallel family's seams: each filled from outside by a reference function (the
lesson's exercise, or the package's own step written out) runs inside the real strategy and
trains exactly as the package's own code does."""

import pytest
import torch

from minitrain import TrainConfig, train
from minitrain.comm import ring_all_reduce

CFG = TrainConfig(steps=4, batch_size=12, seed=0, world_size=2)


def sync_gradients(model, comm):
    """Naive DP's average, in the package's order (divide, then sum)."""
    for p in model.parameters():
        p.grad /= comm.size
        comm.all_reduce(p.grad)


def grad_ready(bucket, i, grad, comm):
    """The lesson-02 exercise's solution: fill the bucket, launch its all-reduce once full."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def end_of_backward(buckets):
    for bucket in buckets:
        bucket.work.wait()


def topk_error_feedback(grad, residual, k):
    """The lesson-03 exercise's solution."""
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    values = corrected[indices]
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return indices, values, new_residual


def zero1_step(flat_params, flat_grads, shard, optimizer, comm):
    """The lesson-04 exercise's solution."""
    size, r = flat_params.numel() // comm.size, comm.rank
    shard.grad = flat_grads[r * size:(r + 1) * size].clone()
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero3_gather(full, shard, comm):
    comm.all_gather(full, shard)


CASES = [
    ("ddp", {}, "ring_all_reduce", ring_all_reduce),
    ("ddp", {"bucket_mb": 0.2}, "bucket_hooks", (grad_ready, end_of_backward)),
    ("ddp", {"bucket_mb": 0.2, "compress": "int8"}, "bucket_hooks", (grad_ready, end_of_backward)),
    ("ddp", {"compress": "topk:0.1"}, "topk_error_feedback", topk_error_feedback),
    ("ddp", {"compress": "topk:0.1", "error_feedback": False}, "topk_error_feedback",
     topk_error_feedback),
    ("ddp-naive", {}, "sync_gradients", sync_gradients),
    ("zero1", {}, "zero1_step", zero1_step),
    ("zero3", {}, "zero3_gather", zero3_gather),
]


@pytest.mark.parametrize("strategy, options, seam, fn", CASES,
                         ids=[f"{c[0]}-{c[2]}-{len(c[1])}" for c in CASES])
def test_a_seam_filled_from_outside_trains_like_the_package(clusters, strategy, options, seam, fn):
    cfg = CFG.with_(strategy=strategy, options=options)
    own = train(cfg, cluster=clusters(2))
    theirs = train(cfg, cluster=clusters(2), seams={seam: fn})
    assert theirs["losses"] == own["losses"]


def test_the_top_k_seam_in_the_parameter_server(clusters):
    cfg = CFG.with_(strategy="ps-sync", world_size=3, options={"compress": "topk:0.1"})
    own = train(cfg, cluster=clusters(3))
    theirs = train(cfg, cluster=clusters(3), seams={"topk_error_feedback": topk_error_feedback})
    assert theirs["losses"] == own["losses"]


def test_a_seam_is_really_called(clusters):
    """A wrong function in the seam changes the run: the seam is not ignored."""
    def no_sync(model, comm):
        pass

    cfg = CFG.with_(strategy="ddp-naive")
    own = train(cfg, cluster=clusters(2))
    broken = train(cfg, cluster=clusters(2), seams={"sync_gradients": no_sync})
    assert broken["losses"][0] == own["losses"][0] and broken["losses"][1:] != own["losses"][1:]
