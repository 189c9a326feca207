"""Every lesson's widgets in a real browser: JupyterLab + headless Chromium render and drive them.

Running the lessons themselves would take minutes, so the test builds one small notebook (in tmp)
that builds each widget the lessons build, with the lessons' own calls (read from
``lessons/*.ipynb`` by :func:`test_viz_sweep.lesson_calls`, the names they use set up as in
``test_viz_sweep.SETUP``: real ranks where the widget needs them, a short recorded run for the
projection widget).  It starts JupyterLab on loopback (isolated config, runtime, settings and
workspace dirs), opens that notebook in Debian's ``chromium`` driven by Playwright, runs all
cells from the Run menu, then for every widget: it rendered; no label is cut off or on a line of its own; each control (dropdown, toggle
buttons, slider, checkbox) is moved once and at least one of them changes what the widget shows;
nothing shows a traceback — neither in the widget nor in a callback (the notebook collects what
the kernel logs for a failing callback into a box the test reads).  Lesson 00's calculator goes to
8 devices (a hint says why nothing changes at ZeRO stage 0), then ZeRO stage 3 (less per device);
lesson 05's bubble widget runs on its real ranks (the button disabled meanwhile), marks the
measurement once the controls move, and refuses V = 4 on the 4-layer model in its own words.
Screenshots of every widget go to ``artifacts/browser/``.  Lessons 03 and 07 have no widgets.

Needs ``chromium`` on PATH (``apt-get install chromium``), the ``playwright`` Python package (no
``playwright install``: the system browser is used) and JupyterLab with ``jupyterlab_widgets``.
Skipped when one is missing, except under ``CI=true``, where that is a failure.
``MINITRAIN_BROWSER_LESSONS`` points the test at another folder of lessons to read the calls from.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from minitrain.runtime.launch import descendants

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"
NOTEBOOK = "lesson_widgets.ipynb"
SHOTS = ROOT / "artifacts" / "browser"

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic"]
SERVER_START_S = 60  # until JupyterLab answers /api/status
RUN_S = 120  # from "Run All Cells" until the widgets are rendered and the kernel is idle
UI_S = 30  # each single UI step (page load, a click taking effect)

# JupyterLab front-end plugins that pop up toasts over the notebook (news, update checks).
DISABLED_PLUGINS = ["@jupyterlab/apputils-extension:announcements"]


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(what: str, install: str) -> None:
    if _in_ci():
        pytest.fail(f"{what} is missing, and CI is set: install it ({install})", pytrace=False)
    pytest.skip(f"{what} is missing ({install})")


def _requirements():
    """The chromium binary and Playwright's sync API, or skip (fail under CI) saying what to install."""
    chromium = shutil.which("chromium")
    if chromium is None:
        _missing("the chromium browser", "apt-get install -y chromium")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _missing("the playwright Python package",
                 'pip install playwright (or pip install -e ".[test]"); no `playwright install`')
    for module, package in (("jupyterlab", "jupyterlab"), ("jupyterlab_widgets", "jupyterlab_widgets")):
        try:
            __import__(module)
        except ImportError:
            _missing(f"the {package} package", f'pip install {package} (or pip install -e ".[lab]")')
    return chromium, sync_playwright, expect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Lab:
    """A JupyterLab server on 127.0.0.1 whose config, data, runtime and settings live in ``tmp``."""

    def __init__(self, root_dir: Path, tmp: Path):
        self.port, self.token = _free_port(), secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        config, data = tmp / "config", tmp / "data"
        (config / "labconfig").mkdir(parents=True)
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {p: True for p in DISABLED_PLUGINS}}))
        # User settings: no news or update toasts, no autosave (the notebook must stay as it is),
        # and every cell rendered, not only those in view (the test reads widgets off screen).
        settings = tmp / "lab-settings" / "@jupyterlab"
        for plugin, values in (("apputils-extension/notification",
                                {"fetchNews": "false", "checkForUpdates": False}),
                               ("docmanager-extension/plugin", {"autosave": False}),
                               ("notebook-extension/tracker", {"windowingMode": "none"})):
            (settings / plugin).parent.mkdir(parents=True, exist_ok=True)
            (settings / f"{plugin}.jupyterlab-settings").write_text(json.dumps(values))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(data),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), IPYTHONDIR=str(tmp / "ipython"),
                   JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), JUPYTER_PLATFORM_DIRS="1",
                   PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("JUPYTER_TOKEN", None)
        self.log_path = tmp / "jupyterlab.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root_dir}",
             f"--ServerApp.runtime_dir={tmp / 'runtime'}", "--ServerApp.open_browser=False",
             f"--LabApp.user_settings_dir={tmp / 'lab-settings'}",
             f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
             # Checkpoints in tmp, not in an .ipynb_checkpoints folder beside the lesson.
             f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}",
             "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.expose_app_in_browser=True"],
            cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.pids: set[int] = set()

    def api(self, path: str, method: str = "GET", timeout: float = 5):
        req = urllib.request.Request(f"{self.base}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("/api/status", timeout=2)
                self.api("/lab/api/settings", timeout=10)  # the lab extension is loaded too
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.25)
        raise RuntimeError(f"JupyterLab did not answer in {SERVER_START_S} s:\n{self.log_tail()}")

    def note_processes(self) -> None:
        """Remember the server's descendants (kernel, its ranks) so that close() can reap them."""
        if self.proc.poll() is None:
            self.pids |= set(descendants(self.proc.pid))

    def close(self) -> None:
        self.note_processes()
        if self.proc.poll() is None:
            try:  # graceful: the server shuts its kernels down
                for kernel in self.api("/api/kernels"):
                    self.api(f"/api/kernels/{kernel['id']}", method="DELETE", timeout=10)
                self.api("/api/shutdown", method="POST")
            except (urllib.error.URLError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            left = [p for p in self.pids if _alive(p)]
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (
                    self.proc.poll() is None or any(_alive(p) for p in self.pids)):
                time.sleep(0.1)
        self.proc.wait(timeout=5)
        self._log.close()
        assert not [p for p in self.pids if _alive(p)], "processes left after shutting JupyterLab down"


# In the page: the notebook's kernel state, and whether any cell is still queued or running.
_KERNEL_STATE_JS = """() => {
  const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
  const prompts = Array.from(document.querySelectorAll('.jp-Notebook .jp-InputArea-prompt'));
  return {status: kernel ? kernel.status : null,
          pending: prompts.filter(p => p.textContent.includes('*')).length};
}"""


def _wait_kernel_settled(page, timeout_s: float, quiet_s: float = 1.5) -> None:
    """Until the kernel is idle with no cell queued or running, and stays so for ``quiet_s``."""
    deadline, since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        state = page.evaluate(_KERNEL_STATE_JS)
        if state["status"] == "idle" and state["pending"] == 0:
            since = since or time.monotonic()
            if time.monotonic() - since >= quiet_s:
                return
        else:
            since = None
        page.wait_for_timeout(250)
    raise AssertionError(f"kernel did not settle in {timeout_s:.0f} s (last: {state})")


# -- the notebook: one cell that collects callback errors, then one cell per lesson widget --------

#: the root element's class of each widget (``self.widget.add_class``)
ROOT_CLASS = {"MemoryCalculator": "mt-memory-calculator", "RingWidget": "mt-ring-widget",
              "ShardingWidget": "mt-sharding-widget", "BubbleWidget": "mt-bubble-widget",
              "TensorSplitWidget": "mt-tp-widget", "MeshWidget": "mt-mesh",
              "ChooserWidget": "mt-chooser-widget", "RingAttentionWidget": "mt-cp-widget",
              "ProjectionWidget": "mt-projection-widget"}

# A callback that raises does not show in the notebook: ipykernel logs it ("Comm" logger) or
# ipywidgets calls showtraceback() for a message that belongs to no cell.  Both go to a box here.
FIRST_CELL = '''\\
import html, logging, os, traceback
os.environ.setdefault("OMP_NUM_THREADS", "1")
import ipywidgets
from IPython import get_ipython
from IPython.display import display
from minitrain import Cluster

errors = ipywidgets.HTML()
errors.add_class("mt-widget-errors")

def report(text):
    errors.value += "<pre>" + html.escape(text) + "</pre>"

class Collect(logging.Handler):
    def emit(self, record):
        report(logging.Formatter().format(record))

logging.getLogger("Comm").addHandler(Collect(logging.ERROR))
shell = get_ipython()
show_traceback = shell.showtraceback

def showtraceback(*args, **kwargs):
    report(traceback.format_exc())
    return show_traceback(*args, **kwargs)

shell.showtraceback = showtraceback
clusters = {}

def cluster_of(n):
    if n not in clusters:
        clusters[n] = Cluster(n, backend="gloo").start()
    return clusters[n]

display(errors)
'''


def _notebook(calls, prelude: str, setup: dict) -> dict:
    cells = [FIRST_CELL]
    for lesson, name, call in calls:
        cells.append(f"# lesson {lesson}: {name}, as the lesson builds it\n"
                     f"names = {{'cluster_of': cluster_of}}\n"
                     f"exec({prelude + setup[lesson]!r}, names)\n"
                     f"eval({call!r}, names)")
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                        "language": "python"}},
            "cells": [{"cell_type": "code", "id": f"cell{i}", "metadata": {}, "source": src,
                       "outputs": [], "execution_count": None} for i, src in enumerate(cells)]}


# -- driving a widget -----------------------------------------------------------------------------

# How many times the kernel went idle (installed once): a change is handled once it has gone idle
# after it.
_IDLE_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const kernel = nb.sessionContext.session.kernel;
  if (window.__mtIdle === undefined || window.__mtIdleKernel !== kernel.id) {
    window.__mtIdle = 0;
    window.__mtIdleKernel = kernel.id;
    kernel.statusChanged.connect((_, s) => { if (s === 'idle') window.__mtIdle += 1; });
  }
  return {idle: window.__mtIdle, status: kernel.status};
}"""

# What a widget shows: its text, its images (a new blob URL per picture) and its buttons' states.
_STATE_JS = """r => r.innerText + '|' + Array.from(r.querySelectorAll('img'))
  .map(i => i.src + ':' + getComputedStyle(i).display).join(',') + '|' +
  Array.from(r.querySelectorAll('button')).map(b => b.disabled).join(',')"""

# Labels that are cut off (text wider than its box) or on a line of their own (not beside the
# control they name).
_LABELS_JS = """r => Array.from(r.querySelectorAll('.widget-label'))
  .filter(l => l.offsetParent !== null && l.textContent.trim())
  .map(l => {
    const a = l.getBoundingClientRect();
    const next = Array.from(l.parentElement.children).find(c => c !== l && c.offsetParent !== null);
    const b = next ? next.getBoundingClientRect() : a;
    return {text: l.textContent.trim(), cut: l.scrollWidth > l.clientWidth + 1,
            alone: b.top >= a.bottom - 2 || a.top >= b.bottom - 2};
  }).filter(x => x.cut || x.alone)"""


def _handled(page, action, timeout_s: float = UI_S) -> None:
    """Do ``action`` (a change a widget sends to the kernel) and wait until the kernel handled it
    and the page is quiet again."""
    before = page.evaluate(_IDLE_JS)["idle"]
    action()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate(_IDLE_JS)["idle"] > before:
            break
        page.wait_for_timeout(50)
    else:
        raise AssertionError(f"the kernel did not handle the change in {timeout_s:.0f} s")
    _wait_kernel_settled(page, timeout_s, quiet_s=0.3)


def _slider_to(page, slider, value: int) -> None:
    """Move an ipywidgets slider's handle with the keyboard until it shows ``value`` (its
    position, for a selection slider)."""
    handle = slider.locator(".noUi-handle")
    for _ in range(32):
        now = float(handle.get_attribute("aria-valuenow"))
        if now == value:
            return
        handle.focus()
        _handled(page, lambda: page.keyboard.press("ArrowRight" if now < value else "ArrowLeft"))
    raise AssertionError(f"slider stuck at {now}, not {value}")


def _drive(page, root, most: int = 99) -> list[tuple[str, bool]]:
    """Move every enabled control of the widget once (the first ``most`` of them): the next
    option of a dropdown, another toggle button, a slider one step, a checkbox flipped.  Returns
    (control, changed the widget)."""
    moved = []

    def label(control) -> str:
        text = control.locator(".widget-label").first
        return text.inner_text().strip() if text.count() else "(unlabelled)"

    def once(kind, control, action):
        if len(moved) >= most:
            return
        before = root.evaluate(_STATE_JS)
        _handled(page, action)
        page.wait_for_timeout(150)  # the views redraw after the message
        moved.append((f"{kind} {label(control)!r}", root.evaluate(_STATE_JS) != before))

    for control in root.locator(".widget-dropdown").all():
        select = control.locator("select")
        if select.is_disabled():
            continue
        n, i = select.evaluate("s => [s.options.length, s.selectedIndex]")
        once("dropdown", control, lambda: select.select_option(index=(i + 1) % n))
    for control in root.locator(".widget-toggle-buttons").all():
        other = control.locator("button:not(.mod-active):not([disabled])").first
        if other.count():
            once("toggle", control, other.click)
    for control in root.locator(".widget-hslider").all():
        handle = control.locator(".noUi-handle")
        if control.locator(".noUi-target[disabled]").count() or not handle.count():
            continue
        now, top = (float(handle.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))

        def step(handle=handle, key="ArrowRight" if now < top else "ArrowLeft"):
            handle.focus()
            page.keyboard.press(key)
        once("slider", control, step)
    for control in root.locator(".widget-checkbox").all():
        once("checkbox", control, control.locator("input[type=checkbox]").click)
    return moved


def _calculator(page, root, expect) -> None:
    """Lesson 00's check: 8 devices at ZeRO 0 change nothing (and a hint says why); ZeRO 3 over 8
    devices needs less per device."""
    per_device = root.locator(".mt-per-device")

    def gb() -> float:
        m = re.fullmatch(r"([\d,.]+) (GB|MB) per device", per_device.inner_text().strip())
        assert m, f"unexpected per-device text {per_device.inner_text()!r}"
        return float(m[1].replace(",", "")) * (1 if m[2] == "GB" else 1e-3)

    stage = root.locator(".mt-zero-stage")
    assert [b.strip() for b in stage.locator("button").all_inner_texts()] == ["0", "1", "2", "3"]
    before = gb()
    devices = root.locator(".widget-dropdown").filter(
        has=page.locator("label", has_text=re.compile(r"^devices$"))).locator("select")
    _handled(page, lambda: devices.select_option(label="8"))
    expect(root.locator(".mt-hint")).to_contain_text("every device holds all")
    assert gb() == before, "at ZeRO stage 0 more devices should not change the bytes per device"
    _handled(page, stage.locator("button", has_text=re.compile(r"^\s*3\s*$")).click)
    expect(root.locator(".mt-hint")).to_have_count(0)
    print(f"  calculator: {before:,.1f} GB per device; 8 devices, ZeRO 3: {gb():,.1f} GB")
    assert gb() < before, "ZeRO-3 over 8 devices should need less per device"


def _bubble_run(page, root, expect) -> None:
    """Lesson 05's widget on real ranks: a double click on Run runs once (the button is disabled
    while it runs, the second click is dropped) and draws the measured chart."""
    button = root.locator(".mt-bubble-run")
    expect(button).to_be_enabled()
    button.evaluate("""b => {  // every time the button becomes disabled: a run starts
      window.__mtRuns = 0;
      new MutationObserver(records => {
        window.__mtRuns += records.filter(r => r.attributeName === 'disabled' && r.oldValue === null).length;
      }).observe(b, {attributes: true, attributeOldValue: true, attributeFilter: ['disabled']});
    }""")
    t0 = time.monotonic()
    button.dblclick()
    expect(button).to_be_disabled(timeout=5_000)
    expect(root.locator(".mt-bubble-measured")).to_be_visible(timeout=RUN_S * 1000)
    t_run = time.monotonic() - t0
    _wait_kernel_settled(page, RUN_S, quiet_s=1.0)  # a second run, if any, would start here
    expect(button).to_be_enabled()
    runs = page.evaluate("window.__mtRuns")
    assert runs == 1, f"a double click on Run ran {runs} times"
    print(f"  bubble: a double click ran once, in {t_run:.1f} s")


def _bubble_refusal(page, root, expect) -> None:
    """After the controls moved, the measurement is marked; V = 4 on the lesson's 2 ranks of a
    4-layer model: refused in the widget's words, the button disabled."""
    expect(root.locator(".mt-bubble-stale")).to_be_visible()
    select = root.locator(".widget-dropdown select")
    if select.input_value() != "interleaved":
        _handled(page, lambda: select.select_option("interleaved"))
    sliders = {s.locator(".widget-label").inner_text().strip(): s
               for s in root.locator(".widget-hslider").all()}
    for name, value in (("stages P", 2), ("micro-batches M", 4), ("chunks V", 4)):
        _slider_to(page, sliders[name], value)
    button = root.locator(".mt-bubble-run")
    if button.is_enabled():  # the lesson did not tell the widget its model: the ranks refuse it
        _handled(page, button.click, timeout_s=RUN_S)
    expect(button).to_be_disabled()
    note = root.locator(".mt-pipeline-refusal").first
    expect(note).to_contain_text("The model has 4 layers")
    print(f"  bubble, V = 4: {note.inner_text().strip()}")


@pytest.mark.timeout(300)
def test_every_lessons_widgets_in_jupyterlab(tmp_path):
    chromium, sync_playwright, expect = _requirements()
    from test_viz_sweep import PRELUDE, SETUP, lesson_calls

    lessons = Path(os.environ.get("MINITRAIN_BROWSER_LESSONS") or LESSONS).resolve()
    calls = lesson_calls(lessons)
    assert {name for _, name, _ in calls} == set(ROOT_CLASS), \
        f"lessons build {sorted({n for _, n, _ in calls})}; ROOT_CLASS knows {sorted(ROOT_CLASS)}"
    folder = tmp_path / "notebook"
    folder.mkdir()
    (folder / NOTEBOOK).write_text(json.dumps(_notebook(calls, PRELUDE, SETUP), indent=1))
    SHOTS.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    lab = Lab(folder, tmp_path)
    try:
        lab.wait_ready()
        t_server = time.monotonic() - t0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                # tall enough for the tallest widget's screenshot
                page = browser.new_page(viewport={"width": 1280, "height": 1600})
                page.set_default_timeout(UI_S * 1000)
                page_errors: list[str] = []
                page.on("pageerror", lambda e: page_errors.append(str(e)))
                # ?reset: start from an empty workspace whatever was saved before.
                page.goto(f"{lab.base}/lab/tree/{NOTEBOOK}?reset&token={lab.token}")
                page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
                _wait_kernel_settled(page, UI_S)  # kernel started and idle before running
                lab.note_processes()

                t_run = time.monotonic()
                page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
                page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
                cells = page.locator(".jp-Notebook .jp-CodeCell")
                roots = [cells.nth(i + 1).locator(f".jp-OutputArea-output .{ROOT_CLASS[name]}")
                         for i, (_, name, _) in enumerate(calls)]
                roots[-1].wait_for(timeout=RUN_S * 1000)
                _wait_kernel_settled(page, max(1, RUN_S - (time.monotonic() - t_run)))
                lab.note_processes()
                t_run = time.monotonic() - t_run
                print(f"\nserver up {t_server:.1f} s, run all {t_run:.1f} s")
                notebook_errors = page.locator(".jp-Notebook .jp-OutputArea-output")
                errors_box = page.locator(".mt-widget-errors")

                def no_errors(where: str) -> None:
                    shown = errors_box.inner_text().strip()
                    assert not shown, f"{where}: a widget callback failed:\n{shown}"
                    text = " ".join(notebook_errors.all_inner_texts())
                    assert "Traceback" not in text and "Error:" not in text, \
                        f"{where}: an error in the notebook:\n{text[-2000:]}"

                no_errors("after run all")
                t_drive, driven = time.monotonic(), set()
                for (lesson, name, call), root in zip(calls, roots):
                    t_widget = time.monotonic()
                    root.scroll_into_view_if_needed()
                    assert root.count() == 1 and root.inner_text().strip(), f"{name} is empty"
                    bad = root.evaluate(_LABELS_JS)
                    if bad:
                        root.screenshot(path=str(SHOTS / f"{lesson}_{name}_labels.png"))
                    assert not bad, f"lesson {lesson} {name}: labels cut off or alone: {bad}"
                    if name == "MemoryCalculator" and lesson == "00":
                        _calculator(page, root, expect)
                    if name == "BubbleWidget":
                        _bubble_run(page, root, expect)
                    moved = _drive(page, root, 99 if name not in driven else 1)
                    driven.add(name)  # a second one of a kind (lesson 04's calculator): one control
                    no_errors(f"lesson {lesson} {name}")
                    assert any(changed for _, changed in moved), \
                        f"lesson {lesson} {name}: no control changed what it shows: {moved}"
                    if name == "BubbleWidget":
                        _bubble_refusal(page, root, expect)
                        no_errors(f"lesson {lesson} {name}, V = 4")
                    root.scroll_into_view_if_needed()
                    root.screenshot(path=str(SHOTS / f"{lesson}_{name}.png"))
                    print(f"lesson {lesson} {name}: {len(moved)} controls moved, "
                          f"{sum(c for _, c in moved)} changed it "
                          f"({time.monotonic() - t_widget:.1f} s)")
                lab.note_processes()
                page.screenshot(path=str(SHOTS / "notebook.png"))
                assert not page_errors, f"errors in the page: {page_errors}"
                print(f"driving the widgets took {time.monotonic() - t_drive:.1f} s")
            finally:
                browser.close()
    except BaseException:
        print(f"\n--- JupyterLab log (tail) ---\n{lab.log_tail()}")
        raise
    finally:
        lab.close()
    print(f"total {time.monotonic() - t0:.1f} s; screenshots in {SHOTS}")
