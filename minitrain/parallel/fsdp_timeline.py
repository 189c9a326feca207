"""How much of ZeRO-3's all-gather time ran behind compute, from a unit timeline (lesson 04).

A timeline is a list of events ``{"unit", "kind", "start", "end", "backward"}`` with ``kind`` one of
``gather``, ``compute``, ``free`` (an instant) and ``reduce_scatter``, as
:class:`~minitrain.parallel.fsdp.FullyShardedDataParallel` records them with ``record_timeline``.
Pure functions, no torch.
"""

from __future__ import annotations

__all__ = ["hidden_fraction", "merge_intervals"]


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
    gather recorded)."""
    compute = merge_intervals((e["start"], e["end"]) for e in timeline if e["kind"] == "compute")
    total = hidden = 0.0
    for e in timeline:
        if e["kind"] != "gather":
            continue
        total += e["end"] - e["start"]
        hidden += sum(max(0.0, min(e["end"], b) - max(e["start"], a)) for a, b in compute)
    return hidden / total if total > 0 else None
