"""Is grading sealed off within 20 % of a grader that is not?  Times ``minitrain grade``
on a class of lesson-00 notebooks against a reference graded in the same run, interleaved.

    python benchmarks/grade_bench.py                        # 20 notebooks, 3 repeats, vs 7c23352^
    python benchmarks/grade_bench.py --quick                # 4 notebooks, 1 repeat: does it run?
    python benchmarks/grade_bench.py --unsealed-reference   # vs this grader's own --unsealed run

The class: copies of lesson 00, solved (``solutions/``) and blank (``lessons/``) in turn, as in
``tests/test_grade.py``.  The reference is, by default, the grader of ``--reference-commit``
(``7c23352^``, the last revision whose grader ran notebooks unsealed), run from a ``git worktree``
of that revision in a temporary folder (removed at the end), with that revision's package in its
kernels too (PYTHONPATH): each grader as it was shipped.  Lesson 00's check cells are the same in
both, so both grade the same notebooks.  ``--unsealed-reference`` instead compares with this
checkout's grader run ``--unsealed`` (no bubblewrap, no cgroup, but the same judge): the cost of
the sandbox alone, not of the whole redesign.

Each repeat runs the graders one after the other (ABAB...), each on a fresh gradebook, after one
untimed warm-up run of each (caches; the worktree's first imports compile it); every gradebook is
checked (solved: pass, blank: fail, every row graded) before its time counts.  The report: each
run's seconds, the medians, and the ratio sealed / reference (the budget: at most 1.20).
Run it on a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSON = "00_why_one_device_is_not_enough.ipynb"
EXERCISE = "zero_bytes_per_device"
BUDGET = 1.20


def make_class(folder: Path, n: int) -> dict[str, str]:
    """``n`` copies of lesson 00 in ``folder``, solved and blank in turn; {file name: "solved" or
    "blank"}."""
    folder.mkdir(parents=True)
    kinds = {}
    for i in range(n):
        kind = "solved" if i % 2 == 0 else "blank"
        name = f"00_student{i:03d}_{kind}.ipynb"
        shutil.copy(ROOT / ("solutions" if kind == "solved" else "lessons") / LESSON, folder / name)
        kinds[name] = kind
    return kinds


def check_gradebook(out: Path, kinds: dict[str, str], label: str) -> str:
    """What ``out`` says, in a few words; SystemExit when it is not the expected gradebook (a time
    for notebooks that were not really graded would mean nothing)."""
    with open(out, newline="", encoding="utf-8") as f:
        rows = {Path(r["file"]).name: r for r in csv.DictReader(f)}
    wrong = []
    for name, kind in kinds.items():
        row = rows.get(name)
        verdict = (row or {}).get(EXERCISE, "")
        if (row is None or not row["status"].startswith("graded")
                or (verdict != "pass" if kind == "solved" else not verdict.startswith("fail"))):
            wrong.append(f"{name} ({kind}): {row and {k: row[k] for k in ('status', EXERCISE)}}")
    if wrong or len(rows) != len(kinds):
        raise SystemExit(f"grade_bench: the {label} grader's gradebook is not what it should be "
                         f"({len(rows)} rows for {len(kinds)} notebooks):\n  " + "\n  ".join(wrong))
    passed = sum(r[EXERCISE] == "pass" for r in rows.values())
    return f"{len(rows)} rows, {passed} pass, {len(rows) - passed} fail"


def run_grader(label: str, cmd: list[str], cwd: Path, env: dict, out: Path, kinds: dict,
               folder: Path) -> float:
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    done = subprocess.run([*cmd, str(folder), "--out", str(out)], cwd=cwd, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"grade_bench: the {label} grader failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    check_gradebook(out, kinds, label)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--notebooks", type=int, help="notebooks in the class (default 20; --quick: 4)")
    p.add_argument("--repeats", type=int, help="timed runs of each grader (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="4 notebooks, 1 repeat: checks that the benchmark runs")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed run of one notebook with each grader")
    p.add_argument("--reference-commit", default="7c23352^", metavar="REV",
                   help="the revision whose grader is the reference (default: %(default)s, the "
                        "last unsealed grader)")
    p.add_argument("--unsealed-reference", action="store_true",
                   help="compare with this checkout's grader run --unsealed instead")
    p.add_argument("--timeout", type=float, default=300, help="seconds per notebook (the graders' "
                   "--timeout, default %(default)s)")
    args = p.parse_args(argv)
    n = args.notebooks or (4 if args.quick else 20)
    repeats = args.repeats or (1 if args.quick else 3)
    if n < 1 or repeats < 1:
        p.error("--notebooks and --repeats must be at least 1")

    grade = [sys.executable, "-m", "minitrain", "grade", "--timeout", f"{args.timeout:g}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with tempfile.TemporaryDirectory(prefix="minitrain-grade-bench-") as tmp:
        tmp = Path(tmp)
        kinds = make_class(tmp / "class", n)
        sealed = ("sealed", grade, ROOT, env)  # this checkout's minitrain (the working folder)
        worktree = None
        try:
            if args.unsealed_reference:
                reference = ("unsealed", [*grade, "--unsealed"], ROOT, env)
                what = "this checkout's grader, --unsealed"
            else:
                worktree = tmp / "reference"
                made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                                       "--quiet", str(worktree), args.reference_commit],
                                      capture_output=True, text=True)
                if made.returncode != 0:
                    worktree = None
                    raise SystemExit(f"grade_bench: cannot check out {args.reference_commit} "
                                     f"({made.stderr.strip()}); pass --unsealed-reference to "
                                     "compare with this grader's --unsealed run instead")
                rev = subprocess.run(["git", "-C", str(worktree), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
                reference = ("reference", grade, worktree, {**env, "PYTHONPATH": str(worktree)})
                what = f"the grader of {args.reference_commit} ({rev}), from a git worktree"
            print(f"class: {n} lesson-00 notebooks ({(n + 1) // 2} solved, {n // 2} blank); "
                  f"{repeats} timed run(s) of each, interleaved; reference: {what}")
            print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
                  f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", flush=True)
            graders = [sealed, reference]
            if not args.no_warmup:  # warm caches; the worktree's first imports compile it
                first = next(iter(kinds))
                (tmp / "warm").mkdir()
                shutil.copy(tmp / "class" / first, tmp / "warm" / first)
                for label, cmd, cwd, e in graders:
                    run_grader(label, cmd, cwd, e, tmp / "warm.csv", {first: kinds[first]},
                               tmp / "warm")
                print("warm-up: 1 notebook with each grader, untimed", flush=True)
            times: dict[str, list[float]] = {label: [] for label, *_ in graders}
            for r in range(repeats):
                for label, cmd, cwd, e in graders:
                    out = tmp / f"{label}-{r}.csv"
                    seconds = run_grader(label, cmd, cwd, e, out, kinds, tmp / "class")
                    times[label].append(seconds)
                    print(f"run {r + 1} {label:9s} {seconds:7.1f} s  ({seconds / n:.2f} s per "
                          f"notebook; {check_gradebook(out, kinds, label)})", flush=True)
        finally:
            if worktree is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(worktree)], capture_output=True)
                subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)
    a, b = (statistics.median(times[label]) for label, *_ in graders)
    ratio = a / b
    print(f"median: sealed {a:.1f} s, {graders[1][0]} {b:.1f} s; ratio {ratio:.3f} "
          f"({(ratio - 1) * 100:+.1f} %; the budget is {BUDGET:.2f}: "
          f"{'within' if ratio <= BUDGET else 'OVER'})")
    print(f"load average after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
