"""ZeRO-3's unit (lesson 04): one module's parameters as a shard always and as full parameters only
while in use, and what happens around its compute — :func:`zero3_hook`, the function
:class:`~minitrain.parallel.fsdp.FullyShardedDataParallel` calls before and after each unit's forward
and backward (lesson 04's exercise writes it), with the :class:`Unit` it is given.

Paper: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (stage 3); prefetch as in Zhao et al., 2023, "PyTorch FSDP".
"""

from __future__ import annotations


import torch
import torch.nn as nn

from ..comm import Comm
from .flat import FlatUnit
from ..device import now

__all__ = ["MOMENTS", "Unit", "zero3_hook", "all_gather_unit"]

#: the moments at which :class:`FullyShardedDataParallel` calls its hook, in the order one unit sees them
MOMENTS = ("before forward", "after forward", "before backward", "after backward")


def all_gather_unit(full: torch.Tensor, shard: torch.Tensor, comm: Comm, index: int = 0,
                    async_op: bool = False):
    """Fill a unit's flat parameter buffer ``full`` (just allocated) with every rank's ``shard``."""
    return comm.all_gather(full, shard, async_op=async_op, tag=f"params-unit{index}")


def zero3_hook(unit: "Unit", comm: Comm, moment: str):
    """What ZeRO-3 does around one unit's compute (the package's; lesson 04's exercise writes it).

    Before the unit computes (forward or backward) its full parameters are gathered into
    ``unit.full`` from every rank's shard — unless an earlier unit's hook already started that
    gather (``unit.pending``): then it is only waited for.  The gathers of the units that run next
    (``unit.ahead``) are started then, asynchronously, so they travel while this unit computes
    (prefetch).  After the unit computes, its full parameters are freed; after its backward, this
    rank's gradient ``unit.grad`` (already divided by N) is reduce-scattered into
    ``unit.grad_shard``, asynchronously: the work is returned and the wrapper waits for it when the
    next unit's gradients are in."""
    if moment.startswith("before"):
        if unit.pending is not None:  # issued ahead by an earlier unit's hook
            unit.pending.wait()
            unit.pending = None
        elif not unit.gathered:
            unit.allocate()
            all_gather_unit(unit.full, unit.shard, comm, unit.index)
        for nxt in unit.ahead:  # prefetch: the next units' gathers run behind this unit's compute
            nxt.allocate()
            nxt.pending = all_gather_unit(nxt.full, nxt.shard, comm, nxt.index, async_op=True)
        return None
    work = None
    if moment == "after backward":
        work = comm.reduce_scatter(unit.grad_shard, unit.grad, async_op=True,
                                   tag=f"grad-unit{unit.index}")
    unit.free()
    return work


class _Unit:
    """One module's parameters under stage 3: a shard always, the full flat vector only in use.

    ``layout.params`` are the original parameters: unregistered, they hold views of ``full`` while
    the unit is gathered (forward and backward run on them).  ``sharded[i]`` (registered on the
    module in their place) is a view of ``shard``: this rank's piece of parameter i, flattened."""

    def __init__(self, index, module, layout: FlatUnit, rank: int, param_dtype=None, name=""):
        self.index, self.module, self.layout, self.name = index, module, layout, name
        self.needs: list[int] = []  # the units whose parameters this module's forward uses
        self.refs = 0               # how many running forwards/backwards hold it gathered
        self.held_for_backward = False
        self.pending = None         # the work of a gather a hook issued ahead (prefetch)
        self.issued_at: float | None = None  # ... when it was issued
        self.issued_from = None     # ... and the shard it reads (kept alive until it is done)
        self.full = self.shard = None
        self.sharded: list[nn.Parameter] = []
        self.ranges: list[tuple] = []  # each registered shard's [start, end) in ``shard``
        self.slots: list[list] = []  # per parameter: the (module, name) places it is registered at
        if layout.params:
            lo, hi = layout.owned_range(rank)
            self.shard = layout.flatten([p.detach() for p in layout.params])[lo:hi].clone()
            dtype = param_dtype or self.shard.dtype
            self.full = torch.empty(layout.total, dtype=dtype, device=self.shard.device)
            for p, view in zip(layout.params, layout.views(self.full)):
                p.data = view
            for off, n, p in zip(layout.offsets, layout.numels, layout.params):
                start, end = max(lo, off), min(hi, off + n)
                self.ranges.append((start - lo, end - lo) if start < end else (0, 0))
                piece = self.shard[slice(*self.ranges[-1])]
                self.sharded.append(nn.Parameter(piece, requires_grad=p.requires_grad))
                p._fsdp_replaced = True
            self.nbytes = self.full.untyped_storage().nbytes()
            self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)

    @property
    def gathered(self) -> bool:
        """True while ``full`` has its memory."""
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def show(self, gathered: bool) -> None:
        """Register the full parameters (gathered) or the shards at every place they belong."""
        for p, q, places in zip(self.layout.params, self.sharded, self.slots):
            for m, name in places:
                m._parameters[name] = p if gathered else q

    def shard_grad(self, grad: torch.Tensor) -> None:
        """``grad`` (flat, this rank's shard) into ``shard.grad``; each registered shard's
        ``.grad`` a view of it.  Accumulates unless the optimizer set the gradients to None."""
        fresh = self.shard.grad is None or all(q.grad is None for q in self.sharded)
        if fresh:
            self.shard.grad = grad.to(self.shard.dtype)
        else:
            self.shard.grad.add_(grad)
        for q, (a, b) in zip(self.sharded, self.ranges):
            if fresh or q.grad is None:
                q.grad = self.shard.grad[a:b]


class Unit:
    """One unit as the hook sees it (:func:`zero3_hook`).

    ``name``: the module's (e.g. ``"blocks.1"``).  ``shard``: this rank's flat shard of the unit's
    parameters, in ``full``'s dtype.  ``full``: the flat vector of all N shards, in rank order;
    the module's parameters are views of it, and it has memory only between ``allocate()`` (its
    contents are then undefined) and ``free()``; ``gathered`` says whether it has.  At "after
    backward": ``grad``, this rank's gradient of ``full`` (already divided by N), and
    ``grad_shard``, where this rank's shard of their sum over the ranks goes.  At "before forward"
    and "before backward": ``ahead``, the units expected to run next whose parameters are neither
    gathered nor being gathered (a hook may start their gathers: prefetch), and ``pending``, the
    work of this unit's gather if a hook started it ahead (set it on a unit of ``ahead``)."""

    def __init__(self, unit: _Unit, shard: torch.Tensor, grad=None, grad_shard=None, ahead=()):
        self._unit, self.shard, self.grad, self.grad_shard = unit, shard, grad, grad_shard
        self.name, self.index = unit.name, unit.index
        self.ahead: list[Unit] = list(ahead)

    @property
    def full(self) -> torch.Tensor:
        return self._unit.full

    @property
    def gathered(self) -> bool:
        return self._unit.gathered

    @property
    def pending(self):
        return self._unit.pending

    @pending.setter
    def pending(self, work) -> None:
        self._unit.pending = work
        self._unit.issued_at = now() if work is not None else None
        self._unit.issued_from = self.shard if work is not None else None

    def allocate(self) -> None:
        self._unit.allocate()

    def free(self) -> None:
        self._unit.free()

    def __repr__(self) -> str:
        return (f"Unit({self.name!r}: {self._unit.layout.numel} parameters, full "
                f"{self._unit.full.numel()} "
                f"elements, shard {self.shard.numel()}, {'gathered' if self.gathered else 'freed'})")
