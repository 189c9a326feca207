"""``python -m minitrain.course.exercises build``: the learners' notebooks in ``lessons/`` written from the
teacher's in ``solutions/`` (answers replaced by a placeholder, outputs stripped; a check cell stores
only "not checked yet", never its verdict); ``--check`` only says whether ``lessons/`` is up to date."""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path

from .core import BEGIN, CHECK_MARK, CHECKS, END, PLACEHOLDER, pending

#: a block right after ``# END SOLUTION``, commented out, that the learner gets instead of the
#: placeholder (the debugging lab's broken programs)
GIVEN_BEGIN, GIVEN_END = "# BEGIN GIVEN", "# END GIVEN"


_ASSIGNED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)")


def _strip_solution(source: str) -> str:
    """The answers replaced by the placeholder line — or, where a ``# BEGIN GIVEN`` block follows
    the ``# END SOLUTION`` line, by that block's lines uncommented (what the learner starts from,
    e.g. the debugging lab's broken programs; in the teacher's notebook they are comments).

    An answer at a cell's top level that assigns a name (a prediction: ``my_prediction = 3.5``)
    keeps its target, ``my_prediction = ...  # YOUR CODE HERE``: a bare ``...`` there would be the
    cell's value, and Jupyter would print ``Ellipsis`` under a blank cell."""
    out, inside, given, placeholder, previous = [], False, None, None, ""
    first = False  # the next line inside is the answer's first
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if given is not None:
            if stripped == GIVEN_END:
                given = None
            elif stripped in ("", "#"):
                out.append("\n")
            elif line.startswith(given + "# "):
                out.append(given + line[len(given) + 2:])
            else:
                raise ValueError(f"a line of a {GIVEN_BEGIN!r} block is not a comment: {line!r}")
        elif stripped == GIVEN_BEGIN:
            if previous != END or placeholder is None:
                raise ValueError(f"{GIVEN_BEGIN!r} must follow an {END!r} line")
            del out[placeholder]
            placeholder, given = None, indent
        elif stripped == GIVEN_END:
            raise ValueError(f"{GIVEN_END!r} without {GIVEN_BEGIN!r}")
        elif stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside, first = True, indent == ""
            placeholder = len(out)
            out.append(f"{indent}{PLACEHOLDER}\n")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
        elif first and stripped:
            first = False
            target = _ASSIGNED.match(line)
            if target:
                out[placeholder] = f"{target.group(1)} = {PLACEHOLDER}\n"
        previous = stripped
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    if given is not None:
        raise ValueError(f"{GIVEN_BEGIN!r} without {GIVEN_END!r}")
    return "".join(out).rstrip("\n")


def _check_name(source: str) -> str | None:
    if not source.lstrip().startswith(CHECK_MARK):
        return None
    for name in CHECKS:
        if f'check("{name}"' in source:
            return name
    raise ValueError(f"a {CHECK_MARK} cell must call check(\"<exercise>\", ...):\n{source}")


def normalise(nb: dict) -> dict:
    """Outputs stripped, except the check cells, which say "not checked yet" (never the verdict: a
    learner would read the answer before running anything; nbval gets the verdict from minitrain's
    pytest plugin, :mod:`minitrain_nbval`); no widget state."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        name = _check_name(source)
        # nbval compares only a cell that ran; without minitrain's plugin it would compare this
        # line with the verdict and fail every check, never pass a blank one
        cell["execution_count"] = None if name is None else 1
        cell["outputs"] = [] if name is None else [
            {"name": "stdout", "output_type": "stream", "text": [pending(name) + "\n"]}]
    return nb


def build_exercise(solution: dict) -> dict:
    """The learner's notebook: every answer replaced by a placeholder."""
    nb = normalise(solution)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            if BEGIN in source or END in source or GIVEN_BEGIN in source:
                cell["source"] = _strip_solution(source)
    return nb


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[3]  # the repository: minitrain/course/exercises/build.py
    parser = argparse.ArgumentParser(prog="python -m minitrain.course.exercises",
                                     description="write lessons/ from solutions/")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if lessons/ or solutions/ are out of date")
    parser.add_argument("--solutions", type=Path, default=root / "solutions")
    parser.add_argument("--lessons", type=Path, default=root / "lessons")
    args = parser.parse_args(argv)
    stale = []
    for src in sorted(args.solutions.glob("[0-9]*.ipynb")):
        solution = json.loads(src.read_text())
        targets = {src: _dump(normalise(solution)),
                   args.lessons / src.name: _dump(build_exercise(solution))}
        for path, text in targets.items():
            if not path.exists() or path.read_text() != text:
                stale.append(path)
                if not args.check:
                    path.write_text(text)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and stale) else 0
