"""Lesson 03: top-k compression with error feedback — checked alone on random tensors, then inside
strategy ``ddp --compress topk:0.1`` through its seam ``topk_error_feedback``, with the tracer's bytes
per rank beside the formula for k values and k indices and beside dense DDP's all-reduce."""

from __future__ import annotations

import torch

from .core import exercise, raised
from .inside import Row, inside, sent_per_rank

_RATIO = 0.1  # the plug-in run: --compress topk:0.1


def _as_tensors(out):
    if not isinstance(out, (tuple, list)) or len(out) != 3 or any(t is None for t in out):
        return None
    try:
        return tuple(torch.as_tensor(t) for t in out)
    except (TypeError, ValueError, RuntimeError):
        return None


def _alone(fn) -> str | None:
    """Against the definition, on random tensors (ties are improbable), with and without a
    residual, k from 1 to n."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((10, 1), (100, 7), (1000, 100), (5, 5)):
        grad = torch.randn(n, generator=gen, device="cpu")
        residual = torch.randn(n, generator=gen, device="cpu") * 0.8
        corrected = grad + residual
        want = set(corrected.abs().topk(k).indices.tolist())
        case = f"n={n}, k={k}"
        try:
            out = fn(grad.clone(), residual.clone(), k)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(f"{case}: {getattr(fn, '__name__', 'your function')}(grad, residual, k)",
                          exc, fn)
        got = _as_tensors(out)
        if got is None:
            return (f"{case}: returned {type(out).__name__}: return a tuple (indices, values, "
                    "new_residual) of tensors")
        idx, values, new_residual = got
        idx = idx.reshape(-1).long()
        values = values.reshape(-1)
        if idx.numel() != k or values.numel() != k:
            return (f"{case}: returned {idx.numel()} indices and {values.numel()} values: send "
                    f"exactly k = {k} (index, value) pairs — the receivers expect k of each")
        if len(set(idx.tolist())) != k:
            return f"{case}: some indices are repeated: send k different entries"
        chosen = set(idx.tolist())
        if chosen != want:
            if chosen == set(grad.abs().topk(k).indices.tolist()):
                return (f"{case}: you chose the k largest entries of grad alone: what the earlier "
                        "steps left unsent (residual) is owed too, so choose among grad + residual")
            if k < n and chosen == set(corrected.topk(k).indices.tolist()):
                return (f"{case}: you chose the k largest values, so large negative entries are "
                        "never sent: choose the entries largest in magnitude |x|")
            return (f"{case}: wrong entries chosen: send the k entries of grad + residual that "
                    "matter most (largest in magnitude)")
        if not torch.allclose(values.float(), corrected[idx], atol=1e-6):
            if torch.allclose(values.float(), grad[idx], atol=1e-6):
                return (f"{case}: values are grad at the chosen indices: send grad + residual "
                        "there (what is owed, not only this step's part)")
            return f"{case}: values must be the entries of grad + residual at your indices"
        new_residual = new_residual.reshape(-1).float()
        if new_residual.numel() != n:
            return f"{case}: new_residual has {new_residual.numel()} entries, expected n = {n}"
        sent = torch.zeros(n, device="cpu").index_put_((idx,), values.float())
        if k < n and torch.count_nonzero(new_residual) == 0:
            return (f"{case}: new_residual is all zeros: everything you did not send is lost; "
                    "keep it for the next step (that is what error feedback means)")
        if torch.allclose(new_residual, corrected, atol=1e-6):
            return (f"{case}: new_residual still holds the entries you sent, so they would be "
                    "sent again next step: keep only what was not sent")
        if torch.allclose(new_residual, residual, atol=1e-6):
            return (f"{case}: new_residual is the old residual unchanged: it must become what "
                    "is still owed after this step")
        if not torch.allclose(sent + new_residual, corrected, atol=1e-6):
            return (f"{case}: what you sent plus new_residual must add up to grad + residual "
                    "(nothing lost, nothing sent twice)")
    return None


def _rows(summary, cfg, package):
    from ...model import GPT
    from ...parallel.compression import TopK

    n, psi = cfg.world_size, GPT(cfg.model).num_params()
    k = sum(TopK(_RATIO).k(b // 4) for b in summary.report[0]["bucket_bytes"])
    sent = sent_per_rank(summary, "all_gather")
    return [Row("bytes sent per rank per step (top-k)", sent, "(N−1)·(4k + 4k)", (n - 1) * 8 * k),
            Row("  the same, against dense DDP", sent, "2(N−1)/N·4Ψ", 2 * (n - 1) / n * 4 * psi)]


@exercise('topk_error_feedback',
          "sends the k entries of grad + residual largest in magnitude and keeps the rest; "
          "strategy 'ddp --compress topk:0.1' with it trains like the package's top-k")
def _check_topk_error_feedback(fn) -> str | None:
    from ...strategies import TrainConfig
    from ...model import PRESETS

    cfg = TrainConfig(strategy="ddp", world_size=2, steps=4, batch_size=12, seed=0,
                      model=PRESETS["nano"], options={"compress": f"topk:{_RATIO}"})
    return _alone(fn) or inside("topk_error_feedback", fn, cfg, reference="package",
                                measure=_rows)
