"""The package's layers only point down: every module's imports (module-level and inside functions,
read from the source with ``ast``) go to its own layer or a lower one, and no chain of imports comes
back to where it started.

The layers, lowest first — each may import from itself and below (docs/architecture.md draws them):

1. the core's vocabulary: ``model``, ``data``, ``memory``, ``precision``, ``device``, ``comm``,
   ``record``
2. ``runtime/``: starting and watching ranks (launch, worker, watch, rank folders, diagnostics,
   shipping, torchrun)
3. ``parallel/``: the techniques, one per file (imports only the vocabulary)
4. ``planning/``: what a run means and what it would take elsewhere (analysis, cost model,
   clusters, chooser, projection and its replay)
5. ``strategies/``: the harness, on top of the techniques and the supports
6. ``checkpoint/``: the files a strategy's checkpointer writes and reads
7. ``train``: the one loop
8. ``viz/``: widgets
9. ``course/``: the course machinery (exercise checkers, the lab, grading, the sandbox)
10. entry points: ``cli``, ``__main__``, and the package's own ``__init__`` (a facade: no module
    inside the package imports it)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minitrain"

LAYERS = [
    ("model", "data", "memory", "precision", "device", "comm", "record"),
    ("runtime",),
    ("parallel",),
    ("planning",),
    ("strategies",),
    ("checkpoint",),
    ("train",),
    ("viz",),
    ("course",),
    ("cli", "__main__", ""),  # "": the package itself (minitrain/__init__.py)
]

#: Known exceptions, each owned by work in progress elsewhere: (importer, imported) -> why.  When
#: one is fixed the test says so, and it must be taken off this list.
PENDING: dict = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ["minitrain", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(name: str, path: Path, known: set) -> set[str]:
    """The modules of the package that ``name`` imports anywhere in its source (``from x import
    y`` counts as importing the module ``x.y`` when there is one, else ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "minitrain.x.y" of an attribute: module x
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(name: str) -> int:
    first = name.split(".")[1] if "." in name else ""
    for i, members in enumerate(LAYERS):
        if first in members:
            return i
    raise AssertionError(f"{name} is in no layer: add its top-level name to LAYERS in {__file__}")


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def without_pending(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in targets if (a, b) not in PENDING} for a, targets in edges.items()}


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)


def test_no_import_points_up():
    edges = graph()
    bad = [(a, b) for a, b in upward(without_pending(edges))]
    assert not bad, "imports that point up a layer:\n" + "\n".join(
        f"  {a} (layer {layer(a) + 1}) imports {b} (layer {layer(b) + 1})" for a, b in bad)


def test_no_import_cycle():
    found = cycles(without_pending(graph()))
    assert not found, "import cycles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_the_pending_exceptions_still_exist():
    """An exception that no longer occurs must come off PENDING (so the rule is enforced again)."""
    edges = graph()
    gone = [pair for pair in PENDING if pair[1] not in edges.get(pair[0], set())]
    assert not gone, f"fixed, take them off PENDING in {__file__}: {gone}"


def test_the_techniques_and_comm_import_no_harness():
    """COURSE.md: a technique file imports nothing from the harness; comm nothing from parallel."""
    edges = graph()
    harness = ("minitrain.strategies", "minitrain.train", "minitrain.cli", "minitrain.course.exercises",
               "minitrain.viz", "minitrain.planning.analysis", "minitrain.checkpoint.core", "minitrain.course.grade")
    for name, targets in edges.items():
        if name.startswith("minitrain.parallel") or name == "minitrain.comm":
            for target in targets:
                assert not target.startswith(harness), f"{name} imports {target}"
    assert not any(t.startswith("minitrain.parallel") for t in edges["minitrain.comm"])


def test_the_walker_sees_upward_imports_and_cycles_even_inside_functions(tmp_path):
    """The checks can fail: a small package with a function-level import pointing up and a cycle."""
    pkg = tmp_path / "minitrain"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "comm.py").write_text("def f():\n    from .parallel import flat\n")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "flat.py").write_text("from ..comm import f\n")
    (pkg / "parallel" / "zero.py").write_text("from . import flat\nimport minitrain.strategies\n")
    (pkg / "strategies.py").write_text("from .parallel.zero import x\n")
    edges = graph(pkg)
    assert edges["minitrain.comm"] == {"minitrain.parallel.flat"}
    assert edges["minitrain.parallel.zero"] == {"minitrain.parallel.flat", "minitrain.strategies"}
    assert upward(edges) == [("minitrain.comm", "minitrain.parallel.flat"),
                             ("minitrain.parallel.zero", "minitrain.strategies")]
    assert sorted(cycles(edges)) == [["minitrain.comm", "minitrain.parallel.flat"],
                                     ["minitrain.parallel.zero", "minitrain.strategies"]]
