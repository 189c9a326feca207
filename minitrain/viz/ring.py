"""The ring widget of lesson 01: a real ring all-reduce, replayed step by step.

Each rank starts with the value 2**rank in every chunk, so a partial sum says which ranks it already
contains (5 = 0b101 = ranks 0 and 2).  ``record_ring`` runs :func:`minitrain.comm.ring_all_reduce` on
a live cluster, each rank recording its chunks after every step; ``ring_frames`` (pure) lines the
ranks' records up into frames; ``frame_html`` (pure) draws one frame; ``RingWidget`` plays them.
"""

from __future__ import annotations

import torch

from ..comm import Comm, ring_all_reduce
from . import LABEL

__all__ = ["record_ring", "ring_frames", "contributors", "frame_html", "RingWidget"]


def _ring_rank(elements_per_chunk: int):
    comm = Comm()
    n = comm.size
    x = torch.full((n * elements_per_chunk,), float(2 ** comm.rank), device=comm.device)
    record: list = []
    ring_all_reduce(x, comm, record=record)
    return record


def record_ring(cluster, elements_per_chunk: int = 1) -> list[list[dict]]:
    """Run the ring on every rank of ``cluster``; return each rank's recorded steps."""
    return cluster.run(_ring_rank, elements_per_chunk)


def ring_frames(records: list[list[dict]]) -> list[dict]:
    """Frames: one per step, holding every rank's chunks and what moved in that step."""
    n = len(records)
    if any(len(r) != len(records[0]) for r in records):
        raise ValueError("every rank must record the same number of steps")
    frames = []
    for k in range(len(records[0])):
        steps = [records[r][k] for r in range(n)]
        frames.append(dict(
            phase=steps[0]["phase"], step=steps[0]["step"],
            chunks=[s["chunks"] for s in steps],
            moves=[] if steps[0]["sent"] is None else
            [(r, (r + 1) % n, steps[r]["sent"]) for r in range(n)],
        ))
    return frames


def contributors(value: float, n: int) -> list[int]:
    """Which ranks' 2**rank values add up to ``value``."""
    v = int(round(value))
    return [r for r in range(n) if v >> r & 1]


def frame_html(frame: dict, index: int = 0, total: int = 1) -> str:
    """One frame as a table: ranks × chunks, with the chunks just received highlighted."""
    n = len(frame["chunks"])
    received = {(dst, chunk) for _, dst, chunk in frame["moves"]}
    title = ("start: rank r holds 2**r in every chunk" if frame["phase"] == "start" else
             f"{frame['phase']}, step {frame['step'] + 1} of {n - 1}")
    head = "".join(f"<th style='padding:4px 10px'>chunk {c}</th>" for c in range(n))
    rows = []
    for r, chunks in enumerate(frame["chunks"]):
        cells = []
        for c, values in enumerate(chunks):
            who = contributors(values[0], n)
            done = len(who) == n
            bg = "#ffd966" if (r, c) in received else ("#b6d7a8" if done else "#f3f3f3")
            label = "all" if done else "+".join(map(str, who))
            cells.append(f"<td class='mt-ring-cell' style='background:{bg};padding:4px 10px;"
                         f"text-align:center'>{values[0]:g}<br><small>ranks {label}</small></td>")
        rows.append(f"<tr><th style='padding:4px 10px'>rank {r}</th>{''.join(cells)}</tr>")
    moves = ", ".join(f"{s}→{d}: chunk {c}" for s, d, c in frame["moves"]) or "nothing sent yet"
    return (f"<div class='mt-ring'><b>frame {index + 1}/{total} — {title}</b>"
            f"<table style='border-collapse:collapse;margin:6px 0'><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table><small>sent this step: {moves}. Yellow: just received; "
            f"green: the full sum.</small></div>")


class RingWidget:
    """Play/step through the frames of a recorded ring all-reduce."""

    def __init__(self, frames: list[dict]):
        import ipywidgets as w

        self.frames = frames
        self.play = w.Play(min=0, max=len(frames) - 1, interval=1200)
        self.slider = w.IntSlider(min=0, max=len(frames) - 1, description="frame", style=LABEL)
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.out = w.HTML()
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.out])
        self.widget.add_class("mt-ring-widget")
        self.show(0)

    def show(self, i: int) -> None:
        self.out.value = frame_html(self.frames[i], i, len(self.frames))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
