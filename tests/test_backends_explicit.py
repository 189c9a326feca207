"""Every Cluster and launch names its backend; NCCL's collective timeouts come back as gloo's do.

``Cluster(n)`` with no backend picks NCCL on a machine with n GPUs (:func:`choose_backend`), and code
written for gloo (CPU tensors handed to collectives) then fails there.  So every ``Cluster(...)`` and
``launch(...)`` in the course's code, the tests, the benchmarks and the lessons says which backend
it means.  Under NCCL a collective that outlives the group's timeout ends the rank (the watchdog);
what the rank's stderr says makes it the same :class:`CollectiveTimeout` as gloo's exception.
"""

from __future__ import annotations

import ast
import json
import os
import signal
from pathlib import Path

import pytest

from minitrain.runtime.diagnostics import CollectiveTimeout, RankError, backend_op, is_timeout
from minitrain.runtime.watch import died, raised
from minitrain.runtime.worker import _is_timeout

ROOT = Path(__file__).resolve().parents[1]

#: where every Cluster(...) and launch(...) call must name its backend
SOURCES = ("minitrain/course/**/*.py", "tests/**/*.py", "benchmarks/*.py")
NOTEBOOKS = ("solutions/*.ipynb", "lessons/*.ipynb")  # lessons/ is built from solutions/
NAMES = ("Cluster", "launch")


def _minitrain_names(tree: ast.AST) -> set[str]:
    """The names a module binds to minitrain: ``import minitrain[.x] [as y]`` and ``from
    minitrain[.x] import a`` (or a relative import, inside the package)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "minitrain"}
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] == "minitrain":
                names |= {a.asname or a.name for a in node.names}
    return names


def _root(func: ast.expr) -> str | None:
    while isinstance(func, ast.Attribute):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None


def _unnamed(tree: ast.AST, bound: set[str]) -> list[int]:
    """Lines of the calls of minitrain's Cluster or launch in ``tree`` that name no backend
    (no ``backend=``; for Cluster, no second positional argument either).  A call counts when
    its name, or the name it is reached from (``minitrain.launch``), is bound to minitrain;
    ``pw.chromium.launch(...)`` is another library's."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name not in NAMES or _root(func) not in bound:
            continue
        named = any(k.arg == "backend" for k in node.keywords)
        if name == "Cluster" and len(node.args) >= 2:
            named = True
        if not named:
            lines.append(node.lineno)
    return sorted(lines)


def _programs(tree: ast.AST, source: str):
    """(line, tree) of each string in a file that is a Python program calling Cluster or launch
    (the programs the tests run in a subprocess or a notebook); ``line``: the file's line of the
    program's first line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and any(f"{n}(" in node.value for n in NAMES):
            try:
                program = ast.parse(node.value)
            except SyntaxError:
                continue
            literal = (ast.get_source_segment(source, node) or "").lstrip("rRbBuUfF")
            opened = literal[3:] if literal[:3] in ('"""', "'''") else literal[1:]
            # a backslash-newline right after the quotes is no part of the text: one line down
            yield node.lineno + opened.startswith("\\\n"), program


def _cells(path: Path):
    """(cell index, tree) of each code cell of a notebook that parses, its ``%`` and ``!`` lines
    left out."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        lines = ["" if line.lstrip().startswith(("%", "!")) else line
                 for line in source.splitlines()]
        try:
            yield i, ast.parse("\n".join(lines))
        except SyntaxError:
            continue


def unnamed_backends() -> list[str]:
    """``file:line`` of every Cluster(...) or launch(...) in :data:`SOURCES` and
    :data:`NOTEBOOKS` that names no backend (this file's own examples left out)."""
    found = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            if path.resolve() == Path(__file__).resolve():
                continue
            rel = path.relative_to(ROOT)
            source = path.read_text()
            tree = ast.parse(source, str(path))
            bound = _minitrain_names(tree)
            found += [f"{rel}:{line}" for line in _unnamed(tree, bound)]
            for start, program in _programs(tree, source):
                found += [f"{rel}:{start + line - 1} (in a program text)"
                          for line in _unnamed(program, bound | _minitrain_names(program))]
    for pattern in NOTEBOOKS:
        for path in sorted(ROOT.glob(pattern)):
            cells = list(_cells(path))
            bound = set().union(*(_minitrain_names(tree) for _, tree in cells))
            for i, tree in cells:
                found += [f"{path.relative_to(ROOT)}: cell {i}, line {line}"
                          for line in _unnamed(tree, bound)]
    return found


def test_every_cluster_and_launch_names_its_backend():
    found = unnamed_backends()
    assert not found, (
        f"{len(found)} Cluster(...)/launch(...) calls name no backend; with none, a machine with "
        "enough GPUs picks NCCL, and CPU tensors handed to its collectives fail. Add "
        "backend=\"gloo\" (or \"nccl\" where the code puts its tensors on comm.device), e.g. "
        "Cluster(2, backend=\"gloo\", timeout=20); in a lesson, edit solutions/ and run "
        "python -m minitrain.course.exercises build:\n  " + "\n  ".join(found))


def test_the_scan_finds_a_call_without_a_backend(tmp_path):
    program = ("import minitrain as mt\nfrom minitrain import Cluster, launch\n"
               "a = Cluster(2)\nb = Cluster(2, 'gloo')\nc = mt.Cluster(2, timeout=5)\n"
               "d = launch(f, 2, backend='gloo')\ne = mt.runtime.launch.launch(f, 2)\n"
               "browser = pw.chromium.launch(headless=True)\n")
    tree = ast.parse(program)
    assert _unnamed(tree, _minitrain_names(tree)) == [3, 5, 7]
    outer = f'\n\nPROGRAM = """\\\n{program}"""\n'
    [(line, inner)] = list(_programs(ast.parse(outer), outer))
    assert line == 4 and [line + n - 1 for n in _unnamed(inner, _minitrain_names(inner))] == \
        [6, 8, 10]
    assert outer.splitlines()[6 - 1] == "a = Cluster(2)"


# --------------------------------------------------------------------------------------------------
# A collective's timeout, as gloo and NCCL say it
# --------------------------------------------------------------------------------------------------

#: gloo's words (torch 2.13, a recv that never matched; the same for an all_reduce's recv)
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 1000ms for recv operation to complete")
#: NCCL's watchdog (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: WorkNCCL::checkTimeout), the
#: message of the c10::DistBackendError that wait() raises
NCCL_WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, "
                 "OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=1000) ran for 1003 "
                 "milliseconds before timing out.")
#: the same, as an older torch words it (no NumelIn / NumelOut)
NCCL_WATCHDOG_OLD = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, "
                     "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before "
                     "timing out.")
#: the stderr of a rank the watchdog ended (TORCH_NCCL_ASYNC_ERROR_HANDLING=1 or 3): its log lines,
#: then the uncaught exception that aborts the process
NCCL_STDERR = """\
[rank1]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=1000) ran for 1003 milliseconds before timing out.
[rank1]:[E1206 18:44:12.715588844 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at work: 3, last enqueued NCCL work: 3, last completed NCCL work: 2.
[rank1]:[E1206 18:44:12.715600000 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank 1] Timeout at NCCL work: 3, last enqueued NCCL work: 3, last completed NCCL work: 2.
[rank1]:[E1206 18:44:12.715610000 ProcessGroupNCCL.cpp:630] [Rank 1] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank1]:[E1206 18:44:12.715620000 ProcessGroupNCCL.cpp:636] [Rank 1] To avoid data inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=1000) ran for 1003 milliseconds before timing out.
Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:618 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f0c70fb1897 in libc10.so)
"""
#: a rank the watchdog ended for another reason: NCCL logs "failed or timed out" for it as well
NCCL_CUDA_ERROR_STDERR = """\
[rank1]:[E1206 18:44:12.715610000 ProcessGroupNCCL.cpp:630] [Rank 1] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank1]:[E1206 18:44:12.715620000 ProcessGroupNCCL.cpp:636] [Rank 1] To avoid data inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered
"""


@pytest.mark.parametrize("text", [
    GLOO, NCCL_WATCHDOG, NCCL_WATCHDOG_OLD, NCCL_STDERR,
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Timeout at NCCL work: 3, last enqueued NCCL work: 3, "
    "last completed NCCL work: 2.",
    "[Rank 0] Work WorkNCCL(SeqNum=5, OpType=BARRIER, NumelIn=1, NumelOut=1, Timeout(ms)=1000) "
    "timed out in blocking wait.",
    "NCCL communicator was aborted on rank 1.  Original reason for failure was: " + NCCL_WATCHDOG,
], ids=["gloo", "nccl-watchdog", "nccl-watchdog-older-torch", "nccl-stderr", "nccl-timeout-at-work",
        "nccl-blocking-wait", "nccl-aborted-by-a-timeout"])
def test_a_timeout_is_recognised_in_gloos_and_nccls_words(text):
    assert is_timeout(text)
    assert _is_timeout(RuntimeError(text))


@pytest.mark.parametrize("text", [
    NCCL_CUDA_ERROR_STDERR,
    "NCCL communicator was aborted on rank 1.",
    "[Rank 0] Collective WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, "
    "Timeout(ms)=600000) raised the following async exception: NCCL error: unhandled system error",
    "Connection closed by peer [127.0.0.1]:41234",
    "ValueError: shapes differ",
    "",
], ids=["nccl-cuda-error", "nccl-aborted", "nccl-error-of-a-work", "gloo-peer-gone", "plain", "empty"])
def test_other_errors_are_not_timeouts(text):
    assert not is_timeout(text)
    assert not _is_timeout(RuntimeError(text))


def test_the_op_is_read_from_either_backends_words():
    assert backend_op(GLOO) == "recv"
    assert backend_op(NCCL_WATCHDOG) == "all_reduce"
    assert backend_op(NCCL_WATCHDOG.replace("ALLREDUCE", "_REDUCE_SCATTER_BASE")) == \
        "reduce_scatter_tensor"
    assert backend_op("shapes differ") == ""


def test_a_raised_nccl_timeout_is_the_same_data_as_gloos():
    gloo = raised(1, "RuntimeError", GLOO, "", (), 1.0)
    nccl = raised(1, "DistBackendError", NCCL_WATCHDOG, "", (), 1.0)
    for err, op in ((gloo, "recv"), (nccl, "all_reduce")):
        assert isinstance(err, CollectiveTimeout)
        assert (err.timeout_s, err.op, err.priority, err.secondary) == (1.0, op, 1, True)


def test_a_rank_the_nccl_watchdog_ended_is_a_collective_timeout():
    err = died(1, -signal.SIGABRT, 4321, NCCL_STDERR, None, timeout_s=1.0)
    assert isinstance(err, CollectiveTimeout)
    assert (err.rank, err.timeout_s, err.op, err.signal) == (1, 1.0, "all_reduce", signal.SIGABRT)
    assert (err.priority, err.secondary) == (1, True)  # a symptom: a cause elsewhere comes first
    assert err.message.endswith("after a collective timed out: " + NCCL_WATCHDOG)  # no log prefix
    assert "timeout of 1 s" in err.hint and err.native == NCCL_STDERR
    assert "Watchdog caught collective operation timeout" in err.abort_reason


def test_a_rank_that_died_otherwise_stays_a_death():
    err = died(1, -signal.SIGABRT, 4321, NCCL_CUDA_ERROR_STDERR, None, timeout_s=1.0)
    assert type(err) is RankError and err.timeout_s is None and err.priority == 0
    assert "illegal memory access" in err.abort_reason
    err = died(1, -signal.SIGKILL, 4321, "", None, timeout_s=1.0)
    assert type(err) is RankError and err.signal == signal.SIGKILL


def test_a_dead_rank_whose_stderr_shows_the_watchdogs_timeout_comes_back_as_one():
    """The launcher's path for a rank that died, on gloo: the rank writes what NCCL's watchdog
    writes to its native stderr, then aborts, as the watchdog makes it."""
    from minitrain import Cluster

    def ended_by_the_watchdog(text):
        import torch.distributed as dist
        if dist.get_rank() == 1:
            os.write(2, text.encode())
            os.abort()
        return 0

    with Cluster(2, backend="gloo", timeout=20, threads=1, forward_output=False) as cluster:
        with pytest.raises(CollectiveTimeout) as info:
            cluster.run(ended_by_the_watchdog, NCCL_STDERR)
    err = info.value
    assert (err.rank, err.timeout_s, err.op, err.signal) == (1, 20.0, "all_reduce", signal.SIGABRT)
    assert err.where[1].state == "waiting" and err.where[0].state == "returned"
