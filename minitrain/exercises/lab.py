"""Lesson 01b, the debugging lab: five broken distributed programs (a skipped collective, send/send,
collectives in a different order on each rank, a collective on the wrong group, a float16
overflow).  The learner runs each on real ranks, reads the launcher's diagnosis, and fixes it; each
fix is checked here on running ranks, and a failure reads like the launcher's diagnosis (which rank
waited in what, at which line of the learner's program) plus what to change.

:func:`diagnosis` turns a rank failure into that text; lesson 01's ring checker uses it too.
"""

from __future__ import annotations

import itertools
import math

import torch

from .core import exercise, ranks
from .inside import rank_error, state_line

# --------------------------------------------------------------------------------------------------
# The launcher's diagnosis, in the learner's terms
# --------------------------------------------------------------------------------------------------


def waits(exc: BaseException, fn) -> list[str]:
    """Where each rank was when a run failed, from the launcher's report (its ``where``): ``"rank 0
    waited in all_reduce (line 3 of your mean_loss: dist.all_reduce(loss))"``, ``"rank 1 returned"``."""
    return [state_line(state, fn, was=True)
            for _, state in sorted(getattr(exc, "where", {}).items())]


def diagnosis(exc: BaseException, fn, where: str) -> str:
    """What the launcher found, in one paragraph: a deadlock (who waits in what, who returned),
    a collective timeout (who waited how long for what), a collective mismatch (a rank aborted by
    the backend), or an exception (the error and the learner's line)."""
    from ..launch import CollectiveTimeout, Deadlock

    if isinstance(exc, Deadlock):
        return (f"{where} the launcher found a deadlock: " + "; ".join(waits(exc, fn)) +
                " — the waiting ranks wait for ranks that will never call it")
    if isinstance(exc, CollectiveTimeout):
        return (f"{where} nothing moved until the collective timeout ({exc.timeout_s:g} s): " +
                "; ".join(waits(exc, fn)))
    if getattr(exc, "signal", None) == 6:
        reason = exc.abort_reason or "the ranks called mismatched collectives"
        return f"{where} rank {exc.rank} was aborted by the backend (signal 6): {reason}"
    return f"{where} rank {getattr(exc, 'rank', '?')} raised {rank_error(exc, fn)}"


def all_wait_in(exc, op: str, n: int) -> bool:
    """True when the launcher saw all ``n`` ranks waiting in ``op`` (e.g. every rank in a send)."""
    states = getattr(exc, "where", {}).values()
    return sum(1 for s in states if s.state == "waiting" and s.op == op) == n


# --------------------------------------------------------------------------------------------------
# Running a program on the checkers' ranks: every rank gets its own input
# --------------------------------------------------------------------------------------------------


def _loss(rank: int) -> torch.Tensor:
    return torch.tensor([2.0 + 0.25 * rank + 0.125 * rank * rank])


def _block(rank: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 100.0 * rank


_ORDERS = {  # the order in which each rank's dict lists its statistics (case "differ")
    0: ("loss", "tokens", "histogram"), 1: ("tokens", "histogram", "loss"),
    2: ("histogram", "tokens", "loss"), 3: ("tokens", "loss", "histogram")}


def _stats(rank: int, case: str) -> dict:
    values = {"loss": torch.tensor([2.5 + rank]), "tokens": torch.tensor([1000.0 * (rank + 1)]),
              "histogram": torch.arange(8, dtype=torch.float32) * 10 ** (rank % 3) + 7.0}
    order = _ORDERS[rank % 4] if case == "differ" else _ORDERS[0]
    return {k: values[k] for k in order}


def _shard(rank: int, case: str) -> torch.Tensor:
    """A rank's float16 gradient shard.  "fits": every square and every rank's sum of squares fit
    in float16, their total over the ranks does not; "spike": one element's square overflows."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(256, generator=g)
    x = x / x.norm() * 180.0  # this shard's sum of squares: 32,400 (< 65,504)
    if case == "spike":
        x[7 * rank + 3] = 300.0  # 300² = 90,000 > 65,504
    return x.half()


_PAIRS: dict = {}


def pairs():
    """This rank's list of the tensor-parallel pairs' groups, ``groups[i]`` = ranks 2i and 2i+1
    (made once per process; every rank must make them, in the same order)."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), dist.get_world_size())
    if key not in _PAIRS:
        _PAIRS.clear()
        size = dist.get_world_size()
        _PAIRS[key] = [dist.new_group([i, i + 1]) for i in range(0, size - size % 2, 2)]
    return _PAIRS[key]


def _input(kind: str, rank: int, case: str):
    return {"skipped": lambda: _loss(rank), "sendsend": lambda: _block(rank),
            "order": lambda: _stats(rank, case), "group": lambda: torch.full((3,), 2.0 ** rank),
            "fp16": lambda: _shard(rank, case)}[kind]()


def _plain(x):
    if torch.is_tensor(x):
        return x.detach().double().tolist() if x.dim() else float(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _on_rank(kind: str, fn, case: str = "", quiet: bool = True):
    """On each rank: the learner's program on this rank's input; what it returned (plain values).
    ``quiet``: what the program prints, and torch's warnings, are dropped (a check cell prints
    only its verdict)."""
    import contextlib
    import io
    import warnings

    import torch.distributed as dist

    x = _input(kind, dist.get_rank(), case)
    groups = pairs() if kind == "group" else None
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
        out = fn(x, groups) if kind == "group" else fn(x)
    return _plain(out)


def _run(kind: str, fn, n: int, case: str = ""):
    """(results by rank, None) or (None, the rank failure)."""
    from ..launch import RankError

    try:
        return ranks(n).run(_on_rank, kind, fn, case, timeout=60), None
    except RankError as exc:
        return None, exc
    except TimeoutError as exc:
        return None, exc


def _wrong(exc, fn, where: str, advice: str) -> str:
    if isinstance(exc, TimeoutError):
        return f"{where} it did not finish within 60 s (a rank waiting for a message?)"
    return f"{diagnosis(exc, fn, where)}. {advice}"


def _num(x) -> float | None:
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, list) and len(x) == 1 and isinstance(x[0], (int, float)):
        return float(x[0])
    return None


# --------------------------------------------------------------------------------------------------
# 1. A skipped collective
# --------------------------------------------------------------------------------------------------

N = 4  # the checks run the programs on 4 ranks


@exercise("lab_skipped_collective", "every rank calls the all_reduce and returns the mean loss "
          "on 4 ranks")
def _check_skipped(fn) -> str | None:
    results, exc = _run("skipped", fn, N)
    where = f"On {N} ranks"
    if exc is not None:
        return _wrong(exc, fn, where, "A collective completes only when every rank of its group "
                      "calls it: take the all_reduce (and the division) out of the `if`, so every "
                      "rank runs them; only the print is rank 0's job")
    losses = [_loss(r).item() for r in range(N)]
    mean = sum(losses) / N
    for rank, got in enumerate(results):
        value = _num(got)
        if value is None:
            return f"rank {rank} returned {got!r}: return the mean loss (a one-element tensor)"
        if abs(value - mean) <= 1e-5 * abs(mean):
            continue
        if abs(value - losses[rank]) < 1e-6:
            return (f"no deadlock now, but rank {rank} returned its own loss {value:g}, not the "
                    f"mean {mean:g}: the ranks never exchanged their losses — every rank must call "
                    "the all_reduce")
        if abs(value - sum(losses)) < 1e-5 * sum(losses):
            return (f"rank {rank} returned {value:g}, the sum of the losses, not their mean "
                    f"{mean:g}: every rank must divide by the world size, not only rank 0")
        if rank > 0 and abs(_num(results[0]) - mean) <= 1e-5 * abs(mean):
            return (f"rank 0 returned the mean, but rank {rank} returned {value:g}: every rank "
                    "needs the mean — reduce (or anything that leaves the sum on rank 0 only) is "
                    "not enough; all_reduce gives it to every rank")
        return f"rank {rank} returned {value:g}, the mean of the ranks' losses is {mean:g}"
    return None


# --------------------------------------------------------------------------------------------------
# 2. send/send
# --------------------------------------------------------------------------------------------------


@exercise("lab_send_send", "every rank gets its left neighbour's tensor on 4 ranks, without a "
          "deadlock")
def _check_send_send(fn) -> str | None:
    results, exc = _run("sendsend", fn, N)
    where = f"On {N} ranks"
    if exc is not None:
        if all_wait_in(exc, "send", N):
            advice = ("Every rank is in a blocking send, and a blocking send returns only once "
                      "its peer has received — but every peer is sending too. Start the send "
                      "without waiting (dist.isend, then .wait() after the recv), or let the even "
                      "ranks send first while the odd ones receive first")
        elif all_wait_in(exc, "recv", N):
            advice = ("Every rank is receiving and none is sending: receiving first on every "
                      "rank is the same deadlock the other way round. Start the send without "
                      "waiting for it (dist.isend), then receive")
        else:
            advice = ("Each send needs the matching recv on its peer, posted so that someone "
                      "can always make progress")
        return _wrong(exc, fn, where, advice)
    blocks = [_block(r).tolist() for r in range(N)]
    for rank, got in enumerate(results):
        left = (rank - 1) % N
        if got == blocks[left]:
            continue
        if got == blocks[rank]:
            return (f"rank {rank} returned its own tensor, not the one it received: return the "
                    f"tensor your recv filled (rank {left}'s, its left neighbour's)")
        if got in blocks:
            who = blocks.index(got)
            what = ("its own tensor" if who == rank else
                    f"rank {who}'s tensor (its right neighbour's)" if who == (rank + 1) % N else
                    f"rank {who}'s tensor")
            return (f"rank {rank} returned {what}; it should get its left neighbour's, rank "
                    f"{left}'s: send to rank + 1 and receive from rank - 1 (mod the world size)")
        return (f"rank {rank} returned {got!r}, which is no rank's tensor (rank {left}'s is "
                f"{blocks[left]}): wait for the receive to complete before you return what it "
                "filled (dist.irecv returns at once)")
    return None


# --------------------------------------------------------------------------------------------------
# 3. Collectives in a different order on each rank
# --------------------------------------------------------------------------------------------------


def _explain_sum(rank: int, name: str, value: float, case: str) -> str:
    """Which ranks' entries ``value`` (rank's wrong ``name``) is the sum of, if we can tell."""
    options = [[(q, k, _stats(q, case)[k].view(-1)[0].item()) for k in ("loss", "tokens",
                                                                           "histogram")]
               for q in range(N)]
    for combo in itertools.product(*options):
        if abs(sum(v for _, _, v in combo) - value) < 1e-3:
            return " + ".join(f"rank {q}'s '{k}'" for q, k, _ in combo)
    return ""


@exercise("lab_mismatched_order", "every rank reduces the statistics in the same order, whatever "
          "order its dict lists them in (4 ranks)")
def _check_order(fn) -> str | None:
    for case in ("same", "differ"):
        results, exc = _run("order", fn, N, case)
        if case == "same":
            where = (f"On {N} ranks whose dicts all list the names in the same order "
                     f"({', '.join(_ORDERS[0])})")
            advice = ("Even with the same dicts, the ranks reduced the entries in different "
                      "orders: choose the order the same way on every rank (e.g. sorted(stats) "
                      "everywhere), not on some ranks only")
        else:
            orders = "; ".join(f"rank {r}: {', '.join(_ORDERS[r])}" for r in range(N))
            where = f"On {N} ranks whose dicts list the names in different orders ({orders})"
            advice = ("Your loop follows each rank's own dict order, so the ranks reduce "
                      "different entries at the same time. Reduce them in one order every rank "
                      "agrees on, e.g. sorted by name")
        if exc is not None:
            return _wrong(exc, fn, where, advice)
        for rank, got in enumerate(results):
            if not isinstance(got, dict) or sorted(got) != sorted(_ORDERS[0]):
                return (f"{where}: rank {rank} returned {type(got).__name__}: return the dict of "
                        "statistics, each summed over the ranks")
            for name in _ORDERS[0]:
                want = sum(_stats(q, case)[name] for q in range(N)).tolist()
                have = got[name] if isinstance(got[name], list) else [got[name]]
                if len(have) == len(want) and all(abs(a - b) < 1e-3 for a, b in zip(have, want)):
                    continue
                mix = _explain_sum(rank, name, have[0], case) if len(have) == 1 else ""
                return (f"{where}, nothing failed but rank {rank}'s '{name}' is {have[:3]}, not the "
                        f"sum over the ranks {want[:3]}" +
                        (f": it is {mix} — the ranks summed different entries together "
                         "(same shapes, so the backend could not notice). " if mix else ". ") +
                        "Reduce the entries in one order every rank agrees on, e.g. sorted by name")
    return None


# --------------------------------------------------------------------------------------------------
# 4. A collective on the wrong group
# --------------------------------------------------------------------------------------------------


def _ranks_in(value: float) -> list[int]:
    k = int(round(value))
    return [r for r in range(N) if k >> r & 1] if abs(value - k) < 1e-6 else []


@exercise("lab_wrong_group", "every rank sums its partial result over its own tensor-parallel pair "
          "(4 ranks, pairs 0-1 and 2-3)")
def _check_group(fn) -> str | None:
    results, exc = _run("group", fn, N)
    where = f"On {N} ranks in pairs (groups[0] = ranks 0 and 1, groups[1] = ranks 2 and 3)"
    if exc is not None:
        return _wrong(exc, fn, where, "A rank that calls a collective on a group it is not a "
                      "member of skips it (torch only warns), so its partner waits alone. Rank r "
                      "belongs to pair r // 2: pass groups[rank // 2]")
    for rank, got in enumerate(results):
        mine = [2 * (rank // 2), 2 * (rank // 2) + 1]
        value = got[0] if isinstance(got, list) and got else _num(got)
        if not isinstance(value, (int, float)):
            return f"rank {rank} returned {got!r}: return the partial result summed over the pair"
        have = _ranks_in(value)
        if have == mine:
            continue
        if have == [rank]:
            return (f"rank {rank} got only its own partial back: it passed a group it is not a "
                    "member of, and torch skips a collective on such a group with only a warning. "
                    "Rank r belongs to pair r // 2: pass groups[rank // 2]")
        if have == list(range(N)):
            return (f"rank {rank} got the sum over all {N} ranks (the whole world), not over its "
                    f"pair, ranks {mine[0]} and {mine[1]}: pass the pair's group, groups[rank // 2]")
        named = f"the partials of ranks {have}" if have else f"{value:g}"
        return (f"rank {rank} got {named}, not the sum over its pair, ranks {mine[0]} and "
                f"{mine[1]}")
    return None


# --------------------------------------------------------------------------------------------------
# 5. Float16 overflow
# --------------------------------------------------------------------------------------------------

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@exercise("lab_fp16_overflow", "the global gradient norm of float16 shards is finite and right on 4 "
          "ranks, also when the squares' sum (or one square) exceeds float16's 65,504")
def _check_fp16(fn) -> str | None:
    for case in ("fits", "spike"):
        results, exc = _run("fp16", fn, N, case)
        where = f"On {N} ranks"
        if exc is not None:
            return _wrong(exc, fn, where, "")
        shards = [_shard(r, case).double() for r in range(N)]
        squares = [float((s * s).sum()) for s in shards]
        norm = math.sqrt(sum(squares))
        biggest = max(float(s.abs().max()) for s in shards)
        for rank, got in enumerate(results):
            value = _num(got)
            if value is None:
                return f"rank {rank} returned {got!r}: return the norm as a float"
            if math.isfinite(value) and abs(value - norm) <= 2e-3 * norm:
                continue
            if not math.isfinite(value):
                if case == "fits":
                    return (f"rank {rank} returned {value}: every shard's sum of squares fits in "
                            f"float16 ({max(squares):,.0f} at most), but their sum over the ranks, "
                            f"{sum(squares):,.0f}, is above float16's largest value, "
                            f"{FP16_MAX:,.0f} — so the all_reduce's float16 sum overflowed. Square, "
                            "sum and all-reduce in float32 (grad.float()), or scale the values "
                            "down first")
                return (f"rank {rank} returned {value}: one element is {biggest:g}, and its square, "
                        f"{biggest * biggest:,.0f}, overflows float16 (largest {FP16_MAX:,.0f}) "
                        "before any sum — convert to float32 before you square, not after")
            local = sum(math.sqrt(q) for q in squares)
            if abs(value - local) <= 2e-3 * local:
                return (f"rank {rank} returned {value:,.1f}, the sum of the ranks' own norms; the "
                        f"norm of the whole gradient is {norm:,.1f}: norms do not add, their "
                        "squares do — all-reduce the sums of squares, then take the root")
            return f"rank {rank} returned {value:,.2f}, the norm of the whole gradient is {norm:,.2f}"
    return None


# --------------------------------------------------------------------------------------------------
# In the notebook: run a program on a Cluster and show what came back, or the diagnosis
# --------------------------------------------------------------------------------------------------

_KINDS = {"lab_skipped_collective": "skipped", "lab_send_send": "sendsend",
          "lab_mismatched_order": "order", "lab_wrong_group": "group", "lab_fp16_overflow": "fp16"}


def run_program(cluster, name: str, fn, case: str = "") -> list | None:
    """Run the lab program ``fn`` of exercise ``name`` on ``cluster`` (every rank with its own
    input, as the check does) and print what each rank returned — or, when the run fails, the
    launcher's error (a :class:`~minitrain.launch.RankError`), without the ranks' stacks.  Never
    raises for a rank's failure; returns the results or None."""
    from ..launch import RankError

    kind = _KINDS[name]
    case = case or {"order": "differ", "fp16": "fits"}.get(kind, "")
    try:
        results = cluster.run(_on_rank, kind, fn, case, False, timeout=60)
    except RankError as err:
        print(f"{type(err).__name__}: {short(err)}")
        return None
    for rank, got in enumerate(results):
        print(f"rank {rank} returned {got}")
    return results


def short(err: BaseException) -> str:
    """The launcher's error without the ranks' stacks and tracebacks (what to read first)."""
    from ..diagnostics import RankError, format_error

    return format_error(err, details=False) if isinstance(err, RankError) else str(err)
