"""The data-parallel family's seams: each filled from outside by a reference function (the
lesson's exercise as its solution in tests/answers/, or the package's own step written out) runs
inside the real strategy and trains exactly as the package's own code does."""

import pytest

from answers.lesson02 import end_of_backward, grad_ready
from answers.lesson03 import topk_ef as topk_error_feedback
from answers.lesson04 import zero1_step, zero3_hook
from minitrain import GPT, TrainConfig, train
from minitrain.comm import ring_all_reduce

CFG = TrainConfig(steps=4, batch_size=12, seed=0, world_size=2)


def sync_gradients(model, comm):
    """Naive DP's average, in the package's order (divide, then sum)."""
    for p in model.parameters():
        p.grad /= comm.size
        comm.all_reduce(p.grad)


CASES = [
    ("ddp", {}, "ring_all_reduce", ring_all_reduce),
    ("ddp", {"bucket_mb": 0.2}, "bucket_hooks", (grad_ready, end_of_backward)),
    ("ddp", {"bucket_mb": 0.2, "compress": "int8"}, "bucket_hooks", (grad_ready, end_of_backward)),
    ("ddp", {"compress": "topk:0.1"}, "topk_error_feedback", topk_error_feedback),
    ("ddp", {"compress": "topk:0.1", "error_feedback": False}, "topk_error_feedback",
     topk_error_feedback),
    ("ddp-naive", {}, "sync_gradients", sync_gradients),
    ("zero1", {}, "zero1_step", zero1_step),
    ("zero3", {}, "zero3_hook", zero3_hook),
]


@pytest.mark.parametrize("strategy, options, seam, fn", CASES,
                         ids=[f"{c[0]}-{c[2]}-{len(c[1])}" for c in CASES])
def test_a_seam_filled_from_outside_trains_like_the_package(clusters, strategy, options, seam, fn):
    cfg = CFG.with_(strategy=strategy, options=options)
    own = train(cfg, cluster=clusters(2))
    theirs = train(cfg, cluster=clusters(2), seams={seam: fn})
    assert theirs.losses == own.losses


def test_the_top_k_seam_in_the_parameter_server(clusters):
    cfg = CFG.with_(strategy="ps-sync", world_size=3, options={"compress": "topk:0.1"})
    own = train(cfg, cluster=clusters(3))
    theirs = train(cfg, cluster=clusters(3), seams={"topk_error_feedback": topk_error_feedback})
    assert theirs.losses == own.losses


def test_a_seam_is_really_called(clusters):
    """A wrong function in the seam changes the run: the seam is not ignored."""
    def no_sync(model, comm):
        pass

    cfg = CFG.with_(strategy="ddp-naive")
    own = train(cfg, cluster=clusters(2))
    broken = train(cfg, cluster=clusters(2), seams={"sync_gradients": no_sync})
    assert broken.losses[0] == own.losses[0] and broken.losses[1:] != own.losses[1:]


def test_zero3_gathered_peak_is_one_unit_blocking_two_with_prefetch_all_when_never_freed(clusters):
    """The ledger's ``gathered_peak``: the largest unit with a blocking hook, two units with the
    package's prefetch, the whole model with a hook that never frees."""
    def keep_all(unit, comm, moment):
        if moment.startswith("before"):
            unit.allocate()
            comm.all_gather(unit.full, unit.shard)
        elif moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)

    cfg = CFG.with_(strategy="zero3", steps=2)
    peaks = {name: train(cfg, cluster=clusters(2), seams=seams).summary.memory[0]["gathered_peak"]
             for name, seams in (("package", None), ("blocking", {"zero3_hook": zero3_hook}),
                                 ("never freed", {"zero3_hook": keep_all}))}
    block = 4 * sum(p.numel() for p in GPT(CFG.model).blocks[0].parameters())  # fp32, N=2: no padding
    assert peaks["blocking"] == block
    assert peaks["package"] == 2 * block
    assert peaks["never freed"] == 4 * GPT(CFG.model).num_params()


def test_a_hook_with_the_packages_code_prefetches_too(clusters):
    """Prefetch is what the package's hook does with ``unit.ahead``, not a favour the wrapper grants
    the package's function: the same code under another name gathers ahead alike (peak: two units)
    and trains alike."""
    from minitrain.parallel.fsdp_unit import zero3_hook as package_hook

    def same_code(unit, comm, moment):
        return package_hook(unit, comm, moment)

    cfg = CFG.with_(strategy="zero3", steps=2)
    own = train(cfg, cluster=clusters(2))
    theirs = train(cfg, cluster=clusters(2), seams={"zero3_hook": same_code})
    block = 4 * sum(p.numel() for p in GPT(CFG.model).blocks[0].parameters())
    peak = lambda run: run.summary.memory[0]["gathered_peak"]  # noqa: E731
    assert theirs.losses == own.losses
    assert peak(theirs) == peak(own) == 2 * block
