"""What went wrong on which rank, as data (lessons 01 and 01b).

A failed run raises a :class:`RankError` (or a :class:`Deadlock`, a :class:`CollectiveTimeout`).  It
carries the facts, not prose: the failing rank's exception type, message and traceback frames, and
``where``, every rank's :class:`RankState` when the run failed (returned, failed, waiting in which
``torch.distributed`` call, at which :class:`Frame` of whose code).  :func:`format_error` is the one
place that turns those facts into text for people (``str(err)``); the lab's and the exercises'
checkers read the fields.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from dataclasses import dataclass

__all__ = ["Frame", "RankState", "frames_of", "op_of", "user_frame", "TIMEOUT_PATTERNS",
           "is_timeout", "backend_op", "LaunchError", "RankError", "CollectiveTimeout", "Deadlock",
           "format_error", "format_states"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # minitrain/
_TORCH = os.sep + "torch" + os.sep


@dataclass(frozen=True)
class Frame:
    """One line of a stack: the file, the line number, the function, the code of that line."""

    file: str
    line: int
    name: str
    code: str = ""

    @property
    def in_cell(self) -> bool:
        """A notebook cell (ipykernel names a cell's code after a file that does not exist)."""
        return "ipykernel" in self.file or self.file.startswith("<ipython-input")

    @property
    def in_torch(self) -> bool:
        return _TORCH in self.file.replace("/", os.sep)

    @property
    def in_package(self) -> bool:
        return os.path.abspath(self.file).startswith(_PACKAGE)

    def label(self) -> str:
        """``cell line 3`` for a notebook cell, ``file.py:12`` otherwise."""
        return f"cell line {self.line}" if self.in_cell else f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.label()}: {self.code}" if self.code else self.label()


def frames_of(summary) -> tuple[Frame, ...]:
    """Frames from a :class:`traceback.StackSummary` (or ``extract_tb``/``extract_stack``), innermost
    last; a line this process cannot read is filled in from its ``linecache`` when it can be."""
    out = []
    for fs in summary:
        code = (fs.line or "").strip() or linecache.getline(fs.filename, fs.lineno or 0).strip()
        out.append(Frame(fs.filename, fs.lineno or 0, fs.name, code))
    return tuple(out)


def op_of(frames) -> str:
    """The ``torch.distributed`` call a stack is in (``all_reduce``, ``recv``...), ``wait`` for an
    asynchronous op's ``wait()`` (which has no Python frame of its own), or ``""``."""
    for fr in reversed(frames):
        path = fr.file.replace(os.sep, "/")
        if "torch/distributed/" in path and not fr.name.startswith(("_", "wrapper")):
            return fr.name
    for fr in reversed(frames):
        if not fr.in_torch:
            return "wait" if ".wait(" in fr.code else ""
    return ""


def user_frame(frames) -> Frame | None:
    """Whose line a stack is at: the innermost frame outside torch and this package (the learner's,
    the test's), else the innermost outside torch, else None."""
    outside = [fr for fr in frames if not fr.in_torch]
    theirs = [fr for fr in outside if not fr.in_package]
    return (theirs or outside or [None])[-1]


@dataclass(frozen=True)
class RankState:
    """Where one rank was when a run failed.  ``state``: ``returned``, ``failed``, ``waiting`` (its
    stack did not move and it used no CPU), ``running`` (no report yet, or busy) or ``dead``."""

    rank: int
    state: str
    op: str = ""
    frames: tuple = ()

    @property
    def frame(self) -> Frame | None:
        """The rank's own line (see :func:`user_frame`)."""
        return user_frame(self.frames)

    def line(self, was: bool = False) -> str:
        """``rank 0 waiting in all_reduce at cell line 3: dist.all_reduce(t)``."""
        was = "was " if was else ""
        if self.state == "waiting":
            state = f"waiting in {self.op}" if self.op else "waiting"
            return f"rank {self.rank} {was}{state} at {self.frame or '?'}"
        if self.state == "running":
            if not self.frames:
                return f"rank {self.rank} still running (no report yet)"
            return f"rank {self.rank} {was}running at {self.frame or '?'}"
        return f"rank {self.rank} {self.state}"

    def stack(self) -> str:
        return "".join(traceback.format_list([(f.file, f.line, f.name, f.code) for f in self.frames]))


#: What a backend says when a collective or point-to-point op did not complete within the process
#: group's timeout: regular expressions, case ignored.  :func:`is_timeout` matches them against a
#: rank's exception message and against the native stderr of a rank that died.
TIMEOUT_PATTERNS = (
    # gloo: "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms for recv
    # operation to complete", and any other "timed out" (a store's, a work waited on with a
    # timeout).  Not NCCL's "Some NCCL operations have failed or timed out. ...": NCCL logs that
    # line for any failed work, a CUDA error as well as a timeout.
    r"(?<!failed or )timed out",
    # NCCL's watchdog, in the rank's log and in the c10::DistBackendError it raises (in wait(), or
    # from the watchdog thread, which ends the process: "terminate called after throwing an
    # instance of 'c10::DistBackendError' what(): [PG ID 0 PG GUID 0(default_pg) Rank 0] Process
    # group watchdog thread terminated with exception: [Rank 0] Watchdog caught collective
    # operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1,
    # Timeout(ms)=1000) ran for 1004 milliseconds before timing out.").  Not "NCCL communicator
    # was aborted on rank 0.": that follows any abort, after a timeout or another error.
    r"Watchdog caught collective operation timeout",
    # NCCL's watchdog, the line it logs after the one above: "[PG ID 0 PG GUID 0(default_pg)
    # Rank 0] Timeout at NCCL work: 1, last enqueued NCCL work: 1, last completed NCCL work: 0."
    r"Timeout at NCCL work",
)
# Not a bare "timeout": every WorkNCCL in a message (an error's too) reads "Timeout(ms)=...".
_TIMEOUT = re.compile("|".join(f"(?:{p})" for p in TIMEOUT_PATTERNS), re.IGNORECASE)

#: NCCL's name of an op (a WorkNCCL's ``OpType=``) -> the ``torch.distributed`` call
_NCCL_OPS = {"ALLREDUCE": "all_reduce", "ALLREDUCE_COALESCED": "all_reduce_coalesced",
             "BROADCAST": "broadcast", "REDUCE": "reduce", "ALLGATHER": "all_gather",
             "_ALLGATHER_BASE": "all_gather_into_tensor", "GATHER": "gather",
             "SCATTER": "scatter", "REDUCE_SCATTER": "reduce_scatter",
             "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor", "ALLTOALL": "all_to_all",
             "ALLTOALL_BASE": "all_to_all_single", "SEND": "send", "RECV": "recv",
             "BARRIER": "barrier"}


def is_timeout(text: str) -> bool:
    """Whether ``text`` (an exception's message, a dead rank's stderr) says that a collective or
    point-to-point op timed out, under gloo or NCCL: one of :data:`TIMEOUT_PATTERNS` matches."""
    return bool(_TIMEOUT.search(text or ""))


def backend_op(text: str) -> str:
    """The op a backend's timeout names: gloo's transport op (``recv`` in "Timed out waiting
    1000ms for recv operation"), NCCL's as a ``torch.distributed`` call (``all_reduce`` for
    ``OpType=ALLREDUCE``); ``""`` when it names none."""
    m = re.search(r"waiting \d+ms for (\w+) operation", text or "")
    if m:
        return m.group(1)
    m = re.search(r"OpType=(\w+)", text or "")
    return _NCCL_OPS.get(m.group(1), m.group(1).lower()) if m else ""


class LaunchError(RuntimeError):
    """The ranks could not be started or were lost."""


class RankError(RuntimeError):
    """A rank raised (or died).

    Fields: ``rank``; ``exc_type`` (the exception's type name in the rank, ``""`` for a death);
    ``message`` (its message, or how the process ended); ``frames`` (its traceback, innermost last);
    ``op`` (the ``torch.distributed`` call it failed in, if any); ``hint`` (what it likely means);
    ``remote_traceback`` (the rank's traceback as text); ``where`` (rank -> :class:`RankState`, every
    rank's state when the run failed); ``others`` (the other failing ranks' errors); for a death
    ``signal`` and ``native`` (the end of its native stderr) and ``abort_reason`` (the C++ runtime's
    reason for a SIGABRT); for a :class:`CollectiveTimeout`, ``timeout_s``; ``exc_args``, the
    exception's arguments when they were plain values (a checker's exception can carry facts)."""

    headline = ""  # a subclass's first words

    def __init__(self, rank: int, message: str, remote_traceback: str = "", exc_type: str = "", *,
                 frames: tuple = (), op: str = "", hint: str = ""):
        super().__init__(rank, message)
        self.rank, self.message, self.exc_type = rank, message, exc_type
        self.remote_traceback, self.frames, self.hint = remote_traceback, tuple(frames), hint
        self.op = op or op_of(self.frames)
        self.where: dict[int, RankState] = {}
        self.others: list[RankError] = []
        self.signal: int | None = None
        self.native = ""
        self.abort_reason = ""
        self.timeout_s: float | None = None
        self.exc_args: tuple = ()  # the exception's own arguments, when they were plain values
        self.secondary = False  # True when it only reports that another rank went away
        self.priority = 0  # which failure is reported first: 0 cause, 1 timeout, 2 peer gone

    @property
    def frame(self) -> Frame | None:
        """The line of the rank's own code the exception came from."""
        return user_frame(self.frames)

    def waiting(self) -> list[RankState]:
        """The ranks that were still at work (waiting, or running) when the run failed, by rank."""
        return [s for _, s in sorted(self.where.items()) if s.state in ("waiting", "running")]

    def __str__(self) -> str:
        return format_error(self)

    def __reduce__(self):
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls, state):
    err = cls.__new__(cls)
    RuntimeError.__init__(err, state.get("rank"), state.get("message"))
    err.__dict__.update(state)
    return err


class CollectiveTimeout(RankError):
    """A collective or point-to-point op did not complete within the process group's timeout."""


class Deadlock(RankError):
    """Some ranks returned while the others wait in a collective that can never complete (a
    learner's skipped collective, a wrong peer, mismatched calls): found within seconds."""


def format_states(states, stacks: bool = False, was: bool = False, shown=()) -> str:
    """A line per rank, then (with ``stacks``) the stack of each rank that has one, but those in
    ``shown`` (whose traceback is printed already)."""
    states = list(states)
    lines = ["  " + s.line(was) for s in states]
    if stacks:
        lines += [f"--- stack of rank {s.rank} ---\n{s.stack().rstrip()}"
                  for s in states if s.frames and s.rank not in shown]
    return "\n".join(lines)


def format_error(err: RankError, details: bool = True) -> str:
    """The whole story of a failed run, for people: the first failure, its traceback, the other
    ranks that failed, and where the waiting ranks were.  ``details=False`` leaves out the
    tracebacks and stacks (what to read first)."""
    if isinstance(err, Deadlock):
        return (f"rank {err.rank} failed: the ranks wait for each other and never will:\n"
                + format_states(sorted(err.where.values(), key=lambda s: s.rank), stacks=details)
                + "\nEvery rank must make the same collective calls in the same order (a send "
                "needs its recv on the peer; a rank that returns early leaves the others waiting).")
    head = f"{err.exc_type}: {err.message}" if err.exc_type else err.message
    text = f"rank {err.rank} failed: {head}"
    if err.hint:
        text += f"\n{err.hint}"
    if err.remote_traceback and details:
        text += f"\n\n--- traceback from rank {err.rank} ---\n{err.remote_traceback.rstrip()}"
    for other in err.others:
        first = f"{other.exc_type}: {other.message}" if other.exc_type else other.message
        text += f"\n\nrank {other.rank} also failed: {first.splitlines()[0] if first else ''}"
    waiting = err.waiting()
    if waiting:
        text += "\n\nwhere the ranks were:\n" + format_states(
            waiting, stacks=details, was=True, shown={err.rank} if err.remote_traceback else ())
    return text
