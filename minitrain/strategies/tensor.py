"""``tensor``: Megatron tensor parallelism over every rank (lesson 06) — its options, checks,
report, the full state gathered from the shards and the sharded checkpoints.  The technique is
:mod:`minitrain.parallel.tensor`."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm
from ..model import GPTConfig
from ..parallel.tensor import Split, merge_shards
from ..parallel.tensor_gpt import TensorParallelGPT
from ..record import Layout
from .base import Checkpointer, Lockstep, TrainConfig, register
from .options import ConfigError, Options, at_least, option

__all__ = ["TensorOptions", "TensorParallel", "TensorShards", "check_tensor_parallel",
           "full_state_dict", "shard_checkpoint", "merge_checkpoints", "comm_per_layer"]


@dataclass(frozen=True)
class TensorOptions(Options):
    """Tensor parallelism's options (strategies tensor and 3d)."""

    tp: int | None = option(None, "tensor-parallel ranks (default: the world size for tensor, its "
                            "only choice; 1 for 3d)", check=at_least(1))
    sequence_parallel: bool = option(False, "shard LayerNorms and residuals along the sequence "
                                     "(reduce-scatter + all-gather instead of all-reduce)")


def check_tensor_parallel(model: GPTConfig, tp: int) -> None:
    """Raise :class:`ConfigError`, naming the fix, if ``model`` cannot be split over ``tp`` ranks."""
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    h, d, ff = model.n_head, model.d_model, model.ff
    if h % tp:
        heads = tp * math.ceil(h / tp)
        able = [k for k in range(1, h + 1) if h % k == 0]
        raise ConfigError(f"n_head={h} does not split over --tp {tp}: each rank computes whole "
                          f"attention heads; use --tp {', '.join(map(str, able))}, or --n-head "
                          f"{heads} --d-model {heads * (d // h)} (a multiple of {tp} heads)")
    if ff % tp:
        raise ConfigError(f"d_ff={ff} does not split over --tp {tp}: the MLP's columns are divided "
                          f"among the ranks; use a d_ff that is a multiple of {tp} (e.g. "
                          f"{tp * math.ceil(ff / tp)})")


@torch.no_grad()
def full_state_dict(model: nn.Module, comm: Comm) -> dict:
    """The single-process state_dict of a tensor-parallel model: every shard all-gathered and put
    back together (padding dropped), replicated tensors as they are.  A collective: every rank of
    ``comm`` must call it; untraced (it is not training traffic)."""
    out = {}
    with comm.tracer.paused():
        for name, t in model.state_dict(keep_vars=True).items():
            split = getattr(t, "tp_split", None)
            t = t.detach()
            if split is not None:
                gathered = t.new_empty((comm.size * t.shape[0], *t.shape[1:]))
                comm.all_gather(gathered, t.contiguous())
                t = merge_shards(list(gathered.chunk(comm.size)), split)
            out[name] = t.clone()
    return out


def shard_checkpoint(*modules: nn.Module) -> dict:
    """This rank's tensor-parallel shards of ``modules`` for a checkpoint file, under their
    state_dict names: ``{"model": {name: tensor}, "splits": {name: [dim, parts, size] or None}}``
    — how :func:`merge_checkpoints` puts the ranks' shards back together, offline (None:
    replicated, every rank holds it whole)."""
    model, splits = {}, {}
    for module in modules:
        for name, t in module.state_dict(keep_vars=True).items():
            model[name] = t.detach().clone()
            split = getattr(t, "tp_split", None)
            splits[name] = list(split) if split is not None else None
    return {"model": model, "splits": splits}


def merge_checkpoints(states: list[dict]) -> dict:
    """The single-process tensors from every tensor rank's :func:`shard_checkpoint`, in rank
    order: shards merged (padding dropped), replicated tensors from rank 0."""
    first = states[0]
    return {name: merge_shards([s["model"][name] for s in states], Split(*split)).clone()
            if (split := first["splits"][name]) is not None else t
            for name, t in first["model"].items()}


class TensorShards(Checkpointer):
    """Each rank saves its shards (with how they split) and their Adam states."""

    def layout(self, cfg: TrainConfig) -> dict:
        return {"tp": cfg.options.tp or cfg.world_size}

    def save(self, strategy) -> dict:
        return {**shard_checkpoint(strategy.model), "optimizer": strategy.optimizer.state_dict()}

    def load(self, strategy, read) -> None:
        state = read(strategy.comm.rank)
        strategy.model.load_state_dict(state["model"])
        strategy.optimizer.load_state_dict(state["optimizer"])

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        return merge_checkpoints([read(r) for r in range(cfg.world_size)])


def comm_per_layer(events, steps: int = 1) -> dict:
    """Collectives per step, by where they were made and in which pass: ``{"blocks.0":
    {"all_reduce forward": {"calls", "bytes", "sent_bytes"}, ...}, "embed": ..., "head": ...,
    "loss": ..., "sequence-parallel-grads": ...}`` from a tracer's events (tags as the model's)."""
    rows: dict = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0}))
    for e in events:
        where, _, direction = e.tag.rpartition(" ")
        parts = where.split(".")
        group = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        row = rows[group][f"{e.op} {direction}"]
        row["calls"] += 1
        row["bytes"] += e.bytes
        row["sent_bytes"] += e.sent_bytes
    return {group: {key: {k: v / steps for k, v in row.items()} for key, row in ops.items()}
            for group, ops in rows.items()}


@register
class TensorParallel(Lockstep):
    """Every rank holds 1/N of every layer and sees the whole batch; the loss is the same number
    on all of them."""

    name = "tensor"
    help = ("tensor parallel (Megatron): heads, MLP and vocabulary split over --tp ranks "
            "(--sequence-parallel)")
    options = TensorOptions
    seams = ("column_parallel_linear", "row_parallel_linear", "vocab_parallel_cross_entropy")
    recomputes = False  # recomputing a block would re-run its collectives; not supported
    checkpointer = TensorShards()

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        tp = cfg.options.tp or cfg.world_size
        if tp != cfg.world_size:
            raise ConfigError(f"--tp {tp} must equal --world-size {cfg.world_size} (strategy "
                              f"'tensor' is tensor parallel only); use --world-size {tp} or leave "
                              "--tp out")
        check_tensor_parallel(cfg.model, tp)

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        return Layout(tp=cfg.world_size, groups={"tp": (tuple(range(cfg.world_size)),)})

    def __init__(self, cfg: TrainConfig, comm: Comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.sequence_parallel = cfg.options.sequence_parallel
        self.model = TensorParallelGPT(
            self.build_model(), comm, self.sequence_parallel,
            column_parallel_linear=self.seams.column_parallel_linear,
            row_parallel_linear=self.seams.row_parallel_linear,
            vocab_parallel_cross_entropy=self.seams.vocab_parallel_cross_entropy)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        sp_sum = self.model.all_reduce_sequence_parallel_grads if self.sequence_parallel else None
        return self.optimizer_step(self.model, x.to(self.device), y.to(self.device), sp_sum).item()

    def final_state(self) -> dict | None:
        """The full model, single-process names and shapes, on rank 0 (a collective)."""
        state = full_state_dict(self.model, self.comm)
        return state if self.comm.rank == 0 else None


    def report(self) -> dict:
        """Shard shapes and the collectives per step by layer and pass (:func:`comm_per_layer`)."""
        return {
            "tp": self.comm.size, "sequence_parallel": self.sequence_parallel,
            "heads_per_rank": self.model.blocks[0].attn.heads if len(self.model.blocks) else None,
            "vocab_padded": self.model.head.out.weight.shape[0] * self.comm.size,
            "shapes": {k: list(v.shape) for k, v in self.model.state_dict().items()},
            "comm_per_layer": comm_per_layer(self.comm.tracer.events, self.cfg.steps),
        }
