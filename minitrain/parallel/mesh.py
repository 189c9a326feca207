"""3D parallelism: data × pipeline × tensor parallel on one world of ranks (lesson 08).

Papers: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (PTD-P: tensor parallel inside a node, pipeline parallel across nodes, data parallel
over the rest); Rajbhandari et al., 2020, "ZeRO" (stage 1 across the data-parallel ranks).  Seed 003,
last section: which layout to pick for which model and cluster (see :mod:`minitrain.chooser`).

**The mesh.**  ``world = dp · pp · tp`` ranks, each with coordinates ``(d, p, t)``.  The tensor
index varies fastest, then the data index, then the pipeline index::

    rank = (p · dp + d) · tp + t

so the ``tp`` ranks of a tensor-parallel group are neighbours (on one machine: tensor parallelism
talks every layer and needs the fastest links), the pipeline stages are furthest apart (they talk
least: one activation per micro-batch, point to point — fine across machines), and data
parallelism sits between.  :class:`Mesh` builds every group explicitly with ``dist.new_group`` and
gives each rank its three communicators; nothing global is read or written.

**A step.**  Each data-parallel replica (``pp · tp`` ranks) takes its 1/dp of the global batch and
runs it through a pipeline (:class:`~minitrain.parallel.pipeline.PipelineExecutor`, any schedule
but zero-bubble) whose stages are tensor-parallel (:class:`TensorParallelStage`: the Megatron layers
of :mod:`minitrain.parallel.tensor`, over the TP group).  Tensor rank t of stage s sends its
activations to tensor rank t of stage s+1 — the same tensor (or, with sequence parallelism, the
same sequence shard) on every tensor rank.  After the flush: sequence-parallel gradients are summed
over the TP group, then the gradients are averaged over the DP group — with ZeRO-1 (default,
``--zero-stage 1``) by a reduce-scatter, each rank stepping the Adam states of its 1/dp shard and
all-gathering the result (:class:`~minitrain.parallel.zero.ZeroRedundancyOptimizer` over the DP
group); with ``--zero-stage 0`` by an all-reduce and a full Adam step on every replica.
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
from ..model import GPT
from ..strategies import ConfigError, Strategy, TrainConfig, register
from .data_parallel import mean_over_ranks
from .pipeline import (PipelineExecutor, bubble_fraction, bubble_formula, check_pipeline,
                       make_schedule, merge_stages, pipeline_options, split_layers, validate)
from .tensor import (ParallelBlock, ParallelEmbedding, ParallelHead,
                     all_reduce_sequence_parallel_grads, check_tensor_parallel, comm_per_layer,
                     full_state_dict, merge_checkpoints, padded_size, shard_checkpoint,
                     vocab_parallel_cross_entropy)
from .zero import ZeroRedundancyOptimizer

__all__ = ["Coords", "MeshShape", "Mesh", "TensorParallelStage", "mesh_shape", "check_mesh",
           "ThreeD"]


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: data-parallel replica ``dp``, pipeline stage ``pp``, tensor rank ``tp``."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the three axes; pure arithmetic, no processes (drawn by the lesson)."""

    dp: int
    pp: int
    tp: int

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, c: Coords) -> int:
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        rest, t = divmod(rank, self.tp)
        p, d = divmod(rest, self.dp)
        return Coords(d, p, t)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ("dp", "pp" or "tp"): the ranks that differ only there."""
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        if axis not in sizes:
            raise ValueError(f"axis must be one of dp, pp, tp; got {axis!r}")
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            key = tuple(getattr(c, a) for a in sizes if a != axis)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)


class Mesh:
    """This rank's place in a ``dp × pp × tp`` mesh and a :class:`Comm` for each axis.

    Every rank of ``comm`` must build it (``dist.new_group`` is collective: all ranks create every
    group, in the same order).  The communicators share ``comm``'s tracer, named "dp", "pp", "tp".
    """

    def __init__(self, shape: MeshShape, comm: Comm):
        if shape.size != comm.size:
            raise ValueError(f"a {shape.dp}x{shape.pp}x{shape.tp} mesh needs {shape.size} ranks, "
                             f"the group has {comm.size}")
        self.shape, self.coords = shape, shape.coords(comm.rank)
        for axis in ("tp", "dp", "pp"):
            mine = None
            for ranks in shape.groups(axis):
                group = dist.new_group([comm.global_rank(r) for r in ranks])
                if comm.rank in ranks:
                    mine = group
            setattr(self, axis, comm.sub(mine, axis))

    def destroy(self) -> None:
        """Free this rank's three groups (their connections and threads): a notebook that runs
        the strategy again builds new ones."""
        for axis in ("tp", "dp", "pp"):
            comm = getattr(self, axis)
            if comm.group is not None:
                dist.destroy_process_group(comm.group)

    def __repr__(self) -> str:
        c = self.coords
        return f"Mesh({self.shape.dp}x{self.shape.pp}x{self.shape.tp}, dp={c.dp}, pp={c.pp}, tp={c.tp})"


class TensorParallelStage(nn.Module):
    """Pipeline stage ``stage`` of ``n_stages`` with tensor-parallel layers over ``tp``: the
    vocabulary-parallel embedding (first stage), its share of the blocks, the vocabulary-parallel
    head (last stage).  Names are the single-process ones, so :func:`full_state_dict` and the
    stages together give the model's state_dict.  Activations are (t, b, d), or (t/tp, b, d) with
    sequence parallelism — what :meth:`activation_shape` tells the executor to receive."""

    def __init__(self, model: GPT, stage: int, n_stages: int, tp: Comm, sequence_parallel: bool):
        super().__init__()
        cfg = model.cfg
        self.stage, self.first, self.last = stage, stage == 0, stage == n_stages - 1
        self.tp, self.sequence_parallel, self.d_model = tp, sequence_parallel, cfg.d_model
        self.embed = ParallelEmbedding(model.embed, tp, sequence_parallel) if self.first else None
        self.blocks = nn.ModuleDict({str(i): ParallelBlock(model.blocks[i], tp, sequence_parallel)
                                     for i in split_layers(cfg.n_layer, n_stages)[stage]})
        self.head = ParallelHead(model.head, tp, sequence_parallel) if self.last else None
        self.vocab_size, self.seq_len = cfg.vocab_size, cfg.seq_len
        for name, module in self.named_modules():
            if hasattr(module, "tag"):  # "blocks.3.mlp.fc": comm_per_layer counts by layer
                module.tag = name

    def activation_shape(self, batch: int, seq: int) -> tuple:
        t = padded_size(seq, self.tp.size) // self.tp.size if self.sequence_parallel else seq
        return (t, batch, self.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x, self.seq_len) if self.head is not None else x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of a micro-batch from this rank's slice of the vocabulary."""
        start = self.head.out.weight.shape[0] * self.tp.rank
        return vocab_parallel_cross_entropy(logits, targets.t(), start, self.vocab_size,
                                            self.tp).mean()

    def split_linears(self) -> list:
        return []  # no zero-bubble I/W split for tensor-parallel layers (refused by check_mesh)


def mesh_shape(cfg: TrainConfig) -> MeshShape:
    """(dp, pp, tp) from ``--dp --pp --tp``: pp and tp default to 1, dp to what is left."""
    o = cfg.options
    pp, tp = o.get("pp") or 1, o.get("tp") or 1
    dp = o.get("dp") or max(1, cfg.world_size // max(1, pp * tp))
    return MeshShape(dp, pp, tp)


def check_mesh(cfg: TrainConfig) -> None:
    """Refuse, naming the fix, a mesh that does not fit the world, the model or the batch."""
    s = mesh_shape(cfg)
    if min(s.dp, s.pp, s.tp) < 1:
        raise ConfigError(f"--dp, --pp and --tp must be >= 1, got {s.dp}, {s.pp}, {s.tp}")
    if s.size != cfg.world_size:
        raise ConfigError(f"--dp {s.dp} x --pp {s.pp} x --tp {s.tp} = {s.size} ranks but "
                          f"--world-size is {cfg.world_size}; use --world-size {s.size}, or "
                          f"sizes whose product is {cfg.world_size}")
    stages = cfg.options.get("stages")
    if stages not in (None, s.pp):
        raise ConfigError(f"--stages {stages} disagrees with --pp {s.pp}; leave --stages out "
                          "(strategy 3d takes the pipeline size from --pp)")
    check_tensor_parallel(cfg.model, s.tp)
    if cfg.batch_size % s.dp:
        raise ConfigError(f"--batch-size {cfg.batch_size} does not split over --dp {s.dp} "
                          f"replicas; use a multiple of {s.dp} (e.g. "
                          f"{s.dp * max(1, round(cfg.batch_size / s.dp))})")
    schedule, P, M, V = pipeline_options(cfg, s.pp)
    check_pipeline(cfg, schedule, P, M, V, cfg.batch_size // s.dp,
                   "each data-parallel replica's batch (--batch-size / --dp)")
    if schedule == "zb-h1":
        raise ConfigError("strategy 3d cannot run --schedule zb-h1 (the tensor-parallel layers "
                          "do not split their backward into I and W); use 1f1b or interleaved")
    if cfg.options.get("zero_stage", 1) not in (0, 1):
        raise ConfigError(f"--zero-stage must be 0 or 1 for strategy 3d, got "
                          f"{cfg.options['zero_stage']} (ZeRO-2/3 across the data-parallel axis "
                          "are zero2/zero3 on their own)")


@register
class ThreeD(Strategy):
    """Data × pipeline × tensor parallel, ZeRO-1 over the data-parallel axis."""

    name = "3d"
    help = ("3D parallel: --dp replicas x --pp pipeline stages x --tp tensor ranks, ZeRO-1 over dp "
            "(--zero-stage 0 for plain all-reduce); pipeline and tensor options apply")
    checkpointing = False  # recomputing a block would re-run its tensor-parallel collectives

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--dp", type=int, default=None,
                            help="3d: data-parallel replicas (default: world size / (pp * tp))")
        parser.add_argument("--pp", type=int, default=None, help="3d: pipeline stages (default 1)")
        parser.add_argument("--zero-stage", type=int, default=1, choices=[0, 1],
                            help="3d: 1 (default) shards Adam's states over dp; 0 all-reduces")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        check_mesh(cfg)

    def __init__(self, cfg: TrainConfig, comm: Comm):
        super().__init__(cfg, comm)
        self.shape = mesh_shape(cfg)
        self.mesh = Mesh(self.shape, comm)
        self.schedule, self.P, self.M, self.V = pipeline_options(cfg, self.shape.pp)
        self.sequence_parallel = bool(cfg.options.get("sequence_parallel", False))
        self.zero_stage = cfg.options.get("zero_stage", 1)
        model, n_stages, pp = self.build_model(), self.P * self.V, self.mesh.pp
        self.stages = {s: TensorParallelStage(model, s, n_stages, self.mesh.tp, self.sequence_parallel)
                       for s in range(pp.rank, n_stages, self.P)}
        self.model = nn.ModuleList(self.stages.values())  # this rank's shards of its stages
        self.table = make_schedule(self.schedule, self.P, self.M, self.V)
        validate(self.table, self.P, self.M, self.V)
        any_stage = next(iter(self.stages.values()))
        last = self.stages.get(n_stages - 1, any_stage)
        self.executor = PipelineExecutor(self.stages, self.table, pp, self.M, cfg.model.d_model,
                                         activation_shape=any_stage.activation_shape, loss=last.loss)
        self.meter = ActivationMeter(self.model)
        if self.zero_stage == 1:
            self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.Adam,
                                                     self.mesh.dp, lr=cfg.lr)
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

    def fit(self, data, on_step=None):
        out = super().fit(data, on_step)
        self._gather_state()
        dist.barrier(group=self.comm.group)  # nobody frees a group a peer still uses
        self.mesh.destroy()  # (after a failure the launcher restarts the ranks anyway)
        return out

    def _gather_state(self) -> None:
        """The full single-process state_dict on rank 0: each stage's shards gathered over its TP
        group, then the stages over the PP group (untraced)."""
        with self.comm.tracer.paused():
            mine = {}
            for stage in self.stages.values():
                mine.update(full_state_dict(stage, self.mesh.tp))
            states = [None] * self.P if self.mesh.pp.rank == 0 else None
            dist.gather_object(mine, states, dst=self.mesh.pp.global_rank(0),
                               group=self.mesh.pp.group)
        self._state = None
        if self.comm.rank == 0:
            self._state = merge_stages(states, self.cfg.model)

    def state_dict(self) -> dict:
        if getattr(self, "_state", None) is None:
            raise RuntimeError("3d gathers the full state at the end of fit(), on rank 0 only")
        return self._state

    # -- checkpoints (lesson 08): replica 0 saves its stages' tensor shards, every rank that holds
    # Adam states of its own saves them (ZeRO-1: each dp rank its 1/dp; ZeRO-0: replica 0 only).
    # Saves run inside fit, after a step, while the mesh's groups live; none needs a collective.
    checkpoint_refusal = None

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        s = mesh_shape(cfg)
        _, _, _, chunks = pipeline_options(cfg, s.pp)
        return {"dp": s.dp, "pp": s.pp, "tp": s.tp, "chunks": chunks,
                "zero_stage": cfg.options.get("zero_stage", 1)}

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
            "comm_by_group": _bytes_by_group(self.comm.tracer.events, self.cfg.steps),
            "comm_per_layer": comm_per_layer([e for e in self.comm.tracer.events
                                              if e.group == "tp"], self.cfg.steps),
        }


def _bytes_by_group(events, steps: int) -> dict:
    """Per step: calls and bytes sent by this rank on each axis (dp, pp, tp)."""
    out: dict = {}
    for e in events:
        row = out.setdefault(e.group, {"calls": 0, "sent_bytes": 0.0})
        row["calls"] += 1 / steps
        row["sent_bytes"] += e.sent_bytes / steps
    return out
