"""``3d``: data × pipeline × tensor parallel with ZeRO-1 over the data-parallel axis (lesson 08).

It composes the pieces that run alone: the mesh's groups (:class:`~minitrain.parallel.mesh.Mesh`),
the same :class:`~minitrain.parallel.pipeline.PipelineStage` and executor as ``pipeline``, holding
the same tensor-parallel layers as ``tensor``
(:class:`~minitrain.parallel.tensor_gpt.TensorParallelParts`) over the mesh's tp group, and
:class:`~minitrain.parallel.zero.ZeroRedundancyOptimizer` over its dp group.  Each replica takes its 1/dp of the batch; tensor rank t of stage s talks to tensor rank t of
stage s+1.  After the flush: sequence-parallel gradients are summed over tp, then gradients are
averaged over dp (ZeRO-1: by its reduce-scatter; ``--zero-stage 0``: an all-reduce).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import Comm, all_reduce_coalesced
from ..data import shard
from ..memory import ActivationMeter, ledger, rss_bytes
from ..parallel.data_parallel import mean_over_ranks
from ..parallel.mesh import Coords, Mesh, MeshShape
from ..parallel.pipeline import PipelineExecutor, PipelineStage
from ..parallel.schedules import (bubble_fraction, bubble_formula, make_schedule, split_layers,
                                  validate)
from ..parallel.tensor_gpt import (TensorParallelParts, all_reduce_sequence_parallel_grads,
                                   tag_collectives)
from ..parallel.zero import ZeroRedundancyOptimizer
from .base import ConfigError, Lockstep, Replicas, TrainConfig, at_least, option, register
from .pipeline import ScheduleOptions, check_pipeline, merge_stages, schedule_shape
from .tensor import (TensorOptions, check_tensor_parallel, comm_per_layer, full_state_dict,
                     merge_checkpoints, shard_checkpoint)

__all__ = ["MeshOptions", "ThreeDOptions", "ThreeD", "mesh_shape", "bytes_by_group"]


@dataclass(frozen=True)
class MeshOptions(Replicas):
    pp: int | None = option(None, "pipeline stages of the 3D mesh (default: 1)", check=at_least(1))
    zero_stage: int = option(1, "1 shards Adam's states over the dp ranks (ZeRO-1); 0 all-reduces "
                             "the gradients", choices=(0, 1))


@dataclass(frozen=True)
class ThreeDOptions(MeshOptions, ScheduleOptions, TensorOptions):
    """The mesh's sizes, and the pipeline's and tensor parallelism's own options."""


def mesh_shape(cfg: TrainConfig) -> MeshShape:
    """(dp, pp, tp) from ``--dp --pp --tp``: pp and tp default to 1, dp to what is left."""
    o = cfg.options
    pp, tp = o.pp or 1, o.tp or 1
    return MeshShape(o.dp or max(1, cfg.world_size // (pp * tp)), pp, tp)


def bytes_by_group(events, steps: int) -> dict:
    """Per step: calls and bytes sent by this rank on each axis (dp, pp, tp)."""
    out: dict = {}
    for e in events:
        row = out.setdefault(e.group, {"calls": 0, "sent_bytes": 0.0})
        row["calls"] += 1 / steps
        row["sent_bytes"] += e.sent_bytes / steps
    return out


@register
class ThreeD(Lockstep):
    """Data × pipeline × tensor parallel, ZeRO-1 over the data-parallel axis."""

    name = "3d"
    help = ("3D parallel: --dp replicas x --pp pipeline stages x --tp tensor ranks, ZeRO-1 over dp "
            "(--zero-stage 0 for plain all-reduce); pipeline and tensor options apply")
    options = ThreeDOptions
    seams = ("one_f_one_b", "stage_step", "column_parallel_linear", "row_parallel_linear",
             "mesh_groups", "zero1_step")
    checkpointing = False  # recomputing a block would re-run its tensor-parallel collectives

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        s = mesh_shape(cfg)
        if s.size != cfg.world_size:
            raise ConfigError(f"--dp {s.dp} x --pp {s.pp} x --tp {s.tp} = {s.size} ranks but "
                              f"--world-size is {cfg.world_size}; use --world-size {s.size}, or "
                              f"sizes whose product is {cfg.world_size}")
        check_tensor_parallel(cfg.model, s.tp)
        if cfg.batch_size % s.dp:
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over --dp {s.dp} "
                              f"replicas; use a multiple of {s.dp} (e.g. "
                              f"{s.dp * max(1, round(cfg.batch_size / s.dp))})")
        _, P, M, V = schedule_shape(cfg.options, s.pp)
        check_pipeline(cfg, P, M, V, cfg.batch_size // s.dp, flags={
            "stages": "--pp {}",
            "batch": "{} (each data-parallel replica's batch: --batch-size / --dp)"})
        if cfg.options.schedule == "zb-h1":
            raise ConfigError("strategy 3d cannot run --schedule zb-h1 (the tensor-parallel layers "
                              "do not split their backward into I and W); use 1f1b or interleaved")

    def __init__(self, cfg: TrainConfig, comm: Comm, seams=None):
        super().__init__(cfg, comm, seams)
        o, seams = cfg.options, self.seams
        self.shape = mesh_shape(cfg)
        self.mesh = Mesh(self.shape, comm, groups=seams.mesh_groups)
        self.schedule, self.P, self.M, self.V = schedule_shape(o, self.shape.pp)
        self.sequence_parallel, self.zero_stage = o.sequence_parallel, o.zero_stage
        model, n_stages, pp = self.build_model(), self.P * self.V, self.mesh.pp
        parts = TensorParallelParts(cfg.model, self.mesh.tp, self.sequence_parallel,
                                    column=seams.column_parallel_linear,
                                    row=seams.row_parallel_linear)
        self.stages = {s: tag_collectives(PipelineStage(model, s, n_stages, parts=parts))
                       for s in range(pp.rank, n_stages, self.P)}
        self.model = nn.ModuleList(self.stages.values())  # this rank's shards of its stages
        self.table = make_schedule(self.schedule, self.P, self.M, self.V, order=seams.one_f_one_b)
        validate(self.table, self.P, self.M, self.V)
        self.executor = PipelineExecutor(self.stages, self.table, pp, self.M, cfg.model.d_model,
                                         activation_shape=parts.activation_shape, loss=parts.loss,
                                         stage_step=seams.stage_step)
        self.meter = ActivationMeter(self.model)
        if self.zero_stage == 1:
            self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.Adam,
                                                     self.mesh.dp, step_shard=seams.zero1_step,
                                                     lr=cfg.lr)
        else:
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.timelines: list[list[dict]] = []

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        d, dp = self.mesh.coords.dp, self.shape.dp
        x, y = shard(x, d, dp).to(self.device), shard(y, d, dp).to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.executor.step(x, y)
        self.timelines.append(self.executor.timeline)
        if self.sequence_parallel:
            for stage in self.stages.values():
                all_reduce_sequence_parallel_grads(stage, self.mesh.tp)
        if self.zero_stage == 0:  # average over the replicas; ZeRO-1's step does it itself
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            all_reduce_coalesced(grads, self.mesh.dp, tag="grad", divide_by=dp)
        self.optimizer.step()  # ZeRO-1: reduce-scatter over dp, step the shard, all-gather
        return mean_over_ranks(torch.tensor(loss, dtype=torch.float64, device=self.device),
                               self.mesh.dp)

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
        dist.barrier(group=self.comm.group)
        self.mesh.destroy()


    # -- checkpoints (lesson 08): replica 0 saves its stages' tensor shards, every rank that holds
    # Adam states of its own saves them (ZeRO-1: each dp rank its 1/dp; ZeRO-0: replica 0 only).
    # Saves run after a step, while the mesh's groups live; none needs a collective.
    checkpoint_refusal = None

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        s = mesh_shape(cfg)
        _, _, _, chunks = schedule_shape(cfg.options, s.pp)
        return {"dp": s.dp, "pp": s.pp, "tp": s.tp, "chunks": chunks,
                "zero_stage": cfg.options.zero_stage}

    def _stepping_optimizer(self) -> torch.optim.Optimizer:
        """The Adam whose states this rank holds (ZeRO-1: the one on its flat shard)."""
        return self.optimizer.optim if self.zero_stage == 1 else self.optimizer

    def checkpoint_state(self) -> dict:
        replica0 = self.mesh.coords.dp == 0
        out = shard_checkpoint(*self.stages.values()) if replica0 else {}
        if replica0 or self.zero_stage == 1:
            out["optimizer"] = self._stepping_optimizer().state_dict()
        return out

    def load_checkpoint_state(self, read) -> None:
        c = self.mesh.coords
        replica0 = read(self.shape.rank(Coords(0, c.pp, c.tp)))
        for stage in self.stages.values():  # (ZeRO-1: into the flat buffers the shards view)
            stage.load_state_dict({k: replica0["model"][k] for k in stage.state_dict()})
        own = read(self.comm.rank) if self.zero_stage == 1 else replica0
        self._stepping_optimizer().load_state_dict(own["optimizer"])

    @classmethod
    def consolidate_checkpoint(cls, cfg: TrainConfig, read) -> dict:
        """Replica 0's ranks: each stage's tensor shards merged, then the stages put together."""
        s = mesh_shape(cfg)
        return merge_stages([merge_checkpoints([read(s.rank(Coords(0, p, t))) for t in range(s.tp)])
                             for p in range(s.pp)], cfg.model)

    def memory(self) -> dict:
        extra, host = self.optimizer.memory_tensors() if self.zero_stage == 1 else ({}, ())
        out = ledger(self.model, self.optimizer, self.executor.peak_bytes, extra=extra, host=host)
        out["rss_peak"] = rss_bytes(peak=True)
        return out

    def report(self) -> dict:
        """Where this rank sits, what it holds, and what it measured: the pipeline's bubble (its
        replica's timeline) and the collectives per step by layer (:func:`comm_per_layer`)."""
        c, s = self.mesh.coords, self.shape
        steps = self.timelines[1:] or self.timelines
        return {
            "rank": self.comm.rank, "dp": s.dp, "pp": s.pp, "tp": s.tp,
            "coords": {"dp": c.dp, "pp": c.pp, "tp": c.tp},
            "groups": {axis: s.group_of(self.comm.rank, axis) for axis in ("dp", "pp", "tp")},
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
