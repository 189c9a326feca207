"""What a run recorded, read back for the projection.

A run trained with ``record_events=True`` (or ``project=...``) keeps, per rank, the tracer's
events (:mod:`minitrain.comm`: every collective and message with its bytes, group and tag, when it
was issued, when its call returned, when it was waited for and when it was done) and its marks
(each step's start and end, each forward and each optimizer step).  Here they become, step by step,
each rank's program for :func:`minitrain.planning.replay.replay`: the compute spans between calls into the
communicator (each with its phase: forward, optimizer, or the rest of the step), the issues and the
waits, each communication keyed alike on every member (``("c", ranks, n)``: the n-th collective of
that group; ``("p", src, dst, channel, n)``: the n-th message of that pair).

:func:`message_times` and :func:`fit_run` read the same events to fit this machine's α-β on the
run's own messages (what ``project(result, "local")`` replays with).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .replay import Op

__all__ = ["windows", "program", "step_programs", "drop_unmatched", "smooth", "completed_at",
           "message_times", "fit_run"]


def windows(marks: list) -> list[tuple]:
    """[(step, start, end, {"optimizer": [(start, end), ...], "forward": [...], "backward": [...],
    "weights": [...]})] from a rank's marks (the intervals of its optimizer steps, forwards,
    backwards and a zero-bubble pipeline's W passes)."""
    kinds = ("optimizer", "forward", "backward", "weights")
    out, start, open_, spans = [], None, {}, {k: [] for k in kinds}
    for t, kind, value in marks:
        if kind == "step":
            start, spans = (value, t), {k: [] for k in kinds}
        elif kind == "step_end" and start is not None:
            out.append((start[0], start[1], t, spans))
            start = None
        elif kind in spans:
            open_[kind] = t
        elif kind.endswith("_end") and kind[:-4] in spans and open_.get(kind[:-4]) is not None:
            spans[kind[:-4]].append((open_.pop(kind[:-4]), t))
    return out


def program(rank: int, events: list[dict], t0: float, t1: float, spans) -> tuple:
    """One rank's program for the step [t0, t1], and its communications as {key: (event, role)}."""
    evs = sorted((e for e in events if t0 <= e["start"] <= t1), key=lambda e: e["id"])
    counters: dict = defaultdict(int)
    keyed = []
    for e in evs:
        op, ranks = e["op"], tuple(e["ranks"]) or (rank,)
        if op in ("send", "recv"):
            peer = ranks[e["peer"]] if e["peer"] is not None else None
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            c = ("p", src, dst, e["channel"], op)
            key = ("p", src, dst, e["channel"], counters[c])
        else:
            c = ("c", ranks)
            key = ("c", ranks, counters[c])
        counters[c] += 1
        keyed.append((key, e))
    points = []
    for key, e in keyed:
        if e["async_op"]:
            points.append((e["start"], 0, "issue", key, e))
            if e["wait_start"] is not None and e["wait_start"] <= t1:
                points.append((e["wait_start"], 1, "wait", key, e))
        else:
            points.append((e["start"], 0, "sync", key, e))
    points.sort(key=lambda p: (p[0], p[1], p[4]["id"]))
    ops: list[Op] = []
    cur = t0

    if not isinstance(spans, dict):  # a plain list: the optimizer's intervals
        spans = {"optimizer": spans, "forward": []}
    optimizer, forward = spans["optimizer"], spans["forward"]

    def compute(a: float, b: float) -> None:
        cuts = sorted({a, b, *[x for iv in optimizer + forward for x in iv if a < x < b]})
        for x, y in zip(cuts, cuts[1:]):
            if y > x:
                mid = (x + y) / 2
                phase = ("optimizer" if any(s <= mid <= e for s, e in optimizer) else
                         "forward" if any(s <= mid <= e for s, e in forward) else "model")
                ops.append(Op("compute", y - x, phase=phase, measured=(x - t0, y - t0)))

    for t, _, kind, key, e in points:
        if t > cur:
            compute(cur, t)
        cur = max(cur, t)
        if kind == "issue":
            took = max(0.0, (e["returned"] or t) - t)
            blocking = e["op"] not in ("send", "recv") and e["end"] <= t + took + 1e-4
            ops.append(Op("issue", took, key, measured=(t - t0, t + took - t0), blocking=blocking))
            cur = max(cur, t + took)
        elif kind == "sync":
            ops.append(Op("issue", 0.0, key, measured=(t - t0, t - t0)))
            ops.append(Op("wait", e["end"] - t, key, measured=(t - t0, e["end"] - t0)))
            cur = max(cur, e["end"])
        else:
            ops.append(Op("wait", e["wait_end"] - t, key, measured=(t - t0, e["wait_end"] - t0)))
            cur = max(cur, e["wait_end"])
    if t1 > cur:
        compute(cur, t1)
    return ops, {key: e for key, e in keyed}


def step_programs(result, step_index: int):
    """Programs of every rank for one step (by position in the recorded steps), and the events."""
    programs, events, window = {}, {}, {}
    for r, log in enumerate(result.events):
        steps = windows(log["marks"])
        step, t0, t1, opts = steps[step_index]
        programs[r], events[r] = program(r, log["events"], t0, t1, opts)
        window[r] = (t0, t1)
    return programs, events, window


def drop_unmatched(programs: dict, instances: dict) -> None:
    """A communication some member never issued inside this step (a prefetch that crosses the
    step's edge) is left out of the step: its issue and wait are dropped."""
    issuers: dict = defaultdict(set)
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "issue":
                issuers[op.key].add(r)
    bad = {k for k, inst in instances.items() if set(inst.members) - issuers[k]}
    for r in programs:
        programs[r] = [op for op in programs[r] if op.key not in bad]
    for k in bad:
        instances.pop(k)


def smooth(all_programs: list[dict]) -> None:
    """Give each compute span, as its share of its rank's FLOPs, the median of its measured
    durations over the steps and over the ranks that run the same program (tensor-parallel peers,
    data-parallel replicas: lockstep ranks doing the same work) — so that a span a busy machine
    stretched once takes no more of the FLOPs for it, and peers that split a layer's work evenly
    are not made to wait for each other by noise."""
    shape = {}
    for r in all_programs[0]:
        shapes = {tuple((op.kind, op.phase) for op in progs[r]) for progs in all_programs}
        if len(shapes) == 1:
            shape.setdefault(shapes.pop(), []).append(r)
    for ranks in shape.values():
        for i, op in enumerate(all_programs[0][ranks[0]]):
            if op.kind == "compute":
                w = statistics.median(progs[r][i].seconds for progs in all_programs for r in ranks)
                for progs in all_programs:
                    for r in ranks:
                        progs[r][i].weight = w


def even(result, step_index: int, programs: dict) -> None:
    """Give each forward (each backward, each W pass) interval of a rank's step the median weight
    of its kind's intervals on that rank, split over the interval's compute spans as measured —
    equal micro-batches do equal work, whatever this machine's noise made them take.  The
    backward's FLOPs go to the backward and W intervals only, in the proportion of their kinds'
    medians: the bookkeeping between actions (Python here; on a GPU it runs ahead of the kernels)
    takes none.  For GPipe, 1F1B and ZB-H1 (an interleaved rank's chunks differ by the embedding
    or the head)."""
    def overlap(op, a, b):
        return max(0.0, min(b, op.measured[1]) - max(a, op.measured[0]))

    phase_of = {"forward": "forward", "backward": "model", "weights": "model"}
    for r, prog in programs.items():
        _, t0, _, spans = windows(result.events[r]["marks"])[step_index]
        weights = {id(op): op.share for op in prog if op.kind == "compute"}
        evened: dict = {}  # phase -> {op: its new weight}
        evened_any = set()
        for kind, phase in phase_of.items():
            intervals = [(a - t0, b - t0) for a, b in spans.get(kind, [])]
            ops = [op for op in prog if op.kind == "compute" and op.phase == phase]
            share = {}  # op -> [(interval, its weight inside the interval)]
            for op in ops:
                d = op.measured[1] - op.measured[0]
                share[id(op)] = [(i, weights[id(op)] * overlap(op, a, b) / d) for i, (a, b)
                                 in enumerate(intervals) if d > 0 and overlap(op, a, b) > 0]
            totals = [sum(w for op in ops for j, w in share[id(op)] if j == i)
                      for i in range(len(intervals))]
            filled = [t for t in totals if t > 0]
            into = evened.setdefault(phase, {})
            if len(filled) >= 2:
                evened_any.add(phase)
            for op in ops:
                if len(filled) < 2:  # too few to even: as measured
                    new = sum(w for _, w in share[id(op)])
                else:
                    typical = statistics.median(filled)
                    new = sum(typical * w / totals[i] for i, w in share[id(op)] if totals[i] > 0)
                into[id(op)] = into.get(id(op), 0.0) + new
        for op in prog:  # a phase none of whose kinds could be evened stays as measured
            if op.kind == "compute" and op.phase in evened_any:
                op.weight = evened[op.phase][id(op)]


# --------------------------------------------------------------------------------------------------
# This machine's α-β, fitted on the run's own messages
# --------------------------------------------------------------------------------------------------


def completed_at(e: dict) -> float | None:
    """When this rank saw the communication ``e`` complete, or None where it did not: a blocking
    call when it returned; an asynchronous one when its work's future fired (before its wait
    returned).  A work without a future (gloo's point-to-point, and its reduce-scatter in torch
    2.13: "getFuture not implemented") records its wait's return as its end, which is not its
    completion unless the rank was already waiting; and timing only those its members all waited
    for would time only the slow ones (zero3 on 2 ranks then replayed 1.12-1.38 times its measured
    step, 0.94-1.09 without them): its price is the α of all the run's collectives."""
    if not e["async_op"] or e["wait_end"] is None or e["end"] < e["wait_end"]:
        return e["end"]
    return None


def message_times(result) -> list[tuple]:
    """(op, ranks, bytes, seconds, step) of the run's own communications, as the ranks saw them
    (one clock: the ranks of one host).  A collective is timed when every member saw it complete
    (:func:`completed_at`), from when the replay would start it — its last member's issue, or the
    completion of the collective before it on the same group, whichever is later (one stream per
    group: what the replay prices is a collective's time on the wire, not its wait in the queue) —
    to its last member's completion.  Prefetched and overlapped collectives count as blocking ones
    do: the ranks computing meanwhile slow them here, and the replay's measured compute ran beside
    them as well.  A message from its send's post to its arrival, seen by a receiver that was
    already waiting for it.  The first recorded step is left out (warm-up)."""
    out = []
    logs = result.events
    steps = len(windows(logs[0]["marks"]))
    for i in range(1 if steps > 1 else 0, steps):
        issue, done, meta, sends, recvs = defaultdict(dict), defaultdict(dict), {}, {}, {}
        for r, log in enumerate(logs):
            _, t0, t1, opts = windows(log["marks"])[i]
            _, keyed = program(r, log["events"], t0, t1, opts)
            for key, e in keyed.items():
                if key[0] == "p":
                    (sends if e["op"] == "send" else recvs)[key] = e
                    continue
                issue[key][r] = e["start"]
                meta[key] = (e["op"], len(key[1]), e["bytes"])
                seen = completed_at(e)
                if seen is not None:
                    done[key][r] = seen
        finished: dict = {}  # key -> the last completion its members saw
        for key in sorted(meta, key=lambda k: (k[1], k[2])):
            op, n, nbytes = meta[key]
            if done[key]:
                finished[key] = max(done[key].values())
            if len(issue[key]) != n or len(done[key]) != n:
                continue
            start = max(issue[key].values())
            before = ("c", key[1], key[2] - 1)
            if before in finished:
                start = max(start, finished[before])
            if n > 1:
                out.append((op, n, nbytes, max(1e-7, finished[key] - start), i))
        for key, rv in recvs.items():
            sd = sends.get(key)
            if sd is None or rv["wait_start"] is None:
                continue
            # only a receiver already waiting when the send was posted saw the message arrive
            if rv["start"] <= sd["start"] and rv["wait_start"] <= sd["start"]:
                out.append(("send", 2, rv["bytes"], max(1e-7, rv["wait_end"] - sd["start"]), i))
    return out


def fit_run(result, beta: float | None = None) -> dict | None:
    """This machine's α-β from the run's own messages (:func:`message_times`).  With ``beta``
    given (an all-reduce sweep's, lesson 01: its fastest repeats measure the wire; the run's
    messages, on a loaded machine, mostly its delays), α is the typical step's: the median over the
    steps of a step's mean excess over β per ring step — a step's many collectives add up to its
    mean (the delays of a loaded machine are heavy-tailed), and a step the shared machine stalled
    whole is one step of several, as the replay's compute is the median step's.  Without it, least
    squares on T = α·steps + β·bytes over every collective, in absolute error; β only when the
    sizes span a factor of 100 and reach 1 KB.  Each collective also on its own (``per_op``:
    gloo's algorithms differ), its α the typical step's as above; one the run never timed (a
    reduce-scatter without a future) takes the α of all.  A point-to-point message's latency apart
    (``p2p_alpha``: the median of the messages a receiver waited for — gloo's are a rendezvous,
    unlike a collective's step).  None when nothing was sent."""
    import numpy as np

    from .costmodel import ring_steps, ring_volume
    groups, p2p = defaultdict(list), []
    for op, n, b, sec, step in message_times(result):
        if op == "send":
            p2p.append((b, sec))
        else:
            groups[(op, n, b)].append((sec, step))
    if not groups and not p2p:
        return None
    out: dict = {}

    def fit(rows):
        """(α, β or None) by least squares in absolute error; β only from sizes that tell."""
        A = np.array([[ring_steps(op, n), ring_volume(op, b, n)] for op, n, b, _ in rows], float)
        t = np.array([r[3] for r in rows], float)
        sizes = [b for _, _, b, _ in rows if b > 0]
        if sizes and max(sizes) >= 1024 and max(sizes) >= 100 * min(sizes):
            (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
            if beta > 0 and alpha >= 0:
                return float(alpha), float(beta)
        return float(np.sum(t * A[:, 0]) / max(np.sum(A[:, 0] ** 2), 1e-30)), None

    def typical_alpha(ops, beta: float) -> float:
        """The median over the steps of a step's mean excess over β, per ring step."""
        by_step = defaultdict(list)
        for (o, n, by), secs in groups.items():
            if o in ops:
                for sec, step in secs:
                    by_step[step].append((sec - ring_volume(o, by, n) * beta) / ring_steps(o, n))
        return max(0.0, statistics.median(float(np.mean(x)) for x in by_step.values()))

    rows = [(op, n, b, sec) for (op, n, b), secs in groups.items() for sec, _ in secs]
    if rows:
        names = {r[0] for r in rows}
        if beta is None:
            alpha, beta = fit(rows)
            out["alpha"] = max(alpha, 0.0)
        else:  # the sweep's β (its fastest repeats: the wire); the run's messages give α
            out["alpha"] = typical_alpha(names, beta)
        if beta is not None:
            out["beta"] = beta
        out["per_op"] = {name: (typical_alpha({name}, beta or 0.0), beta or 0.0) for name in names}
    if p2p:
        out["p2p_alpha"] = max(0.0, statistics.median(sec - by * out.get("beta", beta or 0.0)
                                                      for by, sec in p2p))
        out.setdefault("alpha", out["p2p_alpha"])
    elif "alpha" in out:
        out["p2p_alpha"] = None  # no message was seen arriving: the sweep's ping-pong, if any
    return out
