"""Shared fixtures: ranks are started once per world size and reused by every test that needs them."""

import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
from contextlib import contextmanager

import cloudpickle
import pytest
import torch

from minitrain import Cluster

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the functions a passing check keeps (your minitrain) go to a scratch folder, not the repository;
# made here unless the environment names one, and then removed when the session ends
_MINE = None
if not os.environ.get("MINITRAIN_MINE"):
    _MINE = os.environ["MINITRAIN_MINE"] = tempfile.mkdtemp(prefix="minitrain-mine-")


def pytest_sessionfinish(session, exitstatus):
    if _MINE is not None:
        shutil.rmtree(_MINE, ignore_errors=True)


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` returns a running Cluster of n ranks, started at most once per session."""
    live: dict[int, Cluster] = {}

    def get(n: int) -> Cluster:
        if n not in live:
            live[n] = Cluster(n, timeout=20, threads=1)
        return live[n].start()

    yield get
    for c in live.values():
        c.close()


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_same_run(run: dict, ref: dict, rel: float = 1e-5) -> None:
    """``run`` trained like ``ref`` (both from ``train(..., return_state=True)``): every step's loss
    within ``rel`` relative, and the same final weights under the single-process names.

    Weights: Adam divides each gradient element by its own RMS, so float rounding in elements whose
    gradient is ~0 moves them by a fraction of one step (lr = 1e-3): allow 5% of one step.
    """
    assert len(run.losses) == len(ref.losses) > 0
    for a, b in zip(run.losses, ref.losses):
        assert abs(a - b) <= rel * abs(b), (a, b)
    assert sorted(run.state) == sorted(ref.state)  # the full model, single-process names
    for name, ref_value in ref.state.items():
        torch.testing.assert_close(run.state[name], ref_value, rtol=1e-4, atol=5e-5, msg=name)


@contextmanager
def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported as module ``name``, shipped to ranks by value (they were
    forked before it was imported); removed again on exit."""
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    try:
        yield module
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop(name, None)


def pytest_report_header(config):
    """The versions under test, in the log: CI installs what a fresh install resolves today."""
    from importlib.metadata import PackageNotFoundError, version

    names = ("torch", "numpy", "cloudpickle", "matplotlib", "ipywidgets", "ipykernel", "nbval",
             "nbclient", "jupyterlab", "playwright")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return "minitrain is tested with: " + ", ".join(found)


@pytest.fixture
def no_spawn(monkeypatch):
    """No rank may start during the test: every refusal comes before spawning.  Forking new ranks
    fails the test; clusters that are already running (the `clusters` fixture's) are left alone."""
    def refused(self, *args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(Cluster, "_start", refused)
