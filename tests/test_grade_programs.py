"""The programs ``minitrain grade`` runs in its sandboxes, tried part by part in this process,
without a sandbox: the runner (:mod:`minitrain.course.runner`), what it has the kernel run
(:mod:`minitrain.course.take`), the judge (:mod:`minitrain.course.judge`) and the sandbox's probe
(:mod:`minitrain.course.probe`).  tests/test_grade.py and tests/test_grade_attacks.py run them
sealed off."""

import ast
import base64
import ctypes
import json
import os
import sys
import threading
from pathlib import Path

import cloudpickle
import nbformat
import pytest

import minitrain
from minitrain.course import judge, probe, runner, sandbox, take
from minitrain.runtime import shipping

PR_GET_DUMPABLE = 3  # prctl(2)


def square(x):
    return x * x


# --------------------------------------------------------------------------------------------------
# Run by path
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [judge, runner, probe])
def test_a_program_run_by_path_imports_the_package_by_its_name(module):
    """``python -I FILE`` runs a file as no package's module: a relative import there fails (the
    judge would report that the checkers did not load, for every notebook)."""
    tree = ast.parse(Path(module.__file__).read_text())
    relative = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == [], f"{module.__name__}: relative imports at lines {relative}"
    assert "if __name__ == \"__main__\":\n    main(sys.argv)" in Path(module.__file__).read_text()


# --------------------------------------------------------------------------------------------------
# take: in the kernel
# --------------------------------------------------------------------------------------------------


def test_take_writes_the_function_pickled_or_why_it_could_not(tmp_path):
    take.take(str(tmp_path / "0"), lambda: square)
    assert sorted(os.listdir(tmp_path)) == ["0"]  # the whole file, no part left
    assert shipping.loads((tmp_path / "0").read_bytes())(3) == 9

    take.take(str(tmp_path / "1"), lambda: not_defined_anywhere)  # noqa: F821
    assert (tmp_path / "1.problem").read_text() == ("NameError: name 'not_defined_anywhere' is "
                                                   "not defined")
    take.take(str(tmp_path / "2"), lambda: (square, threading.Lock()))
    problem = (tmp_path / "2.problem").read_text()
    assert problem.startswith("it could not be taken out of the notebook to be judged: "
                              "TypeError:"), problem
    assert not (tmp_path / "2").exists()

    take.take(str(tmp_path / "3"), lambda: (_ for _ in ()).throw(ValueError("x" * 10_000)))
    assert len((tmp_path / "3.problem").read_text()) == take.PROBLEM_CAP


def test_a_students_own_module_goes_by_value_the_package_by_reference(tmp_path, monkeypatch):
    (tmp_path / "my_helpers_for_take.py").write_text("def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_helpers_for_take

    data = take.dumps(my_helpers_for_take.answer)
    assert "my_helpers_for_take" not in cloudpickle.list_registry_pickle_by_value()
    monkeypatch.delitem(sys.modules, "my_helpers_for_take")
    (tmp_path / "my_helpers_for_take.py").unlink()  # the judge has no such module
    assert shipping.loads(data)() == 42
    assert shipping.loads(take.dumps([shipping.dumps, square]))[0] is shipping.dumps


# --------------------------------------------------------------------------------------------------
# runner
# --------------------------------------------------------------------------------------------------


def test_the_code_the_kernel_runs_takes_out_the_checked_expression(tmp_path):
    path = str(tmp_path / "4")
    exec(runner.take_code(path, "fns['sq']"), {"fns": {"sq": square}})
    assert shipping.loads(Path(path).read_bytes())(5) == 25
    exec(runner.take_code(path + "b", "square,\n  square"), {"square": square})
    assert [f(2) for f in shipping.loads(Path(path + "b").read_bytes())] == [4, 4]


def test_taken_gives_the_function_its_problem_or_that_none_came(tmp_path):
    (tmp_path / "0").write_bytes(b"pickled")
    assert runner.taken(str(tmp_path / "0"), 1 << 20) == {"data": base64.b64encode(b"pickled")
                                                          .decode()}
    (tmp_path / "1").write_bytes(b"x" * ((1 << 20) + 1))
    assert runner.taken(str(tmp_path / "1"), 1 << 20) == {
        "problem": "your function, with what it uses, is more than 1 MB pickled; the grader "
                   "takes less"}
    (tmp_path / "2.problem").write_text("NameError: name 'f' is not defined")
    assert runner.taken(str(tmp_path / "2"), 1 << 20) == {
        "problem": "NameError: name 'f' is not defined"}
    assert runner.taken(str(tmp_path / "3"), 1 << 20) == {"problem": runner.NO_FUNCTION}
    assert runner.taken(str(tmp_path / "3"), 1 << 20, "ModuleNotFoundError: minitrain") == {
        "problem": f"{runner.NO_FUNCTION} (ModuleNotFoundError: minitrain)"}


def test_a_cells_error_is_its_error_output():
    cell = nbformat.v4.new_code_cell("1 / 0")
    assert runner.error(cell) is None
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n"),
                    nbformat.v4.new_output("error", ename="ZeroDivisionError",
                                           evalue="division by zero", traceback=[])]
    assert runner.error(cell)["ename"] == "ZeroDivisionError"


# --------------------------------------------------------------------------------------------------
# judge
# --------------------------------------------------------------------------------------------------


def _lines(read: int) -> list:
    """The JSON lines in a pipe whose writer is closed."""
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


def test_a_line_too_big_for_a_pipe_arrives_whole_and_a_line_cut_short_is_none():
    read, write = os.pipe()
    item = {"name": "zero_bytes_per_device", "verdict": "fail: " + "y" * 300_000}
    writer = threading.Thread(target=lambda: (judge.emit(write, item), os.close(write)))
    writer.start()
    try:
        assert json.loads(judge.read_line(read)) == item
        assert judge.read_line(read) is None
    finally:
        writer.join()
        os.close(read)
    read, write = os.pipe()
    os.write(write, b'[["zero_bytes_per_device", {"data": "')
    os.close(write)
    assert judge.read_line(read) is None
    os.close(read)


def test_judging_gives_a_verdict_each_and_the_bits_of_the_passes():
    def problem(name, fn):
        if name == "raises":
            raise ValueError("boom")
        return None if fn(2) == 4 else f"{name}: fn(2) is {fn(2)}, not 4"

    good = {"data": base64.b64encode(shipping.dumps(square)).decode()}
    todo = [("wrong", {"data": base64.b64encode(shipping.dumps(abs)).decode()}),
            ("right", good),
            ("none", {"problem": "no function reached the grader"}),
            ("garbage", {"data": base64.b64encode(b"not a pickle").decode()}),
            ("raises", good),
            ("long", {"problem": "z" * 10_000})]
    read, write = os.pipe()
    try:
        assert judge.judge_all(todo, problem, shipping.loads, write) == 0b10
        os.close(write)
        said = {i["name"]: i["verdict"] for i in _lines(read)}
    finally:
        os.close(read)
    assert said["wrong"] == "fail: wrong: fn(2) is 2, not 4"
    assert said["right"] == "pass"
    assert said["none"] == "fail: no function reached the grader"
    assert said["garbage"].startswith("fail: your function could not be loaded to be judged: "
                                      "UnpicklingError"), said["garbage"]
    assert said["raises"] == "fail: the checker raised ValueError: boom"
    assert len(said["long"]) == judge.VERDICT_CAP


def test_the_passes_fit_an_exit_status_and_no_more_are_counted():
    assert judge.PASSED + (1 << judge.JUDGED_AT_ONCE) - 1 < 128  # below what a signal reads as
    assert judge.NO_MORE < judge.PASSED
    read, write = os.pipe()
    try:
        todo = [(f"e{i}", {"data": base64.b64encode(shipping.dumps(square)).decode()})
                for i in range(judge.JUDGED_AT_ONCE + 2)]
        passed = judge.judge_all(todo, lambda name, fn: None, shipping.loads, write)
        os.close(write)
        assert passed == (1 << judge.JUDGED_AT_ONCE) - 1
        assert [i["verdict"] for i in _lines(read)] == ["pass"] * len(todo)
    finally:
        os.close(read)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_set_dumpable_is_what_the_kernel_then_reports():
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        judge.set_dumpable(libc, False)
        assert libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0
    finally:
        judge.set_dumpable(libc, True)
    assert libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1


def test_emptying_a_folder_removes_links_never_what_they_point_to(tmp_path):
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "kept.txt").write_text("kept")
    box = tmp_path / "box"
    (box / "folder" / "sub").mkdir(parents=True)
    (box / "folder" / "sub" / "file").write_text("x")
    (box / "file").write_text("x")
    (box / "link_to_folder").symlink_to(outside)
    (box / "link_to_file").symlink_to(outside / "deep" / "kept.txt")
    (box / "dangling").symlink_to(tmp_path / "nowhere")
    judge.empty(str(box))
    assert os.listdir(box) == []
    assert (outside / "deep" / "kept.txt").read_text() == "kept"


# --------------------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------------------


def test_the_probe_names_the_minitrain_it_imports(capsys):
    here = os.path.realpath(minitrain.__file__)
    probe.main(["probe.py"])
    assert capsys.readouterr().out == probe.MARK + here + "\n"
    assert sandbox._not_this_minitrain(here) is None
    probe.main(["probe.py", "--installed"])
    assert capsys.readouterr().out == os.path.dirname(here) + "\n"


def test_the_probe_without_a_minitrain_says_so(monkeypatch, capsys):
    monkeypatch.setattr(probe, "origin", lambda name="minitrain": None)
    with pytest.raises(SystemExit) as info:
        probe.main(["probe.py"])
    assert info.value.code == probe.MARK + probe.NONE
    probe.main(["probe.py", "--installed"])
    assert capsys.readouterr().out == "\n"
    assert sandbox._not_this_minitrain(probe.NONE).startswith(
        "minitrain is not importable inside the sandbox")


def test_the_probe_fails_where_the_checkers_cannot_be_read(monkeypatch, tmp_path):
    package = tmp_path / "minitrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "minitrain")
    assert probe.origin() == str((package / "__init__.py").resolve())
    with pytest.raises(FileNotFoundError, match="exercises"):  # a checkout without its checkers
        probe.read(names=("minitrain",))
