"""The projection widget: a lesson's measured run beside the same run re-timed on a named
cluster at a named model size.

One line in a lesson, under the cell that trained ``run`` with ``record_events=True`` (or
``project=...``)::

    from .projection import ProjectionWidget
    ProjectionWidget(run)                      # or ProjectionWidget(run, "ib-h100x4", "7b")
    ProjectionWidget(run, "dgx-h100", "1.3b", degrees={"dp": 8})  # re-projected as the lesson does

The keyword options are :func:`minitrain.planning.projection.project`'s own (``degrees``, ``even``,
``precision``, ``compute``, ``recompute``) and apply at every setting of the controls, so the
widget re-times the run the way the lesson's static figure beside it does — e.g. a run's 2 ranks
standing for 8 data-parallel replicas (``degrees={"dp": 8}``), or a pipeline's equal
micro-batches (``even=True``).

Two dropdowns — the cluster (the presets of :mod:`minitrain.planning.clusters`, and this machine when the
run was calibrated with ``project="local"``) and the model size (the run's own, or one of
:data:`minitrain.planning.projection.MODEL_SIZES`) — re-project the one recorded run at every change
(:func:`minitrain.planning.projection.project`: milliseconds; nothing is trained again).  Shown, always with
the measurement beside it: the measured step's timeline on top, the projected one below it, in the
form the run's lesson draws — DDP's backward and bucket all-reduces (:mod:`.timeline`, for a run with
``options={"timeline": True}``), a pipeline's Gantt chart (:mod:`.pipeline`), or, for any other
lockstep strategy (ZeRO, tensor, 3D, context, expert), each rank's compute and communication
streams —; a bar of the projected step's parts (compute, exposed communication, bubble, idle), with
an error bar beside it spanning the step time's uncertainty on an accelerator preset (where published
runs fell against their projections: :func:`minitrain.planning.projection.published_band`); and
a summary naming the cluster and the model size: the step time and its uncertainty beside the
measured one, the share of communication hidden, MFU, the memory per device and whether it fits, and
the preset's sources.
A run that cannot be projected (no recorded events, a free-running parameter server, a model size
the layout cannot take) gets a sentence saying why, in place of the charts.

:func:`projection_view` (what to draw), :func:`stream_rows`, :func:`step_parts`,
:func:`summary_html` and :func:`projection_figure` are pure and unit-tested
(``tests/test_viz_projection.py``); :class:`ProjectionWidget` only wires the controls to them.
"""

from __future__ import annotations

import dataclasses
import html
import io
import math

from . import LABEL

__all__ = ["CLUSTERS", "SIZES", "devices", "projection_view", "stream_rows", "step_parts", "summary_html",
           "uncertainty", "projection_figure", "ProjectionWidget"]

#: the cluster presets the widget offers, in its order (this machine's are added when calibrated)
CLUSTERS = ("dgx-h100", "dgx-a100", "ib-h100", "ib-a100", "eth-25g")
#: model sizes: "own" is the run's own model
SIZES = ("own", "gpt2", "1.3b", "2.7b", "7b", "13b")
#: the step's parts, as :func:`minitrain.planning.projection.project` names them, and how they are drawn
PARTS = (("compute_s", "compute", "#4c72b0"),
         ("exposed_comm_s", "exposed communication", "#dd8452"),
         ("bubble_s", "bubble", "#c9c9c9"), ("idle_s", "idle", "#eeeeee"))
PHASE_COLORS = {"forward": "#4c72b0", "model": "#c44e52", "optimizer": "#55a868"}
PHASE_NAMES = {"forward": "forward", "model": "backward and the rest",
               "optimizer": "optimizer step"}
GROUP_COLORS = ("#dd8452", "#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd")
UNTRACED = "#bbbbbb"
#: the kinds of :attr:`~minitrain.planning.projection.Projection.time_by_kind`: name and colour
KIND_COLORS = {"gemm": ("GEMMs", "#4c72b0"), "attention": ("attention", "#64b5cd"),
               "memory": ("memory-bound kernels", "#8172b3"),
               "optimizer": ("optimizer", "#55a868"), "launch": ("kernel launches", "#937860"),
               "compute": ("compute", "#4c72b0"),
               "exposed_comm": ("exposed communication", "#dd8452"),
               "bubble": ("bubble", "#c9c9c9"), "idle": ("idle", "#eeeeee")}
#: the axes ``degrees`` re-sizes, in words
AXES = {"dp": "data parallelism", "tp": "tensor parallelism"}


# --------------------------------------------------------------------------------------------------
# What to draw (pure)
# --------------------------------------------------------------------------------------------------


def _kind(result) -> str:
    """"ddp" (the DDP report's bucket timeline), "pipeline" (the executor's timeline) or
    "streams" (every rank's compute and communication, any other lockstep strategy)."""
    lay = result.summary.layout
    report = (result.summary.report or [None])[0] or {}
    if not report.get("timeline"):
        return "streams"
    if lay.dp == lay.tp == lay.cp == 1 and lay.schedule:  # a pipeline only
        return "pipeline"
    if lay.pp == lay.tp == lay.cp == lay.ep == 1 and lay.zero_stage == 0:  # DDP's buckets
        return "ddp"
    return "streams"


def devices(summary, degrees: dict | None = None) -> int:
    """How many devices the projection stands for: the run's ranks, or the mesh ``degrees``
    re-sizes (``{"dp": 8}`` of a 2-rank DDP run: 8)."""
    from ..planning.projection import checked_degrees, mesh_sizes

    degrees = checked_degrees(degrees)
    if not degrees:
        return summary.world_size
    return math.prod(mesh_sizes(summary.layout, degrees).values())


def _why_not(result, cluster: str, model, degrees: dict | None = None) -> str | None:
    """Why ``result`` cannot be projected on ``cluster`` at ``model`` (its mesh re-sized by
    ``degrees``), in words; None if it can."""
    from ..planning.projection import check_projection, checked_degrees

    if result is None or result.events is None:
        return ("This run kept no events to re-time: train it with record_events (or project) "
                "switched on, then give it to the widget.")
    summary = result.summary
    if summary.layout.free_running:
        return (f"A {summary.strategy} run cannot be projected: {summary.layout.free_running}, "
                "so there is no shared step to re-time.")
    try:
        degrees = checked_degrees(degrees)
    except ValueError as exc:
        return f"This run could not be re-timed: {exc}."
    layout = dataclasses.replace(summary.layout, tp=degrees.get("tp") or summary.layout.tp)
    try:
        check_projection(cluster, None if model == "own" else model, layout,
                         strategy=summary.strategy, world_size=devices(summary, degrees),
                         model=summary.model)
    except ValueError as exc:
        return f"This run cannot be projected there: {exc}."
    return None


def stream_rows(result, projection, measured: bool) -> list[dict]:
    """Per rank, the drawn step's ``compute`` spans ``(start_ms, end_ms, phase)`` and ``comm``
    intervals ``(start_ms, end_ms, group, bytes)`` (the group "untraced" for a metric's or a
    synchronisation's), in ms from the step's start: as ``measured`` here (the run's recorded
    events; the earliest rank's step start is 0) or as projected."""
    from ..planning.recorded import step_programs

    out = []
    if measured:
        _, events, window = step_programs(result, projection.step)
        first = min(w[0] for w in window.values())
    for rank, rows in enumerate(projection.timeline):
        compute = []
        for e in rows:
            if e["op"] != "compute":
                continue
            a, b = e["measured"] if measured else (e["start"], e["end"])
            shift = window[rank][0] - first if measured else 0.0
            compute.append(((a + shift) * 1e3, (b + shift) * 1e3, e["phase"]))
        if measured:
            comm = [((e["start"] - first) * 1e3, (e["end"] - first) * 1e3,
                     e["group"] if e["traced"] else "untraced", float(e["bytes"]))
                    for e in events[rank].values()]
        else:
            comm = [(e["start"] * 1e3, e["end"] * 1e3, e["group"], e["bytes"])
                    for e in rows if e["op"] != "compute"]
        out.append({"rank": rank, "compute": compute, "comm": sorted(comm)})
    return out


def step_parts(projection) -> list[dict]:
    """The projected step's parts in order — ``name``, ``seconds``, ``share`` of the step and
    ``color`` — compute, exposed communication, bubble, idle (they add up to the step time)."""
    total = projection.step_time_s
    return [{"name": name, "seconds": getattr(projection, key), "color": color,
             "share": getattr(projection, key) / total if total > 0 else 0.0}
            for key, name, color in PARTS]


def kind_parts(projection) -> list[dict]:
    """The projected step by kind of time — GEMMs, attention, memory-bound kernels, optimizer,
    launches, exposed communication, bubble, idle (:attr:`Projection.time_by_kind`; they add up
    to the step) — each ``name``, ``seconds``, ``share`` of the step and ``color``; kinds that
    take no time are left out."""
    total = projection.step_time_s
    out = []
    for key, seconds in (projection.time_by_kind or {}).items():
        if seconds > 0:
            name, color = KIND_COLORS.get(key, (key, "#999999"))
            out.append({"name": name, "seconds": seconds, "color": color,
                        "share": seconds / total if total > 0 else 0.0})
    return out


def kind_bar_html(parts: list[dict]) -> str:
    """One horizontal bar, a segment per kind as wide as its share of the step, and its legend."""
    esc = html.escape
    bar = "".join(f'<span title="{esc(x["name"])}: {_ms(x["seconds"])}" style="display:inline-block;'
                  f'height:14px;width:{100 * x["share"]:.2f}%;background:{x["color"]}"></span>'
                  for x in parts)
    legend = ", ".join(f'<span style="color:{x["color"]}">■</span> {esc(x["name"])} '
                       f'{_ms(x["seconds"])} ({x["share"]:.0%})' for x in parts)
    return (f'<div class="mt-projection-kinds"><div style="width:100%;white-space:nowrap;'
            f'font-size:0;border:1px solid #ccc">{bar}</div><small>{legend}</small></div>')


def uncertainty(projection) -> dict | None:
    """The projected step time's uncertainty as drawn: ``low_ms``, ``high_ms`` (the range the
    published runs spanned against their projections: :attr:`Projection.step_time_range_s`) and
    ``label`` (the range) and ``note`` (where it comes from); None where no band applies (this
    machine)."""
    span, band = projection.step_time_range_s, projection.band
    if span is None:
        return None
    low, high = span
    return {"low_ms": low * 1e3, "high_ms": high * 1e3,
            "label": f"uncertainty {_ms(low)}–{_ms(high)}",
            "note": band.words("step")}


def projection_view(result, cluster: str = "dgx-h100", model="1.3b", *,
                    degrees: dict | None = None, even: bool | None = None,
                    precision: str | None = None, compute: str | None = None,
                    recompute: bool | None = None, stack: str | None = None) -> dict:
    """Everything the widget draws for ``result`` on ``cluster`` at ``model`` ("own": the run's).
    The keyword options are :func:`~minitrain.planning.projection.project`'s, passed through (``degrees``:
    the run's ranks standing for a bigger mesh, ``{"dp": 8}``; ``even``: a pipeline's equal
    micro-batches, by default where they are equal, as the CLI projects; ``precision``, ``compute``,
    ``recompute``, ``stack``).

    ``{"message": why}`` when it cannot be projected; else ``kind`` ("ddp", "pipeline",
    "streams"), ``measured`` and ``projected`` (the rows of :func:`.timeline.timeline_rows`, the
    timelines :func:`.pipeline.plot_gantt` draws, or :func:`stream_rows`), ``stages`` (the run's
    ranks, all drawn), ``devices`` (those the projection stands for: :func:`devices`),
    ``measured_step_ms`` (the drawn step, measured here), ``projection`` (what
    :func:`~minitrain.planning.projection.project` returned), ``parts`` (:func:`step_parts`) and ``html``
    (:func:`summary_html`)."""
    from ..planning.projection import ddp_timeline, even_work, pipeline_timeline, project
    from .timeline import timeline_rows

    why = _why_not(result, cluster, model, degrees)
    if why is not None:
        return {"message": why, "cluster": cluster, "model": model}
    target = None if model == "own" else model
    if even is None:
        even = even_work(result.summary)
    options = {"degrees": degrees, "even": even, "precision": precision, "compute": compute,
               "recompute": recompute, "stack": stack}
    summary = result.summary
    kind = _kind(result)
    view = {"message": None, "cluster": cluster, "model": model, "kind": kind,
            "stages": summary.world_size, "devices": devices(summary, degrees)}
    try:
        if kind == "pipeline":
            projected, p = pipeline_timeline(result, cluster, target, **options)
            view["measured"], view["projected"] = summary.report[0]["timeline"], projected
        else:
            p = project(result, cluster, target, **options)
            if kind == "ddp":
                index = p.step - summary.start_step
                view["measured"] = timeline_rows(summary.report, step=index)
                view["projected"] = timeline_rows(ddp_timeline(result, p))
            else:
                view["measured"] = stream_rows(result, p, measured=True)
                view["projected"] = stream_rows(result, p, measured=False)
    except (ValueError, RuntimeError) as exc:  # a log the replay cannot read: say so, never raise
        return {"message": f"This run could not be re-timed: {exc}.", "cluster": cluster,
                "model": model}
    replayed = p.replay
    view["measured_step_ms"] = replayed["measured"] * 1e3
    view["projection"], view["parts"], view["kinds"] = p, step_parts(p), kind_parts(p)
    view["html"] = summary_html(view)
    return view


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3g} ms" if seconds < 1 else f"{seconds:,.3g} s"


def summary_html(view: dict) -> str:
    """The summary under the charts: the cluster and model named, the projected step beside the
    measured one, its parts, hidden communication, MFU, memory per device and whether it fits,
    and the preset's sources — or the sentence saying why there is no projection."""
    if view.get("message"):
        return (f'<div class="mt-projection-note" style="color:#8a5a00;font-family:sans-serif;'
                f'line-height:1.4">{html.escape(view["message"])}</div>')
    p = view["projection"]
    esc = html.escape
    parts = ", ".join(f'{esc(x["name"])} {_ms(x["seconds"])} ({x["share"]:.0%})'
                      for x in view["parts"])
    hidden = p.hidden_comm_share
    hidden = ("no communication" if hidden is None
              else f"{hidden:.0%} of its communication hidden behind compute")
    gb = max(m["total"] for m in p.memory) / 1e9 if p.memory else 0.0
    fits = p.fits
    if fits is None:
        memory = f"{gb:,.3g} GB per device at most"
    else:
        from ..planning.clusters import get_cluster
        cap = get_cluster(p.cluster).device.memory_gb
        memory = (f"{gb:,.3g} GB per device at most, of {cap:g} GB: "
                  + ("fits" if fits else "<b>does not fit</b>"))
    mfu = "" if p.mfu is None else f"; MFU {p.mfu:.1%}"
    n, ranks = view.get("devices", view["stages"]), view["stages"]
    where = f"{n} devices"
    if p.degrees:
        where += (f" (the run's {ranks} ranks drawn, standing for "
                  + " and ".join(f"{AXES.get(a, esc(a))} of {v}" for a, v in p.degrees.items())
                  + ")")
    sources = "".join(f"<li>{esc(s)}</li>" for s in p.sources)
    span = p.step_time_range_s
    return (
        '<div class="mt-projection-summary" style="font-family:sans-serif;line-height:1.45">'
        f'<b>Projected</b> on <b>{esc(p.cluster_title)}</b> (<code>{esc(p.cluster)}</code>) '
        f'as <b>{esc(p.model)}</b>, {esc(p.precision)}, on <span class="mt-projection-devices">'
        f'{where}</span>: '
        f'<b class="mt-projection-step">{_ms(p.step_time_s)} per step</b>'
        + (f' <span class="mt-projection-range">(uncertainty {_ms(span[0])}–{_ms(span[1])}: '
           f'{esc(p.band.words())})</span>' if span else "") +
        f' — beside '
        f'<b class="mt-projection-measured">{_ms(view["measured_step_ms"] / 1e3)}</b> measured here '
        f'for the same step (this machine, the run\'s own model).<br>'
        f'Parts: {parts}; {hidden}{mfu}; memory: {memory}.'
        + (f'<br>Where the time goes, its kernels priced under the <code>{esc(p.stack)}</code> '
           f'stack:' + kind_bar_html(view.get("kinds") or kind_parts(p)) if p.time_by_kind
           else "") +
        f'<details><summary>Where the cluster\'s numbers come from</summary><ul '
        f'style="margin:0.2em 0">{sources}</ul></details></div>')


def _group_colors(rows_list) -> dict:
    groups = sorted({c[2] for rows in rows_list for r in rows for c in r["comm"]} - {"untraced"})
    colors = {g: GROUP_COLORS[i % len(GROUP_COLORS)] for i, g in enumerate(groups)}
    colors["untraced"] = UNTRACED
    return colors


def _draw_streams(ax, rows: list[dict], colors: dict, legend: bool) -> None:
    """Each rank's compute (upper half of its row, coloured by phase) and communication (lower
    half, coloured by group)."""
    for row in rows:
        y = row["rank"]
        lanes: dict = {}  # (y, colour) -> spans: one collection each (fast to draw)
        for a, b, phase in row["compute"]:
            lanes.setdefault((y - 0.39, PHASE_COLORS[phase]), []).append((a, max(b - a, 0.0)))
        for a, b, group, _ in row["comm"]:
            lanes.setdefault((y + 0.01, colors[group]), []).append((a, max(b - a, 0.0)))
        for (bottom, color), spans in lanes.items():
            ax.broken_barh(spans, (bottom, 0.38), facecolors=color)
    ax.set_yticks(range(len(rows)), [f"rank {r['rank']}" for r in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)
    if legend:
        from matplotlib.patches import Patch
        phases = sorted({c[2] for r in rows for c in r["compute"]}, key=list(PHASE_COLORS).index)
        handles = [Patch(color=PHASE_COLORS[k], label=f"compute: {PHASE_NAMES[k]}") for k in phases]
        handles += [Patch(color=c, label="untraced (loss, sync)" if g == "untraced"
                          else f"communication: {g} group") for g, c in colors.items()]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False)


def _draw_ddp(ax, rows: list[dict], legend: bool) -> None:
    """DDP's backward and each bucket's all-reduce per rank (as :mod:`.timeline` draws them)."""
    from matplotlib import colormaps
    colors = colormaps["tab10"]
    t0 = min(r["backward"][0] for r in rows)
    for row in rows:
        y = row["rank"]
        start, end = row["backward"]
        ax.barh(y - 0.2, end - start, left=start - t0, height=0.38, color="#999999",
                label="backward (compute)" if legend and y == 0 else None)
        for index, b0, b1, _ in row["buckets"]:
            ax.barh(y + 0.2, max(b1 - b0, 0.0), left=b0 - t0, height=0.38,
                    color=colors(index % 10),
                    label="a bucket's all-reduce (one colour each)" if legend and y == 0 and
                    index == 0 else None)
    ax.set_yticks(range(len(rows)), [f"rank {r['rank']}" for r in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)
    if legend:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def projection_figure(view: dict):
    """The measured step (top), the projected one (middle) and the projected step's parts
    (bottom), on a stand-alone Figure; None for a view with a message."""
    from matplotlib.figure import Figure

    from .pipeline import plot_gantt

    if view.get("message"):
        return None
    p, kind, n = view["projection"], view["kind"], view["stages"]
    lane = 0.42 if kind == "streams" else 0.36
    heights = (0.3 + lane * n, 0.3 + lane * n, 0.55)  # inches: measured, projected, parts
    above, below = 0.3, 0.5  # a title above each, tick labels and an axis label below
    total = sum(heights) + len(heights) * (above + below) + 0.1
    fig = Figure(figsize=(10, total))
    axes, y = [], total - 0.1
    for h in heights:
        y -= above + h
        axes.append(fig.add_axes([0.08, y / total, 0.66, h / total]))
        y -= below
    top, mid, bottom = axes
    titles = (f"measured here: {_ms(view['measured_step_ms'] / 1e3)} per step (this machine, "
              "the run's own model)",
              f"projected on {p.cluster} as {p.model}: {_ms(p.step_time_s)} per step"
              + (f" ({view['devices']} devices, {n} drawn)" if view.get("devices", n) != n else ""))
    if kind == "streams":
        colors = _group_colors([view["measured"], view["projected"]])
    for ax, rows, title, first in ((top, view["measured"], titles[0], True),
                                   (mid, view["projected"], titles[1], False)):
        if kind == "pipeline":
            plot_gantt(ax, rows, n, title=title, unit="ms")
            if not first:
                ax.get_legend().remove()
        elif kind == "ddp":
            _draw_ddp(ax, rows, legend=first)
            ax.set_title(title, fontsize=10)
        else:
            _draw_streams(ax, rows, colors, legend=first)
            ax.set_title(title, fontsize=10)
        ax.set_xlabel("ms since the step started" if kind != "ddp" else "ms since backward started",
                      fontsize=8)
        ax.tick_params(labelsize=8)
    left = 0.0
    for part in view["parts"]:
        width = part["seconds"] * 1e3
        bottom.barh(0, width, left=left, color=part["color"], edgecolor="#888888", linewidth=0.5,
                    hatch="///" if part["name"] == "bubble" else None,
                    label=f"{part['name']} {part['share']:.0%}")
        left += width
    band = uncertainty(p)
    if band is not None:  # the step time's uncertainty, from its low end to its high end
        middle = (band["low_ms"] + band["high_ms"]) / 2
        half = (band["high_ms"] - band["low_ms"]) / 2
        bottom.errorbar(middle, 0, xerr=half, fmt="none", ecolor="#222222", elinewidth=1.2,
                        capsize=5, label=band["label"])
    bottom.set_xlim(0, max(left, band["high_ms"] * 1.02 if band else 0.0, 1e-9))
    bottom.set_yticks([])
    bottom.set_xlabel("ms of the projected step" + (f"; its uncertainty (|—|): {band['note']}"
                                                    if band else ""), fontsize=8)
    bottom.tick_params(labelsize=8)
    bottom.set_title("the projected step's parts", fontsize=10)
    bottom.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


# --------------------------------------------------------------------------------------------------
# The widget
# --------------------------------------------------------------------------------------------------


class ProjectionWidget:
    """``ProjectionWidget(run, cluster="dgx-h100", model="1.3b")``: the cluster and model-size
    dropdowns beside the run's measured timeline, its projection redrawn at every change (see the
    module's docstring).  ``run``: what ``train(..., record_events=True)`` (or ``project=...``)
    returned.  The keyword options (``degrees``, ``even``, ``precision``, ``compute``,
    ``recompute``, ``stack``) are :func:`~minitrain.planning.projection.project`'s, kept for every setting of the
    controls: ``ProjectionWidget(run, "dgx-h100", "1.3b", degrees={"dp": 8})`` re-projects the run
    as ``project(run, "dgx-h100", "1.3b", degrees={"dp": 8})`` does, on whichever cluster and model
    size is chosen.  Views are kept per setting: coming back to one redraws nothing."""

    def __init__(self, run, cluster: str = "dgx-h100", model="1.3b", *,
                 degrees: dict | None = None, even: bool | None = None, precision: str | None = None,
                 compute: str | None = None, recompute: bool | None = None,
                 stack: str | None = None):
        import ipywidgets as w

        self.run = run
        self.options = {"degrees": degrees, "even": even, "precision": precision,
                        "compute": compute, "recompute": recompute, "stack": stack}
        calibrated = run is not None and bool((run.summary.calibration or {}).get("flop_rate"))
        clusters = list(CLUSTERS) + (["local", "binder"] if calibrated else [])
        if cluster not in clusters:
            clusters.append(cluster)
        sizes = [(("the run's own" if s == "own" else s), s) for s in SIZES]
        if model is None:
            model = "own"
        if model not in SIZES:
            sizes.append((str(model), model))
        self.cluster = w.Dropdown(options=clusters, value=cluster, description="cluster",
                                  style=LABEL)
        self.model = w.Dropdown(options=sizes, value=model, description="model size", style=LABEL)
        self.image = w.Image(format="png")
        self.text = w.HTML()
        self._views: dict = {}
        self.view = None
        for c in (self.cluster, self.model):
            c.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.cluster, self.model]), self.image, self.text])
        self.widget.add_class("mt-projection-widget")
        self.update()

    def update(self) -> None:
        """Re-project for what the controls say (or reuse that setting's view) and redraw."""
        key = (self.cluster.value, self.model.value)
        if key not in self._views:
            view = projection_view(self.run, *key, **self.options)
            fig = projection_figure(view)
            png = None
            if fig is not None:
                buf = io.BytesIO()
                fig.savefig(buf, format="png", dpi=80)
                png = buf.getvalue()
            self._views[key] = (view, png)
        self.view, png = self._views[key]
        self.text.value = summary_html(self.view)
        if png is None:
            self.image.layout.display = "none"
        else:
            self.image.value = png
            self.image.layout.display = None

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
