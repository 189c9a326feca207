"""What wraps a learner's function before it goes into its seam (minitrain.course.exercises.guards): a
looser function made to fit the seam's one shape, and what would crash a rank or corrupt a run
turned into an error that says what happened.  No ranks needed: the guards are plain wrappers."""

import pytest
import torch

from minitrain.course.exercises.guards import (GUARDS, GuardedUnit, ReturnsTheTensor, TopkAsTensors,
                                        WatchedWork, plug)
from minitrain.parallel.flat import FlatUnit, Slot


def test_a_ring_that_sums_in_place_and_returns_nothing_returns_the_tensor():
    def in_place(tensor, comm):
        tensor.mul_(2)

    def returns_new(tensor, comm):
        return tensor * 3

    t = torch.ones(3)
    assert ReturnsTheTensor(in_place)(t, None) is t and t.tolist() == [2, 2, 2]
    assert ReturnsTheTensor(returns_new)(torch.ones(2), None).tolist() == [3, 3]


def test_a_top_k_that_returns_lists_gives_tensors():
    def as_lists(grad, residual, k):
        return [0, 2], [1.0, 3.0], (grad + residual).tolist()

    idx, values, rest = TopkAsTensors(as_lists)(torch.ones(3), torch.zeros(3), 2)
    assert all(torch.is_tensor(t) for t in (idx, values, rest)) and idx.tolist() == [0, 2]


class _Unit:
    """The parts of minitrain.parallel.fsdp_unit.Unit a guard reads."""

    def __init__(self):
        self.name, self.full, self.gathered, self.shard = "blocks.0", torch.zeros(4), False, None

    def allocate(self):
        self.gathered = True


def test_a_freed_unit_full_raises_and_cannot_be_replaced():
    unit = _Unit()
    guarded = GuardedUnit(unit)
    with pytest.raises(RuntimeError, match="has no memory now .*unit.allocate"):
        guarded.full
    with pytest.raises(AttributeError, match="unit.full cannot be replaced"):
        guarded.full = torch.zeros(4)
    guarded.allocate()
    assert guarded.full is unit.full
    guarded.shard = torch.ones(2)  # anything else reaches the unit itself
    assert unit.shard.tolist() == [1, 1]


def _buckets(n=2):
    return [Slot(k, FlatUnit([torch.zeros(2)])) for k in range(n)]


class _Work:
    def wait(self):
        return True


def test_bucket_hooks_that_never_launch_or_never_wait_are_named():
    def launch(bucket, i, grad, comm):
        bucket.work = _Work()

    def skip(bucket, i, grad, comm):
        pass

    def wait_all(buckets):
        for b in buckets:
            b.work.wait()

    def wait_none(buckets):
        pass

    for grad_ready, end, message in [(skip, wait_none, "bucket 0's all-reduce was never launched"),
                                     (launch, wait_none, "bucket 0's all-reduce was launched but "
                                                         "not waited for")]:
        grad_ready, end = plug("bucket_hooks", (grad_ready, end))
        buckets = _buckets()
        for b in buckets:
            grad_ready(b, 0, torch.zeros(2), None)
        with pytest.raises(RuntimeError, match=message):
            end(buckets)
    grad_ready, end = plug("bucket_hooks", (launch, wait_all))
    buckets = _buckets()
    for b in buckets:
        grad_ready(b, 0, torch.zeros(2), None)
    assert all(isinstance(b.work, WatchedWork) for b in buckets)
    end(buckets)  # launched and waited: no error
    assert all(b.work.waited for b in buckets)


def test_a_bucket_launched_without_keeping_its_handle_is_named_as_such():
    """A grad_ready that starts the collective through its comm (which notes ``launched_at``) but
    leaves bucket.work None is told the handle was not kept, not that nothing was launched; an
    end_of_backward that waits for every handle and then lets it go passes."""
    class _Comm:
        launched_at = None

        def all_reduce(self, tensor, async_op=False):
            self.launched_at = 1.0
            return _Work()

    def drop(bucket, i, grad, comm):
        comm.all_reduce(bucket.buffer, async_op=True)

    def keep(bucket, i, grad, comm):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)

    def wait_and_clear(buckets):
        for b in buckets:
            b.work.wait()
            b.work = None

    grad_ready, end = plug("bucket_hooks", (drop, lambda buckets: None))
    buckets = _buckets()
    for b in buckets:
        grad_ready(b, 0, torch.zeros(2), _Comm())
    with pytest.raises(RuntimeError, match="bucket 0's all-reduce was launched during backward, "
                                           "but its handle was not kept in bucket.work"):
        end(buckets)
    grad_ready, end = plug("bucket_hooks", (keep, wait_and_clear))
    buckets = _buckets()
    for b in buckets:
        grad_ready(b, 0, torch.zeros(2), _Comm())
    end(buckets)  # every handle waited for, then let go: no error


def test_zero2_hooks_are_guarded_as_reduce_scatters_and_mean_loss_is_quiet(capsys):
    grad_ready, end = plug("zero2_hooks", (lambda b, i, g, c: None, lambda buckets: None))
    buckets = _buckets()
    with pytest.raises(RuntimeError, match="reduce-scatter was never launched"):
        end(buckets)
    mean = plug("mean_loss", lambda loss: print("noise") or loss / 2)
    assert mean(torch.tensor([3.0])) == 1.5 and capsys.readouterr().out == ""
    with pytest.raises(TypeError, match="returned None"):
        plug("mean_loss", lambda loss: None)(torch.tensor([1.0]))


def test_dist_calls_sees_what_goes_past_the_tracer(clusters):
    def on_rank():
        import torch.distributed as dist
        from minitrain.comm import Comm
        from minitrain.course.exercises.guards import bypassed, dist_calls
        comm = Comm()
        with dist_calls() as calls:
            comm.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(5))
        direct = bypassed(calls)
        return [(c.op, c.numel, c.direct) for c in calls], [(c.op, c.numel) for c in direct]
    seen, direct = clusters(2).run(on_rank)[0]
    assert seen == [("all_reduce", 3, False), ("all_reduce", 5, True)] and direct == [("all_reduce", 5)]


def test_the_other_seams_go_in_as_they_are():
    def fn(*args):
        return args

    assert set(GUARDS) == {"ring_all_reduce", "topk_error_feedback", "zero3_hook", "bucket_hooks",
                           "zero2_hooks", "mean_loss"}
    for seam in ("zero1_step", "stage_step", "mesh_groups", "sync_gradients", "one_f_one_b"):
        assert plug(seam, fn) is fn
