"""Lesson 01: each collective run on the live ranks, shown as every rank's tensor before and after.

``collective_demo`` is the rank function (through a traced :class:`~minitrain.comm.Comm`);
``before_after_html`` (pure) draws the table.
"""

from __future__ import annotations

import torch

from ..comm import Comm

__all__ = ["OPS", "collective_demo", "before_after_html", "show_collective"]

OPS = ("send/recv", "broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather")


def collective_demo(op: str, width: int | None = None):
    """Run ``op`` with a small tensor per rank (rank r holds 10·r + 0, 1, 2, ...); return
    ``(before, after, bytes_sent)`` on this rank."""
    comm = Comm()
    r, n = comm.rank, comm.size
    width = width or n
    x = torch.arange(width, dtype=torch.float32) + 10 * r
    before = x.tolist()
    if op == "send/recv":
        if r == 0:
            comm.send(x, dst=1)
        elif r == 1:
            comm.recv(x, src=0)
    elif op == "broadcast":
        comm.broadcast(x, src=0)
    elif op == "reduce":
        comm.reduce(x, dst=0)
    elif op == "all_reduce":
        comm.all_reduce(x)
    elif op == "reduce_scatter":
        out = torch.empty(width // n)
        comm.reduce_scatter(out, x)
        x = out
    elif op == "all_gather":
        out = torch.empty(width * n)
        comm.all_gather(out, x)
        x = out
    else:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")
    return before, x.tolist(), comm.tracer.summary().get("total", {}).get("sent_bytes", 0.0)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def before_after_html(op: str, results) -> str:
    rows = "".join(
        f"<tr><td>rank {r}</td><td><code>{_fmt(b)}</code></td><td><code>{_fmt(a)}</code></td>"
        f"<td>{sent:g}</td></tr>" for r, (b, a, sent) in enumerate(results))
    return (f"<div class='mt-collective'><b>{op}</b><table><tr><th></th><th>before</th>"
            f"<th>after</th><th>bytes sent (ring model)</th></tr>{rows}</table></div>")


def show_collective(cluster, op: str):
    """Run ``op`` on ``cluster`` and display the before/after table; returns the results."""
    from IPython.display import HTML, display

    results = cluster.run(collective_demo, op)
    display(HTML(before_after_html(op, results)))
    return results
