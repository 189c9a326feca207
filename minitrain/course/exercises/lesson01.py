"""Lesson 01: a ring all-reduce from send and receive — checked alone (against dist.all_reduce, at
2, 3 and 4 ranks, sizes that do not divide evenly), then inside strategy ``ddp`` through its
``ring_all_reduce`` seam, with the bytes each rank sent beside 2(N-1)/N of the gradients."""

from __future__ import annotations

import dataclasses
import math

import torch

from .core import exercise, ranks
from .inside import Row, inside
from .lab import HANDLES_ADVICE, all_wait_in, all_wait_on_handles, diagnosis, waits

#: the sizes every world size is tried with: fewer elements than ranks, uneven chunks, one even
_SIZES = (1, 5, 12, 103)


def _holds(value: float, n: int) -> list[int] | None:
    """The ranks whose 2^rank a value is the sum of (each at most once), or None."""
    k = int(round(value))
    if abs(value - k) > 1e-9 or not 0 <= k < 2 ** n:
        return None
    return [r for r in range(n) if k >> r & 1]


def _value_story(v: float, n: int) -> str:
    """What one value is, when every rank started with 2^rank (the full sum is 2^N - 1)."""
    total = 2 ** n - 1
    if not math.isfinite(v):
        return f"{v}"
    for k in range(2, 2 * n + 1):
        if abs(v * k - total) <= 1e-9 * total:
            return f"{v:g} = the full sum {total} divided by {k}"
        if abs(v - k * total) <= 1e-9 * total:
            return f"{v:g} = {k}× the full sum {total} (it was summed {k} times)"
    return f"{v:g}, which is no sum of distinct ranks' 2^rank (the full sum is {total})"


def _chunks_story(got: torch.Tensor, n: int, r: int) -> str:
    """What rank r's chunks hold when every rank started with 2^rank everywhere (observed: each
    chunk's value, and which ranks' values it is the sum of, when it is one)."""
    chunks = torch.tensor_split(got.view(-1), n)
    full, partial, other = [], [], []
    for i, c in enumerate(chunks):
        values = set(c.tolist())
        if len(values) != 1:
            other.append(f"chunk {i} holds different values in its elements "
                         f"({', '.join(f'{v:g}' for v in c[:4].tolist())}...)")
            continue
        value = values.pop()
        held = _holds(value, n)
        if held == list(range(n)):
            full.append(i)
        elif held is not None:
            partial.append(f"chunk {i} only ranks {held}" if held else f"chunk {i} nothing")
        else:
            other.append(f"chunk {i} holds {_value_story(value, n)}")
    if not partial and not other:
        return ""
    text = (f"each rank started with 2^rank in every element, so the sum is {2 ** n - 1} everywhere; "
            + (f"rank {r} ends with the full sum in chunk{'s' if len(full) != 1 else ''} {full}"
               if full else f"rank {r} ends with the full sum in no chunk"))
    if partial:
        text += f", partial sums in the others ({'; '.join(partial)})"
        if len(full) == 1 and not other:
            text += (": after the reduce-scatter each rank owns one finished chunk — the all-gather "
                     "phase must pass the finished chunks around the ring (copying, not adding)")
        else:
            text += ": some chunk was received into, or added to, the wrong place"
    if other:
        text += f"{'; and' if partial else ', and'} {'; '.join(other)}"
    return text


def _ring_rank(fn, sizes):
    """On each rank: the learner's ring on 2^rank tensors (what each chunk holds), then against
    dist.all_reduce on random ones, for every size; the first problem, or None."""
    import torch.distributed as dist

    from ...comm import Comm

    comm = Comm()
    n, r = comm.size, comm.rank
    x = torch.full((3 * n + 1,), float(2 ** r), dtype=torch.float64, device=comm.device)
    got = fn(x, comm)
    got = x if got is None else got
    if not torch.is_tensor(got) or got.shape != x.shape:
        return f"rank {r} returned {type(got).__name__}: return the tensor, summed (in place is fine)"
    story = _chunks_story(got, n, r)
    if story:
        return f"size {x.numel()}: {story}"
    for size in sizes:
        gen = torch.Generator(device=comm.device).manual_seed(1000 * size + r)
        x = torch.randn(size, generator=gen, dtype=torch.float64, device=comm.device)
        want = x.clone()
        dist.all_reduce(want)
        got = fn(x, comm)
        got = x if got is None else got
        if not torch.allclose(got, want, rtol=1e-10, atol=1e-10):
            return (f"size {size}: rank {r} got {got[:4].tolist()}..., expected "
                    f"{want[:4].tolist()}...")
        if comm.tracer.summary().get("all_reduce"):
            return "it called all_reduce: build it from send/recv (comm.isend, comm.recv) only"
    ops = {e.op for e in comm.tracer.events}
    if "send" not in ops:
        return "no send went through comm: build it from comm.isend and comm.recv"
    if ops - {"send", "recv"}:
        return f"use only comm's send and recv; it also called {sorted(ops - {'send', 'recv'})}"
    return None


def _advice(exc, n: int) -> str:
    """What to change, from what the launcher saw the ranks do: only when ranks waited (a rank
    that raised is told its error and its line, nothing about sends)."""
    from ...runtime.launch import CollectiveTimeout, Deadlock

    if not isinstance(exc, (Deadlock, CollectiveTimeout)):
        return ""
    if all_wait_in(exc, "send", n):
        return (". Every rank is in a blocking send, which returns only once its peer has "
                "received — and every peer is sending: start the send with comm.isend, receive, "
                "then wait on the send")
    if all_wait_in(exc, "recv", n):
        return ". Every rank is receiving and none is sending: start the send first (comm.isend)"
    if all_wait_on_handles(exc, n):
        return ". " + HANDLES_ADVICE
    if waits(exc, None):
        return ". Each send needs the matching recv on the peer, in the same step"
    return ""


def _alone(fn) -> str | None:
    from ...runtime.launch import RankError

    for n in (2, 3, 4):
        try:
            problems = [p for p in ranks(n).run(_ring_rank, fn, _SIZES, timeout=60) if p]
        except RankError as exc:
            return diagnosis(exc, fn, f"with {n} ranks") + _advice(exc, n)
        except TimeoutError:
            return f"with {n} ranks it did not finish within 60 s (a rank waiting for a message?)"
        if problems:
            return f"with {n} ranks, {problems[0]}"
    return None


#: the run inside DDP: 3 ranks (an odd ring), buckets small enough that there are several
_DDP_RUN = dict(world_size=3, steps=4, batch_size=6, options={"bucket_mb": 0.005})


def ddp_config():
    """The DDP run the check trains with the learner's ring (a small GPT, three ranks)."""
    from ...model import GPTConfig
    from ...strategies import TrainConfig

    model = dataclasses.replace(GPTConfig(), n_layer=1, n_head=2, d_model=16, seq_len=10)
    return TrainConfig(strategy="ddp", model=model, **_DDP_RUN)


def ring_rows(summary, cfg, package) -> list:
    """Bytes and messages one rank sent per step (tracer) beside the ring's formulas."""
    n, steps, psi = cfg.world_size, summary.steps, summary.params
    buckets = len(summary.report[0].get("bucket_bytes") or [])
    sent = [c.get("send", {}).get("sent_bytes", 0.0) / steps for c in summary.comm]
    calls = [c.get("send", {}).get("calls", 0) / steps for c in summary.comm]
    formula = 2 * (n - 1) / n * 4 * psi
    return [Row("bytes sent per rank per step (mean)", sum(sent) / n, "2(N-1)/N·4Ψ", formula),
            Row("bytes sent by the busiest rank", max(sent), "2(N-1)/N·4Ψ", formula),
            Row("messages sent per rank per step", sum(calls) / n,
                f"2(N-1) × {buckets} buckets", 2 * (n - 1) * buckets if buckets else None, unit="")]


@exercise("ring_all_reduce",
          "equals dist.all_reduce at 2, 3 and 4 ranks, sizes 1, 5, 12 and 103, using send/recv "
          "only, and strategy 'ddp' with it equals one process")
def _check_ring_all_reduce(fn) -> str | None:
    return _alone(fn) or inside("ring_all_reduce", fn, ddp_config(), measure=ring_rows)
