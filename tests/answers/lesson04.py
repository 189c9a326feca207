"""Lesson 04: ZeRO-1's step and ZeRO-3's hook — the solutions and typical wrong answers."""

import torch

from answers import Answers

# --------------------------------------------------------------------------------------------------
# zero1_step(flat_params, flat_grads, shard, optimizer, comm)
# --------------------------------------------------------------------------------------------------


def zero1_step(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads)
    shard.grad = grad / comm.size
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_without_dividing(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads)
    shard.grad = grad
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_arguments_swapped(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(flat_grads, grad)
    shard.grad = grad / comm.size
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_own_slice(flat_params, flat_grads, shard, optimizer, comm):
    size, r = shard.numel(), comm.rank
    shard.grad = flat_grads[r * size:(r + 1) * size].clone()
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_all_reduce(flat_params, flat_grads, shard, optimizer, comm):
    size, r = shard.numel(), comm.rank
    comm.all_reduce(flat_grads)
    shard.grad = flat_grads[r * size:(r + 1) * size] / comm.size
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_without_gather(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads)
    shard.grad = grad / comm.size
    optimizer.step()


def zero1_gather_before_step(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads)
    shard.grad = grad / comm.size
    comm.all_gather(flat_params, shard.detach().clone())
    optimizer.step()


def zero1_without_stepping(flat_params, flat_grads, shard, optimizer, comm):
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads)
    shard.grad = grad / comm.size
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_all_reduce_behind_the_tracer(flat_params, flat_grads, shard, optimizer, comm):
    """All-reduces through torch.distributed directly (the tracer never sees it), then slices."""
    import torch.distributed as dist
    size, r = shard.numel(), comm.rank
    dist.all_reduce(flat_grads, group=comm.group)
    shard.grad = flat_grads[r * size:(r + 1) * size] / comm.size
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


def zero1_reduce_scatter_behind_the_tracer(flat_params, flat_grads, shard, optimizer, comm):
    """Right values, but the reduce-scatter bypasses comm: its bytes are never counted."""
    import torch.distributed as dist
    grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(grad, flat_grads, group=comm.group)
    shard.grad = grad / comm.size
    optimizer.step()
    comm.all_gather(flat_params, shard.detach().clone())


# --------------------------------------------------------------------------------------------------
# zero3_hook(unit, comm, moment)
# --------------------------------------------------------------------------------------------------


def zero3_hook(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_never_free(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    elif moment == "after backward":
        comm.reduce_scatter(unit.grad_shard, unit.grad)


def zero3_no_gather_for_backward(unit, comm, moment):
    if moment == "before forward":
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    elif moment.startswith("after"):
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_free_when_backward_starts(unit, comm, moment):
    """Forward is over when backward starts: free then (too early: backward needs the weights)."""
    if moment == "before forward":
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    elif moment == "before backward":
        unit.free()
    elif moment == "after backward":
        comm.reduce_scatter(unit.grad_shard, unit.grad)


def zero3_allocate_only_for_backward(unit, comm, moment):
    """The memory comes back, so the values must be there too (they are not)."""
    if moment == "before forward":
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    elif moment == "before backward":
        unit.allocate()
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_into_a_new_tensor(unit, comm, moment):
    if moment.startswith("before"):
        full = torch.empty(unit.shard.numel() * comm.size, dtype=unit.shard.dtype)
        comm.all_gather(full, unit.shard)
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_own_shard_only(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        size = unit.shard.numel()
        unit.full[comm.rank * size:(comm.rank + 1) * size] = unit.shard
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_reversed_order(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        gathered = torch.empty(unit.shard.numel() * comm.size, dtype=unit.shard.dtype)
        comm.all_gather(gathered, unit.shard)
        pieces = list(gathered.chunk(comm.size))[::-1]
        unit.full.copy_(torch.cat(pieces))
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_without_reduce_scatter(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    else:
        if moment == "after backward":
            size = unit.grad_shard.numel()
            unit.grad_shard.copy_(unit.grad[comm.rank * size:(comm.rank + 1) * size])
        unit.free()


def zero3_reduce_after_forward_too(unit, comm, moment):
    if moment.startswith("before"):
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    else:
        comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_only_rank_0_gathers(unit, comm, moment):
    """A collective called by one rank: the others never answer (a deadlock, diagnosed)."""
    if moment.startswith("before"):
        unit.allocate()
        if comm.rank == 0:
            comm.all_gather(unit.full, unit.shard)
    else:
        if moment == "after backward":
            comm.reduce_scatter(unit.grad_shard, unit.grad)
        unit.free()


def zero3_all_reduce_behind_the_tracer(unit, comm, moment):
    """After backward: a direct torch.distributed all-reduce of the gradient, then one's slice."""
    import torch.distributed as dist
    if moment.startswith("before"):
        unit.allocate()
        comm.all_gather(unit.full, unit.shard)
    else:
        if moment == "after backward":
            total = unit.grad.clone()
            dist.all_reduce(total, group=comm.group)
            size = unit.grad_shard.numel()
            unit.grad_shard.copy_(total[comm.rank * size:(comm.rank + 1) * size])
        unit.free()


# --------------------------------------------------------------------------------------------------
# zero2_hooks = (grad_ready(bucket, i, grad, comm), end_of_backward(buckets))
# --------------------------------------------------------------------------------------------------


def z2_grad_ready(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def z2_end_of_backward(buckets):
    for bucket in buckets:
        bucket.work.wait()


def z2_all_reduce_then_slice(bucket, i, grad, comm):
    """All-reduces the whole bucket directly through torch.distributed, then (at the end)
    keeps its slice: right values, twice the bytes, and the tracer never sees them."""
    import torch.distributed as dist
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)


def z2_end_taking_the_slice(buckets):
    for bucket in buckets:
        bucket.work.wait()
        size = bucket.grad_shard.numel()
        rank = __import__("torch.distributed").distributed.get_rank()
        bucket.grad_shard.copy_(bucket.buffer[rank * size:(rank + 1) * size])


def z2_no_divide(bucket, i, grad, comm):
    bucket.views[i].copy_(grad)
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def z2_fill_only(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.comm = comm


def z2_launch_at_the_end(buckets):
    for bucket in buckets:
        bucket.work = bucket.comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)
    for bucket in buckets:
        bucket.work.wait()


def z2_never_waits(buckets):
    """Returns at once: the optimizer may read a shard that has not arrived."""


def z2_only_rank_0_scatters(bucket, i, grad, comm):
    """Only rank 0 launches the reduce-scatter: it waits for partners that never call."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views) and comm.rank == 0:
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def z2_end_of_backward_if_launched(buckets):
    for bucket in buckets:
        if getattr(bucket, "work", None) is not None:
            bucket.work.wait()


def z2_end_dividing_again(buckets):
    """Waits, then divides each shard by N once more (grad_ready already did).  gloo copies a
    reduce-scatter's result into the output at every wait() of torch's handle: a second wait
    anywhere would put the right shard back on CPUs, and not on GPUs."""
    n = torch.distributed.get_world_size()
    for bucket in buckets:
        bucket.work.wait()
        bucket.grad_shard.div_(n)


def z2_on_the_last_view(bucket, i, grad, comm):
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    if i == len(bucket.views) - 1:
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def z2_arguments_swapped(bucket, i, grad, comm):
    """reduce_scatter(input, output): the whole bucket passed as the output, the shard as input."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.reduce_scatter(bucket.buffer, bucket.grad_shard, async_op=True)


def z2_filled_undivided(bucket, i, grad, comm):
    bucket.views[i].copy_(grad)
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def z2_divides_before_the_wait(buckets):
    """Divides each shard by N, then waits: the sum has not arrived when it divides."""
    n = __import__("torch.distributed").distributed.get_world_size()
    for bucket in buckets:
        bucket.grad_shard.div_(n)
        bucket.work.wait()


def z2_drops_the_handle(bucket, i, grad, comm):
    """Launches the reduce-scatter but keeps no handle in bucket.work."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


ANSWERS = {
    "zero1_step": Answers(zero1_step, [
        (zero1_without_dividing, "divide by N"),
        (zero1_own_slice, "with its own gradient only"),
        (zero1_all_reduce, "half an all-reduce's 2(N−1)/N"),
        (zero1_without_gather, "own shard is right but element"),
        (zero1_gather_before_step, "ran before the optimizer stepped"),
        (zero1_without_stepping, "flat_params did not change"),
        (zero1_all_reduce_behind_the_tracer, "directly through torch.distributed (the tracer never saw it)"),
        (zero1_reduce_scatter_behind_the_tracer, "called torch.distributed's reduce_scatter_tensor directly"),
        (zero1_arguments_swapped, "got an output of 38 elements and an input of 19: the output is "
                                  "N = 2 times the input, so the two arguments look swapped"),
    ]),
    "zero2_hooks": Answers((z2_grad_ready, z2_end_of_backward), [
        ((z2_all_reduce_then_slice, z2_end_taking_the_slice), "each bucket needs one reduce-scatter, not an all-reduce"),
        ((z2_no_divide, z2_end_of_backward), "N = 2 times the mean"),
        ((z2_fill_only, z2_launch_at_the_end), "nothing overlapped: all 7 reduce-scatters started after backward ended"),
        ((z2_grad_ready, z2_never_waits), "reduce-scatter was launched but never waited for"),
        ((z2_on_the_last_view, z2_end_of_backward), "do not wait for one particular view"),
        ((z2_grad_ready, z2_end_dividing_again), "divided by N = 2 once more"),
        ((z2_only_rank_0_scatters, z2_end_of_backward_if_launched),
         "(line 4 of your z2_end_of_backward_if_launched: bucket.work.wait())"),
        ((z2_arguments_swapped, z2_end_of_backward),
         "got an output of 4608 elements and an input of 2304: the output is N = 2 times the "
         "input, so the two arguments look swapped — the output (first) is this rank's 1/N "
         "shard, bucket.grad_shard; the input (second) the whole tensor, bucket.buffer"),
        ((z2_filled_undivided, z2_divides_before_the_wait),
         "bucket.grad_shard was divided by N = 2 (div_) while the bucket's reduce-scatter was "
         "still in flight (after the launch, before bucket.work.wait())"),
        ((z2_drops_the_handle, z2_end_of_backward),
         "reduce-scatter was launched in grad_ready, but its handle was not kept in bucket.work"),
    ]),
    "zero3_hook": Answers(zero3_hook, [
        (zero3_never_free, "held"),
        (zero3_no_gather_for_backward, "does not gather them again at 'before backward'"),
        (zero3_free_when_backward_starts, "before its backward used them"),
        (zero3_allocate_only_for_backward, "memory that was freed keeps nothing"),
        (zero3_into_a_new_tensor, "gather into it, not into another tensor"),
        (zero3_own_shard_only, "only rank 0's own shard is in unit.full"),
        (zero3_reversed_order, "in the wrong order"),
        (zero3_without_reduce_scatter, "holds only rank"),
        (zero3_reduce_after_forward_too, "exist only at 'after backward'"),
        (zero3_only_rank_0_gathers, "(line 6 of your zero3_only_rank_0_gathers: comm.all_gather(unit.full, unit.shard))"),
        (zero3_all_reduce_behind_the_tracer, "directly through torch.distributed (the tracer never saw it)"),
    ]),
}
