"""minitrain's DDP against torch.nn.parallel.DistributedDataParallel: same model, buckets, run.

    python benchmarks/ddp_bench.py [--model small] [--bucket-mb 1] [--steps 20] [--rounds 3]

For 2 and 4 ranks, both wrappers train the same GPT on the same batches in one cluster, in
alternating rounds (so drifting machine load hits both alike).  Prints the median step time of each
(a step ends when its slowest rank ends), their ratio (target: minitrain / PyTorch <= 1.05), and the
share of minitrain's all-reduce time hidden behind backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minitrain import PRESETS, Cluster, GPT
from minitrain.data import ArithmeticData, shard
from minitrain.parallel.data_parallel import DistributedDataParallel, overlap_fraction


def step_times(kind: str, model_name: str, bucket_mb: float, steps: int, batch: int):
    cfg = PRESETS[model_name]
    model = GPT(cfg, seed=0)
    if kind == "minitrain":
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, record_timeline=True)
    else:
        ddp = TorchDDP(model, bucket_cap_mb=bucket_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, r, n = ArithmeticData(cfg.seq_len, 0), dist.get_rank(), dist.get_world_size()
    times = []
    for step in range(steps + 2):  # two warm-up steps
        x, y = data.batch(step, batch)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(shard(x, r, n), shard(y, r, n)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    overlap = [overlap_fraction(s) for s in ddp.timeline[2:]] if kind == "minitrain" else []
    return times[2:], overlap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    print(f"model {args.model}, bucket {args.bucket_mb} MB, global batch {args.batch_size}, "
          f"{args.rounds} rounds x {args.steps} steps each")
    print(f"{'ranks':>5s} {'minitrain ms':>13s} {'PyTorch ms':>11s} {'ratio':>6s} {'overlap':>8s}")
    for n in (2, 4):
        with Cluster(n, threads=1) as cluster:
            per = {"minitrain": [], "torch": []}
            overlap = []
            for _ in range(args.rounds):
                for kind in ("minitrain", "torch"):
                    res = cluster.run(step_times, kind, args.model, args.bucket_mb, args.steps,
                                      args.batch_size)
                    per[kind] += [max(ts) for ts in zip(*(r[0] for r in res))]
                    overlap += [o for r in res for o in r[1]]
        ours, theirs = statistics.median(per["minitrain"]), statistics.median(per["torch"])
        print(f"{n:5d} {ours * 1e3:13.1f} {theirs * 1e3:11.1f} {ours / theirs:6.3f} "
              f"{statistics.median(overlap):8.0%}")


if __name__ == "__main__":
    main()
