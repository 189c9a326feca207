"""The exercise workflow: checkers that can fail, and lessons/ generated from solutions/."""

import json
from pathlib import Path

import pytest

from minitrain.course import exercises
from minitrain.course.exercises import (PLACEHOLDER, build_exercise, check, normalise, pending, problem,
                                 verdict)

ROOT = Path(__file__).resolve().parents[1]


def test_lessons_are_generated_from_the_solutions_and_up_to_date(capsys):
    assert exercises.main(["build", "--check"]) == 0, "run: python -m minitrain.course.exercises build"
    stale = ROOT / "solutions" / "00_why_one_device_is_not_enough.ipynb"
    text = stale.read_text()
    try:  # the check must be able to fail: a solution edited without a build is caught
        stale.write_text(text.replace("Lesson 00", "Lesson 00 (edited)", 1))
        assert exercises.main(["build", "--check"]) == 1
        assert "out of date" in capsys.readouterr().out
    finally:
        stale.write_text(text)
    names = sorted(p.name for p in (ROOT / "solutions").glob("[0-9]*.ipynb"))
    assert names == sorted(p.name for p in (ROOT / "lessons").glob("[0-9]*.ipynb"))
    assert len(names) >= 2


def test_no_answer_reaches_the_learners_notebooks():
    for path in (ROOT / "lessons").glob("[0-9]*.ipynb"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text and "# BEGIN GIVEN" not in text
        assert PLACEHOLDER in text, f"{path.name} has no exercise"


def test_no_verdict_and_no_answer_before_running():
    """A learner opening a lesson sees no ✓, no ✗ and no part of an answer under any cell: a check
    cell stores only "not checked yet" (nbval gets the verdict from minitrain_nbval)."""
    from minitrain.course.exercises import CHECKS, pending
    from minitrain.course.exercises.build import _check_name

    answers = {name: passes for name, (_, passes) in CHECKS.items()}
    for folder in ("lessons", "solutions"):
        for path in (ROOT / folder).glob("[0-9]*.ipynb"):
            nb = json.loads(path.read_text())
            assert "widgets" not in nb["metadata"]
            checked = 0
            for cell in nb["cells"]:
                if cell["cell_type"] != "code":
                    continue
                stored = "".join("".join(o.get("text", "")) for o in cell["outputs"])
                stored += "".join(json.dumps(o["data"], ensure_ascii=False)
                                  for o in cell["outputs"] if "data" in o)
                assert "✓" not in stored and "✗" not in stored, (path.name, stored)
                assert "correct" not in stored, (path.name, stored)
                for name, passes in answers.items():
                    assert passes not in stored, (path.name, name)
                name = _check_name("".join(cell["source"]))
                if name is None:
                    assert cell["outputs"] == [], (path.name, cell["source"][:80])
                else:
                    assert stored == pending(name) + "\n"
                    checked += 1
            assert checked, f"{path.name}: no check cell"
            text = path.read_text()
            for name in answers:  # nor anywhere else in the file: the pass line is never stored
                assert f"✓ {name}" not in text, (path.name, name)
            assert path.stat().st_size < 60_000


def test_a_blank_prediction_prints_nothing_and_asks_for_the_prediction():
    """A prediction cell keeps its target (``my_prediction = ...``): a bare ``...`` at a cell's top
    level would print ``Ellipsis``; predicted() given the ``...`` asks for the prediction."""
    from minitrain.course.exercises import predicted

    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
            "source": "my_prediction = None  # bytes\n# BEGIN SOLUTION\nmy_prediction = 3 * 4\n"
                      "# END SOLUTION"}
    nb = build_exercise({"metadata": {}, "cells": [cell]})
    assert nb["cells"][0]["source"] == f"my_prediction = None  # bytes\nmy_prediction = {PLACEHOLDER}"
    lessons = [json.loads(p.read_text()) for p in (ROOT / "lessons").glob("[0-9]*.ipynb")]
    sources = ["".join(c["source"]) for nb in lessons for c in nb["cells"] if c["cell_type"] == "code"]
    tops = [s for s in sources if any(line.startswith(PLACEHOLDER) for line in s.splitlines())]
    assert tops == [], "a bare ... at a cell's top level prints Ellipsis"
    for blank in (None, ...):
        shown = str(predicted("bytes", blank, "4Ψ", 8.0, 8.0))
        assert "write your prediction first" in shown and "Ellipsis" not in shown
    with pytest.raises(TypeError, match="as a number"):
        predicted("bytes", "12", "4Ψ", 8.0, 8.0)


def test_build_replaces_the_answer_and_keeps_the_rest():
    solution = {"metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 4, "cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": 3, "outputs": [{"output_type": "stream", "name": "stdout", "text": "x"}],
         "source": "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION\n"},
        {"cell_type": "code", "metadata": {}, "execution_count": 4, "outputs": [],
         "source": '# NBVAL_CHECK_OUTPUT\ncheck("ring_all_reduce", f)'},
    ]}
    nb = build_exercise(solution)
    assert nb["cells"][0]["source"] == f"def f(x):\n    y = 1\n    {PLACEHOLDER}"
    assert nb["cells"][0]["outputs"] == [] and "widgets" not in nb["metadata"]
    assert nb["cells"][1]["outputs"][0]["text"] == [pending("ring_all_reduce") + "\n"]
    assert normalise(solution)["cells"][0]["source"] == solution["cells"][0]["source"]


def test_a_given_block_is_what_the_learner_starts_from():
    """The debugging lab: the learner gets the broken program (a GIVEN block, commented out in the
    teacher's notebook) where the fixed one was, not the placeholder."""
    source = ("def f(x):\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n"
              "    # BEGIN GIVEN\n    # if x:\n    #     return x\n    #\n    # END GIVEN\n")
    nb = {"metadata": {}, "cells": [{"cell_type": "code", "metadata": {}, "outputs": [],
                                     "source": source}]}
    assert build_exercise(nb)["cells"][0]["source"] == "def f(x):\n    if x:\n        return x"
    for bad, message in [("    # BEGIN GIVEN\n    # x\n    # END GIVEN\n", "must follow"),
                         (source.replace("    # if x:", "    if x:"), "is not a comment"),
                         (source.replace("    # END GIVEN\n", ""), "without '# END GIVEN'")]:
        nb["cells"][0]["source"] = bad
        with pytest.raises(ValueError, match=message):
            build_exercise(nb)


@pytest.mark.parametrize("source, message", [
    ("# BEGIN SOLUTION\nx = 1\n", "without '# END SOLUTION'"),
    ("x = 1\n# END SOLUTION\n", "without '# BEGIN SOLUTION'"),
])
def test_broken_markers_are_refused(source, message):
    nb = {"metadata": {}, "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": source}]}
    with pytest.raises(ValueError, match=message):
        build_exercise(nb)


def zero_right(psi, n, stage):
    return 2 * psi / (n if stage >= 3 else 1) + 2 * psi / (n if stage >= 2 else 1) + 12 * psi / (n if stage >= 1 else 1)


def test_a_passing_check_prints_only_its_verdict(capsys):
    # the checker's wrong answers live in tests/answers/lesson00.py
    check("zero_bytes_per_device", zero_right)
    assert capsys.readouterr().out == verdict("zero_bytes_per_device") + "\n"
    # what a check prints (and nbval's diff shows a student who has not passed) names what was
    # checked, never the answer: none of the formulas
    for formula in ("4Ψ", "12Ψ", "14Ψ", "16Ψ", "/N"):
        assert formula not in verdict("zero_bytes_per_device")


def test_other_right_answers_pass_too():
    """A correct but slow ring (every rank sends its whole tensor to every other) passes, and the
    report says it sent more than the ring; the float16 norm fixed by scaling instead of float32
    passes too; DDP's hooks whose end of backward lets each handle go after waiting pass too."""
    from answers import lab, lesson01, lesson02
    from minitrain.course.exercises import report

    for module in (lesson02, lesson01, lab):
        for name, fns in module.ALSO_RIGHT.items():
            for fn in fns:
                assert problem(name, fn) is None, getattr(fn, "__name__", fn)
    bytes_row = report("ring_all_reduce").rows[0]
    assert bytes_row.measured > 1.4 * bytes_row.expected  # (N-1)·Ψ·4 against 2(N-1)/N·4Ψ at N = 3


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="ring_all_reduce"):
        check("nope", print)


def test_a_blank_exercise_says_not_written_yet_and_an_error_names_the_learners_line():
    from minitrain.course.exercises import CHECKS

    def blank_bytes(psi, n, stage):
        ...  # YOUR CODE HERE

    for name in CHECKS:  # every exercise, before its checker runs anything
        assert problem(name, blank_bytes).startswith("not written yet: blank_bytes still has")

    def broken_bytes(psi, n, stage):
        per_param = {0: 16}
        return psi * per_param[stage]

    message = problem("zero_bytes_per_device", broken_bytes)
    assert "raised KeyError: 1" in message and "line 3 of your broken_bytes: return psi * per_param[stage]" in message


def test_a_blank_autograd_function_from_a_notebook_cell_is_not_written_yet():
    """A class defined in a notebook cell has no source file (inspect.getsource fails on it), but
    its methods' source is known: the blank is found in them."""
    import linecache

    source = ("import torch\n\nclass MyLinear(torch.autograd.Function):\n    @staticmethod\n"
              "    def forward(ctx, x, weight, bias, comm):\n        ...  # YOUR CODE HERE\n")
    cell = "<ipython-input-7-0123456789ab>"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    scope: dict = {}
    exec(compile(source, cell, "exec"), scope)
    assert problem("row_parallel_linear", scope["MyLinear"]).startswith("not written yet: MyLinear")
