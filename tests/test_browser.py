"""Lesson 00 in a real browser: JupyterLab + headless Chromium render and drive the memory calculator.

Starts JupyterLab on loopback (isolated config, runtime, settings and workspace dirs), opens
``lessons/00_why_one_device_is_not_enough.ipynb`` in Debian's ``chromium`` driven by Playwright,
runs all cells from the Run menu, checks the ipywidgets calculator rendered, switches it to 8
devices with ZeRO stage 3, checks the per-device number went down and saves a screenshot to
``artifacts/browser/lesson00_calculator.png``.

Needs ``chromium`` on PATH (``apt-get install chromium``), the ``playwright`` Python package (no
``playwright install``: the system browser is used) and JupyterLab with ``jupyterlab_widgets``.
Skipped when one is missing, except under ``CI=true``, where that is a failure.
``MINITRAIN_BROWSER_LESSONS`` points the test at another folder holding a notebook of that name.
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

from minitrain.launch import descendants

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"
NOTEBOOK = "00_why_one_device_is_not_enough.ipynb"
SCREENSHOT = ROOT / "artifacts" / "browser" / "lesson00_calculator.png"

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic"]
SERVER_START_S = 60  # until JupyterLab answers /api/status
RUN_S = 120  # from "Run All Cells" until the widget is rendered and the kernel is idle
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
        # User settings: no news or update toasts, and no autosave (the lesson must stay as it is).
        settings = tmp / "lab-settings" / "@jupyterlab"
        for plugin, values in (("apputils-extension/notification",
                                {"fetchNews": "false", "checkForUpdates": False}),
                               ("docmanager-extension/plugin", {"autosave": False})):
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


def _gb(text: str) -> float:
    m = re.fullmatch(r"([\d,.]+) (GB|MB) per device", text.strip())
    assert m, f"unexpected per-device text {text!r}"
    return float(m[1].replace(",", "")) * (1 if m[2] == "GB" else 1e-3)


@pytest.mark.timeout(300)
def test_lesson00_memory_calculator_in_jupyterlab(tmp_path):
    chromium, sync_playwright, expect = _requirements()
    lessons = Path(os.environ.get("MINITRAIN_BROWSER_LESSONS") or LESSONS).resolve()
    assert (lessons / NOTEBOOK).is_file(), f"no {NOTEBOOK} in {lessons}"
    original = (lessons / NOTEBOOK).read_bytes()

    t0 = time.monotonic()
    lab = Lab(lessons, tmp_path)
    try:
        lab.wait_ready()
        t_server = time.monotonic() - t0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.set_default_timeout(UI_S * 1000)
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                # ?reset: start from an empty workspace whatever was saved before.
                page.goto(f"{lab.base}/lab/tree/{NOTEBOOK}?reset&token={lab.token}")
                page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
                _wait_kernel_settled(page, UI_S)  # kernel started and idle before running
                lab.note_processes()

                t_run = time.monotonic()
                page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
                page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()

                calc = page.locator(".jp-OutputArea-output .mt-memory-calculator")
                per_device = calc.locator(".mt-per-device")
                per_device.wait_for(timeout=RUN_S * 1000)
                lab.note_processes()
                _wait_kernel_settled(page, max(1, RUN_S - (time.monotonic() - t_run)))
                lab.note_processes()
                t_run = time.monotonic() - t_run

                assert calc.count() == 1, "expected one memory calculator"
                stage = calc.locator(".mt-zero-stage")
                assert "widget-toggle-buttons" in stage.get_attribute("class")
                buttons = stage.locator("button")
                assert [b.strip() for b in buttons.all_inner_texts()] == ["0", "1", "2", "3"]
                in_html = calc.locator(".widget-html > .widget-html-content .mt-per-device")
                assert in_html.count() == 1, "the result should be one ipywidgets HTML"
                before = per_device.inner_text().strip()
                print(f"\nbefore: {before}")
                _gb(before)

                devices = calc.locator(".widget-dropdown").filter(
                    has=page.locator("label", has_text=re.compile(r"^devices$"))).locator("select")
                devices.select_option(label="8")
                three = buttons.filter(has_text=re.compile(r"^\s*3\s*$"))
                three.click()
                # The HTML widget replaces its content, so poll the locator, not an element handle.
                expect(per_device).not_to_have_text(before, timeout=UI_S * 1000)
                # The last change sent (stage 3) has been applied once the kernel is idle again.
                _wait_kernel_settled(page, UI_S)
                assert "mod-active" in three.get_attribute("class")
                assert devices.input_value() == "8" or devices.evaluate(
                    "s => s.options[s.selectedIndex].textContent.trim()") == "8"
                after = per_device.inner_text().strip()
                print(f"after (8 devices, ZeRO 3): {after}")
                assert after != before
                assert _gb(after) < _gb(before), "ZeRO-3 over 8 devices should need less per device"

                calc.scroll_into_view_if_needed()
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOT))
                print(f"screenshot: {SCREENSHOT}")
                assert not errors, f"errors in the page: {errors}"
            finally:
                browser.close()
    except BaseException:
        print(f"\n--- JupyterLab log (tail) ---\n{lab.log_tail()}")
        raise
    finally:
        lab.close()
    assert (lessons / NOTEBOOK).read_bytes() == original, "the test must not save the notebook"
    print(f"server up {t_server:.1f} s, run all {t_run:.1f} s, total {time.monotonic() - t0:.1f} s")
