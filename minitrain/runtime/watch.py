"""The watcher: how the launcher tells a rank that waits from a rank that works (lessons 01, 01b).

Each rank runs :func:`heartbeat` in a thread: once a task has run :data:`REPORT_AFTER_S`, it sends
the main thread's stack (as :class:`~minitrain.runtime.diagnostics.Frame` s) every :data:`HEARTBEAT_S` when
it has moved.  In the parent a :class:`Watch` keeps each rank's last stack, since when it has not
moved and how much CPU the rank used since then (from ``/proc``): a rank whose stack stood still for
:data:`STUCK_S` while it used under :data:`IDLE_CPU` of a core is waiting.  When some ranks have
returned and every other one waits, that is a deadlock, found in seconds instead of at the
collective timeout.  :meth:`Watch.states` gives every rank's :class:`~minitrain.runtime.diagnostics.RankState`
for the error the launcher raises.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import traceback

from .diagnostics import (CollectiveTimeout, RankError, RankState, backend_op, frames_of,
                          is_timeout, op_of)

__all__ = ["descendants", "HEARTBEAT_S", "REPORT_AFTER_S", "STUCK_S", "IDLE_CPU", "ALL_WAITING_S", "heartbeat",
           "Watch", "native_end", "native_tail", "abort_reason", "rss_of", "raised", "died"]

#: a rank reports where its main thread is every HEARTBEAT_S while a task has run REPORT_AFTER_S
HEARTBEAT_S, REPORT_AFTER_S = 0.5, 1.0
#: a rank whose stack has not moved for STUCK_S while using under IDLE_CPU of a core is waiting
STUCK_S, IDLE_CPU = 2.0, 0.05
#: when every rank waits (recv against recv), their lines are shown after this long
ALL_WAITING_S = 6.0

_ENTRY = "worker_main"  # the launcher's loop in a rank: the frames below it are the task's


def heartbeat(send, task: dict) -> None:
    """In each rank: while a task runs, tell the parent where the main thread is (when it moves)."""
    main = threading.main_thread().ident
    last = None
    while True:
        time.sleep(HEARTBEAT_S)
        started, number = task.get("since"), task.get("number")
        if started is None or time.monotonic() - started < REPORT_AFTER_S:
            last = None
            continue
        frame = sys._current_frames().get(main)
        if frame is None:
            continue
        stack = traceback.extract_stack(frame)
        entry = [i for i, fs in enumerate(stack) if fs.name == _ENTRY]
        frames = frames_of(stack[entry[-1] + 1:] if entry else stack)
        if (number, frames) != last:
            last = (number, frames)
            send(("status", number, frames))


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc (Linux; empty elsewhere).  Used to check that no
    rank outlives its kernel, and to measure a lesson's memory (a kernel's ranks are its children)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def rss_of(pid: int) -> int | None:
    """A process's resident memory in bytes (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Watch:
    """The parent's view of a run: where each rank's main thread is (from its heartbeat), since
    when it has not moved, how much CPU it used since then, and its memory."""

    def __init__(self, world_size: int, pids: list[int]):
        self.pids = pids
        self.frames: dict[int, tuple] = {}  # rank -> its main thread's stack, innermost last
        self.since: dict[int, tuple] = {}   # rank -> (time, cpu ticks) when its stack last moved
        self.rss: dict[int, int] = {}
        self.announced = False
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.sample()

    def status(self, rank: int, frames: tuple) -> None:
        self.frames[rank] = frames
        self.since[rank] = (time.monotonic(), _cpu_ticks(self.pids[rank]))

    def sample(self) -> None:
        for rank, pid in enumerate(self.pids):
            rss = rss_of(pid)
            if rss:
                self.rss[rank] = rss

    def stuck_for(self, rank: int) -> float:
        """Seconds rank has not moved while (nearly) idle; 0 when it is computing or unknown."""
        if rank not in self.since:
            return 0.0
        t0, ticks0 = self.since[rank]
        elapsed = time.monotonic() - t0
        ticks = _cpu_ticks(self.pids[rank])
        if ticks is not None and ticks0 is not None and elapsed > 0:
            if (ticks - ticks0) / self._tick > IDLE_CPU * elapsed + 0.05:
                return 0.0  # it is computing (or moving data): not stuck
        return elapsed

    def stuck(self, ranks, seconds: float = STUCK_S) -> list[int]:
        """Those of ``ranks`` that wait in a ``torch.distributed`` call and have not moved for
        ``seconds``."""
        return [r for r in ranks if op_of(self.frames.get(r, ())) and self.stuck_for(r) >= seconds]

    def states(self, replies: list, errors=()) -> dict[int, RankState]:
        """Every rank's state: from its final reply (``ok``, ``error``, ``dead``), else from its
        last heartbeat (``waiting`` in a call, or ``running``).  A rank whose error is a timeout
        (in ``errors``), or whose peer vanished while it waited in a call, is shown ``waiting``
        where its traceback says it waited."""
        waited = {e.rank: e for e in errors
                  if e.timeout_s is not None or (getattr(e, "priority", 0) == 2 and op_of(e.frames))}
        out = {}
        for rank, reply in enumerate(replies):
            if rank in waited:
                err = waited[rank]
                out[rank] = RankState(rank, "waiting", err.op or op_of(err.frames), err.frames)
            elif reply is not None:
                state = {"ok": "returned", "dead": "dead"}.get(reply[0], "failed")
                out[rank] = RankState(rank, state)
            else:
                frames = self.frames.get(rank, ())
                op = op_of(frames)
                out[rank] = RankState(rank, "waiting" if op else "running", op, frames)
        return out


def native_end(path: str) -> str:
    """The end (64 KiB) of what a rank wrote to its native stderr, ``""`` when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def native_tail(path: str, lines: int = 40) -> str:
    """The last lines a dead rank wrote to its native stderr (the list of loaded extension modules
    a crash report ends with left out, and the launcher's own frames below the learner's)."""
    text = native_end(path)
    kept, in_stack = [], False
    for line in text.splitlines():
        if line.startswith("Extension modules:"):
            continue
        if line.startswith(("Stack (most recent call first)", "Current thread")):
            in_stack = True
        elif in_stack and f"in {_ENTRY}" in line:
            in_stack = None  # the launcher's frames below the learner's: left out
        elif not line.strip():
            in_stack = False if in_stack is None else in_stack
        if in_stack is not None:
            kept.append(line)
    return "\n".join(kept[-lines:]).strip()


def abort_reason(native: str) -> str:
    """The C++ runtime's reason for an abort (``what():  [file:line] reason``), or ``""``."""
    m = re.search(r"what\(\):\s+(?:\[[^\]]*\]\s*)?(.+)", native)
    return m.group(1).strip() if m else ""


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


#: the prefix torch's C++ log puts before a line: "[rank1]:[E1206 18:44:12.715298746
#: ProcessGroupNCCL.cpp:616] "
_LOG_PREFIX = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} [^\]]*\]\s*")


def _timeout_hint(timeout_s: float) -> str:
    return (f"(a collective did not complete within the group's timeout of {timeout_s:g} s: "
            "probably another rank never called it, or called a different one; raise "
            "Cluster(timeout=...) if the work is just slow)")


def raised(rank: int, name: str, text: str, tb: str, frames: tuple = (),
           timeout_s: float | None = None) -> RankError:
    """The error for a rank that raised ``name: text`` (``timeout_s``: the group's timeout, when
    the exception was a collective's timeout)."""
    if timeout_s is not None:
        err = CollectiveTimeout(rank, text, tb, name, frames=frames, op=backend_op(text),
                                hint=_timeout_hint(timeout_s))
        err.timeout_s = timeout_s
    else:
        err = RankError(rank, text, tb, name, frames=frames)
    # a rank whose peer vanished is a symptom, not the cause; a timeout comes before it
    err.priority = 2 if any(k in text for k in _PEER_LOST) else 1 if timeout_s is not None else 0
    err.secondary = err.priority > 0
    return err


def died(rank: int, exitcode: int | None, pid: int, native: str, rss: int | None,
         timeout_s: float | None = None, frames: tuple = (), stderr: str = "") -> RankError:
    """The error for a rank whose process ended (``exitcode`` negative: the signal), with what it
    likely means and the end of its native stderr (``native``: the lines shown; ``stderr``: the
    text read for a timeout, ``native`` when not given).

    A rank that NCCL's watchdog ended because a collective timed out (its stderr says so:
    :func:`~minitrain.runtime.diagnostics.is_timeout`) comes back as a :class:`CollectiveTimeout`,
    as gloo's timeout does, given the group's ``timeout_s``; ``frames``, where the rank's last
    heartbeat saw it, say where it waited."""
    signum = -exitcode if exitcode is not None and exitcode < 0 else None
    how = f"was killed by signal {signum}" if signum else f"exited with code {exitcode}"
    said = next((_LOG_PREFIX.sub("", line.strip()) for line in (stderr or native).splitlines()
                 if is_timeout(line)), "")
    if timeout_s is not None and said:
        err = CollectiveTimeout(
            rank, f"the process {how} (pid {pid}) after a collective timed out: {said}",
            frames=frames, op=backend_op(said),
            hint=_timeout_hint(timeout_s)
            + f"\n--- what rank {rank} printed last (native stderr) ---\n{native}")
        err.timeout_s = timeout_s
        err.signal, err.native, err.abort_reason = signum, native, abort_reason(native)
        err.priority, err.secondary = 1, True
        return err
    hint = ""
    if signum == signal.SIGABRT:
        hint = ("Signal 6 (abort) in a rank is most often a collective mismatch: the ranks called "
                "different collectives, or the same one with different shapes or dtypes.")
    elif signum == signal.SIGKILL:
        hint = ("Signal 9 usually means the kernel's out-of-memory killer stopped it"
                + (f" (its last resident memory: {rss / 2**20:,.0f} MiB)" if rss else "")
                + ": use a smaller model or batch, or fewer ranks.")
    if native:
        hint += f"\n--- what rank {rank} printed last (native stderr) ---\n{native}"
    err = RankError(rank, f"the process {how} (pid {pid})", hint=hint.strip())
    err.signal, err.native, err.abort_reason = signum, native, abort_reason(native)
    return err
