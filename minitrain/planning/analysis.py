"""What a run's records say, and what the lessons' widgets draw: pure functions, no processes.

The techniques (:mod:`minitrain.parallel`) record what they did — DDP each bucket's all-reduce
(into its ``timeline``, once set to a list), ZeRO-3 each unit's gather, compute and free, the pipeline executor each
action — and these functions read those records, beside the formulas the lessons derive:

* :func:`overlap_fraction` — the share of DDP's all-reduce time hidden behind backward (lesson 02);
* :func:`shard_layout` — who owns which elements of ZeRO's flat, padded vector (lesson 04's
  sharding widget); :func:`hidden_fraction` — the share of ZeRO-3's all-gather time hidden behind
  compute by prefetch (lesson 04);
* :func:`bubble_fraction`, :func:`bubble_formula`, :func:`peak_in_flight` — a pipeline schedule's
  idle share against (p−1)/(v·m+p−1), and the micro-batches it holds at once (lesson 05).

Each works on ideal records (a schedule simulated in units of time) as on measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.flat import FlatUnit
from ..parallel.schedules import Action, as_action

__all__ = ["overlap_fraction", "ShardLayout", "shard_layout", "merge_intervals", "hidden_fraction",
           "bubble_fraction", "bubble_formula", "peak_in_flight", "PROJECTED_TIE", "tied_with_best",
           "order_with_ties"]


# --------------------------------------------------------------------------------------------------
# DDP (lesson 02): all-reduce behind backward
# --------------------------------------------------------------------------------------------------


def overlap_fraction(step: dict) -> float:
    """Share of a step's all-reduce time that ran while backward was still computing (one step of
    ``DistributedDataParallel.timeline``)."""
    start, end = step["backward_start"], step["backward_end"]
    total = sum(b["end"] - b["start"] for b in step["buckets"])
    hidden = sum(max(0.0, min(b["end"], end) - max(b["start"], start)) for b in step["buckets"])
    return hidden / total if total > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# ZeRO (lesson 04): the partition, and prefetch behind compute
# --------------------------------------------------------------------------------------------------


@dataclass
class ShardLayout:
    """Who owns what, for a sharding widget: ``owned[r] = (start, end)`` in the padded flat vector of
    ``total`` elements (``padding`` of them zeros at the end); ``params[r]`` lists ``(name, start,
    end)`` element ranges of the parameters rank r owns; ``boundaries`` each parameter's
    ``(name, start, end)`` in the flat vector."""

    world_size: int
    numel: int
    total: int
    shard_size: int
    padding: int
    owned: list
    params: list
    boundaries: list


def shard_layout(params, world_size: int) -> ShardLayout:
    """The ZeRO partition of ``params`` (tensors, or ``(name, tensor)`` pairs) over ``world_size``
    ranks: flattened in order, padded to a multiple of N, rank r owns ``[r·S, (r+1)·S)`` — the
    :class:`~minitrain.parallel.flat.FlatUnit` ZeRO itself uses."""
    params = list(params)
    if params and isinstance(params[0], tuple):
        names, tensors = [n for n, _ in params], [p for _, p in params]
    else:
        names, tensors = list(range(len(params))), params
    unit = FlatUnit(tensors, world_size, names)
    return ShardLayout(world_size, unit.numel, unit.total, unit.shard_size, unit.padding,
                       [unit.owned_range(r) for r in range(world_size)],
                       [unit.owned_params(r) for r in range(world_size)],
                       [(n, o, o + k) for n, o, k in zip(names, unit.offsets, unit.numels)])


#: the unit of a ZeRO-3 timeline's compute that belongs to no unit (hooks, the loss, the
#: optimizer), as :func:`minitrain.planning.projection.fsdp_timeline` adds it
OTHER_COMPUTE = -1


def merge_intervals(intervals) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def hidden_fraction(timeline: list[dict]) -> float | None:
    """The share of the total all-gather time during which some unit was computing (None: no
    gather recorded).  ``timeline``: ZeRO-3's events ``{"unit", "kind", "start", "end",
    "backward"}``, ``kind`` one of ``gather``, ``compute``, ``free`` (an instant) and
    ``reduce_scatter`` (a ``FullyShardedDataParallel``'s ``timeline``, once set to a list)."""
    compute = merge_intervals((e["start"], e["end"]) for e in timeline if e["kind"] == "compute")
    total = hidden = 0.0
    for e in timeline:
        if e["kind"] != "gather":
            continue
        total += e["end"] - e["start"]
        hidden += sum(max(0.0, min(e["end"], b) - max(e["start"], a)) for a, b in compute)
    return hidden / total if total > 0 else None


# --------------------------------------------------------------------------------------------------
# Pipelines (lesson 05): the bubble and the activations in flight
# --------------------------------------------------------------------------------------------------


def bubble_fraction(timeline: list[dict], stages: int) -> float:
    """Idle share of the step: 1 − busy / (stages · makespan), makespan from the first start to the
    last end.  Works for ideal (:func:`~minitrain.parallel.schedules.simulate`) and measured
    (executor) timelines."""
    if not timeline:
        return 0.0
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    total = stages * span
    busy = sum(e["end"] - e["start"] for e in timeline)
    return (total - busy) / total if total > 0 else 0.0


def bubble_formula(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p−1)/(v·m + p−1): GPipe and 1F1B (v = 1), interleaved 1F1B with v chunks per rank."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def peak_in_flight(table_or_timeline) -> dict[int, int]:
    """Per rank, the most (micro-batch, stage) pairs forwarded and not yet backwarded at any time
    — what sets activation memory.  Under zero-bubble a pair is held until its W (the weight
    gradient still needs the stashed layer inputs).  Accepts a table or a timeline."""
    rows: dict[int, list[Action]] = {}
    if table_or_timeline and isinstance(table_or_timeline[0], dict):
        for e in sorted(table_or_timeline, key=lambda e: (e["rank"], e["start"])):
            rows.setdefault(e["rank"], []).append(as_action(e["action"]))
    else:
        rows = {r: [a for a in row if a is not None] for r, row in enumerate(table_or_timeline)}
    peaks = {}
    for r, acts in rows.items():
        held = peak = 0
        for a in acts:
            held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks[r] = peak
    return peaks


# --------------------------------------------------------------------------------------------------
# Naming a winner among projected times
# --------------------------------------------------------------------------------------------------

#: Projected times closer than this share are a tie.  A replay gives every step of a run the same
#: time, so no spread of steps separates two projections; but its prices (the kernels' rates, the
#: links' α and bandwidth) are not known to within a per cent, so a smaller difference says
#: nothing about which layout or setting would be faster.
PROJECTED_TIE = 0.01


def tied_with_best(times: dict, tol: float = PROJECTED_TIE, largest: bool = False) -> list:
    """The keys of ``times`` within ``tol`` of the smallest (``largest``: the largest) value, in
    the order of their values: one key when a single winner stands out, more when they tie."""
    best = max(times.values()) if largest else min(times.values())
    near = [k for k, t in times.items() if abs(t - best) <= tol * abs(best)]
    return sorted(near, key=times.get, reverse=largest)


def order_with_ties(times: dict, name=str, tol: float = PROJECTED_TIE) -> str:
    """The keys of ``times`` from the smallest value up, joined by " < ", or " ≈ " where a key's
    value is within ``tol`` of the one before it (``name`` words a key)."""
    order = sorted(times, key=times.get)
    out = name(order[0]) if order else ""
    for a, b in zip(order, order[1:]):
        out += (" ≈ " if times[b] - times[a] <= tol * abs(times[a]) else " < ") + name(b)
    return out
