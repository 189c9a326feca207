"""How fast ranks start, how fast a cell on a live group returns, and what each rank costs in memory.

    python benchmarks/launch_bench.py

Compares the two start methods the launcher can use (fork: the default on Linux; spawn: macOS,
Windows, CUDA).  PSS (proportional set size) splits pages shared between processes fairly, so the
sum of PSS over the kernel and its ranks is what the machine really spends — the number that matters
on Binder's 2 GB.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minitrain import Cluster


def all_reduce_cell():
    t = torch.ones(1024)
    dist.all_reduce(t)
    return t[0].item()


def kib(pid: int, field: str) -> int:
    path = f"/proc/{pid}/smaps_rollup" if field == "Pss:" else f"/proc/{pid}/status"
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def measure(world_size: int, method: str, repeats: int) -> dict:
    starts = []
    for _ in range(repeats):
        c = Cluster(world_size, backend="gloo", start_method=method, threads=1)
        t0 = time.perf_counter()
        c.start()
        starts.append(time.perf_counter() - t0)
        c.close()
    with Cluster(world_size, backend="gloo", start_method=method, threads=1) as c:
        c.run(all_reduce_cell)
        calls = []
        for _ in range(20):
            t0 = time.perf_counter()
            c.run(all_reduce_cell)
            calls.append(time.perf_counter() - t0)
        rss = [kib(p, "VmRSS:") for p in c.pids]
        pss = [kib(p, "Pss:") for p in c.pids]
    return dict(start=statistics.median(starts), call=statistics.median(calls),
                rss=max(rss) / 1024, pss=max(pss) / 1024)


def main() -> None:
    import os
    print(f"kernel/parent: RSS {kib(os.getpid(), 'VmRSS:') / 1024:.0f} MiB")
    print(f"{'method':7s} {'ranks':>5s} {'start s':>8s} {'cell ms':>8s} {'RSS/rank MiB':>13s} "
          f"{'PSS/rank MiB':>13s}")
    for method, repeats in (("fork", 5), ("spawn", 1)):
        for n in (2, 4):
            m = measure(n, method, repeats)
            print(f"{method:7s} {n:5d} {m['start']:8.3f} {m['call'] * 1e3:8.2f} {m['rss']:13.0f} "
                  f"{m['pss']:13.0f}")


if __name__ == "__main__":
    main()
