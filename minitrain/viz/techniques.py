"""The map of the course's techniques (shown before lesson 02): for each strategy, the lesson that
builds it, what it splits over the ranks (its :class:`~minitrain.record.Layout`), what one step
sends (its tracer, measured on a real step) and what it is (its ``help``).  Nothing in the table
is typed: :func:`technique_rows` trains each strategy for a few steps on the same running ranks
and reads the run's record.
"""

from __future__ import annotations

import importlib
import re

__all__ = ["MAP", "technique_rows", "technique_table"]

#: (strategy, its options on 4 ranks, the model preset): one row each, in the course's order
MAP = [
    ("ddp", {}, "tiny"),
    ("ps-sync", {"servers": 1}, "tiny"),
    ("zero1", {}, "tiny"),
    ("zero2", {}, "tiny"),
    ("zero3", {}, "tiny"),
    ("pipeline", {"schedule": "1f1b", "microbatches": 4}, "tiny"),
    ("tensor", {}, "tiny"),
    ("3d", {"dp": 2, "pp": 2, "tp": 1}, "tiny"),
    ("context", {"cp": 2}, "tiny"),
    ("expert", {}, "tiny-moe"),
]

_OPS = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
        "broadcast": "broadcast", "send": "send", "recv": "receive", "all_to_all": "all-to-all",
        "reduce": "reduce", "gather": "gather", "scatter": "scatter"}


def _lesson(strategy) -> str:
    """The first lesson the strategy's module names in its docstring."""
    cls = strategy if isinstance(strategy, type) else type(strategy)
    doc = importlib.import_module(cls.__module__).__doc__ or ""
    found = re.findall(r"[Ll]esson (\d\d)", doc)
    return found[0] if found else ""


def _splits(layout) -> str:
    """What the layout splits over the ranks, in words."""
    parts = []
    if layout.free_running:
        parts.append("workers (each its batch) and servers (the model)")
    if layout.dp > 1:
        parts.append(f"the batch over {layout.dp} replicas")
    sharded = {1: "Adam's states", 2: "Adam's states and the gradients",
               3: "Adam's states, the gradients and the weights"}.get(layout.zero_stage)
    if sharded:
        parts.append(f"{sharded} over the replicas")
    if layout.pp > 1:
        parts.append(f"the layers into {layout.pp} stages")
    if layout.tp > 1:
        parts.append(f"each layer's matrices over {layout.tp} ranks")
    if layout.cp > 1:
        parts.append(f"each sequence over {layout.cp} ranks")
    if layout.ep > 1:
        parts.append(f"the experts over {layout.ep} ranks")
    return "; ".join(parts) or "nothing"


def _sends(comm: dict, steps: int) -> str:
    """Rank 0's calls and bytes per step, by operation (the tracer's summary; a receive sends
    nothing, its sender's row counts the bytes)."""
    rows = [(op, row) for op, row in comm.items() if op not in ("total", "recv") and row.get("calls")]
    rows.sort(key=lambda r: -r[1].get("sent_bytes", 0))
    return ", ".join(f"{row['calls'] / steps:g} × {_OPS.get(op, op)} ({row.get('sent_bytes', 0) / steps / 1e3:,.0f} kB)"
                     for op, row in rows) or "nothing"


def technique_rows(cluster, steps: int = 2, batch_size: int = 12) -> list[dict]:
    """One row per :data:`MAP` entry, from ``steps`` steps of it on ``cluster``'s running ranks:
    ``strategy``, ``lesson``, ``splits``, ``sends`` (rank 0, per step), ``help``."""
    from ..model import PRESETS
    from ..strategies import get_strategy
    from ..train import TrainConfig, train

    out = []
    for name, options, model in MAP:
        cfg = TrainConfig(strategy=name, world_size=cluster.world_size, steps=steps,
                          batch_size=batch_size, model=PRESETS[model], options=options)
        run = train(cfg, cluster=cluster)
        strategy = get_strategy(name)
        out.append({"strategy": name, "lesson": _lesson(strategy), "splits": _splits(run.summary.layout),
                    "sends": _sends(run.summary.comm[0], steps), "help": strategy.help})
    return out


def technique_table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| lesson | strategy | splits over the ranks | rank 0 sends per step (measured) | what it is |",
             "|---|---|---|---|---|"]
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731  (a table's column bar)
    lines += [f"| {r['lesson']} | `{r['strategy']}` | {cell(r['splits'])} | {cell(r['sends'])} | "
              f"{cell(r['help'])} |" for r in rows]
    return "\n".join(lines)
