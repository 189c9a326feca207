"""Timing two implementations fairly on shared, noisy CPUs (the ``benchmarks/`` scripts).

Each benchmark trains one replica per implementation (ours, PyTorch's) in the same ranks and takes
turns step by step, swapping the order every other step, after a barrier: a drift in the machine's
load then hits both alike, and the ratio of their median step times means something even where
the absolute times do not.
"""

from __future__ import annotations


import torch.distributed as dist
from ..device import now

__all__ = ["alternate"]


def alternate(kinds: list[str], step, data, batch: int, steps: int, warmup: int = 2) -> dict:
    """Run ``step(kind, x, y)`` for every kind on the batches of ``steps + warmup`` steps, in
    turns.  Returns ``{kind: {"times": [...], "results": [...]}}``: the seconds of the steps after
    the warm-up, and what ``step`` returned for every step (losses, timelines...)."""
    out = {k: {"times": [], "results": []} for k in kinds}
    for i in range(steps + warmup):
        x, y = data.batch(i, batch)
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            dist.barrier()
            t0 = now()
            result = step(kind, x, y)
            elapsed = now() - t0
            out[kind]["results"].append(result)
            if i >= warmup:
                out[kind]["times"].append(elapsed)
    return out
