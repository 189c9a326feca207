"""The split widget of lesson 06: which rank holds which block of A and B in GeLU(XA)B, what each
computes, and where the ranks must add up.

Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism": A split by columns and B by rows needs one all-reduce forward and one backward; the
other way round needs two collectives, the first 4× wider (lesson 06 works it through).  The blocks
are read from the real shards (:func:`split_plan` cuts the model's own ``fc`` and ``proj`` weights
with the function the ``tensor`` strategy shards with).  ``split_plan`` and ``split_html`` are pure
(unit-tested); ``TensorSplitWidget`` wires ipywidgets to them.
"""

from __future__ import annotations

import html

from . import LABEL, beside

__all__ = ["RANK_COLORS", "split_plan", "split_html", "valid_sizes", "TensorSplitWidget"]

RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c")


def split_plan(mlp, n: int, split_a: str = "columns") -> dict:
    """How the MLP ``mlp`` (with ``fc``: d → ff and ``proj``: ff → d) splits over ``n`` ranks.

    Returns ``{"d", "ff", "n", "split_a", "problem", "ranks", "collectives"}``: ``problem`` is
    the sentence saying why it does not split (else None); each rank's entry holds the columns of
    X it needs (``X_columns``), the ``[start, end)`` row and column ranges of its block of A
    (d × ff) and of B (ff × d), their
    shapes as cut from the real weights, and what it computes; ``collectives`` lists, per pass,
    the collective, where it sits and its width in elements per token.
    """
    from ..parallel.tensor import shard_tensor

    if split_a not in ("columns", "rows"):
        raise ValueError(f"split_a must be 'columns' or 'rows', got {split_a!r}")
    d, ff = mlp.fc.in_features, mlp.fc.out_features
    plan = {"d": d, "ff": ff, "n": n, "split_a": split_a, "problem": None, "ranks": [],
            "collectives": []}
    cut = ff if split_a == "columns" else d
    if cut % n:
        what = ("the hidden width d_ff" if split_a == "columns" else "the model width d_model")
        plan["problem"] = (f"A split by {split_a} cuts {what}, {cut}, into {n} equal parts: "
                           f"{cut} does not divide by {n}. Pick a number of ranks that divides "
                           f"{cut}.")
        return plan
    for r in range(n):
        if split_a == "columns":  # torch stores A as fc.weight = Aᵀ (ff × d): A's columns are its rows
            a = shard_tensor(mlp.fc.weight, r, n, dim=0).T
            b = shard_tensor(mlp.proj.weight, r, n, dim=1).T
            lo, hi = r * ff // n, (r + 1) * ff // n
            blocks = {"X": (0, d), "A": ((0, d), (lo, hi)), "B": ((lo, hi), (0, d))}
            computes = [f"Y{r} = GeLU(X · A{r})   (tokens × {hi - lo})",
                        f"Z{r} = Y{r} · B{r}   (tokens × {d}, a partial sum)"]
        else:
            a = shard_tensor(mlp.fc.weight, r, n, dim=1).T
            b = shard_tensor(mlp.proj.weight, r, n, dim=0).T
            lo, hi = r * d // n, (r + 1) * d // n
            blocks = {"X": (lo, hi), "A": ((lo, hi), (0, ff)), "B": ((0, ff), (lo, hi))}
            computes = [f"P{r} = X[:, {lo}:{hi}] · A{r}   (tokens × {ff}, a partial sum)",
                        f"Z[:, {lo}:{hi}] = GeLU(Σ P) · B{r}   (tokens × {hi - lo})"]
        plan["ranks"].append({"rank": r, "X_columns": blocks["X"], "A": blocks["A"], "B": blocks["B"],
                              "A_shape": tuple(a.shape), "B_shape": tuple(b.shape),
                              "computes": computes})
    if split_a == "columns":
        plan["collectives"] = [
            {"pass": "forward", "op": "all-reduce", "where": "Z = Σ Zr, after B (g)", "width": d},
            {"pass": "backward", "op": "all-reduce", "where": "dL/dX, before A (f)", "width": d}]
    else:
        plan["collectives"] = [
            {"pass": "forward", "op": "all-reduce", "where": "Σ Pr, before GeLU", "width": ff},
            {"pass": "forward", "op": "all-gather", "where": "Z's columns, after B", "width": d},
            {"pass": "backward", "op": "all-reduce", "where": "dL/dY = Σ dZr·Brᵀ, before GeLU",
             "width": ff},
            {"pass": "backward", "op": "all-gather", "where": "dL/dX's columns, before A", "width": d}]
    return plan


def _color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _matrix(name: str, shape: tuple, blocks: list, scale: float) -> str:
    """A matrix of ``shape`` (rows, cols; drawn scaled) with blocks ``(color, title, ((row start,
    row end), (col start, col end)))`` coloured."""
    rows, cols = shape
    h, w = max(12, rows * scale), max(12, cols * scale)
    cells = "".join(
        f'<div class="mt-tp-block" title="{title}: rows {a}:{b}, columns {c}:{e}" '
        f'style="position:absolute;top:{100 * a / rows:.2f}%;height:{100 * (b - a) / rows:.2f}%;'
        f'left:{100 * c / cols:.2f}%;width:{100 * (e - c) / cols:.2f}%;'
        f'background:{color};opacity:.85;outline:1px solid white"></div>'
        for color, title, ((a, b), (c, e)) in blocks)
    return (f'<div style="display:inline-block;vertical-align:top;margin:0 10px;text-align:center">'
            f'<div style="position:relative;width:{w:.0f}px;height:{h:.0f}px;background:#eee">'
            f'{cells}</div><div>{name}</div></div>')


def split_html(plan: dict) -> str:
    """A and B with each rank's block coloured, what each rank computes, and the collectives."""
    if plan["problem"]:
        return (f'<div class="mt-tp-problem" style="font-family:sans-serif;color:#c44e52">'
                f'{html.escape(plan["problem"])}</div>')
    d, ff = plan["d"], plan["ff"]
    scale = min(1.0, 220 / max(d, ff))
    tokens = d // 2  # X's height is only drawn: any number of tokens
    if plan["split_a"] == "columns":
        x_blocks = [("#999", "every rank", ((0, tokens), (0, d)))]
    else:
        x_blocks = [(_color(r["rank"]), f"rank {r['rank']}", ((0, tokens), r["X_columns"]))
                    for r in plan["ranks"]]
    mats = (_matrix(f"X (tokens × {d})", (tokens, d), x_blocks, scale)
            + _matrix(f"A ({d} × {ff})", (d, ff), [(_color(r["rank"]), f"rank {r['rank']}", r["A"])
                                                 for r in plan["ranks"]], scale)
            + _matrix(f"B ({ff} × {d})", (ff, d), [(_color(r["rank"]), f"rank {r['rank']}", r["B"])
                                                 for r in plan["ranks"]], scale))
    rows = "".join(
        f'<tr class="mt-tp-rank"><td style="color:{_color(r["rank"])};'
        f'font-weight:bold">rank {r["rank"]}</td><td>A{r["rank"]} {r["A_shape"][0]}×'
        f'{r["A_shape"][1]}, B{r["rank"]} {r["B_shape"][0]}×{r["B_shape"][1]}</td><td>'
        + "<br>".join(html.escape(c) for c in r["computes"]) + "</td></tr>"
        for r in plan["ranks"])
    comm = "".join(f'<li class="mt-tp-collective">{c["pass"]}: <b>{c["op"]}</b> — {c["where"]}, '
                   f'{c["width"]} numbers per token</li>' for c in plan["collectives"])
    title = ("A by columns, B by rows (Megatron)" if plan["split_a"] == "columns"
             else "A by rows, B by columns")
    return (f'<div class="mt-tp-split" style="font-family:sans-serif;font-size:90%">'
            f'<div><b>{title}</b>, {plan["n"]} rank(s): Z = GeLU(X·A)·B</div>{mats}'
            f'<table style="margin-top:6px">{rows}</table>'
            f'<div style="margin-top:4px">where the ranks add up:</div><ul>{comm}</ul></div>')


def valid_sizes(mlp, most: int = 8) -> list[int]:
    """The TP sizes up to ``most`` that split ``mlp`` either way (they divide d_model and d_ff)."""
    d, ff = mlp.fc.in_features, mlp.fc.out_features
    return [n for n in range(1, most + 1) if d % n == 0 and ff % n == 0]


class TensorSplitWidget:
    """TP size and how A is split as controls; the plan of ``model.blocks[0].mlp`` (a GPT) or of
    an MLP redrawn at every change.  The sizes offered are those that split the MLP either way."""

    def __init__(self, model, n: int = 2, split_a: str = "columns"):
        import ipywidgets as w

        self.mlp = model.blocks[0].mlp if hasattr(model, "blocks") else model
        sizes = sorted(set(valid_sizes(self.mlp)) | {n})  # only sizes that split (and the one asked)
        self.n = w.SelectionSlider(options=sizes, value=n, description="TP size N", style=LABEL)
        self.split = w.ToggleButtons(options=["columns", "rows"], value=split_a,
                                     description="split A by",
                                     style=dict(LABEL, button_width="80px"), layout=beside())
        self.out = w.HTML()
        for c in (self.n, self.split):
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([self.n, self.split, self.out])
        self.widget.add_class("mt-tp-widget")
        self.update()

    def update(self) -> None:
        self.out.value = split_html(split_plan(self.mlp, self.n.value, self.split.value))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
