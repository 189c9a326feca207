"""The α-β cost model of communication, fitted to measured all-reduce times (lesson 01).

Sending n bytes costs α + n·β (a latency per message, a time per byte); a ring all-reduce on N ranks
takes T(n) = 2(N-1)·α + 2(N-1)/N · n · β, and "bus bandwidth" (what nccl-tests reports) is
2(N-1)/N · n / T.  Paper: Thakur, Rabenseifner and Gropp, 2005, "Optimization of Collective
Communication Operations in MPICH"; the article "大语言模型LLM分布式训练:大规模数据集上的并行技术全景探索
(LLM系列03)" (a panorama of parallel techniques) §3.1.  Lesson 01 derives and fits it.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist

from ..comm import Comm
from ..device import now

__all__ = ["time_all_reduce", "fit_alpha_beta", "predict", "bus_bandwidth", "crossover_bytes",
           "plot_alpha_beta", "ring_steps", "ring_volume", "collective_seconds", "compute_seconds"]


def time_all_reduce(sizes_bytes: list[int], repeats: int = 5) -> list[float]:
    """On each rank: the fastest of ``repeats`` float32 all-reduces of each size (after a warm-up).

    The minimum, not the mean: noise from other processes only ever adds time.

    A barrier before each call starts the ranks together; the caller takes the maximum over ranks.
    """
    comm = Comm()
    times = []
    for size in sizes_bytes:
        x = torch.ones(max(1, size // 4), device="cpu")
        comm.all_reduce(x)  # warm-up: connections, allocation
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = now()
            comm.all_reduce(x)
            samples.append(now() - t0)
        times.append(min(samples))
    return times


def fit_alpha_beta(sizes_bytes, seconds, n: int) -> tuple[float, float]:
    """Least-squares α (s) and β (s/byte) of the ring model, in relative error (every size counts)."""
    if n < 2:
        raise ValueError("the ring model needs at least 2 ranks")
    sizes, t = np.asarray(sizes_bytes, float), np.asarray(seconds, float)
    design = np.stack([np.full_like(sizes, 2 * (n - 1)), 2 * (n - 1) / n * sizes], axis=1)
    weights = 1 / t
    (alpha, beta), *_ = np.linalg.lstsq(design * weights[:, None], t * weights, rcond=None)
    return float(max(alpha, 0.0)), float(max(beta, 1e-15))


def predict(sizes_bytes, n: int, alpha: float, beta: float) -> np.ndarray:
    sizes = np.asarray(sizes_bytes, float)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * sizes * beta


#: ring steps per collective, times (n - 1): an all-reduce is a reduce-scatter then an all-gather
_STEPS = {"all_reduce": 2, "barrier": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1,
          "broadcast": 1, "reduce": 1}


def ring_steps(op: str, n: int) -> int:
    """Messages in a row (each paying the latency α) of ``op`` on a ring of ``n`` ranks; 1 for a
    point-to-point send/recv."""
    if op in ("send", "recv"):
        return 1
    if n <= 1:
        return 0
    try:
        return _STEPS[op] * (n - 1)
    except KeyError:
        raise ValueError(f"unknown collective {op!r}; the ring model knows "
                         f"{', '.join(sorted(_STEPS))}, send and recv") from None


def ring_volume(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank pushes through its link for ``op`` with a payload of ``nbytes`` (as
    :func:`minitrain.comm.ring_sent_bytes`, ``nbytes`` the full buffer): 2(N−1)/N·B for
    all-reduce, (N−1)/N·B for reduce-scatter, all-gather and all-to-all, B for a pipelined chain
    broadcast or reduce and for a point-to-point message."""
    if op in ("send", "recv"):
        return float(nbytes)
    if n <= 1 or op == "barrier":
        return 0.0
    if op in ("broadcast", "reduce"):
        return float(nbytes)
    return _STEPS[op] * (n - 1) / n * nbytes


def collective_seconds(op: str, nbytes: float, n: int, alpha: float, beta: float,
                       base: float = 0.0) -> float:
    """α-β time of one ``op`` of ``nbytes`` on ``n`` ranks: ``base`` (a fixed launch cost) plus α
    per ring step plus β per byte each rank sends — for an all-reduce exactly :func:`predict`
    (with ``base`` 0).  One cost model: the chooser and the projection both price with it."""
    if n <= 1 and op not in ("send", "recv"):
        return 0.0
    return base + ring_steps(op, n) * alpha + ring_volume(op, nbytes, n) * beta


def compute_seconds(flops: float, flop_rate: float, memory_bytes: float = 0.0,
                    memory_rate: float = float("inf")) -> float:
    """Time of a compute span at one FLOP rate, plus the bytes of memory-bound work (an
    optimizer's update) at a memory bandwidth: the roofline's two terms at their simplest.  The
    chooser and the projection price a step kernel by kernel instead
    (:mod:`minitrain.planning.kernels`)."""
    return flops / flop_rate + (memory_bytes / memory_rate if memory_bytes else 0.0)


def bus_bandwidth(sizes_bytes, seconds, n: int) -> np.ndarray:
    """Bytes per second each rank effectively moved: 2(N-1)/N · n / T."""
    return 2 * (n - 1) / n * np.asarray(sizes_bytes, float) / np.asarray(seconds, float)


def crossover_bytes(n: int, alpha: float, beta: float) -> float:
    """The message size where latency and bandwidth terms are equal: N·α/β."""
    return n * alpha / beta


def plot_alpha_beta(sizes_bytes, seconds, n: int, alpha: float, beta: float):
    """Measured times and the fitted model, log-log, with the two regimes shaded."""
    import matplotlib.pyplot as plt

    sizes = np.asarray(sizes_bytes, float)
    star = crossover_bytes(n, alpha, beta)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.loglog(sizes, seconds, "o", label="measured (max over ranks)")
    ax.loglog(sizes, predict(sizes, n, alpha, beta), "-",
              label=f"model: α={alpha * 1e6:.1f} µs, 1/β={1 / beta / 1e9:.2f} GB/s")
    for a in (ax, bx):
        a.axvspan(sizes.min(), star, color="tab:orange", alpha=0.1, label="latency-bound")
        a.axvspan(star, sizes.max(), color="tab:blue", alpha=0.08, label="bandwidth-bound")
        a.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title(f"ring all-reduce on {n} ranks")
    ax.legend(fontsize=8)
    bx.semilogx(sizes, bus_bandwidth(sizes, seconds, n) / 1e9, "o-")
    bx.axhline(1 / beta / 1e9, ls="--", color="gray", label="1/β (model's limit)")
    bx.set_ylabel("bus bandwidth (GB/s)")
    bx.set_title("busbw = 2(N-1)/N · n / T")
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig
