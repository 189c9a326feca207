"""minitrain's ring all-reduce (send/recv, pipelined in sub-chunks) against gloo's ``all_reduce``.

    python benchmarks/ring_bench.py [--sizes 1 16 64] [--ranks 2 4] [--reps 5] [--pieces N]

For each world size and tensor size (MiB of float32), both run on the same cluster in turns (so
drifting machine load hits both alike), after a barrier each.  Prints the median time of each (a
call ends when its slowest rank ends), the ratio ring / gloo (target <= 1.25 at 16 and 64 MiB) and
the bus bandwidth 2(N-1)/N · bytes / time of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minitrain import Cluster
from minitrain.comm import Comm, ring_all_reduce


def timings(mib: float, reps: int, pieces: int | None) -> dict:
    """Seconds of each call on this rank: ``{"ring": [...], "gloo": [...]}`` (one warm-up each)."""
    comm = Comm()
    comm.tracer.enabled = False
    x = torch.randn(int(mib * 2 ** 20) // 4)
    out = {"ring": [], "gloo": []}
    for i in range(reps + 1):
        for kind in (("ring", "gloo") if i % 2 == 0 else ("gloo", "ring")):
            y = x.clone()
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "ring":
                ring_all_reduce(y, comm, pieces=pieces)
            else:
                dist.all_reduce(y)
            if i:
                out[kind].append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pieces", type=int, default=None, help="sub-chunks per chunk (default: ~2 MiB each)")
    args = parser.parse_args()
    print(f"{'ranks':>5} {'MiB':>5} {'ring ms':>9} {'gloo ms':>9} {'ratio':>6} {'ring GB/s':>10} {'gloo GB/s':>10}")
    for n in args.ranks:
        with Cluster(n, backend="gloo", threads=1) as cluster:
            for mib in args.sizes:
                res = cluster.run(timings, mib, args.reps, args.pieces)
                med = {k: statistics.median(max(ts) for ts in zip(*(r[k] for r in res)))
                       for k in ("ring", "gloo")}
                bus = lambda s: 2 * (n - 1) / n * mib * 2 ** 20 / s / 1e9  # noqa: E731
                print(f"{n:5d} {mib:5g} {med['ring'] * 1e3:9.1f} {med['gloo'] * 1e3:9.1f} "
                      f"{med['ring'] / med['gloo']:6.2f} {bus(med['ring']):10.2f} {bus(med['gloo']):10.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
