"""Running one submitted notebook for ``minitrain grade``, inside its sandbox: a fresh kernel
(nbclient) runs its cells; just before each of the lesson's check cells, the kernel hands the
function that cell checks to :func:`minitrain.course.take.take`, and the runner reports it.

Run by path, ``python -I .../runner.py FD``, with the spec on stdin (JSON): ``cells`` (the code
cells' sources), ``takes`` ({cell index: [exercise, the expression of the function its check
cell checks]}), ``cwd`` (the notebook's folder), ``payloads`` (the folder the functions taken out
are written to), ``max_payload`` (bytes) and ``graceful`` (false: exit at once when done, the
sandbox's end stopping the kernel and all it started).  It reports to the file descriptor FD, one
JSON object a line: each cell's error, each function taken out (base64) or why none was, and
``done`` (or ``dead``, ``failed``).  Run by path, this process imports nbclient and nbformat only,
never the package (nor torch, which would count against the notebook's memory limit).
"""

from __future__ import annotations

import base64
import json
import os
import sys

NO_FUNCTION = "no function reached the grader"
PROBLEM_CAP = 4000  # characters of why no function was taken out


def take_code(path: str, expr: str) -> str:
    """The code the kernel runs just before a check cell: the function ``expr`` names, taken out
    to ``path`` by :func:`minitrain.course.take.take`."""
    return (f"__import__('minitrain.course.take', fromlist=['take']).take({path!r}, "
            f"lambda: ({expr}))")


def taken(path: str, max_payload: int, error: str = "") -> dict:
    """What the kernel left at ``path`` for one exercise: ``{"data": base64 of the pickled
    function}``, or ``{"problem": why there is none}`` (``error``: what the code of
    :func:`take_code` raised, if it did)."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read(max_payload + 1)
        if len(data) > max_payload:
            return {"problem": f"your function, with what it uses, is more than "
                               f"{max_payload >> 20} MB pickled; the grader takes less"}
        return {"data": base64.b64encode(data).decode()}
    if os.path.exists(path + ".problem"):
        with open(path + ".problem") as f:
            return {"problem": f.read(PROBLEM_CAP)}
    return {"problem": f"{NO_FUNCTION} ({error})"[:PROBLEM_CAP] if error else NO_FUNCTION}


def error(cell) -> dict | None:
    """The error output of a cell that ran, or None."""
    return next((o for o in cell.outputs if o.get("output_type") == "error"), None)


def main(argv: list[str]) -> None:
    out = open(int(argv[1]), "w")

    def emit(**item):
        out.write(json.dumps(item) + "\n")
        out.flush()

    spec = json.load(sys.stdin)
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])
    os.makedirs(os.environ["HOME"], exist_ok=True)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in spec["cells"]]
    client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": spec["cwd"]}})
    takes = {int(i): t for i, t in spec["takes"].items()}
    os.makedirs(spec["payloads"], exist_ok=True)
    try:
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                if i in takes:
                    name, expr = takes[i]
                    path = os.path.join(spec["payloads"], f"{i}")
                    take = nbformat.v4.new_code_cell(take_code(path, expr))
                    client.execute_cell(take, i, store_history=False)
                    raised = error(take)
                    why = f"{raised.get('ename')}: {raised.get('evalue')}" if raised else ""
                    emit(take=name, **taken(path, spec["max_payload"], why))
                client.execute_cell(cell, i)
                raised = error(cell)
                if raised is not None:
                    emit(cell=i + 1, ename=str(raised.get("ename"))[:200],
                         evalue=str(raised.get("evalue"))[:2000])
                cell.outputs = []
        emit(done=True)
    except DeadKernelError as exc:
        emit(dead=str(exc)[:2000])
    except Exception as exc:
        emit(failed=f"{type(exc).__name__}: {exc}"[:2000])
    out.close()
    if not spec["graceful"]:
        os._exit(0)  # sealed: the sandbox's end stops the kernel and all it started


if __name__ == "__main__":
    main(sys.argv)
