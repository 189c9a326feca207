"""The ring-attention widget of lesson 09: which key/value block each rank holds at each ring step,
what it has merged so far, and how much unmasked work the step gives it.

``ring_attention_frames`` (pure) follows the schedule of
:class:`minitrain.parallel.context.RingAttention` — at step s rank r holds rank (r − s)'s block and
passes it to rank r + 1 — for a layout from :func:`~minitrain.parallel.context.balanced_layout` or
:func:`~minitrain.parallel.context.contiguous_layout`, counting the work with
:func:`~minitrain.parallel.context.ring_work`; ``frame_html`` (pure) draws one step;
``RingAttentionWidget`` steps through them.
"""

from __future__ import annotations

import torch

from ..parallel.context import balanced_layout, contiguous_layout, ring_work
from . import LABEL, beside

__all__ = ["ring_attention_frames", "frame_html", "RingAttentionWidget"]


def _chunks(positions: torch.Tensor, chunk: int) -> list[list[int]]:
    return [sorted({int(p) // chunk for p in row}) for row in positions]


def ring_attention_frames(seq_len: int, n: int, layout: str = "balanced") -> list[dict]:
    """One frame per ring step: for every rank the block it holds (whose, which chunks), the
    blocks merged so far, the unmasked (query, key) pairs this step and so far, and the sends."""
    if layout not in ("balanced", "contiguous"):
        raise ValueError(f"layout must be 'balanced' or 'contiguous', not {layout!r}")
    if n < 1 or seq_len < (2 * n if layout == "balanced" else n):
        raise ValueError(f"{seq_len} tokens do not split over {n} ranks ({layout}); use more "
                         "tokens or fewer ranks")
    padded, positions = (balanced_layout if layout == "balanced" else contiguous_layout)(seq_len, n)
    chunk = padded // (2 * n) if layout == "balanced" else padded // n
    chunks, work = _chunks(positions, chunk), ring_work(positions)
    frames = []
    for s in range(n):
        ranks = []
        for r in range(n):
            src = (r - s) % n
            ranks.append({"holds": src, "chunks": chunks[src], "merged": [(r - t) % n for t in range(s + 1)],
                          "pairs": work[r][s], "pairs_so_far": sum(work[r][:s + 1])})
        frames.append({"step": s, "n": n, "layout": layout, "ranks": ranks,
                       "own_chunks": chunks, "sends": [(r, (r + 1) % n, (r - s) % n)
                                                       for r in range(n)] if s < n - 1 else [],
                       "slowest": max(w[s] for w in work)})
    return frames


def frame_html(frame: dict, index: int = 0, total: int = 1) -> str:
    """One ring step as a table: each rank's queries, the block it holds, what it has merged, the
    work; a rank that idles this step (no unmasked pair) is shaded."""
    rows = []
    for r, info in enumerate(frame["ranks"]):
        idle = info["pairs"] == 0
        bg = "#f4cccc" if idle else ("#b6d7a8" if len(info["merged"]) == frame["n"] else "#fff2cc")
        rows.append(
            f"<tr class='mt-cp-row' style='background:{bg}'><th style='padding:3px 8px'>rank {r}</th>"
            f"<td style='padding:3px 8px'>chunks {frame['own_chunks'][r]}</td>"
            f"<td style='padding:3px 8px'>rank {info['holds']}'s: chunks {info['chunks']}</td>"
            f"<td style='padding:3px 8px'>{', '.join(map(str, info['merged']))}</td>"
            f"<td style='padding:3px 8px;text-align:right'>{info['pairs']}"
            f"{' (idle)' if idle else ''}</td>"
            f"<td style='padding:3px 8px;text-align:right'>{info['pairs_so_far']}</td></tr>")
    sends = ", ".join(f"{a}→{b}: rank {c}'s block" for a, b, c in frame["sends"]) or \
        "nothing: every rank has seen every block"
    return (f"<div class='mt-cp'><b>step {frame['step'] + 1}/{total} — {frame['layout']} layout, "
            f"{frame['n']} ranks</b><table style='border-collapse:collapse;margin:6px 0'>"
            "<tr><th></th><th>its queries</th><th>K/V block it holds</th><th>blocks merged</th>"
            "<th>pairs this step</th><th>so far</th></tr>"
            f"{''.join(rows)}</table><small>posted during this step's compute: {sends}. The step "
            f"lasts as long as its slowest rank ({frame['slowest']} pairs); red: idle, green: "
            "done.</small></div>")


class RingAttentionWidget:
    """Step through ring attention: the number of ranks, the layout, the step."""

    def __init__(self, seq_len: int = 16, n: int = 4, layout: str = "balanced"):
        import ipywidgets as w

        self.seq_len = seq_len
        self.ranks = w.IntSlider(value=n, min=2, max=max(2, seq_len // 2), description="ranks",
                                 style=LABEL)
        self.layout = w.ToggleButtons(options=["balanced", "contiguous"], value=layout,
                                      description="layout", style=dict(LABEL, button_width="96px"),
                                      layout=beside())
        self.step = w.IntSlider(value=0, min=0, max=n - 1, description="ring step", style=LABEL)
        self.out = w.HTML()
        for control in (self.ranks, self.layout, self.step):
            control.observe(lambda change: self.show(), names="value")
        self.widget = w.VBox([w.HBox([self.ranks, self.layout]), self.step, self.out])
        self.widget.add_class("mt-cp-widget")
        self.show()

    def show(self) -> None:
        frames = ring_attention_frames(self.seq_len, self.ranks.value, self.layout.value)
        self.step.max = len(frames) - 1
        i = min(self.step.value, len(frames) - 1)
        self.out.value = frame_html(frames[i], i, len(frames))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
