"""``minitrain grade FOLDER``: check a class's submitted notebooks and write a gradebook (CSV).

How one notebook becomes one row:

1. **Read** here, as data: a notebook that is not JSON, nested too deeply, too big, or has a cell
   that is not a cell (a source that is a number, null, a missing field) is a row saying so.
2. **Matched** to its lesson (its ``NN_`` or ``NNb_`` file-name prefix, else its check cells), its
   check cells compared with the lesson's: a changed or deleted one is reported as tampered, not
   run; a check cell the lesson does not have (an extra or renamed one) is reported, never scored.
3. **Run sealed off** (:mod:`minitrain.course.sandbox`): a fresh kernel in a sandbox of its own,
   with a time and a memory limit (:mod:`minitrain.course.runner`); just before each of the
   lesson's check cells runs, the function it is about to check is taken out of the kernel
   (:mod:`minitrain.course.take`: cloudpickle, with its cell's source).
4. **Judged** by a second sealed process (:mod:`minitrain.course.judge`), started beside the
   notebook and out of its reach, which imported the checkers from the read-only package before any
   of the student's code existed: it loads each function taken out and calls the checker on it.
   That verdict is the row's; nothing the notebook prints, replaces or patches counts.
5. **Written**: the row is appended to the CSV and flushed at once (``--resume`` finishes an
   interrupted run); every field is capped.

What the grader cannot see: see the README's teachers' section.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import sandbox
from .exercises import CHECK_MARK
from .judge import JUDGED_AT_ONCE

__all__ = ["Grade", "grade_notebook", "grade_folder", "main", "SandboxUnavailable",
           "GradebookMismatch"]

LESSONS = Path(__file__).resolve().parents[2] / "lessons"
_CHECK_CALL = re.compile(r'check\("([a-z0-9_]+)"')

MAX_NOTEBOOK = 128 << 20  # bytes of a submitted notebook
MAX_PAYLOAD = 64 << 20  # bytes of one exercise's function, pickled
MAX_RESULTS = 512 << 20  # bytes read back from a sandbox
FIELD_CAP = 1000  # characters in one gradebook field
DEFAULT_MEMORY_GIB = 4.0
UNSEALED = " (unsealed)"


class SandboxUnavailable(RuntimeError):
    """Notebooks cannot be sealed off here, and the teacher did not ask to grade unsealed."""


@dataclass
class Grade:
    """One submitted notebook's row of the gradebook."""

    file: str
    lesson: str = ""
    status: str = "graded"  # graded, timeout, memory limit, tampered, not a lesson, unreadable, failed to run
    exercises: dict = field(default_factory=dict)  # name -> "pass" or "fail: reason"
    errors: list = field(default_factory=list)  # "cell N: Error: message" outside the checks


# --------------------------------------------------------------------------------------------------
# Reading a notebook as data
# --------------------------------------------------------------------------------------------------


class _Unreadable(ValueError):
    pass


def _code_cells(nb) -> list[str]:
    """The sources of ``nb``'s code cells, or :class:`_Unreadable` saying which cell is not a cell."""
    if not isinstance(nb, dict):
        raise _Unreadable(f"the file holds {_json_kind(nb)}, not a notebook (an object with a "
                          "list of cells)")
    cells = nb.get("cells")
    if not isinstance(cells, list):
        raise _Unreadable("it has no list of cells" if "cells" not in nb else
                          f"its cells are {_json_kind(cells)}, not a list")
    sources = []
    for number, cell in enumerate(cells, 1):
        if not isinstance(cell, dict):
            raise _Unreadable(f"cell {number} is {_json_kind(cell)}, not a cell")
        kind = cell.get("cell_type")
        if not isinstance(kind, str):
            raise _Unreadable(f"cell {number} has no cell_type")
        if kind != "code":
            continue
        source = cell.get("source")
        if isinstance(source, list) and all(isinstance(line, str) for line in source):
            source = "".join(source)
        if isinstance(source, list):
            raise _Unreadable(f"cell {number}'s source is a list with something other than text "
                              "in it (a cell's source is text or a list of lines)")
        if not isinstance(source, str):
            raise _Unreadable(f"cell {number}'s source is {_json_kind(source)}, not text or a list "
                              "of lines" if "source" in cell else f"cell {number} has no source")
        sources.append(source)
    return sources


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return "text"
    return "a list"


def _read(path: Path) -> list[str]:
    """The code cells of the notebook at ``path`` (see :func:`_code_cells`)."""
    try:
        size = path.stat().st_size
        if size > MAX_NOTEBOOK:
            raise _Unreadable(f"{size / 2**20:.0f} MB, more than the {MAX_NOTEBOOK >> 20} MB a "
                              "notebook may have here")
        nb = json.loads(path.read_bytes().decode("utf-8"))
    except RecursionError:
        raise _Unreadable("its JSON is nested too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise _Unreadable(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise _Unreadable(f"not JSON ({exc})") from None
    except OSError as exc:
        raise _Unreadable(f"cannot be read ({exc.strerror or exc})") from None
    return _code_cells(nb)


def _checks(sources: list[str]) -> list[str]:
    return [s for s in sources if s.lstrip().startswith(CHECK_MARK)]


def lessons(folder: Path = LESSONS) -> dict[str, Path]:
    """``{"01": lessons/01_....ipynb, "01b": lessons/01b_....ipynb, ...}``."""
    return {p.name.split("_", 1)[0]: p for p in sorted(folder.glob("[0-9][0-9]*_*.ipynb"))}


_LESSON_CELLS: dict[Path, list[str]] = {}


def _lesson_cells(lesson: Path) -> list[str]:
    if lesson not in _LESSON_CELLS:
        _LESSON_CELLS[lesson] = _code_cells(json.loads(lesson.read_text()))
    return _LESSON_CELLS[lesson]


def _which_lesson(path: Path, nb, known: dict[str, Path]) -> Path | None:
    """The lesson of a notebook (``nb``: the notebook or its code cells' sources)."""
    number = re.match(r"(\d\d[a-z]?)[_\- .]", path.name)
    if number and number.group(1) in known:
        return known[number.group(1)]
    sources = nb if isinstance(nb, list) else _code_cells(nb)
    mine = {n for c in sources for n in _CHECK_CALL.findall(c)}
    overlap = {p: len(mine & {n for c in _lesson_cells(p) for n in _CHECK_CALL.findall(c)})
               for p in known.values()}
    best = max(overlap, key=overlap.get, default=None)
    return best if best is not None and overlap[best] else None


def _check_call(source: str) -> tuple[str, str] | None:
    """(exercise name, the expression of the function checked) of a check cell's
    ``check("name", fn)``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and len(node.args) == 2
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "check"
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return node.args[0].value, ast.get_source_segment(source, node.args[1])
    return None


def exercise_names(lesson: Path) -> list[str]:
    """The exercises of ``lesson``, in the order of its check cells."""
    return [(_check_call(c) or (f"check in cell {n}",))[0]
            for n, c in enumerate(_lesson_cells(lesson), 1) if c.lstrip().startswith(CHECK_MARK)]


# --------------------------------------------------------------------------------------------------
# What runs in the sandboxes
# --------------------------------------------------------------------------------------------------

# Each program run in a sandbox is a module of this folder, run by path (``python -I FILE``): it
# starts with the standard library only, and imports what it needs from the package the sandbox
# checked is this one (see sandbox.py's probe).  The runner runs the notebook (and has the kernel
# take each function checked out of it: take.py); the judge judges them.
_RUNNER = str(Path(__file__).resolve().with_name("runner.py"))
_JUDGE = str(Path(__file__).resolve().with_name("judge.py"))

MAX_VERDICTS = 1 << 20  # bytes of verdicts read back for one notebook


class _Judge:
    """The grader's side of the judge (:mod:`.judge`): started once, it judges notebook after
    notebook (restarted after a notebook that timed out or stopped it; unsealed, started afresh
    for each notebook, there being no namespace of its own to clear between them)."""

    def __init__(self, *, sealed: bool, memory: int | None, hide: list):
        self.sealed, self.memory, self.hide = sealed, memory, hide
        self.box: sandbox.Box | None = None
        self.log = None
        self.control = self.verdicts = -1

    def start(self) -> None:
        """Start the judge (it imports the checkers while the first notebook runs)."""
        if self.box is not None:
            return
        self.box = sandbox.Box(sealed=self.sealed, memory=self.memory, hide=self.hide,
                               as_pid_1=True)
        self.log = tempfile.TemporaryFile()
        control, verdicts = os.pipe(), os.pipe()
        self.control, self.verdicts = control[0], verdicts[0]
        try:
            self.box.start([sys.executable, "-I", _JUDGE, str(control[1]), str(verdicts[1]),
                            "sealed" if self.sealed else "unsealed"],
                           env=_env(self.box, self.sealed), stdin=subprocess.PIPE, stdout=self.log,
                           pass_fds=[control[1], verdicts[1]])
        finally:
            os.close(control[1])
            os.close(verdicts[1])
        os.set_blocking(self.verdicts, False)

    def judge(self, todo: list, timeout: float) -> tuple[dict, str]:
        """({exercise: verdict}, "" or why some have none) for one notebook's functions."""
        if len(todo) > JUDGED_AT_ONCE:
            raise RuntimeError(f"a lesson with {len(todo)} exercises: the judge's exit status "
                               f"carries {JUDGED_AT_ONCE} verdicts (judge.py's JUDGED_AT_ONCE)")
        self.start()
        box, kills = self.box, self.box.memory_kills()
        line = json.dumps(todo).encode() + b"\n"

        def hand_over():  # in a thread: a judge still importing, or stuck, is timed out below
            try:
                box.proc.stdin.write(line)
                box.proc.stdin.flush()
            except (OSError, ValueError):  # the judge is gone: said below
                pass

        threading.Thread(target=hand_over, daemon=True).start()
        deadline = time.monotonic() + timeout
        control, verdicts, answer = b"", b"", None
        while answer is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = select.select([self.control, self.verdicts], [], [], min(left, 0.5))[0]
            if self.verdicts in ready:
                verdicts += self._drain(len(verdicts))
            if self.control in ready:
                chunk = os.read(self.control, 1 << 16)
                if not chunk:
                    break  # the judge is gone
                control += chunk
                for raw in control.split(b"\n")[:-1]:
                    item = _json(raw)
                    if isinstance(item, dict) and ("done" in item or "failed" in item):
                        answer = item
                control = control.rsplit(b"\n", 1)[-1]
            elif not ready and box.proc.poll() is not None:
                break
        verdicts += self._drain(len(verdicts))  # all its writers are gone once it is done
        # Which exercise passed comes from the judged process's exit status, through the judge's
        # control pipe, which no judged process holds; the verdicts pipe only gives a failure its
        # words (what a process the function left behind writes there cannot make a pass).
        said = {}
        for raw in verdicts.splitlines():
            item = _json(raw)
            if (isinstance(item, dict) and isinstance(item.get("verdict"), str)
                    and item["verdict"].startswith("fail: ")):
                said.setdefault(item.get("name"), item["verdict"])
        passed = (answer or {}).get("passed")
        found = {}
        if isinstance(passed, int):
            for i, (name, _) in enumerate(todo):
                found[name] = ("pass" if passed >> i & 1 else
                               said.get(name, "fail: (the checker gave no reason)"))
        problem = ""
        if box.memory_kills() > kills:
            problem = f"memory limit: judging used more than {_gib(self.memory)} and was stopped"
        elif answer is None and time.monotonic() >= deadline:
            problem = f"timeout: judging did not finish within {timeout:g} s"
        elif answer is None or "failed" in answer:
            why = _text(answer or {}, "failed") or _last_line(self.log)
            problem = f"failed to run: the checker stopped ({why})"
        elif answer.get("killed"):
            problem = f"failed to run: the checker was stopped (signal {answer['killed']})"
        if answer is None or "done" not in answer or not self.sealed:
            self.close()  # a fresh judge for the next notebook
        return found, problem

    def _drain(self, have: int) -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(self.verdicts, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            if have + len(data) < MAX_VERDICTS:
                data += chunk
        return data

    def close(self) -> None:
        if self.box is not None:
            self.box.close()
            self.box = None
        for fd in (self.control, self.verdicts):
            if fd >= 0:
                os.close(fd)
        self.control = self.verdicts = -1
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _env(box: sandbox.Box, sealed: bool) -> dict:
    """The environment of a sandboxed process: sealed, only what Python and Jupyter need (no
    variable of the teacher's); unsealed, the grader's own, with a home and a kept-functions folder
    in the box's folder."""
    home = os.path.join(box.tmp, "home")
    own = {"HOME": home, "TMPDIR": box.tmp, "MINITRAIN_MINE": os.path.join(box.tmp, "work", "my_minitrain"),
           "MPLCONFIGDIR": os.path.join(home, ".matplotlib"), "PYTHONDONTWRITEBYTECODE": "1"}
    if not sealed:
        return {**os.environ, **own}
    keep = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k in keep or
           (k.startswith("MINITRAIN_") and k != "MINITRAIN_MINE")}
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **env, **own}


def _results(f) -> list[dict]:
    """The JSON lines a sandbox wrote (whatever it wrote: unreadable lines are skipped)."""
    f.seek(0)
    items = []
    for line in f.read(MAX_RESULTS).splitlines():
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(item, dict):
            items.append(item)
    return items


def _text(item: dict, key: str) -> str:
    value = item.get(key)
    return value if isinstance(value, str) else ""


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB"


def _last_line(log) -> str:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - 20000))
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


# --------------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------------


def grade_notebook(path: Path, known: dict[str, Path] | None = None, timeout: float = 300, *,
                   sealed: bool = True, memory_gib: float | None = DEFAULT_MEMORY_GIB,
                   hide=(), judge: "_Judge | None" = None) -> Grade:
    """Grade one submitted notebook (see the module's docstring).  ``sealed=False`` runs it without
    a sandbox (its row says so); ``hide``: folders and files its sandbox must not see besides the
    notebook's own folder; ``judge``: grade_folder's, shared by its notebooks (else one of its
    own).  Raises :class:`SandboxUnavailable` when ``sealed`` and no sandbox can be made here."""
    if sealed and (reason := sandbox.unavailable()):
        raise SandboxUnavailable(reason)
    known = lessons() if known is None else known
    path = Path(path)
    row = Grade(file=str(path))
    try:
        mine = _read(path)
        lesson = _which_lesson(path, mine, known)
    except _Unreadable as exc:
        row.status = f"unreadable: {exc}"
        return row
    except RecursionError:
        row.status = "unreadable: nested too deeply to read"
        return row
    if lesson is None:
        row.status = "not a lesson: no check cell of any lesson"
        return row
    row.lesson = lesson.stem
    expected = _checks(_lesson_cells(lesson))
    names = exercise_names(lesson)
    changed = [n for n, c in zip(names, expected) if c not in mine]
    if changed:
        row.status = "tampered: check cell changed or deleted (" + ", ".join(changed) + ")"
        row.exercises = {n: "fail: check cell changed or deleted" if n in changed else
                         "fail: not run (a check cell was changed)" for n in names}
        return row
    row.exercises = {n: "" for n in names}
    for number, source in enumerate(mine, 1):
        if source.lstrip().startswith(CHECK_MARK) and source not in expected:
            name = (_check_call(source) or _CHECK_CALL.findall(source) or [None])[0]
            what = f'check("{name}", …)' if name else "no check call"
            row.errors.append(f"cell {number}: a check cell the lesson does not have ({what}): "
                              "reported, not scored")
    takes = {}
    for i, source in enumerate(mine):
        if source in expected:
            call = _check_call(source)
            if call is not None:
                takes[i] = call
    memory = None if memory_gib is None else int(memory_gib * 2**30)
    hide = [path.parent.resolve(), *hide]
    own = judge is None
    try:
        if own:
            judge = _Judge(sealed=sealed, memory=memory, hide=hide)
        _run_and_judge(row, mine, takes, timeout, sealed, memory, hide, judge)
    except Exception as exc:  # noqa: BLE001 - one notebook's trouble is one row, never the class's
        row.status = f"failed to run: the grader met {type(exc).__name__}: {exc}"
        row.exercises = {n: v or "fail: not judged" for n, v in row.exercises.items()}
    finally:
        if own and judge is not None:
            judge.close()
    return row


def _run_and_judge(row: Grade, cells: list[str], takes: dict, timeout: float, sealed: bool,
                   memory: int | None, hide: list, judge: _Judge) -> None:
    """Run the notebook in a box of its own, then have ``judge`` judge what was taken out."""
    checks = set(takes)
    judge.start()  # (already started by grade_folder: it imported the checkers meanwhile)
    with tempfile.TemporaryDirectory(prefix=f"minitrain-grade-{os.getpid()}-") as host, \
            sandbox.Box(sealed=sealed, memory=memory, hide=hide) as box:
        files = {k: open(os.path.join(host, k), "w+b") for k in ("spec", "ran", "run.log")}
        try:
            work = os.path.join(box.tmp, "work")
            spec = {"cells": cells, "takes": takes, "cwd": work,
                    "payloads": os.path.join(box.tmp, "taken"), "max_payload": MAX_PAYLOAD,
                    "graceful": not sealed}
            files["spec"].write(json.dumps(spec).encode())
            files["spec"].seek(0)
            argv = [sys.executable, "-I", _RUNNER, str(files["ran"].fileno())]
            box.start(argv, env=_env(box, sealed), stdin=files["spec"], stdout=files["run.log"],
                      pass_fds=[files["ran"].fileno()])
            code = box.wait(timeout)
            box.stop()  # every process the notebook started, before anything else
            ran = _results(files["ran"])
            problem = _run_problem(ran, code, box, timeout, memory, files["run.log"])
        finally:
            for f in files.values():
                f.close()
    if problem:
        row.status = problem
    for item in ran:
        if isinstance(item.get("cell"), int) and item["cell"] - 1 not in checks:
            row.errors.append(f"cell {item['cell']}: {_text(item, 'ename')}: "
                              f"{_text(item, 'evalue')}".splitlines()[0])
    taken = {}
    for item in ran:
        name = item.get("take")
        if name in row.exercises:
            if isinstance(item.get("data"), str):
                taken[name] = {"data": item["data"]}
            else:
                taken[name] = {"problem": _text(item, "problem") or "no function reached the grader"}
    if taken:
        verdicts, trouble = judge.judge([(n, taken[n]) for n in row.exercises if n in taken], timeout)
        for name in taken:
            verdict = verdicts.get(name)
            if isinstance(verdict, str) and (verdict == "pass" or verdict.startswith("fail: ")):
                row.exercises[name] = verdict
            else:
                row.exercises[name] = f"fail: not judged ({(trouble or 'no verdict').split(':')[0]})"
        if trouble and row.status == "graded":
            row.status = trouble
    for name, verdict in row.exercises.items():
        if not verdict:
            row.exercises[name] = "fail: not reached" if problem else "fail: the check did not run"
    if not sealed:
        row.status += UNSEALED


def _run_problem(ran: list[dict], code, box: sandbox.Box, timeout: float, memory, log) -> str:
    """The status of a run that did not simply finish ("" when it did)."""
    if box.memory_hit():
        return f"memory limit: the notebook used more than {_gib(memory)} and was stopped"
    if code is None:
        return f"timeout: did not finish within {timeout:g} s"
    last = ran[-1] if ran else {}
    if last.get("done") is True:
        if memory and any(_text(i, "ename") == "MemoryError" for i in ran if "cell" in i):
            return f"memory limit: the notebook ran out of memory (the limit is {_gib(memory)})"
        return ""
    dead = next((_text(i, "dead") for i in ran if "dead" in i), None)
    if dead is not None:
        return "failed to run: the kernel died" + (f" ({dead.splitlines()[0]})" if dead else "")
    failed = next((_text(i, "failed") for i in ran if "failed" in i), None)
    return "failed to run: " + (failed or _last_line(log))


# --------------------------------------------------------------------------------------------------
# The gradebook
# --------------------------------------------------------------------------------------------------


def _cap(value) -> str:
    """One gradebook field: one line, valid UTF-8, no control characters, at most FIELD_CAP."""
    text = str(value).encode("utf-8", "replace").decode("utf-8")
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= FIELD_CAP else text[:FIELD_CAP - 1] + "…"


def _row_fields(r: Grade, columns: list[str]) -> list[str]:
    passed = sum(v == "pass" for v in r.exercises.values())
    return [_cap(x) for x in [r.file, r.lesson, r.status, f"{passed}/{len(r.exercises)}",
                              *[r.exercises.get(n, "") for n in columns], "; ".join(r.errors)]]


def _header(columns: list[str]) -> list[str]:
    return ["file", "lesson", "status", "passed", *columns, "errors"]


class GradebookMismatch(ValueError):
    """``--resume`` into a gradebook whose columns are not this folder's."""


def _already(out: Path, header: list[str]) -> set[str]:
    """The files an interrupted gradebook already has rows for (a row cut short is dropped)."""
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):  # a row cut short by the interruption
        data = data[:data.rfind(b"\n") + 1]
        out.write_bytes(data)
    rows = list(csv.reader(data.decode("utf-8", "replace").splitlines()))
    if not rows:
        return set()
    if rows[0] != header:
        raise GradebookMismatch(f"{out} has the columns {', '.join(rows[0])}, but this folder's lessons "
                         f"give {', '.join(header)}: grade into a new file (--out) instead of "
                         "--resume")
    return {r[0] for r in rows[1:] if r}


def grade_folder(folder, out, timeout: float = 300, lesson_folder: Path = LESSONS,
                 progress: bool = True, *, resume: bool = False, sealed: bool = True,
                 memory_gib: float | None = DEFAULT_MEMORY_GIB) -> list[Grade]:
    """Grade every ``*.ipynb`` below ``folder``, appending each row to the gradebook CSV ``out`` as
    soon as it is graded (``resume``: keep the rows ``out`` has and grade the rest).  The columns
    are the exercises of the lessons the notebooks belong to.  Returns the rows graded now."""
    if sealed and (reason := sandbox.unavailable()):
        raise SandboxUnavailable(reason)
    out, folder = Path(out), Path(folder)
    paths = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    known = lessons(lesson_folder)
    matched = []
    for path in paths:
        try:
            matched.append(_which_lesson(path, _read(path), known))
        except (_Unreadable, RecursionError):
            pass
    columns = list(dict.fromkeys(n for lesson in sorted({m for m in matched if m}) for n in
                                 exercise_names(lesson)))
    header = _header(columns)
    done = _already(out, header) if resume and out.exists() else set()
    fresh = not done and not (resume and out.exists() and out.stat().st_size)
    rows = []
    bar = None
    todo = [p for p in paths if _cap(str(p)) not in done]
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(todo), desc="grading", unit="notebook", file=sys.stderr)
    hide = [folder.resolve(), out.resolve()]
    with open(out, "w" if fresh else "a", newline="", encoding="utf-8") as f, \
            _Judge(sealed=sealed, memory=None if memory_gib is None else int(memory_gib * 2**30),
                   hide=hide) as judge:
        writer = csv.writer(f)
        if fresh:
            writer.writerow(header)
            f.flush()
        try:
            for path in todo:
                row = grade_notebook(path, known, timeout, sealed=sealed, memory_gib=memory_gib,
                                     hide=hide, judge=judge)
                rows.append(row)
                writer.writerow(_row_fields(row, columns))
                f.flush()
                if bar is not None:
                    bar.set_postfix_str(path.name[:30])
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="minitrain grade", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a folder of submitted notebooks (searched recursively)")
    parser.add_argument("--out", default="gradebook.csv", help="the CSV to write (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds each notebook may run, and again to judge its exercises "
                             "(default: %(default)s)")
    parser.add_argument("--memory", type=float, default=DEFAULT_MEMORY_GIB, metavar="GIB",
                        help="memory each notebook may use, all its processes together "
                             "(default: %(default)s GiB)")
    parser.add_argument("--lessons", type=Path, default=LESSONS,
                        help="the lesson notebooks to grade against (default: this repository's)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows --out already has (an interrupted run) and grade the rest")
    parser.add_argument("--unsealed", action="store_true",
                        help="grade without a sandbox where none can be made (a notebook can then "
                             "reach your files and leave processes behind); each row says so")
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None  # like Ctrl-C
    try:
        return _main(parser, args)
    except KeyboardInterrupt:
        print("\ninterrupted: " + (f"the rows graded so far are in {args.out}; the same command "
                                   "with --resume grades the rest" if Path(args.out).exists() else
                                   "no row was written yet"), file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum, frame):
    raise KeyboardInterrupt


def _main(parser, args) -> int:
    if not Path(args.folder).is_dir():
        parser.exit(2, f"minitrain grade: error: {args.folder} is not a folder\n")
    if not (args.timeout > 0):
        parser.exit(2, f"minitrain grade: error: --timeout must be positive, got {args.timeout}\n")
    if not (args.memory > 0):
        parser.exit(2, f"minitrain grade: error: --memory must be positive (GiB), got {args.memory}\n")
    if not lessons(args.lessons):
        parser.exit(2, f"minitrain grade: error: no lesson notebooks (NN_name.ipynb) in {args.lessons}\n")
    if not args.unsealed and (reason := sandbox.unavailable()):
        parser.exit(2, f"minitrain grade: error: cannot seal the notebooks off: {reason}.\n"
                       "Fix that, or pass --unsealed to grade without a sandbox (each row then "
                       "says 'unsealed').\n")
    try:
        rows = grade_folder(args.folder, args.out, args.timeout, args.lessons, resume=args.resume,
                            sealed=not args.unsealed, memory_gib=args.memory)
    except GradebookMismatch as exc:
        parser.exit(2, f"minitrain grade: error: {exc}\n")
    graded = sum(r.status.startswith("graded") for r in rows)
    print(f"wrote {args.out}: {len(rows)} notebook(s) graded now, {graded} graded, "
          f"{len(rows) - graded} with a problem (see the status column)")
    return 0
