"""Gradient compression in DDP: step time, bytes sent and loss of each compressor vs uncompressed.

    python benchmarks/compression_bench.py [--model small] [--steps 20] [--batch-size 16]
                                           [--bucket-mb 25] [--compress topk:0.01 int8 ...]

For 2 and 3 ranks, in one cluster, minitrain's DDP trains one replica of the same GPT per
configuration — uncompressed, then each compressor (with error feedback) — on the same batches,
alternating configuration step by step (so drifting machine load hits all alike).  Each replica has
its own tracer.  Prints per configuration: the median step time (a step ends when its slowest rank
ends) and its ratio to uncompressed; the bytes each rank sends per step under the ring model (the
tracer's ``sent_bytes``; compressed buckets are all-gathered, PowerSGD's factors all-reduced) and
uncompressed ÷ compressed; and the mean loss over the ranks after the last step.

On one machine the "network" is loopback at several GB/s, so the time column mostly shows what
compressing and decompressing cost; the bytes column is what a slow link between machines would see.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minitrain import PRESETS, Cluster, GPT
from minitrain.comm import Comm, Tracer
from minitrain.data import ArithmeticData, shard
from minitrain.parallel.data_parallel import DistributedDataParallel

SPECS = ["topk:0.01", "topk:0.1", "int8", "sign", "powersgd:4"]


def run_all(model_name: str, specs: list, steps: int, batch: int, bucket_mb: float | None):
    """On each rank: one DDP replica per spec (None: uncompressed), trained side by side."""
    cfg = PRESETS[model_name]
    data, r, n = ArithmeticData(cfg.seq_len, 0), dist.get_rank(), dist.get_world_size()
    wrappers = {s: DistributedDataParallel(GPT(cfg, seed=0), Comm(None, Tracer(), str(s)),
                                           bucket_cap_mb=bucket_mb, compression=s)
                for s in specs}
    optims = {s: torch.optim.Adam(w.module.parameters(), lr=1e-3) for s, w in wrappers.items()}
    times: dict = {s: [] for s in specs}
    losses: dict = {}
    for step in range(steps + 2):  # two warm-up steps, untimed and untraced
        if step == 2:
            for w in wrappers.values():
                w.comm.tracer.clear()
        x, y = data.batch(step, batch)
        x, y = shard(x, r, n), shard(y, r, n)
        shift = step % len(specs)
        for s in specs[shift:] + specs[:shift]:
            dist.barrier()
            t0 = time.perf_counter()
            optims[s].zero_grad()
            loss = wrappers[s](x, y)
            loss.backward()
            optims[s].step()
            times[s].append(time.perf_counter() - t0)
            losses[s] = loss.item()
    sent = {s: w.comm.tracer.summary().get("total", {}).get("sent_bytes", 0.0) / steps
            for s, w in wrappers.items()}
    return {s: dict(times=times[s][2:], sent=sent[s], loss=losses[s]) for s in specs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="default: PyTorch's 25 MiB with a 1 MiB first bucket")
    parser.add_argument("--compress", nargs="+", default=SPECS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    specs = [None] + args.compress
    print(f"model {args.model} ({PRESETS[args.model].num_params():,} parameters), global batch "
          f"{args.batch_size}, {args.steps} steps, buckets "
          f"{args.bucket_mb or 'default'} MiB, error feedback on")
    print(f"{'ranks':>5s} {'compress':>11s} {'step ms':>8s} {'time x':>7s} {'KiB sent/step':>14s} "
          f"{'bytes ÷':>8s} {'loss':>7s}")
    for n in args.ranks:
        with Cluster(n, backend="gloo", threads=1) as cluster:
            res = cluster.run(run_all, args.model, specs, args.steps, args.batch_size,
                              args.bucket_mb)
        step_ms = {s: statistics.median(max(ts) for ts in zip(*(r[s]["times"] for r in res))) * 1e3
                   for s in specs}
        for s in specs:
            sent = statistics.mean(r[s]["sent"] for r in res)
            loss = statistics.mean(r[s]["loss"] for r in res)
            base = statistics.mean(r[None]["sent"] for r in res)
            print(f"{n:5d} {s or 'none':>11s} {step_ms[s]:8.1f} {step_ms[s] / step_ms[None]:7.2f} "
                  f"{sent / 1024:14.1f} {base / sent:8.1f} {loss:7.4f}")


if __name__ == "__main__":
    main()
