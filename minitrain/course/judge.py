"""The judge of ``minitrain grade``: the process whose verdicts fill the gradebook
(:class:`minitrain.course.grade._Judge` starts it in a sandbox of its own, as its pid 1).

It imports the checkers (from the read-only package) before any student's code exists and makes
itself unreachable: not dumpable, so no process of its sandbox may trace it or read its memory, and,
as pid 1, deaf to their signals.  Then, for each notebook, it forks a fresh process which reads that
notebook's functions from stdin (one JSON line: ``[[exercise, {"data": base64 of the pickled
function} or {"problem": why there is none}], ...]``), judges each, writes the verdicts to the
verdicts pipe and exits with ``PASSED`` plus a bit per exercise passed.  The judge itself never
holds a student's code or verdict.  When that process ends, every other process of the sandbox is
killed and its /tmp and /dev/shm are emptied; only then does the judge say "done", with the passes
read from that exit status, on the control pipe, which no judged process ever had: nothing of one
notebook meets the next, and what a judged function leaves behind cannot make a pass.

Run by path, ``python -I .../judge.py CONTROL_FD VERDICTS_FD sealed|unsealed``: it starts with the
standard library only, so that checkers which do not load are reported on the control pipe.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import select
import shutil
import signal
import sys
import time

PR_SET_DUMPABLE = 4  # prctl(2): 0, no other process of the same user may trace or read this one

#: a judged process exits PASSED plus a bit per exercise passed (bit i: the i-th), below 128 (what
#: a shell reports for a signal): JUDGED_AT_ONCE exercises at most
PASSED = 64
JUDGED_AT_ONCE = 6
NO_MORE = 3  # a judged process's exit status when stdin ended: there are no more notebooks
VERDICT_CAP = 4000  # characters of one verdict


def emit(fd: int, item) -> None:
    """Write ``item`` to ``fd`` as one JSON line (all of it, however many writes that takes)."""
    data = (json.dumps(item) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def read_line(fd: int) -> bytes | None:
    """One line from ``fd``, its newline included, or None when ``fd`` ends before one does."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        line += chunk
    return line


def verdict(name: str, item: dict, problem, loads) -> str:
    """``"pass"`` or ``"fail: why"`` for exercise ``name``: ``item`` holds the function taken out
    of the notebook or why none was (see the module's docstring); ``problem(name, fn)`` is the
    checkers' (None: correct), ``loads`` unpickles the function."""
    if "data" not in item:
        return "fail: " + item["problem"]
    try:
        fn = loads(base64.b64decode(item["data"]))
    except BaseException as exc:
        return f"fail: your function could not be loaded to be judged: {type(exc).__name__}: {exc}"
    try:
        found = problem(name, fn)
    except BaseException as exc:
        found = f"the checker raised {type(exc).__name__}: {exc}"
    return "pass" if found is None else f"fail: {found}"


def judge_all(todo: list, problem, loads, verdicts: int) -> int:
    """Judge each ``(exercise, item)`` of ``todo`` (:func:`verdict`), writing each verdict to the
    file descriptor ``verdicts``; the bits of those that passed (bit i: ``todo[i]``)."""
    passed = 0
    for i, (name, item) in enumerate(todo):
        said = verdict(name, item, problem, loads)
        if said == "pass" and i < JUDGED_AT_ONCE:
            passed |= 1 << i
        emit(verdicts, {"name": name, "verdict": str(said)[:VERDICT_CAP]})
    return passed


def set_dumpable(libc, dumpable: bool) -> None:
    """Whether processes of the same user may trace this one and read its memory."""
    libc.prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)


def empty(folder: str) -> None:
    """Remove everything in ``folder`` (a symbolic link is removed, never followed)."""
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _others() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def _kill_the_rest() -> None:
    """SIGKILL every other process this one may signal, and reap them, until none is left: only
    ever as the pid 1 of a pid namespace of its own, whose processes are all it can see."""
    while _others():
        os.kill(-1, signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.005)


def _judge_notebook(problem, loads, release, verdicts: int) -> int:
    """In a judged process: one notebook's functions from stdin, judged; the bits of the passes
    (exits NO_MORE when stdin ends instead)."""
    line = read_line(0)
    if line is None:
        os._exit(NO_MORE)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # nothing more to read
    todo = json.loads(line)
    del line
    passed = judge_all(todo, problem, loads, verdicts)
    try:
        release()
    except BaseException:
        pass
    return passed


def main(argv: list[str]) -> None:
    control, verdicts, sealed = int(argv[1]), int(argv[2]), argv[3] == "sealed"
    try:  # run by path, this file is no module of the package: its imports are absolute
        from minitrain.course.exercises import problem, release
        from minitrain.runtime.shipping import loads
    except BaseException as exc:
        emit(control, {"failed": f"the checkers did not load: {type(exc).__name__}: {exc}"[:2000]})
        sys.exit(1)
    libc = ctypes.CDLL(None, use_errno=True)
    alone = sealed and os.getpid() == 1  # pid 1 of a namespace of its own
    if alone:
        set_dumpable(libc, False)
    emit(control, {"ready": True})
    while True:
        select.select([0], [], [])
        pid = os.fork()
        if pid == 0:
            try:
                os.close(control)
                if alone:
                    set_dumpable(libc, True)  # the judged process is an ordinary one
                os._exit(PASSED + _judge_notebook(problem, loads, release, verdicts))
            finally:
                os._exit(0)
        status = os.waitpid(pid, 0)[1]
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        if code == NO_MORE:
            break
        if alone:  # nothing of this notebook is left for the next
            _kill_the_rest()
            for folder in ("/tmp", "/dev/shm"):
                empty(folder)
        emit(control, {"done": True,
                       "killed": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                       "passed": code - PASSED if code is not None and code >= PASSED else None})
        if not alone:
            break  # unsealed: a fresh judge for each notebook
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
