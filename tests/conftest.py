"""Shared fixtures: ranks are started once per world size and reused by every test that needs them."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import cloudpickle
import pytest
import torch

from minitrain import Cluster

os.environ.setdefault("OMP_NUM_THREADS", "1")
# every rank the suite starts runs in the taint mode (minitrain/device.py): a tensor the package
# makes without a device that reaches a collective or meets a parameter fails the test, as it
# would stop a run on GPUs; MINITRAIN_TAINT=0 turns it off
os.environ.setdefault("MINITRAIN_TAINT", "1")
# the functions a passing check keeps (your minitrain) go to a scratch folder, not the repository;
# made here unless the environment names one, and then removed when the session ends
_MINE = None
if not os.environ.get("MINITRAIN_MINE"):
    _MINE = os.environ["MINITRAIN_MINE"] = tempfile.mkdtemp(prefix="minitrain-mine-")


def pytest_sessionfinish(session, exitstatus):
    for proc, _ in _NBVAL_RUNS.values():
        stop_tree(proc)
    if _NBVAL_DIR[0] is not None:
        shutil.rmtree(_NBVAL_DIR[0], ignore_errors=True)
    if _MINE is not None:
        shutil.rmtree(_MINE, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The quick tier: pytest -m "not slow"
# --------------------------------------------------------------------------------------------------

#: the end-to-end files: every notebook under nbval, the sealed grader, the browser, the widgets'
#: every control, every wrong answer of every exercise inside its strategy, torchrun, the full-disk
#: and killed-run cases.  ``pytest -m "not slow"`` leaves them out (the README's quick tier); CI
#: runs everything.
SLOW_FILES = {"test_lessons.py", "test_nbval_plugin.py", "test_grade.py", "test_grade_attacks.py",
              "test_browser.py", "test_viz_sweep.py", "test_exercise_answers.py",
              "test_torchrun.py", "test_safety.py", "test_checks_never_raise.py"}


#: and the tests that take seconds each (measured: 2 s or more on the course machine): a command in a
#: subprocess (the CLI, torchrun, a fresh interpreter), a deadlock or a timeout waited for, a
#: bubble timed, a resumed run.  The equivalence tests stay in the quick tier.
SLOW_TESTS = {
    "test_checkpoint.py::test_resume_gives_the_uninterrupted_run",
    "test_cli.py::test_json_contract",
    "test_cli.py::test_loss_falls_far_in_a_few_hundred_steps",
    "test_cli.py::test_readable_output_without_json",
    "test_cli.py::test_the_pipeline_summary_reports_its_bubble",
    "test_cli.py::test_the_readable_summary_says_what_offload_put_on_the_host",
    "test_cli.py::test_the_train_command_runs_under_torchrun",
    "test_config_files.py::test_a_test_session_removes_its_scratch_folder_for_kept_functions",
    "test_diagnostics.py::test_a_cell_defined_after_the_ranks_started_still_shows_its_line",
    "test_diagnostics.py::test_a_killed_rank_is_said_to_be_likely_out_of_memory",
    "test_diagnostics.py::test_a_rank_that_is_only_slow_is_not_a_deadlock",
    "test_diagnostics.py::test_a_skipped_collective_is_named_within_seconds",
    "test_diagnostics.py::test_a_wrong_ring_peer_is_named_within_seconds",
    "test_diagnostics.py::test_when_every_rank_waits_their_lines_are_shown_and_kept",
    "test_harness.py::test_the_loss_scale_seam_runs_inside_the_real_strategy",
    "test_launch.py::test_a_call_that_runs_too_long_is_stopped",
    "test_launch.py::test_a_cluster_left_open_at_exit_leaves_nothing_in_the_temporary_folder",
    "test_launch.py::test_a_collective_that_never_completes_times_out_clearly",
    "test_launch.py::test_a_killed_parents_rank_files_are_reaped_at_the_next_start",
    "test_launch.py::test_forked_ranks_do_not_hang_after_the_parent_used_its_thread_pool",
    "test_launch.py::test_functions_defined_in_a_notebook_run_on_the_ranks",
    "test_launch.py::test_importing_the_launcher_and_exiting_costs_what_importing_torch_does",
    "test_launch.py::test_ranks_that_do_not_start_are_forked_again",
    "test_launch.py::test_the_same_code_runs_under_torchrun",
    "test_mesh.py::test_3d_with_sequence_parallel_interleaving_or_without_zero",
    "test_param_server.py::test_sync_equals_a_single_process",
    "test_pipeline.py::test_measured_bubble_of_the_real_model_is_near_the_formula",
    "test_pipeline.py::test_measured_bubble_of_timed_stages_is_the_formula_within_ten_percent",
    "test_precision.py::test_data_parallel_bf16_equals_single_bf16",
    "test_precision.py::test_ddp_fp16_with_loss_scaling_equals_single_fp16",
    "test_precision.py::test_fp16_training_with_a_huge_initial_scale_skips_then_trains",
    "test_precision.py::test_the_cli_reports_precision_and_checkpointing",
    "test_precision.py::test_the_ledger_shows_the_bytes_per_parameter_of_each_precision",
    "test_projection.py::test_the_cli_prints_the_projection_in_its_json",
    "test_reshard.py::test_resume_on_another_layout_gives_the_uninterrupted_run",
    "test_seams_dp.py::test_a_seam_filled_from_outside_trains_like_the_package",
    "test_seams_mp.py::test_a_seam_filled_from_outside_gives_the_packages_losses",
    "test_tensor.py::test_the_cli_keeps_the_json_contract",
    "test_tensor.py::test_three_ranks_six_heads_with_padded_vocabulary_and_sequence",
    "test_threed_cp.py::test_4d_equals_a_single_process",
    "test_threed_cp.py::test_the_cli_trains_the_4d_mesh",
}


def pytest_itemcollected(item):
    if item.path.name in SLOW_FILES or f"{item.path.name}::{item.originalname}" in SLOW_TESTS:
        item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------------------------------
# The lessons under nbval, in the background
# --------------------------------------------------------------------------------------------------

#: tests/test_lessons.py runs every notebook of solutions/ and lessons/ under nbval: minutes of CPU.
#: The rest of the suite leaves the two cores idle much of the time (ranks waiting for each other, a
#: deadlock diagnosed after seconds), so both runs start when collection ends, at a lower priority
#: that leaves the other tests' timing alone, and the lessons' test runs last and reads them.
LESSON_FOLDERS = ("solutions", "lessons")
NBVAL_NICE = 10
_NBVAL_RUNS: dict = {}
_NBVAL_DIR: list = [None]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _is_lessons_test(item) -> bool:
    return item.nodeid.startswith("tests/test_lessons.py::")


def nbval_start(folder: str, out: pathlib.Path, nice: int = 0) -> tuple[subprocess.Popen, pathlib.Path]:
    """Start ``pytest --nbval-lax`` on a folder of notebooks (its JUnit report goes to a file)."""
    report = out / f"{folder}.xml"
    # -p minitrain_nbval: the check cells' expected verdicts, even where the editable install
    # predates the plugin's entry point (tests/test_nbval_plugin.py checks that pytest loads it alone)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider",
                             "-p", "minitrain_nbval", "-q", f"--junitxml={report}", str(ROOT / folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    return proc, report


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything below it (nbval's kernel and the ranks it forked)."""
    from minitrain.runtime.watch import descendants

    if proc.poll() is None:  # still running: its pid is still its own
        below = descendants(proc.pid)
        proc.kill()
        for pid in below:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    proc.wait()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    lessons = [item for item in items if _is_lessons_test(item)]
    if not lessons or config.option.collectonly:
        return
    items[:] = [item for item in items if not _is_lessons_test(item)] + lessons
    _NBVAL_DIR[0] = pathlib.Path(tempfile.mkdtemp(prefix="minitrain-nbval-"))
    for folder in LESSON_FOLDERS:
        _NBVAL_RUNS[folder] = nbval_start(folder, _NBVAL_DIR[0], NBVAL_NICE)


@pytest.fixture(scope="session")
def lesson_runs():
    """{folder: (process, JUnit report)} of the nbval runs started when collection ended."""
    if not _NBVAL_RUNS:  # collected some other way: start them now
        _NBVAL_DIR[0] = pathlib.Path(tempfile.mkdtemp(prefix="minitrain-nbval-"))
        for folder in LESSON_FOLDERS:
            _NBVAL_RUNS[folder] = nbval_start(folder, _NBVAL_DIR[0])
    return _NBVAL_RUNS


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` returns a running Cluster of n ranks, started at most once per session."""
    live: dict[int, Cluster] = {}

    def get(n: int) -> Cluster:
        if n not in live:
            live[n] = Cluster(n, backend="gloo", timeout=20, threads=1)
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
