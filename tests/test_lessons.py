"""Lessons under nbval: solutions pass; the learners' versions fail exactly at their check cells.

Both folders run in the background while the rest of the suite runs (``tests/conftest.py``);
this test comes last and reads their reports."""

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import stop_tree

ROOT = Path(__file__).resolve().parents[1]


def nbval_results(proc: subprocess.Popen, report: Path) -> dict[str, str | None]:
    """Wait for a run of ``conftest.nbval_start``; return {"file::Cell k": None where it passed,
    else what nbval said (the end of its message)}."""
    try:
        proc.wait(timeout=600)
    finally:
        stop_tree(proc)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = case.find("error") if bad is None else bad
        said = None if bad is None else (bad.get("message", "") + "\n" + (bad.text or ""))[-1500:]
        results[f"{Path(case.get('classname', '')).name}::{case.get('name')}"] = said
    assert results, "nbval collected nothing"
    return results


def check_cells() -> set[str]:
    cells = set()
    for path in sorted((ROOT / "lessons").glob("[0-9]*.ipynb")):
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        for i, cell in enumerate(code):
            if "".join(cell["source"]).startswith("# NBVAL_CHECK_OUTPUT"):
                cells.add(f"{path.stem}::Cell {i}")
    return cells


def normalise_ids(results: dict) -> dict:
    out = {}
    for key, said in results.items():
        name = key.split("::", 1)[1] if "::" in key else key
        nb = next((p.stem for p in (ROOT / "lessons").glob("[0-9]*.ipynb") if p.stem in key), key)
        out[f"{nb}::{name.split('::')[-1]}"] = said
    return out


@pytest.mark.timeout(900)
def test_solutions_pass_and_exercises_fail_only_at_their_checks(lesson_runs):
    runs = lesson_runs  # both folders, started in the background when collection ended (conftest)
    solutions = normalise_ids(nbval_results(*runs["solutions"]))
    exercises = normalise_ids(nbval_results(*runs["lessons"]))
    failing = {k: said for k, said in solutions.items() if said is not None}
    assert not failing, failing  # each failing cell with what nbval said of it
    failed = {k for k, said in exercises.items() if said is not None}
    checks = check_cells()
    assert failed == checks, ({k: exercises[k] for k in failed - checks},
                              f"passed with nothing written: {sorted(checks - failed)}")
    assert set(exercises) == set(solutions)
