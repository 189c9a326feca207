"""The sharding widget of lesson 04: which rank holds which part of the model states, per ZeRO stage.

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models":
every parameter flattened into one vector, padded to a multiple of N, rank r holding the r-th 1/N of
it — stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the parameters.  The
picture is drawn from a real partition (the ``owned`` ranges of a real model's shard layout), not
from a formula.  ``grid`` and ``grid_html`` are pure (unit-tested); ``ShardingWidget`` wires
ipywidgets to them.
"""

from __future__ import annotations

from . import LABEL, beside

__all__ = ["KINDS", "held", "grid", "grid_html", "ShardingWidget"]

KINDS = ("parameters", "gradients", "optimizer_states")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868"}
BYTES_PER_ELEMENT = {"parameters": 2, "gradients": 2, "optimizer_states": 12}  # mixed-precision Adam


def held(kind: str, stage: int) -> bool:
    """True if ``kind`` is sharded at ZeRO ``stage`` (else every rank holds all of it)."""
    return stage >= {"optimizer_states": 1, "gradients": 2, "parameters": 3}[kind]


def grid(owned: list[tuple[int, int]], total: int, stage: int) -> list[dict]:
    """Per rank and kind: the element ranges of the flat (padded) vector that the rank holds, and
    its bytes under mixed-precision Adam (2 + 2 + 12 bytes per element)."""
    rows = []
    for rank, (start, end) in enumerate(owned):
        row = {"rank": rank}
        for kind in KINDS:
            ranges = [(start, end)] if held(kind, stage) else [(0, total)]
            row[kind] = ranges
            row[f"{kind}_bytes"] = BYTES_PER_ELEMENT[kind] * sum(e - s for s, e in ranges)
        row["total_bytes"] = sum(row[f"{k}_bytes"] for k in KINDS)
        rows.append(row)
    return rows


def grid_html(rows: list[dict], total: int, boundaries: list[tuple[str, int, int]] = (),
              padding: int = 0) -> str:
    """Ranks down, kinds across: each cell is the flat vector with the held part coloured; thin
    ticks mark parameter boundaries (hover for the name)."""
    ticks = "".join(f'<div title="{name}" style="position:absolute;left:{100 * s / total:.3f}%;'
                    f'top:0;bottom:0;border-left:1px solid rgba(0,0,0,.25)"></div>'
                    for name, s, _ in boundaries)

    def cell(kind, ranges):
        bars = "".join(f'<div style="position:absolute;left:{100 * s / total:.3f}%;width:'
                       f'{100 * (e - s) / total:.3f}%;top:0;bottom:0;background:{COLORS[kind]}">'
                       f'</div>' for s, e in ranges)
        return (f'<td><div class="mt-shard-cell" style="position:relative;width:180px;height:16px;'
                f'background:#eee">{bars}{ticks}</div></td>')

    head = "".join(f"<th>{k.replace('_', ' ')}</th>" for k in KINDS)
    body = "".join(
        f'<tr class="mt-shard-row"><td>rank {r["rank"]}</td>'
        + "".join(cell(k, r[k]) for k in KINDS)
        + f'<td style="text-align:right">{r["total_bytes"] / 1e6:,.2f} MB</td></tr>' for r in rows)
    note = f"{total:,} elements" + (f" ({padding} of them padding)" if padding else "")
    return (f'<table class="mt-sharding" style="font-family:sans-serif;font-size:90%">'
            f'<tr><th></th>{head}<th>model states</th></tr>{body}</table>'
            f'<div style="font-size:85%">{note}; mixed-precision Adam: 2 + 2 + 12 bytes per element'
            f'</div>')


class ShardingWidget:
    """ZeRO stage and N as controls; the partition of ``model`` recomputed by ``layout_fn(params,
    n)`` (default: :func:`minitrain.planning.analysis.shard_layout`) at every change."""

    def __init__(self, model, layout_fn=None, n: int = 4, stage: int = 1):
        import ipywidgets as w

        if layout_fn is None:
            from ..planning.analysis import shard_layout as layout_fn
        self.model, self.layout_fn = model, layout_fn
        self.stage = w.ToggleButtons(options=["0", "1", "2", "3"], value=str(stage),
                                     description="ZeRO stage",
                                     style=dict(LABEL, button_width="48px"), layout=beside())
        self.n = w.IntSlider(value=n, min=1, max=8, description="ranks N", style=LABEL)
        self.out = w.HTML()
        for c in (self.stage, self.n):
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([self.stage, self.n, self.out])
        self.widget.add_class("mt-sharding-widget")
        self.update()

    def update(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        layout = self.layout_fn(params, self.n.value)
        names = {id(p): n for n, p in self.model.named_parameters()}
        bounds, offset = [], 0
        for p in params:
            bounds.append((names[id(p)], offset, offset + p.numel()))
            offset += p.numel()
        rows = grid(layout.owned, layout.total, int(self.stage.value))
        self.out.value = grid_html(rows, layout.total, bounds, layout.padding)

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
