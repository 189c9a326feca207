"""minitrain's DDP against torch.nn.parallel.DistributedDataParallel: same model, buckets, run.

    python benchmarks/ddp_bench.py [--model small] [--bucket-mb 1] [--steps 20] [--rounds 3]

For 2 and 4 ranks, both wrappers train the same GPT on the same batches in one cluster, two
replicas side by side, alternating step by step (so drifting machine load hits both alike).  Prints the median step time of each
(a step ends when its slowest rank ends), their ratio (target: minitrain / PyTorch <= 1.05), and the
share of minitrain's all-reduce time hidden behind backward.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minitrain import PRESETS, Cluster, GPT
from minitrain.planning.analysis import overlap_fraction
from minitrain.runtime.benchmarking import alternate
from minitrain.data import ArithmeticData, shard
from minitrain.parallel.data_parallel import DistributedDataParallel


def step_times(model_name: str, bucket_mb: float, steps: int, batch: int):
    """Train two identical replicas side by side, one under each wrapper, alternating step by step
    (so drifting machine load hits both alike); return each one's step times and our overlap."""
    cfg = PRESETS[model_name]
    wrappers = {"minitrain": DistributedDataParallel(GPT(cfg, seed=0), bucket_cap_mb=bucket_mb),
                "torch": TorchDDP(GPT(cfg, seed=0), bucket_cap_mb=bucket_mb)}
    wrappers["minitrain"].timeline = []
    optims = {k: torch.optim.Adam(w.module.parameters(), lr=1e-3) for k, w in wrappers.items()}
    data, r, n = ArithmeticData(cfg.seq_len, 0), dist.get_rank(), dist.get_world_size()

    def step(kind, x, y):
        optims[kind].zero_grad()
        wrappers[kind](shard(x, r, n), shard(y, r, n)).backward()
        optims[kind].step()

    out = alternate(list(wrappers), step, data, batch, steps)
    overlap = [overlap_fraction(s) for s in wrappers["minitrain"].timeline[2:]]
    return {k: v["times"] for k, v in out.items()}, overlap


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
        with Cluster(n, backend="gloo", threads=1) as cluster:
            per = {"minitrain": [], "torch": []}
            overlap = []
            for _ in range(args.rounds):
                res = cluster.run(step_times, args.model, args.bucket_mb, args.steps,
                                  args.batch_size)
                for kind in per:
                    per[kind] += [max(ts) for ts in zip(*(r[0][kind] for r in res))]
                overlap += [o for r in res for o in r[1]]
        ours, theirs = statistics.median(per["minitrain"]), statistics.median(per["torch"])
        print(f"{n:5d} {ours * 1e3:13.1f} {theirs * 1e3:11.1f} {ours / theirs:6.3f} "
              f"{statistics.median(overlap):8.0%}")


if __name__ == "__main__":
    main()
