"""Lesson 06: a column-parallel linear, forward and backward."""

from __future__ import annotations

import torch

from .core import exercise, on_clusters


def _column_parallel_rank(fn):
    """On each rank: the learner's column-parallel Function on this rank's output columns of a full
    nn.Linear, forward and backward, against the full layer (lesson 06)."""
    import torch.nn as nn

    from ..comm import Comm

    comm = Comm()
    r, n = comm.rank, comm.size
    gen = torch.Generator().manual_seed(6)
    full, per = nn.Linear(6, 4 * n), 4
    with torch.no_grad():  # the same full layer, input and upstream gradient on every rank
        full.weight.copy_(torch.randn(full.weight.shape, generator=gen))
        full.bias.copy_(torch.randn(full.bias.shape, generator=gen))
    x, upstream = torch.randn(3, 5, 6, generator=gen), torch.randn(3, 5, 4 * n, generator=gen)
    ref_x = x.clone().requires_grad_()
    want = full(ref_x)
    (want * upstream).sum().backward()
    rows = slice(r * per, (r + 1) * per)
    weight = full.weight[rows].detach().clone().requires_grad_()
    bias = full.bias[rows].detach().clone().requires_grad_()
    mine = x.clone().requires_grad_()
    comm.tracer.clear()
    try:
        y = fn.apply(mine, weight, bias, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return f"rank {r}: forward raised {type(exc).__name__}: {exc}"
    if not torch.is_tensor(y):
        return f"forward returned {type(y).__name__}: return X·A_r + b_r (F.linear(x, weight, bias))"
    if tuple(y.shape) != (3, 5, per):
        return (f"rank {r}: forward returned shape {tuple(y.shape)}, expected (3, 5, {per}): "
                "this rank's columns of the output only")
    if not torch.allclose(y, want[..., rows], rtol=1e-5, atol=1e-6):
        return f"rank {r}: forward differs from columns {r * per}:{(r + 1) * per} of the full layer's output"
    if comm.tracer.events:
        return ("forward communicated: a column-parallel layer needs none in forward, every rank "
                "already has all of X")
    try:
        (y * upstream[..., rows]).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return f"rank {r}: backward raised {type(exc).__name__}: {exc}"
    for name, got, ref in (("weight", weight.grad, full.weight.grad[rows]),
                           ("bias", bias.grad, full.bias.grad[rows])):
        if got is None or not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
            return (f"rank {r}: the {name} gradient differs from the full layer's rows "
                    f"{r * per}:{(r + 1) * per} (dL/dA_r = Xᵀ·dL/dY_r, summed over all tokens)")
    if mine.grad is None:
        return f"rank {r}: backward returned no gradient for x"
    own = upstream[..., rows] @ weight.detach()
    if torch.allclose(mine.grad, own, rtol=1e-5, atol=1e-5):
        return (f"rank {r}: dL/dX is only this rank's part (dL/dY_r·A_rᵀ): sum it over the ranks "
                "with comm.all_reduce — the f operator's backward")
    if not torch.allclose(mine.grad, ref_x.grad, rtol=1e-5, atol=1e-5):
        return f"rank {r}: dL/dX differs from the full layer's"
    if [e.op for e in comm.tracer.events] != ["all_reduce"]:
        return (f"backward should make exactly one comm.all_reduce (of dL/dX), it made "
                f"{[e.op for e in comm.tracer.events] or 'none through comm'}")
    return None


@exercise('column_parallel_linear',
          "equals the full nn.Linear's output columns and gradients at 2 and "
                               "3 ranks, with one all-reduce, in backward")
def _check_column_parallel_linear(fn) -> str | None:
    return on_clusters(_column_parallel_rank, fn, sizes=(2, 3))
