"""``expert``: expert parallelism over ``--ep`` ranks for a mixture-of-experts model (lesson 09) —
its options, checks, the full state gathered from the owners, and the report (tokens per expert,
all-to-all bytes beside the theory).  The technique is :mod:`minitrain.parallel.expert`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import all_reduce_coalesced
from ..data import shard
from ..model import GPT
from ..parallel.expert import all_to_all_bytes, expert_parallel_
from ..record import Layout
from .base import Checkpointer, Lockstep, TrainConfig, register
from .options import ConfigError, Options, at_least, option

__all__ = ["ExpertOptions", "ExpertParallel", "ExpertShards"]


@dataclass(frozen=True)
class ExpertOptions(Options):
    ep: int | None = option(None, "expert-parallel ranks: each owns n_expert/ep experts of every "
                            "MoE block; the dense parts are data-parallel over them (default: the "
                            "world size)", check=at_least(1))


def _state_names(cfg: TrainConfig) -> list[str]:
    """The single-process state_dict's keys, in its order."""
    with torch.device("meta"):
        return list(GPT(cfg.model).state_dict().keys())


class ExpertShards(Checkpointer):
    """Each rank saves the dense part (a replica), its own experts and their Adam states; resumed
    on the same number of ranks (each expert on its owner again)."""

    def layout(self, cfg: TrainConfig) -> dict:
        return {"ep": cfg.options.ep or cfg.world_size}

    def save(self, strategy) -> dict:
        return {"model": strategy.model.state_dict(), "optimizer": strategy.optimizer.state_dict()}

    def load(self, strategy, read) -> None:
        state = read(strategy.comm.rank)
        strategy.model.load_state_dict(state["model"])
        strategy.optimizer.load_state_dict(state["optimizer"])

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        """The dense part from rank 0, every expert from its owner, in one process's order."""
        state = dict(read(0)["model"])
        for r in range(1, cfg.world_size):
            state.update({k: v for k, v in read(r)["model"].items() if ".experts." in k})
        return {k: state[k] for k in _state_names(cfg)}


@register
class ExpertParallel(Lockstep):
    """Each rank owns 1/ep of the experts and routes its slice of the batch; tokens go to the
    experts' owners and back by all-to-all; dense gradients are summed over the ranks."""

    name = "expert"
    help = "expert parallel (MoE): experts spread over --ep ranks, tokens moved by all-to-all"
    options = ExpertOptions
    seams = ("all_to_all_dispatch", "moe_router")
    recomputes = False
    checkpointer = ExpertShards()

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        ep = cfg.options.ep or cfg.world_size
        if ep != cfg.world_size:
            raise ConfigError(f"--ep {ep} must equal --world-size {cfg.world_size}; leave --ep out")
        e = cfg.model.n_expert
        if not e:
            raise ConfigError("strategy 'expert' needs a mixture-of-experts model; add --model "
                              "tiny-moe")
        if e % ep:
            able = [k for k in range(1, e + 1) if e % k == 0]
            raise ConfigError(f"n_expert={e} does not split over --ep {ep}: each rank owns whole "
                              f"experts; use --world-size {', '.join(map(str, able))}")
        if cfg.batch_size % ep:
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {ep} ranks; use "
                              f"a multiple of {ep}")

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        w = cfg.world_size  # each rank a replica of the dense layers and 1/w of the experts
        return Layout(dp=w, ep=w, groups={"dp": (tuple(range(w)),)})

    def __init__(self, cfg: TrainConfig, comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.model = expert_parallel_(self.build_model(), comm, cfg.batch_size,
                                      self.seams.all_to_all_dispatch, self.seams.moe_router)
        self.optimizer = self.make_optimizer(self.model.parameters())
        self.dense = [p for n, p in self.model.named_parameters() if ".experts." not in n]
        self.routing: list[list[list[int]]] = []  # per step, per layer: tokens per expert
        self.dropped: list[int] = []

    def forward(self, x, y):
        logits = self.model(x)
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                reduction="sum")
        return total / (self.cfg.batch_size * self.cfg.model.seq_len) + self.model.aux_loss()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        r, n = self.comm.rank, self.comm.size
        x, y = shard(x, r, n).to(self.device), shard(y, r, n).to(self.device)
        sync = lambda: all_reduce_coalesced(  # noqa: E731  (experts: one owner, nothing to sum)
            [p.grad for p in self.dense if p.grad is not None], self.comm, tag="grads")
        loss = self.optimizer_step(self.forward, x, y, sync).detach().clone()
        self.comm.all_reduce(loss, tag="loss")
        blocks = [b.mlp for b in self.model.blocks]
        self.routing.append([m.tokens_per_expert for m in blocks])
        dropped = torch.tensor([sum(m.dropped for m in blocks)], device=self.comm.device)
        self.comm.untraced.all_reduce(dropped)
        self.dropped.append(int(dropped))
        return loss.item()

    def final_state(self) -> dict | None:
        """The full model on rank 0: the dense part from rank 0, each expert from its owner."""
        mine = {k: v.detach().clone() for k, v in self.model.state_dict().items()
                if ".experts." in k}
        parts = [None] * self.comm.size if self.comm.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.comm.rank != 0:
            return None
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for part in parts:
            state.update(part)
        return {k: state[k] for k in _state_names(self.cfg)}

    def report(self) -> dict:
        """Tokens per expert per step (per layer), dropped assignments, and the all-to-all bytes
        per step: measured by the tracer, exact for the routing that happened, and the uniform-
        routing theory."""
        m, steps = self.cfg.model, max(1, self.cfg.steps)
        moved = sum(b.mlp.rows_moved for b in self.model.blocks)
        # the dispatch's messages, whoever wrote it (the seam's sends carry no tag of ours)
        events = [e for e in self.comm.tracer.events
                  if e.tag == "all_to_all" or e.op in ("send", "all_to_all")]
        tokens_local = self.cfg.batch_size // self.comm.size * m.seq_len
        return {
            "ep": self.comm.size, "experts_per_rank": m.n_expert // self.comm.size,
            "local_experts": self.model.blocks[0].mlp.local,
            "tokens_per_expert": self.routing, "dropped": self.dropped,
            "all_to_all_sent_bytes_per_step": sum(e.sent_bytes for e in events) / steps,
            "all_to_all_bytes_routed": 2 * moved * m.d_model * 4 / steps,  # forward + backward
            "all_to_all_bytes_uniform": m.n_layer * all_to_all_bytes(
                tokens_local, m.top_k, m.d_model, self.comm.size),
        }
