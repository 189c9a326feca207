"""Tensor parallel: minitrain's ``tensor`` strategy vs PyTorch's DTensor tensor parallelism, same run.

    python benchmarks/tp_bench.py [--ranks 2 4] [--model 4x256] [--batch-size 8] [--steps 10]
                                  [--rounds 2]

For each world size N (= TP size) both implementations train the same GPT, split the same way, on
the same batches, in one cluster:

* ours: :class:`minitrain.strategies.tensor.TensorParallel` — column/row-parallel linears with f/g,
  heads split, vocabulary-parallel embedding and cross-entropy;
* PyTorch's: ``parallelize_module`` on a device mesh ``"cpu"`` (gloo) with ``ColwiseParallel`` on
  ``qkv`` and ``fc``, ``RowwiseParallel`` on the two ``proj``, ``RowwiseParallel`` on the token
  embedding (vocabulary-parallel) and ``ColwiseParallel`` on the output layer, its loss computed
  under ``loss_parallel()`` (no logits gathered) — the same split as ours.  The fused ``qkv`` rows
  are permuted so that ColwiseParallel's even split hands each rank its heads' rows of q, k and v,
  and its attention runs with n_head / N local heads (:class:`LocalHeadsAttention`).

The two take turns step by step (so drifting machine load hits both alike); a step is timed from a
barrier to the end of the optimizer step and ends when its slowest rank ends.  Prints the median step
time of each, the ratio minitrain / PyTorch (target <= 1.0) and the largest relative difference of
each one's per-step losses from a single process (fp32; target 1e-5), so the race is between equal
computations.  One torch thread per rank; with more ranks than cores the ranks share cores.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitrain import PRESETS, Cluster, GPT, train
from minitrain.runtime.benchmarking import alternate
from minitrain.comm import Comm
from minitrain.data import ArithmeticData
from minitrain.model import GPTConfig
from minitrain.parallel.tensor import shard_tensor
from minitrain.strategies.tensor import TensorParallel
from minitrain.strategies import TrainConfig

#: the presets, plus one whose 8 heads split over 2 and 4 ranks and whose matmuls are not trivial
MODELS = {**PRESETS, "4x256": GPTConfig(n_layer=4, n_head=8, d_model=256, seq_len=64)}
LR = 1e-3


class LocalHeadsAttention(nn.Module):
    """The model's attention for DTensor TP: ``qkv`` returns this rank's [q_r; k_r; v_r] (a plain
    local tensor), attention runs over its n_head / N heads, ``proj`` sums the ranks' outputs."""

    def __init__(self, attn: nn.Module, tp: int):
        super().__init__()
        self.qkv, self.proj, self.heads = attn.qkv, attn.proj, attn.n_head // tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        width = q.shape[-1]
        q, k, v = (z.view(b, t, self.heads, width // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class TorchTP:
    """PyTorch's tensor parallelism (DTensor) on the same GPT."""

    def __init__(self, cfg: GPTConfig):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        n = dist.get_world_size()
        mesh = init_device_mesh("cpu", (n,))
        self.model = GPT(cfg, seed=0)
        plan = {"embed.tok": RowwiseParallel(input_layouts=Replicate()),
                "head.out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i, block in enumerate(self.model.blocks):
            with torch.no_grad():  # rank r's even slice = its heads' rows of q, k and v
                w = block.attn.qkv.weight
                w.copy_(torch.cat([shard_tensor(w, r, n, 0, parts=3) for r in range(n)]))
            block.attn = LocalHeadsAttention(block.attn, n)
            plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                         f"blocks.{i}.attn.proj": RowwiseParallel(),
                         f"blocks.{i}.mlp.fc": ColwiseParallel(),
                         f"blocks.{i}.mlp.proj": RowwiseParallel()})
        parallelize_module(self.model, mesh, plan)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(x)  # a DTensor sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
        self.optimizer.step()
        return loss.full_tensor().item()


class OursTP:
    """minitrain's ``tensor`` strategy on this rank."""

    def __init__(self, cfg: GPTConfig, batch: int):
        tc = TrainConfig(strategy="tensor", world_size=dist.get_world_size(), batch_size=batch,
                         lr=LR, model=cfg, seed=0)
        TensorParallel.check(tc)
        self.strategy = TensorParallel(tc, Comm())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.strategy.train_step(x, y)


def step_times(model: str, batch: int, steps: int, kinds: list[str], warmup: int = 2) -> dict:
    """Train one replica per implementation on this rank, taking turns step by step.  Returns
    ``{kind: {"times": [...], "losses": [...]}}`` (the warm-up steps' times left out)."""
    cfg = MODELS[model]
    runs = {k: (TorchTP(cfg) if k == "torch" else OursTP(cfg, batch)) for k in kinds}
    data = ArithmeticData(cfg.seq_len, 0)
    out = alternate(kinds, lambda kind, x, y: runs[kind].train_step(x, y), data, batch, steps,
                    warmup)
    return {k: {"times": v["times"], "losses": v["results"]} for k, v in out.items()}

def single_losses(model: str, batch: int, steps: int) -> list[float]:
    """The reference: the ``single`` strategy (one process, the whole model, Adam), same batches."""
    return train(TrainConfig(model=MODELS[model], batch_size=batch, steps=steps, lr=LR, seed=0)).losses


def compare(cluster: Cluster, model: str, batch: int, steps: int, rounds: int,
            kinds=("minitrain", "torch"), warmup: int = 2) -> dict:
    """Median step time (slowest rank) per implementation, and each one's largest relative loss
    difference from one process, over ``rounds`` runs on ``cluster``."""
    ref = single_losses(model, batch, steps + warmup)
    per = {k: [] for k in kinds}
    err = {k: 0.0 for k in kinds}
    for _ in range(rounds):
        res = cluster.run(step_times, model, batch, steps, list(kinds), warmup)
        for k in kinds:
            per[k] += [max(ts) for ts in zip(*(r[k]["times"] for r in res))]
            for r in res:  # every rank reports the same loss
                err[k] = max([err[k]] + [abs(a - b) / abs(b) for a, b in zip(r[k]["losses"], ref)])
    return {"median_s": {k: statistics.median(v) for k, v in per.items()}, "loss_error": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="4x256", choices=sorted(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cfg = MODELS[args.model]
    print(f"model {args.model} ({cfg.num_params():,} parameters, {cfg.n_layer} blocks, "
          f"{cfg.n_head} heads), batch {args.batch_size}, {args.rounds} rounds x {args.steps} steps "
          f"(+2 warm-up), implementations alternating; {os.cpu_count()} cores, 1 thread per rank")
    print(f"{'N':>2s} {'minitrain ms':>13s} {'DTensor ms':>11s} {'ratio':>6s} "
          f"{'err minitrain':>14s} {'err DTensor':>12s}")
    for n in args.ranks:
        if cfg.n_head % n:
            print(f"skipping {n} ranks: {cfg.n_head} heads do not split over {n}")
            continue
        with Cluster(n, backend="gloo", threads=1, timeout=300) as cluster:
            res = compare(cluster, args.model, args.batch_size, args.steps, args.rounds)
        med, err = res["median_s"], res["loss_error"]
        print(f"{n:2d} {med['minitrain'] * 1e3:13.1f} {med['torch'] * 1e3:11.1f} "
              f"{med['minitrain'] / med['torch']:6.3f} {err['minitrain']:14.1e} "
              f"{err['torch']:12.1e}", flush=True)
    print("ratio = minitrain / PyTorch DTensor step time (target <= 1.0); err = largest relative "
          "difference of the per-step losses from one process (fp32, target <= 1e-5)")


if __name__ == "__main__":
    main()
