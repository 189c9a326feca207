"""Every widget the lessons build, built as the lessons build it, and every value of every control
set: no traceback, no exception's name, no API wording (``name=value``) in what it shows, and each
control changes what it shows.  No browser (tests/test_browser.py drives the same widgets in
Chromium): what a widget shows is read from its ipywidgets models — the HTML and the PNG of its
Image widgets, its buttons' labels and states.

The widget calls are read from the lessons (``solutions/*.ipynb``); ``SETUP`` gives each lesson's
call the names it uses (the lesson's own definitions, cut down to what the call needs).  A lesson
that builds a widget this file does not know fails ``test_every_lesson_widget_is_swept``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: imported before every lesson's setup: the widget classes and what the setups use
PRELUDE = """\
from minitrain import GPT, PRESETS, GPTConfig, train
from minitrain.strategies.pipeline import run_schedule
from minitrain.viz.chooser import ChooserWidget
from minitrain.viz.context import RingAttentionWidget
from minitrain.viz.memory import MemoryCalculator
from minitrain.viz.mesh import MeshWidget
from minitrain.viz.pipeline import BubbleWidget
from minitrain.viz.projection import ProjectionWidget
from minitrain.viz.ring import RingWidget, record_ring, ring_frames
from minitrain.viz.sharding import ShardingWidget
from minitrain.viz.tensor import TensorSplitWidget
"""

#: per lesson, the names its widget calls use, as the lesson defines them (``cluster_of(n)``: a
#: running cluster of n ranks, given by whoever runs the setup)
SETUP = {
    "00": "",
    "01": "cluster = cluster_of(4)\nframes = ring_frames(record_ring(cluster))\n",
    "02": '''\
CLUSTER, SIZE, GPUS = "dgx-h100", "1.3b", 8
run = train(strategy="ddp", world_size=2, steps=3, batch_size=8, cluster=cluster_of(2),
            options={"bucket_mb": 1.0, "timeline": True}, record_events=True)
''',
    "04": '''\
tiny = GPT(PRESETS["tiny"], seed=0)
zero3_run = train(strategy="zero3", world_size=4, steps=3, batch_size=12, precision="fp32",
                  options={"timeline": True}, cluster=cluster_of(4), record_events=True)
Z3_CLUSTER, Z3_SIZE = "dgx-h100", "7b"
''',
    "05": '''\
MODEL = GPTConfig(n_layer=4, n_head=4, d_model=192, seq_len=64)
BATCH, STEPS, P = 16, 4, 2
CLUSTER, SIZE = "dgx-h100", "1.3b"
cluster = cluster_of(P)
RESULTS = {("gpipe", 4): train(strategy="pipeline", world_size=P, steps=3, batch_size=BATCH, model=MODEL,
                               cluster=cluster, options={"schedule": "gpipe", "microbatches": 4},
                               record_events=True)}

def run(schedule, microbatches, chunks=None, steps=STEPS):
    return cluster.run(run_schedule, schedule, microbatches, chunks, model=MODEL, batch_size=BATCH, steps=steps)

def measured_timeline(schedule, stages, microbatches, chunks):
    return run(schedule, microbatches, chunks if schedule == "interleaved" else None, steps=2)[0]["timeline"]
''',
    "06": 'tiny = GPT(PRESETS["tiny"], seed=0)\n',
    "08": '''\
MODEL = GPTConfig(n_layer=4, n_head=4, d_model=64, seq_len=32)
run = train(strategy="3d", world_size=8, steps=3, batch_size=16, model=MODEL, cluster=cluster_of(8),
            options={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}, record_events=True)
''',
    "09": "N = 4\n",
}

#: settings each sweep also starts from (control description -> value), beside the widget's own,
#: with what to sweep there: None for every value of every control, else {control: values or
#: None for all of them} — the states in which other controls matter, where the product of all
#: values would be too long to draw
BASES = {
    "BubbleWidget": [({"schedule": "interleaved"}, None),
                     ({"schedule": "naive"}, {"micro-batches M": None})],
    "MemoryCalculator": [({"devices": 8}, None), ({"devices": 64, "ZeRO stage": "3"}, None)],
    "MeshWidget": [({"dp": 4, "pp": 4, "tp": 4}, {"devices per machine": [1, 3, 16]})],
    "ChooserWidget": [({"nodes": 8}, None),
                      ({"model": "GPT-3 (175B)", "device": "T4 16GB"}, None)],
    "TensorSplitWidget": [({"split A by": "rows"}, None)],
    "RingAttentionWidget": [({"layout": "contiguous"}, None), ({"ranks": 8}, None)],
    "ShardingWidget": [({"ZeRO stage": "0"}, None)],
}


# -- the lessons' widget calls -----------------------------------------------------------------------


@functools.cache
def _widget_classes() -> dict[str, type]:
    namespace: dict = {}
    exec(PRELUDE, namespace)
    return {k: v for k, v in namespace.items()
            if isinstance(v, type) and hasattr(v, "_ipython_display_")}


def _code(cell: dict) -> str:
    lines = "".join(cell["source"]).splitlines()
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def lesson_calls(folder: Path = ROOT / "solutions") -> list[tuple[str, str, str]]:
    """(lesson number, widget class, the call's source) for every widget a lesson builds."""
    calls = []
    for path in sorted(folder.glob("[0-9][0-9]*.ipynb")):
        lesson = path.name[:2]
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = _code(cell)
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            imported = {a.asname or a.name for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minitrain.viz")
                        for a in node.names}
            known = imported | {name for name in _widget_classes() if name in source}
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in known and node.func.id in _widget_classes()):
                    calls.append((lesson, node.func.id, ast.get_source_segment(source, node)))
    return calls


def build(lesson: str, call: str, cluster_of):
    """The widget, as lesson ``lesson`` builds it."""
    namespace = {"cluster_of": cluster_of}
    exec(PRELUDE + SETUP[lesson], namespace)
    try:
        return eval(call, namespace)
    except NameError as e:
        raise AssertionError(f"lesson {lesson}'s call {call} uses a name SETUP[{lesson!r}] does "
                             f"not define: {e}") from None


# -- what a widget shows -------------------------------------------------------------------------------


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.classes: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.classes += [v for k, v in attrs if k == "class" and v]

    def handle_data(self, data):
        self.parts.append(data)


def walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from walk(child)


def shown(obj) -> tuple:
    """What the widget shows: its HTML (text and classes), images, buttons and notes."""
    import ipywidgets as w

    out = []
    for x in walk(obj.widget):
        if x.layout.display == "none":
            continue
        if isinstance(x, w.HTML):
            out.append(("html", x.value))
        elif isinstance(x, w.Image):
            out.append(("image", hashlib.sha1(x.value).hexdigest()))
        elif isinstance(x, w.Button):
            out.append(("button", x.description, x.disabled))
        elif isinstance(x, w.Output):
            out.append(("output", repr(x.outputs)))
    return tuple(out)


#: what must never be shown: a traceback, an exception's name, an API's name=value, an error block
ERROR_TEXT = re.compile(r"Traceback|\b[A-Z]\w*(Error|Exception)\b|\b[a-z_]+=[\w'\"(-]")


def problems(state: tuple) -> list[str]:
    found = []
    for item in state:
        if item[0] != "html":
            continue
        parser = _Text()
        parser.feed(item[1])
        text = " ".join(parser.parts)
        m = ERROR_TEXT.search(text)
        if m:
            found.append(f"{m[0]!r} in: {text[max(0, m.start() - 80):m.end() + 80]}")
        bad = [c for c in parser.classes if "error" in c]
        if bad:
            found.append(f"an error block ({bad[0]}): {text[:200]}")
    return found


def controls(obj) -> dict:
    """The widget's input controls by description (the Play button is linked in the browser)."""
    import ipywidgets as w

    kinds = (w.Dropdown, w.ToggleButtons, w.SelectionSlider, w.IntSlider, w.Checkbox)
    found = {x.description: x for x in walk(obj.widget) if isinstance(x, kinds)}
    assert found, f"{type(obj).__name__} has no controls"
    return found


def values(control) -> list:
    import ipywidgets as w

    if isinstance(control, w.Checkbox):
        return [False, True]
    if isinstance(control, w.IntSlider):
        return list(range(control.min, control.max + 1, control.step))
    return [o[1] if isinstance(o, tuple) else o for o in control.options]


def sweep(obj, name: str, record: dict) -> None:
    """From the widget's present settings and each of BASES[name]: every value of every control
    (or those the base names), one control at a time; fails on the first problem;
    ``record[control]`` collects the distinct things shown while that control moved."""
    start = {d: c.value for d, c in controls(obj).items()}
    for base, what in [({}, None)] + BASES.get(name, []):
        for d, v in base.items():
            controls(obj)[d].value = v
        assert not problems(shown(obj)), (name, base, problems(shown(obj)))
        for description, control in controls(obj).items():
            if control.disabled or (what is not None and description not in what):
                continue
            before = control.value
            for value in (what or {}).get(description) or values(control):
                control.value = value
                state = shown(obj)
                found = problems(state)
                assert not found, f"{name}, from {base}, {description} = {value!r}: {found}"
                record.setdefault(description, set()).add(state)
            control.value = before
        for d, v in start.items():  # back to the widget's own settings for the next base
            controls(obj)[d].value = v


# -- the tests ------------------------------------------------------------------------------------------


def test_every_lesson_widget_is_swept():
    calls = lesson_calls()
    classes = {name for _, name, _ in calls}
    assert classes >= {"MemoryCalculator", "BubbleWidget", "MeshWidget"}, calls  # the parser sees them
    assert classes <= set(_widget_classes()), classes - set(_widget_classes())
    missing = {lesson for lesson, _, _ in calls} - set(SETUP)
    assert not missing, f"lessons {sorted(missing)} build widgets: give them a SETUP entry"


CALLS = lesson_calls()


@pytest.mark.parametrize("lesson, name, call", CALLS, ids=[f"{l}-{n}" for l, n, _ in CALLS])
def test_every_value_of_every_control_shows_no_error_and_changes_the_widget(
        lesson, name, call, clusters):
    obj = build(lesson, call, clusters)
    first = shown(obj)
    assert first and not problems(first), problems(first)
    record: dict = {}
    sweep(obj, name, record)
    dead = [d for d, states in record.items() if len(states) < 2]
    assert not dead, f"{name}: moving {dead} never changed what it shows"


def test_the_bubble_widget_on_real_ranks_under_every_setting(clusters):
    """Lesson 05's widget on its real cluster: the run at the lesson's setting draws a measured
    chart; for every setting its controls offer the Run button is either enabled or disabled with
    a sentence, the measurement is marked once the controls move away from it; a setting the
    model cannot run (V = 4 on 2 ranks of a 4-layer model) is refused in the widget's words."""
    (call,) = [c for lesson, name, c in CALLS if name == "BubbleWidget"]
    w = build("05", call, clusters)
    w.run_measured()
    assert w.measured_summary is not None and not problems(shown(w)), (w.measured_error, problems(shown(w)))
    settings = [(name, p, m, 2) for name in w.schedule.options for p in (2, 3) for m in (1, 4, 5)]
    settings += [("interleaved", 2, m, v) for m in (4, 16) for v in (2, 3, 4)]
    for name, p, m, v in settings:
        w.schedule.value, w.stages.value, w.microbatches.value = name, p, m
        if not w.chunks.disabled:
            w.chunks.value = v
        assert not problems(shown(w)), (name, p, m, v, problems(shown(w)))
        assert w.run_button.disabled == bool(w.run_note.value), (name, p, m, v)
        assert ("mt-bubble-stale" in w.measured_text.value) == (w.config() != w.measured_config)
    w.schedule.value, w.stages.value, w.microbatches.value = "interleaved", 2, 4
    w.chunks.value = 4
    if not w.run_button.disabled:  # the lesson did not tell the widget its model: the ranks will
        w.run_button.click()
    assert w.run_button.disabled and "The model has 4 layers" in w.run_note.value
    assert not problems(shown(w)), problems(shown(w))
