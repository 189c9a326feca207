"""Every exercise: its blank says "not written yet", its solution passes inside the real strategy,
and each typical wrong answer fails with its own message (within 15 s, clusters already running)."""

import importlib
import pkgutil
import time

import pytest

from minitrain.course.exercises import CHECKS, problem

import answers

def _name(fn) -> str:
    """A function's name; for an exercise of several functions (a tuple), theirs joined by +."""
    return "+".join(f.__name__ for f in fn) if isinstance(fn, tuple) else fn.__name__


CASES, SOLUTIONS, NAMES = [], [], set()
for info in pkgutil.iter_modules(answers.__path__):
    module = importlib.import_module(f"{answers.__name__}.{info.name}")
    for name, a in module.ANSWERS.items():
        NAMES.add(name)
        SOLUTIONS.append(pytest.param(name, a.solution, id=f"{name}-solution"))
        for i, (fn, fragment) in enumerate(a.wrong):
            CASES.append(pytest.param(name, fn, fragment, id=f"{name}-wrong{i}-{_name(fn)}"))


def test_every_exercise_has_three_wrong_answers():
    missing = sorted(set(CHECKS) - NAMES)
    assert not missing, f"exercises without answers in tests/answers/: {missing}"
    for info in pkgutil.iter_modules(answers.__path__):
        module = importlib.import_module(f"{answers.__name__}.{info.name}")
        for name, a in module.ANSWERS.items():
            assert len(a.wrong) >= 3, f"{name}: {len(a.wrong)} wrong answers, want at least 3"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_a_blank_exercise_is_not_written_yet(name):
    def blank(*args):
        ...  # YOUR CODE HERE
    assert problem(name, blank).startswith("not written yet")


@pytest.mark.parametrize("name, fn", SOLUTIONS)
def test_the_solution_passes(name, fn):
    assert problem(name, fn) is None


@pytest.mark.parametrize("name, fn, fragment", CASES)
def test_a_wrong_answer_gets_its_message(name, fn, fragment):
    start = time.perf_counter()
    found = problem(name, fn)
    took = time.perf_counter() - start
    assert found is not None, f"{_name(fn)} passed the check of {name}"
    assert fragment in found, f"{_name(fn)}: {found!r} does not say {fragment!r}"
    assert took < 15, f"{_name(fn)}: the check took {took:.1f} s (at most 15 s)"


def test_a_verdict_does_not_depend_on_the_checks_before_it():
    """A lab answer that makes its own group (dist.new_group inside the function) is told so after
    other checks have run in this process — its exercise's solution, a deadlock that leaves the
    next check fresh ranks, its exercise's other wrong answers — and again when checked a second
    time."""
    from answers import lab

    before = [("lab_wrong_group", lab.ANSWERS["lab_wrong_group"].solution, True)]
    before += [("lab_send_send", fn, False) for fn, _ in lab.ANSWERS["lab_send_send"].wrong]
    before += [("lab_wrong_group", fn, False) for fn, _ in lab.ANSWERS["lab_wrong_group"].wrong
               if fn is not lab.tp_sum_new_group]
    for name, fn, right in before:
        assert (problem(name, fn) is None) == right, f"{name}: {_name(fn)}"
    for attempt in ("after the other lab checks", "checked again"):
        found = problem("lab_wrong_group", lab.tp_sum_new_group)
        assert found is not None, f"tp_sum_new_group passed, {attempt}"
        assert lab.NEW_GROUP_SAYS in found, f"{attempt}: {found!r}"
