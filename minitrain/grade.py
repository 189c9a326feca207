"""``minitrain grade FOLDER``: check a class's submitted notebooks and write a gradebook (CSV).

Each notebook is matched to its lesson (by its ``NN_`` or ``NNb_`` file-name prefix, else by its
check cells), its check cells are compared with the lesson's (a changed or deleted one is reported
as tampered, not run), and it is executed on its own — a fresh kernel in a temporary folder, with a
time limit, so one student's endless loop cannot stall the others (the kernel and every rank it
started are stopped).  A row per notebook: the lesson, the status, each exercise's verdict (the
checker's one-line reason when it fails) and the errors raised elsewhere in the notebook.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .exercises import CHECK_MARK

__all__ = ["Grade", "grade_notebook", "grade_folder", "main"]

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
_CHECK_CALL = re.compile(r'check\("([a-z0-9_]+)"')


@dataclass
class Grade:
    """One submitted notebook's row of the gradebook."""

    file: str
    lesson: str = ""
    status: str = "graded"  # graded, timeout, tampered, not a lesson, unreadable, failed to run
    exercises: dict = field(default_factory=dict)  # name -> "pass" or "fail: reason"
    errors: list = field(default_factory=list)  # "cell N: Error: message" outside the checks


def _cells(nb: dict) -> list[str]:
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


def _checks(sources: list[str]) -> list[str]:
    return [s for s in sources if s.lstrip().startswith(CHECK_MARK)]


def lessons(folder: Path = LESSONS) -> dict[str, Path]:
    """``{"01": lessons/01_....ipynb, "01b": lessons/01b_....ipynb, ...}``."""
    return {p.name.split("_", 1)[0]: p for p in sorted(folder.glob("[0-9][0-9]*_*.ipynb"))}


def _which_lesson(path: Path, nb: dict, known: dict[str, Path]) -> Path | None:
    number = re.match(r"(\d\d[a-z]?)[_\- .]", path.name)
    if number and number.group(1) in known:
        return known[number.group(1)]
    def exercises(notebook: dict) -> set:
        return {n for c in _cells(notebook) for n in _CHECK_CALL.findall(c)}
    mine = exercises(nb)
    overlap = {p: len(mine & exercises(json.loads(p.read_text()))) for p in known.values()}
    best = max(overlap, key=overlap.get, default=None)
    return best if best is not None and overlap[best] else None


_RUNNER = r"""
import json, sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True,
                        resources={"metadata": {"path": sys.argv[3]}})
try:
    client.execute()
finally:
    nbformat.write(nb, sys.argv[2])
"""


def _kill_tree(pid: int) -> None:
    from .launch import descendants
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _execute(nb_path: Path, timeout: float) -> tuple[dict | None, str]:
    """Run the notebook in a fresh kernel in a temporary folder; (executed notebook, problem)."""
    with tempfile.TemporaryDirectory(prefix="minitrain-grade-") as work:
        out = Path(work) / "executed.ipynb"
        proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(nb_path), str(out), work],
                                cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True,  # one student's kept functions:
                                env={**os.environ, "MINITRAIN_MINE": str(Path(work) / "my_minitrain")})
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            partial = json.loads(out.read_text()) if out.exists() else None
            return partial, f"timeout: did not finish within {timeout:g} s"
        finally:
            _kill_tree(proc.pid)  # a kernel left behind, and the ranks it started
        if not out.exists():
            return None, "failed to run: " + (err.strip().splitlines() or ["no output"])[-1]
        return json.loads(out.read_text()), ""


def _verdicts(executed: dict) -> tuple[dict, list]:
    """``({exercise: "pass" | "fail: reason"}, [errors elsewhere])`` from an executed notebook."""
    verdicts, errors = {}, []
    number = 0
    for cell in executed["cells"]:
        if cell["cell_type"] != "code":
            continue
        number += 1
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        outputs = cell.get("outputs", [])
        failure = next((o for o in outputs if o.get("output_type") == "error"), None)
        if source.lstrip().startswith(CHECK_MARK):
            name = (_CHECK_CALL.findall(source) or [f"check in cell {number}"])[0]
            text = "".join("".join(o.get("text", "")) for o in outputs
                           if o.get("output_type") == "stream")
            line = next((l for l in text.splitlines() if l.startswith(("✓", "✗"))), "")
            if line.startswith("✓"):
                verdicts[name] = "pass"
            elif line:
                verdicts[name] = "fail: " + line.split(": ", 1)[-1]
            elif failure:
                verdicts[name] = f"fail: {failure['ename']}: {failure['evalue']}"
            else:
                verdicts[name] = "fail: the check did not run"
        elif failure:
            errors.append(f"cell {number}: {failure['ename']}: {failure['evalue']}".splitlines()[0])
    return verdicts, errors


def grade_notebook(path: Path, known: dict[str, Path] | None = None, timeout: float = 300) -> Grade:
    """Grade one submitted notebook (see the module's docstring)."""
    known = lessons() if known is None else known
    row = Grade(file=str(path))
    try:
        nb = json.loads(Path(path).read_text())
        _cells(nb)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        row.status = f"unreadable: {exc}"
        return row
    lesson = _which_lesson(Path(path), nb, known)
    if lesson is None:
        row.status = "not a lesson: no check cell of any lesson"
        return row
    row.lesson = lesson.stem
    expected = _checks(_cells(json.loads(lesson.read_text())))
    names = [(_CHECK_CALL.findall(c) or ["?"])[0] for c in expected]
    mine = _cells(nb)
    changed = [n for n, c in zip(names, expected) if c not in mine]
    if changed:
        row.status = "tampered: check cell changed or deleted (" + ", ".join(changed) + ")"
        row.exercises = {n: "fail: check cell changed or deleted" for n in changed}
        return row
    executed, problem = _execute(Path(path).resolve(), timeout)
    if executed is not None:
        row.exercises, row.errors = _verdicts(executed)
    for name in names:
        row.exercises.setdefault(name, "fail: not reached" if problem else "fail: no verdict")
    if problem:
        row.status = problem
    return row


def grade_folder(folder, out, timeout: float = 300, lesson_folder: Path = LESSONS,
                 progress: bool = True) -> list[Grade]:
    """Grade every ``*.ipynb`` below ``folder`` and write the gradebook CSV to ``out``."""
    paths = sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    known = lessons(lesson_folder)
    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(paths), desc="grading", unit="notebook", file=sys.stderr)
    for path in paths:
        rows.append(grade_notebook(path, known, timeout))
        if bar is not None:
            bar.set_postfix_str(path.name[:30])
            bar.update(1)
    if bar is not None:
        bar.close()
    exercises = list(dict.fromkeys(n for r in rows for n in r.exercises))
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "lesson", "status", "passed", *exercises, "errors"])
        for r in rows:
            passed = sum(v == "pass" for v in r.exercises.values())
            writer.writerow([r.file, r.lesson, r.status, f"{passed}/{len(r.exercises)}",
                             *[r.exercises.get(n, "") for n in exercises], "; ".join(r.errors)])
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="minitrain grade", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a folder of submitted notebooks (searched recursively)")
    parser.add_argument("--out", default="gradebook.csv", help="the CSV to write (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds each notebook may run (default: %(default)s)")
    parser.add_argument("--lessons", type=Path, default=LESSONS,
                        help="the lesson notebooks to grade against (default: this repository's)")
    args = parser.parse_args(argv)
    if not Path(args.folder).is_dir():
        parser.exit(2, f"minitrain grade: error: {args.folder} is not a folder\n")
    if not (args.timeout > 0):
        parser.exit(2, f"minitrain grade: error: --timeout must be positive, got {args.timeout}\n")
    rows = grade_folder(args.folder, args.out, args.timeout, args.lessons)
    graded = sum(r.status == "graded" for r in rows)
    print(f"wrote {args.out}: {len(rows)} notebook(s), {graded} graded, "
          f"{len(rows) - graded} with a problem (see the status column)")
    return 0
