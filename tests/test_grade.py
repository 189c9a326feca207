"""``minitrain grade``: a folder with a solved, a blank, a stuck, a tampered, a check-cell-deleted,
a deadlocking and a not-JSON notebook gives the right gradebook rows, in bounded time."""

import csv
import json
import shutil
import time
from pathlib import Path

import pytest

from minitrain.cli import main
from test_grade_attacks import CHECK, SOLVED, notebook, sealed_or_skip

ROOT = Path(__file__).resolve().parents[1]
LESSON = "00_why_one_device_is_not_enough.ipynb"

# rank 0 all-reduces, rank 1 returns: the launcher names the deadlock within seconds
DEADLOCK = """\
import torch
import torch.distributed as dist
from minitrain import Cluster

def skips_the_all_reduce():
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    return t.tolist()

with Cluster(2, backend="gloo", timeout=20) as cluster:
    cluster.run(skips_the_all_reduce)"""


def _write(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb))


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    sealed_or_skip()
    folder = tmp_path_factory.mktemp("class")
    shutil.copy(ROOT / "solutions" / LESSON, folder / "00_ada.ipynb")          # solved
    shutil.copy(ROOT / "lessons" / LESSON, folder / "00_bob.ipynb")            # blank
    tampered = json.loads((ROOT / "solutions" / LESSON).read_text())           # check cell edited
    for cell in tampered["cells"]:
        src = "".join(cell["source"])
        if src.startswith("# NBVAL_CHECK_OUTPUT"):
            cell["source"] = src + "\nprint('✓ trust me')"
    _write(tampered, folder / "sub" / "dee.ipynb") if (folder / "sub").mkdir() is None else None
    deleted = json.loads((ROOT / "solutions" / LESSON).read_text())  # check cell deleted
    deleted["cells"] = [c for c in deleted["cells"]
                        if not "".join(c["source"]).startswith("# NBVAL_CHECK_OUTPUT")]
    _write(deleted, folder / "00_eve.ipynb")
    (folder / "00_fay.ipynb").write_text("my homework, as plain text\n")  # not JSON
    _write(notebook(DEADLOCK, SOLVED, CHECK), folder / "00_gus.ipynb")  # a cell that deadlocks
    out = folder / "gradebook.csv"
    t0 = time.monotonic()
    assert main(["grade", str(folder), "--out", str(out), "--timeout", "180"]) == 0
    elapsed = time.monotonic() - t0
    rows = {Path(r["file"]).name: r for r in csv.DictReader(out.open())}
    return rows, elapsed


def test_a_solved_notebook_passes(gradebook):
    row = gradebook[0]["00_ada.ipynb"]
    assert row["lesson"] == "00_why_one_device_is_not_enough" and row["status"] == "graded"
    assert row["zero_bytes_per_device"] == "pass" and row["passed"] == "1/1" and row["errors"] == ""


def test_a_blank_notebook_fails_with_the_checkers_reason(gradebook):
    row = gradebook[0]["00_bob.ipynb"]
    assert row["status"] == "graded" and row["passed"] == "0/1"
    assert row["zero_bytes_per_device"].startswith("fail: not written yet: zero_bytes_per_device")


def test_a_stuck_notebook_is_stopped_at_its_time_limit(tmp_path):
    sealed_or_skip()
    stuck = json.loads((ROOT / "lessons" / LESSON).read_text())  # never finishes
    stuck["cells"].insert(0, {"cell_type": "code", "metadata": {}, "outputs": [],
                              "execution_count": None, "source": "while True:\n    pass"})
    _write(stuck, tmp_path / "00_cy.ipynb")
    t0 = time.monotonic()
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--timeout", "8"]) == 0
    assert time.monotonic() - t0 < 30  # the time limit holds, the kernel is stopped
    row = next(csv.DictReader((tmp_path / "g.csv").open()))
    assert row["status"] == "timeout: did not finish within 8 s" and row["passed"] == "0/1"
    assert row["zero_bytes_per_device"] == "fail: not reached"


def test_a_tampered_check_cell_is_reported_not_run(gradebook):
    row = gradebook[0]["dee.ipynb"]  # matched to its lesson by its check cells, not its name
    assert row["lesson"] == "00_why_one_device_is_not_enough"
    assert row["status"].startswith("tampered") and row["zero_bytes_per_device"].startswith("fail")


def test_a_deleted_check_cell_is_reported_as_tampered_not_run(gradebook):
    row = gradebook[0]["00_eve.ipynb"]
    assert row["lesson"] == "00_why_one_device_is_not_enough" and row["passed"] == "0/1", row
    assert row["status"] == "tampered: check cell changed or deleted (zero_bytes_per_device)", row
    assert row["zero_bytes_per_device"] == "fail: check cell changed or deleted", row


def test_a_file_that_is_not_json_is_one_unreadable_row(gradebook):
    row = gradebook[0]["00_fay.ipynb"]
    assert row["status"].startswith("unreadable: not JSON (Expecting value: line 1 column 1"), row
    assert row["lesson"] == "" and row["passed"] == "0/0", row


def test_a_deadlocking_cell_is_diagnosed_in_the_row_and_the_rest_is_graded(gradebook):
    row = gradebook[0]["00_gus.ipynb"]  # well inside the 180 s limit: no timeout
    assert row["status"] == "graded" and row["zero_bytes_per_device"] == "pass", row
    assert row["errors"].startswith("cell 1: Deadlock: rank 0 failed: the ranks wait for each other "
                                    "and never will"), row


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["grade", str(tmp_path / "missing")])
    assert info.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_a_lab_notebook_is_matched_by_its_prefix():
    from minitrain.course.grade import _which_lesson, lessons

    known = lessons()
    assert known["01b"].name == "01b_debugging_lab.ipynb"
    assert _which_lesson(Path("01b_ada.ipynb"), {"cells": []}, known) == known["01b"]
    assert _which_lesson(Path("01_ada.ipynb"), {"cells": []}, known) == known["01"]
