"""Lesson 04: ZeRO-1's step (reduce-scatter the gradients, step the shard, all-gather the
parameters) and ZeRO-3's hook around a unit's compute (gather before, free after, reduce-scatter
after backward).  Each is checked alone on 2 and 3 ranks, then inside the real strategy ('zero1'
with ``zero1_step``, 'zero3' with ``zero3_hook``) beside the lesson's formulas: bytes per rank from
the tracer, optimizer states and peak parameter memory from the ledger."""

from __future__ import annotations

import torch

from .core import exercise, raised, ranks
from .guards import GuardedUnit, bypassed, dist_calls
from .inside import RUNS, Row, inside, rank_trouble, sent_per_rank

#: a small GPT: the checks and the runs inside the strategies take seconds
_MODEL = dict(n_layer=2, n_head=2, d_model=16, seq_len=10)


def _on_ranks(rank_fn, fn, sizes=(2, 3)) -> str | None:
    """``rank_fn(fn)`` on the checkers' running ranks of each size; the first problem found, with a
    rank's failure (deadlock, timeout, error) in the learner's terms."""
    from ...runtime.launch import RankError

    for n in sizes:
        try:
            problems = [p for p in ranks(n).run(rank_fn, fn, timeout=60) if p]
        except RankError as exc:
            return rank_trouble(exc, fn, f"with {n} ranks")
        except TimeoutError:
            return f"with {n} ranks it did not finish within 60 s (a rank waiting for a message?)"
        if problems:
            return f"with {n} ranks, {problems[0]}"
    return None


def _cfg(strategy: str, n: int):
    from ...model import GPTConfig
    from ...strategies import TrainConfig

    cfg = TrainConfig(steps=4, batch_size=12, model=GPTConfig(**_MODEL))
    return cfg.with_(strategy=strategy, world_size=n)


def _bytes_per_element(summary) -> int:
    return 4 if summary.precision == "fp32" else 2


def _inside_at(name: str, fn, strategy: str, measure) -> str | None:
    """``inside`` at 2 and then 3 ranks; the report keeps the 3-rank run with both runs' rows."""
    rows = []
    for n in (2, 3):
        found = inside(name, fn, _cfg(strategy, n), measure=measure)
        if found:
            return found
        rows += RUNS[name].rows
    RUNS[name].rows = rows
    return None


# --------------------------------------------------------------------------------------------------
# ZeRO-1's step: reduce-scatter, step the shard, all-gather
# --------------------------------------------------------------------------------------------------

_PSI = 37  # not a multiple of 2 or 3: the flat vectors are zero-padded to a multiple of N

#: the optimizers the step is checked with: SGD sees a gradient N times too large, Adam hardly does
_OPTIMIZERS = {"SGD with momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
               "Adam": lambda ps: torch.optim.Adam(ps, lr=0.1)}


def _local_gradients(n: int, step: int, device) -> list:
    """Every rank's own gradient at ``step`` (each rank can make all of them), on ``device``."""
    gen = torch.Generator(device=device).manual_seed(100 * step + 7)
    return [torch.randn(_PSI, generator=gen, device=device) for _ in range(n)]


def _zero1_rank(fn):
    """On each rank: three steps of the learner's zero1_step from this rank's own gradient, against
    the optimizer on the whole vector in one process with the mean gradient."""
    import torch.nn as nn

    from ...parallel.flat import FlatUnit
    from .guards import ShapeCheckedComm

    comm = ShapeCheckedComm()
    n, r = comm.size, comm.rank
    layout = FlatUnit([torch.empty(_PSI, device=comm.device)], n)
    size = layout.shard_size
    lo, hi = r * size, (r + 1) * size
    start = torch.randn(_PSI, generator=torch.Generator(device=comm.device).manual_seed(5),
                        device=comm.device)
    seen = []  # every torch.distributed call of the learner's steps
    for opt_name, make in _OPTIMIZERS.items():
        # one process with the mean gradient; and what a rank would get from the sum, or its own
        ref = {k: nn.Parameter(start.clone()) for k in ("mean", "sum", "own")}
        ref_opt = {k: make([p]) for k, p in ref.items()}
        flat = torch.zeros(layout.total, device=comm.device)
        flat[:_PSI] = start
        shard = flat[lo:hi]  # a view, as in the package: stepping it updates flat_params in place
        optimizer = make([shard])
        for step in range(3):
            grads = _local_gradients(n, step, comm.device)
            for k, g in (("mean", torch.stack(grads).mean(0)), ("sum", torch.stack(grads).sum(0)),
                         ("own", grads[r])):
                ref[k].grad = g
                ref_opt[k].step()
            local = torch.zeros(layout.total, device=comm.device)
            local[:_PSI] = grads[r]
            mark, before = len(comm.tracer.events), flat.clone()
            try:
                with dist_calls() as calls:
                    fn(flat, local, shard, optimizer, comm)
            except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
                if _timed_out(exc):
                    raise  # a collective nobody answered: the launcher says who waited for what
                return raised(f"rank {r}: your zero1_step", exc, fn)
            events = comm.tracer.events[mark:]
            seen += calls
            where = f"with {opt_name}, step {step}"
            found = _all_reduced(calls, r, n, local.numel() * 4, "the gradient")
            if found:
                return found
            got, want = flat[:_PSI], ref["mean"].detach()
            if torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                continue
            mine = slice(lo, min(hi, _PSI))
            if torch.equal(flat, before):
                return (f"{where}: flat_params did not change on rank {r}: the optimizer steps "
                        "shard from shard.grad, which must hold this rank's slice of the averaged "
                        "gradient when optimizer.step() runs")
            if torch.allclose(got[mine], ref["sum"].detach()[mine], rtol=1e-5, atol=1e-6):
                return (f"{where}: rank {r}'s shard was stepped with the sum of the ranks' "
                        f"gradients, {n}× their mean: divide by N (Adam hardly notices — it "
                        "divides by the gradient's own size — but SGD steps N times too far)")
            if torch.allclose(got[mine], ref["own"].detach()[mine], rtol=1e-5, atol=1e-6):
                return (f"{where}: rank {r} stepped its shard with its own gradient only: the "
                        "gradients must be summed over the ranks first (each rank needs only "
                        "its shard of the sum)")
            if torch.allclose(got[mine], want[mine], rtol=1e-5, atol=1e-6):
                wrong = (got - want).abs().gt(1e-5).nonzero().flatten()
                k = int(wrong[0])
                if any(e.op == "all_gather" for e in events):
                    return (f"{where}: rank {r}'s own shard is right but element {k} (rank "
                            f"{k // size}'s shard) holds its value from before the step: your "
                            "all-gather ran before the optimizer stepped the shards")
                return (f"{where}: rank {r}'s own shard is right but element {k} (rank "
                        f"{k // size}'s shard) is not: every rank needs every rank's updated "
                        "shard, in flat_params, after the step")
            return (f"{where}: rank {r}'s parameters differ from {opt_name} on the whole vector "
                    "with the mean gradient, in its own shard too")
        if not any(e.op == "all_gather" for e in comm.tracer.events):
            return "no all_gather went through comm: the updated shards must reach every rank"
    return _bypass(seen, r)


def _all_reduced(calls, r: int, n: int, nbytes: int, what: str,
                 rest: str = "the all-gather of the updated shards the other half — together what "
                             "one all-reduce costs, with 1/N of the optimizer's work") -> str | None:
    """An all-reduce among ``calls`` (every torch.distributed call the learner's function made,
    through ``comm`` or not), said with what was observed."""
    reduced = [c for c in calls if c.op == "all_reduce"]
    if not reduced:
        return None
    direct = " directly through torch.distributed (the tracer never saw it)" \
        if any(c.direct for c in reduced) else ""
    size = sum(c.nbytes for c in reduced)
    return (f"rank {r} all-reduced {size:,.0f} B{direct}, where each rank needs only its shard of "
            f"the sum of {what}: a reduce-scatter sends {(n - 1) / n * nbytes:,.0f} B per rank, "
            f"half an all-reduce's 2(N−1)/N, and {rest}")


def _bypass(calls, r: int) -> str | None:
    """Collectives the learner's function made past ``comm`` (the tracer cannot count them)."""
    direct = bypassed(calls)
    if not direct:
        return None
    names = sorted({c.function for c in direct})
    return (f"rank {r} called torch.distributed's {', '.join(names)} directly: use the comm you are "
            "given (comm.reduce_scatter, comm.all_gather), so that the tracer counts its bytes")


@exercise("zero1_step",
          "reduce-scatter, step and all-gather equal SGD and Adam on the whole vector at 2 and 3 "
          "ranks (uneven sizes padded), and strategy 'zero1' with it trains like one process")
def _check_zero1_step(fn) -> str | None:
    return _on_ranks(_zero1_rank, fn) or _inside_at("zero1_step", fn, "zero1", _zero1_rows)


def _zero1_rows(summary, cfg, package) -> list:
    n, psi, b = cfg.world_size, summary.params, _bytes_per_element(summary)
    sent = sent_per_rank(summary, "reduce_scatter") + sent_per_rank(summary, "all_gather")
    states = summary.memory[0]["bytes"]["optimizer_states"]
    return [Row(f"N={n}: reduce-scatter + all-gather", sent, f"an all-reduce's 2(N−1)/N·{b}B·Ψ",
                2 * (n - 1) / n * b * psi),
            Row(f"N={n}: Adam's states on rank 0", states, "8B·Ψ/N", 8 * psi / n)]


# --------------------------------------------------------------------------------------------------
# ZeRO-3's hook: gather before a unit computes, free after, reduce-scatter after backward
# --------------------------------------------------------------------------------------------------


class _Stop(Exception):
    """Every rank stops the run at the same hook call (none is left waiting in a collective)."""


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or "connection closed" in text


class _Spy:
    """Calls the learner's hook (with a :class:`~.guards.GuardedUnit`) and looks at what it did:
    gathered (into ``unit.full``, every shard in rank order), freed, reduced the gradient.  The expected values come from the same
    collectives run with the tracer paused; every rank agrees on a problem before any stops."""

    def __init__(self, fn, comm):
        self.fn, self.comm = fn, comm
        self.problem: str | None = None
        self.stopped = False
        self.kept: dict = {}  # moment -> names of units the hook left gathered after it

    def __call__(self, unit, comm, moment):
        c, n = self.comm, self.comm.size
        whole = unit.full
        want_full = want_grad = grad = None
        with c.tracer.paused():
            if moment.startswith("before"):
                want_full = torch.empty(whole.numel(), dtype=whole.dtype, device=whole.device)
                c.all_gather(want_full, unit.shard.clone())
            if moment == "after backward":
                grad = unit.grad.clone()
                want_grad = torch.empty_like(unit.grad_shard)
                c.reduce_scatter(want_grad, grad.clone())
        was = unit.gathered
        mark = len(c.tracer.events)
        result = problem = None
        calls: list = []
        try:
            with dist_calls() as calls:
                result = self.fn(GuardedUnit(unit), comm, moment)
                if result is not None and hasattr(result, "wait"):
                    result.wait()  # an asynchronous collective's work, as the package's returns
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            if _timed_out(exc):
                raise  # a collective nobody answered: the launcher says who waited for what
            problem = self._raised(exc, unit, moment)
        ops = [e.op for e in c.tracer.events[mark:]] + [k.op for k in bypassed(calls)]
        if problem is None:
            problem = self._verify(unit, moment, was, ops, want_full, grad, want_grad, n, calls)
        if problem is None:
            problem = _bypass(calls, c.rank)
        flag = torch.tensor([0.0 if problem is None else 1.0], device=c.device)
        with c.tracer.paused():
            c.all_reduce(flag)
        if flag.item():
            self.problem, self.stopped = problem, True  # problem: None on a rank that found none
            raise _Stop()
        return result

    def _raised(self, exc, unit, moment) -> str:
        text = raised(f"your hook at '{moment}' of unit {unit.name!r}", exc, self.fn)
        if isinstance(exc, AttributeError) and "full" in str(exc):
            text += (" — unit.full cannot be replaced: the module's parameters are views of it, "
                     "so the gathered values must go into it (allocate it, then fill it)")
        elif moment != "after backward" and "NoneType" in str(exc):
            text += " — unit.grad and unit.grad_shard exist only at 'after backward'"
        return text

    def _verify(self, unit, moment, was, ops, want_full, grad, want_grad, n, calls=()) -> str | None:
        name = unit.name
        if moment.startswith("before"):
            phase = moment.split()[1]
            if not unit.gathered:
                if phase == "backward" and was:
                    return (f"your hook freed the parameters of unit {name!r} at 'before "
                            "backward', before its backward used them: backward multiplies by the same "
                            "weights as forward — free them after the backward")
                if "all_gather" in ops:
                    return (f"at '{moment}' your hook all-gathered, but unit.full of {name!r} has "
                            "no memory afterwards: the module's parameters are views of unit.full, "
                            "so allocate it and gather into it, not into another tensor")
                if phase == "backward":
                    return (f"unit {name!r} would start its backward with its parameters freed: "
                            "they were freed after forward and your hook does not gather them "
                            "again at 'before backward' — backward needs the full weights too")
                return (f"unit {name!r} would start its forward with its parameters not gathered: "
                        "at 'before forward' unit.full has no memory after your hook")
            return self._gathered_values(unit, moment, ops, want_full, n)
        if moment == "after backward":
            found = self._reduced_values(unit, ops, grad, want_grad, n, calls)
            if found:
                return found
        if unit.gathered:
            self.kept.setdefault(moment, set()).add(name)
        return None

    def _gathered_values(self, unit, moment, ops, want, n) -> str | None:
        full, name, r = unit.full, unit.name, self.comm.rank
        if torch.equal(full, want):
            return None
        size = unit.shard.numel()
        part = [full[k * size:(k + 1) * size] for k in range(n)]
        wants = [want[k * size:(k + 1) * size] for k in range(n)]
        right = [torch.equal(a, b) for a, b in zip(part, wants)]
        if right[r] and "all_gather" not in ops:
            k = right.index(False)
            return (f"at '{moment}' only rank {r}'s own shard is in unit.full of {name!r}; rank "
                    f"{k}'s part (elements {k * size} to {(k + 1) * size}) is not — every rank's "
                    "shard must arrive from its rank")
        holds = [next((j for j in range(n) if torch.equal(part[k], wants[j])), None)
                 for k in range(n)]
        if None not in holds and sorted(holds) == list(range(n)):
            k = next(k for k in range(n) if holds[k] != k)
            return (f"at '{moment}' unit.full of {name!r} holds the shards in the wrong order: "
                    f"position {k} holds rank {holds[k]}'s shard — the flat vector is every "
                    "rank's shard in rank order")
        if moment == "before backward" and "all_gather" not in ops:
            return (f"at 'before backward' unit.full of {name!r} has memory again but not the "
                    "parameters: memory that was freed keeps nothing — gather them again")
        return (f"at '{moment}' unit.full of {name!r} is not every rank's shard in rank order "
                "(the values differ)")

    def _reduced_values(self, unit, ops, grad, want, n, calls=()) -> str | None:
        got, name, r = unit.grad_shard, unit.name, self.comm.rank
        found = _all_reduced(calls, r, n, grad.numel() * grad.element_size(),
                             f"unit {name!r}'s gradient after its backward",
                             "it leaves in unit.grad_shard exactly the shard this rank steps")
        if found:
            return found
        close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # noqa: E731
        if close(got, want):
            return None
        size = got.numel()
        if close(got, grad[r * size:(r + 1) * size]):
            return (f"after backward unit.grad_shard of {name!r} holds only rank {r}'s own "
                    "gradient: it must be this rank's shard of the sum of unit.grad over the ranks")
        if close(got, want / n):
            return (f"after backward unit.grad_shard of {name!r} is divided by N once more: "
                    "unit.grad is already divided by N, so the sum over the ranks is the average")
        if not {"reduce_scatter", "all_reduce"} & set(ops):
            return (f"after backward your hook did not reduce unit {name!r}'s gradient: "
                    "unit.grad_shard must receive this rank's shard of the sum of unit.grad over "
                    "the ranks")
        return (f"after backward unit.grad_shard of {name!r} is not this rank's shard of the sum "
                "of unit.grad over the ranks")


def _unit_bytes(fsdp) -> dict:
    return {u.name: u.nbytes for u in fsdp._sharded}


def _zero3_rank(fn):
    """On each rank: two training steps of a small GPT under FullyShardedDataParallel with the
    learner's hook (seen by a :class:`_Spy`), then the gathered peak against the largest unit."""
    from ...comm import Comm
    from ...data import ArithmeticData, shard
    from ...model import GPT, GPTConfig
    from ...parallel.fsdp import MOMENTS, FullyShardedDataParallel

    comm = Comm()
    n, r = comm.size, comm.rank
    cfg = GPTConfig(**_MODEL)
    spy = _Spy(fn, comm)
    fsdp = FullyShardedDataParallel(GPT(cfg, seed=0), comm, zero3_hook=spy)
    optimizer = torch.optim.Adam(fsdp.sharded_parameters(), lr=1e-2)
    data = ArithmeticData(cfg.seq_len, 0)
    try:
        for step in range(2):
            x, y = data.batch(step, 4 * n)
            fsdp(shard(x, r, n), shard(y, r, n)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the run itself failed (a learner's error inside)
        if spy.stopped:  # autograd may hand the _Stop back wrapped
            return spy.problem
        if _timed_out(exc):
            raise
        return raised(f"rank {r}: training with your hook", exc, fn)
    sizes = _unit_bytes(fsdp)
    largest = max(sizes, key=sizes.get)
    whole, peak = sum(sizes.values()), fsdp.gathered_peak
    if peak > sizes[largest]:
        kept = " and ".join(f"'{m}'" for m in MOMENTS if m in spy.kept) or "some moment"
        return (f"rank {r} held {peak:,} B of gathered parameters at once — {peak / whole:.0%} "
                f"of the whole model's {whole:,} B — where ZeRO-3 needs, beside its shards, at "
                f"most the largest unit ({largest!r}, {sizes[largest]:,} B): your hook left "
                f"parameters gathered at {kept}; free them after each forward and each backward")
    return None


def _largest_unit_bytes(model_cfg, n: int, b: int) -> int:
    """The largest unit's flat vector (padded to a multiple of N), in bytes, from the model's shapes."""
    from ...model import GPT
    from ...parallel.flat import FlatUnit
    from ...parallel.fsdp import default_units

    units = default_units(GPT(model_cfg, seed=0))
    return max(FlatUnit([p for p in u.parameters() if p.requires_grad], n).total for u in units) * b


def _zero3_rows(summary, cfg, package) -> list:
    n, psi, b = cfg.world_size, summary.params, _bytes_per_element(summary)
    mem = summary.memory[0]
    peak = mem["bytes"]["parameters"] + mem["gathered_peak"]
    largest = _largest_unit_bytes(cfg.model, n, b)
    return [Row(f"N={n}: all-gather ×2 + reduce-scatter", sent_per_rank(summary),
                f"3(N−1)/N·{b}B·Ψ", 3 * (n - 1) / n * b * psi),
            Row(f"N={n}: peak parameters on rank 0", peak, f"{b}B·Ψ/N + largest unit",
                b * psi / n + largest)]


@exercise("zero3_hook",
          "gathers every shard in rank order before each forward and backward, frees after, "
          "reduce-scatters after backward, at most one unit gathered at 2 and 3 ranks; strategy "
          "'zero3' with it trains like one process")
def _check_zero3_hook(fn) -> str | None:
    return _on_ranks(_zero3_rank, fn) or _inside_at("zero3_hook", fn, "zero3", _zero3_rows)


# --------------------------------------------------------------------------------------------------
# ZeRO-2's hooks: each bucket reduce-scattered as soon as it is full, overlapping backward
# --------------------------------------------------------------------------------------------------

_Z2_BUCKET_MB = 0.01  # the nano GPT's 104 kB of gradients in 7 buckets (the checks alone)
_Z2_RUN_MB = 0.005  # the small GPT of the runs inside zero2: several buckets


def _zero2_alone(fn) -> str | None:
    from .core import on_clusters
    from .lesson02 import _hooks_rank

    return on_clusters(_hooks_rank, tuple(fn), (2, 3), "reduce_scatter", _Z2_BUCKET_MB)


def _spread(values: list) -> tuple[float, float] | None:
    return (min(values), max(values)) if len(values) >= 3 else None


def _zero2_rows(summary, cfg, package) -> list:
    import statistics

    n, psi, b = cfg.world_size, summary.params, _bytes_per_element(summary)
    grads = summary.memory[0]["bytes"]["gradients"]
    mine = [o for rep in summary.report for o in rep["overlap"][1:]]  # the first step warms up
    theirs = [o for rep in package.report for o in rep["overlap"][1:]]
    return [Row(f"N={n}: reduce-scatter sent per rank", sent_per_rank(summary, "reduce_scatter"),
                f"(N−1)/N·{b}B·Ψ", (n - 1) / n * b * psi),
            Row(f"N={n}: gradients kept on rank 0", grads, f"{b}B·Ψ/N (padded)",
                b * psi / n),
            Row(f"N={n}: reduce-scatter time hidden", statistics.median(mine),
                "the package's hooks, same run", statistics.median(theirs), "%",
                measured_range=_spread(mine), expected_range=_spread(theirs), compare=True)]


def _zero2_cfg(n: int):
    return _cfg("zero2", n).with_(options={"bucket_mb": _Z2_RUN_MB, "timeline": True}, steps=4)


@exercise("zero2_hooks",
          "every rank holds its shard of the full batch's mean gradient at 2 and 3 ranks, every "
          "bucket's reduce-scatter launched once, during backward, and waited for; strategy "
          "'zero2' with them trains like one process")
def _check_zero2_hooks(fn) -> str | None:
    from .core import parts

    pair = parts(fn)
    if len(pair) != 2 or not all(map(callable, pair)):
        return ("check it with the pair of your functions: check(\"zero2_hooks\", "
                "(my_grad_ready, my_end_of_backward))")
    found = _zero2_alone(pair)
    if found:
        return found
    rows = []
    for n in (2, 3):
        found = inside("zero2_hooks", tuple(pair), _zero2_cfg(n), measure=_zero2_rows)
        if found:
            return found
        rows += RUNS["zero2_hooks"].rows
    RUNS["zero2_hooks"].rows = rows
    return None
