"""Lesson 02: DDP's overlap, drawn from a real run's timeline.

Each rank's DDP wrapper records, per step, when backward started and ended and when each bucket's
all-reduce started and completed (a ``DistributedDataParallel``'s ``timeline``, set to a list).
``timeline_rows`` (pure) turns that into bars relative to the step's start; ``plot_ddp_timeline``
draws compute and communication per rank, so you see the buckets leave while backward still runs.
``trace_rows`` and ``plot_trace`` draw the same step from a ``torch.profiler`` trace
(:mod:`minitrain.runtime.profiling`): the backward's operators, and the all-reduces on the threads
that ran them.
"""

from __future__ import annotations

from ..runtime.profiling import ALL_REDUCE, BACKWARD, trace_spans

__all__ = ["timeline_rows", "plot_ddp_timeline", "trace_rows", "plot_trace"]


def timeline_rows(reports: list[dict], step: int = -1) -> list[dict]:
    """Per rank: the backward bar and the bucket bars of one step, in ms from the earliest start."""
    steps = [r["timeline"][step] for r in reports]
    t0 = min(s["backward_start"] for s in steps)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    return [dict(rank=rank,
                 backward=(ms(s["backward_start"]), ms(s["backward_end"])),
                 buckets=[(b["index"], ms(b["start"]), ms(b["end"]), b["bytes"]) for b in s["buckets"]])
            for rank, s in enumerate(steps)]


def plot_ddp_timeline(reports: list[dict], step: int = -1, ax=None, title: str | None = None,
                      legend: bool = True, what: str = "all-reduce"):
    """Backward compute and each bucket's collective (``what``), per rank, for one step of a real
    run — or of its projection (:func:`minitrain.planning.projection.ddp_timeline`), drawn by the same
    function; ``ax`` to draw beside another."""
    import matplotlib.pyplot as plt

    rows = timeline_rows(reports, step)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 1.4 + 0.9 * len(rows)))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    for row in rows:
        y = row["rank"]
        start, end = row["backward"]
        ax.barh(y + 0.18, end - start, left=start, height=0.32, color="#999999",
                label="backward (compute)" if y == 0 else None)
        for index, b0, b1, nbytes in row["buckets"]:
            first = y == 0 and index == 0
            span = max(row["backward"][1], max((b[2] for b in row["buckets"]), default=0)) or 1
            ax.barh(y - 0.18, max(b1 - b0, span / 400), left=b0, height=0.32,
                    color=colors(index % 10),
                    label=f"{what} of a bucket (one colour each)" if first else None)
    ax.set_yticks(range(len(rows)), [f"rank {r['rank']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward started")
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or "DDP: buckets are all-reduced while backward is still running",
                 fontsize=10 if title else None)
    fig.tight_layout()
    return fig


def trace_rows(path: str) -> dict:
    """A profiled DDP step's trace as bars in ms from its first backward operator: ``backward``
    (the operators' spans, merged where they touch), ``launches`` (the rank's ``c10d::allreduce_``
    calls) and ``work`` (the backend's all-reduces: gloo's run on threads of their own; on a GPU,
    NCCL's kernels), each ``(start, end)``; and ``backward_span``, the first start and last end."""
    ops = trace_spans(path, BACKWARD)
    if not ops:
        raise ValueError(f"{path}: no backward operators in the trace (was a training step "
                         "profiled?)")
    t0 = ops[0]["start"]
    ms = lambda s: ((s["start"] - t0) * 1e3, (s["end"] - t0) * 1e3)  # noqa: E731
    merged: list = []
    for a, b in map(ms, ops):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    reduces = trace_spans(path, ALL_REDUCE)
    launches = [ms(r) for r in reduces if r["name"].startswith("c10d::")]
    work = [ms(r) for r in reduces if not r["name"].startswith("c10d::")]
    return {"backward": merged, "launches": launches, "work": work,
            "backward_span": (merged[0][0], max(b for _, b in merged))}


def plot_trace(path: str, ax=None, title: str | None = None):
    """The profiled step from its trace, on the time axis of :func:`plot_ddp_timeline` (ms since
    backward started): the backward's operators, the all-reduce calls the rank made, and the
    backend's all-reduce work."""
    import matplotlib.pyplot as plt

    rows = trace_rows(path)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 2.2))
    else:
        fig = ax.figure
    spans = {"backward operators (main thread)": (rows["backward"], "#999999"),
             "c10d::allreduce_ calls (main thread)": (rows["launches"], "tab:blue"),
             "gloo:all_reduce work (gloo's threads)": (rows["work"], "tab:orange")}
    for y, (label, (bars, color)) in enumerate(spans.items()):
        for a, b in bars:
            ax.barh(y, max(b - a, 0.02), left=a, height=0.5, color=color)
    ax.set_yticks(range(len(spans)), list(spans))
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward started")
    ax.set_title(title or "the same step in torch.profiler's trace", fontsize=10)
    fig.tight_layout()
    return fig
