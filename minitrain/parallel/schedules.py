"""Pipeline schedules as data (lesson 05): which action each rank runs, in which order, and what
that costs — pure Python, no processes.

Papers: GPipe — Huang et al., 2019; 1F1B — Narayanan et al., 2019 (PipeDream) and 2021
(PipeDream-Flush); interleaved 1F1B — Narayanan et al., 2021 (Megatron-LM, PTD-P); zero bubble
(ZB-H1) — Qi et al., 2024.

A schedule is a :data:`Table`: for each rank the ordered :class:`Action` s it runs (``F``, ``B``, or
for zero bubble ``I`` then ``W``), ``None`` for one unit of idle time.  :func:`make_schedule` writes
it, :func:`validate` checks it, :func:`simulate` times it with :data:`COSTS`;
:class:`~minitrain.parallel.pipeline.PipelineExecutor` runs it on real ranks.  What a timeline says
(the bubble, the activations in flight) is :mod:`minitrain.planning.analysis`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ParameterError

__all__ = ["Action", "COSTS", "SCHEDULES", "Table", "ScheduleError", "split_layers",
           "check_schedule", "one_f_one_b", "orders", "make_schedule", "with_idles", "dependencies", "simulate",
           "validate", "as_action"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` (F, B, I or W) of micro-batch ``microbatch`` on virtual
    stage ``stage`` (it runs on rank ``stage % P``)."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


#: ideal durations in units of one forward: a backward costs two (input- and weight-gradient GEMMs)
COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
Table = list  # list[list[Action | None]]: table[rank] = that rank's actions in order, None = idle


class ScheduleError(ParameterError):
    """A schedule that cannot run: the message names the offending action, or (from
    :func:`check_schedule`) the parameter, its value and the fix, as :class:`ParameterError`'s
    fields."""


# --------------------------------------------------------------------------------------------------
# Making schedules: each rank's order of actions, then the ideal timing
# --------------------------------------------------------------------------------------------------


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Blocks of each stage: as even as possible, the first ``n_layer % n_stages`` get one more."""
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} stages need at least {n_stages} layers, got {n_layer}")
    q, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + q + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, *,
                   n_layer: int | None = None, batch: int | None = None) -> None:
    """Raise :class:`ScheduleError`, naming the parameter, its value and the fix, unless schedule
    ``name`` can run ``microbatches`` micro-batches on ``stages`` ranks of ``chunks`` model chunks
    each — of a model of ``n_layer`` blocks and a batch of ``batch`` samples, when given."""
    P, M, V = stages, microbatches, chunks
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown {{}}; choose one of: {', '.join(SCHEDULES)}",
                            ("schedule", name))
    if P < 1 or M < 1 or V < 1:
        shape = (("stages", P), ("microbatches", M), ("chunks", V))
        refused, value = next((k, v) for k, v in shape if v < 1)
        raise ScheduleError("stages, microbatches and chunks must be >= 1, got {}, {}, {}", *shape,
                            parameter=refused, value=value)
    if n_layer is not None and P * V > n_layer:
        raise ScheduleError(f"{{}} x {{}} = {P * V} pipeline stages but the model has {n_layer} "
                            "layers; use {} or more, or fewer stages/chunks",
                            ("stages", P), ("chunks", V), ("n_layer", P * V))
    if batch is not None and M > batch:
        raise ScheduleError("{} is more than {}: each micro-batch needs at least one sample; use "
                            "{} or fewer", ("microbatches", M), ("batch", batch),
                            ("microbatches", batch))
    if name == "naive" and M != 1:
        raise ScheduleError(f"the naive schedule runs one batch, no micro-batches: use {{}} (got "
                            f"{M}), or {{}} to use micro-batches", ("microbatches", 1),
                            ("schedule", "gpipe/1f1b"), parameter="microbatches", value=M)
    if name == "interleaved":
        if V < 2:
            raise ScheduleError(f"interleaved 1F1B needs chunks >= 2 model chunks per rank, got "
                                f"{V}; use {{}} (or {{}} for one chunk)", ("chunks", 2),
                                ("schedule", "1f1b"), parameter="chunks", value=V)
        if M % P:
            raise ScheduleError(f"interleaved 1F1B (Megatron) needs microbatches to be a multiple "
                                f"of {{}}, got {M}; use {{}}", ("stages", P),
                                ("microbatches", P * max(1, round(M / P))),
                                parameter="microbatches", value=M)
    elif V != 1:
        raise ScheduleError(f"{name} runs one model chunk per rank, got {{}}; use {{}}, or {{}}",
                            ("chunks", V), ("chunks", 1), ("schedule", "interleaved"))


def _one_f_one_b(P: int, M: int, r: int, backward: str = "B") -> list[Action]:
    """PipeDream-Flush: P−r−1 warm-up forwards, then one forward / one backward, then the rest."""
    warmup = min(P - r - 1, M)
    order = [Action("F", m, r) for m in range(warmup)]
    for i in range(M - warmup):
        order += [Action("F", warmup + i, r), Action(backward, i, r)]
    return order + [Action(backward, m, r) for m in range(M - warmup, M)]


def one_f_one_b(rank: int, P: int, M: int) -> list[str]:
    """1F1B's order on ``rank`` of ``P`` stages for ``M`` micro-batches, as strings ("F0", "B0"):
    what :func:`orders` runs when its ``one_f_one_b`` seam is None (lesson 05's exercise writes
    one)."""
    return [f"{a.kind}{a.microbatch}" for a in _one_f_one_b(P, M, rank)]


def _interleaved(P: int, M: int, V: int, r: int) -> list[Action]:
    """Megatron's interleaved 1F1B order on rank r (M a multiple of P).

    The k-th forward of a rank is micro-batch ``(k // (P·V))·P + k % P`` of chunk
    ``(k // P) % V``: groups of P micro-batches go through chunk 0, then chunk 1, ...  Backwards
    go through the chunks in reverse.  Warm-up: 2(P−r−1) + (V−1)·P forwards.
    """
    def action(kind: str, k: int) -> Action:
        group, inner = divmod(k, P * V)
        chunk = inner // P if kind == "F" else V - 1 - inner // P
        return Action(kind, group * P + inner % P, chunk * P + r)

    total = M * V
    warmup = min(2 * (P - r - 1) + (V - 1) * P, total)
    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    return order + [action("B", k) for k in range(total - warmup, total)]


def _zb_h1(P: int, M: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2024): 1F1B's F and I order, with each W put where the rank would wait.

    A greedy list schedule in unit time: a free rank runs its next F or I (in 1F1B order) if its
    inputs are there; otherwise it runs its oldest pending W, filling what would be bubble.  A rank
    never holds more than P micro-batches forwarded but not yet W'd — 1F1B's peak on the first
    stage, so the activation memory is 1F1B's.  Leftover Ws run at the end.
    """
    todo = [_one_f_one_b(P, M, r, backward="I") for r in range(P)]
    out: list[list[Action]] = [[] for _ in range(P)]
    pending: list[list[Action]] = [[] for _ in range(P)]
    held = [0] * P  # forwarded, not yet W'd
    done: dict[Action, int] = {}  # action -> end time
    t = 0
    while any(todo) or any(pending):
        started = []
        for r in range(P):
            if out[r] and done.get(out[r][-1], t + 1) > t:
                continue  # still busy
            nxt = todo[r][0] if todo[r] else None
            ready = nxt is not None and all(done.get(d, t + 1) <= t for d in dependencies(nxt, P, "I"))
            if ready and not (nxt.kind == "F" and held[r] >= P and pending[r]):
                todo[r].pop(0)
                held[r] += nxt.kind == "F"
                if nxt.kind == "I":
                    pending[r].append(Action("W", nxt.microbatch, nxt.stage))
                started.append((r, nxt))
            elif pending[r]:
                held[r] -= 1
                started.append((r, pending[r].pop(0)))
        for r, a in started:
            out[r].append(a)
            done[a] = t + COSTS[a.kind]
        t += 1
    return out


def orders(name: str, stages: int, microbatches: int, chunks: int = 1, *,
           one_f_one_b=None) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (no idles): the heart of each schedule.

    ``one_f_one_b(rank, P, M) -> ["F0", "F1", "B0", ...]`` is 1F1B's order (None: the package's
    :func:`one_f_one_b`; lesson 05's exercise writes one): each string is an action of micro-batch
    N on the rank's own stage."""
    check_schedule(name, stages, microbatches, chunks)
    P, M = stages, microbatches
    if one_f_one_b is not None and name != "1f1b":
        raise ScheduleError("one_f_one_b= replaces the 1f1b order only, got {}", ("schedule", name))
    if name == "1f1b" and one_f_one_b is None:
        return [_one_f_one_b(P, M, r) for r in range(P)]
    if name == "1f1b":
        return [[as_action(a, r) for a in one_f_one_b(r, P, M)] for r in range(P)]
    if name in ("naive", "gpipe"):  # all forwards, then all backwards
        return [[Action("F", m, r) for m in range(M)] + [Action("B", m, r) for m in range(M)]
                for r in range(P)]
    if name == "interleaved":
        return [_interleaved(P, M, chunks, r) for r in range(P)]
    return _zb_h1(P, M)


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1, *,
                  one_f_one_b=None) -> Table:
    """The ideal table of schedule ``name``: each rank's order (:func:`orders`), with ``None`` for
    each idle unit (placed by :func:`simulate` with :data:`COSTS`)."""
    table = orders(name, stages, microbatches, chunks, one_f_one_b=one_f_one_b)
    return with_idles(table, simulate(table))


def with_idles(table: Table, timeline: list[dict]) -> Table:
    """``table`` with one ``None`` per unit of time each rank waits in ``timeline`` (integer costs)."""
    out: Table = [[] for _ in table]
    clock = [0.0] * len(table)
    for e in sorted(timeline, key=lambda e: (e["rank"], e["start"])):
        r = e["rank"]
        out[r] += [None] * round(e["start"] - clock[r])
        out[r].append(e["action"])
        clock[r] = e["end"]
    return out


# --------------------------------------------------------------------------------------------------
# Checking and simulating a table
# --------------------------------------------------------------------------------------------------


def dependencies(a: Action, n_stages: int, backward: str = "B") -> list[Action]:
    """What ``a`` needs done first: F(m,s) ← F(m,s−1); B/I(m,s) ← F(m,s) and the input gradient of
    (m,s+1) (its ``backward``: B, or I under zero-bubble); W(m,s) ← I(m,s)."""
    m, s = a.microbatch, a.stage
    if a.kind == "F":
        return [Action("F", m, s - 1)] if s > 0 else []
    if a.kind == "W":
        return [Action("I", m, s)]
    return [Action("F", m, s)] + ([Action(backward, m, s + 1)] if s + 1 < n_stages else [])


def _actions(table: Table) -> list[tuple[int, Action]]:
    return [(r, a) for r, row in enumerate(table) for a in row if a is not None]


def simulate(table: Table, costs: dict = COSTS) -> list[dict]:
    """The ideal timeline of ``table``: each rank runs its actions in order, each as soon as the
    rank is free and what it needs has finished (sends never block, receives do).  ``None``
    entries are ignored: the waits are recomputed from the dependencies.

    Returns ``[{"rank", "action", "start", "end"}]`` in units of time; raises :class:`ScheduleError`
    naming the blocked actions when no rank can go on (a deadlock).
    """
    acts = _actions(table)
    n_stages = 1 + max((a.stage for _, a in acts), default=0)
    present = {a for _, a in acts}
    rows = [[a for a in row if a is not None] for row in table]
    pos, free = [0] * len(rows), [0.0] * len(rows)
    end: dict[Action, float] = {}
    timeline = []
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                deps = _deps_in(a, n_stages, present)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                end[a] = free[r] = start + costs[a.kind]
                timeline.append({"rank": r, "action": a, "start": start, "end": end[a]})
                pos[r] += 1
                progress = True
    blocked = [(r, row[pos[r]]) for r, row in enumerate(rows) if pos[r] < len(row)]
    if blocked:
        waits = []
        for r, a in blocked:
            missing = [d for d in _deps_in(a, n_stages, present) if d not in end]
            waits.append(f"rank {r} waits on {a} (needs {', '.join(map(str, missing))})")
        raise ScheduleError("deadlock: " + ", ".join(waits))
    return timeline


def _deps_in(a: Action, n_stages: int, present: set) -> list[Action]:
    """dependencies() with the next stage's input gradient as whichever of B / I the table has."""
    backward = "I" if Action("I", a.microbatch, a.stage + 1) in present else "B"
    return dependencies(a, n_stages, backward)


def validate(table: Table, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raise :class:`ScheduleError` unless ``table`` can run: every forward and backward (B, or
    I and W) of every (micro-batch, stage) exactly once, on rank ``stage % stages``, each after what
    it needs on its own rank, and no deadlock between ranks."""
    P, S = stages, stages * chunks
    if len(table) != P:
        raise ScheduleError(f"the table has {len(table)} rows, expected one per rank ({P})")
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(table):
        for i, a in enumerate(row):
            if a is None:
                continue
            if not isinstance(a, Action) or a.kind not in COSTS:
                raise ScheduleError(f"rank {r}: {a!r} is not an Action of kind F, B, I or W")
            if not (0 <= a.microbatch < microbatches and 0 <= a.stage < S):
                raise ScheduleError(f"rank {r}: {a} is out of range (micro-batches 0..{microbatches - 1},"
                                    f" stages 0..{S - 1})")
            if a.stage % P != r:
                raise ScheduleError(f"rank {r}: {a} is on the wrong rank; stage {a.stage} runs on "
                                    f"rank {a.stage % P}")
            if a in where:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            where[a] = (r, i)
    for m in range(microbatches):
        for s in range(S):
            split = Action("I", m, s) in where or Action("W", m, s) in where
            if split and Action("B", m, s) in where:
                raise ScheduleError(f"rank {s % P}: B{m}@s{s} and I/W{m}@s{s} both present; use "
                                    "either B or the I+W pair")
            for kind in ("F", "I", "W") if split else ("F", "B"):
                if Action(kind, m, s) not in where:
                    raise ScheduleError(f"missing: {Action(kind, m, s)} (rank {s % P})")
    present = set(where)
    for a, (r, i) in where.items():
        for d in _deps_in(a, S, present):
            if where[d][0] == r and where[d][1] > i:
                raise ScheduleError(f"rank {r}: {a} comes before {d}")
    simulate(table)


def as_action(a, stage: int | None = None) -> Action:
    """An Action from an Action or its string: "F3@s1", or "F3" on ``stage`` (so reported
    timelines and a learner's rows can be read back)."""
    if isinstance(a, Action):
        return a
    match = re.fullmatch(r"([FBIW])(\d+)(?:@s(\d+))?", a.strip()) if isinstance(a, str) else None
    if match is None or (match.group(3) is None and stage is None):
        raise ScheduleError(f"{a!r} is not an action: write 'F3' for the forward of micro-batch 3, "
                            "'B3' for its backward (or 'F3@s1' with its stage)")
    s = int(match.group(3)) if match.group(3) is not None else stage
    return Action(match.group(1), int(match.group(2)), s)
