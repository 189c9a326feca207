"""minitrain's ZeRO against PyTorch's: ZeRO-3 vs FSDP2 (``fully_shard``), in fp32 and with a bf16
mixed-precision policy, ZeRO-1 vs ``ZeroRedundancyOptimizer``; same model, same batches, same run.

    python benchmarks/zero_bench.py [--model small] [--steps 10] [--rounds 2] [--batch-size 16]

ZeRO-3 is used as a PyTorch user uses FSDP2: wrap, then ``torch.optim.Adam(model.parameters())``;
its prefetch timeline gives the share of all-gather time hidden behind compute (last step, rank 0).
For 2 and 4 ranks, the six implementations train identical GPTs side by side in one cluster,
taking turns step by step (so drifting machine load hits all alike).  Prints the median step time of
each pair (a step ends when its slowest rank ends) and the ratio minitrain / PyTorch (target for
ZeRO-3: <= 1.25), then per-rank memory: the model states each one holds between steps (measured
from the tensors: for FSDP2 the local shards of its DTensors) and the peak resident memory of a rank
that trains only that implementation (VmHWM growth over the run, in a fresh cluster, the lower of
two tries; target: ZeRO-3 <= FSDP2).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minitrain import PRESETS, Cluster, GPT
from minitrain.planning.analysis import hidden_fraction
from minitrain.runtime.benchmarking import alternate
from minitrain.comm import Comm
from minitrain.data import ArithmeticData, shard
from minitrain.memory import ledger, rss_bytes
from minitrain.parallel.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from minitrain.parallel.zero import ZeroRedundancyOptimizer

KINDS = ["zero3", "fsdp2", "zero3-bf16", "fsdp2-bf16", "zero1", "torch-zero1"]
PAIRS = (("zero3", "fsdp2"), ("zero3-bf16", "fsdp2-bf16"), ("zero1", "torch-zero1"))


def build(kind: str, model_name: str):
    """(callable model, optimizer, function returning model-state bytes) for one implementation."""
    model = GPT(PRESETS[model_name], seed=0)
    bf16 = kind.endswith("-bf16")
    if kind.startswith("zero3"):
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        fsdp = FullyShardedDataParallel(model, Comm(), mp_policy=policy)
        fsdp.timeline = []
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the shards, as with FSDP2

        def states():
            extra, _ = fsdp.memory_tensors()
            extra["gradients"] = [g for g in extra["gradients"] if g is not None]
            return ledger(model, opt, extra=extra)["bytes"]
        return fsdp, opt, states
    if kind.startswith("fsdp2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        extra = {"mp_policy": TorchPolicy(policy.param_dtype, policy.reduce_dtype)} if bf16 else {}
        for m in [model.embed, *model.blocks, model.head]:
            fully_shard(m, mesh=mesh, **extra)
        fully_shard(model, mesh=mesh, **extra)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def states():
            local = [p.to_local() for p in model.parameters()]
            grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            st = [v.to_local() if hasattr(v, "to_local") else v
                  for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            size = lambda ts: sum(t.numel() * t.element_size() for t in ts if t.dim() > 0)
            return {"parameters": size(local), "gradients": size(grads), "optimizer_states": size(st)}
        return model, opt, states
    if kind == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, Comm(), lr=1e-3)
        return model, opt, lambda: ledger(model, opt, extra=opt.memory_tensors()[0])["bytes"]
    ddp = TorchDDP(model)
    opt = TorchZeRO(model.parameters(), torch.optim.Adam, lr=1e-3)
    return ddp, opt, lambda: ledger(model, opt.optim)["bytes"]  # torch's: the local optimizer


def step_times(model_name: str, steps: int, batch: int, kinds: list[str]):
    """Train one replica per implementation, taking turns step by step; return step times and
    model-state bytes after the last step."""
    runs = {k: build(k, model_name) for k in kinds}
    data, r, n = ArithmeticData(PRESETS[model_name].seq_len, 0), dist.get_rank(), dist.get_world_size()

    def step(kind, x, y):
        model, opt, _ = runs[kind]
        if getattr(model, "timeline", None) is not None:
            model.timeline.clear()  # keep the last step's
        opt.zero_grad()
        model(shard(x, r, n), shard(y, r, n)).backward()
        opt.step()

    out = alternate(kinds, step, data, batch, steps)
    states = {k: {kk: v for kk, v in runs[k][2]().items()
                  if kk in ("parameters", "gradients", "optimizer_states")} for k in kinds}
    hidden = {k: hidden_fraction(runs[k][0].timeline or []) for k in kinds if k.startswith("zero3")}
    return {k: v["times"] for k, v in out.items()}, states, hidden


def peak_rss(model_name: str, steps: int, batch: int, kind: str) -> int:
    """VmHWM growth of a rank that builds and trains only ``kind``."""
    base = rss_bytes(peak=True)
    step_times(model_name, steps, batch, [kind])
    return rss_bytes(peak=True) - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    print(f"model {args.model} ({PRESETS[args.model].num_params():,} parameters), global batch "
          f"{args.batch_size}, {args.rounds} rounds x {args.steps} steps, implementations alternating")
    mb = 1 / 2 ** 20
    for n in (2, 4):
        per = {k: [] for k in KINDS}
        with Cluster(n, backend="gloo", threads=1) as cluster:
            for _ in range(args.rounds):
                res = cluster.run(step_times, args.model, args.steps, args.batch_size, KINDS)
                for k in KINDS:
                    per[k] += [max(ts) for ts in zip(*(r[0][k] for r in res))]
            states, hidden = res[0][1], res[0][2]
        med = {k: statistics.median(v) for k, v in per.items()}
        print(f"\n{n} ranks: median step time")
        for ours, theirs in PAIRS:
            print(f"  {ours:10s} {med[ours] * 1e3:7.1f} ms   {theirs:12s} {med[theirs] * 1e3:7.1f} ms"
                  f"   ratio {med[ours] / med[theirs]:.3f}")
        print("  all-gather time hidden behind compute (rank 0, last step): " +
              ", ".join(f"{k} {v:.0%}" for k, v in hidden.items() if v is not None))
        rss = {"zero3": [], "fsdp2": []}
        for k in ("zero3", "fsdp2", "fsdp2", "zero3"):  # fresh ranks each; the lower of two tries
            with Cluster(n, backend="gloo", threads=1) as cluster:
                rss[k].append(max(cluster.run(peak_rss, args.model, args.steps, args.batch_size, k)))
        rss = {k: min(v) for k, v in rss.items()}
        print(f"{n} ranks: rank 0's model states between steps (MiB), peak RSS growth (max rank)")
        for k in KINDS:
            s = states[k]
            line = (f"  {k:12s} params {s['parameters'] * mb:6.2f}  grads {s['gradients'] * mb:6.2f}"
                    f"  optimizer {s['optimizer_states'] * mb:6.2f}  total "
                    f"{sum(s.values()) * mb:6.2f}")
            if k in rss:
                line += f"   peak RSS +{rss[k] * mb:6.1f}"
            print(line)
        print(f"  ZeRO-3 / FSDP2: model states {sum(states['zero3'].values()) / sum(states['fsdp2'].values()):.3f}, "
              f"peak RSS growth {rss['zero3'] / rss['fsdp2']:.3f}")


if __name__ == "__main__":
    main()
