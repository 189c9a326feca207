"""Expert parallelism: the experts of every MoE block spread over the ranks, tokens dispatched to
them and combined back with all-to-all (lesson 09).

GShard (Lepikhin et al., 2020, "GShard: Scaling Giant Models with Conditional Computation and
Automatic Sharding") and Switch Transformers (Fedus et al., 2021): each rank routes its own tokens
(the dense parts are data-parallel), sends every (token, expert) assignment to the rank that owns
the expert, the owner runs its experts and sends the results back.  Both exchanges are an
all-to-all with uneven splits, written here from point-to-point sends
(:func:`all_to_all`); ``torch.distributed.all_to_all_single`` is the reference.  Capacity is per
group of tokens, as in GShard and Switch: a group is one sequence, so each rank (holding whole
sequences) drops what its experts' queues cannot take *before* the all-to-all — a dropped
assignment never travels — by the rule one process applies (:func:`~minitrain.model.moe_router`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm
from ..model import MoE, expert_capacity, moe_router

__all__ = ["all_to_all", "all_to_all_reference", "AllToAll", "ExpertParallelMoE",
           "expert_parallel_", "expert_owner", "all_to_all_bytes"]


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
               input_splits: list[int], comm: Comm, tag: str = "all_to_all") -> torch.Tensor:
    """Rank r sends rows ``input[sum(input_splits[:p]) : ...+input_splits[p]]`` to every rank p and
    receives rank p's rows for it into ``output`` at ``sum(output_splits[:p])`` — from sends and
    receives, every transfer posted at once in one exchange (each pair sends at most one message
    each way, so messages match in order); its own rows copied.  Returns ``output``."""
    r = comm.rank
    ins, outs = input.split(input_splits), output.split(output_splits)
    sends, recvs = [], []
    for step in range(1, comm.size):  # a shifted order, so no rank waits on one peer first
        dst, src = (r + step) % comm.size, (r - step) % comm.size
        if input_splits[dst]:
            sends.append((ins[dst].contiguous(), dst, 4))
        if output_splits[src]:
            recvs.append((outs[src], src, 4))
    works = comm.exchange(sends, recvs, tag=tag)
    outs[r].copy_(ins[r])
    for w in works:
        w.wait()
    return output


def all_to_all_reference(output, input, output_splits, input_splits, comm: Comm, tag=""):
    """``torch.distributed.all_to_all_single``: the library's all-to-all (what :func:`all_to_all`
    is checked and timed against)."""
    return comm.all_to_all(output, input.contiguous(), output_splits, input_splits, tag=tag)


class AllToAll(torch.autograd.Function):
    """All-to-all as an autograd op: backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, comm, fn, tag):
        ctx.splits, ctx.comm, ctx.fn, ctx.tag = (output_splits, input_splits), comm, fn, tag
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        return fn(out, x.contiguous(), output_splits, input_splits, comm)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty(sum(input_splits), *grad.shape[1:])
        back = ctx.fn(back, grad.contiguous(), input_splits, output_splits, ctx.comm)
        return back, None, None, None, None, None


def expert_owner(n_expert: int, ep: int) -> list[int]:
    """Which rank owns each expert: contiguous groups of ``n_expert / ep``."""
    return [e // (n_expert // ep) for e in range(n_expert)]


class ExpertParallelMoE(nn.Module):
    """A :class:`~minitrain.model.MoE` whose experts live on their owners: the same router and
    the local experts under the same names (``experts.<e>``), this rank's tokens in and out.

    ``all_to_all_dispatch``: the all-to-all function (lesson 09's exercise; None:
    :func:`all_to_all`).  ``moe_router``: the routing rule (lesson 09's exercise; None: the
    package's :func:`~minitrain.model.moe_router`).  ``groups``: the global batch's number of
    groups (sequences), for this rank's share of the load-balancing loss."""

    def __init__(self, moe: MoE, comm: Comm, groups: int, all_to_all_dispatch=None,
                 moe_router=None):
        super().__init__()
        self.cfg, self.comm, self.groups = moe.cfg, comm, groups
        self.all_to_all_dispatch = all_to_all_dispatch or all_to_all
        self.moe_router = moe_router  # None: the package's moe_router
        self.owner = expert_owner(self.cfg.n_expert, comm.size)
        self.local = [e for e, o in enumerate(self.owner) if o == comm.rank]
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.local})
        self.aux_loss = self.tokens_per_expert = None
        self.dropped = 0
        self.rows_moved = 0  # rows this rank sent to other ranks in forwards so far (x2 with backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, comm, d = self.cfg, self.comm, x.shape[-1]
        groups = x.reshape(-1, x.shape[-2], d)  # this rank's sequences: its groups
        route = self.moe_router or moe_router
        experts, gates, keep, aux = route(self.router(groups), cfg.top_k,
                                          expert_capacity(cfg, groups.shape[1]))
        flat = groups.reshape(-1, d)
        tokens = torch.arange(flat.shape[0], device=x.device).repeat_interleave(cfg.top_k)
        experts, gates, keep = experts.reshape(-1), gates.reshape(-1), keep.reshape(-1)
        routed = torch.bincount(experts, minlength=cfg.n_expert)
        self.dropped = int((~keep).sum())  # dropped here, before the all-to-all: never sent
        tokens, experts, gates = tokens[keep], experts[keep], gates[keep]
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=cfg.n_expert)
        every = counts.new_empty(comm.size * 2 * cfg.n_expert)  # (source rank, kept/routed, expert)
        comm.all_gather(every, torch.cat([counts, routed]), tag="moe counts")
        every = every.view(comm.size, 2, cfg.n_expert)
        kept_by = every[:, 0]
        to_rank = [int(counts[self.local_of(p)].sum()) for p in range(comm.size)]
        from_rank = [int(kept_by[p, self.local].sum()) for p in range(comm.size)]
        got = AllToAll.apply(flat[tokens[order]], from_rank, to_rank, comm,
                             self.all_to_all_dispatch, "moe dispatch")
        # got: by source rank, then by expert, token order within
        per_source = [seg.split(kept_by[p, self.local].tolist())
                      for p, seg in enumerate(got.split(from_rank))]
        outs = [[None] * len(self.local) for _ in range(comm.size)]
        for i, e in enumerate(self.local):
            rows = torch.cat([per_source[p][i] for p in range(comm.size)])
            y = self.experts[str(e)](rows)
            for p, part in enumerate(y.split(kept_by[:, e].tolist())):
                outs[p][i] = part
        back_in = torch.cat([t for row in outs for t in row]) if got.shape[0] else got
        back = AllToAll.apply(back_in, to_rank, from_rank, comm, self.all_to_all_dispatch,
                              "moe combine")
        out = torch.zeros_like(flat).index_add_(
            0, tokens[order], back * gates[order].unsqueeze(-1).to(flat.dtype))
        # this rank's share of the mean over all groups, so that the ranks' shares add up to it
        self.aux_loss = aux * (groups.shape[0] / self.groups)
        self.tokens_per_expert = every[:, 1].sum(0).tolist()
        self.rows_moved += sum(to_rank) - to_rank[comm.rank] + sum(from_rank) - from_rank[comm.rank]
        return out.view_as(x)

    def local_of(self, rank: int) -> list[int]:
        return [e for e, o in enumerate(self.owner) if o == rank]


def expert_parallel_(model: nn.Module, comm: Comm, groups: int, all_to_all_dispatch=None,
                     moe_router=None) -> nn.Module:
    """Swap every MoE block for :class:`ExpertParallelMoE` in place (the experts this rank does not
    own are dropped; state_dict names of the rest unchanged); ``groups``: the global batch's
    sequences; returns the model."""
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, comm, groups, all_to_all_dispatch, moe_router)
    return model


def all_to_all_bytes(tokens_local: int, k: int, d_model: int, ep: int, itemsize: int = 4) -> float:
    """Expected bytes one rank sends per MoE layer per step with uniform routing: forward dispatch
    and combine, backward the same two — each (ep-1)/ep of its tokens·k rows of d values."""
    return 4 * tokens_local * k * d_model * itemsize * (ep - 1) / ep
