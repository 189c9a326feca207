"""Lessons under nbval: solutions pass; the learners' versions fail exactly at their check cells."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def nbval(folder: str, tmp_path) -> dict[str, bool]:
    """Run ``pytest --nbval-lax`` on a folder; return {"file::Cell k": passed}."""
    report = tmp_path / f"{folder}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q",
                    f"--junitxml={report}", str(ROOT / folder)], capture_output=True, text=True,
                   timeout=600, cwd=ROOT)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        results[f"{Path(case.get('classname', '')).name}::{case.get('name')}"] = not failed
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
    for key, ok in results.items():
        name = key.split("::", 1)[1] if "::" in key else key
        nb = next((p.stem for p in (ROOT / "lessons").glob("[0-9]*.ipynb") if p.stem in key), key)
        out[f"{nb}::{name.split('::')[-1]}"] = ok
    return out


@pytest.mark.timeout(600)
def test_solutions_pass_and_exercises_fail_only_at_their_checks(tmp_path):
    solutions = normalise_ids(nbval("solutions", tmp_path))
    assert all(solutions.values()), [k for k, ok in solutions.items() if not ok]
    exercises = normalise_ids(nbval("lessons", tmp_path))
    failed = {k for k, ok in exercises.items() if not ok}
    assert failed == check_cells()
    assert set(exercises) == set(solutions)
