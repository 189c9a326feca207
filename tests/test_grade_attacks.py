"""``minitrain grade`` against a class that cheats, vandalises, escapes and sends garbage.

Every attack is a notebook of lesson 00 (its exercise is pure Python, so a tiny notebook grades in
seconds); one folder holds them all and is graded once, and each test reads its row.  Each attack's
test fails on a grader that runs notebooks unsealed: there the cheats are recorded as passes, the
vandal changes the submissions, solutions/ and the installed package and reaches the teacher's
loopback, the daemons hold grading up (for ever, with the pipe kept open) and rewrite the
gradebook, 3 GB go unnoticed, a malformed notebook aborts the whole run, a 5 MB message breaks the
CSV, and Ctrl-C loses every row.  Ten thousand cells and a 50 MB output are graded as well.
"""

import csv
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from minitrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
LESSON = "00_why_one_device_is_not_enough.ipynb"
HEADER = ["file", "lesson", "status", "passed", "zero_bytes_per_device", "errors"]
MARK = f"minitrain-attack-{uuid.uuid4().hex[:12]}"  # in the command line of every daemon started


def _exercise_cells(folder: str) -> tuple[str, str]:
    """(lesson 00's exercise cell, its check cell) from lessons/ (blank) or solutions/ (solved)."""
    nb = json.loads((ROOT / folder / LESSON).read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    i = next(i for i, c in enumerate(code) if c.startswith("def zero_bytes_per_device"))
    return code[i], code[i + 1]


BLANK, CHECK = _exercise_cells("lessons")
SOLVED, _ = _exercise_cells("solutions")
WRONG = "def zero_bytes_per_device(psi, n, stage):\n    return 16 * psi / n"


def notebook(*sources: str) -> dict:
    return {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                       "source": s} for s in sources],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 4}


def sealed_or_skip():
    """Sandbox tests skip where this machine cannot make one, except on CI, where they must run."""
    from minitrain.course.sandbox import unavailable

    reason = unavailable()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the sandbox tests: {reason}")
    if reason:
        pytest.skip(reason)


def marked_processes() -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if MARK in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z":
                found.append(f"{entry}: {cmdline}")
    return found


def leftovers(pid: int) -> list[str]:
    """Temporary folders and cgroups the grader in process ``pid`` made and did not remove."""
    import tempfile

    tmp = [str(p) for kind in ("grade", "stage")  # (not minitrain-ranks-: a live Cluster's own)
           for p in Path(tempfile.gettempdir()).glob(f"minitrain-{kind}-{pid}-*")]
    groups = [str(p) for p in Path("/sys/fs/cgroup").glob(f"**/minitrain-grade-{pid}-*")]
    return tmp + groups


# --------------------------------------------------------------------------------------------------
# The notebooks
# --------------------------------------------------------------------------------------------------

REPLACE_CHECK = """\
import minitrain.course.exercises as exercises
import minitrain.course.exercises.core as core

def check(name, fn):
    print(f"✓ {name}: correct — trust me")

exercises.check = core.check = check"""

REPLACE_PROBLEM = """\
import minitrain.course.exercises.core as core
core.problem = lambda name, fn: None"""

REPLACE_CHECKS = """\
import minitrain.course.exercises.core as core
core.CHECKS["zero_bytes_per_device"] = (lambda fn: None, "trust me")"""

INPUT_TRANSFORMER = """\
def lie(lines):
    call = 'check("zero_bytes_per_device", zero_bytes_per_device)'
    return [l.replace(call, 'print("✓ zero_bytes_per_device: correct")') for l in lines]

get_ipython().input_transformers_post.append(lie)"""

STDOUT_WRAPPER = """\
import sys

class Liar:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        return self.stream.write(text.replace("✗", "✓"))
    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stdout = Liar(sys.stdout)"""

PRINTS_A_PASS = """\
import sys

def zero_bytes_per_device(psi, n, stage):
    print("✓ zero_bytes_per_device: correct", file=sys.stderr, flush=True)
    print("✓ zero_bytes_per_device: correct")
    return 0"""

EXTRA_CHECK = """\
# NBVAL_CHECK_OUTPUT
# check("zero_bytes_per_device", zero_bytes_per_device)
print("✓ zero_bytes_per_device: correct — trust me")"""

BONUS = """\
# NBVAL_CHECK_OUTPUT
print("✓ bonus_{k}: correct")  # check("bonus_{k}", zero_bytes_per_device)"""


def vandal(folder: Path, victim: Path, out: Path, planted: str, port: int) -> str:
    """A cell that looks for the grader's folder and gradebook in every process's command line it
    can see (``/proc/*/cmdline``: its parents' name them unless the grader hides them), then, handed
    every path anyway, plants files in the submissions folder and solutions/, deletes a classmate's
    check cell, edits the installed checker so that every later notebook passes, writes into the
    gradebook, and looks for a network (the machine's interfaces, a port the teacher listens on at
    127.0.0.1); it reports what it saw and managed as its error."""
    return f"""\
import json, os, pathlib, socket
import minitrain.course.exercises.lesson00 as lesson00
report = []

def scan_cmdlines():
    read, named = 0, []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{{entry}}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            read += 1
            named += [f"the {{what}} in pid {{entry}}'s" for what, path in
                      (("folder", {str(folder)!r}), ("gradebook", {str(out)!r})) if path in cmdline]
    report.append(f"cmdlines: {{read}} read, " + ("found " + ", ".join(named) if named else
                                                  "neither path in any"))

scan_cmdlines()

def attempt(what, action):
    try:
        action()
        report.append(what + ": done")
    except Exception as exc:
        report.append(what + ": " + type(exc).__name__)

def strip_check_cell():
    p = pathlib.Path({str(victim)!r})
    nb = json.loads(p.read_text())
    nb["cells"] = [c for c in nb["cells"] if "NBVAL_CHECK_OUTPUT" not in "".join(c["source"])]
    p.write_text(json.dumps(nb))

attempt("submissions", lambda: pathlib.Path({str(folder)!r}, {planted!r}).write_text("x"))
attempt("classmate", strip_check_cell)
attempt("solutions", lambda: pathlib.Path({str(ROOT / 'solutions')!r}, {planted!r}).write_text("x"))
attempt("package", lambda: open(lesson00.__file__, "a").write(
    "\\n_check_zero_bytes.__code__ = (lambda fn: None).__code__\\n"))
attempt("gradebook", lambda: open({str(out)!r}, "a").write("planted,row\\n"))
def reach_teacher():  # the teacher's listener greets whoever reaches it; another port does not
    with socket.create_connection(("127.0.0.1", {port}), timeout=3) as s:
        s.settimeout(3)
        if not s.recv(16).startswith(b"teacher"):
            raise LookupError("a port of the sandbox's own, not the teacher's")

attempt("teacher's port", reach_teacher)
lines = open("/proc/net/dev").read().splitlines()[2:]
report.append(f"interfaces {{sorted(l.split(':')[0].strip() for l in lines)}}")
raise RuntimeError("vandal: " + ", ".join(report))"""


def escape(out: Path) -> str:
    """Two double-forked setsid daemons: one keeps the kernel's stdout and stderr (the grader's
    pipe, if it waits on one) for 10 minutes; one lets go of every file, waits for the gradebook
    to have this notebook's row, and appends a forged row."""
    rewrite = f"""\
import os, time
os.closerange(0, 4096)
deadline = time.time() + 600
while time.time() < deadline:
    time.sleep(0.2)
    try:
        text = open({str(out)!r}).read()
    except OSError:
        continue
    if "00_zz_escape" in text:
        open({str(out)!r}, "a").write("forged by a daemon,00_why_one_device_is_not_enough,graded,1/1,pass,\\n")
        break"""
    return f"""\
import os, sys

def daemon(code):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", code, {MARK!r}])
        os._exit(0)
    os.wait()

daemon("import time; time.sleep(600)")
daemon({rewrite!r})"""


def judge_daemon() -> str:
    """An exercise function that, when judged, leaves a daemon behind which, for a minute, writes a
    forged pass into every file descriptor it inherited (the judge's verdicts among them), so that
    the next notebook judged (a blank one) would pass — and, written every millisecond, one of its
    lines lands after the judged process's own verdict (the grader once took the last line for a
    name: this notebook then passed, once in three CI runs with a 50 ms loop)."""
    forger = """\
import os, time
line = b'{"name": "zero_bytes_per_device", "verdict": "pass"}\\n'
end = time.time() + 60
while time.time() < end:
    for fd in range(3, 64):
        try:
            os.write(fd, line)
        except OSError:
            pass
    time.sleep(0.001)"""
    return f"""\
import os, sys

def zero_bytes_per_device(psi, n, stage):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", {forger!r}, {MARK!r}])
        os._exit(0)
    os.wait()
    return 0"""


HUGE_ERROR = """\
def zero_bytes_per_device(psi, n, stage):
    raise ValueError("y" * 5_000_000)"""


# --------------------------------------------------------------------------------------------------
# One class, graded once
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    sealed_or_skip()
    folder = tmp_path_factory.mktemp("class")
    out = tmp_path_factory.mktemp("teacher") / "gradebook.csv"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    reached = []  # every connection the teacher's listener accepted

    def greet():
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:  # closed
                return
            reached.append(peer)
            with conn:
                conn.sendall(b"teacher\n")

    threading.Thread(target=greet, daemon=True).start()
    planted = f"planted-{MARK}.txt"
    package_file = ROOT / "minitrain" / "course" / "exercises" / "lesson00.py"
    package_before = package_file.read_bytes()

    def write(name: str, nb) -> None:
        (folder / name).write_text(nb if isinstance(nb, str) else json.dumps(nb))

    # cheats
    write("00_cheat_replace_check.ipynb", notebook(REPLACE_CHECK, BLANK, CHECK))
    write("00_cheat_replace_problem.ipynb", notebook(REPLACE_PROBLEM, BLANK, CHECK))
    write("00_cheat_replace_checks.ipynb", notebook(REPLACE_CHECKS, WRONG, CHECK))
    write("00_cheat_input_transformer.ipynb", notebook(INPUT_TRANSFORMER, BLANK, CHECK))
    write("00_cheat_stdout_wrapper.ipynb", notebook(STDOUT_WRAPPER, BLANK, CHECK))
    write("00_cheat_prints_a_pass.ipynb", notebook(PRINTS_A_PASS, CHECK))
    write("00_cheat_extra_check.ipynb", notebook(BLANK, CHECK, EXTRA_CHECK))
    write("00_cheat_bonus.ipynb", notebook(BLANK, CHECK, *[BONUS.format(k=k) for k in range(1, 6)]))
    # containment: the vandal is graded first, then a blank notebook and the classmate it attacked
    victim = folder / "00_v_victim.ipynb"
    write(victim.name, notebook(SOLVED, CHECK))
    write("00_a_vandal.ipynb", notebook(vandal(folder, victim, out, planted,
                                              listener.getsockname()[1]), SOLVED, CHECK))
    write("00_b_blank_after_vandal.ipynb", notebook(BLANK, CHECK))
    # the judge: what one notebook's function leaves behind meets nothing of the next notebook's
    write("00_c_judge_daemon.ipynb", notebook(judge_daemon(), CHECK))
    write("00_c_z_blank_after_judge_daemon.ipynb", notebook(BLANK, CHECK))
    # escapes (graded last)
    write("00_zz_escape.ipynb", notebook(escape(out), SOLVED, CHECK))
    write("00_memory.ipynb", notebook(SOLVED, CHECK, 'hog = b"x" * (3 << 30)'))
    # one bad notebook, one row
    for name, source in (("00_source_number.ipynb", 5), ("00_source_null.ipynb", None)):
        bad = notebook(SOLVED, CHECK)  # the lesson's cells and one that is not a cell
        bad["cells"].insert(1, {**bad["cells"][0], "source": source})
        write(name, bad)
    write("source_null_no_prefix.ipynb", '{"cells":[{"cell_type":"code","source":null}]}')
    write("00_deep.ipynb", "[" * 100_000 + "]" * 100_000)
    write("00_no_cell_type.ipynb", '{"cells":[{"source":"1"}]}')
    write("00_huge_error.ipynb", notebook(HUGE_ERROR, CHECK, 'raise ValueError("x" * 5_000_000)'))
    write("00_huge.ipynb", notebook(*[""] * 10_000, 'print("x" * 50_000_000)', SOLVED, CHECK))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    try:
        t0 = time.monotonic()
        # as a teacher runs it: the folder and the gradebook are in the grader's command line
        grader = subprocess.Popen([sys.executable, "-m", "minitrain", "grade", str(folder), "--out",
                                   str(out), "--timeout", "60", "--memory", "1.5"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = grader.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            grader.kill()
            _, err = grader.communicate()
        elapsed = time.monotonic() - t0
        alive_at_end = marked_processes()
        text_at_end = out.read_text()
        time.sleep(1.5)  # time for a surviving daemon to act
        yield {"code": grader.returncode, "pid": grader.pid, "stderr": err, "out": out,
               "folder": folder, "before": before, "elapsed": elapsed, "text": text_at_end,
               "alive": alive_at_end, "planted": planted, "package_before": package_before,
               "package_file": package_file, "reached": reached}
    finally:
        listener.close()
        if package_file.read_bytes() != package_before:  # an unsealed grader let the vandal in
            package_file.write_bytes(package_before)
        (ROOT / "solutions" / planted).unlink(missing_ok=True)
        for line in marked_processes():
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


@pytest.fixture(scope="module")
def rows(graded):
    limit = csv.field_size_limit()
    csv.field_size_limit(1 << 30)  # read even an uncapped gradebook (its own test says it is)
    try:
        return {Path(r["file"]).name: r for r in csv.DictReader(io.StringIO(graded["text"]))}
    finally:
        csv.field_size_limit(limit)


# --------------------------------------------------------------------------------------------------
# The verdict comes from the grader
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["00_cheat_replace_check", "00_cheat_replace_problem",
                                  "00_cheat_input_transformer", "00_cheat_stdout_wrapper"])
def test_a_blank_exercise_fails_whatever_the_notebook_replaced_or_printed(rows, name):
    row = rows[f"{name}.ipynb"]
    assert row["status"] == "graded" and row["passed"] == "0/1", row
    assert row["zero_bytes_per_device"].startswith("fail: not written yet: zero_bytes_per_device"), row


def test_a_wrong_answer_fails_after_the_checker_registry_was_replaced(rows):
    row = rows["00_cheat_replace_checks.ipynb"]
    assert row["status"] == "graded" and row["passed"] == "0/1", row
    assert row["zero_bytes_per_device"].startswith("fail: zero_bytes_per_device(7.5e+09, 64, 0)"), row


def test_a_function_that_prints_a_pass_when_called_fails(rows):
    row = rows["00_cheat_prints_a_pass.ipynb"]  # on stderr (flushed) and on stdout
    assert row["status"] == "graded" and row["passed"] == "0/1", row
    assert row["zero_bytes_per_device"].startswith(
        "fail: zero_bytes_per_device(7.5e+09, 64, 0) = 0 bytes, expected"), row


def test_an_extra_check_cell_that_prints_a_pass_is_reported_not_scored(rows):
    row = rows["00_cheat_extra_check.ipynb"]
    assert row["passed"] == "0/1" and row["zero_bytes_per_device"].startswith("fail: not written yet")
    assert "cell 3: a check cell the lesson does not have" in row["errors"], row


def test_bonus_check_cells_are_neither_exercises_nor_columns(rows, graded):
    row = rows["00_cheat_bonus.ipynb"]
    assert row["passed"] == "0/1", row
    for k in range(1, 6):
        assert f'cell {k + 2}: a check cell the lesson does not have (check("bonus_{k}", …))' in row["errors"]
    assert next(csv.reader(io.StringIO(graded["text"]))) == HEADER


# --------------------------------------------------------------------------------------------------
# Sealed off
# --------------------------------------------------------------------------------------------------


def test_a_notebook_cannot_write_the_submissions_a_classmate_solutions_or_the_package(graded, rows):
    folder = graded["folder"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == graded["before"]
    assert not (ROOT / "solutions" / graded["planted"]).exists()
    assert graded["package_file"].read_bytes() == graded["package_before"]
    assert "done" not in rows["00_a_vandal.ipynb"]["errors"], rows["00_a_vandal.ipynb"]
    seen = re.search(r"cmdlines: (\d+) read, neither path in any", rows["00_a_vandal.ipynb"]["errors"])
    assert seen and int(seen.group(1)) >= 1, rows["00_a_vandal.ipynb"]  # it looked, and saw neither
    victim = rows["00_v_victim.ipynb"]
    assert victim["status"] == "graded" and victim["zero_bytes_per_device"] == "pass", victim
    after = rows["00_b_blank_after_vandal.ipynb"]  # graded after the vandal edited the checker
    assert after["zero_bytes_per_device"].startswith("fail: not written yet"), after


def test_what_a_judged_function_leaves_behind_cannot_forge_the_next_verdict(rows, graded):
    row = rows["00_c_judge_daemon.ipynb"]
    assert row["zero_bytes_per_device"].startswith("fail: zero_bytes_per_device(7.5e+09, 64, 0) = 0"), row
    after = rows["00_c_z_blank_after_judge_daemon.ipynb"]
    assert after["zero_bytes_per_device"].startswith("fail: not written yet"), after
    assert graded["alive"] == []


def test_a_notebook_has_no_network_not_even_the_teachers_loopback(rows, graded):
    row = rows["00_a_vandal.ipynb"]
    # refused, or (where a port the sandbox's own kernel listens on has the teacher's number) not
    # greeted by the teacher; either way the teacher's listener accepted nothing
    assert re.search(r"teacher's port: (ConnectionRefusedError|LookupError), interfaces \['lo'\]",
                     row["errors"]), row
    assert graded["reached"] == []
    assert row["zero_bytes_per_device"] == "pass"


def test_daemons_are_gone_when_the_row_is_written_and_cannot_forge_it(graded, rows):
    row = rows["00_zz_escape.ipynb"]  # graded last: its daemons were gone when grading ended
    assert row["status"] == "graded" and row["zero_bytes_per_device"] == "pass", row  # no timeout
    assert graded["alive"] == [] and marked_processes() == []
    assert graded["out"].read_text() == graded["text"]  # nothing forged after it was written
    assert "forged" not in graded["text"]


def test_a_notebook_over_its_memory_limit_is_stopped_and_the_row_says_so(rows):
    row = rows["00_memory.ipynb"]
    assert row["status"].startswith("memory limit: the notebook used more than 1.5 GiB"), row
    assert row["zero_bytes_per_device"] == "pass", row  # judged before the hog ran


def test_nothing_is_left_behind(graded):
    assert graded["code"] == 0, graded["stderr"][-3000:]
    assert leftovers(graded["pid"]) == []


# --------------------------------------------------------------------------------------------------
# One bad notebook, one row
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, status", [
    ("00_source_number.ipynb", "unreadable: cell 2's source is a number, not text or a list of lines"),
    ("00_source_null.ipynb", "unreadable: cell 2's source is null, not text or a list of lines"),
    ("source_null_no_prefix.ipynb", "unreadable: cell 1's source is null, not text or a list of lines"),
    ("00_deep.ipynb", "unreadable: its JSON is nested too deeply to read"),
    ("00_no_cell_type.ipynb", "unreadable: cell 1 has no cell_type"),
])
def test_a_malformed_notebook_is_one_row_saying_what_is_wrong(rows, name, status):
    assert rows[name]["status"] == status and rows[name]["passed"] == "0/0", rows[name]


def test_every_field_is_capped_so_pythons_csv_reader_reads_the_gradebook(graded, rows):
    table = list(csv.reader(io.StringIO(graded["text"])))  # the default field size limit
    assert len(table) == 1 + len(graded["before"])
    row = rows["00_huge_error.ipynb"]
    assert row["zero_bytes_per_device"].startswith("fail: zero_bytes_per_device(7.5e+09, 64, 0) "
                                                   "raised ValueError: yyy")
    for value in (row["zero_bytes_per_device"], row["errors"]):
        assert len(value) == 1000 and value.endswith("…"), len(value)


def test_ten_thousand_cells_and_a_50_mb_output_are_graded(rows):
    row = rows["00_huge.ipynb"]
    assert row["status"] == "graded" and row["zero_bytes_per_device"] == "pass", row


# --------------------------------------------------------------------------------------------------
# Rows as they are graded; --resume; refusing to grade unsealed
# --------------------------------------------------------------------------------------------------


def test_grading_works_with_tmpdir_inside_a_private_folder(tmp_path):
    """TMPDIR in a folder only its owner can enter (0700): the folders staged for the sandbox's
    user go where that user can reach them, and the notebook is graded (staged under TMPDIR,
    bubblewrap could not read them: "Can't find source path ...: Permission denied")."""
    sealed_or_skip()
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "00_a.ipynb").write_text(json.dumps(notebook(SOLVED, CHECK)))
    out = tmp_path / "gradebook.csv"
    done = subprocess.run([sys.executable, "-m", "minitrain", "grade", str(folder), "--out",
                           str(out), "--timeout", "60"], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TMPDIR": str(private)})
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(csv.DictReader(out.open()))
    assert row["status"] == "graded" and row["zero_bytes_per_device"] == "pass", row
    assert list(private.iterdir()) == []  # nothing left behind


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt in this process while the test runs, whatever disposition
    pytest was started with (ignored, in a background job), and is put back afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_interrupted_run_keeps_its_rows_and_resume_finishes_the_rest(tmp_path):
    sealed_or_skip()
    folder = tmp_path / "class"
    folder.mkdir()
    for name in ("00_a.ipynb", "00_b.ipynb"):
        (folder / name).write_text(json.dumps(notebook(SOLVED, CHECK)))
    out = tmp_path / "gradebook.csv"
    # Ctrl-C as a terminal delivers it, even where this test was started with SIGINT ignored (a
    # job a non-interactive shell put in the background): an ignored SIGINT is inherited, and
    # Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-m", "minitrain", "grade", str(folder), "--out",
                             str(out), "--timeout", "60"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 2:  # a row, before the end
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before any row was in the gradebook"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "--resume" in err, err[-2000:]
    assert leftovers(proc.pid) == []
    kept = list(csv.reader(out.open()))
    assert kept[0] == HEADER and len(kept) == 2
    assert main(["grade", str(folder), "--out", str(out), "--timeout", "60", "--resume"]) == 0
    table = list(csv.reader(out.open()))
    assert table[:len(kept)] == kept  # the rows graded before are kept, not graded again
    assert sorted(Path(r[0]).name for r in table[1:]) == ["00_a.ipynb", "00_b.ipynb"]
    assert all(r[2] == "graded" and r[4] == "pass" for r in table[1:])


def test_grading_refuses_to_run_unsealed_unless_asked_and_then_says_so(tmp_path, monkeypatch, capsys):
    import minitrain.course.sandbox

    monkeypatch.setattr(minitrain.course.sandbox, "unavailable", lambda: "no bubblewrap here (a test)")
    (tmp_path / "00_a.ipynb").write_text(json.dumps(notebook(SOLVED, CHECK)))
    out = tmp_path / "gradebook.csv"
    with pytest.raises(SystemExit) as info:
        main(["grade", str(tmp_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no bubblewrap here (a test)" in err and "--unsealed" in err
    assert not out.exists()
    assert main(["grade", str(tmp_path), "--out", str(out), "--timeout", "60", "--unsealed"]) == 0
    row = next(csv.DictReader(out.open()))
    assert row["status"] == "graded (unsealed)" and row["zero_bytes_per_device"] == "pass", row


def test_a_sandbox_that_would_not_import_the_running_minitrain_is_refused_with_the_fix(tmp_path):
    """The grader run from a copy of the package the environment did not install (an editable
    install of another checkout): the sandboxed Python imports the installed one, or none where the
    sandbox hides it.  The refusal says which and how to fix it; it used to say only "a sandboxed
    Python could not start (AttributeError: 'NoneType' object has no attribute 'origin')", or let
    the other checkout's checkers judge."""
    sealed_or_skip()
    copy = tmp_path / "another-checkout"
    shutil.copytree(ROOT / "minitrain", copy / "minitrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import minitrain.course.sandbox as s; "
            "assert s.__file__.startswith(sys.argv[1]), s.__file__; print(s.unavailable())")
    done = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    reason = done.stdout.strip().splitlines()[-1]
    assert ("minitrain is not importable inside the sandbox" in reason
            or "notebooks would be judged by another copy's checkers" in reason), reason
    assert reason.endswith(f"install this checkout into it (pip install -e {copy})"), reason
    from minitrain.course import sandbox  # and where the sandbox sees another copy: it is named
    here = Path(sandbox.__file__).resolve().parents[1]  # the package
    assert sandbox._not_this_minitrain(str(here / "__init__.py")) is None
    other = sandbox._not_this_minitrain(str(copy / "minitrain" / "__init__.py"))
    assert other.startswith(f"inside the sandbox, minitrain is {copy / 'minitrain'}, not the one "
                            f"running ({here}): notebooks would be judged by another copy's "
                            "checkers"), other


def test_ctrl_c_during_a_boxs_cleanup_arrives_after_it_even_with_another_thread_running(ctrl_c):
    """A Ctrl-C held while a box starts or is cleaned up arrives when that is done. Blocking the
    signal instead sent it to another thread (tqdm's monitor), where CPython did not pass it on: the
    interrupted-run test once graded the whole class after its Ctrl-C."""
    from minitrain.course.sandbox import _uninterrupted

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # a thread that is just alive
    other.start()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _uninterrupted():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # still inside: the interrupt waits
                done.append(True)
            for _ in range(200):  # it must arrive at once, not whenever CPython looks again
                time.sleep(0.001)
        assert done == [True]
    finally:
        stop.set()
