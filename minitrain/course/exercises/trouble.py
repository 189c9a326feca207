"""What a rank's failure means, in the learner's terms: from the structured fields of a
:class:`~minitrain.runtime.launch.RankError`, :class:`~minitrain.runtime.launch.Deadlock` or
:class:`~minitrain.runtime.launch.CollectiveTimeout` (each rank's state, operation and frames), the sentence a
check prints — which rank waited for what, and the learner's own line.  Shared by every checker
(:func:`.core.on_clusters` words a failure with :func:`rank_trouble`), the inside runs and the lab."""

from __future__ import annotations

from .kept import parts

__all__ = ["learner_line", "where_line", "state_line", "rank_trouble", "rank_error"]


def learner_line(frames, fn) -> str:
    """`` (line L of your fn: code)`` for the innermost of ``frames`` (a rank's stack or traceback,
    :class:`~minitrain.runtime.diagnostics.Frame` s) in the learner's code (``fn`` may be a tuple of the
    learner's functions)."""
    codes = _codes(fn)
    files = {code.co_filename for code in codes}
    mine = [fr for fr in frames if fr.file in files]
    if not mine:
        return ""
    fr = mine[-1]
    first = _first_line(fn, fr.name)
    where = f"line {fr.line - first + 1} of your {fr.name}" if first else f"your {fr.name}"
    return f" ({where}{': ' + fr.code if fr.code else ''})"


def _codes(fn) -> list:
    """The code objects of the learner's function(s) (and of an object's forward / backward)."""
    objs = [o for f in parts(fn) for o in (f, getattr(f, "forward", None), getattr(f, "backward", None))]
    return [o.__code__ for o in objs if getattr(o, "__code__", None) is not None]


def _first_line(fn, func: str) -> int | None:
    for code in _codes(fn):
        if code.co_name == func:
            return code.co_firstlineno
    return None


def _op_words(op: str) -> str:
    """A waiting rank's operation in words: ``wait`` (an asynchronous handle's ``wait()``, which has
    no frame of its own) says so."""
    if op == "wait":
        return "a handle's wait() (the collective or message it waits for never completed)"
    return op or "a call"


def where_line(frames, fn) -> str:
    """Where a rank was, always naming a line: the learner's (`` (line L of your fn: code)``), else
    the innermost frame outside torch, said to be outside the learner's code."""
    from ...runtime.diagnostics import user_frame

    mine = learner_line(frames, fn) if fn is not None else ""
    if mine:
        return mine
    fr = user_frame(frames)
    return f" (at {fr}, after your code had returned)" if fr is not None else ""


def state_line(state, fn, was: bool = False) -> str:
    """A rank's :class:`~minitrain.runtime.diagnostics.RankState` in the learner's terms: ``rank 0 waited
    in all_reduce (line 3 of your mean_loss: dist.all_reduce(loss))``, ``rank 1 returned``."""
    from ...runtime.diagnostics import op_of

    if state.state == "waiting":
        op = op_of(state.frames) or state.op  # the call in its stack before the backend's word
        return (f"rank {state.rank} {'waited' if was else 'waits'} in {_op_words(op)}"
                f"{where_line(state.frames, fn)}")
    return state.line(was)


def rank_trouble(exc: BaseException, fn, where: str) -> str:
    """One or two sentences from a rank's failure: what waited for what, or the error and the line."""
    from ...runtime.launch import CollectiveTimeout, Deadlock

    if isinstance(exc, Deadlock):
        waits = [state_line(state, fn) for _, state in sorted(exc.where.items())]
        return (f"{where}: the ranks wait for each other and never will — " + "; ".join(waits) +
                ". Every rank must make the same collective calls in the same order, and a send "
                "needs the matching recv on its peer")
    if isinstance(exc, CollectiveTimeout):
        states = "; ".join(state_line(state, fn, was=True) for _, state in
                           sorted(getattr(exc, "where", {}).items()))
        if not states:
            from ...runtime.diagnostics import op_of

            op = op_of(exc.frames) or exc.op
            states = f"rank {exc.rank} waited in {_op_words(op)}{where_line(exc.frames, fn)}"
        return (f"{where}: nothing moved for {exc.timeout_s:g} s (the collective timeout): "
                f"{states} — every rank must call each collective, in the same order, and a "
                "send needs the matching recv on its peer")
    return f"{where}: {rank_error(exc, fn)}"


def rank_error(exc: BaseException, fn) -> str:
    """A rank's exception as one line: its type and message, and the learner's line it came from."""
    message = getattr(exc, "message", None)
    if message is None:
        message = str(exc)
    kind = getattr(exc, "exc_type", "") or ("" if hasattr(exc, "message") else type(exc).__name__)
    message = message.splitlines()[0] if message else ""
    if kind and not message.startswith(kind):
        message = f"{kind}: {message}"
    return f"{message}{learner_line(getattr(exc, 'frames', ()), fn)}"
