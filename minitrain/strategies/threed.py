"""``3d``: data × pipeline × tensor parallel with ZeRO-1 over the data-parallel axis (lesson 08).

It composes the pieces that run alone: the mesh's groups (:class:`~minitrain.parallel.mesh.Mesh`),
the same :class:`~minitrain.parallel.pipeline.PipelineStage` and executor as ``pipeline``, holding
the same tensor-parallel layers as ``tensor``
(:class:`~minitrain.parallel.tensor_gpt.TensorParallelParts`) over the mesh's tp group, and
:class:`~minitrain.parallel.zero.ZeroRedundancyOptimizer` over its dp group.  Each replica takes its 1/dp of the batch; tensor rank t of stage s talks to tensor rank t of
stage s+1.  After the flush: sequence-parallel gradients are summed over tp, then gradients are
averaged over dp (ZeRO-1: by its reduce-scatter; ``--zero-stage 0``: an all-reduce).

``--cp`` adds a fourth axis, context parallelism (lesson 09; DP × CP × PP × TP, as picotron's 4D):
each cp rank of a (dp, pp, tp) position holds 1/cp of every sequence, in the load-balanced layout of
:func:`~minitrain.parallel.context.balanced_layout`; each block's tensor-parallel attention computes
its heads' attention by :func:`~minitrain.parallel.context.ring_attention` over the mesh's cp group;
the pipeline carries the local tokens' activations; each rank's loss is its tokens' share of the
mean.  After the flush the gradients are summed over cp (each cp rank saw 1/cp of the tokens), and
then go on as above.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from ..planning.analysis import bubble_formula, bubble_fraction
from ..comm import Comm, all_reduce_coalesced
from ..data import shard
from ..memory import ledger
from ..parallel.data_parallel import mean_over_ranks
from ..parallel.context import balanced_layout, ring_attention, ring_bytes_per_layer, sequence_piece
from ..parallel.mesh import Coords, Mesh, MeshShape
from ..parallel.pipeline import PipelineExecutor, PipelineStage
from ..parallel.schedules import make_schedule, split_layers, validate
from ..parallel.tensor_gpt import (TensorParallelParts, all_reduce_sequence_parallel_grads,
                                   tag_collectives)
from ..parallel.zero import ZeroRedundancyOptimizer
from ..record import Layout
from .base import Checkpointer, Lockstep, Seams, TrainConfig, register
from .options import ConfigError, Replicas, at_least, option
from .context import ContextAxis
from .pipeline import ScheduleOptions, check_pipeline, merge_stages, schedule_shape
from .tensor import (TensorOptions, check_tensor_parallel, comm_per_layer, full_state_dict,
                     merge_checkpoints, shard_checkpoint)

__all__ = ["MeshOptions", "ThreeDOptions", "ThreeD", "MeshShards", "mesh_shape", "sequence_layout",
           "bytes_by_group"]


@dataclass(frozen=True)
class MeshOptions(ContextAxis, Replicas):
    pp: int | None = option(None, "pipeline stages of the 3D mesh (default: 1)", check=at_least(1))
    zero_stage: int = option(1, "1 shards Adam's states over the dp ranks (ZeRO-1); 0 all-reduces "
                             "the gradients", choices=(0, 1))


@dataclass(frozen=True)
class ThreeDOptions(MeshOptions, ScheduleOptions, TensorOptions):
    """The mesh's sizes, and the pipeline's and tensor parallelism's own options."""


def mesh_shape(cfg: TrainConfig) -> MeshShape:
    """(dp, pp, tp, cp) from ``--dp --pp --tp --cp``: pp, tp and cp default to 1, dp to what is
    left."""
    o = cfg.options
    pp, tp, cp = o.pp or 1, o.tp or 1, o.cp or 1
    return MeshShape(o.dp or max(1, cfg.world_size // (pp * tp * cp)), pp, tp, cp)


def sequence_layout(seq_len: int, shape: MeshShape, sequence_parallel: bool):
    """``(padded_len, positions)``: the balanced layout of a sequence over the cp ranks; padded to
    a multiple of 2·cp (two chunks per rank) — and, sequence parallel, so that each cp rank's
    tokens also split evenly over the tp ranks."""
    unit = 2 * shape.cp
    if sequence_parallel:
        unit = math.lcm(unit, shape.cp * shape.tp)
    return balanced_layout(unit * math.ceil(seq_len / unit), shape.cp)


def _check_context(cfg: TrainConfig, s: MeshShape) -> None:
    """What the fourth axis needs: two chunks of the sequence per cp rank (a shorter one is
    refused; one that does not divide evenly is padded at the end, outside the loss)."""
    if cfg.model.seq_len < 2 * s.cp:
        raise ConfigError(f"seq_len {cfg.model.seq_len} is shorter than 2 x --cp {s.cp} chunks "
                          f"(each cp rank holds a chunk from the front and its mirror from the "
                          f"back); use --seq-len {2 * s.cp} or more, or a smaller --cp")


def bytes_by_group(events, steps: int) -> dict:
    """Per step: calls and bytes sent by this rank on each axis (dp, pp, tp, and cp)."""
    out: dict = {}
    for e in events:
        row = out.setdefault(e.group, {"calls": 0, "sent_bytes": 0.0})
        row["calls"] += 1 / steps
        row["sent_bytes"] += e.sent_bytes / steps
    return out


class MeshShards(Checkpointer):
    """Replica 0 saves its stages' tensor shards; every rank that holds Adam states of its own saves
    them (ZeRO-1: each dp rank its 1/dp; ZeRO-0: replica 0 only).  The cp ranks of a position hold
    replicas: only cp rank 0 saves, every cp rank loads its.  Saves run after a step, while the
    mesh's groups live; none needs a collective."""

    def layout(self, cfg: TrainConfig) -> dict:
        s = mesh_shape(cfg)
        _, _, _, chunks = schedule_shape(cfg.options, s.pp)
        cp = {"cp": s.cp} if s.cp > 1 else {}  # (a 3D checkpoint's layout has no cp)
        return {"dp": s.dp, "pp": s.pp, "tp": s.tp, **cp, "chunks": chunks,
                "zero_stage": cfg.options.zero_stage}

    @staticmethod
    def _adam(strategy) -> torch.optim.Optimizer:
        """The Adam whose states this rank holds (ZeRO-1: the one on its flat shard)."""
        return strategy.optimizer.optim if strategy.zero_stage == 1 else strategy.optimizer

    def save(self, strategy) -> dict:
        c = strategy.mesh.coords
        if c.cp != 0:
            return {}  # a replica of cp rank 0's state
        out = shard_checkpoint(*strategy.stages.values()) if c.dp == 0 else {}
        if c.dp == 0 or strategy.zero_stage == 1:
            out["optimizer"] = self._adam(strategy).state_dict()
        return out

    def load(self, strategy, read) -> None:
        c, shape = strategy.mesh.coords, strategy.shape
        replica0 = read(shape.rank(Coords(0, c.pp, c.tp)))
        for stage in strategy.stages.values():  # (ZeRO-1: into the flat buffers the shards view)
            stage.load_state_dict({k: replica0["model"][k] for k in stage.state_dict()})
        own = read(shape.rank(Coords(c.dp, c.pp, c.tp))) if strategy.zero_stage == 1 else replica0
        self._adam(strategy).load_state_dict(own["optimizer"])

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        """Replica 0's ranks: each stage's tensor shards merged, then the stages put together."""
        s = mesh_shape(cfg)
        return merge_stages([merge_checkpoints([read(s.rank(Coords(0, p, t))) for t in range(s.tp)])
                             for p in range(s.pp)], cfg.model)


@register
class ThreeD(Lockstep):
    """Data × pipeline × tensor parallel, ZeRO-1 over the data-parallel axis."""

    name = "3d"
    help = ("3D parallel: --dp replicas x --pp pipeline stages x --tp tensor ranks, ZeRO-1 over dp "
            "(--zero-stage 0 for plain all-reduce); pipeline and tensor options apply; --cp adds "
            "context parallelism (ring attention) as a fourth axis")
    options = ThreeDOptions
    seams = ("mesh_groups", "one_f_one_b", "stage_step", "column_parallel_linear",
             "row_parallel_linear", "ring_all_reduce", "zero1_step", "online_softmax_merge")
    recomputes = False  # recomputing a block would re-run its tensor-parallel collectives
    checkpointer = MeshShards()

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        s = mesh_shape(cfg)
        if s.size != cfg.world_size:
            sizes = (f"--dp {s.dp} x --cp {s.cp} x --pp {s.pp} x --tp {s.tp} = {s.size} ranks (the "
                     "product dp·cp·pp·tp)" if s.cp > 1 else
                     f"--dp {s.dp} x --pp {s.pp} x --tp {s.tp} = {s.size} ranks")
            raise ConfigError(f"{sizes} but --world-size is {cfg.world_size}; use --world-size "
                              f"{s.size}, or sizes whose product is {cfg.world_size}")
        check_tensor_parallel(cfg.model, s.tp)
        if s.cp > 1:
            _check_context(cfg, s)
        if cfg.batch_size % s.dp:
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over --dp {s.dp} "
                              f"replicas; use a multiple of {s.dp} (e.g. "
                              f"{s.dp * max(1, round(cfg.batch_size / s.dp))})")
        _, P, M, V = schedule_shape(cfg.options, s.pp)
        check_pipeline(cfg, P, M, V, cfg.batch_size // s.dp, forms={
            "stages": "--pp {}",
            "batch": "{} (each data-parallel replica's batch: --batch-size / --dp)"})
        if cfg.options.schedule == "zb-h1":
            raise ConfigError("strategy 3d cannot run --schedule zb-h1 (the tensor-parallel layers "
                              "do not split their backward into I and W); use 1f1b or interleaved")

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        s = mesh_shape(cfg)
        schedule, _, M, V = schedule_shape(cfg.options, s.pp)
        return Layout(dp=s.dp, pp=s.pp, tp=s.tp, cp=s.cp, zero_stage=cfg.options.zero_stage,
                      schedule=schedule, microbatches=M, virtual_stages=V,
                      groups={a: tuple(tuple(g) for g in s.groups(a)) for a in s.axes})

    @classmethod
    def check_seams(cls, cfg: TrainConfig, seams: Seams) -> None:
        s = mesh_shape(cfg)
        if s.cp > 1 and seams.mesh_groups is not None:
            raise ConfigError(f"the mesh_groups seam (dp, pp, tp, axis) numbers the ranks of a 3D "
                              f"mesh, and this run has --cp {s.cp}: the 4D mesh numbers its own; "
                              "leave out --cp, or the seam")
        if seams.ring_all_reduce is not None and (cfg.options.zero_stage != 0 or s.dp == 1):
            raise ConfigError("the ring_all_reduce seam averages the replicas' gradients, which "
                              "happens with --zero-stage 0 and --dp 2 or more (ZeRO-1 "
                              "reduce-scatters instead); add --zero-stage 0 and --dp 2")
        if seams.zero1_step is not None and (cfg.options.zero_stage != 1 or s.dp == 1):
            raise ConfigError("the zero1_step seam is ZeRO-1's step over the replicas, which "
                              "runs with --zero-stage 1 and --dp 2 or more; leave out "
                              "--zero-stage 0 and use --dp 2")
        if s.cp == 1 and seams.online_softmax_merge is not None:
            raise ConfigError("the online_softmax_merge seam merges the ring's partial attention "
                              "results, and with --cp 1 there is no ring; add --cp 2 (or more)")

    def __init__(self, cfg: TrainConfig, comm: Comm, seams=None):
        super().__init__(cfg, comm, seams)
        o, seams = cfg.options, self.seams
        self.shape = mesh_shape(cfg)
        self.mesh = Mesh(self.shape, comm, mesh_groups=seams.mesh_groups)
        self.schedule, self.P, self.M, self.V = schedule_shape(o, self.shape.pp)
        self.sequence_parallel, self.zero_stage = o.sequence_parallel, o.zero_stage
        model, n_stages, pp = self.build_model(), self.P * self.V, self.mesh.pp
        context = {}
        if self.shape.cp > 1:  # the 4th axis: this rank's tokens, and the ring over the cp group
            self.padded, self.positions = sequence_layout(cfg.model.seq_len, self.shape,
                                                          self.sequence_parallel)
            ring = partial(ring_attention, positions=self.positions.to(self.device),
                           comm=self.mesh.cp, online_softmax_merge=seams.online_softmax_merge)
            context = dict(attention=ring, positions=self.positions[self.mesh.coords.cp],
                           sequence_tokens=cfg.model.seq_len)
        parts = TensorParallelParts(cfg.model, self.mesh.tp, self.sequence_parallel,
                                    column_parallel_linear=seams.column_parallel_linear,
                                    row_parallel_linear=seams.row_parallel_linear, **context)
        self.stages = {s: tag_collectives(PipelineStage(model, s, n_stages, parts=parts))
                       for s in range(pp.rank, n_stages, self.P)}
        self.model = nn.ModuleList(self.stages.values())  # this rank's shards of its stages
        self.table = make_schedule(self.schedule, self.P, self.M, self.V,
                                   one_f_one_b=seams.one_f_one_b)
        validate(self.table, self.P, self.M, self.V)
        self.executor = PipelineExecutor(self.stages, self.table, pp, self.M, cfg.model.d_model,
                                         activation_shape=parts.activation_shape, loss=parts.loss,
                                         stage_step=seams.stage_step)
        if self.zero_stage == 1:
            self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.Adam,
                                                     self.mesh.dp, zero1_step=seams.zero1_step,
                                                     lr=cfg.lr)
        else:
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.timelines: list[list[dict]] = []

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        d, dp = self.mesh.coords.dp, self.shape.dp
        x, y = shard(x, d, dp), shard(y, d, dp)
        if self.mesh.cp is not None:  # this cp rank's tokens of each sequence
            x, y = sequence_piece(x, y, self.padded, self.positions[self.mesh.coords.cp])
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.executor.step(x, y)
        self.timelines.append(self.executor.timeline)
        loss = torch.tensor(loss, dtype=torch.float64, device=self.device)
        if self.mesh.cp is not None:  # each cp rank's gradients and loss: its tokens' share
            all_reduce_coalesced([p.grad for p in self.model.parameters() if p.grad is not None],
                                 self.mesh.cp, tag="grads over cp")
            self.mesh.cp.untraced.all_reduce(loss)  # a metric
        if self.sequence_parallel:
            for stage in self.stages.values():
                all_reduce_sequence_parallel_grads(stage, self.mesh.tp)
        if self.zero_stage == 0:  # average over the replicas; ZeRO-1's step does it itself
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            all_reduce_coalesced(grads, self.mesh.dp, tag="grad", divide_by=dp,
                                 ring_all_reduce=self.seams.ring_all_reduce)
        self.optimizer.step()  # ZeRO-1: reduce-scatter over dp, step the shard, all-gather
        return mean_over_ranks(loss, self.mesh.dp)

    def final_state(self) -> dict | None:
        """The full single-process state_dict on rank 0: each stage's shards gathered over its TP
        group, then the stages over the PP group (untraced)."""
        with self.comm.tracer.paused():
            mine = {}
            for stage in self.stages.values():
                mine.update(full_state_dict(stage, self.mesh.tp))
            states = [None] * self.P if self.mesh.pp.rank == 0 else None
            dist.gather_object(mine, states, dst=self.mesh.pp.global_rank(0),
                               group=self.mesh.pp.group)
        return merge_stages(states, self.cfg.model) if self.comm.rank == 0 else None

    def close(self) -> None:
        """Free the mesh's groups once every rank is done with them (a notebook that runs the
        strategy again builds new ones)."""
        self.comm.untraced.barrier()
        self.mesh.destroy()


    def memory(self) -> dict:
        extra, host = self.optimizer.memory_tensors() if self.zero_stage == 1 else ({}, ())
        return ledger(self.model, self.optimizer, self.executor.peak_bytes, extra=extra, host=host)

    def report(self) -> dict:
        """Where this rank sits, what it holds, and what it measured: the pipeline's bubble (its
        replica's timeline) and the collectives per step by layer (:func:`comm_per_layer`)."""
        c, s = self.mesh.coords, self.shape
        steps = self.timelines[1:] or self.timelines
        return {
            "rank": self.comm.rank, "dp": s.dp, "pp": s.pp, "tp": s.tp, "cp": s.cp,
            "coords": {axis: getattr(c, axis) for axis in s.axes},
            "groups": {axis: s.group_of(self.comm.rank, axis) for axis in s.axes},
            **self._context_report(),
            "stages": {st: list(split_layers(self.cfg.model.n_layer, self.P * self.V)[st])
                       for st in self.stages},
            "schedule": self.schedule, "microbatches": self.M, "chunks": self.V,
            "sequence_parallel": self.sequence_parallel, "zero_stage": self.zero_stage,
            "params_local": sum(p.numel() for p in self.model.parameters()),
            "bubble_own_stage": statistics.median(
                [bubble_fraction(t, 1) for t in steps]) if steps else None,
            "bubble_formula": bubble_formula(self.P, self.M, self.V),
            "comm_by_group": bytes_by_group(self.comm.tracer.events, self.cfg.steps),
            "comm_per_layer": comm_per_layer([e for e in self.comm.tracer.events
                                              if e.group == "tp"], self.cfg.steps),
        }

    def _context_report(self) -> dict:
        """With cp > 1: the layout, and the ring's bytes per step (tracer) beside the theory — per
        layer of this rank's stages, the key/value blocks of its heads (d/tp wide) of its
        replica's batch, around a ring of cp ranks."""
        if self.mesh.cp is None:
            return {}
        m, s = self.cfg.model, self.shape
        local = self.padded // s.cp
        ring = [e for e in self.comm.tracer.events if e.group == "cp" and e.tag.startswith("cp ")]
        layers = sum(len(stage.blocks) for stage in self.stages.values())
        theory = ring_bytes_per_layer(self.cfg.batch_size // s.dp, local, m.d_model // s.tp, s.cp)
        return {"seq_len": m.seq_len, "padded_len": self.padded, "tokens_per_rank": local,
                "positions": self.positions[self.mesh.coords.cp].tolist(),
                "cp_ring_sent_bytes_per_step": sum(e.sent_bytes for e in ring) / self.cfg.steps,
                "cp_ring_sent_bytes_theory": layers * theory["total"]}
