"""ZeRO stages 1 and 2, and ZeRO-Offload, from scratch (lesson 04; mixed precision in lesson 07).

Papers: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20); Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"
(USENIX ATC'21).  Each rank keeps and steps the optimizer states of its shard of the flat, padded
parameter vector (:class:`~minitrain.parallel.flat.FlatUnit`): stage 1
(:class:`ZeroRedundancyOptimizer`) reduce-scatters the gradients after backward (:func:`zero1_step`,
the lesson's exercise), stage 2 (:class:`Zero2Optimizer`) bucket by bucket during it (and drops the
full gradients); the updated shards are all-gathered.  :class:`HostOffload` keeps the fp32 masters, the states and the
step on the host.  Stage 3 is :mod:`minitrain.parallel.fsdp`.  Limits: one parameter group and
one dtype; fp16 loss scaling is not supported (an overflow verdict would need every rank's shard).
"""

from __future__ import annotations


import torch

from ..comm import Comm
from ..precision import MixedPrecisionOptimizer
from .data_parallel import comm_for
from .flat import FlatUnit, GradientReducer, SlotHooks, bucket_caps, make_buckets
from ..device import now

__all__ = ["zero1_step", "master_shard", "shard_optimizer", "HostOffload", "ZeroRedundancyOptimizer",
           "Zero2Optimizer", "reduce_scatter_when_full", "wait_for_shards", "ShardComm"]


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


@torch.no_grad()
def zero1_step(flat_params: torch.Tensor, flat_grads: torch.Tensor, shard: torch.Tensor,
               optimizer, comm: Comm) -> None:
    """ZeRO-1's step of one flat unit on this rank (lesson 04's exercise writes it).

    ``flat_grads``: this rank's own gradient (its part of the batch), flat and zero-padded like
    ``flat_params`` to a multiple of N.  ``shard``: this rank's slice of ``flat_params`` (a view),
    the one parameter ``optimizer`` steps.  One reduce-scatter leaves this rank the sum of its
    slice over the ranks (divided by N: the average), the optimizer steps the shard in place, and
    one all-gather brings every rank's updated shard into ``flat_params``: 2(N−1)/N of the
    gradient's bytes per rank, what an all-reduce of it would send.
    """
    grad = torch.empty_like(shard)
    comm.reduce_scatter(grad, flat_grads, tag="grad")
    shard.grad = grad.div_(comm.size)
    optimizer.step()
    comm.all_gather(flat_params, shard.clone(), tag="params")  # the input must not alias the output


# --------------------------------------------------------------------------------------------------
# Stage 2's two hooks: each bucket reduce-scattered as soon as it is full (the lesson-04 exercise)
# --------------------------------------------------------------------------------------------------


def reduce_scatter_when_full(bucket, i: int, grad: torch.Tensor, comm) -> None:
    """ZeRO-2's gradient hook, called during backward as soon as parameter ``i``'s gradient is
    ready: put it, divided by N, in its place in the bucket; once the bucket is full, start its
    reduce-scatter without waiting (``bucket.work``), into ``bucket.grad_shard`` — this rank keeps
    only its shard of the bucket's mean gradient, and the full one is dropped (the hooks' caller
    sets ``p.grad = None``)."""
    torch.mul(grad, 1.0 / comm.size, out=bucket.views[i])
    bucket.ready.add(i)
    if len(bucket.ready) == len(bucket.views):
        bucket.work = comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)


def wait_for_shards(buckets: list) -> None:
    """ZeRO-2's end of backward: wait until every bucket's reduce-scatter has completed."""
    for bucket in buckets:
        bucket.work.wait()


class ShardComm:
    """The ``comm`` ZeRO-2's ``grad_ready`` gets with one bucket: ``size``, ``rank`` and
    ``reduce_scatter(output, input, async_op=False)`` (traced as the bucket's ``grad-bucketK``),
    which notes when it was launched, for the timeline."""

    def __init__(self, comm: Comm, slot):
        self.comm, self.slot = comm, slot
        self.size, self.rank = comm.size, comm.rank

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        self.slot.launched_at = now()
        return self.comm.reduce_scatter(output, input, async_op=async_op,
                                        tag=f"grad-bucket{self.slot.index}")


class _Bucket:
    """One unit of ZeroRedundancyOptimizer: a flat parameter buffer, its shard, its gradient shard."""

    def __init__(self, layout: FlatUnit, rank: int):
        self.layout = layout
        lo, hi = layout.owned_range(rank)
        self.flat = layout.bind()  # the parameters now live in the flat buffer
        self.shard = self.flat[lo:hi]  # what this rank's optimizer steps, in place
        self.grad_shard: torch.Tensor | None = None


class ZeroRedundancyOptimizer(_WrappedOptimizer):
    """ZeRO stage 1: each rank keeps and steps the optimizer states of its shard only.

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
        offload: the fp32 master shard, the optimizer states and the step on the host (:class:`HostOffload`).
        master_weights: mixed precision — ``{16-bit parameter: fp32 copy}`` from
            :func:`~minitrain.precision.cast_model_`.  16-bit parameters are reduced and gathered in
            16 bits and stepped on fp32 master *shards* cut from these (:func:`shard_optimizer`);
            without it a 16-bit parameter's master starts from its rounded value.
        zero1_step: the step, ``zero1_step(flat_params, flat_grads, shard, optimizer, comm)`` with
            this rank's own flat gradient (the lesson-04 exercise).  Default None: the package's
            :func:`zero1_step`.  Not with ``reduce_gradients=False`` (nothing left to reduce).
        **defaults: the optimizer's arguments (``lr=...``).

    ``step()`` then steps the shard and all-gathers the updated parameters into every rank's buffers.
    Every rank must start from the same weights (rank 0's are broadcast, untraced as ``init``).
    Stage 2, the gradients sharded too, is :class:`Zero2Optimizer`.
    """

    def __init__(self, params, optimizer_class, comm: Comm | None = None, process_group=None, *,
                 reduce_gradients: bool = True, offload: bool = False,
                 master_weights: dict | None = None, zero1_step=None, **defaults):
        if zero1_step is not None and not reduce_gradients:
            raise ValueError("zero1_step= is the step from each rank's own gradients; with "
                             "reduce_gradients=False there is nothing to reduce")
        self.zero1_step = zero1_step  # None: the package's zero1_step
        self.reduce_gradients = reduce_gradients
        names, tensors = self._shard(params, comm, process_group)
        self._build([FlatUnit(tensors, self.comm.size, names)], optimizer_class, offload,
                    master_weights, defaults)

    def _shard(self, params, comm, process_group) -> tuple[list, list]:
        """The communicator and the parameters to shard: ``(names, tensors)``."""
        self.comm = comm_for(comm, process_group)
        names, tensors = _trainable(params)
        if not tensors:
            raise ValueError(f"{type(self).__name__} got no parameters that require grad")
        self.params = tensors
        return names, tensors

    def _build(self, layouts: list[FlatUnit], optimizer_class, offload: bool, master_weights,
               defaults: dict) -> None:
        """Bind the parameters into the units' flat buffers, broadcast rank 0's weights, and build
        the optimizer of this rank's shards."""
        r = self.comm.rank
        self.offload = offload
        self.buckets = [_Bucket(layout, r) for layout in layouts]
        with torch.no_grad():
            for b in self.buckets:
                self.comm.broadcast(b.flat, src=0, tag="init")
        masters = {b.shard: master_shard(b.layout, r, master_weights)
                   for b in self.buckets} if master_weights else None
        self.optim = shard_optimizer([b.shard for b in self.buckets], optimizer_class, masters,
                                     offload, **defaults)

    # -- what torch.optim users expect (state, param_groups: _WrappedOptimizer) ----------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for b in self.buckets:
            b.grad_shard = None

    @torch.no_grad()
    def step(self, closure=None):
        """:func:`zero1_step` (or the ``zero1_step`` given) from each rank's own flat gradient;
        with gradients already averaged by a DDP: this rank's slice of them stepped, all-gathered."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.reduce_gradients:  # one flat unit: one optimizer step
            step = self.zero1_step or zero1_step
            for b in self.buckets:
                flat_grads = b.layout.flatten([p.grad for p in b.layout.params])
                step(b.flat, flat_grads, b.shard, self.optim, self.comm)
                b.shard.grad = None
            return loss
        for b in self.buckets:
            lo, hi = b.layout.owned_range(self.comm.rank)
            b.grad_shard = b.layout.flatten([p.grad for p in b.layout.params])[lo:hi].clone()
        self._step_shards()
        for b in self.buckets:
            b.grad_shard = None  # stage 1 keeps the full gradients; the shard was transient
        return loss

    def _step_shards(self) -> None:
        """Step each bucket's shard on its ``grad_shard``, then all-gather the updated shards."""
        for b in self.buckets:
            b.shard.grad = b.grad_shard
        self.optim.step()
        for b in self.buckets:
            b.shard.grad = None
        self._all_gather_parameters()

    def _all_gather_parameters(self) -> None:
        for b in self.buckets:
            # the input must not alias the output: send a copy of the shard
            self.comm.all_gather(b.flat, b.shard.clone(), tag="params")

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


class Zero2Optimizer(ZeroRedundancyOptimizer):
    """ZeRO stage 2: the gradients sharded too, reduce-scattered bucket by bucket *during* backward
    from hooks, and the full ``.grad`` not kept.

    Built as :class:`ZeroRedundancyOptimizer` (``params``, ``optimizer_class``, ``comm`` /
    ``process_group``, ``offload``, ``master_weights``, ``**defaults``), plus:

        bucket_cap_mb: the buckets' size in MiB, as our DDP's (:func:`~.flat.make_buckets`).
        zero2_hooks: the hooks ``(grad_ready(bucket, i, grad, comm), end_of_backward(buckets))``
            (:func:`reduce_scatter_when_full`, :func:`wait_for_shards`: the lesson-04 exercise),
            in place of the package's own launch, which reduce-scatters full buckets strictly in
            order.  ``bucket``: ``buffer``, ``views[i]``, ``ready``, ``work``, ``index``,
            ``grad_shard``; ``comm``: a :class:`ShardComm`.

    ``step()`` steps the gradient shards reduced in backward and all-gathers the parameters.  The
    reducer (``.reducer``, a :class:`~.flat.GradientReducer`) keeps a timeline when its
    ``timeline`` is set to a list.
    """

    def __init__(self, params, optimizer_class, comm: Comm | None = None, process_group=None, *,
                 bucket_cap_mb: float | None = None, offload: bool = False,
                 master_weights: dict | None = None, zero2_hooks=None, **defaults):
        names, tensors = self._shard(params, comm, process_group)
        n = self.comm.size
        layouts = make_buckets(tensors, *bucket_caps(bucket_cap_mb), world_size=n, names=names)
        self._build(layouts, optimizer_class, offload, master_weights, defaults)
        comms: dict = {}

        def hook_comm(slot):
            if slot.index not in comms:
                comms[slot.index] = ShardComm(self.comm, slot)
            return comms[slot.index]
        hooks = SlotHooks(*zero2_hooks, comm=hook_comm) if zero2_hooks else None
        self.reducer = GradientReducer(layouts, n, self._launch, self._finish, hooks=hooks)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_shards()
        return loss

    # -- during backward (the reducer's callbacks) ---------------------------------------------------

    def _launch(self, slot):
        slot.out = torch.empty_like(self.buckets[slot.index].shard)
        return self.comm.reduce_scatter(slot.out, slot.buffer, async_op=True,
                                        tag=f"grad-bucket{slot.index}")

    def _finish(self, slot) -> None:
        b = self.buckets[slot.index]
        out = slot.grad_shard if self.reducer.hooks is not None else slot.out
        b.grad_shard = out if b.grad_shard is None else b.grad_shard.add_(out)
