"""Lesson 06: the column-parallel linear (its f: all-reduce of dL/dX in backward), the
row-parallel linear (its g: all-reduce of the partial outputs in forward) and the vocabulary-parallel
cross-entropy (a max and two sums over the vocabulary all-reduced, never the logits) — each checked
alone on 2 and 3 ranks against the full layer or loss, then inside strategy ``tensor`` (their seams
``column_parallel_linear``, ``row_parallel_linear`` and ``vocab_parallel_cross_entropy``) against
one process, with the all-reduces the tracer counted beside Megatron's count."""

from __future__ import annotations

import torch

from .core import exercise, on_clusters, raised
from .guards import dist_calls

_PER, _IN, _TOKENS = 4, 6, (3, 5)  # shard width, the other side of the layer, the input's leading dims


def _full_layer(n: int, in_features: int, out_features: int, device):
    """The same full nn.Linear, input and upstream gradient on every rank (seeded, drawn on the
    CPU), on ``device``."""
    import torch.nn as nn

    gen = torch.Generator().manual_seed(6)
    full = nn.Linear(in_features, out_features)
    with torch.no_grad():
        full.weight.copy_(torch.randn(full.weight.shape, generator=gen, device="cpu"))
        full.bias.copy_(torch.randn(full.bias.shape, generator=gen, device="cpu"))
    x = torch.randn(*_TOKENS, in_features, generator=gen, device="cpu")
    upstream = torch.randn(*_TOKENS, out_features, generator=gen, device="cpu")
    return full.to(device), x.to(device), upstream.to(device)


def _close(a, b) -> bool:
    return (torch.is_tensor(a) and tuple(a.shape) == tuple(b.shape) and a.is_floating_point()
            and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5))


#: what each gradient of a column-parallel layer is, in words
_GRADIENT_OF = {"weight": "dL/dA_r = dL/dY_rᵀ·X, summed over every token",
                "bias": "dL/db_r = dL/dY_r summed over every token (no communication: b_r is "
                        "this rank's own)"}


def _gradient_differs(name: str, got, ref, n: int, rows: slice) -> str:
    """What was observed of a wrong weight or bias gradient, beside what it should be."""
    want = f"rows {rows.start}:{rows.stop} of the full layer's {name} gradient"
    if got is None:
        return f"backward returned no {name} gradient (None) where {want} is due: {_GRADIENT_OF[name]}"
    if tuple(got.shape) != tuple(ref.shape):
        return (f"the {name} gradient has shape {tuple(got.shape)}, expected {tuple(ref.shape)} "
                f"({want}): {_GRADIENT_OF[name]}")
    scale = ((got * ref).sum() / (ref * ref).sum() if ref.abs().sum() > 0
             else torch.tensor(0.0, device=ref.device))
    if torch.allclose(got, scale * ref, rtol=1e-4, atol=1e-5) and abs(scale.item() - 1) > 1e-3:
        k = scale.item()
        times = (f"1/{round(1 / k)} of" if k > 0 and abs(1 / k - round(1 / k)) < 1e-3 and k < 1
                 else f"{k:.3g}×")
        why = (f" — divided by N = {n}, as if it were averaged over the ranks: each rank's "
               f"{name} is its own, nothing to average" if abs(k * n - 1) < 1e-3 else
               f" — multiplied by N = {n}, as if summed over the ranks: each rank's {name} is its "
               "own" if abs(k - n) < 1e-3 else "")
        return f"the {name} gradient is {times} {want}{why}: {_GRADIENT_OF[name]}"
    worst = (got - ref).abs().max().item()
    return (f"the {name} gradient differs from {want} by up to {worst:.3g} (norm "
            f"{got.norm().item():.3g} against {ref.norm().item():.3g}): {_GRADIENT_OF[name]}")


def _column_parallel_rank(fn):
    """On each rank: the learner's column-parallel Function on this rank's output columns of a full
    nn.Linear, forward and backward, against the full layer."""
    from ...comm import Comm

    comm = Comm()
    r, n = comm.rank, comm.size
    full, x, upstream = _full_layer(n, _IN, _PER * n, comm.device)
    ref_x = x.clone().requires_grad_()
    want = full(ref_x)
    (want * upstream).sum().backward()
    rows = slice(r * _PER, (r + 1) * _PER)
    weight = full.weight[rows].detach().clone().requires_grad_()
    bias = full.bias[rows].detach().clone().requires_grad_()
    mine = x.clone().requires_grad_()
    comm.tracer.clear()
    try:
        y = fn.apply(mine, weight, bias, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(f"rank {r}: forward", exc, getattr(fn, "forward", fn))
    if not torch.is_tensor(y):
        return f"forward returned {type(y).__name__}: return X·A_r + b_r (F.linear(x, weight, bias))"
    if comm.tracer.events:
        return (f"forward communicated ({', '.join(e.op for e in comm.tracer.events)}): a "
                "column-parallel layer needs nothing from the other ranks in forward — every rank "
                "already has all of X, and its output columns are its own")
    if tuple(y.shape) != (*_TOKENS, _PER):
        return (f"rank {r}: forward returned shape {tuple(y.shape)}, expected {(*_TOKENS, _PER)}: "
                "this rank's columns of the output only")
    if not _close(y, want[..., rows]):
        return f"rank {r}: forward differs from columns {r * _PER}:{(r + 1) * _PER} of the full layer's output"
    try:
        (y * upstream[..., rows]).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return raised(f"rank {r}: backward", exc, getattr(fn, "backward", fn))
    for name, got, ref in (("weight", weight.grad, full.weight.grad[rows]),
                           ("bias", bias.grad, full.bias.grad[rows])):
        if not _close(got, ref):
            return f"rank {r}: " + _gradient_differs(name, got, ref, n, rows)
    if mine.grad is None:
        return f"rank {r}: backward returned no gradient for x"
    own = upstream[..., rows] @ weight.detach()
    if _close(mine.grad, own):
        return (f"rank {r}: dL/dX is only this rank's part (dL/dY_r·A_rᵀ): sum it over the ranks "
                "with comm.all_reduce — the f operator's backward")
    if _close(mine.grad, ref_x.grad / n):
        return (f"rank {r}: dL/dX is the mean of the ranks' parts, 1/{n} of the full layer's: "
                "every part adds to dL/dX, so sum them (don't divide by N)")
    if not _close(mine.grad, ref_x.grad):
        return f"rank {r}: dL/dX differs from the full layer's"
    if [e.op for e in comm.tracer.events] != ["all_reduce"]:
        return (f"backward should make exactly one comm.all_reduce (of dL/dX), it made "
                f"{[e.op for e in comm.tracer.events] or 'none through comm'}")
    # q;k;v and the output layer have no bias: the same layer with bias=None
    mine = x.clone().requires_grad_()
    try:
        y = fn.apply(mine, weight, None, comm)
        (y * upstream[..., rows]).sum().backward()
    except Exception as exc:  # noqa: BLE001
        message = raised(f"rank {r}: with bias=None (q;k;v and the output layer have no bias), "
                         "forward and backward", exc, fn)
        if "not a Variable" in str(exc) or "NoneType" in str(exc):
            message += (" — when forward got bias=None, backward returns None in its place (keep "
                        "in ctx whether there was a bias)")
        return message
    if not _close(y, want[..., rows] - full.bias[rows].detach()):
        return f"rank {r}: with bias=None the output should be X·A_rᵀ, without a bias"
    return None


def _row_parallel_rank(fn):
    """On each rank: the learner's row-parallel Function on this rank's input columns X_r and
    weight columns B_r of a full nn.Linear, forward and backward, against the full layer."""
    from ...comm import Comm

    comm = Comm()
    r, n = comm.rank, comm.size
    full, x, upstream = _full_layer(n, _PER * n, _IN, comm.device)
    ref_x = x.clone().requires_grad_()
    want = full(ref_x)
    (want * upstream).sum().backward()
    cols = slice(r * _PER, (r + 1) * _PER)
    weight = full.weight[:, cols].detach().clone().requires_grad_()
    bias = full.bias.detach().clone().requires_grad_()
    mine = x[..., cols].clone().requires_grad_()
    comm.tracer.clear()
    try:
        z = fn.apply(mine, weight, bias, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        message = raised(f"rank {r}: forward", exc, getattr(fn, "forward", fn))
        if "shape" in str(exc) or "size" in str(exc):
            message += (f" — x is this rank's slice X_r, {tuple(mine.shape)} (the column-parallel "
                        f"layer's output columns), and weight its columns B_r, "
                        f"{tuple(weight.shape)}: F.linear(x, weight) is the partial product")
        return message
    if not torch.is_tensor(z):
        return f"forward returned {type(z).__name__}: return Z = Σ_r X_r·B_rᵀ + b, on every rank"
    forward_ops = [e.op for e in comm.tracer.events]
    if tuple(z.shape) != (*_TOKENS, _IN):
        return (f"rank {r}: forward returned shape {tuple(z.shape)}, expected {(*_TOKENS, _IN)}: "
                "the whole output, the same on every rank")
    partial = mine.detach() @ weight.detach().t()
    if not _close(z, want):
        if _close(z, partial + bias.detach()) or _close(z, partial):
            return (f"rank {r}: the output is this rank's partial sum X_r·B_rᵀ only: add the ranks' "
                    "partial products with comm.all_reduce (the g operator) — then the bias")
        if _close(z, want + (n - 1) * bias.detach()):
            return (f"the bias is counted {n} times: each rank added b before the all-reduce, "
                    "which sums the ranks' b too — add it once, after the all-reduce")
        if _close(z, want - bias.detach()):
            return "the output has no bias: add b after the all-reduce"
        return f"rank {r}: forward differs from the full layer's output"
    if forward_ops != ["all_reduce"]:
        return (f"forward should make exactly one comm.all_reduce (of the partial products), it "
                f"made {forward_ops or 'none through comm'}")
    try:
        (z * upstream).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return raised(f"rank {r}: backward", exc, getattr(fn, "backward", fn))
    backward_ops = [e.op for e in comm.tracer.events][1:]
    grads = (("x", mine.grad, ref_x.grad[..., cols]), ("weight", weight.grad, full.weight.grad[:, cols]),
             ("bias", bias.grad, full.bias.grad))
    if backward_ops and all(g is not None and _close(g, n * ref) for _, g, ref in grads):
        return (f"every gradient is {n}× the full layer's: the backward all-reduced dL/dZ, which "
                "every rank already has whole — g's backward is the identity, no communication")
    for name, got, ref in grads:
        if got is None:
            return f"rank {r}: backward returned no gradient for {name}"
        if not _close(got, ref):
            if name == "x" and backward_ops:
                return (f"rank {r}: dL/dX_r was summed over the ranks: each rank's dL/dX_r = "
                        "dL/dZ·B_r belongs to its own slice of X, nothing to add up (that is the "
                        "column-parallel layer's f)")
            if name == "bias" and _close(got, ref / n):
                return (f"rank {r}: the bias gradient is 1/{n} of the full layer's: the bias was "
                        "added once, to the whole output, so its gradient is all of dL/dZ summed "
                        "over the tokens, on every rank")
            return (f"rank {r}: the gradient of {name} differs from the full layer's "
                    f"{'columns ' + str(r * _PER) + ':' + str((r + 1) * _PER) if name != 'bias' else 'bias gradient'}")
    if backward_ops:
        return (f"backward communicated ({', '.join(backward_ops)}): g's backward is the identity, "
                "every rank already has all of dL/dZ")
    return None


# --------------------------------------------------------------------------------------------------
# Inside strategy 'tensor': the all-reduce bytes beside Megatron's count
# --------------------------------------------------------------------------------------------------


def _tensor_config():
    from ...model import GPTConfig
    from ...strategies.base import TrainConfig

    return TrainConfig(strategy="tensor", world_size=2, steps=3, batch_size=4, seed=0,
                       model=GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))


def _tensor_rows(which: str):
    """``measure`` for :func:`inside`: the all-reduces your linear made (the collectives that no
    layer's tag names are yours), the blocks' all-reduce bytes per layer (row: every one of yours
    is in a block) and the whole model's, each beside Megatron's count."""
    from .inside import Row

    def measure(summary, cfg, package) -> list:
        per = summary.report[0]["comm_per_layer"]  # rank 0, per step
        L, N = cfg.model.n_layer, cfg.world_size
        b, s, d = cfg.batch_size, cfg.model.seq_len, cfg.model.d_model
        ring, bsd = 2 * (N - 1) / N, b * s * d * 4  # bytes a rank sends per all-reduced byte; fp32
        yours = per.get("", {}).get("all_reduce ", {"calls": 0, "sent_bytes": 0.0})
        calls, text = (2 * L, "2·L") if which == "row" else (2 * L + 1, "(2·L + 1)")
        rows = [Row("all-reduces by your linear / step", yours["calls"],
                    f"{text} ({'g' if which == 'row' else 'f'}: attention, MLP"
                    f"{'' if which == 'row' else ', the head'})", calls, unit=""),
                Row("  their bytes sent per rank / step", yours["sent_bytes"],
                    f"{text}·2(N−1)/N·b·s·d·4", calls * ring * bsd)]
        if which == "row":
            blocks = sum(v["sent_bytes"] for where, ops in per.items()
                         if where.startswith("blocks.") for v in ops.values())
            rows.append(Row("all-reduce bytes per rank per layer", (blocks + yours["sent_bytes"]) / L,
                            "(2 fwd + 2 bwd)·2(N−1)/N·b·s·d·4", 4 * ring * bsd))
        model = summary.comm[0].get("all_reduce", {}).get("sent_bytes", 0.0) / summary.steps
        rows.append(Row("all-reduce bytes per rank / step", model,
                        "(4·L + 2)·2(N−1)/N·b·s·d·4 + 2(N−1)/N·3·b·s·4 (loss)",
                        (4 * L + 2) * ring * bsd + ring * 3 * b * s * 4))
        return rows
    return measure


def _inside_tensor(name: str, fn, which: str) -> str | None:
    from .inside import inside
    return inside(name, fn, _tensor_config(), measure=_tensor_rows(which))


@exercise('column_parallel_linear',
          "equals the full nn.Linear's output columns and gradients at 2 and 3 ranks, with one "
          "all-reduce, in backward; strategy 'tensor' with it trains like one process")
def _check_column_parallel_linear(fn) -> str | None:
    return (on_clusters(_column_parallel_rank, fn, sizes=(2, 3))
            or _inside_tensor("column_parallel_linear", fn, "column"))


@exercise('row_parallel_linear',
          "equals the full nn.Linear's output and gradients (x's slice, the weight's columns, the "
          "bias) at 2 and 3 ranks, with one all-reduce, in forward; strategy 'tensor' with it "
          "trains like one process")
def _check_row_parallel_linear(fn) -> str | None:
    return (on_clusters(_row_parallel_rank, fn, sizes=(2, 3))
            or _inside_tensor("row_parallel_linear", fn, "row"))


# --------------------------------------------------------------------------------------------------
# The vocabulary-parallel cross-entropy: the loss from each rank's slice of the logits
# --------------------------------------------------------------------------------------------------

_VOCAB = 13  # odd: over 2 ranks the vocabulary is padded by one column
_PAD_LOGIT = 1e4  # what a padded column holds: it must change nothing


def _vocab_case(n: int, r: int, large: bool, device):
    """Full logits (3, 5, V), targets, and this rank's slice of the padded logits (seeded, drawn
    on the CPU), on ``device``."""
    from ...parallel.tensor import padded_size

    gen = torch.Generator().manual_seed(16 + large)
    full = torch.randn(*_TOKENS, _VOCAB, generator=gen, device="cpu") * 3 + (95.0 if large else 0.0)
    target = torch.randint(0, _VOCAB, _TOKENS, generator=gen, device="cpu")
    per = padded_size(_VOCAB, n) // n
    pad = torch.full((*_TOKENS, per * n - _VOCAB), _PAD_LOGIT, device="cpu")
    padded = torch.cat([full, pad], dim=-1)
    local = padded[..., r * per:(r + 1) * per].clone()
    return full.to(device), target.to(device), per, local.to(device)


def _ce(logits, target):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           reduction="none").view(target.shape)


def _loss_differs(r: int, got, want, full, target, padded_full, n: int, per: int) -> str:
    """What the learner's per-position loss is, when it is not the full cross-entropy."""
    worst = (got - want).abs().max().item()
    with_pad = _ce(padded_full, target)
    if torch.allclose(got, with_pad, rtol=1e-4, atol=1e-3):
        return (f"rank {r}: the loss equals the cross-entropy over all {per * n} columns, the "
                f"{per * n - _VOCAB} padding column(s) (ids {_VOCAB}..{per * n - 1}, holding a logit "
                f"of {_PAD_LOGIT:g} here) included: leave the columns at or past vocab_size out of "
                "the max and the sum of exponentials (their ids ≥ vocab_size are no token)")
    # each rank's slice of the logits (its padding columns at -inf) and each rank's own max
    # instead of the global one: shifted by these, the ranks' sums no longer add up
    parts = [padded_full[..., k * per:(k + 1) * per].masked_fill(
        torch.arange(k * per, (k + 1) * per, device=padded_full.device) >= _VOCAB, float("-inf"))
        for k in range(n)]
    own_max = [part.max(-1).values for part in parts]
    owner_max = torch.stack(own_max).gather(0, (target // per).unsqueeze(0)).squeeze(0)
    mixed = (torch.log(sum(torch.exp(part - m.unsqueeze(-1)).sum(-1)
                           for part, m in zip(parts, own_max)))
             - (full.gather(-1, target.unsqueeze(-1)).squeeze(-1) - owner_max))
    if torch.allclose(got, mixed, rtol=1e-4, atol=1e-4):
        return (f"rank {r}: the loss differs from the full cross-entropy by up to {worst:.3g}, and "
                "matches sums of exponentials each shifted by its own rank's max: the max must be "
                "the same on every rank before the sums are added (all-reduce it with "
                "op=dist.ReduceOp.MAX)")
    return (f"rank {r}: the loss differs from the full cross-entropy by up to {worst:.3g} (position "
            f"0: {got.flatten()[0].item():.4f} against {want.flatten()[0].item():.4f}): loss = "
            "log Σ_j exp(z_j − m) − (z_target − m), every sum over all ranks' columns")


#: what an all-reduce's op makes of the ranks' maxes
_OF_THE_MAXES = {"SUM": "sum", "AVG": "average", "MIN": "smallest", "PRODUCT": "product"}


def _max_not_maxed(reduced: list, local, start: int, positions: int) -> str | None:
    """When one of forward's all-reduces (``reduced``, from :func:`.guards.dist_calls` with their
    inputs kept) carried this rank's own max logit per position with another op than MAX: what the
    ranks then shift by, in words."""
    columns = torch.arange(start, start + local.shape[-1], device=local.device)
    own = [local.masked_fill(columns >= _VOCAB, float("-inf")).max(-1).values, local.max(-1).values]
    for c in reduced:
        if c.reduce_op == "MAX" or not c.inputs or c.inputs[0].numel() % positions:
            continue
        rows = c.inputs[0].detach().double().reshape(-1, positions)
        if any(torch.allclose(row, m.reshape(-1).double(), rtol=1e-6, atol=1e-6)
               for row in rows for m in own):
            what = _OF_THE_MAXES.get(c.reduce_op, f"{c.reduce_op}-reduction")
            why = (" (with logits near 95, the sum is near N·95 and exp(z − m) underflows to 0)"
                   if c.reduce_op == "SUM" else "")
            return (f"forward all-reduced this rank's max logit at each position with "
                    f"op={c.reduce_op}, so every rank shifts by the {what} of the ranks' maxes, "
                    f"not by the largest logit{why}: all-reduce the max with "
                    "op=dist.ReduceOp.MAX")
    return None


def _vocab_ce_rank(fn):
    """On each rank: the learner's Function on its slice of the (padded) logits, against the full
    cross-entropy: values, gradient of its slice, and what it sent."""
    from ...comm import Comm

    comm = Comm()
    r, n = comm.rank, comm.size
    name = getattr(fn, "__name__", "your Function")
    for large in (False, True):
        full, target, per, local = _vocab_case(n, r, large, comm.device)
        padded_full = torch.cat(
            [full, torch.full((*_TOKENS, per * n - _VOCAB), _PAD_LOGIT, device=full.device)], -1)
        case = " (logits near 95)" if large else ""
        ref = full.clone().requires_grad_()
        want = _ce(ref, target)
        upstream = torch.randn(_TOKENS, generator=torch.Generator().manual_seed(7),
                               device="cpu").to(comm.device)
        (want * upstream).sum().backward()
        mine = local.clone().requires_grad_()
        comm.tracer.clear()
        try:
            with dist_calls(keep_inputs=True) as calls:
                got = fn.apply(mine, target, r * per, _VOCAB, comm)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            from ...runtime.worker import _is_timeout
            if _is_timeout(exc):
                raise
            return raised(f"rank {r}{case}: {name}.apply(logits, target, {r * per}, {_VOCAB}, comm)",
                          exc, getattr(fn, "forward", fn))
        forward = list(comm.tracer.events)
        if not torch.is_tensor(got):
            return (f"forward returned {type(got).__name__}: return the loss at every position, "
                    f"a tensor of shape {tuple(target.shape)} (target's)")
        if tuple(got.shape) != tuple(target.shape):
            return (f"rank {r}: forward returned shape {tuple(got.shape)}, expected "
                    f"{tuple(target.shape)}: the loss at every position (no mean: the caller "
                    "averages)")
        other = sorted({e.op for e in forward} - {"all_reduce"})
        positions = target.numel()
        if other:
            sent = sum(e.bytes for e in forward) / positions
            return (f"forward made {', '.join(other)} ({sent:g} bytes per position): the "
                    f"logits never travel — each rank holds {per} of the {_VOCAB} per position; "
                    "three numbers per position are all-reduced (the max, the target's logit, the "
                    "sum of exponentials)")
        if not forward:
            return ("forward communicated nothing: each rank holds only its slice of the "
                    "vocabulary, so the max and the sums over the vocabulary need all-reduces")
        reduced = [c for c in calls if c.op == "all_reduce" and c.tensors]
        numbers = sum(c.numel for c in reduced) / positions
        nbytes = sum(c.nbytes for c in reduced) / positions
        kinds = ", ".join(sorted({str(c.tensors[0].dtype).replace("torch.", "")
                                  for c in reduced}))
        if numbers > 3:
            return (f"forward all-reduced {numbers:g} numbers per position ({kinds}): the loss "
                    "needs 3 (the max, the target's logit and the sum of exponentials), whatever "
                    "the vocabulary")
        if nbytes > 4 * numbers:
            wide = [c for c in reduced if c.tensors[0].element_size() > 4]
            many = sum(c.numel for c in wide) / positions
            dtype = str(wide[0].tensors[0].dtype).replace("torch.", "")
            return (f"forward all-reduced {numbers:g} numbers per position, "
                    f"{'all ' if many == numbers else ''}{many:g} of them in {dtype}: "
                    f"{nbytes:g} bytes per position where float32 carries them in "
                    f"{4 * numbers:g} — the max, the target's logit and the sum of exponentials "
                    "need no more than float32: compute them from logits.float()")
        summed = _max_not_maxed(reduced, local, r * per, positions)
        if summed:
            return f"rank {r}{case}: {summed}"
        if not got.is_floating_point():
            return (f"rank {r}: forward returned {got.dtype}: the loss is a floating-point number at "
                    "every position")
        got = got.float()
        bad = ~torch.isfinite(got)
        if bad.any():
            why = (f" — exp of logits near 95 overflows float32 (its largest number is about "
                   "e^88.7): subtract the max logit (the same on every rank) before exponentiating"
                   if large else "")
            return f"rank {r}{case}: the loss has inf/NaN at {int(bad.sum())} positions{why}"
        if not torch.allclose(got, want.detach(), rtol=1e-4, atol=1e-4):
            message = _loss_differs(r, got.detach(), want.detach(), full, target, padded_full, n,
                                    per)
            return message.replace(f"rank {r}:", f"rank {r}{case}:", 1)
        try:
            (got * upstream).sum().backward()
        except Exception as exc:  # noqa: BLE001
            return raised(f"rank {r}{case}: backward", exc, getattr(fn, "backward", fn))
        backward = comm.tracer.events[len(forward):]
        grad_full = torch.nn.functional.pad(ref.grad, (0, per * n - _VOCAB))
        grad = grad_full[..., r * per:(r + 1) * per]
        g = mine.grad if mine.grad is None else mine.grad.float()
        if g is None:
            return f"rank {r}: backward returned no gradient for the logits"
        if tuple(g.shape) != tuple(grad.shape):
            return (f"rank {r}: the logits' gradient has shape {tuple(g.shape)}, expected "
                    f"{tuple(grad.shape)} (this rank's slice)")
        if not torch.allclose(g, grad, rtol=1e-4, atol=1e-5):
            soft = grad.clone()
            cols = torch.arange(r * per, (r + 1) * per, device=comm.device)
            hit = (target.unsqueeze(-1) == cols)
            soft = soft + hit.to(soft.dtype) * upstream.unsqueeze(-1)  # softmax·upstream alone
            if torch.allclose(g, soft, rtol=1e-4, atol=1e-5):
                return (f"rank {r}: the logits' gradient is softmax·dL/dloss alone: the target's "
                        "column also gets −1 (dloss/dz_j = softmax_j − [j is the target]), on the "
                        "rank that holds it")
            if torch.allclose(g, n * grad, rtol=1e-4, atol=1e-5):
                return (f"rank {r}: the logits' gradient is {n}× the full one: each rank's slice "
                        "gets its own softmax − one-hot, nothing to add up over the ranks")
            worst = (g - grad).abs().max().item()
            return (f"rank {r}{case}: the logits' gradient differs from the full cross-entropy's "
                    f"columns {r * per}:{(r + 1) * per} by up to {worst:.3g}: dloss/dz_j = "
                    "softmax_j − [j is the target] (0 on padding columns), times the incoming "
                    "gradient")
        if backward:
            return (f"backward communicated ({', '.join(e.op for e in backward)}): each rank's "
                    "gradient, softmax − one-hot on its own columns, needs nothing from the others "
                    "(save the softmax in forward)")
    return None


def _loss_rows(summary, cfg, package) -> list:
    """The loss's all-reduces (yours: the collectives no layer's tag names) beside the package's
    and beside 3 numbers per position."""
    from .inside import Row

    per = summary.report[0]["comm_per_layer"]
    N, b, s = cfg.world_size, cfg.batch_size, cfg.model.seq_len
    yours = per.get("", {}).get("all_reduce ", {"calls": 0, "bytes": 0.0, "sent_bytes": 0.0})
    theirs = package.report[0]["comm_per_layer"].get("loss", {})
    return [Row("all-reduces by your loss / step", yours["calls"], "the package's loss",
                sum(v["calls"] for v in theirs.values()), unit=""),
            Row("  numbers all-reduced per position", yours["bytes"] / 4 / (b * s),
                "max, target logit, Σ exp", 3, unit=""),
            Row("  bytes sent per rank / step", yours["sent_bytes"], "3·b·s·4·2(N−1)/N",
                3 * b * s * 4 * 2 * (N - 1) / N)]


@exercise("vocab_parallel_cross_entropy",
          "equals the full cross-entropy and its gradient at 2 and 3 ranks (padding ignored, large "
          "logits finite) from 3 numbers per position, nothing in backward; strategy 'tensor' with "
          "it trains like one process")
def _check_vocab_parallel_cross_entropy(fn) -> str | None:
    from .inside import inside
    return (on_clusters(_vocab_ce_rank, fn, sizes=(2, 3))
            or inside("vocab_parallel_cross_entropy", fn, _tensor_config(), measure=_loss_rows))
