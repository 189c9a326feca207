"""Lesson 02: naive DP's gradient sync, and DDP's two bucket hooks — solutions and typical mistakes."""

import torch
import torch.distributed as dist

from answers import Answers


# -- sync_gradients(model, comm) ---------------------------------------------------------------------

def sync_right(model, comm):
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= comm.size


def sync_summed(model, comm):
    """Forgets to divide by N: every rank holds the sum."""
    for p in model.parameters():
        comm.all_reduce(p.grad)


def sync_first_only(model, comm):
    """Averages the first parameter only (a return inside the loop)."""
    for p in model.parameters():
        comm.all_reduce(p.grad)
        p.grad /= comm.size
        return


def sync_rank_0_only(model, comm):
    """Only rank 0 all-reduces: it waits for partners that never call (a deadlock)."""
    for p in model.parameters():
        if comm.rank == 0:
            comm.all_reduce(p.grad)
        p.grad /= comm.size


def sync_local(model, comm):
    """Divides by N but never communicates."""
    for p in model.parameters():
        p.grad /= comm.size


# -- bucket_hooks = (grad_ready(bucket, i, grad, comm), end_of_backward(buckets)) ---------------------

def grad_ready(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def end_of_backward(buckets):
    for bucket in buckets:
        bucket.work.wait()


def grad_ready_no_divide(bucket, i, grad, comm):
    bucket.views[i].copy_(grad)
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def grad_ready_fill_only(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])


def end_of_backward_launch_then_wait(buckets):
    """All the all-reduces after backward: right values, nothing overlapped."""
    for bucket in buckets:
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)  # not through comm either
    for bucket in buckets:
        bucket.work.wait()


def grad_ready_keeps_comm(bucket, i, grad, comm):
    """Fills, and keeps the comm for the end of backward (launching there)."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.out = comm


def end_of_backward_launches(buckets):
    for bucket in buckets:
        bucket.work = bucket.out.all_reduce(bucket.buffer, async_op=True)
    for bucket in buckets:
        bucket.work.wait()


def end_of_backward_no_wait(buckets):
    """Forgets the wait: the optimizer may read a half-summed buffer."""


def grad_ready_too_early(bucket, i, grad, comm):
    """Launches as soon as the first gradient is in."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == 1:
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def grad_ready_never(bucket, i, grad, comm):
    """Off by one: the bucket is never 'full'."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views) + 1:
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def grad_ready_blocking(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer)


def grad_ready_waits(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)
        bucket.work.wait()


def grad_ready_own_counter(bucket, i, grad, comm):
    """Counts arrivals in an attribute of its own, never reset: right once, never again."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.arrived = getattr(bucket, "arrived", 0) + 1
    if bucket.arrived == len(bucket.views):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def grad_ready_only_rank_0_launches(bucket, i, grad, comm):
    """Only rank 0 launches the all-reduce: it waits for partners that never call (a deadlock)."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views) and comm.rank == 0:
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def end_of_backward_if_launched(buckets):
    for bucket in buckets:
        if getattr(bucket, "work", None) is not None:
            bucket.work.wait()


def grad_ready_on_the_last_view(bucket, i, grad, comm):
    """Launches when the bucket's last view arrives, assuming views arrive in order."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    if i == len(bucket.views) - 1:
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def sync_divides_before_the_wait(model, comm):
    """Starts each all-reduce asynchronously and divides before its sum has arrived."""
    for p in model.parameters():
        work = comm.all_reduce(p.grad, async_op=True)
        p.grad /= comm.size
        work.wait()


def grad_ready_drops_the_handle(bucket, i, grad, comm):
    """Launches the all-reduce but keeps no handle: bucket.work stays None."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        comm.all_reduce(bucket.buffer, async_op=True)


def grad_ready_own_handle(bucket, i, grad, comm):
    """Keeps the handle, in an attribute of its own instead of bucket.work."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.handle = comm.all_reduce(bucket.buffer, async_op=True)


def end_of_backward_own_handle(buckets):
    for bucket in buckets:
        bucket.handle.wait()


def end_of_backward_divides_before_the_wait(buckets):
    n = dist.get_world_size()
    for bucket in buckets:
        bucket.buffer /= n
        bucket.work.wait()


def end_of_backward_waits_then_clears(buckets):
    """Right: waits for every handle, then lets it go."""
    for bucket in buckets:
        bucket.work.wait()
        bucket.work = None


ANSWERS = {
    "sync_gradients": Answers(sync_right, [
        (sync_summed, "divide by comm.size"),
        (sync_first_only, "differs from the full batch's gradient"),
        (sync_local, "no all_reduce went through comm"),
        (sync_rank_0_only, "(line 5 of your sync_rank_0_only: comm.all_reduce(p.grad))"),
        (sync_divides_before_the_wait,
         "embed.tok.weight.grad was divided by N = 2 (div_) while its all-reduce was still "
         "in flight"),
    ]),
    "bucket_hooks": Answers((grad_ready, end_of_backward), [
        ((grad_ready_no_divide, end_of_backward), "the gradients are N = 2 times the mean"),
        ((grad_ready_keeps_comm, end_of_backward_launches),
         "nothing overlapped: all 7 all-reduces started after backward ended"),
        ((grad_ready, end_of_backward_no_wait), "launched but never waited for"),
        ((grad_ready_too_early, end_of_backward), "started when only 1 of its"),
        ((grad_ready_never, end_of_backward), "buckets were never launched"),
        ((grad_ready_blocking, end_of_backward), "was blocking"),
        ((grad_ready_waits, end_of_backward), "waited for during backward"),
        ((grad_ready_fill_only, end_of_backward_launch_then_wait), "did not go through comm"),
        ((grad_ready_own_counter, end_of_backward), "state of your own carries over"),
        ((grad_ready_on_the_last_view, end_of_backward), "do not wait for one particular view"),
        ((grad_ready_only_rank_0_launches, end_of_backward_if_launched),
         "rank 0 waits in a handle's wait() (the collective or message it waits for never "
         "completed) (line 4 of your end_of_backward_if_launched: bucket.work.wait())"),
        ((grad_ready_drops_the_handle, end_of_backward),
         "bucket 0's all-reduce was launched in grad_ready, but its handle was not kept in "
         "bucket.work"),
        ((grad_ready_drops_the_handle, end_of_backward_if_launched),
         "its handle was not kept in bucket.work (None when end_of_backward started), so nobody "
         "can wait for it"),
        ((grad_ready_own_handle, end_of_backward_own_handle),
         "its handle was not kept in bucket.work"),
        ((grad_ready_no_divide, end_of_backward_divides_before_the_wait),
         "bucket.buffer was divided by N = 2 (div_) while the bucket's all-reduce was still "
         "in flight"),
    ]),
}


#: right answers other than the solution, which must pass too
ALSO_RIGHT = {"bucket_hooks": [(grad_ready, end_of_backward_waits_then_clears)]}
