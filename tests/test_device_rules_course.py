"""The exercises' checkers make every tensor on a named device.

A checker's rank function runs inside a rank: a tensor it makes for a collective must be on the
rank's device (``comm.device``: its GPU under NCCL, the CPU under gloo), and one that stays on the
host says so (``device="cpu"``).  A factory call without ``device=`` makes a CPU tensor whatever
the backend, which NCCL refuses.  Derived constructors (``torch.zeros_like(x)``,
``x.new_zeros(...)``) follow the tensor they come from and are left alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from minitrain.device import FACTORIES  # the factories that make a tensor from nothing

ROOT = Path(__file__).resolve().parents[1]
CHECKERS = "minitrain/course/exercises/*.py"


def deviceless_factories(source: str) -> list[int]:
    """Lines of the ``torch.<factory>(...)`` calls in ``source`` that pass no ``device=`` (a
    ``**kwargs`` passes the caller's on)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "torch" \
                and not any(k.arg in ("device", None) for k in node.keywords):
            lines.append(node.lineno)
    return sorted(lines)


def test_every_tensor_a_checker_makes_names_its_device():
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted(ROOT.glob(CHECKERS))
             for line in deviceless_factories(path.read_text())]
    assert not found, (
        f"{len(found)} tensor factory calls in the checkers name no device; pass device=comm.device "
        "(or x.device, a tensor at hand) in a rank, device=\"cpu\" for a tensor that stays on the "
        "host:\n  " + "\n  ".join(found))


def test_the_scan_finds_a_factory_without_a_device():
    source = ("import torch\n"
              "a = torch.zeros(3)\n"
              "b = torch.ones(3, device=comm.device)\n"
              "c = torch.zeros_like(b)\n"
              "d = b.new_zeros(2)\n"
              "e = torch.tensor([1.0], dtype=torch.float64)\n"
              "f = torch.randn(2, generator=g, device='cpu')\n")
    assert deviceless_factories(source) == [2, 6]
