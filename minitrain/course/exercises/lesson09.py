"""Lesson 09: merging two partial attention results (the online-softmax rescale), the MoE
all-to-all dispatch from send/recv, and the MoE router (top-k, capacity per group, the
load-balancing loss) — each checked alone, then inside the real strategy through its seam
(``context``'s ``online_softmax_merge``, ``expert``'s ``all_to_all_dispatch`` and ``moe_router``)."""

from __future__ import annotations

import dataclasses
import math

import torch

from .core import exercise, on_clusters, raised
from .inside import Row, inside

_MODEL = dict(n_layer=1, n_head=2, d_model=16, seq_len=10)  # small: the check runs in seconds


def _parts(causal: bool, large: bool = False):
    """Full attention of 6 queries over 8 keys, and the two partial results over keys 0-3 and 4-7
    (with the causal mask some rows see none of the second part: lse = -inf).  float64; ``large``:
    float32 with scores up to about 100 (lse ~ 100: exp(lse) overflows float32)."""
    from ...parallel.context import block_attention

    g = torch.Generator().manual_seed(9)
    dtype = torch.float32 if large else torch.float64
    q, k, v = (torch.randn(2, t, 4, generator=g, dtype=torch.float64, device="cpu")
               for t in (6, 8, 8))
    if large:
        q = q * 50.0
    q, k, v = (z.to(dtype) for z in (q, k, v))
    pos_q = torch.arange(6, device="cpu") if causal else torch.full((6,), 99, device="cpu")
    pos_k = torch.arange(8, device="cpu")
    q, k, v = (z.requires_grad_() for z in (q, k, v))
    full = block_attention(q, k, v, pos_q, pos_k)
    a = block_attention(q, k[:, :4], v[:, :4], pos_q, pos_k[:4])
    b = block_attention(q, k[:, 4:], v[:, 4:], pos_q, pos_k[4:])
    return (q, k, v), full, a, b


_CASES = [(False, False, "without a mask"),
          (True, False, "with the causal mask (rows 0-3 see none of part b: lse_b = -inf)"),
          (False, True, "in float32 with large scores (lse up to about {top:.0f})")]


def _not_finite(case: str, out, lse, la, lb) -> str | None:
    """Where the merge gave inf or NaN from finite parts: which rows, and what their lse were."""
    bad = ~torch.isfinite(out).all(-1) | ~torch.isfinite(lse)
    if not bad.any():
        return None
    what = "NaN" if (torch.isnan(out).any() or torch.isnan(lse).any()) else "inf"
    rows = int(bad.sum())
    masked = torch.isinf(la[bad]).any() or torch.isinf(lb[bad]).any()
    if masked:
        return (f"{case} the result has {what} in {rows} rows, the rows where one part's lse is "
                "-inf (it saw none of that part's keys): exp(lse_x − lse) must give weight 0 there "
                "(subtract the merged lse, which is finite, not the part's own)")
    top = float(torch.maximum(la[bad], lb[bad]).max().detach())
    if top > 80:
        return (f"{case} the result has {what} in {rows} rows, where the parts' lse reach "
                f"{top:.0f}: exp({top:.0f}) overflows {str(la.dtype).replace('torch.', '')} "
                f"(its largest number is {torch.finfo(la.dtype).max:.1e}, about e^"
                f"{math.log(torch.finfo(la.dtype).max):.1f}) — never exponentiate an lse itself: "
                "exp(lse_x − lse) ≤ 1, and torch.logaddexp(lse_a, lse_b) for the merged lse")
    return (f"{case} the result has {what} in {rows} rows whose parts are finite (lse between "
            f"{float(torch.minimum(la[bad], lb[bad]).min().detach()):.3g} and {top:.3g}): out = "
            "exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b with lse = logaddexp(lse_a, lse_b)")


def _merge_alone(fn) -> str | None:
    for causal, large, case in _CASES:
        leaves, (want, want_lse), (oa, la), (ob, lb) = _parts(causal, large)
        case = case.format(top=float(torch.maximum(la, lb).max().detach()))
        tol = dict(rtol=1e-4, atol=1e-4) if large else dict(rtol=1e-7, atol=1e-9)
        try:
            got = fn(oa, la, ob, lb)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(f"online_softmax_merge ({case})", exc, fn)
        if not (isinstance(got, tuple) and len(got) == 2 and all(map(torch.is_tensor, got))):
            return f"returned {type(got).__name__}: return the pair (out, lse)"
        out, lse = got
        if tuple(out.shape) != tuple(want.shape) or tuple(lse.shape) != tuple(want_lse.shape):
            return (f"returned shapes {tuple(out.shape)} and {tuple(lse.shape)}, expected "
                    f"{tuple(want.shape)} and {tuple(want_lse.shape)} (out_a's and lse_a's)")
        bad = _not_finite(case, out, lse, la, lb)
        if bad:
            return bad
        if not torch.allclose(lse.to(want_lse.dtype), want_lse, **tol):
            if torch.allclose(lse.to(want_lse.dtype), torch.maximum(la, lb), **tol):
                return ("lse is the max of lse_a and lse_b: the merged log-sum-exp is "
                        "log(exp(lse_a) + exp(lse_b)) — torch.logaddexp(lse_a, lse_b)")
            return (f"{case} lse differs from the log-sum-exp of all the scores: "
                    "lse = log(exp(lse_a) + exp(lse_b))")
        out = out.to(want.dtype)
        if not torch.allclose(out, want, **tol):
            if torch.allclose(out, oa + ob, **tol):
                return ("out = out_a + out_b: each part is normalised over its own keys only; weight "
                        "each by its share of the total, exp(lse_a - lse) and exp(lse_b - lse)")
            if torch.allclose(out, (oa + ob) / 2, **tol):
                return ("out is the plain average of the parts: weight each by its share of the "
                        "softmax mass, exp(lse_x - lse), not 1/2")
            return (f"{case} out differs from attention over all 8 keys: out = exp(lse_a - lse)·out_a"
                    " + exp(lse_b - lse)·out_b")
        if large:
            continue  # the float64 cases check the gradient
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                               dtype=out.dtype, device="cpu")
        try:
            grads = torch.autograd.grad((out * upstream).sum(), leaves, allow_unused=True)
        except RuntimeError as exc:
            return (f"{case} the forward is right but backward fails ({str(exc).splitlines()[0]}): "
                    "keep the merge differentiable (torch operations on the inputs, no .detach(), "
                    ".item() or in-place changes of them)")
        wants = torch.autograd.grad((want * upstream).sum(), leaves)
        for name, g, w in zip("qkv", grads, wants):
            if g is None or not torch.allclose(g, w, atol=1e-8):
                return (f"{case} the forward is right but the gradient of {name} is not: keep the "
                        "merge differentiable (torch operations on the inputs, no .detach() or "
                        ".item())")
    return None


def _tiny_cfg(strategy: str, world: int, moe: bool = False):
    from ...model import GPTConfig
    from ...strategies import TrainConfig
    from ...model import PRESETS

    base = PRESETS["tiny-moe"] if moe else GPTConfig()
    return TrainConfig(steps=3, batch_size=4, strategy=strategy, world_size=world,
                       model=dataclasses.replace(base, **_MODEL))


def _ring_bytes(summary, cfg, package) -> list:
    """Rank 0's ring traffic per step beside (3N − 2) blocks of K and V per layer."""
    from ...parallel.context import ring_bytes_per_layer

    rep, m = summary.report[0], cfg.model
    per_layer = ring_bytes_per_layer(cfg.batch_size, rep["tokens_per_rank"], m.d_model, cfg.world_size)
    return [Row("K/V blocks around the ring per step", rep["ring_sent_bytes_per_step"],
                "(3N−2)·2·b·L·d·4 per layer", per_layer["total"] * m.n_layer)]


def _all_to_all_bytes(summary, cfg, package) -> list:
    """Rank 0's all-to-all traffic per step beside the exact count for the routing that ran."""
    rep = summary.report[0]
    return [Row("all-to-all rows sent per step", rep["all_to_all_sent_bytes_per_step"],
                "routed rows · d · 4", rep["all_to_all_bytes_routed"])]


@exercise("online_softmax_merge",
          "equals attention over all the keys (forward and backward, with and without fully "
          "masked rows), and strategy 'context' with it equals one process")
def _check_online_softmax_merge(fn) -> str | None:
    return _merge_alone(fn) or inside("online_softmax_merge", fn, _tiny_cfg("context", 2),
                                      measure=_ring_bytes)


def _dispatch_rank(fn):
    """On each rank: the learner's all-to-all with uneven splits (some 0) against
    ``dist.all_to_all_single``, sent through ``comm`` by point-to-point messages."""
    import torch.distributed as dist

    from ...comm import Comm

    comm = Comm()
    n, r = comm.size, comm.rank
    split = lambda src, dst: (3 * src + 2 * dst + src * dst) % 5 + (src == dst)  # noqa: E731
    ins, outs = [split(r, p) for p in range(n)], [split(p, r) for p in range(n)]
    x = torch.arange(sum(ins) * 3, dtype=torch.float32, device=comm.device).view(-1, 3) + 1000 * r
    want = x.new_empty(sum(outs), 3)
    dist.all_to_all_single(want, x, outs, ins)
    output = torch.full((sum(outs), 3), -1.0, device=comm.device)
    try:
        got = fn(output, x.clone(), list(outs), list(ins), comm)
    except Exception as exc:  # noqa: BLE001
        from ...runtime.worker import _is_timeout
        if _is_timeout(exc):  # a message that never came: the launcher says who waited where
            raise
        msg = raised(f"rank {r}: your dispatch", exc, fn)
        if "split" in str(exc) or "size" in str(exc).lower():
            msg += (" — split input by input_splits (rows you send to each rank) and output by "
                    "output_splits (rows you receive from each), not the other way round")
        return msg
    if got is None:
        return "returned None: return output (filled with the rows received from every rank)"
    if not torch.is_tensor(got) or tuple(got.shape) != tuple(want.shape):
        return f"rank {r}: returned {getattr(got, 'shape', got)}, expected output, shape {tuple(want.shape)}"
    if not torch.equal(got, want):
        offsets = [sum(outs[:p]) for p in range(n)]
        for p in range(n):
            a, b = got[offsets[p]:offsets[p] + outs[p]], want[offsets[p]:offsets[p] + outs[p]]
            if not torch.equal(a, b):
                if p == r:
                    return (f"rank {r}: its own rows are wrong: copy input's block for rank {r} into "
                            f"output's block for rank {r} (no message to yourself)")
                if got[offsets[p]:offsets[p] + outs[p]].eq(-1).all():
                    return (f"rank {r}: nothing arrived in the rows from rank {p}: receive into the "
                            f"slice output[sum(output_splits[:{p}]) : … + output_splits[{p}]] itself "
                            "(output.split(output_splits) gives views), and wait for the receive")
                return (f"rank {r}: the rows from rank {p} are wrong: rank p's block of input for you "
                        f"lands at output[sum(output_splits[:p]) : … + output_splits[p]]; split input "
                        "by input_splits and output by output_splits, not the other way round")
        return f"rank {r}: output differs from dist.all_to_all_single's"
    ops = {e.op for e in comm.tracer.events}
    if not ops & {"send", "recv"}:
        return ("no send or receive went through comm: write it from comm.isend / comm.irecv "
                "(or comm.send / comm.recv), not dist.all_to_all_single")
    if ops - {"send", "recv"}:
        return f"use only point-to-point messages; it also called {sorted(ops - {'send', 'recv'})}"
    sent = [e for e in comm.tracer.events if e.op == "send"]
    if any(e.peer == r for e in sent):
        return f"rank {r} sent a message to itself: copy its own rows instead"
    return None


@exercise("all_to_all_dispatch",
          "equals dist.all_to_all_single with uneven splits at 2 and 3 ranks, from send/recv, "
          "and strategy 'expert' with it equals one process")
def _check_all_to_all_dispatch(fn) -> str | None:
    return (on_clusters(_dispatch_rank, fn, sizes=(2, 3))
            or inside("all_to_all_dispatch", fn, _tiny_cfg("expert", 2, moe=True),
                      measure=_all_to_all_bytes))


# --------------------------------------------------------------------------------------------------
# The MoE router: top-k, capacity per group, the load-balancing loss
# --------------------------------------------------------------------------------------------------

#: (groups G, tokens per group S, experts E, top k, capacity) the router is tried on alone
_ROUTER_CASES = [(3, 8, 4, 2, 4), (2, 6, 3, 1, 2), (2, 5, 4, 2, None), (1, 12, 4, 2, 5)]


def _router_logits(G: int, S: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(G, S, E, generator=g, device="cpu") * 1.5).requires_grad_()


def _keep_differs(keep, want_keep, experts, capacity, k: int) -> str:
    """Which assignments the learner's keep got wrong, in words: too many or too few in an
    expert's queue, or the wrong ones kept."""
    G, S, _ = experts.shape
    for g in range(G):
        for e in sorted(set(experts[g].flatten().tolist())):
            mine = int((keep[g] & (experts[g] == e)).sum())
            routed = int((experts[g] == e).sum())
            due = routed if capacity is None else min(routed, capacity)
            if mine > due:
                return (f"group {g}: expert {e} kept {mine} of its {routed} assignments where its "
                        f"capacity is {capacity}: an expert takes at most `capacity` assignments "
                        "of each group")
            if mine < due:
                what = "capacity is None: keep every assignment" if capacity is None else (
                    f"its capacity is {capacity}: keep as many as fit")
                return (f"group {g}: expert {e} kept only {mine} of its {routed} assignments "
                        f"where {what}")
    for g in range(G):
        wrong = (keep[g] != want_keep[g]).nonzero().tolist()
        if wrong:
            dropped = [(t, c) for t, c in wrong if not keep[g, t, c]]
            kept = [(t, c) for t, c in wrong if keep[g, t, c]]
            if dropped and kept:
                (t, c), (u, d) = dropped[0], kept[0]
                nth = ("first", "second", "third", "fourth")
                order = lambda c: nth[c] if c < len(nth) else f"#{c + 1}"  # noqa: E731
                return (f"group {g}: expert {int(experts[g, t, c])} dropped token {t}'s "
                        f"{order(c)} choice and kept token {u}'s {order(d)} choice: an "
                        "expert's queue takes every token's first choice, in token order, before "
                        "any second choice (GShard), and keeps the first `capacity` of that queue")
            return f"group {g}: keep differs at (token, choice) {wrong[0]}"
    return "keep differs"


def _router_alone(fn) -> str | None:
    from ...model import moe_router

    name = getattr(fn, "__name__", "your router")
    for seed, (G, S, E, k, cap) in enumerate(_ROUTER_CASES):
        call = f"{name}(logits {G}×{S}×{E}, k={k}, capacity={cap})"
        logits, ref_logits = _router_logits(G, S, E, seed), _router_logits(G, S, E, seed)
        want = moe_router(ref_logits, k, cap)
        try:
            got = fn(logits, k, cap)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(call, exc, fn)
        if not isinstance(got, tuple) or len(got) != 4:
            what = f"a tuple of {len(got)}" if isinstance(got, tuple) else type(got).__name__
            return f"{call} returned {what}: return (experts, gates, keep, aux_loss)"
        experts, gates, keep, aux = got
        for label, t, shape in (("experts", experts, (G, S, k)), ("gates", gates, (G, S, k)),
                                ("keep", keep, (G, S, k)), ("aux_loss", aux, ())):
            if not torch.is_tensor(t):
                return f"{call}: {label} is {type(t).__name__}, expected a tensor of shape {shape}"
            if tuple(t.shape) != shape:
                return f"{call}: {label} has shape {tuple(t.shape)}, expected {shape}"
        if not torch.equal(experts.long(), want[0]):
            g, t = (experts.long() != want[0]).any(-1).nonzero()[0].tolist()
            probs = torch.softmax(ref_logits.detach()[g, t], -1)
            return (f"{call}: group {g} token {t} went to experts {experts[g, t].tolist()}, its "
                    f"top {k} are {want[0][g, t].tolist()} (probabilities "
                    f"{[round(p, 3) for p in probs.tolist()]}): the k most probable, best first")
        if not torch.allclose(gates.detach().float(), want[1].detach(), atol=1e-5):
            sums = gates.detach().float().sum(-1)
            if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
                g, t = (sums - 1).abs().argmax().item() // S, (sums - 1).abs().argmax().item() % S
                return (f"{call}: the gates of group {g} token {t} sum to {sums[g, t].item():.4f}: "
                        "they are the chosen experts' probabilities renormalised to sum to 1 over "
                        "the token's k experts")
            worst = (gates.detach().float() - want[1].detach()).abs().max().item()
            return (f"{call}: the gates differ from the chosen experts' renormalised probabilities "
                    f"by up to {worst:.3g}")
        if keep.dtype != torch.bool:
            return f"{call}: keep is {keep.dtype}, expected a bool tensor (True: the assignment fits)"
        if not torch.equal(keep, want[2]):
            return f"{call}: " + _keep_differs(keep, want[2], want[0], cap, k)
        if not aux.requires_grad:
            nor = (", nor do the gates (were the logits detached, or the router run under "
                   "torch.no_grad()?)" if not gates.requires_grad else "")
            return (f"{call}: aux_loss carries no gradient to the logits{nor}: P_e, the mean "
                    "router probability, comes from the softmax and must stay differentiable "
                    "(only f_e, the fraction of assignments, is a count)")
        if not torch.allclose(aux.detach().float(), want[3].detach(), rtol=1e-4, atol=1e-6):
            probs = torch.softmax(ref_logits.detach().float(), -1)
            chosen = torch.nn.functional.one_hot(want[0], E)
            f_all = chosen.sum((0, 1, 2)).float() / (G * S * k)
            pooled = E * (f_all * probs.mean((0, 1))).sum()
            hint = (" — that is the loss over all groups pooled together: compute it per group, "
                    "then average over the groups" if G > 1 and torch.allclose(
                        aux.detach().float(), pooled, rtol=1e-4) else "")
            return (f"{call}: aux_loss is {aux.item():.6f}, E·Σ_e f_e·P_e per group averaged over "
                    f"the groups gives {want[3].item():.6f}{hint} (f_e: the fraction of the group's "
                    "k·S assignments routed to e, before capacity; P_e: e's mean probability)")
        g_mine = torch.autograd.grad(aux, logits, allow_unused=True, retain_graph=True)[0]
        g_want = torch.autograd.grad(want[3], ref_logits, retain_graph=True)[0]
        if g_mine is None or not torch.allclose(g_mine, g_want, rtol=1e-3, atol=1e-6):
            return (f"{call}: aux_loss has the right value but not the right gradient: f_e is a "
                    "count (no gradient), P_e the mean of the softmax probabilities (the gradient "
                    "flows through it)")
        found = _gates_gradient(gates, want[1], logits, ref_logits, seed)
        if found:
            return f"{call}: {found}"
    return None


def _gates_gradient(gates, want_gates, logits, ref_logits, seed: int) -> str | None:
    """The gates' gradient to the router (through the logits, which the router's weights make)
    against the package's router's, for an upstream gradient drawn per case: the expert outputs
    are weighted by the gates, which is how the router learns."""
    upstream = torch.randn(tuple(want_gates.shape), generator=torch.Generator().manual_seed(
        50 + seed), device="cpu")
    g_want = torch.autograd.grad((want_gates * upstream).sum(), ref_logits)[0]
    if not g_want.abs().max() > 1e-8:  # k = 1: every gate is 1, whatever the logits
        return None
    g_mine = None
    if gates.requires_grad:
        g_mine = torch.autograd.grad((gates.float() * upstream).sum(), logits,
                                     allow_unused=True)[0]
    if g_mine is None or not g_mine.any():
        how = ("the gates do not require grad (computed under torch.no_grad(), or detached)"
               if not gates.requires_grad else "their gradient to the logits is zero")
        return (f"the gates have the right values but carry no gradient to the router: {how}; "
                "each expert's output is weighted by its gate, and that weight is how the "
                "router's weights learn — compute the gates from the softmax, differentiably "
                "(only the choice of experts and keep are counts)")
    if not torch.allclose(g_mine, g_want, rtol=1e-3, atol=1e-6):
        worst = (g_mine - g_want).abs().max().item()
        return (f"the gates have the right values, but their gradient to the logits differs "
                f"from the renormalised probabilities' by up to {worst:.3g}: the gates must be "
                "the chosen experts' softmax probabilities divided by their sum, each step "
                "differentiable")
    return None


def _routing_rows(summary, cfg, package) -> list:
    """Assignments dropped and the busiest expert against the mean, yours beside the package's."""
    import statistics

    def imbalance(rep):
        return statistics.mean(max(layer) / (sum(layer) / len(layer))
                               for step in rep["tokens_per_expert"] for layer in step)
    mine, ref = summary.report[0], package.report[0]
    return [Row("assignments dropped per step", round(sum(mine["dropped"]) / summary.steps, 2),
                "the package's router", round(sum(ref["dropped"]) / package.steps, 2), unit=""),
            Row("busiest expert / mean", round(imbalance(mine), 3), "the package's router",
                round(imbalance(ref), 3), unit="×"),
            Row("all-to-all bytes sent per step", mine["all_to_all_sent_bytes_per_step"],
                "kept rows · d · 4", mine["all_to_all_bytes_routed"])]


def _router_cfg():
    cfg = _tiny_cfg("expert", 2, moe=True)
    return cfg.with_(model=dataclasses.replace(cfg.model, capacity_factor=1.0))


@exercise("moe_router",
          "routes each token to its top-k experts with renormalised gates, keeps what fits each "
          "expert's capacity per group (first choices first) and returns the load-balancing loss "
          "with its gradient; strategy 'expert' with it (capacity 1.0, tokens dropped) equals one "
          "process")
def _check_moe_router(fn) -> str | None:
    return _router_alone(fn) or inside("moe_router", fn, _router_cfg(), measure=_routing_rows)
