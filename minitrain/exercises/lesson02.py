"""Lesson 02: the gradient synchronisation of data parallelism."""

from __future__ import annotations

import torch

from .core import exercise, on_clusters


def _sync_rank(fn):
    """On each rank: the learner's gradient sync vs the full batch's gradients in one process."""
    from ..comm import Comm
    from ..data import ArithmeticData, shard
    from ..model import GPT, PRESETS

    comm = Comm()
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(PRESETS["nano"], seed=7)
    reference(x, y).backward()
    model = GPT(PRESETS["nano"], seed=7)
    model(shard(x, r, n), shard(y, r, n)).backward()
    fn(model, comm)
    if not comm.tracer.summary().get("all_reduce"):
        return "no all_reduce went through comm: call comm.all_reduce(p.grad) for each parameter"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            return f"rank {r}: {name}.grad is None after your sync"
        if torch.allclose(p.grad, q.grad * n, rtol=1e-4, atol=1e-7) and n > 1:
            return f"rank {r}: {name}.grad is the sum over ranks: divide by comm.size to average"
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7):
            return f"rank {r}: {name}.grad differs from the full batch's gradient"
    return None


@exercise('sync_gradients',
          "every rank holds the full batch's gradients at 2 and 3 ranks")
def _check_sync_gradients(fn) -> str | None:
    return on_clusters(_sync_rank, fn, sizes=(2, 3))
