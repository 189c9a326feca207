"""One training step under ``torch.profiler``, saved as a Chrome trace, and read back (lesson 02).

The profiler is the tool an engineer opens first: every operator the step ran, on every thread,
with its start and duration.  :class:`StepProfile` is a callback of :func:`minitrain.train.fit`
that profiles one step of a rank and writes ``DIR/rank<r>.json`` — the Chrome trace format that
Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open (``minitrain train ... --profile DIR``).
:func:`trace_spans` reads such a file back: the spans of the events whose names match, so a lesson
can draw the backward's operators and the collectives beside the package's own timeline, and a test
can check that the all-reduces ran while backward did.
"""

from __future__ import annotations

import json
import os
import re

import torch

__all__ = ["StepProfile", "profiled_step", "trace_spans", "trace_path", "BACKWARD", "ALL_REDUCE"]

#: Event names (regular expressions) of a trace: autograd's backward functions, and the
#: all-reduces (the c10d op the rank calls, and the backend's work: gloo's thread runs it as
#: "gloo:all_reduce"; NCCL's kernels as "ncclDevKernel_AllReduce..." on the GPU's stream).
BACKWARD = r"^autograd::engine::evaluate_function"
ALL_REDUCE = r"all_reduce|allreduce|AllReduce"


def trace_path(folder: str, rank: int) -> str:
    """Where rank ``rank``'s trace is written in ``folder``."""
    return os.path.join(folder, f"rank{rank}.json")


def profiled_step(steps: int, start: int = 0) -> int:
    """Which step is profiled: the second of the run (the first warms up: allocations, the
    first buckets, lazily built groups), or the only one."""
    return start + 1 if steps - start > 1 else start


class StepProfile:
    """Profiles step ``step`` of this rank (CPU activity, and CUDA where the rank runs on a GPU)
    and writes its Chrome trace to ``trace_path(folder, rank)`` at the step's end.  The profiled
    step runs slower than the others (the profiler records every operator): its time is the
    profiler's as well as the step's."""

    def __init__(self, folder: str, rank: int, step: int, cuda: bool = False):
        self.path, self.step, self.cuda, self._prof = trace_path(folder, rank), step, cuda, None

    def begin(self, step: int) -> None:
        if step != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()

    def end(self, step: int, loss: float) -> None:
        if step != self.step or self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._prof = None


def trace_spans(path: str, pattern: str) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace whose names match ``pattern`` (a
    regular expression), as ``{"name", "start", "end", "tid"}`` in seconds from the trace's first
    event, in start order."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
    if not timed:
        return []
    t0 = min(float(e["ts"]) for e in timed)
    rx = re.compile(pattern)
    spans = [{"name": e.get("name", ""), "start": (float(e["ts"]) - t0) * 1e-6,
              "end": (float(e["ts"]) + float(e.get("dur", 0)) - t0) * 1e-6, "tid": e.get("tid")}
             for e in timed if rx.search(e.get("name", ""))]
    return sorted(spans, key=lambda s: s["start"])
