"""Each lesson's exercise answers for tests/test_exercise_answers.py: per exercise, the solution (must
pass, inside the real strategy) and typical wrong answers, each with a fragment of the message the
check must give.  A module defines ``ANSWERS = {name: Answers(solution, [(wrong_fn, fragment), ...])}``."""

from dataclasses import dataclass, field


@dataclass
class Answers:
    solution: object
    wrong: list = field(default_factory=list)  # (function, fragment of the expected message)
    blank: object = None  # the exercise's blank (a function holding the placeholder line)
