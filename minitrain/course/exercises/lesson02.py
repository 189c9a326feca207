"""Lesson 02: data parallelism's gradient average — naive DP's ``sync_gradients`` (the warm-up), then
DDP's two bucket hooks (``grad_ready``, ``end_of_backward``): each checked alone on real ranks, then
inside the real strategy through its seam (``ddp-naive``'s ``sync_gradients``, ``ddp``'s
``bucket_hooks``), with the tracer's bytes and the measured overlap beside the lesson's formulas."""

from __future__ import annotations

import statistics
import time

import torch

from .core import exercise, on_clusters, parts, raised
from .guards import InPlaceNames, WatchingComm, bypassed, dist_calls
from .inside import Row, inside, sent_per_rank


def _model():
    from ...model import PRESETS
    return PRESETS["nano"]


def _cfg(strategy: str, n: int, **options):
    from ...strategies import TrainConfig
    return TrainConfig(strategy=strategy, world_size=n, steps=4, batch_size=6 * n, seed=0,
                       model=_model(), options=options)


def _ring_bytes(cfg) -> tuple[str, float]:
    from ...model import GPT
    n, psi = cfg.world_size, GPT(cfg.model).num_params()
    return "2(N−1)/N·4Ψ", 2 * (n - 1) / n * 4 * psi


# --------------------------------------------------------------------------------------------------
# Naive DP: sync_gradients(model, comm)
# --------------------------------------------------------------------------------------------------


def _sync_rank(fn):
    """On each rank: the learner's gradient sync vs the full batch's gradients in one process."""
    from ...comm import Comm
    from ...data import ArithmeticData, shard
    from ...model import GPT

    comm = Comm()
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(_model(), seed=7)
    reference(x, y).backward()
    model = GPT(_model(), seed=7)
    model(shard(x, r, n), shard(y, r, n)).backward()
    try:
        with dist_calls() as calls, InPlaceNames():
            fn(model, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(f"rank {r}: {getattr(fn, '__name__', 'your function')}(model, comm)", exc, fn)
    names = {p.grad.data_ptr(): name for name, p in model.named_parameters() if p.grad is not None}
    for c in calls:
        for k, how in (c.touched or {}).items():
            what = f"{names[c.tensors[k].data_ptr()]}.grad" \
                if c.tensors[k].data_ptr() in names else "a tensor"
            return (f"rank {r}: {what} was {how} while its {c.op.replace('_', '-')} was still "
                    "in flight (after comm.all_reduce(..., async_op=True), before the handle's "
                    "wait()): the all-reduce reads and writes it until wait() returns, so a "
                    "change made before then is lost or half-summed; wait first, then divide")
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
    from ...model import GPT
    formula, expected = _ring_bytes(cfg)
    params = len(list(GPT(cfg.model).parameters()))
    calls = summary.comm[0].get("all_reduce", {}).get("calls", 0) / summary.steps
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


def _hooks_rank(fn, kind: str = "all_reduce", bucket_mb: float | None = None):
    """On each rank: three backwards of the nano GPT through the package's DDP (``kind``
    "all_reduce") or ZeRO-2 (``"reduce_scatter"``, lesson 04) with the learner's two hooks, every
    collective watched — the third with each bucket's gradients handed over in another order than
    its views'; what went wrong, in the order a learner should fix it."""
    from ...data import ArithmeticData, shard
    from ...model import GPT
    from ...parallel.data_parallel import DistributedDataParallel
    from ...parallel.zero import Zero2Optimizer

    grad_ready, end_of_backward = fn
    names = InPlaceNames()  # how the learner's hooks write their tensors, for the messages
    launches, delivered, ends = [], {}, {}
    holder, reorder, held, arrived = {}, [False], {}, {}

    def identify(tensor):
        for s in holder["slots"] if "slots" in holder else []:
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
                with names:
                    grad_ready(bucket, j, g, comm)
            return None
        arrived.setdefault(bucket.index, []).append(i)
        delivered.setdefault(bucket.index, set()).add(i)
        with names:
            return grad_ready(bucket, i, grad, comm)

    def my_end_of_backward(buckets):
        ends["start"] = time.perf_counter()
        ends["works"] = {b.index: b.work for b in buckets}  # the handles grad_ready kept
        try:
            with names:
                return end_of_backward(buckets)
        finally:
            ends["end"] = time.perf_counter()

    comm = WatchingComm(launches, identify)
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(_model(), seed=7)
    reference(x, y).backward()
    model = GPT(_model(), seed=7)
    cap = bucket_mb or _BUCKET_MB
    if kind == "all_reduce":
        ddp = DistributedDataParallel(model, comm, bucket_cap_mb=cap,
                                      bucket_hooks=(my_grad_ready, my_end_of_backward))
        holder["slots"] = ddp.slots
    else:
        ddp = model
        zero = Zero2Optimizer(model.parameters(), torch.optim.SGD, comm, bucket_cap_mb=cap,
                              zero2_hooks=(my_grad_ready, my_end_of_backward), lr=0.1)
        holder["slots"] = zero.reducer.slots
    for where in (f"rank {r}", f"rank {r}, in the second backward",
                  f"rank {r}, in a backward whose gradients arrived in another order"):
        reorder[0] = "order" in where
        launches.clear(), delivered.clear(), ends.clear(), held.clear(), arrived.clear()
        model.zero_grad(set_to_none=True)
        if kind != "all_reduce":
            zero.zero_grad()
        error = None
        try:
            with dist_calls() as calls:
                ddp(shard(x, r, n), shard(y, r, n)).backward()
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            error = exc
            calls = []
        finally:
            for launch in launches:  # leave no all-reduce in flight for the next check
                if launch["work"] is not None:
                    launch["work"].wait()
        found = _hooks_problem(fn, where, holder["slots"], launches, delivered, ends, error,
                               arrived, kind, bypassed(calls, ("all_reduce", "reduce_scatter")))
        if not found:
            found = (_hooks_values(model, reference, where, n) if kind == "all_reduce" else
                     _shard_values(zero, reference, where, n, r))
        if found:
            return found
    return None


def _shard_values(zero, reference, where, n, r) -> str | None:
    """ZeRO-2: each bucket's gradient shard against this rank's slice of the full batch's gradient."""
    grads = {id(p): q.grad for p, q in zip(zero.params, reference.parameters())}
    for b in zero.buckets:
        lo, hi = b.layout.owned_range(r)
        want = b.layout.flatten([grads[id(p)] for p in b.layout.params])[lo:hi]
        got = b.grad_shard
        if got is None:
            return (f"{where}: bucket {zero.buckets.index(b)} has no gradient shard after "
                    "backward: reduce-scatter bucket.buffer into bucket.grad_shard")
        if n > 1 and torch.allclose(got, want * n, rtol=1e-4, atol=1e-7):
            return (f"{where}: bucket {zero.buckets.index(b)}'s gradient shard is N = {n} times the "
                    "mean (the sum over the ranks): the reduce-scatter sums, so divide each "
                    "gradient by comm.size as you put it in its bucket")
        if n > 1 and torch.allclose(got * n, want, rtol=1e-4, atol=1e-7):
            return (f"{where}: bucket {zero.buckets.index(b)}'s gradient shard is the mean "
                    f"divided by N = {n} once more: each gradient is divided once, as it goes "
                    "into its bucket; after the wait the shard is the mean already")
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-7):
            full = b.layout.flatten([grads[id(p)] for p in b.layout.params])
            size = hi - lo
            other = next((q for q in range(n) if q != r and torch.allclose(
                got, full[q * size:(q + 1) * size], rtol=1e-4, atol=1e-7)), None)
            return (f"{where}: bucket {zero.buckets.index(b)}'s gradient shard on rank {r} "
                    + (f"is rank {other}'s shard of the mean gradient: bucket.grad_shard must "
                       "receive this rank's own shard" if other is not None else
                       "is not this rank's shard of the mean gradient over the ranks"))
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


#: how the hooks' messages name the collective: DDP's all-reduce, ZeRO-2's reduce-scatter (lesson 04)
WORDS = {"all_reduce": dict(op="all_reduce", word="all-reduce", past="all-reduced",
                            call="comm.all_reduce(bucket.buffer, async_op=True)",
                            target="all-reduce bucket.buffer"),
         "reduce_scatter": dict(op="reduce_scatter", word="reduce-scatter",
                                past="reduce-scattered",
                                call="comm.reduce_scatter(bucket.grad_shard, bucket.buffer, "
                                     "async_op=True)",
                                target="reduce-scatter bucket.buffer into bucket.grad_shard")}


def _hooks_problem(fn, where, slots, launches, delivered, ends, error, arrived=None,
                   kind: str = "all_reduce", direct=()) -> str | None:
    """What went wrong with the learner's hooks in one backward, from what was watched, in the
    order a learner should fix it.  ``kind``: the collective the hooks must launch (:data:`WORDS`)."""
    w = WORDS[kind]
    if direct:
        d = direct[0]
        said = (f"{where}: your {d.op.replace('_', '-')}s did not go through comm (the one "
                f"grad_ready gets): you called torch.distributed's {d.function} directly "
                f"({len(direct)} call{'s' if len(direct) > 1 else ''}), which the tracer and the "
                "wrapper cannot see")
        if d.op != kind:
            return (said + f"; and each bucket needs one {w['word']}, not an "
                    f"{d.op.replace('_', '-')}: {w['target']}" +
                    (" — each rank keeps only its shard, for half an all-reduce's bytes"
                     if kind == "reduce_scatter" else ""))
        return said + f": launch each bucket with {w['call']}"
    others = [launch for launch in launches if launch.get("op", kind) != kind]
    if others:
        o = WORDS.get(others[0]["op"], {"word": others[0]["op"]})
        return (f"{where}: bucket {others[0]['slot']} was {o.get('past', o['word'])} where "
                f"each bucket needs one {w['word']}: {w['target']}"
                + (" — each rank keeps only its shard of the sum, for half an all-reduce's bytes"
                   if kind == "reduce_scatter" else ""))
    total = {s.index: len(s.unit.params) for s in slots}
    if error is not None and "start" not in ends and _in_their_code(error, fn):
        return raised(f"{where}: backward with your hooks", error, fn)  # grad_ready failed
    if not launches:
        if any(s.work is not None for s in slots):
            return (f"{where}: your {w['word']}s did not go through comm (the one grad_ready "
                    f"gets), so the tracer and the wrapper cannot see them: launch each bucket "
                    f"with {w['call']}")
        return (f"{where}: no bucket's {w['word']} was ever launched (all {len(slots)} buckets "
                f"were never launched): each bucket's {w['word']} must start, through the comm "
                f"grad_ready gets, once the bucket's last gradient is in{_again(where)}")
    for launch in launches:
        if launch["slot"] is None:
            return (f"{where}: you {w['past']} a tensor of {launch['numel']} elements that is "
                    f"not a bucket's buffer: {w['target']}, the whole bucket in one message")
    for launch in launches:
        k, got = launch["slot"], launch["got"]
        if got < total[k]:
            order = (arrived or {}).get(k, [])
            seen = (f" (its gradients arrived in the order {', '.join(map(str, order))} of its "
                    "views — backward does not promise the views' order: count the arrivals, do "
                    "not wait for one particular view)") \
                if 0 < got <= len(order) and order[got - 1] == total[k] - 1 else ""
            return (f"{where}: bucket {k}'s {w['word']} started when only {got} of its "
                    f"{total[k]} gradients were in: it sums the buffer as it is, so the missing gradients "
                    f"never reach the other ranks; launch a bucket once its last gradient is in{seen}")
    count = {s.index: sum(launch["slot"] == s.index for launch in launches) for s in slots}
    for k, c in count.items():
        if c > 1:
            return (f"{where}: bucket {k}'s {w['word']} was launched {c} times in one backward: "
                    "once per bucket, when it is full (a second sum adds the ranks' sums)")
    never = [k for k, c in count.items() if c == 0]
    if never:
        return (f"{where}: bucket {never[0]} ({total[never[0]]} parameters) was never launched "
                f"({len(never)} of {len(slots)} buckets were not): every bucket's {w['word']} must "
                f"start, once its last gradient is in{_again(where)}")
    kept = ends.get("works", {})
    unkept = [launch["slot"] for launch in launches
              if launch["async_op"] and "works" in ends and launch["time"] < ends["start"]
              and kept.get(launch["slot"]) is None]
    if unkept:
        return (f"{where}: bucket {unkept[0]}'s {w['word']} was launched in grad_ready, but its "
                "handle was not kept in bucket.work (None when end_of_backward started), so "
                "nobody can wait for it and end_of_backward cannot know when the sum has "
                f"arrived: keep it, bucket.work = {w['call']}, and wait for it in "
                "end_of_backward")
    if "start" not in ends:
        return raised(f"{where}: backward with your hooks", error, fn) if error is not None else \
            f"{where}: end_of_backward was not called (backward failed)"
    blocking = [launch["slot"] for launch in launches if not launch["async_op"]]
    if blocking:
        return (f"{where}: bucket {blocking[0]}'s {w['word']} was blocking (comm.{w['op']} "
                "without async_op=True): backward stood still until it completed, so nothing "
                "overlapped; launch it with async_op=True, keep the handle in bucket.work, and "
                "wait for it at the end of backward")
    after = sorted((launch for launch in launches if launch["time"] >= ends["start"]),
                   key=lambda launch: launch["time"])
    last = max(s.index for s in slots)
    if len(after) == len(launches) and len(after) > 1:
        return (f"{where}: nothing overlapped: all {len(after)} {w['word']}s started after "
                "backward ended (in end_of_backward), so the network sat idle while backward "
                f"computed; start each bucket's {w['word']} in grad_ready, as soon as that bucket "
                "is full, while backward still computes the earlier layers")
    early = [launch["slot"] for launch in after if launch["slot"] != last]
    if early:
        return (f"{where}: bucket {early[0]}'s {w['word']} started only after backward ended; "
                "start it in grad_ready, as soon as the bucket is full, so it overlaps backward")
    for launch in launches:
        if launch["waited"] is not None and launch["waited"] < ends["start"]:
            return (f"{where}: bucket {launch['slot']}'s {w['word']} was waited for during "
                    "backward (in grad_ready): backward stood still until it completed, so "
                    "nothing overlapped; wait only in end_of_backward")
    for launch in launches:
        if launch["waited"] is None or launch["waited"] > ends["end"]:
            return (f"{where}: bucket {launch['slot']}'s {w['word']} was launched but never "
                    "waited for: end_of_backward returned while it could still be running, "
                    "and the optimizer would read a half-summed buffer; wait for every "
                    "bucket's handle before end_of_backward returns")
    for launch in launches:
        for name, how in launch.get("touched", {}).items():
            return (f"{where}: bucket {launch['slot']}: {name} was {how} while the bucket's "
                    f"{w['word']} was still in flight (after the launch, before "
                    f"bucket.work.wait()): the {w['word']} reads and writes it until the wait "
                    "returns, so a division (or any change) made before then is lost or "
                    "half-summed; wait for bucket.work before you divide — or divide each "
                    "gradient as it goes into its bucket, before the launch")
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
    mine = summary.report[0]
    buckets = len(mine["bucket_bytes"])
    calls = summary.comm[0].get("all_reduce", {}).get("calls", 0) / summary.steps
    mine = [o for rep in summary.report for o in rep["overlap"][1:]]  # the first step warms up
    theirs = [o for rep in package.report for o in rep["overlap"][1:]]
    spread = lambda xs: (min(xs), max(xs)) if len(xs) >= 3 else None  # noqa: E731
    return [Row("all-reduce bytes sent per rank per step", sent_per_rank(summary, "all_reduce"),
                formula, expected),
            Row("all-reduces per step", calls, "one per bucket", buckets, ""),
            Row("all-reduce time hidden behind backward", statistics.median(mine),
                "the package's hooks, same run", statistics.median(theirs), "%",
                measured_range=spread(mine), expected_range=spread(theirs), compare=True)]


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
