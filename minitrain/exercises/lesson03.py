"""Lesson 03: top-k compression with error feedback."""

from __future__ import annotations

import torch

from .core import exercise, raised


@exercise('topk_error_feedback',
          "sends the k largest entries of grad + residual and keeps the rest")
def _check_topk_error_feedback(fn) -> str | None:
    """Against the definition (top k of grad + residual; the rest kept), on random tensors."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((10, 1), (100, 7), (1000, 100), (5, 5)):
        grad, residual = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
        corrected = grad + residual
        want_idx = corrected.abs().topk(k).indices
        try:
            out = fn(grad.clone(), residual.clone(), k)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(f"n={n}, k={k}: {fn.__name__}(...)", exc, fn)
        if not isinstance(out, tuple) or len(out) != 3 or any(t is None for t in out):
            return "return a tuple (indices, values, new_residual)"
        idx, values, new_residual = (torch.as_tensor(t) for t in out)
        if sorted(idx.long().tolist()) != sorted(want_idx.tolist()):
            if sorted(grad.abs().topk(k).indices.tolist()) == sorted(idx.long().tolist()) != \
                    sorted(want_idx.tolist()):
                return (f"n={n}, k={k}: you chose the top k of grad; choose them from "
                        "grad + residual (that is what error feedback means)")
            return f"n={n}, k={k}: wrong indices; keep the k entries of grad + residual largest in |x|"
        order = idx.long().argsort()
        if not torch.allclose(values[order], corrected[idx.long()][order]):
            return f"n={n}, k={k}: values must be (grad + residual) at the chosen indices"
        expected = corrected.clone()
        expected[want_idx] = 0
        if not torch.allclose(new_residual, expected):
            return (f"n={n}, k={k}: the new residual must be grad + residual with the sent "
                    "entries set to zero")
    return None
