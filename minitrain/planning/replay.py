"""The discrete-event replay under the projection: each rank's step as a program of
compute spans, communication issues and waits, replayed on a cost model.

The rules, each proved on hand-made programs in ``tests/test_projection.py``:

* each rank has one compute stream and, per process group, one communication stream (NCCL gives
  every process group its own stream): a rank's collectives on one group run one after another;
* a collective starts when every member of its group has issued it (the last member decides) and
  its stream is free; a point-to-point message once both its send and its receive are posted;
  each then takes what the cost model says (``cost(instance)``);
* a wait blocks the rank's compute stream until its communication is done; an issue that returned
  only once its communication was done (gloo's collectives on a CPU) blocks the same way.

:func:`replay` runs the programs; :func:`breakdown` splits the replayed step into compute, exposed
communication, bubble and idle and says how much communication was hidden; :func:`timelines` gives
each rank's replayed step in the tracer's form.  Where the programs come from (a real run's
recorded events) is :mod:`minitrain.planning.recorded`; what each span and message costs on a cluster, at
which model size, is :mod:`minitrain.planning.projection` and :mod:`minitrain.planning.scaling`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["Op", "Instance", "ReplayError", "replay", "breakdown", "timelines"]


class ReplayError(RuntimeError):
    """The event log cannot be replayed (a wait whose communication is never issued by all)."""


@dataclass
class Op:
    """One entry of a rank's program: ``compute`` (``seconds`` measured, ``phase`` "forward",
    "model" (backward, recomputation, anything else of the step) or "optimizer"), ``issue`` (post
    communication ``key``; ``seconds``: the call's own time) or ``wait`` (block until ``key`` is
    done; ``seconds``: how long it blocked when measured)."""

    kind: str
    seconds: float = 0.0
    key: tuple | None = None
    phase: str = "model"
    measured: tuple = (0.0, 0.0)   # the measured interval (relative to the step's start)
    blocking: bool = False         # issue: the call itself returned only once it was done (gloo)
    weight: float | None = None    # compute: its share of the step's FLOPs (default: seconds)

    @property
    def share(self) -> float:
        """A compute span's weight in sharing out its rank's FLOPs: ``weight``, else its
        measured seconds."""
        return self.seconds if self.weight is None else self.weight


@dataclass
class Instance:
    """One communication: ``op`` on ``members`` (global ranks; a send's are (src, dst)), ``bytes``
    per member, ``repeat`` back-to-back copies (a per-layer message standing for several layers)."""

    op: str
    members: tuple
    bytes: float
    repeat: float = 1.0
    group: str = ""
    tag: str = ""
    seconds: float | None = None   # fixed cost (tests); else the cluster's


def replay(programs: dict, instances: dict, cost=None, compute=None, issue_cost: bool = True,
           start: dict | None = None) -> dict:
    """Replay ``programs`` ({rank: [Op]}) discrete-event.  ``instances``: {key: Instance};
    ``cost(instance)`` its seconds (default ``instance.seconds``); ``compute(rank, op)`` a compute
    span's seconds (default its measured ``op.seconds``); ``issue_cost``: posting takes the
    issuing call's measured time on the compute stream, or, when that call returned only once the
    communication was done (``op.blocking``: gloo on a CPU), blocks until it is done — else
    posting costs nothing (a GPU's launch).  ``start``: {rank: when it starts} (default 0).

    Rules: a collective starts when every member has issued it and each member's previous
    collective on that group has finished; a point-to-point message when both its send and its
    receive are posted; each takes ``cost``.  A wait blocks its rank's compute stream until the
    communication is done.  Returns ``{"ranks": {rank: {"end", "segments"}}, "comm": {key:
    (start, end)}, "step_time"}``; raises :class:`ReplayError` when some rank can never go on."""
    cost = cost or (lambda inst: inst.seconds * inst.repeat)
    compute = compute or (lambda rank, op: op.seconds)
    t = {r: (start or {}).get(r, 0.0) for r in programs}
    t0 = dict(t)
    pc = {r: 0 for r in programs}
    segs: dict = {r: [] for r in programs}
    issued: dict = defaultdict(dict)
    done: dict = {}
    stream_prev: dict = {}  # collective key -> the previous key on each member's stream
    last_on_stream: dict = {}
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "issue" and op.key[0] == "c":
                slot = (r, op.key[1])
                stream_prev.setdefault(op.key, []).append(last_on_stream.get(slot))
                last_on_stream[slot] = op.key

    def resolve(key) -> bool:
        if key in done:
            return True
        inst = instances[key]
        members = inst.members
        if any(m not in issued[key] for m in members):
            return False
        start = max(issued[key][m] for m in members)
        for prev in stream_prev.get(key, []):
            if prev is not None:
                if prev not in done:
                    return False
                start = max(start, done[prev][1])
        done[key] = (start, start + cost(inst))
        return True

    pending: set = set()
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if op.kind == "compute":
                    d = compute(r, op)
                    segs[r].append({"kind": "compute", "phase": op.phase, "start": t[r],
                                    "end": t[r] + d, "measured": op.measured})
                    t[r] += d
                elif op.kind == "issue":
                    if op.key not in instances:
                        raise ReplayError(f"rank {r} issues {op.key}, which no instance describes")
                    if op.key not in issued or r not in issued[op.key]:
                        issued[op.key][r] = t[r]
                        if not resolve(op.key):
                            pending.add(op.key)
                    if issue_cost and op.blocking:  # the call returned once it was done
                        if op.key not in done:
                            break
                        end = done[op.key][1]
                        segs[r].append({"kind": "wait", "key": op.key, "start": t[r],
                                        "end": max(t[r], end), "measured": op.measured})
                        t[r] = max(t[r], end)
                    else:
                        d = op.seconds if issue_cost else 0.0
                        segs[r].append({"kind": "issue", "key": op.key, "start": t[r],
                                        "end": t[r] + d, "measured": op.measured})
                        t[r] += d
                else:
                    if not resolve(op.key):
                        break
                    end = done[op.key][1]
                    segs[r].append({"kind": "wait", "key": op.key, "start": t[r],
                                    "end": max(t[r], end), "measured": op.measured})
                    t[r] = max(t[r], end)
                pc[r] += 1
                progress = True
        for key in list(pending):
            if resolve(key):
                pending.discard(key)
                progress = True
    stuck = {r: prog[pc[r]] for r, prog in programs.items() if pc[r] < len(prog)}
    if stuck:
        lines = []
        for r, op in sorted(stuck.items()):
            inst = instances.get(op.key)
            missing = [m for m in (inst.members if inst else ()) if m not in issued[op.key]]
            lines.append(f"rank {r} waits for {op.key[0] == 'p' and 'a message' or inst.op} "
                         f"{op.key}: not issued by rank(s) {missing}")
        raise ReplayError("the event log cannot be replayed: " + "; ".join(lines))
    first = min(t0.values(), default=0.0)
    return {"ranks": {r: {"start": t0[r], "end": t[r], "segments": segs[r]} for r in programs},
            "comm": done,
            "step_time": max(t.values(), default=0.0) - first}


def _merge(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def breakdown(rep: dict, pipeline: bool = False) -> dict:
    """Mean over ranks of compute, exposed communication, bubble and idle (they add up to the step
    time: a rank's waiting is exposed communication while its communication is in flight, else
    idle — bubble in a ``pipeline`` on point-to-point waits and at the end), ``comm_s`` (the time
    a rank has communication in flight), and the share of that hidden behind compute."""
    T = rep["step_time"]
    sums = defaultdict(float)
    busy_total = exposed_total = 0.0
    n = len(rep["ranks"])
    for r, info in rep["ranks"].items():
        busy = []
        exposed = 0.0
        for s in info["segments"]:
            d = s["end"] - s["start"]
            if s["kind"] == "compute":
                sums["compute_s"] += d
            elif s["kind"] == "issue":
                exposed += d
                busy.append((s["start"], s["end"]))
            else:
                a, b = rep["comm"][s["key"]]
                busy.append((a, b))
                overlap = max(0.0, min(b, s["end"]) - max(a, s["start"]))
                exposed += overlap
                sums["bubble_s" if pipeline and s["key"][0] == "p" else "idle_s"] += d - overlap
        sums["exposed_comm_s"] += exposed
        sums["bubble_s" if pipeline else "idle_s"] += T - (info["end"] - info.get("start", 0.0))
        busy_total += _merge(busy)
        exposed_total += min(exposed, _merge(busy)) if busy else 0.0
    out = {k: sums[k] / n for k in ("compute_s", "exposed_comm_s", "bubble_s", "idle_s")}
    out["comm_s"] = busy_total / n
    out["hidden_comm_share"] = 1 - exposed_total / busy_total if busy_total > 0 else None
    return out


def timelines(rep: dict) -> list[list[dict]]:
    """Per rank of ``rep`` (a :func:`replay`'s result with the ``instances`` it replayed), in the
    tracer's form (seconds from the step's start): its communications
    (``op``, ``bytes``, ``start``, ``end``, ``group``, ``tag``) and its compute spans (``op``
    "compute", ``phase``), and the measured interval each segment replays (``measured``)."""
    out = []
    for r in sorted(rep["ranks"]):
        rows = []
        seen = set()
        for s in rep["ranks"][r]["segments"]:
            if s["kind"] == "compute":
                rows.append({"op": "compute", "phase": s["phase"], "start": s["start"],
                             "end": s["end"], "measured": s["measured"]})
                continue
            key = s["key"]
            if key in seen:
                continue
            seen.add(key)
            inst = rep["instances"][key]
            a, b = rep["comm"][key]
            rows.append({"op": inst.op, "bytes": inst.bytes * inst.repeat, "start": a, "end": b,
                         "group": inst.group, "tag": inst.tag, "issued": s["start"],
                         "measured": s["measured"]})
        out.append(sorted(rows, key=lambda e: e["start"]))
    return out
