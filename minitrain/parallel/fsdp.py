"""ZeRO stage 3, FSDP-style: parameters, gradients and optimizer states all sharded (lesson 04).

Papers: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20); Zhao et al., 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel" (VLDB).  Each unit (the embedding, each block, the head) all-gathers its parameters just
before its forward and again before its backward, frees them after, and reduce-scatters its
gradients (:class:`~minitrain.parallel.flat.GradientReducer`): 3Ψ per step, 1.5× DDP's traffic.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm
from .data_parallel import broadcast_module, comm_for
from .flat import FlatUnit, GradientReducer
from .zero import master_shard

__all__ = ["FullyShardedDataParallel", "default_units", "all_gather_unit"]


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


def all_gather_unit(full: torch.Tensor, shard: torch.Tensor, comm: Comm, index: int = 0) -> None:
    """Fill a unit's flat parameter buffer ``full`` (just allocated) with every rank's ``shard``."""
    comm.all_gather(full, shard, tag=f"params-unit{index}")


class _Unit:
    """One module's parameters under stage 3: a shard always, the full flat vector only in use."""

    def __init__(self, index: int, module: nn.Module, layout: FlatUnit, rank: int):
        self.index, self.module, self.layout = index, module, layout
        self.needs: list[int] = []  # the units whose parameters this module's forward uses
        self.refs = 0               # how many running forwards/backwards hold it gathered
        self.held_for_backward = False
        self.full = self.shard = None
        if layout.params:
            lo, hi = layout.owned_range(rank)
            self.full = layout.bind()
            self.shard = self.full[lo:hi].clone()
            self.nbytes = self.full.untyped_storage().nbytes()
            self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)


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
    """ZeRO stage 3, shaped like PyTorch's FSDP: parameters, gradients and optimizer states sharded.

    Arguments:
        module: the model (rank 0's weights are broadcast first, untraced as ``init``).
        comm / process_group: the data-parallel ranks (default: the whole world).
        units: the submodules to shard one by one (default :func:`default_units`); parameters no
            unit holds form one more unit for ``module`` itself.
        gather: ``gather(full, shard, comm)`` fills a unit's just-allocated flat parameter buffer
            with every rank's shard (the wrapper frees it after use).  Default None:
            :func:`all_gather_unit`.

    Each unit's parameters become views of a flat buffer whose storage exists only while the unit
    runs: a forward pre-hook all-gathers it, a forward hook frees it; a :class:`_BeforeBackward` on the
    unit's output all-gathers it again when backward reaches the unit; when the unit's gradients
    are accumulated they are reduce-scattered (asynchronously, one unit in flight) and the buffer is
    freed again.  A tied parameter belongs to the first unit that has it; a unit that uses another's
    (the head of a GPT with ``tie_weights``) gathers that unit too.  Train the shards:
    ``optimizer_class(fsdp.sharded_parameters(), ...)`` — or, for a 16-bit model,
    ``shard_optimizer(fsdp.sharded_parameters(), optimizer_class, fsdp.master_shards(masters))``.
    ``full_state_dict()`` gathers the model.  A parameter unused on every rank gets a zero gradient
    when the rest of its unit is used, none otherwise.
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, process_group=None,
                 units: list | None = None, gather=None):
        super().__init__()
        self.module = module
        self.comm = comm_for(comm, process_group)
        self.gather = gather
        broadcast_module(module, self.comm)
        names = {id(p): k for k, p in module.named_parameters()}
        modules = list(default_units(module) if units is None else units) + [module]
        owner: dict = {}
        self.units: list[_Unit] = []
        for m in modules:
            mine = [p for p in m.parameters() if p.requires_grad and id(p) not in owner]
            for p in mine:
                owner[id(p)] = len(self.units)
            layout = FlatUnit(mine, self.comm.size, [names[id(p)] for p in mine])
            self.units.append(_Unit(len(self.units), m, layout, self.comm.rank))
        for u in self.units:
            inside = {id(x) for x in u.module.modules()}
            u.needs = sorted({owner[id(p)] for p in u.module.parameters() if id(p) in owner and (
                owner[id(p)] == u.index or id(self.units[owner[id(p)]].module) not in inside)})
            if u.needs:
                u.module.register_forward_pre_hook(lambda m, args, u=u: self._before_forward(u))
                u.module.register_forward_hook(lambda m, args, out, u=u: self._after_forward(u, out))
        self._sharded = [u for u in self.units if u.shard is not None]
        self.reducer = GradientReducer(
            [u.layout for u in self._sharded], self.comm.size, self._launch, self._finish,
            ordered=False, max_in_flight=1, flush_untouched=False,
            on_full=lambda slot: self._after_backward(self._sharded[slot.index]),
            after_flush=self._release_all)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sharded_parameters(self) -> list[torch.Tensor]:
        """This rank's shard of each unit: what the optimizer steps (gradients land in ``.grad``)."""
        return [u.shard for u in self._sharded]

    def master_shards(self, master_weights: dict) -> dict:
        """Mixed precision: ``{shard: this rank's fp32 slice of master_weights}`` (the ``{16-bit
        parameter: fp32 copy}`` of :func:`~minitrain.precision.cast_model_`), for
        :func:`~minitrain.parallel.zero.shard_optimizer`.  A unit with a parameter missing from it
        is left out (its master then starts from the 16-bit shard, upcast)."""
        return {u.shard: master_shard(u.layout, self.comm.rank, master_weights)
                for u in self._sharded if all(p in master_weights for p in u.layout.params)}

    # -- gathering and freeing -----------------------------------------------------------------------

    def _acquire(self, u: _Unit) -> None:
        if u.refs == 0:
            u.allocate()
            if self.gather is None:
                all_gather_unit(u.full, u.shard, self.comm, u.index)
            else:
                self.gather(u.full, u.shard, self.comm)
        u.refs += 1

    def _release(self, u: _Unit) -> None:
        u.refs -= 1
        if u.refs == 0:
            u.free()

    def _before_forward(self, u: _Unit) -> None:
        for k in u.needs:
            self._acquire(self.units[k])

    def _after_forward(self, u: _Unit, out):
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
            for k in u.needs:
                self._acquire(self.units[k])

    def _after_backward(self, u: _Unit) -> None:
        if u.held_for_backward:
            u.held_for_backward = False
            for k in u.needs:
                self._release(self.units[k])

    def _release_all(self) -> None:
        for u in self.units:
            self._after_backward(u)

    def _launch(self, slot):
        u = self._sharded[slot.index]
        slot.out = torch.empty_like(u.shard)
        return self.comm.reduce_scatter(slot.out, slot.buffer, async_op=True,
                                        tag=f"grad-unit{u.index}")

    def _finish(self, slot) -> None:
        """Add the averaged gradient shard into ``shard.grad``."""
        u = self._sharded[slot.index]
        u.shard.grad = slot.out if u.shard.grad is None else u.shard.grad.add_(slot.out)

    # -- full parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The whole model's state_dict (cloned), gathered on every rank (a collective: every rank
        must call it)."""
        for u in self._sharded:
            self._acquire(u)
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for u in self._sharded:
            self._release(u)
        return state

    def is_gathered_parameter(self, t: torch.Tensor) -> bool:
        """True if ``t`` shares storage with a gathered unit (the activation meter skips those)."""
        ptr = t.untyped_storage().data_ptr()
        return any(u.refs > 0 and u.full.untyped_storage().data_ptr() == ptr
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
