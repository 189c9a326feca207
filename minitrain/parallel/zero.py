"""ZeRO stages 1 and 2, and ZeRO-Offload, from scratch (lesson 04; mixed precision in lesson 07).

Papers: Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20); Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"
(USENIX ATC'21).  Each rank keeps and steps the optimizer states of its shard of the flat, padded
parameter vector (:class:`~minitrain.parallel.flat.FlatUnit`): stage 1 reduce-scatters the
gradients after backward, stage 2 bucket by bucket during it (and drops the full gradients); the
updated shards are all-gathered.  :class:`HostOffload` keeps the fp32 masters, the states and the
step on the host.  Stage 3 is :mod:`minitrain.parallel.fsdp`.  Limits: one parameter group and
one dtype; fp16 loss scaling is not supported (an overflow verdict would need every rank's shard).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..precision import MixedPrecisionOptimizer
from .data_parallel import comm_for
from .flat import FlatUnit, GradientReducer, bucket_caps, make_buckets

__all__ = ["master_shard", "shard_optimizer", "HostOffload", "ZeroRedundancyOptimizer"]


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
        self.flat = layout.bind()  # the parameters now live in the flat buffer
        self.shard = self.flat[lo:hi]  # what this rank's optimizer steps, in place
        self.grad_shard: torch.Tensor | None = None


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
        step_shard: stage 1 only: ``step_shard(flat_params, grad, shard, optimizer, comm)`` takes the
            step from the averaged flat gradient (every rank holds all of it: it is all-reduced
            instead of reduce-scattered): give the shard its slice, step, all-gather into
            ``flat_params`` (the lesson-04 exercise).  Default None: the package's own step.
        **defaults: the optimizer's arguments (``lr=...``).

    ``step()`` then steps the shard and all-gathers the updated parameters into every rank's buffers.
    Every rank must start from the same weights (rank 0's are broadcast, untraced as ``init``).
    """

    def __init__(self, params, optimizer_class, comm: Comm | None = None, process_group=None, *,
                 reduce_gradients: bool = True, shard_gradients: bool = False,
                 bucket_cap_mb: float | None = None, offload: bool = False,
                 master_weights: dict | None = None, step_shard=None, **defaults):
        self.comm = comm_for(comm, process_group)
        self.stage = 2 if shard_gradients else 1
        if step_shard is not None and shard_gradients:
            raise ValueError("step_shard= replaces stage 1's step; stage 2 reduces in backward")
        self.step_shard = step_shard
        self.reduce_gradients = reduce_gradients or shard_gradients
        self.offload = offload
        names, tensors = _trainable(params)
        if not tensors:
            raise ValueError("ZeroRedundancyOptimizer got no parameters that require grad")
        self.params = tensors
        n, r = self.comm.size, self.comm.rank
        if shard_gradients:
            layouts = make_buckets(tensors, *bucket_caps(bucket_cap_mb), world_size=n, names=names)
        else:
            layouts = [FlatUnit(tensors, n, names)]
        self.buckets = [_Bucket(layout, r) for layout in layouts]
        with torch.no_grad():
            for b in self.buckets:
                self.comm.broadcast(b.flat, src=0, tag="init")
        masters = {b.shard: master_shard(b.layout, r, master_weights)
                   for b in self.buckets} if master_weights else None
        self.optim = shard_optimizer([b.shard for b in self.buckets], optimizer_class, masters,
                                     offload, **defaults)
        if shard_gradients:
            self.reducer = GradientReducer(layouts, n, self._launch, self._finish)

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
        if self.step_shard is not None:
            for b in self.buckets:
                self.step_shard(b.flat, self._averaged_gradient(b), b.shard, self.optim, self.comm)
                b.shard.grad = None
            return loss
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

    def _averaged_gradient(self, b: _Bucket) -> torch.Tensor:
        """The whole averaged flat gradient, on every rank (for ``step_shard``)."""
        flat = b.layout.flatten([p.grad for p in b.layout.params])
        if self.reduce_gradients:
            self.comm.all_reduce(flat, tag="grad")
            flat.div_(self.comm.size)
        return flat

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

    # -- stage 2: during backward (the reducer's callbacks) ------------------------------------------

    def _launch(self, slot):
        slot.out = torch.empty_like(self.buckets[slot.index].shard)
        return self.comm.reduce_scatter(slot.out, slot.buffer, async_op=True,
                                        tag=f"grad-bucket{slot.index}")

    def _finish(self, slot) -> None:
        b = self.buckets[slot.index]
        b.grad_shard = slot.out if b.grad_shard is None else b.grad_shard.add_(slot.out)

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



# TEMPORARY (until the harness lands): the strategies
import abc  # noqa: E402
import math  # noqa: E402

import torch.nn as nn  # noqa: E402

from ..memory import ActivationMeter, ledger, model_state_bytes, rss_bytes  # noqa: E402
from ..strategies import ConfigError, Strategy, TrainConfig, register  # noqa: E402
from .data_parallel import _DataParallelStrategy  # noqa: E402


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
        from .fsdp import FullyShardedDataParallel
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
