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
    x = torch.arange(width, dtype=torch.float32, device=comm.device) + 10 * r
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
        out = torch.empty(width // n, device=comm.device)
        comm.reduce_scatter(out, x)
        x = out
    elif op == "all_gather":
        out = torch.empty(width * n, device=comm.device)
        comm.all_gather(out, x)
        x = out
    else:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")
    return before, x.tolist(), comm.tracer.summary().get("total", {}).get("sent_bytes", 0.0)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


#: the algorithm the tracer's byte counts assume for each op (:func:`minitrain.comm.ring_sent_bytes`)
MODEL = {
    "send/recv": "point to point: the sender sends the tensor once",
    "broadcast": "a chain from the root around the ring (root → root+1 → …): every rank but "
                 "the last forwards the whole tensor; gloo's own algorithm may differ (a tree sends "
                 "the same total from fewer ranks)",
    "reduce": "a chain around the ring ending at the root: every rank but the root sends the "
              "whole tensor (its partial sum) on; gloo's own algorithm may differ",
    "all_reduce": "a ring: reduce-scatter then all-gather, 2(N−1)/N of the tensor per rank",
    "reduce_scatter": "a ring: (N−1)/N of the input per rank",
    "all_gather": "a ring: (N−1)/N of the output per rank",
}
#: what a rank's tensor holds after the op that the op does not define
UNDEFINED = {"reduce": lambda r, root=0: r != root}


def before_after_html(op: str, results, root: int = 0) -> str:
    """Every rank's tensor before and after ``op``, and the bytes it sent under the cost model's
    algorithm (:data:`MODEL`, said under the table).  A value the op leaves undefined (what a
    reduce leaves on the ranks that are not its root: gloo's scratch, partial sums) is greyed and
    marked."""
    undefined = UNDEFINED.get(op, lambda r, root=0: False)
    rows = "".join(
        f"<tr><td>rank {r}</td><td><code>{_fmt(b)}</code></td>"
        + (f"<td style='color:#999'><code>{_fmt(a)}</code> *</td>" if undefined(r, root) else
           f"<td><code>{_fmt(a)}</code></td>")
        + f"<td>{sent:g}</td></tr>" for r, (b, a, sent) in enumerate(results))
    notes = [f"bytes sent, as the cost model counts them — {MODEL.get(op, 'its algorithm')}"]
    if any(undefined(r, root) for r in range(len(results))):
        notes.append(f"* not defined by {op}: only the root (rank {root}) receives the sum; gloo "
                     "leaves whatever its own algorithm left there (partial sums), another backend "
                     "leaves something else — never read it")
    return (f"<div class='mt-collective'><b>{op}</b><table><tr><th></th><th>before</th>"
            f"<th>after</th><th>bytes sent (cost model)</th></tr>{rows}</table>"
            + "".join(f"<small>{n}</small><br>" for n in notes) + "</div>")


def show_collective(cluster, op: str):
    """Run ``op`` on ``cluster`` and display the before/after table; returns the results."""
    from IPython.display import HTML, display

    results = cluster.run(collective_demo, op)
    display(HTML(before_after_html(op, results)))
    return results
