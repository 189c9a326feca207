"""Flat buffers, gradient buckets and ZeRO's gradient-hook machine (lessons 02, 04).

Papers: Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
(buckets filled in backward order, launched from autograd hooks); Rajbhandari et al., 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models" (the flat, padded partition).

* :class:`FlatUnit` — parameters laid end to end in one vector, zero-padded to a multiple of N;
  rank r owns ``[r·S, (r+1)·S)`` (:func:`minitrain.planning.analysis.shard_layout` describes it for a widget).
* :func:`make_buckets` — parameters grouped, in reverse order, into units of about a byte cap.
* :class:`Slot` and :func:`copy_into_bucket` — a bucket during one backward, and its gradient
  hook: DDP's hooks (:mod:`.data_parallel`) fill and launch slots.
* :class:`GradientReducer` — the "gradient ready → pre-divided copy into its unit's flat buffer
  → asynchronous launch once the unit is full → wait at the end of backward" machine that
  ZeRO-2 reduce-scatters with, full units launched in unit order; :class:`OneInFlightReducer`,
  ZeRO-3's, launches each unit as it fills, one at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import ParameterError
from ..device import now

__all__ = ["FlatUnit", "make_buckets", "bucket_caps", "MIB",
           "DEFAULT_BUCKET_MB", "FIRST_BUCKET_BYTES", "GradientReducer", "OneInFlightReducer",
           "SlotHooks", "Slot", "copy_into_bucket", "Done"]

MIB = 1024 * 1024
DEFAULT_BUCKET_MB = 25
FIRST_BUCKET_BYTES = 1 * MIB  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES


class FlatUnit:
    """Parameters laid end to end in one flat vector, zero-padded to a multiple of ``world_size``.

    Rank r owns the flat elements ``[r·S, (r+1)·S)`` with ``S = total / world_size``.  ``names`` label
    the parameters in :meth:`owned_params` (default: their index).  With ``world_size=1`` there is no
    padding: a DDP bucket, or a message of several tensors.
    """

    def __init__(self, params: list, world_size: int = 1, names: list | None = None):
        self.params = list(params)
        self.names = list(names) if names is not None else list(range(len(self.params)))
        self.world_size = world_size
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.shard_size = math.ceil(self.numel / world_size)
        self.total = self.shard_size * world_size
        self.padding = self.total - self.numel

    @property
    def nbytes(self) -> int:
        """Bytes of the flat vector (padding included)."""
        return self.total * self.params[0].element_size()

    def owned_range(self, rank: int) -> tuple[int, int]:
        """The flat elements ``[start, end)`` rank ``rank`` owns (padding included)."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def owned_params(self, rank: int) -> list[tuple]:
        """``(name, start, end)`` for each parameter rank ``rank`` owns a piece of; start and end
        are element indices into that parameter (flattened)."""
        lo, hi = self.owned_range(rank)
        out = []
        for name, off, n in zip(self.names, self.offsets, self.numels):
            start, end = max(lo, off), min(hi, off + n)
            if start < end:
                out.append((name, start - off, end - off))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (the padding is left out)."""
        return [flat[o:o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, self.params)]

    def flatten(self, tensors: list | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One padded flat vector from ``tensors`` laid out like the parameters (None: zeros), in
        ``dtype`` (default: the parameters'); ``tensors`` left out: the parameters themselves."""
        p0 = self.params[0]
        flat = torch.zeros(self.total, dtype=dtype or p0.dtype, device=p0.device)
        with torch.no_grad():
            for view, t in zip(self.views(flat), self.params if tensors is None else tensors):
                if t is not None:
                    view.copy_(t)
        return flat

    @torch.no_grad()
    def unflatten(self, flat: torch.Tensor, into: list | None = None) -> None:
        """Copy each parameter's slice of ``flat`` into ``into`` (default: the parameters)."""
        for t, view in zip(self.params if into is None else into, self.views(flat)):
            t.copy_(view)

    def bind(self) -> torch.Tensor:
        """Move the parameters into one flat buffer and return it: each parameter becomes a view
        of it (PyTorch's ``parameters_as_bucket_view``)."""
        flat = self.flatten([p.detach() for p in self.params])
        for p, view in zip(self.params, self.views(flat)):
            p.data = view
        return flat


def bucket_caps(bucket_cap_mb: float | None) -> tuple[float, float | None]:
    """(cap, first bucket's cap) in bytes: PyTorch's 25 MiB and 1 MiB first bucket for None."""
    if bucket_cap_mb is None:
        return DEFAULT_BUCKET_MB * MIB, FIRST_BUCKET_BYTES
    if bucket_cap_mb <= 0:
        raise ParameterError("{}: the bucket size must be > 0 MiB",
                             ("bucket_cap_mb", bucket_cap_mb))
    return bucket_cap_mb * MIB, None


def make_buckets(params: list, cap_bytes: float, first_cap_bytes: float | None = None,
                 world_size: int = 1, names: list | None = None) -> list[FlatUnit]:
    """Group ``params`` into buckets (:class:`FlatUnit` of ``world_size``), in reverse order:
    backward produces the last layers' gradients first.

    As PyTorch does: parameters are added to the open bucket until it holds at least ``cap_bytes``
    (so a bucket may overshoot by its last parameter; fewer, fuller messages), then it is closed.
    The first bucket closes at ``first_cap_bytes`` instead, if given — PyTorch's DDP makes it 1 MiB
    when the cap is left at its default, so the first all-reduce starts early in backward.
    Parameters of different dtypes never share a bucket (each dtype is bucketed on its own).
    ``names`` (one per parameter) label the buckets' parameters.
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
    name_of = {id(p): n for p, n in zip(params, names if names is not None else range(len(params)))}
    return [FlatUnit(ps, world_size, [name_of[id(p)] for p in ps]) for ps in groups]


# --------------------------------------------------------------------------------------------------
# The gradient-hook machine
# --------------------------------------------------------------------------------------------------


@dataclass
class Slot:
    """One unit's state during a backward: its flat gradient buffer (``buffer``, ``views``), which
    parameters are in (``ready``), the collective in flight (``work``, started at ``launched_at``)
    and whatever the launch callback keeps for the finish one (``out``)."""

    index: int
    unit: FlatUnit
    buffer: torch.Tensor | None = None
    views: list = field(default_factory=list)
    ready: set = field(default_factory=set)
    work: object = None
    launched_at: float | None = None
    out: object = None
    grad_shard: torch.Tensor | None = None  # ZeRO-2's hooks: this rank's shard of the bucket's sum

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.unit.params)


@torch.no_grad()
def copy_into_bucket(bucket: Slot, i: int, grad: torch.Tensor, world_size: int) -> bool:
    """The bucket hook: put parameter ``i``'s gradient, divided by N, into its place in the bucket
    (copy and divide fused) and mark it ready; True once every parameter of the bucket is in."""
    torch.mul(grad, 1.0 / world_size, out=bucket.views[i])
    bucket.ready.add(i)
    return len(bucket.ready) == len(bucket.views)


class Done:
    """A finished work handle, for a collective that already ran (blocking) when it was launched.

    A work handle, wherever the techniques take or give one (``launch``'s, ``bucket.work``, a hook's
    gather), has ``wait()`` and ``end``: when its collective completed (:func:`minitrain.device.now`),
    known once it has been waited for, else None.  :class:`minitrain.comm.Comm`'s asynchronous
    calls return such handles; this one is done from the start."""

    def __init__(self, end: float | None = None):
        self.end = now() if end is None else end

    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class SlotHooks:
    """Hooks that put the gradients into the units and launch their collectives themselves
    (ZeRO-2's exercise, lesson 04): ``grad_ready(slot, i, grad, comm)`` for each gradient,
    ``end_of_backward(slots)`` once.  ``comm(slot)`` is the communicator a slot's hooks get,
    whose asynchronous calls give the work handle they leave in ``slot.work``."""

    grad_ready: Callable
    end_of_backward: Callable
    comm: Callable


class GradientReducer:
    """Gradients reduced unit by unit while backward runs, from post-accumulate-grad hooks (ZeRO-2).

    For each unit (a :class:`FlatUnit`; one :class:`Slot` each, in ``units`` order): when a
    parameter's gradient is accumulated, :func:`copy_into_bucket` copies it, pre-divided by N, into
    the unit's flat buffer (zeros allocated at the unit's first gradient) and drops ``p.grad`` (the
    full gradient is not kept); full units are launched strictly in unit order — every rank must
    issue the same collectives in the same order, whatever order its hooks fired in — by
    ``launch(slot)``, which starts the unit's collective and returns a work handle.  The end of
    backward (an autograd callback) launches what is left (zeros for a unit no gradient reached),
    waits, calls ``finish(slot)`` for each launched unit, in order, and frees its buffer.

    Arguments:
        units: the flat units, in launch order.
        world_size: N, what each gradient is divided by.
        launch: ``launch(slot) -> work`` (a work handle: ``wait()``, ``end``, as :class:`Done`);
            may keep results in ``slot.out``.
        finish: ``finish(slot)`` once its work is done.
        dtype: the buffers' dtype (default: the unit's parameters').
        hooks: :class:`SlotHooks` that put the gradients in and launch the collectives instead of
            ``launch``; each slot also gets ``grad_shard``, an empty tensor of the unit's shard
            size.  A unit none of whose gradients came is fed zeros through ``grad_ready`` at the
            end of backward.  ``finish`` then runs as usual.

    ``begin()`` starts a backward early (ZeRO-3 calls it before a unit's first gradient).
    ``timeline``: None, or a list (set by whoever wants it) that gets, per backward, when it
    started and ended and when each unit's collective was launched and completed (DDP's form).
    """

    def __init__(self, units: list[FlatUnit], world_size: int, launch, finish, *,
                 dtype: torch.dtype | None = None, hooks: SlotHooks | None = None):
        self.slots = [Slot(k, u) for k, u in enumerate(units)]
        self.world_size = world_size
        self.launch, self.finish = launch, finish
        self.dtype = dtype
        self.hooks = hooks
        self.timeline: list[dict] | None = None  # a list: kept, per backward
        self._step: dict = {}
        self._arrived: dict = {}  # slot index -> the gradients handed to the hooks this backward
        self.in_backward = False
        self._next = 0
        for s in self.slots:
            for i, p in enumerate(s.unit.params):
                p.register_post_accumulate_grad_hook(lambda p, s=s, i=i: self._grad_ready(s, i, p))

    def begin(self) -> None:
        """Start a backward (idempotent): reset the slots, queue the end-of-backward callback."""
        if self.in_backward:
            return
        self.in_backward = True
        self._next = 0
        self._step = dict(backward_start=now(), buckets=[])
        self._arrived = {s.index: set() for s in self.slots}
        for s in self.slots:
            s.ready.clear()
            s.work, s.launched_at, s.out = None, None, None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _allocate(self, s: Slot) -> None:
        p0 = s.unit.params[0]
        s.buffer = torch.zeros(s.unit.total, dtype=self.dtype or p0.dtype, device=p0.device)
        s.views = s.unit.views(s.buffer)
        if self.hooks is not None:
            s.grad_shard = torch.empty(s.unit.shard_size, dtype=s.buffer.dtype, device=p0.device)

    @torch.no_grad()
    def _grad_ready(self, s: Slot, i: int, p: torch.Tensor) -> None:
        self.begin()
        if s.buffer is None:
            self._allocate(s)
        if self.hooks is not None:
            self._arrived[s.index].add(i)
            self.hooks.grad_ready(s, i, p.grad, self.hooks.comm(s))
            p.grad = None
            return
        full = copy_into_bucket(s, i, p.grad, self.world_size)
        p.grad = None
        if full:
            self._full(s)

    def _full(self, s: Slot) -> None:
        """Slot ``s`` has all its gradients: launch, in unit order, what can go."""
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch every full unit, strictly in unit order."""
        while self._next < len(self.slots) and self.slots[self._next].full:
            self._launch(self.slots[self._next])
            self._next += 1

    def _launch(self, s: Slot) -> None:
        if s.buffer is None:  # no gradient reached this unit: it contributes zeros
            self._allocate(s)
        s.launched_at = now()
        s.work = self.launch(s)

    def _finish(self, s: Slot) -> None:
        s.work.wait()
        self._note(s)
        self.finish(s)
        s.work, s.out = None, None
        s.ready.clear()
        s.buffer, s.views, s.grad_shard = None, [], None

    def _note(self, s: Slot) -> None:
        """The timeline's bar of slot ``s`` (its collective done): launched, completed."""
        if self.timeline is not None and s.launched_at is not None:
            end = s.work.end or now()
            self._step["buckets"].append(dict(index=s.index, bytes=s.unit.nbytes,
                                              start=s.launched_at, end=end))

    @torch.no_grad()
    def _end_backward(self) -> None:
        self.in_backward = False
        self._step["backward_end"] = now()
        if self.hooks is not None:
            self._end_with_hooks()
        else:
            self._end_launching()
        if self.timeline is not None:
            self.timeline.append(self._step)

    def _end_with_hooks(self) -> None:
        """The hooks' end of backward: units left unfilled are fed zeros, ``end_of_backward`` waits,
        then each unit is finished."""
        for s in self.slots:
            if s.buffer is None:
                self._allocate(s)
            for i, p in enumerate(s.unit.params):
                if i not in self._arrived.setdefault(s.index, set()):
                    self._arrived[s.index].add(i)
                    self.hooks.grad_ready(s, i, torch.zeros_like(p, dtype=s.buffer.dtype),
                                          self.hooks.comm(s))
        self.hooks.end_of_backward(self.slots)
        for s in self.slots:
            if s.work is None:
                raise RuntimeError(f"bucket {s.index}'s collective was never launched (bucket.work "
                                   "is None at the end of backward)")
            self._finish(s)

    def _end_launching(self) -> None:
        self._launch_ready()
        for s in self.slots[self._next:]:
            if s.work is None:
                self._launch(s)
        self._finish_launched()

    def _finish_launched(self) -> None:
        for s in self.slots:
            if s.work is not None:
                self._finish(s)


class OneInFlightReducer(GradientReducer):
    """ZeRO-3's :class:`GradientReducer`: each unit launched as soon as it fills — its units fill
    in the model's own backward order — once the unit in flight is finished, so that at most one
    unit's gradient buffer waits on the network.

    At the end of backward a unit no gradient reached is launched only when
    ``flush_untouched(slot)`` says so (ZeRO-3: the units still gathered for a backward), and
    ``after_flush()`` runs after the last wait.  The other arguments are
    :class:`GradientReducer`'s.
    """

    def __init__(self, units: list[FlatUnit], world_size: int, launch, finish, *,
                 flush_untouched, after_flush, dtype: torch.dtype | None = None):
        super().__init__(units, world_size, launch, finish, dtype=dtype)
        self.flush_untouched, self.after_flush = flush_untouched, after_flush

    def _full(self, s: Slot) -> None:
        self._launch(s)

    def _launch(self, s: Slot) -> None:
        self._finish_launched()
        super()._launch(s)

    def _end_launching(self) -> None:
        for s in self.slots:
            if s.work is None and (s.ready or self.flush_untouched(s)):
                self._launch(s)
        self._finish_launched()

    @torch.no_grad()
    def _end_backward(self) -> None:
        super()._end_backward()
        self.after_flush()
