"""What a run returns: its losses and a typed summary, with the layout its strategy declared.

``train()`` (and each rank's ``run_rank``) returns a :class:`RunResult`: the losses, a
:class:`RunSummary` of the run (its configuration, timings, checkpoints and the per-rank tables it
measured: communication, memory, the strategy's report), and — when asked — the recorded events
the projection replays and the trained weights.  The summary carries the :class:`Layout` the
strategy declared (``Strategy.layout(cfg)``): the sizes of its axes, its ZeRO stage, its pipeline
schedule.  What reads a run (the projection, the lessons) reads those fields, never the
strategy's name.  ``to_dict()`` gives the JSON the CLI prints (``minitrain train --json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import GPTConfig

__all__ = ["Layout", "RunSummary", "RunResult"]


@dataclass(frozen=True)
class Layout:
    """How a strategy lays the model and the batch over its ranks.

    ``dp`` replicas (each on its slice of the batch), ``pp`` pipeline stages, ``tp`` tensor-parallel
    ranks, ``cp`` context-parallel ranks, ``ep`` ranks the experts are spread over; ``zero_stage``
    what the replicas shard (0: nothing, 1 Adam's states, 2 also gradients, 3 also parameters),
    ``offload`` whether Adam's states live in host memory; a pipeline's ``schedule``, its
    ``microbatches`` and ``virtual_stages`` (model chunks per rank).  ``groups``: every process
    group by axis, ``{"dp": ((0, 2), (1, 3)), ...}`` (a group along an axis: the ranks that differ
    only there).  ``free_running``: why the ranks share no step (a parameter server), else None."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    offload: bool = False
    schedule: str | None = None
    microbatches: int = 1
    virtual_stages: int = 1
    groups: dict = field(default_factory=dict)
    free_running: str | None = None

    def stages_of(self, rank: int) -> list[int]:
        """The pipeline stages ``rank`` holds, of ``pp × virtual_stages``: its place in its pp
        group, then every ``pp``-th after it (an interleaved rank's chunks)."""
        place = next((g.index(rank) for g in self.groups.get("pp", ()) if rank in g), 0)
        return list(range(place, self.pp * self.virtual_stages, self.pp))


@dataclass
class RunSummary:
    """A run on rank 0's view: its configuration, what it measured, what it saved.

    ``comm``, ``memory`` and ``report`` are per-rank tables as measured (the tracer's summary, the
    memory ledger, the strategy's own facts); ``projection`` the run re-timed on a cluster
    (``train(project=...)``: a :class:`minitrain.planning.projection.Projection`)."""

    strategy: str
    world_size: int
    backend: str
    steps: int
    batch_size: int
    seed: int
    params: int
    model: GPTConfig
    precision: str
    options: dict  # the strategy's options that differ from their defaults
    checkpoint_activations: bool
    loss_scaler: dict | None  # rank 0's dynamic loss scaler (fp16-mixed): every rank holds the same
    final_loss: float
    step_time_s: float  # the median step
    step_times_s: list[float]  # every step's: a timing shown with its spread
    start_step: int  # > 0 when resumed: the losses are of steps start_step..
    resumed_from: str | None
    resharded_from: str | None  # "zero3 on 4 ranks"
    checkpoints: list[str]
    comm: list[dict]
    memory: list[dict]
    layout: Layout = field(default_factory=Layout)
    report: list[dict] | None = None  # None when the strategy reports nothing
    calibration: dict | None = None  # this machine measured after the run (project="local")
    projection: object = None

    def to_dict(self) -> dict:
        """The summary as JSON takes it (``minitrain train --json``)."""
        out = {k: getattr(self, k) for k in _SUMMARY_KEYS}
        out["model"] = self.model.to_dict()
        for key in ("report", "calibration"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.projection is not None:
            out["projection"] = self.projection.to_dict()
        return out


_SUMMARY_KEYS = ("strategy", "world_size", "backend", "steps", "batch_size", "seed", "params",
                 "model", "precision", "options", "checkpoint_activations", "loss_scaler",
                 "final_loss", "step_time_s", "step_times_s", "start_step", "resumed_from",
                 "resharded_from", "checkpoints", "comm", "memory")


@dataclass
class RunResult:
    """What a run returns on rank 0: the loss of every step and the :class:`RunSummary`;
    ``events`` (each rank's recorded log, what the projection replays) and ``step_times`` (rank
    0's seconds per step) when recorded; ``state`` (the trained weights, a single-process
    state_dict) when asked for."""

    losses: list[float]
    summary: RunSummary
    events: list[dict] | None = None
    step_times: list[float] | None = None
    state: dict | None = None

    def to_dict(self) -> dict:
        out = {"losses": self.losses, "summary": self.summary.to_dict()}
        out.update({k: getattr(self, k) for k in ("events", "step_times", "state")
                    if getattr(self, k) is not None})
        return out
