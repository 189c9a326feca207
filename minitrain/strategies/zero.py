"""``zero1``, ``zero2``, ``zero3``: the model states sharded over the data-parallel ranks (lesson 04),
with ``--offload`` (ZeRO-Offload) and checkpoints in which every rank writes its own shards (lesson 08).

Memory per rank (measured by :func:`minitrain.memory.ledger`, compared with
:func:`~minitrain.memory.model_state_bytes`): in bf16-mixed (2 + 2 + 12 bytes) the paper's 4Ψ+12Ψ/N,
2Ψ+14Ψ/N and 16Ψ/N; in fp32 (4 + 4 + 8 bytes) 8Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..planning.analysis import hidden_fraction, overlap_fraction
from ..memory import ActivationMeter, ledger, model_state_bytes
from ..parallel.data_parallel import mean_over_ranks
from ..parallel.flat import FlatUnit
from ..parallel.fsdp import FullyShardedDataParallel
from ..parallel.zero import Zero2Optimizer, ZeroRedundancyOptimizer, shard_optimizer
from ..record import Layout
from .base import Checkpointer, Lockstep, TrainConfig, register
from .options import ConfigError, Options, option
from .data_parallel import Buckets, Timeline, check_batch_split, local_batch
from .portable import shard_optimizer_state, unshard_optimizer

__all__ = ["Offload", "ZeroOptions", "Zero2Options", "Zero3Options", "Zero1", "Zero2", "Zero3", "ZeroShards",
           "shard_state", "unshard_state"]


@dataclass(frozen=True)
class Offload(Options):
    offload: bool = option(False, "optimizer states, fp32 master shard and step in host memory "
                                  "(ZeRO-Offload)")


@dataclass(frozen=True)
class ZeroOptions(Offload):
    """zero1's (a record of its own: zero2's, which adds bucket_mb, is not one)."""


@dataclass(frozen=True)
class Zero3Options(Offload, Timeline):
    """zero3's: offload, and the timeline of each unit's gather, compute, free, reduce-scatter."""


@dataclass(frozen=True)
class Zero2Options(Buckets, Offload, Timeline):
    """zero2's: the gradient buckets too, and their timeline."""


# --------------------------------------------------------------------------------------------------
# Checkpoints (lesson 08): each rank saves its shards; the model is put back together offline
# --------------------------------------------------------------------------------------------------


def shard_state(module: nn.Module, units: list[tuple[FlatUnit, torch.Tensor]], rank: int,
                aliases: dict | None = None) -> dict:
    """This rank's shard of each flat unit (``(layout, shard)`` pairs), described well enough to be
    put back together without the model: each unit's parameter names and shapes, which state_dict
    key holds which parameter (tied ones share one), and, from rank 0, any state no unit holds.
    ``aliases`` (``{id(tensor): name}``) names the tensors registered in the parameters' place
    (ZeRO-3's shards)."""
    ids = {id(p): name for layout, _ in units for p, name in zip(layout.params, layout.names)}
    ids.update(aliases or {})
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


class ZeroShards(Checkpointer):
    """Every rank writes its shard of each flat unit and its optimizer's states for it (1/N of
    each); the model is put back together offline; another layout's portable state is cut into
    this rank's shards (:mod:`minitrain.strategies.portable`)."""

    reshards = True

    def layout(self, cfg: TrainConfig) -> dict:
        out = {"offload": cfg.options.offload}
        if isinstance(cfg.options, Zero2Options):  # zero2: the buckets are the units
            out["bucket_mb"] = cfg.options.bucket_mb
        return out

    def save(self, strategy) -> dict:
        sharded = strategy.sharded
        return {"model": shard_state(strategy.model, sharded.shards(), strategy.comm.rank,
                                     sharded.parameter_names()),
                "optimizer": sharded.shard_optimizer().state_dict()}

    @torch.no_grad()
    def load(self, strategy, read) -> None:
        state, sharded = read(strategy.comm.rank), strategy.sharded
        for (_, shard), saved in zip(sharded.shards(), state["model"]["units"], strict=True):
            shard.copy_(saved["shard"])
        sharded.shard_optimizer().load_state_dict(state["optimizer"])
        if sharded.full_weights:  # every rank holds the full weights: gather them
            with strategy.comm.tracer.paused():
                sharded.gather()

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        return unshard_state([read(r)["model"] for r in range(cfg.world_size)])

    def portable_optimizer(self, cfg: TrainConfig, read) -> dict:
        return unshard_optimizer([read(r) for r in range(cfg.world_size)],
                                 masters=cfg.precision != "fp32")

    @torch.no_grad()
    def load_portable(self, strategy, weights: dict, optim: dict) -> None:
        rank, sharded = strategy.comm.rank, strategy.sharded
        names = {id(p): n for n, p in strategy.model.named_parameters()}  # stages 1-2: the model's
        units = [(layout, [names.get(id(p), name) for p, name in zip(layout.params, layout.names)])
                 for layout, _ in sharded.shards()]  # stage 3: the names the wrapper took them under
        if sharded.full_weights:  # every rank holds the full weights; the shards are views of them
            strategy.model.load_state_dict(weights)
        else:  # the full weights exist only while gathered: write this rank's shard of each unit
            for (layout, shard), (_, unit) in zip(sharded.shards(), units):
                lo, hi = layout.owned_range(rank)
                shard.copy_(layout.flatten([weights[n] for n in unit])[lo:hi])
        optimizer = sharded.shard_optimizer()
        optimizer.load_state_dict(shard_optimizer_state(optimizer.state_dict(), units, rank, optim,
                                                        weights))


# --------------------------------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------------------------------


class _OptimizerShards:
    """Stages 1 and 2: the shards are the ZeRO optimizer's, and every rank holds the full weights
    (the shards are views of them)."""

    full_weights = True

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.layouts, self.memory_tensors = optimizer.layouts, optimizer.memory_tensors

    def shards(self) -> list[tuple[FlatUnit, torch.Tensor]]:
        return [(b.layout, b.shard) for b in self.optimizer.buckets]

    def shard_optimizer(self):
        return self.optimizer.optim

    def parameter_names(self) -> None:
        return None  # the model's own names

    def memory(self) -> dict:
        return {}

    def gather(self) -> None:
        """Every rank's full weights from the shards, as after a step."""
        self.optimizer._all_gather_parameters()


class _Zero3Shards:
    """Stage 3: the FSDP wrapper's shards (the full weights exist only while gathered), stepped
    by their own optimizer; with offload, its host side counted too."""

    full_weights = False

    def __init__(self, fsdp: FullyShardedDataParallel, optimizer, offload: bool):
        self.fsdp, self.optimizer, self.offload = fsdp, optimizer, offload
        self.layouts, self.parameter_names = fsdp.layouts, fsdp.parameter_names

    def shards(self) -> list[tuple[FlatUnit, torch.Tensor]]:
        return [(u.layout, u.shard) for u in self.fsdp.units if u.shard is not None]

    def shard_optimizer(self):
        return self.optimizer

    def memory(self) -> dict:
        return {"gathered_peak": self.fsdp.gathered_peak}

    def memory_tensors(self):
        extra, host = self.fsdp.memory_tensors()
        if self.offload:
            more, host = self.optimizer.memory_tensors()
            extra = {k: extra.get(k, []) + more.get(k, []) for k in {*extra, *more}}
        extra["gradients"] = [g for g in extra.get("gradients", []) if g is not None]
        return extra, host


class _Zero(Lockstep):
    """zero1/2/3: the global batch split over the ranks, the model states sharded.  A stage is its
    ``shard(model)``, which builds the wrapper, the optimizer and the shards (a part:
    :class:`_OptimizerShards`, :class:`_Zero3Shards`) that the checkpointer, the ledger and the
    report read.

    fp32 and bf16-mixed only: fp16's loss scaler would have to skip a step when *any* rank's
    gradient shard overflowed, a global verdict these strategies do not take."""

    stage = 0
    precisions = ("fp32", "bf16-mixed")
    options = ZeroOptions
    checkpointer = ZeroShards()

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        check_batch_split(cfg, cfg.world_size)
        if cfg.loss_scale:
            raise ConfigError(f"strategy {cls.name!r} does not scale the loss: each rank sees only "
                              "its shard of the gradients, so an overflow check would need every "
                              "rank's verdict; leave out --loss-scale (bf16-mixed needs none)")

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        return replace(super().layout(cfg), zero_stage=cls.stage, offload=cfg.options.offload)

    def __init__(self, cfg, comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.offload = cfg.options.offload
        self.model = self.build_model()  # bf16-mixed: bf16 model, fp32 copies in master_weights
        self.wrapper, self.optimizer, self.sharded = self.shard(self.model)
        self.master_weights.clear()  # each rank keeps only its shard of them
        self.meter = ActivationMeter(self.model, ignore=self.not_activations())

    @abc.abstractmethod
    def shard(self, model) -> tuple:
        """(what to call forward on, the optimizer, the shards: a part as above)."""

    def not_activations(self):
        """The activation meter's rule for saved tensors that are not activations beyond the
        parameters, ``(tensor) -> bool``, or None: stages 1-2 keep every parameter whole, so there
        are none."""
        return None

    def train_step(self, x, y) -> float:
        loss = self.optimizer_step(self.wrapper, *local_batch(x, y, self.comm, self.device))
        return mean_over_ranks(loss, self.comm)

    def memory(self) -> dict:
        """The ledger; stage 3 adds ``gathered_peak``, the most bytes of full (gathered)
        parameters held at once beside the shards."""
        extra, host = self.sharded.memory_tensors()
        out = ledger(self.model, self.optimizer, self.meter.peak, extra=extra, host=host)
        out.update(self.sharded.memory())
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
class Zero1(_Zero):
    name = "zero1"
    help = "ZeRO stage 1: optimizer states sharded; reduce-scatter, step the shard, all-gather (--offload)"
    stage = 1
    seams = ("zero1_step",)

    def shard(self, model):
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, self.comm,
                                      offload=self.offload, master_weights=self.master_weights,
                                      zero1_step=self.seams.zero1_step, lr=self.cfg.lr)
        return model, opt, _OptimizerShards(opt)


@register
class Zero2(_Zero):
    name = "zero2"
    help = "ZeRO stage 2: gradients too, reduce-scattered in buckets during backward (--offload, --bucket-mb)"
    stage = 2
    options = Zero2Options
    seams = ("zero2_hooks",)

    def shard(self, model):
        opt = Zero2Optimizer(model.parameters(), torch.optim.Adam, self.comm,
                             bucket_cap_mb=self.cfg.options.bucket_mb, offload=self.offload,
                             master_weights=self.master_weights,
                             zero2_hooks=self.seams.zero2_hooks, lr=self.cfg.lr)
        if self.cfg.options.timeline:
            opt.reducer.timeline = []
        return model, opt, _OptimizerShards(opt)

    def report(self) -> dict:
        """The stages' report, and with ``timeline`` each step's buckets and the share of their
        reduce-scatter time hidden behind backward (``overlap``), as ddp's."""
        out = super().report()
        out["bucket_bytes"] = [u.nbytes for u in self.optimizer.layouts()]
        timeline = self.optimizer.reducer.timeline
        if timeline is not None:
            out["timeline"] = timeline
            out["overlap"] = [overlap_fraction(s) for s in timeline]
        return out


@register
class Zero3(_Zero):
    name = "zero3"
    help = "ZeRO stage 3 (FSDP): parameters too, gathered per block for forward and backward (--offload)"
    stage = 3
    options = Zero3Options
    seams = ("zero3_hook",)
    recomputes = False  # recomputation would re-enter the gather hooks; not supported yet

    def shard(self, model):
        self.steps_timeline: list[list[dict]] = []
        fsdp = FullyShardedDataParallel(model, self.comm, zero3_hook=self.seams.zero3_hook)
        if self.cfg.options.timeline:
            fsdp.timeline = []
        opt = shard_optimizer(fsdp.sharded_parameters(), torch.optim.Adam,
                              fsdp.master_shards(self.master_weights), self.offload, lr=self.cfg.lr)
        return fsdp, opt, _Zero3Shards(fsdp, opt, self.offload)

    def not_activations(self):
        """The gathered parameters: their storage comes and goes, so the meter cannot know them
        from the parameters' own."""
        return self.wrapper.is_gathered_parameter

    def train_step(self, x, y) -> float:
        """The step; with ``timeline``, its gather/compute/free/reduce-scatter events kept apart."""
        mark = len(self.wrapper.timeline) if self.wrapper.timeline is not None else 0
        loss = super().train_step(x, y)
        if self.wrapper.timeline is not None:
            self.steps_timeline.append(self.wrapper.timeline[mark:])
            del self.wrapper.timeline[:]
        return loss

    def report(self) -> dict:
        """The stages' report; with ``timeline`` each step's unit events and the share of the
        all-gather time hidden behind compute (``hidden``: :func:`~minitrain.planning.analysis.hidden_fraction`)."""
        out = super().report()
        if self.cfg.options.timeline:
            out["timeline"] = self.steps_timeline
            out["hidden"] = [hidden_fraction(t) for t in self.steps_timeline]
        return out

    def final_state(self) -> dict | None:
        """The full weights, gathered on every rank (a collective), kept on rank 0."""
        state = self.wrapper.full_state_dict()
        return state if self.comm.rank == 0 else None
