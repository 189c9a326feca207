"""Data parallelism from scratch: naive DP, and DDP with gradient buckets overlapped with backward.

Lesson 02.  Paper: Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training" (VLDB) — buckets, overlap, ``no_sync``.  Every rank holds a full replica and a
slice of the batch; after backward the gradients are averaged, so every replica takes the step one
process would take on the whole batch.  :class:`NaiveDataParallel` all-reduces each gradient after
backward (:func:`average_gradients`); :class:`DistributedDataParallel` packs them into buckets
(:mod:`.flat`) whose all-reduces start from autograd hooks (:class:`BucketHooks`) while backward goes
on.  Both wrap a module as PyTorch's do.
"""

from __future__ import annotations

import typing
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn

from ..comm import Comm
from .compression import as_error_feedback, compressed_all_reduce
from .flat import Done, FlatUnit, Slot, bucket_caps, copy_into_bucket, make_buckets
from ..device import now

__all__ = ["NaiveDataParallel", "DistributedDataParallel", "BucketHooks", "BucketComm",
           "average_gradients", "launch_when_full", "wait_for_buckets", "broadcast_module",
           "mean_over_ranks", "comm_for"]


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (replicas start identical)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(t.data, src=src, tag="init")


def comm_for(comm: Comm | None, process_group) -> Comm:
    """The communicator a wrapper was given: ``comm=``, or one over ``process_group=`` (default:
    the whole world)."""
    if comm is not None and process_group is not None:
        raise ValueError("pass either comm= or process_group=, not both")
    return comm if comm is not None else Comm(process_group)


def mean_over_ranks(loss: torch.Tensor, comm: Comm) -> float:
    """Mean of the ranks' losses (untraced: a metric, not training traffic)."""
    t = loss.detach().clone()
    comm.untraced.all_reduce(t)
    return t.item() / comm.size


@torch.no_grad()
def average_gradients(model: nn.Module, comm: Comm) -> None:
    """Naive DP's gradient average (the package's ``sync``; lesson 02's warm-up exercise writes
    it): divide each gradient by N, all-reduce the sum."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad.div_(comm.size)
            comm.all_reduce(p.grad, tag="grad")


class NaiveDataParallel(nn.Module):
    """Replicas kept equal by one all-reduce per gradient, after backward (call ``sync_gradients``).

    ``sync_gradients``: ``sync_gradients(model, comm)`` averages the gradients (default
    :func:`average_gradients`; the lesson-02 exercise writes one).
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, process_group=None,
                 sync_gradients=None):
        super().__init__()
        self.module = module
        self.comm = comm_for(comm, process_group)
        self.sync = sync_gradients or average_gradients
        broadcast_module(module, self.comm)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average every gradient over the ranks with the ``sync_gradients`` given.

        A parameter without a gradient on this rank contributes zeros, so that every rank makes
        the same sequence of calls (a missing call would leave the others waiting).
        """
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sync(self.module, self.comm)


# --------------------------------------------------------------------------------------------------
# DDP's two hooks: what a bucket does during backward, and at its end (the lesson-02 exercise)
# --------------------------------------------------------------------------------------------------


def launch_when_full(bucket: Slot, i: int, grad: torch.Tensor, comm) -> None:
    """DDP's gradient hook, called as soon as backward has produced parameter ``i``'s gradient:
    put it, divided by N, in its place in the bucket; once the bucket's last gradient is in,
    start the bucket's all-reduce without waiting for it (``bucket.work`` keeps the handle), so
    it travels while backward computes the earlier layers' gradients."""
    if copy_into_bucket(bucket, i, grad, comm.size):
        bucket.work = comm.all_reduce(bucket.buffer, async_op=True)


def wait_for_buckets(buckets: list) -> None:
    """DDP's end of backward: wait until every bucket's all-reduce has completed."""
    for bucket in buckets:
        bucket.work.wait()


class BucketHooks(NamedTuple):
    """DDP's two hooks.  ``grad_ready(bucket, i, grad, comm)`` runs during backward each time a
    parameter's gradient is ready (``bucket`` a :class:`.flat.Slot`: ``buffer``, ``views[i]``,
    ``ready``, ``work``, ``index``; ``comm`` the bucket's :class:`BucketComm`);
    ``end_of_backward(buckets)`` runs once backward has finished, and when it returns every
    ``bucket.buffer`` holds the mean gradient over the ranks."""

    grad_ready: typing.Callable = launch_when_full
    end_of_backward: typing.Callable = wait_for_buckets


class BucketComm:
    """The ``comm`` DDP's ``grad_ready`` gets with one bucket: ``size``, ``rank`` and
    ``all_reduce(tensor, async_op=False)``, which sums ``tensor`` with the DDP's bucket reduction
    ``reduce(tensor, index, async_op) -> work or None`` and keeps, for the timeline, when it was
    launched (``launched_at``) and its work handle (``work``: ``wait()``, ``end``, as
    :class:`~.flat.Done`)."""

    def __init__(self, reduce, index: int, comm: Comm):
        self.reduce, self.index = reduce, index
        self.size, self.rank = comm.size, comm.rank
        self.launched_at: float | None = None
        self.work = None

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        self.launched_at = now()
        self.work = self.reduce(tensor, self.index, async_op)
        return self.work if async_op else None


class DistributedDataParallel(nn.Module):
    """DDP from scratch: bucketed gradient all-reduce, launched from autograd hooks during backward.

    Arguments:
        module: the model (the same initial weights are broadcast from rank 0).
        comm: the data-parallel communicator (default: the whole world); or ``process_group=``.
        bucket_cap_mb: bucket size in MiB, as PyTorch's ``bucket_cap_mb``.  Left at its default
            (25 MiB), the first bucket is 1 MiB, as in PyTorch (see :func:`.flat.make_buckets`).
        find_unused_parameters: allow parameters that get no gradient in a step.  Costs one small
            extra all-reduce per step (who used what); a parameter unused on *every* rank keeps
            ``grad = None``, exactly as in a single process.  Without it such a step is an error.
            Which buckets fill during backward may then differ between ranks, so the hooks run at
            the end of backward, in bucket order (no overlap; PyTorch keeps it by launching full
            buckets strictly in order).
        compression: average each bucket from compressed payloads (lesson 03): a spec
            (``"topk:0.01"``, ``"int8"``, ``"sign"``, ``"powersgd:4"``) or a ``Compressor``, with
            error feedback, or an ``ErrorFeedback`` (residuals keyed by bucket index: without
            feedback, ``as_error_feedback(spec, False)``), blocking.  Default None.
        ring_all_reduce: ``ring_all_reduce(buffer, comm) -> the sum`` sums a full bucket over the
            ranks, e.g. :func:`minitrain.comm.ring_all_reduce` (the lesson-01 exercise).  The
            buffer holds g/N, so the sum is the mean.  A sum function blocks by its shape, so it
            does not overlap with backward; default None: ``comm.all_reduce``, which can (see
            :meth:`_bucket_reduction`).
        bucket_hooks: :class:`BucketHooks` ``(grad_ready, end_of_backward)`` (default
            :func:`launch_when_full`, :func:`wait_for_buckets`).  Each bucket's ``comm`` is a
            :class:`BucketComm` that sums as the two arguments above say.

    ``timeline``: None, or a list (set by whoever wants it) that gets, per step, when backward ran
    and when each bucket's all-reduce started and ended — lesson 02 plots it.
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, process_group=None, compression=None,
                 ring_all_reduce=None, bucket_hooks=None):
        super().__init__()
        cap, first = bucket_caps(bucket_cap_mb)
        self.module = module
        self.comm = comm_for(comm, process_group)
        self.find_unused_parameters = find_unused_parameters
        self.timeline: list[dict] | None = None  # a list: each step's times kept in it
        self.ef = as_error_feedback(compression)
        self.ring_all_reduce = ring_all_reduce
        self.hooks = BucketHooks(*(bucket_hooks or ()))
        broadcast_module(module, self.comm)
        names = {id(p): n for n, p in module.named_parameters()}
        self._params = [p for p in module.parameters() if p.requires_grad]  # tied: listed once
        self._pos = {id(p): k for k, p in enumerate(self._params)}
        self._names = [names[id(p)] for p in self._params]
        self.buckets: list[FlatUnit] = make_buckets(self._params, cap, first)
        self.slots = [Slot(k, unit) for k, unit in enumerate(self.buckets)]
        reduce = self._bucket_reduction()
        self.comms = [BucketComm(reduce, s.index, self.comm) for s in self.slots]
        self.require_sync = True  # False inside no_sync()
        self._in_backward = False
        self._step: dict = {}
        self._forward_end = None
        self._got: set = set()  # (bucket, i) whose gradient arrived in this backward
        for s in self.slots:
            for i, p in enumerate(s.unit.params):
                p.register_post_accumulate_grad_hook(lambda p, s=s, i=i: self._grad_ready(s, i, p))

    def _bucket_reduction(self):
        """How a bucket is summed, in :meth:`Comm.all_reduce`'s shape: ``reduce(tensor, index,
        async_op) -> work or None``, asynchronous when the hook asks (lesson 02's check tells a
        blocking launch from one waited for too early by what reaches the communicator).

        By default that is the communicator's all-reduce, which can overlap with backward.  A sum
        function — the ``ring_all_reduce`` given, or with ``compression`` the compressed average — has
        the shape ``(tensor) -> the sum`` and blocks by that shape, whatever the hook asks: it runs
        at once, its sum is copied into the bucket (a no-op when it summed in place), and the
        handle it gives is already done (:class:`~.flat.Done`)."""
        comm, ef, ring_all_reduce = self.comm, self.ef, self.ring_all_reduce
        if ef is None and ring_all_reduce is None:
            return lambda t, k, async_op: comm.all_reduce(t, async_op=async_op, tag=f"bucket{k}")
        if ef is not None:  # the sum of the ranks' payloads of g/N is the mean
            def total(t, k):
                return compressed_all_reduce(t, comm, ef, key=k, average=False)
        else:
            def total(t, k):
                return ring_all_reduce(t, comm)

        def reduce(t, k, async_op):
            t.copy_(total(t, k))
            return Done() if async_op else None
        return reduce

    def forward(self, *args, **kwargs):
        self._forward_end = None
        out = self.module(*args, **kwargs)
        self._forward_end = now()
        return out

    @contextmanager
    def no_sync(self):
        """Backward passes inside this block accumulate gradients locally, with no communication;
        the first backward after it all-reduces the accumulated sum."""
        was, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = was

    # -- during backward, and at its end ------------------------------------------------------------

    def _begin(self) -> None:
        """The first gradient of a backward: fresh buckets, and the end-of-backward callback."""
        self._in_backward = True
        self._got = set()
        self._step = dict(backward_start=self._forward_end or now(), ready={},
                          buckets=[])
        for s, c in zip(self.slots, self.comms):
            s.ready.clear()
            s.work = s.out = None
            c.launched_at = c.work = None
            if s.buffer is None:  # one buffer per bucket for the whole run
                p0 = s.unit.params[0]
                s.buffer = torch.empty(s.unit.total, dtype=p0.dtype, device=p0.device)
                s.views = s.unit.views(s.buffer)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @torch.no_grad()
    def _grad_ready(self, s: Slot, i: int, p: torch.Tensor) -> None:
        if not self.require_sync:
            return
        if not self._in_backward:
            self._begin()
        self._got.add((s.index, i))
        if not self.find_unused_parameters:
            self._hook(s, i, p.grad)

    def _hook(self, s: Slot, i: int, grad: torch.Tensor) -> None:
        self.hooks.grad_ready(s, i, grad, self.comms[s.index])
        if self.timeline is not None:
            self._step["ready"][self._names[self._pos[id(s.unit.params[i])]]] = now()

    @torch.no_grad()
    def _end_backward(self) -> None:
        self._in_backward = False
        slots = self.slots
        self._step["backward_end"] = now()
        used = self._agree_on_unused()
        if self.find_unused_parameters:  # every rank the same hooks, in bucket order
            for s in slots:
                for i, p in enumerate(s.unit.params):
                    got = (s.index, i) in self._got and p.grad is not None
                    self._hook(s, i, p.grad if got else torch.zeros_like(p))
        self.hooks.end_of_backward(slots)
        for s, c in zip(slots, self.comms):
            end = c.work.end if c.work is not None else None  # when the sum completed
            self._step["buckets"].append(dict(index=s.index, bytes=s.unit.nbytes,
                                              start=c.launched_at or self._step["backward_end"],
                                              end=end or now()))
            self._copy_back(s, used)
        self._step["synced"] = now()
        if self.timeline is not None:
            self.timeline.append(self._step)

    def _copy_back(self, b: Slot, used: dict) -> None:
        """Copy the averaged bucket back into the gradients."""
        fresh = None  # one allocation per bucket for parameters whose .grad is None
        for i, p in enumerate(b.unit.params):
            if used and not used[id(p)]:
                continue  # unused on every rank: leave grad None, as a single process would
            if p.grad is None:
                if fresh is None:
                    fresh = b.unit.views(b.buffer.clone())
                p.grad = fresh[i]
            else:
                p.grad.copy_(b.views[i])

    def _agree_on_unused(self) -> dict:
        slots = self.slots
        missing = [(s, i) for s in slots for i in range(len(s.unit.params))
                   if (s.index, i) not in self._got]
        if not self.find_unused_parameters:
            if missing:
                names = [self._names[self._pos[id(s.unit.params[i])]] for s, i in missing]
                raise RuntimeError(
                    f"parameters got no gradient in this step: {', '.join(names[:5])}"
                    f"{' ...' if len(names) > 5 else ''}; pass find_unused_parameters=True to "
                    "DistributedDataParallel, or freeze them (requires_grad=False)")
            return {}
        used = torch.ones(len(self._params), device=self.comm.device)
        for s, i in missing:
            used[self._pos[id(s.unit.params[i])]] = 0
        self.comm.all_reduce(used, tag="unused-map")
        return {id(p): bool(used[k] > 0) for k, p in enumerate(self._params)}
