"""Running a learner's function inside the real strategy, what the run measured, and the learner's
own minitrain: every function that passed its check, kept on disk for lesson 08.

A plug-in check first tests the function alone, then :func:`inside` trains the real strategy with
it in its seam (``train(cfg, seams={seam: fn})``) next to one process (and the package's own code),
and keeps a :class:`Run`: losses, bytes per rank from the tracer, memory from the ledger and step
times, beside the formulas the lesson derives.  ``report(name)`` shows it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ...record import RunSummary
from . import guards
from .core import ranks
from .trouble import (learner_line, rank_error, rank_trouble, state_line,  # noqa: F401
                      where_line)  # re-exported
from .kept import keep, mine, mine_dir, parts  # noqa: F401 - re-exported

# --------------------------------------------------------------------------------------------------
# The real strategy with the learner's function in its seam
# --------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One measured quantity beside the lesson's formula for it — or, with ``compare``, beside
    another measurement (``formula`` then names it: no ratio, and a difference is claimed only when
    the two spreads, ``measured_range`` and ``expected_range`` (min, max over repeats), do not
    overlap)."""
    what: str
    measured: float
    formula: str = ""
    expected: float | None = None
    unit: str = "B"
    measured_range: tuple | None = None
    expected_range: tuple | None = None
    compare: bool = False

    def line(self) -> str:
        got = _fmt(self.measured, self.unit)
        if self.expected is None:
            return f"  {self.what:<38s} {got:>12s}"
        if self.compare:
            return (f"  {self.what:<38s} {got:>12s}{_range(self.measured_range, self.unit)}   "
                    f"{self.formula}: {_fmt(self.expected, self.unit)}"
                    f"{_range(self.expected_range, self.unit)} — {self.verdict()}")
        ratio = self.measured / self.expected if self.expected else float("nan")
        return (f"  {self.what:<38s} {got:>12s}   formula {self.formula} = "
                f"{_fmt(self.expected, self.unit)} (measured/formula {ratio:.2f})")

    def verdict(self) -> str:
        """Whether two measurements differ beyond their spreads (medians of repeats)."""
        a, b = self.measured_range, self.expected_range
        if a is None or b is None:
            return "one run each: no difference can be claimed"
        if a[1] < b[0]:
            return "lower, beyond both spreads"
        if a[0] > b[1]:
            return "higher, beyond both spreads"
        return "the spreads overlap: no difference shown"


def _range(r, unit: str) -> str:
    return f" (range {_fmt(r[0], unit)}–{_fmt(r[1], unit)})" if r else ""


def _fmt(x: float, unit: str) -> str:
    if unit == "B":
        return f"{x:,.0f} B"
    if unit == "%":
        return f"{x:.0%}"
    if unit == "s":
        return f"{x * 1e3:.1f} ms"
    return f"{x:g}{unit}"


@dataclass
class Run:
    """What the real strategy did with the learner's function in its seam (shown by :func:`report`)."""
    exercise: str
    strategy: str
    world: int
    options: dict
    losses: list
    reference: list
    reference_name: str
    summary: RunSummary
    package: RunSummary  # the package's own run's
    rows: list = field(default_factory=list)

    def lines(self) -> list[str]:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        worst = max((abs(a - b) / abs(b) for a, b in zip(self.losses, self.reference)), default=0)
        out = [f"Strategy '{self.strategy}' on {self.world} ranks{' (' + opts + ')' if opts else ''} "
               f"with your {self.exercise}:",
               f"  {'yours':<12s}{' '.join(f'{v:.5f}' for v in self.losses)}",
               f"  {self.reference_name:<12s}{' '.join(f'{v:.5f}' for v in self.reference)}"
               f"   (largest relative difference {worst:.1e})"]
        out += [row.line() for row in self.rows]
        out.append(step_time_line(self.summary, self.package))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def step_time_line(mine: dict, own: dict) -> str:
    """Two runs' step times, each with its spread over the steps after the first (the first warms
    up), and a difference claimed only beyond both spreads."""
    def times(summary):
        ts = summary.step_times_s or [summary.step_time_s]
        return ts[1:] if len(ts) > 2 else ts

    a, b = times(mine), times(own)
    ma, mb = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
    if len(a) < 3 or len(b) < 3:
        pace = "one or two steps each: no difference can be claimed"
    elif max(a) < min(b):
        pace = f"yours is faster, beyond both spreads ({mb / ma:.1f}×)"
    elif min(a) > max(b):
        pace = f"yours is slower, beyond both spreads ({ma / mb:.1f}×)"
    else:
        pace = "the spreads overlap: no difference shown"
    return (f"  step time (median, range over {len(a)} steps): yours {ma * 1e3:.1f} ms "
            f"({min(a) * 1e3:.1f}–{max(a) * 1e3:.1f}), the package's {mb * 1e3:.1f} ms "
            f"({min(b) * 1e3:.1f}–{max(b) * 1e3:.1f}) — {pace}")


#: exercise name -> the last Run of a passing check (what :func:`report` shows)
RUNS: dict = {}
#: a config's one-process losses, computed once per kernel (every attempt compares with them)
_ONE_PROCESS: dict = {}


def inside(name: str, fn, cfg, seam: str | None = None, reference: str = "single",
           measure=None, tolerance: float = 1e-5) -> str | None:
    """Train ``cfg``'s strategy with ``fn`` in seam ``seam`` (default: the exercise's name; ``fn``
    guarded for it by :func:`.guards.plug`) on the checkers' running ranks, and compare its losses with one process (``reference="single"``) or
    with the package's own code (``"package"``, where the technique changes the maths, e.g. top-k).

    ``measure(summary, cfg, package)`` returns the :class:`Row` s shown beside the losses
    (``package``: the package's own run's summary, to compare with).  Returns the problem, or None
    (and keeps the :class:`Run` in :data:`RUNS`)."""
    from ...train import train
    from ...runtime.launch import RankError

    seam, n = seam or name, cfg.world_size
    where = f"inside strategy '{cfg.strategy}' on {n} ranks"
    cluster = ranks(n)
    package = train(cfg, cluster=cluster)  # first: it also warms the ranks up for a fair timing
    try:
        theirs = train(cfg, cluster=cluster, seams={seam: guards.plug(seam, fn)})
    except RankError as exc:
        return rank_trouble(exc, fn, where)
    except TimeoutError:
        return f"{where} it did not finish within 60 s (a rank waiting for a message?)"
    if reference == "single":
        single = cfg.with_(strategy="single", world_size=1, options={})
        if repr(single) not in _ONE_PROCESS:  # the same for every attempt at this check
            _ONE_PROCESS[repr(single)] = train(single, cluster=ranks(1)).losses
        want, ref_name = _ONE_PROCESS[repr(single)], "one process"
    else:
        want, ref_name = package.losses, "package's"
    for step, (a, b) in enumerate(zip(theirs.losses, want)):
        if not (math.isfinite(a) and abs(a - b) <= tolerance * abs(b)):
            return (f"alone it is right, but {where} the loss at step {step} is {a:.6f} where "
                    f"{ref_name} {'gives' if ref_name == 'one process' else 'code gives'} {b:.6f}")
    rows = measure(theirs.summary, cfg, package.summary) if measure else []
    RUNS[name] = Run(name, cfg.strategy, n, theirs.summary.options or {}, theirs.losses, want, ref_name, theirs.summary,
                     package.summary, rows)
    return None


class NoRun(str):
    """What :func:`report` shows before the exercise's check has passed (no error: the lesson goes on)."""

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def report(name: str):
    """The last passing check's run of exercise ``name`` inside its strategy (shown as text); before
    it has passed, a line saying so (never an error, so "Run All" goes on)."""
    if name not in RUNS:
        return NoRun(f"No run of your {name} inside the strategy yet: its check runs it once your "
                     "function passes (fix it and run the check cell above again).")
    return RUNS[name]


def sent_per_rank(summary, op: str | None = None) -> float:
    """Mean bytes one rank sent per step (the tracer's ``sent_bytes``), over all ops or one."""
    key = op or "total"
    per_rank = [c.get(key, {}).get("sent_bytes", 0.0) for c in summary.comm]
    return sum(per_rank) / len(per_rank) / summary.steps


# --------------------------------------------------------------------------------------------------
# Your minitrain: the functions that passed, kept (:mod:`.kept`) for lesson 08
# --------------------------------------------------------------------------------------------------


@dataclass
class YourMinitrain:
    """The seams of one strategy filled with the learner's kept functions where there is one."""
    strategy: str
    seams: dict
    theirs: list
    fallback: list
    unloadable: dict = field(default_factory=dict)
    unused: dict = field(default_factory=dict)  # kept, but this run's layout does not take it: why

    def __str__(self) -> str:
        total = len(self.theirs) + len(self.fallback) + len(self.unused)
        lines = [f"Strategy '{self.strategy}' takes {total} pieces you can write:"]
        lines += [f"  ✓ {name:<24s} yours (from {mine_dir() / (name + '.py')})" for name in self.theirs]
        lines += [f"  · {name:<24s} yours, not used by this layout: {why}"
                  for name, why in self.unused.items()]
        lines += [f"  · {name:<24s} the package's ("
                  + (f"yours did not load: {self.unloadable[name]}; run its check again"
                     if name in self.unloadable else "you have not passed its check yet") + ")"
                  for name in self.fallback]
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def your_minitrain(strategy: str, cfg=None) -> YourMinitrain:
    """Seams for ``strategy`` from your kept functions (each guarded by :func:`.guards.plug`); the
    ones you have not written fall back.
    With ``cfg`` (the run's config), a kept function the run's layout cannot take (say, the ring
    merge of context parallelism in a run without ``--cp``) is left out, saying why."""
    from ...strategies import ConfigError, get_strategy
    from ...train import check_config

    problems: dict = {}
    kept, honoured = mine(problems), get_strategy(strategy).seams
    unused = {}
    if cfg is not None:
        for s in [s for s in honoured if s in kept]:
            try:
                check_config(cfg, {s: kept[s]})
            except ConfigError as exc:
                unused[s] = str(exc)
    theirs = [s for s in honoured if s in kept and s not in unused]
    return YourMinitrain(strategy, {s: guards.plug(s, kept[s]) for s in theirs}, theirs,
                         [s for s in honoured if s not in kept],
                         {s: p for s, p in problems.items() if s in honoured}, unused)


# --------------------------------------------------------------------------------------------------
# Predict, then measure
# --------------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    """A learner's guess beside the formula and the measurement of a real run, and why they differ."""
    what: str
    prediction: float | None
    formula: str
    expected: float
    measured: float
    unit: str = "B"
    gap: str = ""

    def lines(self) -> list[str]:
        def ratio(x):
            return f" ({x / self.measured:.2f}× the measurement)" if self.measured else ""
        out = [f"{self.what}:"]
        if self.prediction is None:
            out.append("  your prediction   (none yet: write your prediction first, in the cell "
                       "above, then run both cells again)")
        else:
            out.append(f"  your prediction   {_fmt(self.prediction, self.unit):>14s}"
                       f"{ratio(self.prediction)}")
        out.append(f"  formula           {_fmt(self.expected, self.unit):>14s}   {self.formula}"
                   f"{ratio(self.expected)}")
        out.append(f"  measured          {_fmt(self.measured, self.unit):>14s}")
        if self.gap:
            out.append(f"  the gap: {self.gap}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731


def predicted(what: str, prediction, formula: str, expected: float, measured: float,
              unit: str = "B", gap: str = "") -> Prediction:
    """Show a prediction cell's guess beside the formula and the measurement (``unit``: ``"B"``
    bytes, ``"%"`` a fraction, ``"s"`` seconds, anything else is appended to the number).  A blank
    prediction (None, or the cell's ``...`` left in place) is shown as "write your prediction first"."""
    if prediction is Ellipsis:
        prediction = None
    if prediction is not None and (isinstance(prediction, bool)
                                   or not isinstance(prediction, numbers.Real)):
        raise TypeError(f"write your prediction as a number (got {type(prediction).__name__} "
                        f"{prediction!r})")
    return Prediction(what, None if prediction is None else float(prediction), formula,
                      float(expected), float(measured), unit, gap)
