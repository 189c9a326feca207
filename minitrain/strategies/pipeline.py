"""``pipeline``: one stage (or V chunks) per rank, the batch in micro-batches run by a schedule table
(lesson 05) — its options, checks, report and checkpoint state.  The technique is
:mod:`minitrain.parallel.schedules` and :mod:`minitrain.parallel.pipeline`."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from ..planning.analysis import bubble_formula, bubble_fraction, peak_in_flight
from ..comm import Comm
from ..data import ArithmeticData
from ..memory import ledger
from ..model import GPT, PRESETS
from ..parallel.pipeline import PipelineExecutor, PipelineStage, split_weight_gradients
from ..parallel.schedules import (SCHEDULES, ScheduleError, check_schedule, make_schedule, simulate,
                                  split_layers, validate)
from ..record import Layout
from .base import Checkpointer, Lockstep, TrainConfig, register
from .checks import check_strategy
from .options import ConfigError, Options, at_least, in_cli_words, option

__all__ = ["ScheduleOptions", "PipelineOptions", "Pipeline", "Stages", "schedule_shape",
           "check_pipeline", "merge_stages", "run_schedule"]


@dataclass(frozen=True)
class ScheduleOptions(Options):
    """How a pipeline runs its micro-batches (strategies pipeline and 3d)."""

    schedule: str = option("1f1b", f"pipeline schedule: {', '.join(SCHEDULES)}",
                           choices=tuple(SCHEDULES), metavar="SCHEDULE")
    microbatches: int | None = option(None, "micro-batches per (replica's) batch (default: the "
                                      "pipeline stages; naive: 1)", check=at_least(1))
    chunks: int | None = option(None, "model chunks per rank, for interleaved (default: 2 for "
                                "interleaved, else 1)", check=at_least(1))


@dataclass(frozen=True)
class PipelineOptions(ScheduleOptions):
    stages: int | None = option(None, "pipeline stages, one per rank (default: the world size, its "
                                "only choice)", check=at_least(1))


def schedule_shape(options: ScheduleOptions, stages: int) -> tuple[str, int, int, int]:
    """(schedule, stages P, micro-batches M, chunks V) with the defaults: M = P (1 for naive),
    V = 1 (2 for interleaved)."""
    schedule = options.schedule
    microbatches = options.microbatches or (1 if schedule == "naive" else stages)
    chunks = options.chunks or (2 if schedule == "interleaved" else 1)
    return schedule, stages, microbatches, chunks


def check_pipeline(cfg: TrainConfig, P: int, M: int, V: int, batch: int,
                   forms: dict | None = None) -> None:
    """Refuse, naming the fix, a pipeline of P stages x V chunks running M micro-batches of a batch
    of ``batch`` samples: the schedule's own check (:func:`check_schedule`) in the CLI's words, and
    what the model and the trainer options add."""
    schedule = cfg.options.schedule
    try:
        check_schedule(schedule, P, M, V, n_layer=cfg.model.n_layer, batch=batch)
    except ScheduleError as exc:
        raise in_cli_words(exc, forms) from None
    if cfg.model.tie_weights and P > 1:
        raise ConfigError("pipeline cannot tie the embedding (first stage) to the head (last "
                          "stage); use a model with tie_weights=False")
    if schedule == "zb-h1" and cfg.checkpoint_activations:
        raise ConfigError("--schedule zb-h1 cannot checkpoint activations (the W pass needs "
                          "the stashed inputs); leave out --checkpoint-activations")


def merge_stages(states: list[dict], model) -> dict:
    """The single-process state_dict of GPT(``model``) from the ranks' stage states, in its order."""
    merged = {k: v for s in states for k, v in s.items()}
    return {k: merged[k] for k in GPT(model).state_dict()}


class Stages(Checkpointer):
    """Each rank saves its stages (under the single-process names) and their optimizer state."""

    def layout(self, cfg: TrainConfig) -> dict:
        _, stages, _, chunks = schedule_shape(cfg.options, cfg.world_size)
        return {"stages": stages, "chunks": chunks}

    def save(self, strategy) -> dict:
        return {"model": strategy.stage_state(), "optimizer": strategy.optimizer.state_dict()}

    def load(self, strategy, read) -> None:
        state = read(strategy.comm.rank)
        indexed = {k.split(".", 1)[1]: k for k in strategy.model.state_dict()}
        strategy.model.load_state_dict({indexed[k]: v for k, v in state["model"].items()})
        strategy.optimizer.load_state_dict(state["optimizer"])

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        return merge_stages([read(r)["model"] for r in range(cfg.world_size)], cfg.model)


@register
class Pipeline(Lockstep):
    """One stage (or V chunks) per rank; the batch in micro-batches run by a schedule table."""

    name = "pipeline"
    help = ("pipeline parallel: layers split into --stages, --microbatches run by --schedule "
            "naive|gpipe|1f1b|interleaved|zb-h1 (--chunks for interleaved)")
    options = PipelineOptions
    seams = ("one_f_one_b", "stage_step")
    checkpointer = Stages()

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        P = cfg.options.stages or cfg.world_size
        if P != cfg.world_size:
            raise ConfigError(f"--stages {P} must equal --world-size {cfg.world_size} (one rank per "
                              f"stage); use --world-size {P} or leave --stages out")
        _, P, M, V = schedule_shape(cfg.options, P)
        check_pipeline(cfg, P, M, V, cfg.batch_size)

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        schedule, P, M, V = schedule_shape(cfg.options, cfg.world_size)
        return Layout(pp=P, schedule=schedule, microbatches=M, virtual_stages=V,
                      groups={"pp": (tuple(range(P)),)})

    def __init__(self, cfg: TrainConfig, comm: Comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.schedule, self.P, self.M, self.V = schedule_shape(cfg.options, cfg.world_size)
        self.table = make_schedule(self.schedule, self.P, self.M, self.V,
                                   one_f_one_b=self.seams.one_f_one_b)
        validate(self.table, self.P, self.M, self.V)
        model, n_stages = self.build_model(), self.P * self.V
        self.stages = {s: PipelineStage(model, s, n_stages)
                       for s in range(comm.rank, n_stages, self.P)}
        if self.schedule == "zb-h1":
            for stage in self.stages.values():
                split_weight_gradients(stage)
        self.model = nn.ModuleList(self.stages.values())  # this rank's parameters only
        self.optimizer = self.make_optimizer(self.model.parameters())
        self.executor = PipelineExecutor(self.stages, self.table, comm, self.M, cfg.model.d_model,
                                         stage_step=self.seams.stage_step)
        self.timelines: list[list[dict]] = []  # this rank's measured timeline, per step

    def train_step(self, x, y) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.executor.step(x.to(self.device), y.to(self.device))
        self.optimizer.step()  # after the flush: every micro-batch's gradient is in
        self.timelines.append(self.executor.timeline)
        return loss

    def final_state(self) -> dict | None:
        """Every rank gets all ranks' timelines (for the report); rank 0 the full state_dict."""
        everyone = [None] * self.comm.size
        dist.all_gather_object(everyone, self.timelines, group=self.comm.group)
        self.step_timelines = [sorted((e for rank in everyone for e in rank[i]),
                                      key=lambda e: (e["rank"], e["start"]))
                               for i in range(len(self.timelines))]
        states = [None] * self.comm.size if self.comm.rank == 0 else None
        mine = {k: v.detach().cpu() for k, v in self.stage_state().items()}
        dist.gather_object(mine, states, dst=self.comm.global_rank(0), group=self.comm.group)
        return merge_stages(states, self.cfg.model) if states is not None else None

    def stage_state(self) -> dict:
        """This rank's stages' state_dict under the single-process names (no ModuleList index)."""
        return {k.split(".", 1)[1]: v for k, v in self.model.state_dict().items()}

    def memory(self) -> dict:
        return ledger(self.model, self.optimizer, self.executor.peak_bytes)

    def report(self) -> dict:
        """The schedule, its ideal table and the measured run: ``bubble_measured`` is the median of
        the steps' bubbles (the first step left out when there are more); ``timeline`` is the last
        step's measured timeline (all ranks, actions as strings); ``peak_in_flight`` is measured
        from it, ``peak_in_flight_ideal`` read from the table."""
        steps = getattr(self, "step_timelines", None) or [self.executor.timeline]
        bubbles = [bubble_fraction(t, self.P) for t in steps]
        ideal = simulate(self.table)
        return {
            "rank": self.comm.rank, "schedule": self.schedule, "stages": self.P,
            "microbatches": self.M, "chunks": self.V,
            "layers": {s: list(split_layers(self.cfg.model.n_layer, self.P * self.V)[s])
                       for s in self.stages},
            "bubble_measured": statistics.median(bubbles[1:] or bubbles),
            "bubble_per_step": bubbles,
            "bubble_formula": bubble_formula(self.P, self.M, self.V),
            "bubble_ideal": bubble_fraction(ideal, self.P),
            "peak_in_flight": peak_in_flight(steps[-1]),
            "peak_in_flight_ideal": peak_in_flight(self.table),
            "activation_bytes_peak": self.executor.peak_bytes,
            "timeline": [{**e, "action": str(e["action"])} for e in steps[-1]],
            "table": [[str(a) if a is not None else None for a in row] for row in self.table],
        }


def run_schedule(schedule: str = "1f1b", microbatches: int | None = None,
                 chunks: int | None = None, *, model=None, batch_size: int = 8, steps: int = 1,
                 seed: int = 0, lr: float = 1e-3) -> dict:
    """Run ``steps`` pipeline steps on every rank of a live cluster, one stage per rank — for a
    notebook: ``cluster.run(run_schedule, "gpipe", 4)[0]``.

    Returns (on every rank) :meth:`Pipeline.report` plus ``"losses"``: ``timeline`` is the last
    step's measured timeline of all ranks, ``table`` the ideal table, beside their bubbles.
    """
    cfg = TrainConfig(strategy="pipeline", world_size=dist.get_world_size(), steps=steps,
                      seed=seed, batch_size=batch_size, lr=lr, model=model or PRESETS["tiny"],
                      options={"schedule": schedule, "microbatches": microbatches,
                               "chunks": chunks})
    check_strategy(cfg)
    strategy, data = Pipeline(cfg, Comm()), ArithmeticData(cfg.model.seq_len, seed)
    losses = [strategy.train_step(*data.batch(step, batch_size)) for step in range(steps)]
    strategy.final_state()  # gathers every rank's timelines
    return {**strategy.report(), "losses": losses}
