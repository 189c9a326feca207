"""Lesson 02: data parallelism's gradient average — naive DP's ``sync_gradients`` (the warm-up), then
DDP's two bucket hooks (``grad_ready``, ``end_of_backward``): each checked alone on real ranks, then
inside the real strategy through its seam (``ddp-naive``'s ``sync_gradients``, ``ddp``'s
``bucket_hooks``), with the tracer's bytes and the measured overlap beside the lesson's formulas."""

from __future__ import annotations

import statistics
import time

import torch

from .core import exercise, on_clusters, parts, raised
from .guards import WatchingComm
from .inside import Row, inside, sent_per_rank


def _model():
    from ..model import PRESETS
    return PRESETS["nano"]


def _cfg(strategy: str, n: int, **options):
    from ..strategies import TrainConfig
    return TrainConfig(strategy=strategy, world_size=n, steps=3, batch_size=6 * n, seed=0,
                       model=_model(), options=options)


def _ring_bytes(cfg) -> tuple[str, float]:
    from ..model import GPT
    n, psi = cfg.world_size, GPT(cfg.model).num_params()
    return "2(N−1)/N·4Ψ", 2 * (n - 1) / n * 4 * psi


# --------------------------------------------------------------------------------------------------
# Naive DP: sync_gradients(model, comm)
# --------------------------------------------------------------------------------------------------


def _sync_rank(fn):
    """On each rank: the learner's gradient sync vs the full batch's gradients in one process."""
    from ..comm import Comm
    from ..data import ArithmeticData, shard
    from ..model import GPT

    comm = Comm()
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(_model(), seed=7)
    reference(x, y).backward()
    model = GPT(_model(), seed=7)
    model(shard(x, r, n), shard(y, r, n)).backward()
    try:
        fn(model, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(f"rank {r}: {getattr(fn, '__name__', 'your function')}(model, comm)", exc, fn)
    if not comm.tracer.summary().get("all_reduce"):
        return ("no all_reduce went through comm: each rank still holds only its own gradients; "
                "call comm.all_reduce(p.grad) for each parameter")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            return f"rank {r}: {name}.grad is None after your sync"
        if torch.allclose(p.grad, q.grad * n, rtol=1e-4, atol=1e-7) and n > 1:
            return (f"rank {r}: {name}.grad is the sum over the ranks, N = {n} times the mean: "
                    "divide by comm.size to average")
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7):
            return f"rank {r}: {name}.grad differs from the full batch's gradient"
    return None


def _naive_rows(summary, cfg, package):
    from ..model import GPT
    formula, expected = _ring_bytes(cfg)
    params = len(list(GPT(cfg.model).parameters()))
    calls = summary["comm"][0].get("all_reduce", {}).get("calls", 0) / summary["steps"]
    return [Row("all-reduce bytes sent per rank per step", sent_per_rank(summary, "all_reduce"),
                formula, expected),
            Row("all-reduce calls per step", calls, "one per parameter tensor", params, "")]


@exercise('sync_gradients',
          "every rank holds the full batch's gradients at 2 and 3 ranks, and strategy 'ddp-naive' "
          "with it trains like one process")
def _check_sync_gradients(fn) -> str | None:
    return (on_clusters(_sync_rank, fn, sizes=(2, 3))
            or inside("sync_gradients", fn, _cfg("ddp-naive", 2), measure=_naive_rows))


# --------------------------------------------------------------------------------------------------
# DDP: bucket_hooks = (grad_ready(bucket, i, grad, comm), end_of_backward(buckets))
# --------------------------------------------------------------------------------------------------

_BUCKET_MB = 0.01  # the nano GPT's 104 kB of gradients in 7 buckets


def _hooks_rank(fn):
    """On each rank: two backwards of the nano GPT through the package's DDP with the learner's two
    hooks, every all-reduce watched; what went wrong, in the order a learner should fix it."""
    from ..data import ArithmeticData, shard
    from ..model import GPT
    from ..parallel.data_parallel import DistributedDataParallel

    grad_ready, end_of_backward = fn
    launches, delivered, ends = [], {}, {}
    holder, reorder, held, arrived = {}, [False], {}, {}

    def identify(tensor):
        for s in holder["ddp"].slots if "ddp" in holder else []:
            if s.buffer is not None and s.buffer.data_ptr() == tensor.data_ptr() \
                    and s.buffer.numel() == tensor.numel():
                return s.index, len(delivered.get(s.index, ()))
        return None, 0

    def my_grad_ready(bucket, i, grad, comm):
        if reorder[0] and len(bucket.views) > 1:  # hold the bucket's gradients, then hand them
            held.setdefault(bucket.index, []).append((i, grad.clone()))  # over last view first
            if len(held[bucket.index]) < len(bucket.views):
                return None
            for j, g in held.pop(bucket.index)[::-1]:
                arrived.setdefault(bucket.index, []).append(j)
                delivered.setdefault(bucket.index, set()).add(j)
                grad_ready(bucket, j, g, comm)
            return None
        arrived.setdefault(bucket.index, []).append(i)
        delivered.setdefault(bucket.index, set()).add(i)
        return grad_ready(bucket, i, grad, comm)

    def my_end_of_backward(buckets):
        ends["start"] = time.perf_counter()
        try:
            return end_of_backward(buckets)
        finally:
            ends["end"] = time.perf_counter()

    comm = WatchingComm(launches, identify)
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(_model(), seed=7)
    reference(x, y).backward()
    model = GPT(_model(), seed=7)
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=_BUCKET_MB,
                                  bucket_hooks=(my_grad_ready, my_end_of_backward))
    holder["ddp"] = ddp
    for where in (f"rank {r}", f"rank {r}, in the second backward",
                  f"rank {r}, in a backward whose gradients arrived in another order"):
        reorder[0] = "order" in where
        launches.clear(), delivered.clear(), ends.clear(), held.clear(), arrived.clear()
        model.zero_grad(set_to_none=True)
        error = None
        try:
            ddp(shard(x, r, n), shard(y, r, n)).backward()
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            error = exc
        finally:
            for launch in launches:  # leave no all-reduce in flight for the next check
                if launch["work"] is not None:
                    launch["work"].wait()
        found = (_hooks_problem(fn, where, ddp.slots, launches, delivered, ends, error, arrived)
                 or _hooks_values(model, reference, where, n))
        if found:
            return found
    return None


def _in_their_code(error: BaseException, fn) -> bool:
    """Did ``error`` come from the learner's own functions (not from the DDP's checks)?"""
    import traceback

    codes = {(f.__code__.co_filename, f.__code__.co_name) for f in parts(fn)
             if hasattr(f, "__code__")}
    return any((t.filename, t.name) in codes for t in traceback.extract_tb(error.__traceback__))


def _again(where: str) -> str:
    if "second" not in where:
        return ""
    return (" (the first backward was right: bucket.ready and bucket.work start afresh at each "
            "backward, but state of your own carries over)")


def _hooks_problem(fn, where, slots, launches, delivered, ends, error, arrived=None) -> str | None:
    total = {s.index: len(s.unit.params) for s in slots}
    if error is not None and "start" not in ends and _in_their_code(error, fn):
        return raised(f"{where}: backward with your hooks", error, fn)  # grad_ready failed
    if not launches:
        if any(s.work is not None for s in slots):
            return (f"{where}: your all-reduces did not go through comm (the one grad_ready "
                    "gets), so the tracer and DDP cannot see them: launch each bucket with "
                    "comm.all_reduce(bucket.buffer, async_op=True)")
        return (f"{where}: no bucket's all-reduce was ever launched (all {len(slots)} buckets "
                "were never launched): each bucket's all-reduce must start, through the comm "
                f"grad_ready gets, once the bucket's last gradient is in{_again(where)}")
    for launch in launches:
        if launch["slot"] is None:
            return (f"{where}: you all-reduced a tensor of {launch['numel']} elements that is not a "
                    "bucket's buffer: all-reduce bucket.buffer, the whole bucket in one message")
    for launch in launches:
        k, got = launch["slot"], launch["got"]
        if got < total[k]:
            order = (arrived or {}).get(k, [])
            seen = (f" (its gradients arrived in the order {', '.join(map(str, order))} of its "
                    "views — backward does not promise the views' order: count the arrivals, do "
                    "not wait for one particular view)") \
                if 0 < got <= len(order) and order[got - 1] == total[k] - 1 else ""
            return (f"{where}: bucket {k}'s all-reduce started when only {got} of its {total[k]} "
                    "gradients were in: it sums the buffer as it is, so the missing gradients "
                    f"never reach the other ranks; launch a bucket once its last gradient is in{seen}")
    count = {s.index: sum(launch["slot"] == s.index for launch in launches) for s in slots}
    for k, c in count.items():
        if c > 1:
            return (f"{where}: bucket {k}'s all-reduce was launched {c} times in one backward: "
                    "once per bucket, when it is full (a second sum adds the ranks' sums)")
    never = [k for k, c in count.items() if c == 0]
    if never:
        return (f"{where}: bucket {never[0]} ({total[never[0]]} parameters) was never launched "
                f"({len(never)} of {len(slots)} buckets were not): every bucket's all-reduce must "
                f"start, once its last gradient is in{_again(where)}")
    if "start" not in ends:
        return raised(f"{where}: backward with your hooks", error, fn) if error is not None else \
            f"{where}: end_of_backward was not called (backward failed)"
    blocking = [launch["slot"] for launch in launches if not launch["async_op"]]
    if blocking:
        return (f"{where}: bucket {blocking[0]}'s all-reduce was blocking (comm.all_reduce "
                "without async_op=True): backward stood still until it completed, so nothing "
                "overlapped; launch it with async_op=True, keep the handle in bucket.work, and "
                "wait for it at the end of backward")
    after = sorted((launch for launch in launches if launch["time"] >= ends["start"]),
                   key=lambda launch: launch["time"])
    last = max(s.index for s in slots)
    if len(after) == len(launches) and len(after) > 1:
        return (f"{where}: nothing overlapped: all {len(after)} all-reduces started after "
                "backward ended (in end_of_backward), so the network sat idle while backward "
                "computed; start each bucket's all-reduce in grad_ready, as soon as that bucket "
                "is full, while backward still computes the earlier layers")
    early = [launch["slot"] for launch in after if launch["slot"] != last]
    if early:
        return (f"{where}: bucket {early[0]}'s all-reduce started only after backward ended; "
                "start it in grad_ready, as soon as the bucket is full, so it overlaps backward")
    for launch in launches:
        if launch["waited"] is not None and launch["waited"] < ends["start"]:
            return (f"{where}: bucket {launch['slot']}'s all-reduce was waited for during "
                    "backward (in grad_ready): backward stood still until it completed, so "
                    "nothing overlapped; wait only in end_of_backward")
    for launch in launches:
        if launch["waited"] is None or launch["waited"] > ends["end"]:
            return (f"{where}: bucket {launch['slot']}'s all-reduce was launched but never "
                    "waited for: end_of_backward returned while it could still be running, "
                    "and the optimizer would read a half-summed buffer; wait for every "
                    "bucket's handle before end_of_backward returns")
    if error is not None:
        return raised(f"{where}: backward with your hooks", error, fn)
    return None


def _hooks_values(model, reference, where, n) -> str | None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            return f"{where}: {name}.grad is None after backward"
        if n > 1 and torch.allclose(p.grad, q.grad * n, rtol=1e-4, atol=1e-7):
            return (f"{where}: the gradients are N = {n} times the mean ({name}.grad is the sum "
                    "over the ranks): the all-reduce sums, so divide each gradient by comm.size "
                    "as you put it in its bucket")
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7):
            return (f"{where}: {name}.grad differs from the full batch's gradient: each bucket "
                    "must end up holding the mean over the ranks of its gradients")
    return None


def _ddp_rows(summary, cfg, package):
    formula, expected = _ring_bytes(cfg)
    mine = summary["report"][0]
    buckets = len(mine["bucket_bytes"])
    calls = summary["comm"][0].get("all_reduce", {}).get("calls", 0) / summary["steps"]
    hidden = statistics.median(o for rep in summary["report"] for o in rep["overlap"])
    theirs = statistics.median(o for rep in package["report"] for o in rep["overlap"])
    return [Row("all-reduce bytes sent per rank per step", sent_per_rank(summary, "all_reduce"),
                formula, expected),
            Row("all-reduces per step", calls, "one per bucket", buckets, ""),
            Row("all-reduce time hidden behind backward", hidden, "the package's", theirs, "%")]


def _hooks_inside(fn) -> str | None:
    for n in (3, 2):  # the run kept for report() is the last: 2 ranks
        found = inside("bucket_hooks", tuple(fn),
                       _cfg("ddp", n, bucket_mb=_BUCKET_MB, timeline=True), measure=_ddp_rows)
        if found:
            return found
    return None


@exercise('bucket_hooks',
          "every rank holds the full batch's gradients at 2 and 3 ranks, every bucket's "
          "all-reduce launched once, during backward, and waited for; strategy 'ddp' with them "
          "trains like one process")
def _check_bucket_hooks(fn) -> str | None:
    pair = parts(fn)
    if len(pair) != 2 or not all(map(callable, pair)):
        return ("check it with the pair of your functions: check(\"bucket_hooks\", "
                "(my_grad_ready, my_end_of_backward))")
    return on_clusters(_hooks_rank, tuple(pair), sizes=(2, 3)) or _hooks_inside(pair)
