"""The checkers' common ground: the registry of exercises, the verdict line, running a learner's
function on running ranks, and what a learner reads when their code is blank or raises."""

from __future__ import annotations

import inspect
import traceback

from .kept import keep, parts
from .trouble import rank_trouble

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PLACEHOLDER = "...  # YOUR CODE HERE"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"

#: exercise name -> (checker, what a correct answer satisfies); filled by :func:`exercise`
CHECKS: dict = {}


def exercise(name: str, passes: str):
    """Register the decorated checker for exercise ``name``: ``checker(fn)`` returns None when
    ``fn`` is right, else a sentence saying what is wrong; ``passes`` ends the pass verdict."""
    def register(checker):
        CHECKS[name] = (checker, passes)
        return checker
    return register


def blank(fn) -> bool:
    """True while (one of) the learner's function(s) still holds the ``...  # YOUR CODE HERE`` line
    (for a class, an autograd Function: while one of its methods does)."""
    return any(_blank(f) for f in parts(fn))


def _blank(fn) -> bool:
    pieces = [fn]
    if inspect.isclass(fn):  # a class from a notebook cell has no source file; its methods have
        pieces = [getattr(m, "__func__", m) for m in vars(fn).values()]
    for piece in pieces:
        try:
            if "# YOUR CODE HERE" in inspect.getsource(piece):
                return True
        except (OSError, TypeError):
            continue
    return False


def raised(call: str, exc: BaseException, fn) -> str:
    """``call`` raised: the error, and the line of the learner's own code where it happened."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    several = len(parts(fn)) > 1  # functions of one cell share a file: tell them by name
    for f in parts(fn):
        code = getattr(f, "__code__", None)
        if code is None:
            continue
        mine = [t for t in frames if t.filename == code.co_filename
                and (not several or t.name == code.co_name)]
        if mine:
            last = mine[-1]
            where = (f" (line {last.lineno - code.co_firstlineno + 1} of your {f.__name__}: "
                     f"{(last.line or '').strip()})")
    return f"{call} raised {type(exc).__name__}: {exc}{where}"


_RANKS: dict = {}  # (world size, collective timeout) -> a running Cluster, kept between checks


def ranks(n: int, timeout: float = 5):
    """A running cluster of ``n`` ranks for the checkers, started once and reused by every check
    (starting ranks is most of a check's time).  A check that fails or times out leaves it to be
    restarted by its next run; :func:`release` stops them all."""
    from ...runtime.launch import Cluster

    key = (n, timeout)
    if key not in _RANKS:
        _RANKS[key] = Cluster(n, backend="gloo", timeout=timeout, threads=1, forward_output=False)
    return _RANKS[key]


def discard(n: int, timeout: float = 5) -> None:
    """Stop the running cluster of ``n`` ranks (if any), so the next check starts it afresh: one a
    check may have left mid-message, or with a process group the check did not make."""
    stale = _RANKS.pop((n, timeout), None)
    if stale is not None:
        stale.close()


def release() -> None:
    """Stop the checkers' ranks (they are also stopped when the kernel exits)."""
    while _RANKS:
        _RANKS.popitem()[1].close()


def on_clusters(rank_fn, fn, sizes=(2, 3, 4), *args, trouble=rank_trouble) -> str | None:
    """Run ``rank_fn(fn, *args)`` on running clusters of each size; the first problem found, or None.
    ``trouble(exc, fn, where)`` words a rank's failure from the error's fields; by default
    :func:`.trouble.rank_trouble`: every rank's state and the learner's line."""
    from ...runtime.launch import RankError

    for n in sizes:
        try:
            problems = [p for p in ranks(n).run(rank_fn, fn, *args, timeout=60) if p]
        except RankError as exc:
            return trouble(exc, fn, f"with {n} ranks")
        except TimeoutError:
            return f"with {n} ranks it did not finish within 60 s (a rank waiting for a message?)"
        if problems:  # a rank may have left the group mid-message: the next check starts afresh
            discard(n)
            return f"with {n} ranks, {problems[0]}"
    return None


def verdict(name: str) -> str:
    """The fixed line a correct solution prints.  Never stored in a notebook (it would tell the
    learner the answer before they run anything): under nbval, :mod:`minitrain_nbval` makes it the
    check cell's expected output."""
    return f"✓ {name}: correct — {CHECKS[name][1]}"


def pending(name: str) -> str:
    """The line a check cell shows before it is run (what ``lessons/`` stores): no verdict, no part
    of the answer."""
    return f"{name}: not checked yet (run this cell to check your answer)"


def check(name: str, fn) -> None:
    """Check the learner's ``fn`` for exercise ``name`` and print one line: the verdict.

    A passing ``fn`` is kept in your minitrain (:func:`~minitrain.course.exercises.kept.keep`).
    Returns nothing, so the check cell's only output is that line (nbval compares it).
    Use :func:`problem` to get the reason as a value."""
    found = problem(name, fn)
    if found is None:
        keep(name, fn)  # your minitrain: lesson 08 trains with the functions you passed
    print(verdict(name) if found is None else f"✗ {name}: {found}")


def problem(name: str, fn) -> str | None:
    """What is wrong with ``fn`` for exercise ``name``, or None when it is correct."""
    if name not in CHECKS:
        raise KeyError(f"no exercise called {name!r}; known: {', '.join(CHECKS)}")
    if blank(fn):
        first = next(f for f in parts(fn) if _blank(f))
        return (f"not written yet: {getattr(first, '__name__', 'your function')} still has the "
                f"`{PLACEHOLDER}` line; replace it with your code")
    return CHECKS[name][0](fn)
