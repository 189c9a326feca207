"""The teacher's command, ``pytest --nbval-lax path/to/student/NN.ipynb``, run as a teacher would run
it (from a folder of student notebooks, outside this repository): the lessons store no verdict, yet a
blank check fails with the checker's ✗ line in the diff and a solved one passes (minitrain_nbval)."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = "00_why_one_device_is_not_enough.ipynb"
CHECK = "# NBVAL_CHECK_OUTPUT"


def _exercise(folder: str) -> dict:
    """The lesson's exercise cell and its check cell, as they are in ``folder`` (the whole lesson
    runs under nbval in tests/test_lessons.py; these two are the part this test is about)."""
    nb = json.loads((ROOT / folder / LESSON).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    i = next(k for k, c in enumerate(code) if "".join(c["source"]).startswith(CHECK))
    return {**nb, "cells": code[i - 1:i + 1]}


def _saved_after(nb: dict, line: str) -> dict:
    """``nb`` as a student saves it after running the check: ``line`` is the stored output."""
    nb = json.loads(json.dumps(nb))
    nb["cells"][-1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": line + "\n"}]
    return nb


def test_the_plugin_is_registered_with_pytest():
    plugins = {e.name: e.value for e in entry_points(group="pytest11")}
    assert plugins.get("minitrain_nbval") == "minitrain_nbval", \
        "pip install -e . again: it registers minitrain's pytest plugin (pyproject.toml, pytest11)"


@pytest.mark.timeout(300)
def test_the_teachers_command_fails_a_blank_check_and_passes_a_solved_one(tmp_path):
    from minitrain.course.exercises import verdict

    blank, solved = _exercise("lessons"), _exercise("solutions")
    wrong = json.loads(json.dumps(blank))
    wrong["cells"][0]["source"] = "def zero_bytes_per_device(psi, n, stage):\n    return 16 * psi / n"
    # solved, on a busy machine: a notice on stderr in the check cell is not compared
    noisy = json.loads(json.dumps(solved))
    lines = "".join(noisy["cells"][1]["source"]).split("\n", 1)
    noisy["cells"][1]["source"] = (lines[0] + "\nimport sys; print('minitrain: ranks were slow to "
                                   "start', file=sys.stderr)\n" + lines[1])
    students = {"00_blank.ipynb": blank, "00_solved.ipynb": solved, "00_wrong.ipynb": wrong,
                # saved after a failed run: its stored ✗ line is not what nbval expects
                "00_blank_saved.ipynb": _saved_after(blank, "✗ zero_bytes_per_device: not written yet"),
                "00_solved_noisy.ipynb": noisy,
                # saved after a pass: still passes
                "00_solved_saved.ipynb": _saved_after(solved, verdict("zero_bytes_per_device"))}
    folder = tmp_path / "student"
    folder.mkdir()
    for name, nb in students.items():
        (folder / name).write_text(json.dumps(nb))
    report = tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *sorted(students)],
                          cwd=folder, capture_output=True, text=True, timeout=280)
    cases = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        stem = Path(case.get("classname")).name.removesuffix(".ipynb")
        cases[f"{stem}::{case.get('name')}"] = (
            None if failure is None else (failure.get("message", "") + (failure.text or "")))
    assert len(cases) == 2 * len(students), (proc.stdout[-3000:], cases)
    for name in students:
        stem = name.removesuffix(".ipynb")
        exercise, check = cases[f"{stem}::Cell 0"], cases[f"{stem}::Cell 1"]
        assert exercise is None, (name, exercise)
        if "solved" in name:
            assert check is None, (name, check)
        else:
            assert check is not None, f"{name}: its check cell passed"
            assert "✗ zero_bytes_per_device: " in check, (name, check)  # the checker's reason
    assert "not written yet" in cases["00_blank::Cell 1"]
    assert "the same 1,875,000,000 bytes at every stage" in cases["00_wrong::Cell 1"]
