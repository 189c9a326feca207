"""Data parallelism from scratch: naive DP, and DDP with gradient buckets overlapped with backward.

Lesson 02; seeds 002 §2.1 and 003 (DP vs DDP).  Paper: Li et al., 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training" (VLDB) — buckets, overlap, ``no_sync``.

Every rank holds a full replica of the model and a slice of the global batch.  After backward, the
gradients are averaged over the ranks, so every replica takes the same optimizer step — the same
step a single process would take on the whole batch.

* :class:`NaiveDataParallel` — broadcast the weights once; after backward, all-reduce every gradient,
  one call per parameter, and divide by N.  Correct, but every call pays the latency α (lesson 01) and
  nothing overlaps with compute.
* :class:`DistributedDataParallel` — gradients are packed into buckets of about ``bucket_cap_mb`` MiB,
  filled in reverse parameter order (the order backward produces them).  A hook on each parameter
  fires when its gradient is accumulated; when a bucket is full its all-reduce starts *asynchronously*,
  while backward goes on computing earlier layers.  At the end of backward we wait for the buckets and
  copy the averaged gradients back.  ``no_sync()`` accumulates gradients locally without any traffic.
  With ``compression=`` (lesson 03) each full bucket is averaged from compressed payloads instead
  (:func:`~minitrain.parallel.compression.compressed_all_reduce`, blocking, with error feedback).

Both have PyTorch's shape: they wrap a module, expose it as ``.module`` and forward calls to it, so
``torch.nn.parallel.DistributedDataParallel`` can be swapped in.
"""

from __future__ import annotations

import abc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import Comm
from ..data import shard
from ..memory import ActivationMeter
from ..strategies import ConfigError, Strategy, TrainConfig, register
from .compression import (add_compression_arguments, as_error_feedback, check_compression,
                          compressed_all_reduce)

__all__ = ["NaiveDataParallel", "DistributedDataParallel", "Bucket", "make_buckets", "MIB",
           "FIRST_BUCKET_BYTES",
           "broadcast_module", "overlap_fraction"]


def broadcast_module(module: nn.Module, comm: Comm, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (replicas start identical)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(t.data, src=src, tag="init")


def _comm_for(comm: Comm | None, process_group) -> Comm:
    if comm is not None and process_group is not None:
        raise ValueError("pass either comm= or process_group=, not both")
    return comm if comm is not None else Comm(process_group)


class NaiveDataParallel(nn.Module):
    """Replicas kept equal by one all-reduce per gradient, after backward (call ``sync_gradients``)."""

    def __init__(self, module: nn.Module, comm: Comm | None = None, process_group=None):
        super().__init__()
        self.module = module
        self.comm = _comm_for(comm, process_group)
        broadcast_module(module, self.comm)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average every gradient over the ranks: all-reduce the sum, divide by N.

        A parameter without a gradient on this rank contributes zeros, so that every rank makes
        the same sequence of calls (a missing call would leave the others waiting).
        """
        n = self.comm.size
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(n)
            self.comm.all_reduce(p.grad, tag="grad")


@dataclass
class Bucket:
    """A flat buffer holding the gradients of some parameters, all-reduced as one message."""

    index: int
    params: list
    offsets: list
    numel: int
    buffer: torch.Tensor | None = None
    ready: set = field(default_factory=set)
    work: object = None
    launched_at: float | None = None
    views: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def allocate(self) -> None:
        """Create the flat buffer, and each parameter's view into it (made once: hooks are hot)."""
        p0 = self.params[0]
        self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
        self.views = self.split(self.buffer)

    def split(self, flat: torch.Tensor) -> list:
        """Views of a flat tensor laid out as this bucket, one per parameter, shaped like it."""
        parts = flat.split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params)]

    def view(self, i: int) -> torch.Tensor:
        return self.views[i]


MIB = 1024 * 1024
DEFAULT_BUCKET_MB = 25
FIRST_BUCKET_BYTES = 1 * MIB  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES


def make_buckets(params: list, cap_bytes: float, first_cap_bytes: float | None = None) -> list[Bucket]:
    """Group ``params`` into buckets, in reverse order: backward produces the last layers'
    gradients first.

    As PyTorch does: parameters are added to the open bucket until it holds at least ``cap_bytes``
    (so a bucket may overshoot by its last parameter; fewer, fuller messages), then it is closed.
    The first bucket closes at ``first_cap_bytes`` instead, if given — PyTorch's DDP makes it 1 MiB
    when the cap is left at its default, so the first all-reduce starts early in backward.
    Parameters of different dtypes never share a bucket (each dtype is bucketed on its own).
    """
    groups: list[list] = []
    open_: dict = {}  # dtype -> [params, bytes, buckets closed so far]
    for p in reversed(params):
        entry = open_.setdefault(p.dtype, [[], 0, 0])
        entry[0].append(p)
        entry[1] += p.numel() * p.element_size()
        first = entry[2] == 0 and first_cap_bytes is not None
        if entry[1] >= (first_cap_bytes if first else cap_bytes):
            groups.append(entry[0])
            open_[p.dtype] = [[], 0, entry[2] + 1]
    groups += [entry[0] for entry in open_.values() if entry[0]]
    position = {id(p): k for k, p in enumerate(reversed(params))}
    groups.sort(key=lambda ps: position[id(ps[0])])  # launch order: first gradient ready first
    out = []
    for i, ps in enumerate(groups):
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += p.numel()
        out.append(Bucket(i, ps, offsets, total))
    return out


class DistributedDataParallel(nn.Module):
    """DDP from scratch: bucketed gradient all-reduce, launched from autograd hooks during backward.

    Arguments:
        module: the model (the same initial weights are broadcast from rank 0).
        comm: the data-parallel communicator (default: the whole world); or ``process_group=``.
        bucket_cap_mb: bucket size in MiB, as PyTorch's ``bucket_cap_mb``.  Left at its default
            (25 MiB), the first bucket is 1 MiB, as in PyTorch, so that communication starts
            early (see :func:`make_buckets`).
        find_unused_parameters: allow parameters that get no gradient in a step.  Costs one small
            extra all-reduce per step (who used what); a parameter unused on *every* rank keeps
            ``grad = None``, exactly as in a single process.  Without it such a step is an error.
        record_timeline: keep, per step, when backward ran and when each bucket's all-reduce
            started and ended (``.timeline``) — lesson 02 plots it.
        compression: average each bucket from compressed payloads: a spec (``"topk:0.01"``,
            ``"int8"``, ``"sign"``, ``"powersgd:4"``), a ``Compressor`` or an ``ErrorFeedback``
            (its residuals are keyed by bucket index).  Default None: the plain all-reduce.
        error_feedback: keep what compression leaves out and add it to the next step's bucket
            (ignored when ``compression`` is already an ``ErrorFeedback``).
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, record_timeline: bool = False,
                 process_group=None, compression=None, error_feedback: bool = True):
        super().__init__()
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.comm = _comm_for(comm, process_group)
        self.find_unused_parameters = find_unused_parameters
        self.record_timeline = record_timeline
        self.require_sync = True
        self.timeline: list[dict] = []
        self.ef = as_error_feedback(compression, error_feedback)
        broadcast_module(module, self.comm)
        names = {id(p): n for n, p in module.named_parameters()}
        self._params = [p for p in module.parameters() if p.requires_grad]  # tied: listed once
        self._pos = {id(p): k for k, p in enumerate(self._params)}
        self._names = [names[id(p)] for p in self._params]
        if bucket_cap_mb is None:  # PyTorch's default: 25 MiB, and a 1 MiB first bucket
            self.buckets = make_buckets(self._params, DEFAULT_BUCKET_MB * MIB, FIRST_BUCKET_BYTES)
        else:
            self.buckets = make_buckets(self._params, bucket_cap_mb * MIB)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._in_backward = False
        self._step: dict = {}
        self._next = 0
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        self._forward_end = None
        out = self.module(*args, **kwargs)
        self._forward_end = time.perf_counter()
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

    # -- backward hooks -----------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._next = 0
        for b in self.buckets:
            b.ready.clear()
            b.work, b.launched_at = None, None
            if b.buffer is None:
                b.allocate()
        self._step = dict(backward_start=self._forward_end or time.perf_counter(), ready={},
                          buckets=[])
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @torch.no_grad()
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.require_sync:
            return
        if not self._in_backward:
            self._begin_backward()
        bucket, i = self._where[id(p)]
        torch.mul(p.grad, 1.0 / self.comm.size, out=bucket.views[i])  # copy in and pre-divide, fused
        bucket.ready.add(i)
        if self.record_timeline:
            self._step["ready"][self._names[self._pos[id(p)]]] = time.perf_counter()
        if len(bucket.ready) == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every full bucket, strictly in bucket order: all ranks must issue the same
        collectives in the same order, whatever order their hooks fired in."""
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            b.launched_at = time.perf_counter()
            if self.ef is None:
                b.work = self.comm.all_reduce(b.buffer, async_op=True, tag=f"bucket{b.index}")
            else:
                b.work = self._compressed_all_reduce(b)
            self._next += 1

    def _compressed_all_reduce(self, b: Bucket) -> "_Done":
        """Average bucket ``b`` from compressed payloads, now (blocking).  The buffer already holds
        g/N (pre-divided in ``_grad_ready``), so the *sum* of the ranks' payloads is the mean."""
        compressed_all_reduce(b.buffer, self.comm, self.ef, key=b.index, average=False)
        return _Done(time.perf_counter())

    @torch.no_grad()
    def _end_backward(self) -> None:
        """Runs once at the end of backward: handle unused parameters, wait, copy gradients back."""
        self._in_backward = False
        self._step["backward_end"] = time.perf_counter()
        used_everywhere = self._agree_on_unused()
        self._launch_ready()
        for b in self.buckets:
            b.work.wait()
            self._step["buckets"].append(dict(index=b.index, bytes=b.nbytes,
                                              start=b.launched_at, end=b.work.end))
        for b in self.buckets:
            fresh = None  # one allocation per bucket for parameters whose .grad is None
            for i, p in enumerate(b.params):
                if used_everywhere and not used_everywhere[id(p)]:
                    continue  # unused on every rank: leave grad None, as a single process would
                if p.grad is None:
                    if fresh is None:
                        fresh = b.split(b.buffer.clone())
                    p.grad = fresh[i]
                else:
                    p.grad.copy_(b.views[i])
        self._step["synced"] = time.perf_counter()
        if self.record_timeline:
            self.timeline.append(self._step)

    def _agree_on_unused(self) -> dict:
        missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
        if not self.find_unused_parameters:
            if missing:
                names = [self._names[self._pos[id(b.params[i])]] for b, i in missing]
                raise RuntimeError(
                    f"parameters got no gradient in this step: {', '.join(names[:5])}"
                    f"{' ...' if len(names) > 5 else ''}; pass find_unused_parameters=True to "
                    "DistributedDataParallel, or freeze them (requires_grad=False)")
            return {}
        used = torch.ones(len(self._params))
        for b, i in missing:
            used[self._pos[id(b.params[i])]] = 0
            b.view(i).zero_()
            b.ready.add(i)
        self.comm.all_reduce(used, tag="unused-map")
        return {id(p): bool(used[k] > 0) for k, p in enumerate(self._params)}


class _Done:
    """A finished work handle: what ``_end_backward`` waits on for a blocking, compressed bucket."""

    def __init__(self, end: float):
        self.end = end

    def wait(self) -> bool:
        return True


def overlap_fraction(step: dict) -> float:
    """Share of a step's all-reduce time that ran while backward was still computing."""
    start, end = step["backward_start"], step["backward_end"]
    total = sum(b["end"] - b["start"] for b in step["buckets"])
    hidden = sum(max(0.0, min(b["end"], end) - max(b["start"], start)) for b in step["buckets"])
    return hidden / total if total > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# Strategies for `minitrain train`
# --------------------------------------------------------------------------------------------------


def mean_over_ranks(loss: torch.Tensor, comm: Comm) -> float:
    """Mean of the ranks' losses (untraced: a metric, not training traffic)."""
    t = loss.detach().clone()
    dist.all_reduce(t, group=comm.group)
    return t.item() / comm.size


class _DataParallelStrategy(Strategy):
    """Shared by ddp-naive and ddp: split the global batch, train the replica, report the mean loss.

    Mixed precision (lesson 07): the replicas are bf16/fp16, so are the gradients and the buckets —
    gloo all-reduces bf16 and fp16 on CPU (checked with torch 2.13), so the gradients travel in 16
    bits, half the bytes, as with PyTorch's DDP.  Each rank's gradient is rounded to 16 bits, divided
    by N and summed in 16 bits, so the averaged gradient differs from a single process's by a few
    16-bit roundings (tests/test_precision.py bounds the effect on the losses).  With fp16 an
    overflow becomes inf in the sum on every rank alike, so all ranks skip the same steps.
    """

    precisions = ("fp32", "bf16-mixed", "fp16-mixed")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.batch_size % cfg.world_size:
            fix = cfg.world_size * max(1, round(cfg.batch_size / cfg.world_size))
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {cfg.world_size} "
                              f"ranks; use a multiple of {cfg.world_size} (e.g. {fix})")

    def local(self, x, y):
        r, n = self.comm.rank, self.comm.size
        return shard(x, r, n).to(self.device), shard(y, r, n).to(self.device)

    def global_mean(self, loss: torch.Tensor) -> float:
        return mean_over_ranks(loss, self.comm)

    @abc.abstractmethod
    def wrap(self, model):
        """The data-parallel wrapper around the replica."""

    def after_backward(self) -> None:
        """Anything left to do before the optimizer step (DDP: nothing, its hooks did it)."""

    def __init__(self, cfg: TrainConfig, comm: Comm):
        super().__init__(cfg, comm)
        self.model = self.build_model()
        self.wrapper = self.wrap(self.model)
        self.meter = ActivationMeter(self.model)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x, y) -> float:
        x, y = self.local(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        with self.meter.measure():
            loss = self.wrapper(x, y)
        self.backward(loss)
        self.after_backward()
        self.optimizer.step()
        return self.global_mean(loss)



@register
class NaiveDDP(_DataParallelStrategy):
    name = "ddp-naive"
    help = "data parallel: one all-reduce per gradient after backward"
    checkpoint_refusal = None  # identical replicas: Strategy's defaults (rank 0 writes the replica)

    def wrap(self, model):
        return NaiveDataParallel(model, self.comm)

    def after_backward(self) -> None:
        self.wrapper.sync_gradients()


@register
class DDP(_DataParallelStrategy):
    name = "ddp"
    help = ("distributed data parallel: bucketed all-reduce overlapped with backward "
            "(--bucket-mb, --compress)")
    checkpoint_refusal = None  # identical replicas: Strategy's defaults (rank 0 writes the replica)

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--bucket-mb", type=float, default=None,
                            help="ddp: gradient bucket size in MiB (default 25, as PyTorch)")
        add_compression_arguments(parser)

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.options.get("bucket_mb") is not None and cfg.options["bucket_mb"] <= 0:
            raise ConfigError(f"--bucket-mb must be > 0, got {cfg.options['bucket_mb']}")
        check_compression(cfg)
        if cfg.options.get("compress") and cfg.precision == "fp16-mixed" and cfg.loss_scale != 0:
            raise ConfigError("--compress cannot be combined with loss scaling (--precision "
                              "fp16-mixed): the error-feedback residuals would hold gradients "
                              "scaled by a changing loss scale, and an overflow's inf; use "
                              "--precision bf16-mixed, or --loss-scale 0")
        if cfg.options.get("compress") and (cfg.save_dir or cfg.resume):
            raise ConfigError("--compress cannot be checkpointed yet: each rank's error-feedback "
                              "residuals would be lost, so a resumed run would differ; leave out "
                              "--compress, or --save-dir/--resume")

    def wrap(self, model):
        o = self.cfg.options
        return DistributedDataParallel(model, self.comm, bucket_cap_mb=o.get("bucket_mb"),
                                       record_timeline=o.get("timeline", False),
                                       compression=o.get("compress"),
                                       error_feedback=o.get("error_feedback", True))

    def report(self) -> dict:
        """Bucket sizes, and (with the ``timeline`` option) each step's backward/all-reduce times."""
        out = {"bucket_bytes": [b.nbytes for b in self.wrapper.buckets]}
        if self.wrapper.ef is not None:
            out["compression"] = self.wrapper.ef.compressor.name
        if self.wrapper.timeline:
            out["timeline"] = self.wrapper.timeline
            out["overlap"] = [overlap_fraction(s) for s in self.wrapper.timeline]
        return out
