"""ZeRO stages 1, 2 and 3, and ZeRO-Offload, from scratch (lesson 04; precision in lesson 07).

Papers: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20); Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"
(USENIX ATC'21).  Seeds 001 (16 bytes per parameter) and 003 (ZeRO stages, offload).

Data parallelism keeps N identical copies of everything: parameters, gradients and optimizer
states — 16 bytes per parameter with Adam, on every rank.  ZeRO removes the redundancy by giving
each rank one N-th of the *model states*, in three stages:

* **stage 1** (:class:`ZeroRedundancyOptimizer`) — the optimizer states.  After backward each rank
  reduce-scatters the gradients (it only needs the averaged gradient of its own shard), steps its
  shard, and all-gathers the updated parameters: reduce-scatter + all-gather move the same 2Ψ as
  DDP's all-reduce.
* **stage 2** (``ZeroRedundancyOptimizer(..., shard_gradients=True)``) — the gradients too: each
  bucket of gradients is reduce-scattered as soon as backward has produced it (launched from
  autograd hooks, overlapped with the rest of backward, as in our DDP) and the full gradients are
  dropped; each rank keeps only its gradient shard.
* **stage 3** (:class:`FullyShardedDataParallel`, FSDP-style) — the parameters too.  A unit (the
  embedding, each transformer block, the head) all-gathers its parameters just before its forward,
  frees them after, all-gathers them again just before its backward, and reduce-scatters its
  gradients after it: 3Ψ per step instead of 2Ψ, i.e. 1.5× DDP's traffic.
* **offload** (:class:`HostOffload`, ZeRO-Offload) — the fp32 master shard, the optimizer states and
  the optimizer step live in host memory; the gradient shard goes device→host, the updated shard
  host→device.  On a CPU run that is a copy between two CPU buffers, but the ledger still tells
  ``device`` from ``host`` bytes so the lesson can show what moved.

The partition: a group of parameters (a *unit*) is flattened in parameter order into one vector,
padded with zeros to a multiple of N, and rank r owns elements [r·S, (r+1)·S), S = padded / N
(:class:`FlatUnit`, :func:`shard_layout`).  Stage 1 uses one unit for the whole model, exactly the
paper's picture; stage 2 uses one per gradient bucket, stage 3 one per module it wraps, so that each
can be reduce-scattered (and gathered) on its own.

**Mixed precision** (``--precision bf16-mixed``, lesson 07): the model is bf16, so are the flat
buffers, the gradients, the reduce-scatters and the all-gathers — half the bytes of fp32 on the
wire.  Each rank's optimizer holds fp32 *master* weights for its shard only, cut from the fp32
weights taken before the cast (:func:`master_shard`), next to Adam's moments
(:func:`shard_optimizer`: a :class:`~minitrain.precision.MixedPrecisionOptimizer` on the shard).
A step upcasts the bf16 gradient shard, steps the fp32 master shard and rounds it into the bf16
parameter shard; stages 1–2 then all-gather it, in stage 3 that shard *is* the parameter.  With
offload the masters, moments and step are on the host, the bf16 gradient shard is copied over.
The averaged gradient is summed in bf16, so a run equals the single bf16 process within bf16's
rounding (as DDP in bf16 does, tests/test_precision.py), not within 1e-5.

Memory per rank (measured by :func:`minitrain.memory.ledger`, compared with
:func:`~minitrain.memory.model_state_bytes`): in bf16-mixed (``recipe="mixed-adam"``: 2 + 2 + 12
bytes) the paper's 4Ψ+12Ψ/N, 2Ψ+14Ψ/N and 16Ψ/N; in fp32 (``recipe="fp32-adam"``: 4 + 4 + 8 bytes)
8Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N.  Sharded tensors hold the padding too: at most N−1 elements per unit.

Limits, for a short file: fp32 and bf16-mixed only — fp16-mixed is refused, since its loss scaler
would have to skip a step when *any* rank's gradient shard overflowed (an all-reduce of the
verdict this file does not do); the masters must be equal on every rank (rank 0's 16-bit weights
are broadcast, the fp32 masters are not: build the model from the same seed everywhere); one
parameter group and one dtype; every rank must use the same parameters in a step (a parameter unused
on every rank may get a zero gradient rather than ``None``: stages 1–2 always, stage 3 when the
rest of its unit is used); frozen parameters (``requires_grad=False``) are not
sharded — they stay whole on every rank, as buffers do — and get no gradient or optimizer state.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm
from ..memory import ActivationMeter, ledger, model_state_bytes, rss_bytes
from ..precision import MixedPrecisionOptimizer
from ..strategies import ConfigError, Strategy, TrainConfig, register
from .data_parallel import (DEFAULT_BUCKET_MB, FIRST_BUCKET_BYTES, MIB, _DataParallelStrategy,
                            broadcast_module, make_buckets)

__all__ = ["FlatUnit", "ShardLayout", "shard_layout", "master_shard", "shard_optimizer",
           "HostOffload", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "default_units"]


def _comm_for(comm: Comm | None, process_group) -> Comm:
    if comm is not None and process_group is not None:
        raise ValueError("pass either comm= or process_group=, not both")
    return comm if comm is not None else Comm(process_group)


# --------------------------------------------------------------------------------------------------
# The partition
# --------------------------------------------------------------------------------------------------


class FlatUnit:
    """Parameters laid end to end in one flat vector, zero-padded to a multiple of ``world_size``.

    Rank r owns the flat elements ``[r·S, (r+1)·S)`` with ``S = total / world_size``.  ``names`` label
    the parameters in :meth:`owned_params` (default: their index).
    """

    def __init__(self, params: list, world_size: int, names: list | None = None):
        self.params = list(params)
        self.names = list(names) if names is not None else list(range(len(self.params)))
        self.world_size = world_size
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.shard_size = math.ceil(self.numel / world_size)
        self.total = self.shard_size * world_size
        self.padding = self.total - self.numel

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

    def flatten(self, tensors: list, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One padded flat vector from ``tensors`` laid out like the parameters (None: zeros), in
        ``dtype`` (default: the parameters')."""
        p0 = self.params[0]
        flat = torch.zeros(self.total, dtype=dtype or p0.dtype, device=p0.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat


@dataclass
class ShardLayout:
    """Who owns what, for a sharding widget: ``owned[r] = (start, end)`` in the padded flat vector of
    ``total`` elements (``padding`` of them zeros at the end); ``params[r]`` lists ``(name, start,
    end)`` element ranges of the parameters rank r owns; ``boundaries`` each parameter's
    ``(name, start, end)`` in the flat vector."""

    world_size: int
    numel: int
    total: int
    shard_size: int
    padding: int
    owned: list
    params: list
    boundaries: list


def shard_layout(params, world_size: int) -> ShardLayout:
    """The ZeRO partition of ``params`` (tensors, or ``(name, tensor)`` pairs) over ``world_size``
    ranks: flattened in order, padded to a multiple of N, rank r owns ``[r·S, (r+1)·S)``."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        names, tensors = [n for n, _ in params], [p for _, p in params]
    else:
        names, tensors = list(range(len(params))), params
    unit = FlatUnit(tensors, world_size, names)
    return ShardLayout(world_size, unit.numel, unit.total, unit.shard_size, unit.padding,
                       [unit.owned_range(r) for r in range(world_size)],
                       [unit.owned_params(r) for r in range(world_size)],
                       [(n, o, o + k) for n, o, k in zip(names, unit.offsets, unit.numels)])


def _trainable(params) -> tuple[list, list]:
    """(names, tensors) of the distinct parameters that require grad (a tied one counted once)."""
    names, tensors, seen = [], [], set()
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (i, item)
        if isinstance(p, dict):
            raise ValueError("minitrain's ZeRO takes one parameter group: pass the parameters")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
            tensors.append(p)
    if len({p.dtype for p in tensors}) > 1:
        raise ValueError("minitrain's ZeRO shards parameters of one dtype only; got "
                         f"{sorted({str(p.dtype) for p in tensors})}")
    return names, tensors


def master_shard(layout: FlatUnit, rank: int, master_weights: dict) -> torch.Tensor:
    """This rank's slice of a unit's fp32 master weights: ``master_weights`` (``{16-bit parameter:
    fp32 copy}``, from :func:`~minitrain.precision.cast_model_`) flattened and padded like the
    parameters, then cut like the parameter shard.  A parameter missing from it is upcast."""
    lo, hi = layout.owned_range(rank)
    masters = [master_weights.get(p, p).detach() for p in layout.params]
    return layout.flatten(masters, dtype=torch.float32)[lo:hi].clone()


def shard_optimizer(shards: list, optimizer_class, master_weights: dict | None = None,
                    offload: bool = False, **defaults):
    """The optimizer that steps this rank's shards.

    fp32 shards: ``optimizer_class`` itself.  16-bit shards (mixed precision, lesson 07): a
    :class:`~minitrain.precision.MixedPrecisionOptimizer` — fp32 masters (``master_weights``,
    ``{shard: fp32 slice}`` from :func:`master_shard`) and Adam's moments in its ``state``, 4 + 8 =
    12 bytes per owned element; it upcasts the 16-bit gradient shard, steps the masters and rounds
    them into the 16-bit shard.  ``offload``: :class:`HostOffload`, the same on the host.
    """
    if offload:
        return HostOffload(shards, optimizer_class, master_weights=master_weights, **defaults)
    if all(s.dtype == torch.float32 for s in shards):
        return optimizer_class(shards, **defaults)
    return MixedPrecisionOptimizer(shards, optimizer_class, master_weights=master_weights,
                                   **defaults)


# --------------------------------------------------------------------------------------------------
# Offload: the optimizer step on the host (ZeRO-Offload)
# --------------------------------------------------------------------------------------------------


class _WrappedOptimizer:
    """What torch.optim users expect of our optimizers, forwarded to the inner one (``self.optim``)
    that steps ``self.params``' stand-ins (host masters or shards)."""

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


class HostOffload(_WrappedOptimizer):
    """An optimizer whose fp32 master copy, states and step live in host memory (Ren et al., 2021).

    ``params`` stay where they are (the device shards, fp32 or 16-bit); ``step()`` copies each
    one's ``.grad`` device→host (in the gradient's own dtype: 2 bytes per element under bf16),
    upcasts it to fp32 on the host, runs ``optimizer_class`` on the host masters, and copies them
    back host→device (rounded to the parameter's dtype).  ``master_weights`` (``{param: fp32
    tensor}``) gives the masters' starting values; a parameter missing from it starts from its own
    value.  On a GPU the host buffers are pinned, so the copies are real PCIe transfers.
    """

    def __init__(self, params, optimizer_class, master_weights: dict | None = None, **defaults):
        self.params = list(params)
        master_weights = master_weights or {}
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.params)

        def host_like(p, dtype):
            return torch.empty(p.shape, dtype=dtype, device="cpu", pin_memory=pin)

        self.masters = [host_like(p, torch.float32).copy_(master_weights.get(p, p).detach())
                        for p in self.params]
        self.host_grads = [host_like(p, p.dtype) for p in self.params]
        self.optim = optimizer_class(self.masters, **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p, m, g in zip(self.params, self.masters, self.host_grads):
            # device -> host; a 16-bit gradient is upcast on the host, for the step only
            m.grad = g.copy_(p.grad).float() if p.grad is not None else None
        self.optim.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # host -> device (rounded to nearest, for a 16-bit parameter)
            p.grad = m.grad = None  # the gradient now lives on the host
        return loss

    def state_dict(self) -> dict:
        """The host masters and the inner optimizer's state (what a checkpoint saves)."""
        return {"masters": self.masters, "optimizer": self.optim.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for p, m, saved in zip(self.params, self.masters, state["masters"], strict=True):
            m.copy_(saved)
            p.copy_(m)
        self.optim.load_state_dict(state["optimizer"])

    def memory_tensors(self) -> tuple[dict, list]:
        """({kind: tensors} the ledger would not find by itself, the tensors living on the host)."""
        states = [v for s in self.optim.state.values() for v in s.values() if torch.is_tensor(v)]
        return ({"optimizer_states": self.masters, "gradients": self.host_grads},
                self.masters + self.host_grads + states)


# --------------------------------------------------------------------------------------------------
# Stages 1 and 2: a sharded optimizer
# --------------------------------------------------------------------------------------------------


class _Bucket:
    """One unit of ZeroRedundancyOptimizer: a flat parameter buffer, its shard, its gradient shard."""

    def __init__(self, layout: FlatUnit, rank: int):
        self.layout = layout
        lo, hi = layout.owned_range(rank)
        self.flat = layout.flatten([p.detach() for p in layout.params])
        for p, view in zip(layout.params, layout.views(self.flat)):
            p.data = view  # the parameters now live in the flat buffer (torch: parameters_as_bucket_view)
        self.shard = self.flat[lo:hi]  # what this rank's optimizer steps, in place
        self.grad_shard: torch.Tensor | None = None
        self.grad_flat: torch.Tensor | None = None  # stage 2, during backward only
        self.grad_views: list = []
        self.ready: set = set()
        self.work = None
        self.incoming: torch.Tensor | None = None


class ZeroRedundancyOptimizer(_WrappedOptimizer):
    """ZeRO stage 1 (and 2): each rank keeps and steps the optimizer states of its shard only.

    Built like ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class,
    process_group=None, **defaults)``, so either can be swapped in.  Arguments:

        params: the parameters (tensors or ``(name, tensor)`` pairs; one group, one dtype).  They are
            moved into flat buffers: each becomes a view of its unit's buffer.
        optimizer_class: e.g. ``torch.optim.AdamW``, run on this rank's flat fp32 shard.
        comm / process_group: the data-parallel ranks (default: the whole world).
        reduce_gradients: True (default): ``step()`` averages the gradients itself, with one
            reduce-scatter (each rank only needs its shard of the average) — use it *without* DDP.
            False: the gradients are already averaged (the model is wrapped in a DDP, as torch's
            ZeroRedundancyOptimizer expects) and each rank just reads its slice.
        shard_gradients: stage 2.  Gradients are reduce-scattered bucket by bucket *during* backward,
            from hooks (``bucket_cap_mb`` as our DDP's), and the full ``.grad`` are not kept.
        offload: the fp32 master shard, the optimizer states and the step on the host (:class:`HostOffload`).
        master_weights: mixed precision — ``{16-bit parameter: fp32 copy}`` from
            :func:`~minitrain.precision.cast_model_`.  16-bit parameters are reduced and gathered in
            16 bits and stepped on fp32 master *shards* cut from these (:func:`shard_optimizer`);
            without it a 16-bit parameter's master starts from its rounded value.
        **defaults: the optimizer's arguments (``lr=...``).

    ``step()`` then steps the shard and all-gathers the updated parameters into every rank's buffers.
    Every rank must start from the same weights (rank 0's are broadcast, untraced as ``init``).
    """

    def __init__(self, params, optimizer_class, comm: Comm | None = None, process_group=None, *,
                 reduce_gradients: bool = True, shard_gradients: bool = False,
                 bucket_cap_mb: float | None = None, offload: bool = False,
                 master_weights: dict | None = None, **defaults):
        self.comm = _comm_for(comm, process_group)
        self.stage = 2 if shard_gradients else 1
        self.reduce_gradients = reduce_gradients or shard_gradients
        self.offload = offload
        names, tensors = _trainable(params)
        if not tensors:
            raise ValueError("ZeroRedundancyOptimizer got no parameters that require grad")
        self.params = tensors
        n, r = self.comm.size, self.comm.rank
        if shard_gradients:
            cap, first = ((DEFAULT_BUCKET_MB * MIB, FIRST_BUCKET_BYTES) if bucket_cap_mb is None
                          else (bucket_cap_mb * MIB, None))
            name_of = {id(p): k for k, p in zip(names, tensors)}
            groups = [[(name_of[id(p)], p) for p in b.params] for b in make_buckets(tensors, cap, first)]
        else:
            groups = [list(zip(names, tensors))]
        self.buckets = [_Bucket(FlatUnit([p for _, p in g], n, [k for k, _ in g]), r) for g in groups]
        with torch.no_grad():
            for b in self.buckets:
                self.comm.broadcast(b.flat, src=0, tag="init")
        masters = {b.shard: master_shard(b.layout, r, master_weights)
                   for b in self.buckets} if master_weights else None
        self.optim = shard_optimizer([b.shard for b in self.buckets], optimizer_class, masters,
                                     offload, **defaults)
        self._in_backward = False
        if shard_gradients:
            for b in self.buckets:
                for i, p in enumerate(b.layout.params):
                    p.register_post_accumulate_grad_hook(
                        lambda p, b=b, i=i: self._grad_ready(b, i, p))

    # -- what torch.optim users expect (state, param_groups: _WrappedOptimizer) ----------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for b in self.buckets:
            b.grad_shard = None

    @torch.no_grad()
    def step(self, closure=None):
        """Average (stage 1) or collect (stage 2) the gradient shards, step them, all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1:
            self._reduce_scatter_gradients()
        for b in self.buckets:
            b.shard.grad = b.grad_shard
        self.optim.step()
        for b in self.buckets:
            b.shard.grad = None
            if self.stage == 1:
                b.grad_shard = None  # stage 1 keeps the full gradients; the shard was transient
        self._all_gather_parameters()
        return loss

    # -- stage 1: after backward ---------------------------------------------------------------------

    def _reduce_scatter_gradients(self) -> None:
        n, r = self.comm.size, self.comm.rank
        for b in self.buckets:
            flat = b.layout.flatten([p.grad for p in b.layout.params])
            if self.reduce_gradients:
                b.grad_shard = torch.empty_like(b.shard)
                self.comm.reduce_scatter(b.grad_shard, flat, tag="grad")
                b.grad_shard.div_(n)
            else:  # already averaged by a DDP: take this rank's slice
                lo, hi = b.layout.owned_range(r)
                b.grad_shard = flat[lo:hi].clone()

    def _all_gather_parameters(self) -> None:
        for b in self.buckets:
            # the input must not alias the output: send a copy of the shard
            self.comm.all_gather(b.flat, b.shard.clone(), tag="params")

    # -- stage 2: during backward --------------------------------------------------------------------

    @torch.no_grad()
    def _grad_ready(self, b: _Bucket, i: int, p: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if b.grad_flat is None:
            b.grad_flat = torch.zeros(b.layout.total, dtype=p.dtype, device=p.device)
            b.grad_views = b.layout.views(b.grad_flat)
        torch.mul(p.grad, 1.0 / self.comm.size, out=b.grad_views[i])  # copy in, pre-divided
        p.grad = None  # the full gradient is not kept: that is stage 2
        b.ready.add(i)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Reduce-scatter every full bucket, in bucket order (all ranks issue the same calls)."""
        for b in self.buckets:
            if b.work is not None:
                continue
            if len(b.ready) < len(b.layout.params) and not force:
                return
            if b.grad_flat is None:  # a bucket no gradient reached: contribute zeros
                b.grad_flat = torch.zeros(b.layout.total, dtype=b.flat.dtype, device=b.flat.device)
            b.incoming = torch.empty_like(b.shard)
            b.work = self.comm.reduce_scatter(b.incoming, b.grad_flat, async_op=True,
                                              tag=f"grad-bucket{self.buckets.index(b)}")

    @torch.no_grad()
    def _end_backward(self) -> None:
        self._in_backward = False
        self._launch_ready(force=True)
        for b in self.buckets:
            b.work.wait()
            b.grad_shard = b.incoming if b.grad_shard is None else b.grad_shard.add_(b.incoming)
            b.grad_flat, b.grad_views, b.incoming, b.work = None, [], None, None
            b.ready.clear()

    # -- for reports and the ledger ------------------------------------------------------------------

    def layouts(self) -> list[FlatUnit]:
        return [b.layout for b in self.buckets]

    def memory_tensors(self) -> tuple[dict, list]:
        """({kind: tensors} beyond ``.grad`` and ``state``, tensors that live on the host)."""
        extra = {"gradients": [b.grad_shard for b in self.buckets if b.grad_shard is not None]}
        if not self.offload:
            return extra, []
        more, host = self.optim.memory_tensors()
        return {k: extra.get(k, []) + more.get(k, []) for k in {*extra, *more}}, host


# --------------------------------------------------------------------------------------------------
# Stage 3: fully sharded data parallel
# --------------------------------------------------------------------------------------------------


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


class _Unit:
    """One module's parameters under stage 3: a shard always, the full flat vector only in use."""

    def __init__(self, index: int, module: nn.Module, layout: FlatUnit, rank: int):
        self.index, self.module, self.layout = index, module, layout
        self.needs: list[int] = []  # the units whose parameters this module's forward uses
        self.refs = 0               # how many running forwards/backwards hold it gathered
        self.held_for_backward = False
        self.full = self.shard = None
        self.grad_flat = self.incoming = self.work = None
        self.grad_views: list = []
        self.ready: set = set()
        if layout.params:
            lo, hi = layout.owned_range(rank)
            self.full = layout.flatten([p.detach() for p in layout.params])
            for p, view in zip(layout.params, layout.views(self.full)):
                p.data = view
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

    Each unit's parameters become views of a flat buffer whose storage exists only while the unit
    runs: a forward pre-hook all-gathers it, a forward hook frees it; a :class:`_BeforeBackward` on the
    unit's output all-gathers it again when backward reaches the unit; when the unit's gradients
    are accumulated they are reduce-scattered (asynchronously) and the buffer is freed again.
    A tied parameter belongs to the first unit that has it; a unit that uses another's (the head of a
    GPT with ``tie_weights``) gathers that unit too.  Train the shards:
    ``optimizer_class(fsdp.sharded_parameters(), ...)`` — or, for a 16-bit model,
    ``shard_optimizer(fsdp.sharded_parameters(), optimizer_class, fsdp.master_shards(masters))``:
    the 16-bit shard *is* the parameter, gathered and reduce-scattered in 16 bits, and the fp32
    masters exist only as shards.  ``full_state_dict()`` gathers the model.
    """

    def __init__(self, module: nn.Module, comm: Comm | None = None, process_group=None,
                 units: list | None = None):
        super().__init__()
        self.module = module
        self.comm = _comm_for(comm, process_group)
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
            for i, p in enumerate(u.layout.params):
                p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: self._grad_ready(u, i, p))
        self._in_backward = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sharded_parameters(self) -> list[torch.Tensor]:
        """This rank's shard of each unit: what the optimizer steps (gradients land in ``.grad``)."""
        return [u.shard for u in self.units if u.shard is not None]

    def master_shards(self, master_weights: dict) -> dict:
        """Mixed precision: ``{shard: this rank's fp32 slice of master_weights}`` (the ``{16-bit
        parameter: fp32 copy}`` of :func:`~minitrain.precision.cast_model_`), for
        :func:`shard_optimizer`.  A unit with a parameter missing from it is left out (its
        master then starts from the 16-bit shard, upcast)."""
        return {u.shard: master_shard(u.layout, self.comm.rank, master_weights)
                for u in self.units if u.shard is not None
                and all(p in master_weights for p in u.layout.params)}

    # -- gathering and freeing -----------------------------------------------------------------------

    def _acquire(self, u: _Unit) -> None:
        if u.refs == 0:
            u.allocate()
            self.comm.all_gather(u.full, u.shard, tag=f"params-unit{u.index}")
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
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not u.held_for_backward:
            u.held_for_backward = True
            for k in u.needs:
                self._acquire(self.units[k])

    def _after_backward(self, u: _Unit) -> None:
        if u.held_for_backward:
            u.held_for_backward = False
            for k in u.needs:
                self._release(self.units[k])

    @torch.no_grad()
    def _grad_ready(self, u: _Unit, i: int, p: torch.Tensor) -> None:
        if u.grad_flat is None:
            u.grad_flat = torch.zeros(u.layout.total, dtype=p.dtype, device=p.device)
            u.grad_views = u.layout.views(u.grad_flat)
        torch.mul(p.grad, 1.0 / self.comm.size, out=u.grad_views[i])  # copy in, pre-divided
        p.grad = None
        u.ready.add(i)
        if len(u.ready) == len(u.layout.params):
            self._reduce_scatter(u)
            self._after_backward(u)

    def _reduce_scatter(self, u: _Unit) -> None:
        """Start reducing ``u``'s gradients; first finish the one still in flight, so that at most
        one unit's full gradient buffer waits on the network (its compute hid that one's time)."""
        for other in self.units:
            if other.work is not None:
                self._finish(other)
        if u.grad_flat is None:  # no gradient reached this unit: contribute zeros
            u.grad_flat = torch.zeros(u.layout.total, dtype=u.shard.dtype, device=u.shard.device)
        u.incoming = torch.empty_like(u.shard)
        u.work = self.comm.reduce_scatter(u.incoming, u.grad_flat, async_op=True,
                                          tag=f"grad-unit{u.index}")

    def _finish(self, u: _Unit) -> None:
        """Wait for ``u``'s reduce-scatter; add the averaged shard into ``shard.grad``; free the rest."""
        u.work.wait()
        u.shard.grad = u.incoming if u.shard.grad is None else u.shard.grad.add_(u.incoming)
        u.grad_flat, u.grad_views, u.incoming, u.work = None, [], None, None
        u.ready.clear()

    @torch.no_grad()
    def _end_backward(self) -> None:
        """Once per backward: finish units backward did not complete, wait, keep the shards."""
        self._in_backward = False
        for u in self.units:
            if u.shard is not None and u.ready and len(u.ready) < len(u.layout.params):
                self._reduce_scatter(u)  # some of its parameters got no gradient: zeros for them
            self._after_backward(u)
        for u in self.units:
            if u.work is not None:
                self._finish(u)

    # -- full parameters -----------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The whole model's state_dict (cloned), gathered on every rank (a collective: every rank
        must call it)."""
        for u in self.units:
            if u.full is not None:
                self._acquire(u)
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for u in self.units:
            if u.full is not None:
                self._release(u)
        return state

    def is_gathered_parameter(self, t: torch.Tensor) -> bool:
        """True if ``t`` shares storage with a gathered unit (the activation meter skips those)."""
        ptr = t.untyped_storage().data_ptr()
        return any(u.full is not None and u.refs > 0 and
                   u.full.untyped_storage().data_ptr() == ptr for u in self.units)

    def layouts(self) -> list[FlatUnit]:
        return [u.layout for u in self.units if u.layout.params]

    def memory_tensors(self) -> tuple[dict, list]:
        shards = self.sharded_parameters()
        return {"parameters": shards, "gradients": [s.grad for s in shards]}, []


def _map_tensors(out, fn):
    if torch.is_tensor(out):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    return out


# --------------------------------------------------------------------------------------------------
# Checkpoints (lesson 08): each rank saves its shards; the model is put back together offline
# --------------------------------------------------------------------------------------------------


def shard_state(module: nn.Module, units: list[tuple[FlatUnit, torch.Tensor]], rank: int) -> dict:
    """This rank's shard of each flat unit (``(layout, shard)`` pairs), described well enough to be
    put back together without the model: each unit's parameter names and shapes, which state_dict
    key holds which parameter (tied ones share one), and, from rank 0, any state no unit holds."""
    ids = {id(p): name for layout, _ in units for p, name in zip(layout.params, layout.names)}
    keys, extra = {}, {}
    state = module.state_dict(keep_vars=True)  # the Parameter objects: no data is touched
    for key, value in state.items():
        if id(value) in ids:
            keys[key] = ids[id(value)]
        elif rank == 0:
            extra[key] = value.detach().clone()
    return {"units": [{"names": list(layout.names), "shapes": [list(p.shape) for p in layout.params],
                       "shard": shard.detach().clone()} for layout, shard in units],
            "keys": keys, "extra": extra, "order": list(state)}


def unshard_state(states: list[dict]) -> dict:
    """The single-process state_dict from every rank's :func:`shard_state`, in rank order: each
    unit's shards concatenated (the padding dropped) and cut into its parameters."""
    params = {}
    for i, unit in enumerate(states[0]["units"]):
        flat = torch.cat([s["units"][i]["shard"] for s in states])
        offset = 0
        for name, shape in zip(unit["names"], unit["shapes"]):
            n = math.prod(shape)
            params[name] = flat[offset:offset + n].view(shape).clone()
            offset += n
    keys, extra = states[0]["keys"], states[0]["extra"]
    return {k: params[keys[k]] if k in keys else extra[k] for k in states[0]["order"]}


# --------------------------------------------------------------------------------------------------
# Strategies for `minitrain train`
# --------------------------------------------------------------------------------------------------


class _ZeroStrategy(_DataParallelStrategy):
    """Shared by zero1/2/3: the global batch split over the ranks, the model states sharded."""

    stage = 0
    precisions = ("fp32", "bf16-mixed")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        why = ("each rank sees only its shard of the gradients, so an overflow check would need "
               "every rank's verdict")
        if cfg.precision == "fp16-mixed":
            raise ConfigError(f"strategy {cls.name!r} cannot train in fp16-mixed, which needs loss "
                              f"scaling: {why}; use --precision bf16-mixed (fp32's range, no loss "
                              "scaling) or --precision fp32")
        super().check(cfg)
        if cfg.loss_scale:
            raise ConfigError(f"strategy {cls.name!r} does not scale the loss: {why}; leave out "
                              "--loss-scale (bf16-mixed needs none)")
        if cfg.options.get("bucket_mb") is not None and cfg.options["bucket_mb"] <= 0:
            raise ConfigError(f"--bucket-mb must be > 0, got {cfg.options['bucket_mb']}")

    def wrap(self, model):
        return model

    def __init__(self, cfg: TrainConfig, comm: Comm):
        Strategy.__init__(self, cfg, comm)
        self.offload = bool(cfg.options.get("offload", False))
        self.model = self.build_model()  # bf16-mixed: bf16 model, fp32 copies in master_weights
        self.wrapper, self.optimizer, self.sharded = self.shard(self.model)
        self.master_weights.clear()  # each rank keeps only its shard of them
        ignore = getattr(self.sharded, "is_gathered_parameter", None)
        self.meter = ActivationMeter(self.model, ignore=ignore)

    @abc.abstractmethod
    def shard(self, model) -> tuple:
        """(what to call forward on, the optimizer, the object holding the shards)."""

    # -- checkpoints: every rank writes its shards and its optimizer states (1/N of each) -----------

    def shards(self) -> list[tuple[FlatUnit, torch.Tensor]]:
        """``(layout, this rank's shard)`` of every flat unit (stages 1-2: the optimizer's)."""
        return [(b.layout, b.shard) for b in self.optimizer.buckets]

    def shard_optimizer(self):
        """The optimizer stepping this rank's shards (Adam, mixed precision's, or HostOffload)."""
        return self.optimizer.optim

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        out = {"offload": bool(cfg.options.get("offload", False))}
        if cls.stage == 2:  # the buckets are the units
            out["bucket_mb"] = cfg.options.get("bucket_mb")
        return out

    def checkpoint_state(self) -> dict:
        return {"model": shard_state(self.model, self.shards(), self.comm.rank),
                "optimizer": self.shard_optimizer().state_dict()}

    @torch.no_grad()
    def load_checkpoint_state(self, read) -> None:
        state = read(self.comm.rank)
        for (_, shard), saved in zip(self.shards(), state["model"]["units"], strict=True):
            shard.copy_(saved["shard"])
        self.shard_optimizer().load_state_dict(state["optimizer"])
        if self.stage < 3:  # every rank holds the full weights: gather them, as after a step
            with self.comm.tracer.paused():
                self.optimizer._all_gather_parameters()

    @classmethod
    def consolidate_checkpoint(cls, cfg: TrainConfig, read) -> dict:
        return unshard_state([read(r)["model"] for r in range(cfg.world_size)])

    def memory(self) -> dict:
        extra, host = self.sharded.memory_tensors()
        out = ledger(self.model, self.optimizer, self.meter.peak, extra=extra, host=host)
        out["rss_peak"] = rss_bytes(peak=True)
        return out

    @property
    def recipe(self) -> str:
        """The memory recipe of :data:`minitrain.memory.RECIPES` this run follows."""
        return "fp32-adam" if self.cfg.precision == "fp32" else "mixed-adam"

    def report(self) -> dict:
        """This rank's owned ranges, the padding, and its bytes beside the formula (fp32 Adam:
        4 + 4 + 8 bytes per parameter; bf16-mixed: 2 + 2 + 12)."""
        r, n = self.comm.rank, self.comm.size
        layouts = self.sharded.layouts()
        psi = sum(u.numel for u in layouts)
        padded = sum(u.total for u in layouts)
        mem = self.memory()
        return {
            "stage": self.stage, "offload": self.offload, "rank": r, "world_size": n,
            "units": len(layouts), "numel": psi, "padded_numel": padded, "padding": padded - psi,
            "shard_numel": sum(u.shard_size for u in layouts),
            "owned": [own for u in layouts for own in u.owned_params(r)],
            "device_bytes": mem["device"], "host_bytes": mem["host"],
            "recipe": self.recipe,
            "formula": model_state_bytes(psi, n, self.stage, self.recipe),
            "formula_padded": model_state_bytes(padded, n, self.stage, self.recipe),
        }


@register
class Zero1(_ZeroStrategy):
    name = "zero1"
    help = "ZeRO stage 1: optimizer states sharded; reduce-scatter, step the shard, all-gather (--offload)"
    stage = 1
    checkpoint_refusal = None

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--offload", action="store_true",
                            help="zero1/zero2/zero3: optimizer states and step on host memory")

    def shard(self, model):
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, self.comm,
                                      offload=self.offload, master_weights=self.master_weights,
                                      lr=self.cfg.lr)
        return model, opt, opt


@register
class Zero2(_ZeroStrategy):
    name = "zero2"
    help = "ZeRO stage 2: gradients too, reduce-scattered in buckets during backward (--offload, --bucket-mb)"
    stage = 2
    checkpoint_refusal = None

    def shard(self, model):
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, self.comm,
                                      shard_gradients=True, offload=self.offload,
                                      bucket_cap_mb=self.cfg.options.get("bucket_mb"),
                                      master_weights=self.master_weights, lr=self.cfg.lr)
        return model, opt, opt


@register
class Zero3(_ZeroStrategy):
    name = "zero3"
    help = "ZeRO stage 3 (FSDP): parameters too, gathered per block for forward and backward (--offload)"
    stage = 3
    checkpointing = False  # recomputation would re-enter the gather hooks; not supported yet
    checkpoint_refusal = None

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if getattr(cfg, "checkpoint_activations", False):
            raise ConfigError("strategy 'zero3' cannot checkpoint activations yet; leave out "
                              "--checkpoint-activations (or use zero1/zero2)")

    def shard(self, model):
        fsdp = FullyShardedDataParallel(model, self.comm)
        opt = shard_optimizer(fsdp.sharded_parameters(), torch.optim.Adam,
                              fsdp.master_shards(self.master_weights), self.offload, lr=self.cfg.lr)
        return fsdp, opt, _Zero3Memory(fsdp, opt if self.offload else None)

    def shards(self):
        return [(u.layout, u.shard) for u in self.wrapper.units if u.shard is not None]

    def shard_optimizer(self):
        return self.optimizer

    def fit(self, data, on_step=None):
        out = super().fit(data, on_step)
        with self.comm.tracer.paused():  # gathered for state_dict(): not training traffic
            state = self.wrapper.full_state_dict()
        self._state = state if self.comm.rank == 0 else None
        return out

    def state_dict(self) -> dict:
        """The full weights, gathered (on every rank, untraced) at the end of :meth:`fit`."""
        if getattr(self, "_state", None) is None:
            raise RuntimeError("zero3 gathers its full state at the end of fit(), on rank 0 only")
        return self._state


class _Zero3Memory:
    """The FSDP wrapper's shards plus, with offload, the host side."""

    def __init__(self, fsdp: FullyShardedDataParallel, offload: HostOffload | None):
        self.fsdp, self.offload = fsdp, offload
        self.is_gathered_parameter = fsdp.is_gathered_parameter
        self.layouts = fsdp.layouts

    def memory_tensors(self):
        extra, host = self.fsdp.memory_tensors()
        if self.offload is not None:
            more, host = self.offload.memory_tensors()
            extra = {k: extra.get(k, []) + more.get(k, []) for k in {*extra, *more}}
        extra["gradients"] = [g for g in extra.get("gradients", []) if g is not None]
        return extra, host
