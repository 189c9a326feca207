"""GPipe and 1F1B: minitrain's pipeline executor vs torch.distributed.pipelining, same split and run.

    python benchmarks/pipeline_bench.py [--ranks 2] [--microbatches 4 8] [--model 8x256]
                                        [--batch-size 16] [--steps 8] [--rounds 3]

For each world size P (= pipeline stages) and micro-batch count M, both implementations train the
same GPT cut the same way (embedding + the first blocks on stage 0, ..., the last blocks + head on
stage P-1, blocks split by ``pipeline.split_layers``), on the same batches, in one cluster: ours
through the ``pipeline`` strategy (``--schedule gpipe|1f1b``), PyTorch's as ``PipelineStage``
modules driven by ``ScheduleGPipe`` / ``Schedule1F1B`` with ``loss_fn`` on the last stage.  The two
replicas take turns step by step (so drifting machine load hits both alike); a step is timed from a
barrier to the end of the optimizer step, and ends when its slowest rank ends.

Prints, per schedule: the median step time of each, the ratio minitrain / PyTorch (target for 1F1B
and GPipe: <= 1.05); the span of the actions (first start to last end, so the step time minus the
span is what a step spends outside forward/backward: optimizer, barriers, splitting, our loss
broadcast); and the bubble fraction 1 - busy / (P * span) (``pipeline.bubble_fraction``) measured
from each one's recorded timeline of forward/backward actions (ours: the executor's own timeline;
PyTorch's: the wall-clock spans of ``forward_one_chunk`` / ``backward_one_chunk``, recorded by
wrapping them; both start an action once its input has arrived) beside the formula (P-1)/(M+P-1)
(target: within 10 % of it).  Every step's loss of both is compared with a single-process run (fp32,
target 1e-5 relative), so the race is between equal computations.

The ranks run one torch thread each; with more ranks than cores (4 ranks on a 2-core machine) the
ranks share cores, so the bubbles are filled by the OS scheduler and times are not meaningful.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from minitrain import PRESETS, Cluster, GPT
from minitrain.runtime.benchmarking import alternate
from minitrain.data import ArithmeticData
from minitrain.model import GPTConfig, loss_fn
from minitrain.planning.analysis import bubble_formula, bubble_fraction
from minitrain.parallel.schedules import Action, as_action, dependencies, split_layers

#: the presets, plus one deep enough for 4 stages whose compute dominates the point-to-point traffic
MODELS = {**PRESETS, "8x256": GPTConfig(n_layer=8, n_head=8, d_model=256, seq_len=64)}
SCHEDULES = ("gpipe", "1f1b")
LR = 1e-3


# --------------------------------------------------------------------------------------------------
# PyTorch's side: torch.distributed.pipelining with manual stage modules
# --------------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """A stage of the GPT for PipelineStage: embedding (first stage), blocks, head (last stage)."""

    def __init__(self, model: GPT, stage: int, stages: int):
        super().__init__()
        self.embed = model.embed if stage == 0 else None
        mine = split_layers(len(model.blocks), stages)[stage]
        self.blocks = nn.ModuleList(model.blocks[i] for i in mine)
        self.head = model.head if stage == stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class TorchPipeline:
    """This rank's stage of a torch.distributed.pipelining run, with a recorded action timeline."""

    def __init__(self, cfg: GPTConfig, schedule: str, microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.rank, self.stages = dist.get_rank(), dist.get_world_size()
        self.module = StageModule(GPT(cfg, seed=0), self.rank, self.stages)
        self.stage = PipelineStage(self.module, self.rank, self.stages, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(self.stage, n_microbatches=microbatches, loss_fn=loss_fn)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=LR)
        # this step's actions: rank, action, start, end, in seconds of perf_counter, the host's
        # monotonic clock, which all ranks on one host share (like our executor's common origin)
        self.timeline: list[dict] = []
        self._wrap("F", "forward_one_chunk")
        self._wrap("B", "backward_one_chunk")

    def _wrap(self, kind: str, name: str) -> None:
        """Record the wall-clock span of every call of ``stage.<name>`` (instance attribute: the
        schedule calls it through the stage object)."""
        inner = getattr(self.stage, name)

        def timed(chunk_id, *args, **kwargs):
            start = time.perf_counter()
            out = inner(chunk_id, *args, **kwargs)
            self.timeline.append({"rank": self.rank, "action": f"{kind}{chunk_id}@s{self.rank}",
                                  "start": start, "end": time.perf_counter()})
            return out

        setattr(self.stage, name, timed)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One step on the global batch; the mean loss on the last stage (None elsewhere)."""
        self.timeline = []
        self.optimizer.zero_grad(set_to_none=True)
        losses: list = []
        if self.rank == 0:
            self.schedule.step(x)  # a one-stage pipeline would also take target/losses here
        elif self.rank == self.stages - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else None


# --------------------------------------------------------------------------------------------------
# Our side: the `pipeline` strategy
# --------------------------------------------------------------------------------------------------


class OursPipeline:
    """This rank's part of minitrain's ``pipeline`` strategy (its executor records the timeline)."""

    def __init__(self, cfg: GPTConfig, schedule: str, microbatches: int, batch: int):
        from minitrain.comm import Comm
        from minitrain.strategies.pipeline import Pipeline
        from minitrain.strategies import TrainConfig

        tc = TrainConfig(strategy="pipeline", world_size=dist.get_world_size(), batch_size=batch,
                         lr=LR, model=cfg, seed=0,
                         options={"schedule": schedule, "microbatches": microbatches})
        Pipeline.check(tc)
        self.strategy = Pipeline(tc, Comm())
        self.timeline: list[dict] = []

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.strategy.train_step(x, y)  # the executor waits on its own barrier first
        self.timeline = [{**e, "action": str(e["action"])} for e in self.strategy.executor.timeline]
        return loss


# --------------------------------------------------------------------------------------------------
# The run on each rank, and the parent's summary
# --------------------------------------------------------------------------------------------------


def build(kind: str, cfg: GPTConfig, schedule: str, microbatches: int, batch: int):
    if kind == "torch":
        return TorchPipeline(cfg, schedule, microbatches)
    return OursPipeline(cfg, schedule, microbatches, batch)


def step_times(model: str, schedule: str, microbatches: int, batch: int, steps: int,
               kinds: list[str], warmup: int = 2) -> dict:
    """Train one replica per implementation on this rank, taking turns step by step.

    Returns ``{kind: {"times": [...], "losses": [...], "timelines": [...]}}``; the first ``warmup``
    steps (PyTorch infers the stage shapes in its first step) are left out of times and timelines
    but kept in the losses.
    """
    cfg = MODELS[model]
    runs = {k: build(k, cfg, schedule, microbatches, batch) for k in kinds}
    data = ArithmeticData(cfg.seq_len, 0)

    def step(kind, x, y):
        return runs[kind].train_step(x, y), runs[kind].timeline

    out = alternate(kinds, step, data, batch, steps, warmup)
    return {k: {"times": v["times"], "losses": [loss for loss, _ in v["results"]],
                "timelines": [tl for _, tl in v["results"][warmup:]]} for k, v in out.items()}

def replay(timeline: list[dict], durations=None) -> list[dict]:
    """The same ranks running the same actions in the same order with messages that take no time:
    each action starts once its rank is free and what it needs (:func:`dependencies`) has ended.
    ``durations(entry) -> seconds`` (default: the entry's own measured span).  The bubble of the
    replay is what the durations alone give; measured minus replay is what communication (waiting
    for a message longer than for the action that sends it) added."""
    rows: dict[int, list] = {}
    for e in sorted(timeline, key=lambda e: e["start"]):
        rows.setdefault(e["rank"], []).append(e)
    acts = {as_action(e["action"]) for e in timeline}
    n_stages = 1 + max(a.stage for a in acts)
    length = durations or (lambda e: e["end"] - e["start"])
    pos, free, end, out = dict.fromkeys(rows, 0), dict.fromkeys(rows, 0.0), {}, []
    progress = True
    while progress:
        progress = False
        for r, row in rows.items():
            while pos[r] < len(row):
                e = row[pos[r]]
                a = as_action(e["action"])
                backward = "I" if Action("I", a.microbatch, a.stage + 1) in acts else "B"
                deps = [d for d in dependencies(a, n_stages, backward) if d in acts]
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                end[a] = free[r] = start + length(e)
                out.append({"rank": r, "action": a, "start": start, "end": end[a]})
                pos[r] += 1
                progress = True
    return out


def bubble_parts(timeline: list[dict], stages: int) -> dict:
    """The measured bubble taken apart: ``even`` = the replay with every action of one kind on one
    rank at that rank's median for the kind (the stages' imbalance, beside the formula's equal
    stages), ``replay`` = the replay with each action's own duration (+ jitter), ``measured``
    (+ communication on the critical path); ``unsent`` = the replay with each action's own duration
    less the time its sends took to post (ours records it: ``isend`` copies into the socket in the
    calling thread, so that part of communication is inside the sender's action)."""
    med: dict[tuple, float] = {}
    for (r, k) in {(e["rank"], str(e["action"])[0]) for e in timeline}:
        med[r, k] = statistics.median(e["end"] - e["start"] for e in timeline
                                      if e["rank"] == r and str(e["action"])[0] == k)
    even = replay(timeline, lambda e: med[e["rank"], str(e["action"])[0]])
    unsent = replay(timeline, lambda e: e["end"] - e["start"] - e.get("send", 0.0))
    return {"even": bubble_fraction(even, stages),
            "unsent": bubble_fraction(unsent, stages),
            "replay": bubble_fraction(replay(timeline), stages),
            "measured": bubble_fraction(timeline, stages)}


def single_losses(model: str, batch: int, steps: int) -> list[float]:
    """The reference: one process, the whole model, Adam, the same batches."""
    cfg = MODELS[model]
    gpt, data = GPT(cfg, seed=0), ArithmeticData(cfg.seq_len, 0)
    opt, out = torch.optim.Adam(gpt.parameters(), lr=LR), []
    for step in range(steps):
        x, y = data.batch(step, batch)
        opt.zero_grad()
        loss = gpt(x, y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="8x256", choices=sorted(MODELS))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2],
                        help="world sizes = pipeline stages (default 2; more ranks than cores "
                             "oversubscribe the CPU)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["minitrain", "torch"],
                        choices=["minitrain", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = MODELS[args.model]
    print(f"model {args.model} ({cfg.num_params():,} parameters, {cfg.n_layer} blocks), "
          f"global batch {args.batch_size}, {args.rounds} rounds x {args.steps} steps "
          f"(+2 warm-up), "
          f"implementations alternating; {os.cpu_count()} cores, 1 thread per rank")
    if max(args.ranks) > (os.cpu_count() or 1):
        print(f"note: {max(args.ranks)} ranks on {os.cpu_count()} cores oversubscribe the CPU: "
              "idle ranks give their core away, so times and bubbles there are not meaningful")
    kinds = args.kinds
    warmup = 2
    ref = single_losses(args.model, args.batch_size, args.steps + warmup)
    header = (f"{'P':>2s} {'M':>2s} {'schedule':8s} " + " ".join(f"{k + ' ms':>12s}" for k in kinds)
              + (f" {'ratio':>6s}" if len(kinds) == 2 else "")
              + " " + " ".join(f"{'span ' + k[:5]:>10s}" for k in kinds)
              + " " + " ".join(f"{'bubble ' + k[:5]:>13s}" for k in kinds) + f" {'formula':>8s}"
              + " " + " ".join(f"{'err ' + k[:5]:>9s}" for k in kinds))
    rows, apart = [], []
    for n in args.ranks:
        if n > cfg.n_layer:
            print(f"skipping {n} ranks: more stages than the {cfg.n_layer} blocks of {args.model}")
            continue
        with Cluster(n, backend="gloo", threads=1, timeout=300) as cluster:
            for m in args.microbatches:
                if args.batch_size % m:
                    print(f"skipping M={m}: batch {args.batch_size} does not split into {m}")
                    continue
                for sched in args.schedules:
                    per = {k: [] for k in kinds}
                    bub = {k: [] for k in kinds}
                    span = {k: [] for k in kinds}
                    parts = {k: [] for k in kinds}
                    err = {k: 0.0 for k in kinds}
                    for _ in range(args.rounds):
                        res = cluster.run(step_times, args.model, sched, m, args.batch_size,
                                          args.steps, kinds, warmup)
                        for k in kinds:
                            per[k] += [max(ts) for ts in zip(*(r[k]["times"] for r in res))]
                            for tls in zip(*(r[k]["timelines"] for r in res)):
                                tl = [e for t in tls for e in t]
                                bub[k].append(bubble_fraction(tl, n))
                                parts[k].append(bubble_parts(tl, n))
                                span[k].append(max(e["end"] for e in tl)
                                               - min(e["start"] for e in tl))
                            losses = res[-1][k]["losses"]
                            err[k] = max([err[k]] + [abs(a - b) / abs(b)
                                                     for a, b in zip(losses, ref)])
                    med = {k: statistics.median(v) for k, v in per.items()}
                    row = (f"{n:2d} {m:2d} {sched:8s} "
                           + " ".join(f"{med[k] * 1e3:12.1f}" for k in kinds))
                    if len(kinds) == 2:
                        row += f" {med[kinds[0]] / med[kinds[1]]:6.3f}"
                    row += (" " + " ".join(f"{statistics.median(span[k]) * 1e3:10.1f}"
                                           for k in kinds)
                            + " " + " ".join(f"{statistics.median(bub[k]):13.3f}" for k in kinds)
                            + f" {bubble_formula(n, m):8.3f} "
                            + " ".join(f"{err[k]:9.1e}" for k in kinds))
                    rows.append(row)
                    if len(rows) == 1:
                        print(header)
                    print(row, flush=True)
                    formula = bubble_formula(n, m)
                    for k in kinds:
                        p = {q: statistics.median(d[q] for d in parts[k]) for q in parts[k][0]}
                        over = p["measured"] / formula - 1
                        apart.append(f"{n:2d} {m:2d} {sched:8s} {k:9s} {formula:8.3f} "
                                     f"{p['even']:8.3f} {p['unsent']:8.3f} {p['replay']:8.3f} "
                                     f"{p['measured']:8.3f} "
                                     f"{over:+8.1%} {'yes' if abs(over) <= 0.10 else 'no':>6s} "
                                     f"{p['measured'] - p['replay']:+8.3f}")
    print("\nthe bubble taken apart (medians over steps): formula = (P-1)/(M+P-1), equal stages; "
          "the same actions replayed with instant messages: even = each action at its rank's median "
          "for its kind (the stages' imbalance), unsent = each at its own duration less the time "
          "its isend calls took inside it (ours records it; torch: = replay), replay = each at its "
          "own duration (+ jitter); measured (+ waiting for messages: comm = measured - replay); "
          "over = measured vs formula, goal within 10 %")
    print(f"{'P':>2s} {'M':>2s} {'schedule':8s} {'impl':9s} {'formula':>8s} {'even':>8s} "
          f"{'unsent':>8s} {'replay':>8s} {'measured':>8s} {'over':>8s} {'<=10%':>6s} {'comm':>8s}")
    for line in apart:
        print(line)
    print("\nratio = minitrain / PyTorch step time (target <= 1.05); span = first action start to "
          "last action end (ms; the step adds the optimizer, barriers, splitting); bubble = "
          "1 - busy/(P*span) from the recorded actions, formula (P-1)/(M+P-1); err = max "
          "relative difference of the per-step losses from one process (fp32, target <= 1e-5)")


if __name__ == "__main__":
    main()
