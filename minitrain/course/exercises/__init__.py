"""Exercise checkers for the lessons (one module per lesson), and the tool that writes the learners'
notebooks from the solutions (:mod:`.build`).

How an exercise works (lessons 00–09, and the debugging lab 01b in :mod:`.lab`):

* the learner writes a function in an exercise cell;
* the next cell, marked ``# NBVAL_CHECK_OUTPUT``, calls ``check("name", their_function)``, which runs
  the checker and prints one fixed line: the pass verdict, or a line starting with ``✗`` that says
  what is wrong (it never raises, so "Run All" goes on through the rest of the lesson, which uses the
  package's own implementation);
* a check first tests the function alone, then runs the real strategy with it in its seam
  (:func:`.inside.inside`): losses against one process, bytes per rank from the tracer and memory
  from the ledger beside the lesson's formulas, step time against the package's own code; the cell
  after the check shows that run (``report("name")``);
* a function that passes is kept in ``my_minitrain/`` beside the notebook (``$MINITRAIN_MINE``
  overrides; :mod:`.kept`): lesson 08 trains the 3D mesh with every piece the learner wrote
  (:func:`.inside.your_minitrain`) and says which fell back to the package's;
* what protects a run from a learner's function (a ring that returns nothing, a collective into a
  freed buffer, an all-reduce never waited for) wraps the function before it goes into its seam
  (:mod:`.guards`): the techniques call every function in a seam alike;
* ``pytest --nbval-lax`` compares that cell's output with the pass verdict: a blank or wrong
  exercise fails there, a correct one passes.  The verdict is never stored in a notebook (a learner
  would read the answer before running anything): the check cell stores only "not checked yet"
  (:func:`.core.pending`), and minitrain's pytest plugin (:mod:`minitrain_nbval`, loaded by pytest
  wherever minitrain is installed) gives nbval :func:`.core.verdict` as the expected output.

One source of truth: the teacher's notebooks in ``solutions/`` hold the answers between
``# BEGIN SOLUTION`` and ``# END SOLUTION`` lines.  ``python -m minitrain.course.exercises build`` writes
``lessons/`` from them, replacing each answer by a placeholder, stripping outputs (no widget state,
no images) and storing "not checked yet" as the check cells' output.  ``--check`` only
verifies that ``lessons/`` is up to date (a test runs it).
"""

from . import (lab, lesson00, lesson01, lesson02, lesson03, lesson04, lesson05, lesson06, lesson07,
               lesson08, lesson09)
from .build import build_exercise, main, normalise
from .inside import (Row, Run, inside, predicted, rank_trouble, report, sent_per_rank,
                     your_minitrain)
from .kept import keep, mine, mine_dir
from .core import (BEGIN, CHECK_MARK, CHECKS, END, PLACEHOLDER, blank, check, exercise, problem,
                   pending, raised, ranks, release, verdict)

__all__ = ["check", "problem", "verdict", "pending", "CHECKS", "build_exercise", "normalise", "main",
           "exercise", "ranks", "release", "blank", "raised", "PLACEHOLDER", "CHECK_MARK",
           "BEGIN", "END", "inside", "report", "Row", "Run", "keep", "mine", "mine_dir",
           "your_minitrain", "predicted", "rank_trouble", "sent_per_rank"]

#: the lessons whose import registers their exercises in CHECKS
LESSONS = (lesson00, lesson01, lab, lesson02, lesson03, lesson04, lesson05, lesson06, lesson07,
           lesson08, lesson09)
