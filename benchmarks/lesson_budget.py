"""Per lesson: wall time and peak memory of the kernel plus its ranks, against the course budget.

    python benchmarks/lesson_budget.py                 # every lesson, all cores
    python benchmarks/lesson_budget.py --cpus 1        # pinned to one CPU, like Binder
    python benchmarks/lesson_budget.py --cpus 0,1      # the course budget: all cores, then 1 CPU
    python benchmarks/lesson_budget.py solutions/01_*.ipynb

Runs each notebook top to bottom in a fresh kernel (nbclient) and samples, every 50 ms, the memory
of every process below this one (the kernel and the ranks it forks).  RSS counts pages shared between
processes once per process (an upper bound); PSS splits them fairly (what the machine really spends).
Budget: <= 60 s and <= 2 GB total per lesson (Binder's limit).  The memory verdict is on PSS: forked
ranks map the kernel's pages (torch alone is ~200 MB resident), so RSS summed over 8 ranks counts
the same pages 9 times and passes 2 GB before a rank has done anything; PSS gives each shared page
to its sharers once, which is what a container's memory limit (Binder's 2 GB) charges.  Both are
printed.  The solution notebooks are run by default, so every exercise's code path is exercised too.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from minitrain.runtime.launch import descendants

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S, BUDGET_BYTES = 60, 2 * 1024 ** 3


def memory_of(pids: list[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def run_lesson(path: Path, timeout: int = 120) -> dict:
    nb = nbformat.read(path, as_version=4)
    peak = {"rss": 0, "pss": 0, "procs": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            pids = descendants(os.getpid())
            rss, pss = memory_of(pids)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            peak["procs"] = max(peak["procs"], len(pids))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    error = None
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as exc:  # noqa: BLE001 - report and go on to the next lesson
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return dict(lesson=path.name, seconds=seconds, error=error, **peak)


def pin(cpus: int | None) -> int:
    """Pin this process (and so the kernels it starts) to the first ``cpus`` CPUs (None: all)."""
    allowed = sorted(os.sched_getaffinity(0) if cpus else range(os.cpu_count() or 1))
    os.sched_setaffinity(0, set(allowed[:cpus] if cpus else allowed))
    if cpus:
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    return len(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--cpus", default="0",
                        type=lambda text: [int(n) for n in text.split(",")],
                        help="pin to this many CPUs (Binder: 1; 0: all); a list (0,1) runs each "
                             "lesson once per value")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "solutions").glob("[0-9]*.ipynb"))
    print(f"{'lesson':40s} {'CPUs':>4s} {'wall s':>7s} {'peak RSS MiB':>13s} {'peak PSS MiB':>13s} "
          f"{'procs':>5s}  budget: {BUDGET_S} s, {BUDGET_BYTES / 2**30:g} GiB PSS")
    worst = 0
    for path in paths:
        for cpus in args.cpus:
            n = pin(cpus or None)
            r = run_lesson(path)
            ok = r["error"] is None and r["seconds"] <= BUDGET_S and r["pss"] <= BUDGET_BYTES
            worst |= not ok
            print(f"{r['lesson']:40s} {n:4d} {r['seconds']:7.1f} {r['rss'] / 2**20:13.0f} "
                  f"{r['pss'] / 2**20:13.0f} {r['procs']:5d}  "
                  f"{'ok' if ok else 'OVER' if not r['error'] else r['error']}", flush=True)
    raise SystemExit(1 if worst else 0)


if __name__ == "__main__":
    main()
