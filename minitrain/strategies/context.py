"""``context``: context parallelism (ring attention) over ``--cp`` ranks, data parallelism over
``--dp`` replicas beside it (lesson 09) — its options, checks and report.  The technique is
:mod:`minitrain.parallel.context`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import all_reduce_coalesced
from ..parallel.context import (balanced_layout, context_parallel_, contiguous_layout,
                                local_forward, ring_bytes_per_layer, ring_work, sequence_piece)
from ..record import Layout
from .base import Lockstep, TrainConfig, register
from .options import ConfigError, Options, Replicas, at_least, option
from .single import Replica

__all__ = ["ContextAxis", "ContextOptions", "ContextParallel"]


@dataclass(frozen=True)
class ContextAxis(Options):
    """The context-parallel axis (shared by ``context`` and ``3d``: one ``--cp`` flag)."""

    cp: int | None = option(None, "context-parallel ranks: each holds 1/cp of every sequence; "
                            "unset: world size / dp in context, 1 in 3d", check=at_least(1))


@dataclass(frozen=True)
class ContextOptions(ContextAxis, Replicas):
    """--dp and --cp."""


def _sizes(cfg: TrainConfig) -> tuple[int, int]:
    o = cfg.options
    cp = o.cp or cfg.world_size // (o.dp or 1)
    return o.dp or max(1, cfg.world_size // cp), cp


@register
class ContextParallel(Lockstep):
    """Every rank holds the whole model and 1/cp of each sequence (a front chunk and its mirror
    from the back); attention passes key/value blocks around the cp ring; gradients are summed
    over all ranks."""

    name = "context"
    help = ("context parallel (ring attention): each sequence split over --cp ranks, load-balanced "
            "for causal masking; world/cp data-parallel replicas beside")
    options = ContextOptions
    seams = ("online_softmax_merge",)
    recomputes = False  # recomputing a block would run its ring again; not supported
    checkpointer = Replica()  # identical replicas (resumed on their own layout only)

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        dp, cp = _sizes(cfg)
        if cfg.world_size % cp:
            able = [k for k in range(1, cfg.world_size + 1) if cfg.world_size % k == 0]
            raise ConfigError(f"--cp {cp} does not divide --world-size {cfg.world_size} (the "
                              f"data-parallel replicas are world size / cp); use --cp "
                              f"{', '.join(map(str, able))}")
        if dp * cp != cfg.world_size:
            raise ConfigError(f"--dp {dp} x --cp {cp} = {dp * cp} ranks but --world-size is "
                              f"{cfg.world_size}; make them equal (or give only one of --dp, --cp)")
        if cfg.batch_size % dp:
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over --dp {dp}; "
                              f"use a multiple of {dp}")
        if cfg.model.n_expert:
            raise ConfigError("strategy 'context' runs dense models; for --model tiny-moe use "
                              "--strategy expert")
        if cfg.model.seq_len < 2 * cp:
            raise ConfigError(f"seq_len {cfg.model.seq_len} is shorter than 2 x --cp {cp} chunks; "
                              f"use --seq-len {2 * cp} or more, or a smaller --cp")

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        dp, cp = _sizes(cfg)  # a cp group: consecutive ranks
        return Layout(dp=dp, cp=cp, groups={"cp": tuple(tuple(range(d * cp, (d + 1) * cp))
                                                        for d in range(dp))})

    def __init__(self, cfg: TrainConfig, comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.dp, self.cp = _sizes(cfg)
        self.groups = []
        mine = None
        if self.dp > 1:  # cp groups: consecutive ranks (every rank creates every group)
            for d in range(self.dp):
                ranks = list(range(d * self.cp, (d + 1) * self.cp))
                group = dist.new_group(ranks)
                self.groups.append(group)
                if comm.rank in ranks:
                    mine = group
        self.cp_comm = comm.sub(mine, "cp") if mine is not None else comm.sub(None, "cp")
        self.padded, self.positions = balanced_layout(cfg.model.seq_len, self.cp)
        self.model = context_parallel_(self.build_model(), self.cp_comm,
                                       self.seams.online_softmax_merge)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def local(self, x: torch.Tensor, y: torch.Tensor):
        """This rank's replica slice of the batch, padded, and its chunk pair of each row."""
        b = x.shape[0] // self.dp
        d = self.comm.rank // self.cp
        x, y = x[d * b:(d + 1) * b], y[d * b:(d + 1) * b]
        x, y = sequence_piece(x, y, self.padded, self.positions[self.cp_comm.rank])
        return x.to(self.device), y.to(self.device)

    def forward(self, x, y):
        logits = local_forward(self.model, x, self.positions, self.cp_comm.rank)
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                ignore_index=-100, reduction="sum")
        return total / (self.cfg.batch_size * self.cfg.model.seq_len)  # this rank's share

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = self.local(x, y)
        sync = lambda: all_reduce_coalesced(  # noqa: E731
            [p.grad for p in self.model.parameters() if p.grad is not None], self.comm, tag="grads")
        loss = self.optimizer_step(self.forward, x, y, sync).detach().clone()
        self.comm.all_reduce(loss, tag="loss")  # the shares add up to the global mean
        return loss.item()

    def close(self) -> None:
        for group in self.groups:
            dist.destroy_process_group(group)

    def report(self) -> dict:
        """The layout, the causal work per ring step (balanced vs contiguous), and the ring's bytes
        per step measured by the tracer beside the theory."""
        events = [e for e in self.comm.tracer.events if e.tag.startswith("cp ")]
        steps = max(1, self.cfg.steps)
        m = self.cfg.model
        local = self.padded // self.cp
        theory = ring_bytes_per_layer(self.cfg.batch_size // self.dp, local, m.d_model, self.cp)
        return {
            "dp": self.dp, "cp": self.cp, "seq_len": m.seq_len, "padded_len": self.padded,
            "tokens_per_rank": local,
            "positions": self.positions[self.cp_comm.rank].tolist(),
            "work_balanced": ring_work(self.positions)[self.cp_comm.rank],
            "work_contiguous": ring_work(contiguous_layout(m.seq_len, self.cp)[1])[
                self.cp_comm.rank],
            "ring_sent_bytes_per_step": sum(e.sent_bytes for e in events) / steps,
            "ring_sent_bytes_theory": m.n_layer * theory["total"],
            "ring_messages_per_step": sum(e.op == "send" for e in events) / steps,
        }
