"""Lesson 04: the ZeRO-1 step."""

from __future__ import annotations

import torch

from .core import exercise, on_clusters


def _zero1_rank(fn):
    """On each rank: three ZeRO-1 steps of the learner's vs Adam on the whole vector in one process."""
    import torch.nn as nn

    from ..comm import Comm

    comm = Comm()
    n, r = comm.size, comm.rank
    numel = 12 * n  # a multiple of N: the padding is the caller's job
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(3)]  # the same on every rank
    reference = nn.Parameter(start.clone())
    ref_opt = torch.optim.Adam([reference], lr=0.1)
    flat_params = start.clone()
    size = numel // n
    shard = nn.Parameter(start[r * size:(r + 1) * size].clone())
    optimizer = torch.optim.Adam([shard], lr=0.1)
    for step, g in enumerate(grads):
        reference.grad = g.clone()
        ref_opt.step()
        fn(flat_params, g.clone(), shard, optimizer, comm)
        if not torch.allclose(flat_params, reference.detach(), rtol=1e-5, atol=1e-6):
            wrong = (flat_params - reference.detach()).abs().gt(1e-5).nonzero().flatten()
            owner = int(wrong[0]) // size if len(wrong) else -1
            if torch.allclose(shard.detach(), reference.detach()[r * size:(r + 1) * size],
                              rtol=1e-5, atol=1e-6):
                return (f"step {step}: your own shard is right but element {int(wrong[0])} "
                        f"(rank {owner}'s shard) is not: all-gather every rank's shard into flat_params")
            return (f"step {step}: rank {r}'s parameters differ from Adam on the whole vector; give "
                    "the shard its slice of the gradient (elements rank·S to (rank+1)·S), then step")
    ops = comm.tracer.summary()
    if not ops.get("all_gather"):
        return "no all_gather went through comm: use comm.all_gather(flat_params, shard.detach())"
    if ops.get("all_reduce") or ops.get("broadcast"):
        return "only an all_gather is needed: the gradients are already averaged on every rank"
    return None


@exercise('zero1_step',
          "equals Adam on the whole parameter vector at 2 and 3 ranks, sharded")
def _check_zero1_step(fn) -> str | None:
    return on_clusters(_zero1_rank, fn, sizes=(2, 3))
