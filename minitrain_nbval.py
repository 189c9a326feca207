"""minitrain's pytest plugin: what nbval expects from a lesson's check cells.

A check cell (``# NBVAL_CHECK_OUTPUT`` then ``check("name", fn)``) prints one line: ``✓ name:
correct — …`` when ``fn`` is right, ``✗ name: …`` otherwise.  The lesson notebooks do not store that
✓ line as the cell's output (a learner opening the notebook would read the verdict, and part of the
answer, before running anything): they store "name: not checked yet".  Under nbval (``pytest
--nbval-lax NOTEBOOK``) this plugin makes each check cell's expected output the pass line of the
installed checkers (:func:`minitrain.course.exercises.verdict`), whatever the notebook stores: a correct
notebook passes, a blank or wrong one fails at its check cell with the checker's ``✗ …`` line in the
diff — and a student's notebook saved after a failed run (its ``✗`` line stored) still fails.

pytest loads it by itself wherever minitrain is installed (the ``pytest11`` entry point in
``pyproject.toml``); where plugins are not loaded automatically (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``),
add ``-p minitrain_nbval``.  Without it every check cell fails (the stored line is not the verdict),
so a blank notebook never passes.  In a notebook with check cells, what cells write to stderr (a
launcher's notice, a warning) is left out of the comparison: a correct notebook on a busy machine
still passes.  It imports nothing until nbval collects a check cell of a minitrain lesson, and
touches no other notebook.
"""

from __future__ import annotations

import re

#: a check cell: the marker line first, then the call naming the exercise
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
_CHECK_CALL = re.compile(r'check\("([a-z0-9_]+)"')


def _check_name(cell) -> str | None:
    """The exercise a check cell checks, or None for any other cell."""
    if getattr(cell, "cell_type", None) != "code":
        return None
    source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
    if not source.lstrip().startswith(CHECK_MARK):
        return None
    found = _CHECK_CALL.search(source)
    return found.group(1) if found else None


def expect_verdicts(cells) -> int:
    """Give each check cell of a minitrain lesson (``cells``: nbformat cells) the pass verdict as its
    one expected output; the number of cells changed."""
    cells = [(cell, name) for cell in cells if (name := _check_name(cell)) is not None]
    if not cells:
        return 0
    import nbformat

    from minitrain.course.exercises import CHECKS, verdict

    changed = 0
    for cell, name in cells:
        if name not in CHECKS:  # not one of ours: left as it is
            continue
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=verdict(name) + "\n")]
        cell.execution_count = cell.execution_count or 1  # nbval compares only a cell that ran
        changed += 1
    return changed


def pytest_collection_modifyitems(session, config, items) -> None:
    option = config.option
    if not (getattr(option, "nbval", False) or getattr(option, "nbval_lax", False)):
        return
    # nbval's items (IPyNbCell) each hold their notebook cell as ``.cell``
    expect_verdicts([item.cell for item in items if hasattr(item, "cell")])
    # a lesson's notebook: what its cells write to stderr (a launcher's notice that ranks were slow
    # to start, a library's warning) is not compared — only what they print and display
    for item in items:
        parent = getattr(item, "parent", None)
        if _check_name(getattr(item, "cell", None)) and hasattr(parent, "skip_compare") \
                and "stderr" not in parent.skip_compare:
            parent.skip_compare = tuple(parent.skip_compare) + ("stderr",)
