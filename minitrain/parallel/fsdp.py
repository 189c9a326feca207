"""ZeRO stage 3, shaped like PyTorch's FSDP2: parameters, gradients and optimizer states all sharded
(lesson 04).

Papers: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20); Zhao et al., 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel" (VLDB).  Each unit (the embedding, each block, the head) all-gathers its parameters just
before its forward and again before its backward, frees them after, and reduce-scatters its
gradients once they are in (:class:`~minitrain.parallel.flat.OneInFlightReducer`): 3Ψ per step, 1.5×
DDP's traffic.  What happens around a unit's compute is one function, :func:`zero3_hook` (lesson
04's exercise writes it); the wrapper calls it at the four moments, offering it the units that run
next: the package's hook issues their gathers ahead (prefetch), so they run behind this unit's
compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm import Comm, all_reduce_coalesced
from .data_parallel import broadcast_module, comm_for
from .flat import Done, FlatUnit, OneInFlightReducer
from .fsdp_unit import MOMENTS, Unit, _Unit, all_gather_unit, zero3_hook
from .zero import master_shard
from ..device import now

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy", "MOMENTS", "Unit", "zero3_hook",
           "default_units", "all_gather_unit"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's: parameters all-gathered and computed in ``param_dtype``, gradients reduce-scattered
    in ``reduce_dtype`` (default: ``param_dtype``); the shards and their gradients stay in the
    parameters' own dtype (fp32), which is what the user's optimizer steps.  None: no cast."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def default_units(module: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one: the children, a ModuleList's items each on its own (for the
    GPT: the embedding, every block, the head)."""
    out = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += [m for c in child.children() for m in ([c] if any(True for _ in c.parameters())
                                                         else [])]
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def _refuse_unwrapped(optimizer, args, kwargs):
    """Optimizer step pre-hook: a parameter replaced by its shard at wrapping never gets a gradient."""
    for group in optimizer.param_groups:
        if any(getattr(p, "_fsdp_replaced", False) for p in group["params"]):
            raise RuntimeError(
                "this optimizer holds parameters that FullyShardedDataParallel replaced by their "
                "shards: it was built before wrapping and would train nothing.  Build it after "
                "wrapping, from model.parameters() (the shards).")


register_optimizer_step_pre_hook(_refuse_unwrapped)


class _BeforeBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward runs just before the unit's own backward."""

    @staticmethod
    def forward(ctx, fsdp, unit, x):
        ctx.fsdp, ctx.unit = fsdp, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fsdp._before_backward(ctx.unit)
        return None, None, grad


class FullyShardedDataParallel(nn.Module):
    """ZeRO stage 3, shaped like PyTorch's FSDP2 (``fully_shard``).

    Arguments:
        module: the model (rank 0's weights are broadcast first, untraced as ``init``).
        comm / process_group: the data-parallel ranks (default: the whole world).
        units: the submodules to shard one by one (default :func:`default_units`); parameters no
            unit holds form one more unit for ``module`` itself.
        zero3_hook: ``zero3_hook(unit, comm, moment)``, what happens around a unit's compute
            (the lesson-04 exercise): called with a :class:`Unit` at "before forward", "after forward", "before backward" (the unit must
            then be gathered) and "after backward" (its gradient is complete: reduce it into
            ``unit.grad_shard``; it may return the work of an asynchronous collective).  Default
            None: :func:`zero3_hook`, which prefetches the units ``unit.ahead`` lists.
        mp_policy: a :class:`MixedPrecisionPolicy` (default: compute in the parameters' dtype).
        replicate: parameters left whole on every rank (e.g. the norms), gradients averaged.
        prefetch: how many units ahead the hook is offered (``unit.ahead``) before a unit computes
            (forward: the next units in the last forward's order; backward: the previous ones).
            0: none (every unit gathered when needed).

    After wrapping, ``module.parameters()`` are this rank's shards (1-D: each parameter's piece of
    its unit's flat shard, possibly empty): hand them to any ``torch.optim`` optimizer; after
    ``backward()`` each ``.grad`` is its shard of the averaged gradient (in the shard's dtype).
    While a unit runs, the full parameters (views of a flat buffer in ``param_dtype``) are
    registered in their place: a forward pre-hook calls the hook "before forward", a forward hook
    "after forward", a :class:`_BeforeBackward` on the unit's output "before backward", and once
    the unit's gradients are in (or at the end of backward), "after backward" (one unit's
    reduce-scatter in flight).  ``gathered_peak`` is the most bytes of full parameters held at once.
    A tied parameter belongs to the first unit that has it; a unit that uses another's gathers it
    too, and keeps it gathered in backward until that unit's own gradient is in.
    An optimizer built before wrapping (over the replaced parameters) is refused at ``step()``.
    ``full_state_dict()`` gathers the model.  The flat shards themselves
    (``sharded_parameters()``) can be stepped instead, e.g. with fp32 masters of a 16-bit model:
    ``shard_optimizer(fsdp.sharded_parameters(), cls, fsdp.master_shards(masters))``.
    ``timeline``: None, or a list (set by whoever wants it) that gets each unit's gather, compute,
    free and reduce-scatter (:func:`~minitrain.planning.analysis.hidden_fraction` reads it).
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, process_group=None,
                 units: list | None = None, zero3_hook=None,
                 mp_policy: MixedPrecisionPolicy | None = None, replicate=(), prefetch: int = 1):
        super().__init__()
        self.module = module
        self.comm = comm_for(comm, process_group)
        self.zero3_hook = zero3_hook  # None: the package's zero3_hook
        self.prefetch = prefetch
        self.gathered_peak = 0  # bytes of full parameters held at once, at most
        self.policy = mp_policy or MixedPrecisionPolicy()
        self.replicated = list(replicate)
        self.timeline: list[dict] | None = None  # a list: each unit's events kept in it
        self._order: list[int] = []       # units in the order the last forward ran them
        self._running: list[int] = []     # ... and the order this forward runs them
        self._fresh: dict = {}            # replicated parameter -> [this backward's gradient, new?]
        broadcast_module(module, self.comm)
        names = {id(p): k for k, p in module.named_parameters()}
        module_names = {id(m): k or "(the model itself)" for k, m in module.named_modules()}
        places: dict = {}
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    places.setdefault(id(p), []).append((m, name))
        skip = {id(p) for p in self.replicated}
        modules = list(default_units(module) if units is None else units) + [module]
        owner: dict = {}
        self.units: list[_Unit] = []
        module.register_forward_pre_hook(lambda m, args: self._start_forward())
        for m in modules:
            mine = [p for p in m.parameters() if p.requires_grad and id(p) not in owner
                    and id(p) not in skip]
            for p in mine:
                owner[id(p)] = len(self.units)
            layout = FlatUnit(mine, self.comm.size, [names[id(p)] for p in mine])
            u = _Unit(len(self.units), m, layout, self.comm.rank, self.policy.param_dtype,
                      module_names.get(id(m), type(m).__name__))
            u.slots = [places[id(p)] for p in mine]
            self.units.append(u)
        for u in self.units:
            inside = {id(x) for x in u.module.modules()}
            u.needs = sorted({owner[id(p)] for p in u.module.parameters() if id(p) in owner and (
                owner[id(p)] == u.index or id(self.units[owner[id(p)]].module) not in inside)})
            if u.needs:
                u.module.register_forward_pre_hook(lambda m, args, u=u: self._before_forward(u, args))
                u.module.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u, out))
        self._sharded = [u for u in self.units if u.shard is not None]
        for u in self._sharded:
            u.show(False)
        for p in self.replicated:
            p.register_hook(lambda g, p=p: self._replicated_grad(p, g))
        self.reducer = OneInFlightReducer(
            [u.layout for u in self._sharded], self.comm.size, self._launch, self._finish,
            flush_untouched=lambda slot: self._sharded[slot.index].refs > 0,  # gathered, no grad
            after_flush=self._end_backward,
            dtype=self.policy.reduce_dtype or self.policy.param_dtype)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sharded_parameters(self) -> list[torch.Tensor]:
        """This rank's flat shard of each unit (the registered parameters are views of them)."""
        return [u.shard for u in self._sharded]

    def master_shards(self, master_weights: dict) -> dict:
        """Mixed precision: ``{shard: this rank's fp32 slice of master_weights}`` (the ``{16-bit
        parameter: fp32 copy}`` of :func:`~minitrain.precision.cast_model_`), for
        :func:`~minitrain.parallel.zero.shard_optimizer`.  A unit with a parameter missing from it
        is left out (its master then starts from the 16-bit shard, upcast)."""
        return {u.shard: master_shard(u.layout, self.comm.rank, master_weights)
                for u in self._sharded if all(p in master_weights for p in u.layout.params)}

    def parameter_names(self) -> dict:
        """``{id(registered shard): the parameter's name}`` (checkpoints map state_dict keys)."""
        return {id(q): name for u in self._sharded for q, name in zip(u.sharded, u.layout.names)}

    # -- gathering and freeing: the hook, at the four moments ---------------------------------------

    def _event(self, u: _Unit, kind: str, start: float, end: float | None = None) -> None:
        if self.timeline is not None:
            self.timeline.append(dict(unit=u.index, kind=kind, start=start,
                                      end=start if end is None else end,
                                      backward=self.reducer.in_backward))

    def _source(self, u: _Unit) -> torch.Tensor:
        """This rank's shard in the dtype the unit computes in (the policy's param_dtype)."""
        return u.shard if u.shard.dtype == u.full.dtype else u.shard.to(u.full.dtype)

    def _call(self, u: _Unit, moment: str, grad=None, grad_shard=None, ahead=()):
        """The hook at ``moment`` for unit ``u``; what it returned (the work of a collective)."""
        ahead = [Unit(v, self._source(v)) for v in ahead
                 if v.refs == 0 and v.pending is None and not v.gathered]
        hook = self.zero3_hook or zero3_hook
        work = hook(Unit(u, self._source(u), grad, grad_shard, ahead), self.comm, moment)
        held = sum(v.full.untyped_storage().nbytes() for v in self._sharded)
        self.gathered_peak = max(self.gathered_peak, held)
        return work

    def _acquire(self, u: _Unit, phase: str, ahead: list) -> None:
        """Before a forward or backward that uses ``u``: "before <phase>" (offering ``ahead``) unless
        a running forward or backward already holds it gathered."""
        if u.refs == 0:
            issued, start = u.pending, now()
            if issued is not None:  # a hook started this gather ahead: it began then
                start = u.issued_at
            self._call(u, f"before {phase}", ahead=ahead)
            end = issued.end if issued is not None else None
            self._event(u, "gather", start, end or now())
            if not u.gathered:
                raise RuntimeError(
                    f"unit {u.name!r} is about to run its {phase} with its parameters not "
                    f"gathered: after the hook's 'before {phase}' unit.full has no memory; gather "
                    "every rank's shard into it first")
            u.show(True)
        u.refs += 1

    def _release(self, u: _Unit) -> None:
        """The end of a forward that used ``u``: "after forward" once no forward holds it."""
        u.refs -= 1
        if u.refs == 0:
            u.show(False)
            self._call(u, "after forward")
            self._event(u, "free", now())

    def _ahead(self, u: _Unit, order: list[int]) -> list[_Unit]:
        """The units the ``prefetch`` modules after ``u`` in ``order`` need (not ``u``'s own)."""
        if u.index not in order:
            return []
        at = order.index(u.index)
        out = []
        for k in order[at + 1:at + 1 + self.prefetch]:
            out += [self.units[i] for i in self.units[k].needs
                    if i not in u.needs and self.units[i] not in out]
        return out

    def _start_forward(self) -> None:
        if self._running:
            self._order = self._running
        self._running = []

    def _before_forward(self, u: _Unit, args):
        if u.index not in self._running:
            self._running.append(u.index)
        ahead = self._ahead(u, self._order)
        for k in u.needs:
            self._acquire(self.units[k], "forward", ahead)
        u.compute_start = now()
        dtype = self.policy.param_dtype
        if dtype is not None:  # FSDP2's cast_forward_inputs
            return _map_tensors(args, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def _after_forward(self, u: _Unit, out):
        self._event(u, "compute", u.compute_start, now())
        if torch.is_grad_enabled():
            out = _map_tensors(out, lambda t: _BeforeBackward.apply(self, u, t)
                               if t.requires_grad else t)
        for k in u.needs:
            self._release(self.units[k])
        return out

    # -- backward ------------------------------------------------------------------------------------

    def _before_backward(self, u: _Unit) -> None:
        self.reducer.begin()
        if not u.held_for_backward:
            u.held_for_backward = True
            ahead = self._ahead(u, (self._running or self._order)[::-1])
            for k in u.needs:
                self._acquire(self.units[k], "backward", ahead)
            u.compute_start = now()

    def _launch(self, slot):
        """``u``'s gradient is in (or backward ended with ``u`` gathered): its backward is done —
        the hook's "after backward" reduces the gradient and frees the parameters."""
        u = self._sharded[slot.index]
        if u.held_for_backward:
            u.held_for_backward = False
            self._event(u, "compute", u.compute_start, now())
        u.refs = 0  # a unit that needed it (a tied weight) has finished its backward already
        u.show(False)
        slot.out = torch.empty(u.shard.numel(), dtype=slot.buffer.dtype, device=u.shard.device)
        work = self._call(u, "after backward", slot.buffer, slot.out)
        self._event(u, "free", now())
        return work if work is not None else Done()

    def _finish(self, slot) -> None:
        """Add the averaged gradient shard into the shards' ``.grad``."""
        u = self._sharded[slot.index]
        self._event(u, "reduce_scatter", slot.launched_at, slot.work.end)
        u.shard_grad(slot.out)

    def _end_backward(self) -> None:
        for u in self.units:
            u.held_for_backward = False
        for u in self._sharded:  # a gather issued ahead that no unit used
            if u.pending is not None:
                u.pending.wait()
                u.pending = u.issued_at = u.issued_from = None
                u.free()
        if self._running:
            self._order, self._running = self._running, []
        self._average_replicated()

    def _replicated_grad(self, p, g):
        self.reducer.begin()
        if id(p) in self._fresh:
            self._fresh[id(p)][0] += g
        else:
            self._fresh[id(p)] = [g.detach().clone(), p.grad is None]
        return g

    @torch.no_grad()
    def _average_replicated(self) -> None:
        """Average this backward's gradients of the replicated parameters (one all-reduce)."""
        if not self.replicated:
            return
        fresh = [self._fresh.get(id(p), [torch.zeros_like(p), p.grad is None]) for p in self.replicated]
        olds = [None if new else f.clone() for f, new in fresh]
        all_reduce_coalesced([f for f, _ in fresh], self.comm, tag="replicated-grads",
                             divide_by=self.comm.size)
        for p, (avg, _), old in zip(self.replicated, fresh, olds):
            if old is None or p.grad is None:
                p.grad = avg
            else:
                p.grad.add_(avg - old)
        self._fresh.clear()

    # -- full parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The whole model's state_dict (cloned, in the shards' dtype), gathered on every rank (a
        collective: every rank must call it)."""
        where = {id(q): (u, i) for u in self._sharded for i, q in enumerate(u.sharded)}
        full = {}
        for u in self._sharded:
            flat = torch.empty(u.layout.total, dtype=u.shard.dtype, device=u.shard.device)
            self.comm.all_gather(flat, u.shard, tag=f"state-unit{u.index}")
            full[u.index] = u.layout.views(flat)
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            if id(v) in where:
                u, i = where[id(v)]
                out[k] = full[u.index][i].clone()
            else:
                out[k] = v.detach().clone()
        return out

    def is_gathered_parameter(self, t: torch.Tensor) -> bool:
        """True if ``t`` shares storage with a gathered unit (the activation meter skips those)."""
        ptr = t.untyped_storage().data_ptr()
        return any(u.full.untyped_storage().nbytes() and u.full.untyped_storage().data_ptr() == ptr
                   for u in self._sharded)

    def layouts(self) -> list[FlatUnit]:
        return [u.layout for u in self._sharded]

    def memory_tensors(self) -> tuple[dict, list]:
        shards = self.sharded_parameters()
        return {"parameters": shards, "gradients": [s.grad for s in shards]}, []


def _map_tensors(out, fn):
    if torch.is_tensor(out):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    return out
