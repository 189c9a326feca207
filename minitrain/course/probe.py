"""What a sandboxed ``python -I`` must reach, for :func:`minitrain.course.sandbox.unavailable`,
without the cost of importing torch: the runner's packages (nbclient, cloudpickle) importable, the
files of minitrain, of the kernel and of torch readable.  It prints which minitrain it found (or
that it found none), so that the grader refuses a sandbox that would judge with another copy's
checkers.

Run by path, ``python -I .../probe.py``, never as a module of the package: it must run where the
sandboxed Python finds another minitrain, or none.  ``--installed`` prints only the folder of the
minitrain found (an empty line where there is none), for the grader's environment outside any
sandbox.
"""

from __future__ import annotations

import importlib.util
import os
import sys

MARK = "minitrain-probe: "  # starts the line that names the minitrain found
NONE = "no minitrain"  # what that line says where there is none


def origin(name: str = "minitrain") -> str | None:
    """The real path of the file ``import name`` loads (a package's ``__init__.py``), or None."""
    spec = importlib.util.find_spec(name)
    return None if spec is None or spec.origin is None else os.path.realpath(spec.origin)


def read(names=("minitrain", "ipykernel", "torch")) -> None:
    """Open each package's file and list its folder, and open the checkers' ``__init__.py``: an
    OSError where this process may not read them."""
    for name in names:
        found = importlib.util.find_spec(name).origin
        open(found, "rb").close()
        os.listdir(os.path.dirname(found))
    package = os.path.dirname(importlib.util.find_spec("minitrain").origin)
    open(os.path.join(package, "course", "exercises", "__init__.py"), "rb").close()


def main(argv: list[str]) -> None:
    if argv[1:] == ["--installed"]:
        found = origin()
        print(os.path.dirname(found) if found else "")
        return
    import nbclient  # noqa: F401 - the runner's packages
    import cloudpickle  # noqa: F401
    found = origin()
    if found is None:
        sys.exit(MARK + NONE)
    print(MARK + found, flush=True)
    read()


if __name__ == "__main__":
    main(sys.argv)
