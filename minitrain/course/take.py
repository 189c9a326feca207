"""Taking a function out of a student's kernel to be judged, for ``minitrain grade``: the runner
(:mod:`minitrain.course.runner`) calls :func:`take` in the kernel just before each of the lesson's
check cells, with the function that cell is about to check.

The function is pickled by value (a notebook's functions are; so are those of the student's own
modules) with its cell's source (:mod:`minitrain.runtime.shipping`), into a file the runner reads.
Whatever the notebook did to its kernel, this module included, it can only choose which function
is judged, never the verdict: the judge is another process (:mod:`minitrain.course.judge`).
"""

from __future__ import annotations

import os
import sys

PROBLEM_CAP = 4000  # characters of why no function was taken out
#: top-level packages whose functions are pickled by reference: the judge imports its own copy
BY_REFERENCE = ("minitrain", "torch", "builtins")


def take(path: str, get) -> None:
    """Write ``get()`` (the function checked, or a tuple or list of them), pickled, to ``path``;
    where that fails, why to ``path + ".problem"``."""
    try:
        fn = get()
    except BaseException as exc:
        _note(path, f"{type(exc).__name__}: {exc}")
        return
    try:
        data = dumps(fn)
    except BaseException as exc:
        _note(path, f"it could not be taken out of the notebook to be judged: "
                    f"{type(exc).__name__}: {exc}")
        return
    with open(path + ".part", "wb") as f:
        f.write(data)
    os.replace(path + ".part", path)


def dumps(fn) -> bytes:
    """``fn`` (a function, or a tuple or list of them) pickled, with the modules it comes from
    pickled by value, but for those of :data:`BY_REFERENCE`."""
    import cloudpickle

    from ..runtime import shipping

    pieces = list(fn) if isinstance(fn, (tuple, list)) else [fn]
    names = {getattr(f, "__module__", None) for f in pieces} - {None, "__main__"}
    mods = [sys.modules[m] for m in names if m in sys.modules
            and m.split(".")[0] not in BY_REFERENCE]
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        return shipping.dumps(fn)
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


def _note(path: str, text: str) -> None:
    with open(path + ".problem", "w") as f:
        f.write(text[:PROBLEM_CAP])
