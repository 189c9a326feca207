"""Your minitrain on disk: every function that passed its check, kept for lesson 08.

A passing function is pickled with its code (``<name>.pkl``) beside its source (``<name>.py``) in
``my_minitrain/`` next to the notebook (``$MINITRAIN_MINE`` overrides); :func:`mine` loads them back.
:func:`parts` is how every checker reads "the learner's function(s)".
"""

from __future__ import annotations

import os
from pathlib import Path

from ...runtime import shipping

__all__ = ["parts", "mine_dir", "keep", "mine"]


def parts(fn) -> list:
    """The learner's functions in ``fn``: ``fn`` itself, or the items of a tuple (an exercise of
    several functions, e.g. DDP's two bucket hooks)."""
    return list(fn) if isinstance(fn, (tuple, list)) else [fn]


def mine_dir() -> Path:
    """Where passed functions are kept: ``$MINITRAIN_MINE``, else ``my_minitrain/`` beside the
    notebook (the kernel's working directory)."""
    return Path(os.environ.get("MINITRAIN_MINE") or Path.cwd() / "my_minitrain")


def keep(name: str, fn) -> Path | None:
    """Save a passing ``fn`` as ``<name>.pkl`` (cloudpickle: the function with what it uses) and
    ``<name>.py`` (its source, to read).  Returns the folder, or None if it cannot be written."""
    import inspect

    folder = mine_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.pkl").write_bytes(_by_value(fn))
        sources = []
        for f in parts(fn):
            try:
                sources.append(inspect.getsource(f))
            except (OSError, TypeError):
                sources.append(f"# the source of {getattr(f, '__name__', name)} was not available\n")
        source = "\n\n".join(sources)
        (folder / f"{name}.py").write_text(source)
    except OSError:
        return None
    return folder


def _by_value(fn) -> bytes:
    """``fn`` (or a tuple of functions) pickled with its code, even when it lives in a module of the
    learner's (a notebook's functions are pickled so anyway): the kept file loads wherever the
    package is installed."""
    import sys

    import cloudpickle

    modules = []
    for f in parts(fn):
        module = sys.modules.get(getattr(f, "__module__", None) or "")
        if (module is not None and module.__name__ != "__main__" and module not in modules
                and module.__name__.split(".")[0] not in ("minitrain", "torch", "builtins")):
            modules.append(module)
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return shipping.dumps(fn)  # with the cell's source: lesson 08's tracebacks show its lines
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def mine(problems: dict | None = None) -> dict:
    """The learner's kept functions by exercise name; those that do not load are left out (with
    the reason in ``problems`` when given)."""
    out = {}
    folder = mine_dir()
    for path in sorted(folder.glob("*.pkl")) if folder.is_dir() else []:
        try:
            out[path.stem] = shipping.loads(path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - e.g. kept by another version of the package
            if problems is not None:
                problems[path.stem] = f"{type(exc).__name__}: {exc}"
    return out
