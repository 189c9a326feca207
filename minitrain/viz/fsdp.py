"""Lesson 04: ZeRO-3's gather → compute → free, drawn from a real run's timeline.

Each rank's :class:`~minitrain.parallel.fsdp.FullyShardedDataParallel` (its ``timeline`` set to a list)
records, per unit, when its all-gather was issued and completed, when it computed, when its full
parameters were freed and when its gradients were reduce-scattered.  ``unit_timeline_rows`` (pure)
lines the ranks up on one clock in ms; ``plot_fsdp_timeline`` draws them: with prefetch the next
unit's gather runs under the current unit's compute.
"""

from __future__ import annotations

from ..planning.analysis import OTHER_COMPUTE, hidden_fraction

__all__ = ["unit_timeline_rows", "plot_fsdp_timeline"]

LANES = {"gather": 0, "compute": 1, "reduce_scatter": 2}


def unit_timeline_rows(timelines: list[list[dict]]) -> list[dict]:
    """Per rank: its bars (``unit, kind, start, end, backward``; ms from the earliest event of any
    rank) in time order, and the share of its all-gather time hidden behind compute."""
    t0 = min((e["start"] for tl in timelines for e in tl), default=0.0)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    return [dict(rank=rank, hidden=hidden_fraction(tl),
                 bars=[dict(unit=e["unit"], kind=e["kind"], start=ms(e["start"]), end=ms(e["end"]),
                            backward=e["backward"]) for e in sorted(tl, key=lambda e: e["start"])])
            for rank, tl in enumerate(timelines)]


def plot_fsdp_timeline(timelines: list[list[dict]], unit_names: dict[int, str] | None = None,
                       title: str | None = None):
    """Gather, compute and reduce-scatter lanes per rank (one colour per unit, named in a legend
    beside the axis by ``unit_names`` — unit index → name — or "unit 3"), frees as ticks; a real
    run's, or its projection's (:func:`minitrain.planning.projection.fsdp_timeline`)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = unit_timeline_rows(timelines)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 1.3 * len(rows)))
    colors = plt.get_cmap("tab10")
    colour = lambda u: "0.75" if u == OTHER_COMPUTE else colors(u % 10)  # noqa: E731
    labels = []
    for row in rows:
        base = row["rank"] * 4
        for b in row["bars"]:
            if b["kind"] == "free":
                ax.plot([b["start"]] * 2, [base + 0.6, base + 1.4], color="black", lw=0.8)
                continue
            y = base + LANES[b["kind"]]
            ax.barh(y, max(b["end"] - b["start"], 0.02), left=b["start"], height=0.7,
                    color=colour(b["unit"]), hatch="//" if b["backward"] else None,
                    edgecolor="white" if b["backward"] else None)
        hidden = "-" if row["hidden"] is None else f"{row['hidden']:.0%}"
        labels += [(base + k, f"rank {row['rank']} {kind}" + (f" ({hidden} hidden)" if k == 0 else ""))
                   for kind, k in LANES.items()]
    units = sorted({b["unit"] for row in rows for b in row["bars"] if b["kind"] != "free"})
    names = {OTHER_COMPUTE: "other compute (hooks, loss, optimizer)", **(unit_names or {})}
    ax.legend(handles=[Patch(color=colour(u), label=names.get(u, f"unit {u}")) for u in units],
              title="unit", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms (hatched: backward; black ticks: full parameters freed)")
    ax.set_title(title or "ZeRO-3: gather → compute → free per unit (colour), next gather issued ahead")
    fig.tight_layout()
    return fig
