"""The strategy chooser of lesson 08, behind controls: pick a model and a cluster, see the layout.

:func:`minitrain.planning.chooser.choose` does the work; here ``candidate_rows`` picks the rows worth showing
(the recommendation, the layouts as fast as it, the next fastest, and for each rule the rejected
layout that came closest) and ``recommendation_html`` draws them with the reasons — both pure and
unit-tested.  ``ChooserWidget`` only wires ipywidgets to them.
"""

from __future__ import annotations

import html
from dataclasses import asdict, replace

from ..planning.chooser import SCENARIOS, ModelSpec, Recommendation, Workload, choose
from ..planning.clusters import (DGX_H100_HOST, ETH25, H100, HDR, NDR, NVLINK3, NVLINK4, PCIE4,
                                 ClusterSpec)
from ..memory import GB
from . import LABEL
from .memory import DEVICES, MODELS

__all__ = ["candidate_rows", "recommendation_html", "ChooserWidget", "LINKS"]

#: the clusters' links by name (:mod:`minitrain.planning.clusters`): inside a node, and each
#: device's to the network between nodes
LINKS = {"intra": {link.name: link for link in (NVLINK4, NVLINK3, PCIE4)},
         "inter": {link.name: link for link in (NDR, HDR, ETH25)}}


def _row(cand, verdict: str) -> dict:
    mem, comm, t = cand.memory, cand.comm, cand.time
    return {"layout": str(cand.layout), "strategy": cand.layout.strategy(), "verdict": verdict,
            "memory_gb": mem["total"] / GB if mem else None,
            "comm_gb": {k: comm[k] / GB for k in ("dp", "pp", "tp")} if comm else None,
            "step_s": t["total"] if t else None}


def candidate_rows(rec: Recommendation, fastest: int = 3) -> list[dict]:
    """Rows for the reasons table: ``{"layout", "strategy", "verdict", "memory_gb", "comm_gb"
    ({"dp", "pp", "tp"} GB sent per device per step), "step_s"}`` — the recommendation, the
    layouts as fast as it, the ``fastest`` next feasible ones, then one per rejection rule (the
    one needing the least memory)."""
    rows = []
    if rec.best is not None:
        rows.append(_row(rec.best, "recommended"))
        rows += [_row(c, "as fast, less simple") for c in rec.alternatives]
    shown = {id(rec.best)} | {id(c) for c in rec.alternatives}
    rest = [c for c in rec.candidates if c.feasible and id(c) not in shown]
    rows += [_row(c, "fits, slower") for c in rest[:fastest]]
    closest: dict = {}
    for c in rec.candidates:
        if c.feasible:
            continue
        rule = c.rejected.split(":")[0]
        size = c.memory["total"] if c.memory else float("inf")
        if rule not in closest or size < closest[rule][0]:
            closest[rule] = (size, c)
    rows += [_row(c, f"rejected — {c.rejected}") for _, c in closest.values()]
    return rows


def _cell(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def recommendation_html(rec: Recommendation, fastest: int = 3) -> str:
    """The recommendation, the scenario table's row, the reasons, and the candidates' table, as HTML."""
    if rec.layout is not None:
        beyond = "".join(f" × {name} {k}" for name, k in (("CP", rec.cp), ("EP", rec.ep)) if k > 1)
        head = (f'<b class="mt-recommended">{html.escape(str(rec.layout) + beyond)}</b> '
                f'(<code>--strategy {rec.strategy()}</code>)')
    else:
        head = '<b class="mt-recommended" style="color:red">nothing fits</b>'
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in rec.reasons)
    body = []
    for row in candidate_rows(rec, fastest):
        comm = row["comm_gb"] or {}
        colour = {"recommended": "#e6f4ea"}.get(row["verdict"], "")
        body.append(
            f'<tr style="background:{colour}"><td>{html.escape(row["layout"])}</td>'
            f'<td>{_cell(row["memory_gb"], ",.1f")}</td>'
            + "".join(f'<td>{_cell(comm.get(k), ",.2f")}</td>' for k in ("dp", "pp", "tp"))
            + f'<td>{_cell(row["step_s"], ".3g")}</td><td>{html.escape(row["verdict"])}</td></tr>')
    table = ('<table class="mt-chooser-table" style="font-size:90%"><tr><th>layout</th>'
             '<th>GB / device</th><th>DP GB</th><th>PP GB</th><th>TP GB</th><th>s / step</th>'
             '<th>verdict</th></tr>' + "".join(body) + "</table>")
    situation, advice = SCENARIOS[rec.scenario]
    return (f'<div class="mt-chooser" style="font-family:sans-serif;max-width:980px">'
            f'<div>{head}</div><div class="mt-scenario-row">Hugging Face guide — {html.escape(situation)}: '
            f'<i>{html.escape(advice)}</i></div><ul>{reasons}</ul>{table}'
            f'<div style="font-size:80%">GB sent per device per step (ring model); s / step '
            f'estimated from compute, bubble and the traffic that cannot hide.</div></div>')


class ChooserWidget:
    """ipywidgets front end: ``ChooserWidget().widget`` is what the notebook displays."""

    def __init__(self, model: str = "LLaMA 13B", device: str = "H100 80GB"):
        import ipywidgets as w

        def dropdown(options, description, width="auto", **kw):
            return w.Dropdown(options=options, description=description, style=LABEL,
                              layout=w.Layout(width=width), **kw)

        self.model = dropdown(list(MODELS), "model", value=model)
        self.device = dropdown(list(DEVICES), "device", value=device)
        self.per_node = dropdown([1, 2, 4, 8], "devices per node", value=8)
        self.nodes = dropdown([1, 2, 4, 8, 16, 32, 64], "nodes", value=1)
        self.intra = dropdown(list(LINKS["intra"]), "link in a node")
        self.inter = dropdown(list(LINKS["inter"]), "link between nodes")
        self.seq = dropdown([1024, 2048, 4096, 8192], "sequence", value=2048)
        self.batch = dropdown([64, 128, 256, 512, 1024, 2048], "global batch", value=512)
        self.micro = dropdown([1, 2, 4, 8], "micro-batch", value=1)
        self.out = w.HTML()
        controls = [self.model, self.device, self.per_node, self.nodes, self.intra, self.inter,
                    self.seq, self.batch, self.micro]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        for c in controls:
            c.layout.margin = "2px 16px 2px 0"
        rows = [w.HBox(part, layout=w.Layout(flex_flow="row wrap"))
                for part in (controls[:4], controls[4:6], controls[6:])]
        self.widget = w.VBox(rows + [self.out])
        self.widget.add_class("mt-chooser-widget")
        self.update()

    def inputs(self) -> tuple[ModelSpec, ClusterSpec, Workload]:
        """The chooser's inputs; the cluster's devices have the chosen memory and an H100's
        compute, its nodes the DGX's host."""
        device = replace(H100, name=self.device.value, memory_gb=DEVICES[self.device.value])
        hw = ClusterSpec("custom", f"{self.nodes.value} x {self.per_node.value} {device.name}",
                         device, self.per_node.value, self.nodes.value,
                         LINKS["intra"][self.intra.value], LINKS["inter"][self.inter.value],
                         host=DGX_H100_HOST)
        job = Workload(seq_len=self.seq.value, global_batch=self.batch.value,
                       micro_batch=self.micro.value)
        return ModelSpec(**asdict(MODELS[self.model.value])), hw, job

    def update(self) -> None:
        try:
            self.out.value = recommendation_html(choose(*self.inputs()))
        except ValueError as exc:  # e.g. a batch that no layout can split
            self.out.value = f'<b style="color:red">{html.escape(str(exc))}</b>'

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
