"""``minitrain grade FOLDER``: check a class's submitted notebooks and write a gradebook (CSV).

How one notebook becomes one row:

1. **Read** here, as data: a notebook that is not JSON, nested too deeply, too big, or has a cell
   that is not a cell (a source that is a number, null, a missing field) is a row saying so.
2. **Matched** to its lesson (its ``NN_`` or ``NNb_`` file-name prefix, else its check cells), its
   check cells compared with the lesson's: a changed or deleted one is reported as tampered, not
   run; a check cell the lesson does not have (an extra or renamed one) is reported, never scored.
3. **Run sealed off** (:mod:`minitrain.sandbox`): a fresh kernel in a sandbox of its own, with a
   time and a memory limit; just before each of the lesson's check cells runs, the function it is
   about to check is taken out of the kernel (cloudpickle, with its cell's source:
   :mod:`minitrain.shipping`).
4. **Judged** by a second sealed process, started beside the notebook and out of its reach, which
   imported the checkers from the read-only package before any of the student's code existed: it
   loads each function taken out and calls the checker on it.  That verdict is the row's; nothing
   the notebook prints, replaces or patches counts.
5. **Written**: the row is appended to the CSV and flushed at once (``--resume`` finishes an
   interrupted run); every field is capped.

What the grader cannot see: see the README's teachers' section.
"""

from __future__ import annotations

import ast
import base64
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import sandbox
from .exercises import CHECK_MARK

__all__ = ["Grade", "grade_notebook", "grade_folder", "main", "SandboxUnavailable",
           "GradebookMismatch"]

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
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

# In the student's kernel, just before one of the lesson's check cells: the function the check is
# about to get, pickled by value (a notebook's functions are; so are those of the student's own
# modules) with its cell's source, into a file for the runner.  Whatever the notebook did to this
# kernel, it can only choose which function is judged, never the verdict.
_TAKE = r"""
import os, sys
def _note(text):
    with open(path + ".problem", "w") as f:
        f.write(text[:4000])
try:
    fn = get()
except BaseException as exc:
    _note(f"{type(exc).__name__}: {exc}")
else:
    try:
        import cloudpickle
        from minitrain import shipping
        pieces = list(fn) if isinstance(fn, (tuple, list)) else [fn]
        names = {getattr(f, "__module__", None) for f in pieces} - {None, "__main__"}
        mods = [sys.modules[m] for m in names if m in sys.modules
                and m.split(".")[0] not in ("minitrain", "torch", "builtins")]
        for m in mods:
            cloudpickle.register_pickle_by_value(m)
        try:
            data = shipping.dumps(fn)
        finally:
            for m in mods:
                cloudpickle.unregister_pickle_by_value(m)
    except BaseException as exc:
        _note(f"it could not be taken out of the notebook to be judged: {type(exc).__name__}: {exc}")
    else:
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)
"""

# Runs the notebook (nbclient) in the sandbox and reports to fd 3, one JSON object a line: the
# errors of its cells, each function taken out (base64) or why none was, and "done".
_RUNNER = r"""
import base64, json, os, sys
out = open(int(sys.argv[1]), "w")
def emit(**item):
    out.write(json.dumps(item) + "\n")
    out.flush()
spec = json.load(sys.stdin)
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
nb = nbformat.v4.new_notebook()
nb.cells = [nbformat.v4.new_code_cell(source) for source in spec["cells"]]
client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True,
                        resources={"metadata": {"path": spec["cwd"]}})
takes = {int(i): t for i, t in spec["takes"].items()}
os.makedirs(spec["payloads"], exist_ok=True)
try:
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if i in takes:
                name, expr = takes[i]
                path = os.path.join(spec["payloads"], f"{i}")
                code = (f"__import__('builtins').exec({spec['take']!r}, "
                        f"{{'path': {path!r}, 'get': lambda: ({expr})}})")
                client.execute_cell(nbformat.v4.new_code_cell(code), i, store_history=False)
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        data = f.read(spec["max_payload"] + 1)
                    if len(data) > spec["max_payload"]:
                        emit(take=name, problem=f"your function, with what it uses, is more than "
                             f"{spec['max_payload'] >> 20} MB pickled; the grader takes less")
                    else:
                        emit(take=name, data=base64.b64encode(data).decode())
                elif os.path.exists(path + ".problem"):
                    with open(path + ".problem") as f:
                        emit(take=name, problem=f.read(4000))
                else:
                    emit(take=name, problem="no function reached the grader")
            client.execute_cell(cell, i)
            error = next((o for o in cell.outputs if o.get("output_type") == "error"), None)
            if error is not None:
                emit(cell=i + 1, ename=str(error.get("ename"))[:200], evalue=str(error.get("evalue"))[:2000])
            cell.outputs = []
    emit(done=True)
except DeadKernelError as exc:
    emit(dead=str(exc)[:2000])
except Exception as exc:
    emit(failed=f"{type(exc).__name__}: {exc}"[:2000])
out.close()
if not spec["graceful"]:
    os._exit(0)  # sealed: the sandbox's end stops the kernel and all it started
"""

# Judges in a sandbox of its own: the checkers are imported first (from the read-only package),
# then, once the notebook has run, the functions taken out arrive on stdin, and each verdict goes to
# fd 3.  No code of the student's exists in this process before the checkers are bound.
_JUDGE = r"""
import base64, json, os, sys
out = open(int(sys.argv[1]), "w")
def emit(**item):
    out.write(json.dumps(item) + "\n")
    out.flush()
try:
    import minitrain.exercises as exercises
    from minitrain.exercises import problem
    from minitrain.shipping import loads
except BaseException as exc:
    emit(failed=f"the checkers did not load: {type(exc).__name__}: {exc}"[:2000])
    sys.exit(1)
emit(ready=True)
todo = json.loads(sys.stdin.read())
for name, item in todo:
    if "data" not in item:
        verdict = "fail: " + item["problem"]
    else:
        try:
            fn = loads(base64.b64decode(item["data"]))
        except BaseException as exc:
            verdict = f"fail: your function could not be loaded to be judged: {type(exc).__name__}: {exc}"
        else:
            try:
                found = problem(name, fn)
            except BaseException as exc:
                found = f"the checker raised {type(exc).__name__}: {exc}"
            verdict = "pass" if found is None else f"fail: {found}"
    emit(name=name, verdict=str(verdict)[:4000])
try:
    exercises.release()
except BaseException:
    pass
emit(done=True)
out.close()
os._exit(0)
"""


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
                   hide=()) -> Grade:
    """Grade one submitted notebook (see the module's docstring).  ``sealed=False`` runs it without
    a sandbox (its row says so); ``hide``: folders and files its sandbox must not see besides the
    notebook's own folder.  Raises :class:`SandboxUnavailable` when ``sealed`` and no sandbox can
    be made here."""
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
    try:
        _run_and_judge(row, mine, takes, timeout, sealed,
                       None if memory_gib is None else int(memory_gib * 2**30),
                       [path.parent.resolve(), *hide])
    except Exception as exc:  # noqa: BLE001 - one notebook's trouble is one row, never the class's
        row.status = f"failed to run: the grader met {type(exc).__name__}: {exc}"
        row.exercises = {n: v or "fail: not judged" for n, v in row.exercises.items()}
    return row


def _run_and_judge(row: Grade, cells: list[str], takes: dict, timeout: float, sealed: bool,
                   memory: int | None, hide: list) -> None:
    """Run the notebook in one box while a judge waits in another; fill ``row``."""
    checks = set(takes)
    with tempfile.TemporaryDirectory(prefix=f"minitrain-grade-{os.getpid()}-") as host, \
            sandbox.Box(sealed=sealed, memory=memory, hide=hide) as judge_box, \
            sandbox.Box(sealed=sealed, memory=memory, hide=hide) as run_box:
        files = {k: open(os.path.join(host, k), "w+b") for k in ("spec", "ran", "run.log", "judged",
                                                                  "judge.log")}
        try:
            judge_box.start([sys.executable, "-I", "-c", _JUDGE, str(files["judged"].fileno())],
                            env=_env(judge_box, sealed), stdin=subprocess.PIPE,
                            stdout=files["judge.log"], pass_fds=[files["judged"].fileno()])
            work = os.path.join(run_box.tmp, "work")
            spec = {"cells": cells, "takes": takes, "take": _TAKE, "cwd": work,
                    "payloads": os.path.join(run_box.tmp, "taken"), "max_payload": MAX_PAYLOAD,
                    "graceful": not sealed}
            files["spec"].write(json.dumps(spec).encode())
            files["spec"].seek(0)
            argv = [sys.executable, "-I", "-c",
                    f"import os; os.makedirs({work!r}, exist_ok=True); os.chdir({work!r}); "
                    f"os.makedirs(os.environ['HOME'], exist_ok=True); "
                    f"exec(compile({_RUNNER!r}, '<minitrain-grade-runner>', 'exec'))",
                    str(files["ran"].fileno())]
            run_box.start(argv, env=_env(run_box, sealed), stdin=files["spec"],
                          stdout=files["run.log"], pass_fds=[files["ran"].fileno()])
            code = run_box.wait(timeout)
            run_box.stop()  # every process the notebook started, before anything else
            ran = _results(files["ran"])
            problem = _run_problem(ran, code, run_box, timeout, memory, files["run.log"])
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
            _judge(row, judge_box, files, taken, timeout, memory)
            for name, verdict in row.exercises.items():
                if not verdict:
                    row.exercises[name] = ("fail: not reached" if problem else
                                           "fail: the check did not run")
            if not sealed and not row.status.endswith(UNSEALED):
                row.status += UNSEALED
        finally:
            for f in files.values():
                f.close()


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


def _judge(row: Grade, box: sandbox.Box, files: dict, taken: dict, timeout: float, memory) -> None:
    """Hand the functions taken out to the judge; its verdicts go into ``row``."""
    todo = json.dumps([(name, taken[name]) for name in row.exercises if name in taken]).encode()

    def hand_over():  # in a thread: a judge still importing, or stuck, is timed out below
        try:
            box.proc.stdin.write(todo)
            box.proc.stdin.close()
        except (OSError, ValueError):  # the judge is gone: said below
            pass

    threading.Thread(target=hand_over, daemon=True).start()
    code = box.wait(timeout)
    box.stop()
    judged = _results(files["judged"])
    for item in judged:
        name, verdict = item.get("name"), item.get("verdict")
        if name in taken and isinstance(verdict, str) and (verdict == "pass" or verdict.startswith("fail: ")):
            row.exercises[name] = verdict
    unjudged = [n for n in taken if not row.exercises[n]]
    if not unjudged:
        return
    if box.memory_hit():
        why = f"memory limit: judging used more than {_gib(memory)} and was stopped"
    elif code is None:
        why = f"timeout: judging did not finish within {timeout:g} s"
    else:
        failed = next((_text(i, "failed") for i in judged if "failed" in i), "")
        why = "failed to run: the checker stopped (" + (failed or _last_line(files["judge.log"])) + ")"
    if row.status == "graded":
        row.status = why
    for name in unjudged:
        row.exercises[name] = f"fail: not judged ({why.split(':')[0]})"


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
    with open(out, "w" if fresh else "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if fresh:
            writer.writerow(header)
            f.flush()
        try:
            for path in todo:
                row = grade_notebook(path, known, timeout, sealed=sealed, memory_gib=memory_gib,
                                     hide=[folder.resolve(), out.resolve()])
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
