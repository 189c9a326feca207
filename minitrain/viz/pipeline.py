"""The bubble widget of lesson 05: a pipeline schedule drawn as a Gantt chart, ideal and measured.

Papers: Huang et al., 2019, "GPipe"; Narayanan et al., 2019, "PipeDream" (1F1B) and 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (interleaved);
Qi et al., 2023, "Zero Bubble Pipeline Parallelism".  A schedule is data
(:func:`minitrain.parallel.schedules.make_schedule`), :func:`~minitrain.parallel.schedules.simulate`
gives its ideal timeline and the executor records a measured one in the same format, so one drawing
serves both.  ``gantt_rows``, ``bubble_summary`` and ``summary_html`` are pure (unit-tested);
``plot_gantt`` draws on a matplotlib axis; ``BubbleWidget`` wires ipywidgets to them.
"""

from __future__ import annotations

import html
import io
import re
import time
from datetime import datetime, timedelta

from . import LABEL

__all__ = ["KIND_COLORS", "KIND_NAMES", "IDLE_COLOR", "bar_color", "ideal_timeline", "gantt_rows",
           "bubble_summary", "summary_html", "plot_gantt", "gantt_figure", "refusal", "BubbleWidget"]

#: Base colour per kind and model chunk (index = chunk): forwards cool, backwards warm.
KIND_COLORS = {
    "F": ("#4c72b0", "#3fa7b5", "#8172b3", "#2a6f4e"),
    "B": ("#c44e52", "#e377c2", "#8c564b", "#b8a300"),
    "I": ("#ff7f0e", "#d9534f", "#a0522d", "#c9a227"),
    "W": ("#55a868", "#7fbf3f", "#3d8b6d", "#9bbb59"),
}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)",
              "W": "backward (weight grad)"}
IDLE_COLOR = "#eeeeee"

_ACTION = re.compile(r"^([FBIW])(\d+)@s(\d+)$")


def _parts(action) -> tuple[str, int, int]:
    """(kind, microbatch, stage) of an Action, or of its string form "F3@s1" (as in report())."""
    if isinstance(action, str):
        m = _ACTION.match(action.strip())
        if not m:
            raise ValueError(f"not an action: {action!r} (expected e.g. 'F3@s1')")
        return m.group(1), int(m.group(2)), int(m.group(3))
    return action.kind, action.microbatch, action.stage


def _as_actions(timeline: list[dict]) -> list[dict]:
    """The timeline with string actions turned into pipeline.Action (for pipeline's own helpers)."""
    if not any(isinstance(e["action"], str) for e in timeline):
        return timeline
    from ..parallel.schedules import Action
    return [dict(e, action=Action(*_parts(e["action"]))) for e in timeline]


def _window(timeline: list[dict]) -> tuple[float, float]:
    """The span the bubble is measured over, as :func:`~minitrain.planning.analysis.bubble_fraction`
    does: from the first start to the last end (of any rank)."""
    return min(e["start"] for e in timeline), max(e["end"] for e in timeline)


def bar_color(kind: str, microbatch: int, microbatches: int, chunk: int = 0) -> str:
    """Kind and chunk pick the hue; later micro-batches are lighter (up to 45 % towards white)."""
    base = KIND_COLORS[kind][chunk % len(KIND_COLORS[kind])]
    t = 0.45 * microbatch / max(microbatches - 1, 1)
    rgb = [int(base[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * t):02x}" for c in rgb)


def ideal_timeline(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> list[dict]:
    """The ideal timeline of a schedule to draw: :func:`~minitrain.parallel.schedules.simulate` with
    a stage's F = 1, B = 2 (I = W = 1) units, so a chunk of an interleaved schedule, which holds
    1/v of its stage's layers, takes 1/v of that.  Schedules of any v then share one time axis (with
    a whole unit per chunk, interleaving would look v times slower than it is); the bubble fraction
    is the same either way."""
    from ..parallel.schedules import COSTS, make_schedule, simulate

    costs = {kind: cost / chunks for kind, cost in COSTS.items()}
    return simulate(make_schedule(schedule, stages, microbatches, chunks), costs)


def _time_label(rows: list[dict]) -> str:
    """The x label of an ideal timeline, from what one forward of one chunk took in it."""
    bars = [b for r in rows for b in r["bars"]]
    chunks = 1 + max(b["chunk"] for b in bars)
    forward = next((b["end"] - b["start"] for b in bars if b["kind"] == "F"), 1.0)
    if chunks == 1 or abs(forward - 1.0) < 1e-9:
        return "time (F = 1, B = 2, I = W = 1 unit" + (" per chunk)" if chunks > 1 else ")")
    return f"time (a stage's F = 1, B = 2 units; each of its {chunks} chunks takes 1/{chunks} of that)"


def _luminance(color: str) -> float:
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b


def gantt_rows(timeline: list[dict], stages: int) -> list[dict]:
    """Per rank (0 .. stages-1): its bars in start order and the idle gaps between them.

    A bar is ``{rank, start, end, label ("F3"), kind, microbatch, stage, chunk, color}`` (times
    as in the timeline: units for an ideal one, seconds for a measured one); the chunk of virtual
    stage s is s // stages.  ``idle`` lists the (start, end) gaps over the whole window (from the
    first start to the last end of any rank), so ``idle_total + busy = makespan`` on every rank
    and the idle time of all ranks is ``bubble_fraction × stages × makespan``.
    """
    if not timeline:
        raise ValueError("empty timeline: nothing to draw")
    microbatches = 1 + max(_parts(e["action"])[1] for e in timeline)
    t0, t1 = _window(timeline)
    rows = []
    for rank in range(stages):
        bars = []
        for e in timeline:
            if e["rank"] != rank:
                continue
            kind, mb, stage = _parts(e["action"])
            chunk = stage // stages
            bars.append(dict(rank=rank, start=float(e["start"]), end=float(e["end"]),
                             label=f"{kind}{mb}", kind=kind, microbatch=mb, stage=stage,
                             chunk=chunk, color=bar_color(kind, mb, microbatches, chunk)))
        bars.sort(key=lambda b: (b["start"], b["end"]))
        idle, t = [], t0
        for b in bars:
            if b["start"] > t:
                idle.append((t, b["start"]))
            t = max(t, b["end"])
        if t < t1:
            idle.append((t, t1))
        busy = sum(b["end"] - b["start"] for b in bars)
        rows.append(dict(rank=rank, bars=bars, idle=idle, busy=busy,
                         idle_total=sum(e - s for s, e in idle)))
    extra = {e["rank"] for e in timeline} - set(range(stages))
    if extra:
        raise ValueError(f"timeline has ranks {sorted(extra)} but stages={stages}")
    return rows


def bubble_summary(timeline: list[dict], stages: int, microbatches: int, chunks: int = 1) -> dict:
    """Bubble measured on ``timeline`` (ideal or measured) beside (p−1)/(v·m+p−1), the makespan,
    busy and idle time per rank and the peak number of micro-batches in flight per rank."""
    from ..planning.analysis import bubble_formula, bubble_fraction, peak_in_flight

    timeline = _as_actions(timeline)
    rows = gantt_rows(timeline, stages)
    t0, t1 = _window(timeline)
    return dict(
        stages=stages, microbatches=microbatches, chunks=chunks,
        bubble=float(bubble_fraction(timeline, stages)),
        formula=float(bubble_formula(stages, microbatches, chunks)),
        makespan=t1 - t0,
        busy={r["rank"]: r["busy"] for r in rows},
        idle={r["rank"]: r["idle_total"] for r in rows},
        peak_in_flight={int(k): int(v) for k, v in peak_in_flight(timeline).items()},
        actions=len(timeline),
    )


def summary_html(summary: dict, what: str = "ideal", unit: str = "units") -> str:
    """One line: bubble vs formula, makespan, peak in-flight per rank."""
    s = summary
    p, m, v = s["stages"], s["microbatches"], s["chunks"]
    formula = "(p−1)/(m+p−1)" if v == 1 else "(p−1)/(v·m+p−1)"
    span = f"{s['makespan'] * 1e3:.1f} ms" if unit == "ms" else f"{s['makespan']:.4g} units"
    peaks = " ".join(str(s["peak_in_flight"].get(r, 0)) for r in range(p))
    held = "micro-batches" if v == 1 else "(micro-batch, chunk) activations"
    return (f'<div class="mt-bubble-summary mt-bubble-{what}" style="font-family:sans-serif">'
            f'<b>{what} bubble <span class="mt-bubble-value">{100 * s["bubble"]:.1f}%</span></b>'
            f' vs '
            f'{formula} = {p - 1}/{v * m + p - 1} = <span class="mt-bubble-formula">'
            f'{100 * s["formula"]:.1f}%</span>; makespan {span}; peak {held} in flight per '
            f'rank: <span class="mt-peak">{peaks}</span></div>')


def plot_gantt(ax, timeline: list[dict], stages: int, title: str | None = None,
               unit: str = "units"):
    """Ranks as rows (rank 0 on top), one bar per action, idle time hatched grey.

    ``unit="units"``: an ideal timeline (F=1, B=2, I=W=1); ``unit="ms"``: a measured one, whose
    times are seconds (drawn in ms).  Bars are labelled "F3" (or just "3") when wide enough.
    Actions are the axis' patches (one each, gid "action"); idle time is a collection per rank.
    """
    from matplotlib.patches import Patch, Rectangle

    if unit not in ("units", "ms"):
        raise ValueError(f"unit must be 'units' or 'ms', not {unit!r}")
    scale = 1e3 if unit == "ms" else 1.0
    rows = gantt_rows(timeline, stages)
    t0, t1 = _window(timeline)
    span = max((t1 - t0) * scale, 1e-12)
    fig = ax.figure
    width_pt = fig.get_figwidth() * ax.get_position().width * 72
    per_char_pt = 5.5  # fontsize 7
    for row in rows:
        y = row["rank"]
        if row["idle"]:
            ax.broken_barh([(s * scale, (e - s) * scale) for s, e in row["idle"]], (y - 0.4, 0.8),
                           facecolors=IDLE_COLOR, edgecolors="#bbbbbb", hatch="///", linewidth=0,
                           gid="idle")
        for b in row["bars"]:
            x, w = b["start"] * scale, (b["end"] - b["start"]) * scale
            ax.add_patch(Rectangle((x, y - 0.4), w, 0.8, facecolor=b["color"], edgecolor="white",
                                   linewidth=0.6, gid="action"))
            pts = width_pt * w / span
            text = next((t for t in (b["label"], str(b["microbatch"]))
                         if pts >= per_char_pt * len(t) + 2), None)
            if text:
                ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=7,
                        color="black" if _luminance(b["color"]) > 0.6 else "white")
    kinds = sorted({(b["kind"], b["chunk"]) for r in rows for b in r["bars"]},
                   key=lambda kc: ("FBIW".index(kc[0]), kc[1]))
    chunked = any(c for _, c in kinds)
    handles = [Patch(color=KIND_COLORS[k][c % 4],
                     label=KIND_NAMES[k] + (f", chunk {c}" if chunked else "")) for k, c in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#bbbbbb", hatch="///", label="idle"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    ax.set_yticks(range(stages), [f"rank {r}" for r in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(t0 * scale, t1 * scale)
    ax.set_xlabel(_time_label(rows) if unit == "units" else "ms since the step started")
    if title is not None:
        ax.set_title(title, fontsize=10)
    return ax


def gantt_figure(timeline: list[dict], stages: int, title: str | None = None,
                 unit: str = "units"):
    """A stand-alone Figure (not registered with pyplot, so nothing to close) with one Gantt."""
    from matplotlib.figure import Figure

    height = 0.9 + 0.38 * stages
    fig = Figure(figsize=(10, height))
    ax = fig.add_axes([0.07, 0.5 / height, 0.76, 1 - 0.8 / height])
    plot_gantt(ax, timeline, stages, title=title, unit=unit)
    return fig

def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _faded(png: bytes) -> bytes:
    """The picture 60 % of the way to white: a measurement made for other settings."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    buf = io.BytesIO()
    Image.blend(image, Image.new("RGB", image.size, "white"), 0.6).save(buf, format="PNG")
    return buf.getvalue()


def _note_html(message: str, kind: str = "refusal") -> str:
    """A sentence in place of a chart: ``refusal`` (this setting cannot run) or ``error`` (a run
    failed)."""
    color = "#8a5a00" if kind == "refusal" else "#b00"
    return (f'<div class="mt-pipeline-{kind}" style="color:{color};font-family:sans-serif;'
            f'line-height:1.4">{html.escape(message)}</div>')


def refusal(name: str, stages: int, microbatches: int, chunks: int = 1, *,
            n_layer: int | None = None, batch: int | None = None) -> str | None:
    """Why schedule ``name`` cannot run ``microbatches`` micro-batches on ``stages`` ranks of
    ``chunks`` model chunks each (of a model of ``n_layer`` blocks and a batch of ``batch``
    samples, when given), in plain words; None if it can.  The conditions are those of
    :func:`~minitrain.parallel.schedules.check_schedule` (a test holds the two together)."""
    p, m, v = stages, microbatches, chunks
    if name == "naive" and m != 1:
        return (f"The naive schedule sends the whole batch through the ranks in one piece: it has "
                f"no micro-batches. Set micro-batches M to 1 (it is {m}), or pick gpipe or 1f1b "
                "to split the batch.")
    if name == "interleaved":
        if v < 2:
            return "Interleaving gives every rank two or more model chunks: set chunks V to 2 or more."
        if m % p:
            return (f"Interleaved 1F1B sends the micro-batches round the {p} ranks in groups of "
                    f"{p}: {m} micro-batches do not make whole groups. Set micro-batches M to a "
                    f"multiple of {p}, such as {p * max(1, m // p)}.")
    elif v != 1:
        return (f"{name} gives every rank one model chunk: chunks V only counts for the "
                "interleaved schedule.")
    if n_layer is not None and p * v > n_layer:
        if v == 1:
            return (f"The model has {n_layer} layers: it cannot be cut into {p} stages of at "
                    "least one layer each.")
        most = n_layer // p
        fix = f"set chunks V to {most} or fewer" if most >= 2 else "pick 1f1b (one chunk per rank)"
        return (f"The model has {n_layer} layers: {p} ranks × {v} chunks would need {p * v}, one "
                f"layer or more per chunk. To run it, {fix}.")
    if batch is not None and m > batch:
        return (f"The batch has {batch} samples, so it makes at most {batch} micro-batches: set "
                f"micro-batches M to {batch} or fewer.")
    return None


#: what a refused real run says about the model and the batch (the limits the widget was not told)
_LIMITS = {"n_layer": re.compile(r"the model has (\d+) layers"),
           "batch": re.compile(r"is more than (?:batch=|--batch-size )(\d+)")}


def _cause(exc: BaseException) -> str:
    """A failed run's message without the rank's traceback (``RankError`` appends it)."""
    if isinstance(getattr(exc, "message", None), str):  # a RankError: the rank's own words
        return f"{exc.exc_type}: {exc.message}" if exc.exc_type else exc.message
    text = str(exc).split("\n\n--- traceback", 1)[0].strip()
    return re.sub(r"^rank \d+ failed: ", "", text)


def _sent_at():
    """When the front end sent the message being handled (its header's date), or None outside a
    kernel: a click sent while a run was going is not a new request."""
    try:
        from IPython import get_ipython

        date = get_ipython().kernel.get_parent("shell")["header"]["date"]
        if isinstance(date, str):
            date = datetime.fromisoformat(date.replace("Z", "+00:00"))
        return date if isinstance(date, datetime) else None
    except Exception:  # not in a kernel, or no message being handled
        return None


class BubbleWidget:
    """P, M, V and the schedule as controls; the ideal schedule redrawn at every change.

    ``run(schedule, stages, microbatches, chunks) -> timeline`` (seconds), if given, adds a "Run on
    real ranks" button that draws the measured timeline below the ideal one.  ``ranks``: the
    cluster's size, if known (the real run's P is fixed to it); ``n_layer`` and ``batch``: the
    model's layers and the batch the run trains on, if known.  The button is disabled, with the
    reason beside it, for a setting the real run cannot take; limits the widget was not told it
    learns from the first run they refuse.  A measured chart drawn for other settings than the
    controls show is faded and marked.
    """

    def __init__(self, run=None, stages: int = 4, microbatches: int = 8, chunks: int = 1,
                 schedule: str = "1f1b", ranks: int | None = None, n_layer: int | None = None,
                 batch: int | None = None):
        import ipywidgets as w

        from ..parallel.schedules import SCHEDULES

        self.run, self.ranks, self.n_layer, self.batch = run, ranks, n_layer, batch
        self.schedule = w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule",
                                   style=LABEL)
        self.stages = w.IntSlider(value=stages, min=2, max=8, description="stages P", style=LABEL)
        self.microbatches = w.IntSlider(value=microbatches, min=1, max=16,
                                        description="micro-batches M", style=LABEL)
        self.chunks = w.IntSlider(value=chunks, min=1, max=4, description="chunks V", style=LABEL)
        self.text = w.HTML()
        self.image = w.Image(format="png")
        self.fig = self.summary = self.error = None
        self._hold = False
        self._sync_chunks()
        controls = [self.schedule, self.stages, self.microbatches, self.chunks]
        for c in controls:
            c.observe(self._changed, names="value")
        children = [w.HBox(controls[:2]), w.HBox(controls[2:]), self.text, self.image]
        self.measured_fig = self.measured_summary = self.measured_error = None
        self.measured_config = None  # (schedule, P, M, V) of the measured chart
        self._measured_png = self._faded_png = None
        self._running, self._busy_until = False, None
        if run is not None:
            self._label = "Run on real ranks" + (f" (P = {ranks})" if ranks else "")
            self.run_button = w.Button(description=self._label, button_style="primary",
                                       layout=w.Layout(width="auto", flex="0 0 auto"))
            self.run_button.add_class("mt-bubble-run")
            self.run_button.on_click(self._clicked)
            self.run_note = w.HTML()
            self.measured_text = w.HTML()
            self.measured_image = w.Image(format="png")
            self.measured_image.layout.display = "none"
            children += [w.HBox([self.run_button, self.run_note]), self.measured_text,
                         self.measured_image]
        self.widget = w.VBox(children)
        self.widget.add_class("mt-bubble-widget")
        self.update()

    # -- controls -----------------------------------------------------------------------------
    def config(self) -> tuple[str, int, int, int]:
        """(schedule, P, M, V) as the controls say; V is 1 unless the schedule is interleaved."""
        name = self.schedule.value
        v = self.chunks.value if name == "interleaved" else 1
        return name, self.stages.value, self.microbatches.value, v

    def _sync_chunks(self) -> None:
        interleaved = self.schedule.value == "interleaved"
        self.chunks.disabled = not interleaved
        if interleaved and self.chunks.value == 1:
            self.chunks.value = 2  # interleaving needs at least 2 chunks per rank

    def _changed(self, change) -> None:
        if self._hold:
            return
        self._hold = True
        try:
            if change["owner"] is self.schedule:
                self._sync_chunks()
        finally:
            self._hold = False
        self.update()

    def run_refusal(self) -> str | None:
        """Why the real ranks cannot run what the controls say, in plain words; None if they can."""
        name, p, m, v = self.config()
        if self.ranks is not None and p != self.ranks:
            return f"The cluster has {self.ranks} ranks: set stages P = {self.ranks} to run on it."
        return refusal(name, p, m, v, n_layer=self.n_layer, batch=self.batch)

    # -- drawing ------------------------------------------------------------------------------
    def update(self) -> None:
        """Recompute the ideal schedule and redraw it (or say why it cannot run)."""
        name, p, m, v = self.config()
        self.error = refusal(name, p, m, v)
        if self.error is None:
            try:
                timeline = ideal_timeline(name, p, m, v)
            except ValueError as e:  # not foreseen by refusal(): say so rather than fail
                self.error = f"This schedule cannot run: {e}"
        if self.error is not None:
            self.fig = self.summary = None
            self.text.value = _note_html(self.error)
            self.image.layout.display = "none"
        else:
            self.summary = bubble_summary(timeline, p, m, v)
            self.fig = gantt_figure(timeline, p, title=f"{name}, ideal: P={p}, M={m}"
                                    + (f", V={v}" if v > 1 else ""))
            self.image.value = _png(self.fig)
            self.image.layout.display = None
            self.text.value = summary_html(self.summary, "ideal")
        self._refresh_run()

    def _refresh_run(self) -> None:
        """The button's state and the measured chart's mark, for what the controls now say."""
        if self.run is None or self._running:
            return
        why = self.run_refusal()
        self.run_button.disabled = why is not None
        self.run_button.description = self._label
        self.run_note.value = "" if why is None else _note_html(why)
        if self.measured_summary is None:
            return
        name, p, m, v = self.measured_config
        current = self.measured_config == self.config()
        text = summary_html(self.measured_summary, "measured", unit="ms")
        if not current:
            text = ('<div class="mt-bubble-stale" style="font-family:sans-serif;color:#8a5a00;'
                    'line-height:1.4">'
                    f'Measured earlier for {html.escape(name)}, P = {p}, M = {m}'
                    + (f", V = {v}" if v > 1 else "") + ', not the setting above: press '
                    '"Run on real ranks" to measure this one.</div>' + text)
            if self._faded_png is None:
                self._faded_png = _faded(self._measured_png)
        self.measured_text.value = text
        self.measured_image.value = self._measured_png if current else self._faded_png

    def _clicked(self, _button) -> None:
        sent = _sent_at()
        if sent is not None and self._busy_until is not None and sent < self._busy_until:
            return  # clicked while the last run was running (a double click): not a new request
        started = time.monotonic()
        try:
            self.run_measured()
        finally:
            if sent is not None:
                self._busy_until = sent + timedelta(seconds=time.monotonic() - started)

    def run_measured(self) -> None:
        """Run the current schedule on the real ranks (``run``) and draw what was recorded."""
        if self.run is None:
            raise RuntimeError("BubbleWidget(run=...) was not given a run callable")
        if self._running:
            return
        name, p, m, v = self.config()
        why = self.run_refusal()
        if why is not None:
            self.measured_error = why
            self._said(_note_html(why))
            return
        self._running = True
        self.run_button.disabled, self.run_button.description = True, "Running…"
        self.measured_text.value = ('<div class="mt-bubble-running" style="font-family:sans-serif">'
                                    f'running {html.escape(name)} on real ranks…</div>')
        try:
            timeline = self.run(name, p, m, v)
            summary = bubble_summary(timeline, p, m, v)
            fig = gantt_figure(timeline, p, unit="ms",
                               title=f"{name}, measured: P={p}, M={m}"
                               + (f", V={v}" if v > 1 else ""))
        except Exception as e:  # a refusal or a failed rank: say so, keep the widget alive
            self._running = False
            self.measured_error, kind = self._failure(e)
            self._said("" if kind == "refusal" else _note_html(self.measured_error, kind))
            return  # a refusal is said beside the button; an earlier measurement stays, marked
        finally:
            self._running = False
        self.measured_summary, self.measured_fig = summary, fig
        self.measured_config, self._measured_png, self._faded_png = (name, p, m, v), _png(fig), None
        self.measured_error = None
        self.measured_image.layout.display = None
        self._refresh_run()

    def _said(self, note: str) -> None:
        """``note`` above the measured chart (if there is one, it stays, marked as not this
        setting's)."""
        self.measured_text.value = ""
        self._refresh_run()
        self.measured_text.value = note + self.measured_text.value

    def _failure(self, exc: Exception) -> tuple[str, str]:
        """What a failed run says and its kind (``refusal`` or ``error``): in the widget's words
        when it is a limit of the model or the batch (learnt for next time: the button then
        refuses such settings)."""
        cause = _cause(exc)
        for name, pattern in _LIMITS.items():
            found = pattern.search(cause)
            if found and getattr(self, name) is None:
                setattr(self, name, int(found[1]))
        why = self.run_refusal()
        if why is not None:
            return why, "refusal"
        return ("The run on the real ranks failed: "
                + (cause.splitlines()[0] if cause else type(exc).__name__), "error")

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
