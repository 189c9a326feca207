"""The launcher: results from every rank, failures named and cleaned up, timeouts, torchrun."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from conftest import pid_alive
from minitrain import Cluster, CollectiveTimeout, RankError, launch
from minitrain.runtime.launch import choose_backend


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_results_come_back_from_every_rank(clusters, n):
    results = clusters(n).run(rank_and_sum)
    assert results == [(r, n, n * (n + 1) / 2) for r in range(n)]


def test_arguments_and_large_results_round_trip(clusters):
    big = torch.arange(100_000, dtype=torch.float32)
    out = clusters(2).run(lambda t, scale=1: t * scale + dist.get_rank(), big, scale=2)
    assert torch.equal(out[0], big * 2) and torch.equal(out[1], big * 2 + 1)


def test_closures_and_lambdas_defined_here_run_on_the_ranks(clusters):
    offset = 41  # captured by value: cloudpickle ships the closure
    assert clusters(3).run(lambda: dist.get_rank() + offset) == [41, 42, 43]


def test_a_cell_on_a_live_group_is_fast(clusters):
    c = clusters(4)
    c.run(rank_and_sum)
    t0 = time.perf_counter()
    for _ in range(5):
        c.run(rank_and_sum)
    per_call = (time.perf_counter() - t0) / 5
    assert per_call < 0.5, f"a call on a running cluster took {per_call:.3f} s"


def test_output_of_ranks_is_forwarded_with_their_rank(clusters, capsys):
    clusters(2).run(lambda: print("hello from", dist.get_rank()))
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def fail_on_rank_one():
    t = torch.ones(1)
    if dist.get_rank() == 1:
        raise ValueError("bad shape on purpose")
    dist.all_reduce(t)  # rank 0 now waits for rank 1, which will never come
    return t.item()


def test_a_rank_that_raises_is_named_quickly_and_cleaned_up():
    c = Cluster(3, backend="gloo", timeout=60)
    c.start()
    pids = list(c.pids)
    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        c.run(fail_on_rank_one)
    elapsed = time.perf_counter() - t0
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "rank 1 failed" in str(err) and "bad shape on purpose" in str(err)
    assert "fail_on_rank_one" in err.remote_traceback  # the rank's own traceback
    assert elapsed < 5, f"the failure took {elapsed:.1f} s to surface (timeout was 60 s)"
    time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), "ranks were left behind"
    # the same object starts fresh ranks, on a new port, and works
    assert [r[2] for r in c.run(rank_and_sum)] == [6.0] * 3
    assert set(c.pids).isdisjoint(pids)
    c.close()
    assert not any(pid_alive(p) for p in c.pids)


def test_ranks_that_do_not_start_are_forked_again(monkeypatch, capsys):
    """A forked rank stuck before joining the group (once in CI: a lock held by a parent thread
    at fork time) — the ranks are stopped and forked again, and the cluster works."""
    launch_module = sys.modules["minitrain.runtime.launch"]  # (minitrain.launch is also a function)
    worker_module = sys.modules["minitrain.runtime.worker"]
    stuck = mp.Value("i", 0)  # shared with the forked ranks: how many got stuck so far
    original = worker_module._die_with_parent

    def first_rank_2_hangs():
        original()
        if mp.current_process().name == "minitrain-rank2":
            with stuck.get_lock():
                first = stuck.value == 0
                stuck.value += 1
            if first:
                time.sleep(3600)

    monkeypatch.setattr(worker_module, "_die_with_parent", first_rank_2_hangs)
    monkeypatch.setattr(launch_module, "FORK_STARTUP_S", 2.0)
    with Cluster(3, backend="gloo", timeout=30) as c:
        assert [r[2] for r in c.run(rank_and_sum)] == [6.0] * 3
    assert stuck.value == 2  # stuck the first time, started the second
    assert "starting them again" in capsys.readouterr().err


def test_a_killed_rank_is_reported_and_the_rest_stopped():
    with Cluster(2, backend="gloo", timeout=60) as c:
        pids = list(c.pids)
        t0 = time.perf_counter()
        with pytest.raises(RankError, match=r"rank 1 failed: .*killed by signal 9"):
            c.run(lambda: os.kill(os.getpid(), signal.SIGKILL) if dist.get_rank() == 1
                  else dist.barrier())
        assert time.perf_counter() - t0 < 5
        time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids)


def test_a_collective_that_never_completes_times_out_clearly():
    def only_rank_zero_reduces():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        else:
            time.sleep(30)

    with Cluster(2, backend="gloo", timeout=1.5) as c:
        t0 = time.perf_counter()
        with pytest.raises(CollectiveTimeout) as info:
            c.run(only_rank_zero_reduces)
        elapsed = time.perf_counter() - t0
    assert info.value.rank == 0
    assert "timeout of 1.5 s" in str(info.value) and "Cluster(timeout=" in str(info.value)
    assert 1.0 < elapsed < 6


def test_a_call_that_runs_too_long_is_stopped():
    with Cluster(2, backend="gloo", timeout=30) as c:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
            c.run(time.sleep, 30, timeout=1)
        assert c.run(lambda: 7) == [7, 7]


def test_spawned_ranks_work_too():
    """spawn is what macOS, Windows and CUDA runs use; cloudpickle makes lambdas work there too."""
    with Cluster(2, backend="gloo", start_method="spawn", timeout=30) as c:
        base = 10
        assert c.run(lambda: dist.get_rank() + base) == [10, 11]


def test_forked_ranks_do_not_hang_after_the_parent_used_its_thread_pool():
    """A kernel that has run torch on 2 threads, then Cluster(1): the forked rank must not enter
    the parent's dead OpenMP pool (it hung in its first parallel op when it ran 2 threads)."""
    script = textwrap.dedent("""
        import torch
        from minitrain import Cluster
        torch.set_num_threads(2)
        a = torch.randn(1000, 1000)
        (a @ a * 2).sum()                       # the parent's OpenMP pool now exists
        def work():
            b = torch.randn(1000, 1000)
            return float((b @ b * 2).sum()), torch.get_num_threads()
        with Cluster(1) as c:
            print(c.run(work, timeout=60)[0][1])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"
    with pytest.raises(ValueError, match="start_method='spawn'"):
        Cluster(1, backend="gloo", threads=2, start_method="fork")
    assert Cluster(1, backend="gloo", threads=2, start_method="spawn").threads == 2


def test_forked_ranks_share_what_a_first_optimizer_step_imports(clusters):
    """A process's first optimizer.step() imports torch._dynamo (seconds of CPU): the parent
    imports it once before forking, so no rank pays for it."""
    def imported_before_a_step():
        import sys
        return "torch._dynamo" in sys.modules

    assert clusters(2).run(imported_before_a_step) == [True, True]


def test_launch_is_a_one_shot_cluster():
    assert launch(rank_and_sum, 2, backend="gloo") == [(0, 2, 3.0), (1, 2, 3.0)]


def test_bad_arguments_are_refused_before_spawning():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        Cluster(0, backend="gloo")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Cluster(2, backend="gloo", timeout=0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        Cluster(2, backend="mpi")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="machine has GPUs")
def test_backend_is_gloo_without_gpus_and_nccl_is_refused():
    assert choose_backend(2) == "gloo"
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        choose_backend(2, "nccl")


def listening_addresses(port: int) -> list[str]:
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    found.append(local.split(":")[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_rendezvous_listens_on_loopback_only(clusters):
    c = clusters(2)
    port = c.port
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::


def test_functions_defined_in_a_notebook_run_on_the_ranks(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch, torch.distributed as dist\n"
                                  "from minitrain import Cluster\n"
                                  "cluster = Cluster(2, backend='gloo', timeout=20).start()"),
        nbformat.v4.new_code_cell("def defined_in_the_notebook(x):\n"
                                  "    t = torch.tensor([x * (dist.get_rank() + 1.0)])\n"
                                  "    dist.all_reduce(t)\n"
                                  "    return t.item()\n"
                                  "print(cluster.run(defined_in_the_notebook, 2))"),
        nbformat.v4.new_code_cell("cluster.close()"),
    ]
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "[6.0, 6.0]" in outputs


TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys, torch
    from minitrain import Comm, ring_all_reduce
    from minitrain.runtime.launch import init_from_env
    rank, world = init_from_env()
    t = torch.arange(5.0) * (rank + 1)
    ring_all_reduce(t, Comm())
    with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as f:
        f.write(f"{rank} {world} {t.tolist()}")
""")


def test_the_same_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"{rank} 2 [0.0, 3.0, 6.0, 9.0, 12.0]"


# --------------------------------------------------------------------------------------------------
# Nothing left behind: a rank's children, a Cluster left open, a killed parent's files
# --------------------------------------------------------------------------------------------------


def test_what_a_dead_rank_started_goes_with_it():
    """A rank that starts a process and dies: the process (now an orphan) is stopped with the
    rank's process group, at the failure — not left running under init."""
    def start_a_child_and_die(path):
        if dist.get_rank() == 1:
            child = subprocess.Popen(["sleep", "300"])
            with open(path, "w") as f:
                f.write(str(child.pid))
            os._exit(3)
        time.sleep(1)

    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "child.pid")
    c = Cluster(2, backend="gloo", timeout=30)
    try:
        with pytest.raises(RankError, match="rank 1 failed: the process exited with code 3"):
            c.run(start_a_child_and_die, path)
        child = int(open(path).read())
        deadline = time.monotonic() + 5
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the dead rank's child is still running"
        assert c.run(lambda: 7) == [7, 7]  # and the next run starts fresh ranks
    finally:
        c.close()


LEFT_OPEN = """
import sys
from minitrain import Cluster
c = Cluster(2, backend="gloo")
c.run(lambda: 1)
sys.modules["__main__"].keep = [c]
keep.append(keep)  # a cycle holds it, as a notebook's namespace can: never collected
print(c.folder, flush=True)
"""


def test_a_cluster_left_open_at_exit_leaves_nothing_in_the_temporary_folder(tmp_path):
    """The rank files live in the cluster's own folder, and a Cluster left open is closed at
    exit: the process's TMPDIR holds nothing of minitrain's (torch's own cache folder,
    ``torchinductor_<user>``, made when torch._dynamo is imported, is torch's)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp / "minitrain-ranks-"))
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], left


HOLD_OPEN = """
import time
from minitrain import Cluster
c = Cluster(2, backend="gloo").start()
print(c.folder, flush=True)
time.sleep(600)
"""


def test_a_killed_parents_rank_files_are_reaped_at_the_next_start(tmp_path, monkeypatch):
    """A parent killed by SIGKILL cannot close its Cluster: its folder stays until the next start
    on the machine removes it (its lock is free) — and a live cluster's folder is left alone."""
    import tempfile
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    killed, live = (subprocess.Popen([sys.executable, "-c", HOLD_OPEN], stdout=subprocess.PIPE,
                                     text=True, env=env) for _ in range(2))
    try:
        folders = [p.stdout.readline().strip() for p in (killed, live)]
        assert all(os.path.isfile(os.path.join(f, "rank0.stderr")) for f in folders), folders
        killed.kill()
        killed.wait()
        time.sleep(0.5)  # its ranks die with it (PR_SET_PDEATHSIG)
        assert os.path.isdir(folders[0])  # nobody closed it
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with Cluster(1, backend="gloo") as c:  # the next start
            mine = c.folder
            assert mine.startswith(str(tmp))
            assert not os.path.exists(folders[0])
            assert os.path.isfile(os.path.join(folders[1], "rank0.stderr"))  # alive: kept
        assert not os.path.exists(mine) and c.folder is None
    finally:
        for p in (killed, live):
            p.kill()
            p.wait()


KILLED_BEFORE_RENAME = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("rankfolder", sys.argv[1])
rankfolder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rankfolder)
os.rename = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed after mkdtemp, before rename
rankfolder.new_folder()
"""


def test_a_start_killed_before_its_folder_was_renamed_leaves_it_to_the_next_start(tmp_path,
                                                                                    monkeypatch):
    """SIGKILL between making a start's folder (``.minitrain-new-<pid>-*``, locked) and renaming it:
    the next start removes it once its process is gone (after a minute's grace); one whose process
    lives, or whose lock is held, or that is younger than that, is left alone."""
    import fcntl
    import tempfile

    from minitrain.runtime import rankfolder
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run([sys.executable, "-c", KILLED_BEFORE_RENAME, rankfolder.__file__],
                          env={**os.environ, "TMPDIR": str(tmp)}, timeout=60)
    assert done.returncode == -signal.SIGKILL
    [killed] = [p for p in tmp.iterdir()]
    assert killed.name.startswith(".minitrain-new-") and (killed / "owner.lock").exists()
    assert not pid_alive(int(killed.name.split("-")[2]))
    young = tmp / ".minitrain-new-999999999-young"  # no such pid, but just made: a minute's grace
    young.mkdir()
    mine = tmp / f".minitrain-new-{os.getpid()}-live"  # this process: alive
    held = tmp / ".minitrain-new-999999999-held"  # no such pid here, but its lock is held
    for folder in (mine, held):
        folder.mkdir()
    (held / "owner.lock").write_text("")
    lock = os.open(held / "owner.lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        old = time.time() - 120
        for folder in (killed, mine, held):
            os.utime(folder, (old, old))
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        folder, fd = rankfolder.new_folder()  # the next start
        rankfolder.remove_folder(folder, fd)
        assert sorted(p.name for p in tmp.iterdir()) == sorted([young.name, mine.name, held.name])
    finally:
        os.close(lock)


EXIT_PROBE = """
import atexit, sys
atexit.register(lambda: print("torch._dynamo" in sys.modules))  # runs last: registered first
import {module}
"""


def _cpu_seconds(code: str, env=None) -> float:
    """CPU seconds (user + system) a fresh interpreter running ``code`` takes, the least of 3:
    CPU time, not wall time, so that a busy machine does not make the comparison flaky."""
    import resource
    best = float("inf")
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return best


def test_importing_the_launcher_and_exiting_costs_what_importing_torch_does():
    """Nothing is imported at exit (torch._dynamo, 1-2 s of CPU, is imported only when a Cluster
    forks its ranks), so a CLI call or a script pays for torch and little more."""
    for module in ("minitrain", "minitrain.runtime.launch"):
        out = subprocess.run([sys.executable, "-c", EXIT_PROBE.format(module=module)],
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", f"importing {module} imports torch._dynamo at exit"
    torch_s = _cpu_seconds("import torch")
    launcher_s = _cpu_seconds("import minitrain.runtime.launch")
    assert launcher_s <= 1.25 * torch_s + 0.4, (launcher_s, torch_s)
