"""The one training loop, and ``train()``, its Python entry point (lessons 00–08).

:func:`fit` steps a :class:`~minitrain.strategies.Lockstep` strategy through ``cfg.steps`` batches
(saving checkpoints as asked); a :class:`~minitrain.strategies.FreeRunning` one runs its own loop.
``run_rank(cfg)`` is what each rank executes — from :class:`minitrain.runtime.launch.Cluster`, from
``launch``, or directly under ``torchrun`` — so the same code path serves notebooks, scripts and real
clusters.  Rank 0 reports each step through ``on_step``; what follows the steps from outside the
loop (:class:`Recording`, for the projection) is a callback of :func:`fit`.  At the end every rank's
tracer summary and memory ledger are gathered to rank 0 (outside the tracer, so they do not count as
training traffic) into the run's record (:class:`~minitrain.record.RunResult`).
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import torch.distributed as dist

from .checkpoint.core import load_checkpoint, maybe_save
from .checkpoint.checks import SaveDirLock, check_checkpoint_config, clear_save_dir
from .comm import Comm, Tracer
from .data import ArithmeticData
from .runtime.launch import Cluster
from .memory import rss_bytes
from .planning.recording import Recording
from .record import RunResult, RunSummary
from .strategies import (ConfigError, FreeRunning, Seams, Strategy, TrainConfig, check_strategy,
                         get_strategy)
from .strategies.options import did_you_mean
from .device import now
from .runtime.profiling import StepProfile, profiled_step

__all__ = ["run_rank", "train", "check_config", "fit", "Diverged", "add_projection",
           "check_projection_config"]


class Diverged(RuntimeError):
    """The loss became NaN or infinite: the run stops (``allow_nonfinite=True`` goes on)."""


def _diverged(cfg: TrainConfig, step: int, loss: float) -> Diverged:
    fix = f"lower --lr (now {cfg.lr:g})"
    if cfg.precision == "fp16-mixed":
        fix += ", or keep loss scaling on (leave out --loss-scale 0) or use --precision bf16-mixed"
    return Diverged(f"step {step}: the loss is {loss} — training diverged; {fix}. "
                    "(--allow-nonfinite keeps training)")


def check_config(cfg: TrainConfig, seams=None, *, lock: SaveDirLock | bool | None = None) -> None:
    """Refuse a configuration that cannot run (unknown strategy, bad sizes or options, a seam the
    strategy does not have, a checkpoint that does not match, a save dir another run uses) before
    spawning.  ``lock`` (a :class:`~minitrain.checkpoint.checks.SaveDirLock`) takes the save dir
    for the run: see :func:`~minitrain.checkpoint.checks.check_checkpoint_config`."""
    check_strategy(cfg, seams)
    check_checkpoint_config(cfg, lock)
    _check_profile(cfg)
    cores = os.cpu_count() or 1
    if cfg.world_size > 4 * cores and cfg.backend != "nccl":
        print(f"minitrain: {cfg.world_size} ranks on {cores} CPU cores ({cfg.world_size / cores:.0f} "
              f"per core): expect each step to take roughly {cfg.world_size / cores:.0f} times as long "
              "as with one rank per core", file=sys.stderr, flush=True)


def _check_profile(cfg: TrainConfig) -> None:
    """``--profile DIR``: a strategy whose ranks step together, and a folder (made if missing)."""
    if not cfg.profile:
        return
    if issubclass(get_strategy(cfg.strategy), FreeRunning):
        raise ConfigError(f"--profile profiles one step of ranks that step together; {cfg.strategy}'s "
                          "ranks run free (no common step); profile ddp or zero1-3 instead")
    if os.path.exists(cfg.profile) and not os.path.isdir(cfg.profile):
        raise ConfigError(f"--profile {cfg.profile}: a file, not a folder; name a folder for the "
                          "ranks' traces (made if missing)")
    try:
        os.makedirs(cfg.profile, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--profile {cfg.profile}: cannot make the folder ({exc.strerror}); name "
                          "a folder you can write") from None


def fit(strategy: Strategy, data, on_step=None, callbacks=()) -> tuple[list[float], list[float]]:
    """Train ``cfg.steps`` steps (from ``strategy.start_step``); return (losses, seconds per step).

    ``on_step(step, loss)`` follows each step; each of ``callbacks`` (e.g. :class:`Recording`) has
    ``begin(step)`` called before a step and ``end(step, loss)`` after it, outside its timing;
    checkpoints are saved as ``cfg.save_dir`` and ``cfg.save_every`` ask.  A free-running strategy
    (its ranks do not step together) runs its own loop instead."""
    if isinstance(strategy, FreeRunning):
        return strategy.run(data, on_step)
    cfg = strategy.cfg
    losses, times = [], []
    for step in range(strategy.start_step, cfg.steps):
        x, y = data.batch(step, cfg.batch_size)
        for c in callbacks:
            c.begin(step)
        t0 = now()
        loss = strategy.train_step(x, y)
        times.append(now() - t0)
        for c in callbacks:
            c.end(step, loss)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
        if not math.isfinite(loss) and not cfg.allow_nonfinite:
            raise _diverged(cfg, step, loss)  # the loss is the global mean: every rank stops here
        if cfg.save_dir:
            maybe_save(strategy, step)
    return losses, times


def _build(cfg: TrainConfig, comm: Comm, seams) -> Strategy:
    return get_strategy(cfg.strategy)(cfg, comm, Seams.of(seams))


def _loss_scaler(strategy: Strategy) -> dict | None:
    """The dynamic loss scaler's state (fp16-mixed), or None."""
    return strategy.loss_scaler.state_dict() if strategy.loss_scaler is not None else None


def _calibrate(comm: Comm) -> dict:
    """This machine measured after the run (every rank takes part; not training traffic)."""
    from .planning.clusters import calibrate_rank
    with comm.tracer.paused():
        return calibrate_rank()


def run_rank(cfg: TrainConfig, on_step=None, return_state: bool = False, seams=None,
             record_events: bool = False, calibrate: bool = False) -> RunResult | None:
    """Train on this rank (the process group must exist); rank 0 returns the run's record.

    ``on_step(step, loss)`` is called on rank 0 after every step.  Returns, on rank 0, a
    :class:`~minitrain.record.RunResult` (with ``return_state`` its ``state``: the trained weights
    as a plain state_dict); on the other ranks None.  ``seams`` (a
    :class:`~minitrain.strategies.Seams` or ``{name: function}``) puts a learner's functions in
    the strategy's seams.  ``record_events`` keeps what :mod:`minitrain.planning.projection`
    replays (``events``: each rank's log, :class:`Recording`); ``calibrate`` also measures this
    machine afterwards (``summary.calibration``, for the "local" and "binder" clusters).
    """
    comm = Comm(None, Tracer(), "world")
    if cfg.save_dir and comm.rank == 0:
        clear_save_dir(cfg)  # --overwrite: the earlier run's steps go before this run saves any
    strategy = _build(cfg, comm, seams)
    if cfg.resume:
        load_checkpoint(strategy, cfg.resume)  # before the tracer is cleared: not training traffic
    data = ArithmeticData(cfg.model.seq_len, cfg.seed)
    comm.tracer.clear()
    callbacks = []
    if cfg.profile:
        callbacks.append(StepProfile(cfg.profile, comm.rank,
                                     profiled_step(cfg.steps, strategy.start_step),
                                     cuda=strategy.device.type == "cuda"))
    with Recording(strategy, on=record_events) as recorder:
        losses, times = fit(strategy, data, on_step if comm.rank == 0 else None,
                            [recorder, *callbacks])
    with comm.tracer.paused():  # gathering the result is not training traffic
        final = strategy.final_state()
    mine = {"comm": comm.tracer.summary(),
            "memory": {**strategy.memory(), "rss_peak": rss_bytes(peak=True)},
            "report": strategy.report(), "loss_scaler": _loss_scaler(strategy),
            "events": recorder.export()}
    gathered = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    strategy.close()
    calibration = _calibrate(comm) if calibrate else None
    if comm.rank != 0:
        return None
    summary = RunSummary(
        strategy=cfg.strategy, world_size=comm.size, backend=dist.get_backend(), steps=cfg.steps,
        batch_size=cfg.batch_size, seed=cfg.seed, params=cfg.model.num_params(), model=cfg.model,
        precision=cfg.precision, options=cfg.options.given(),
        checkpoint_activations=cfg.checkpoint_activations,
        loss_scaler=gathered[0]["loss_scaler"], final_loss=losses[-1],
        step_time_s=statistics.median(times), step_times_s=list(times),
        start_step=strategy.start_step, resumed_from=strategy.resumed_from,
        resharded_from=strategy.resharded_from, checkpoints=strategy.saved_checkpoints,
        comm=[g["comm"] for g in gathered], memory=[g["memory"] for g in gathered],
        layout=type(strategy).layout(cfg),
        report=[g["report"] for g in gathered] if any(g["report"] for g in gathered) else None,
        calibration=calibration)
    return RunResult(
        losses, summary,
        events=[g["events"] for g in gathered] if record_events else None,
        step_times=times if record_events else None,
        state={k: v.detach().cpu().clone() for k, v in final.items()} if return_state else None)


def train(cfg: TrainConfig | None = None, *, cluster: Cluster | None = None, on_step=None,
          return_state: bool = False, seams=None, project: str | None = None, as_model=None,
          stack: str | None = None, record_events: bool = False, **overrides) -> RunResult:
    """Train from Python (a notebook, a test) and return rank 0's record
    (:class:`~minitrain.record.RunResult`: ``losses``, ``summary``...).

    ``train(strategy="single", steps=50)`` builds a :class:`TrainConfig` from keywords.  Pass a
    running ``cluster`` of the right size to reuse its ranks (fast: no start-up); otherwise one is
    started for the call and stopped after it.  ``on_step`` runs on rank 0 (its prints are forwarded).
    ``seams={"ring_all_reduce": my_ring, ...}`` runs the strategy with your functions in its seams
    (:class:`~minitrain.strategies.Seams`).

    ``project="dgx-h100"`` (``as_model="7b"``) re-times the run on that cluster at that model size
    and adds ``summary.projection`` (:func:`minitrain.planning.projection.project`), its kernels
    priced under ``stack`` (default: the device's, "flash" on GPUs); ``record_events`` keeps the events (``result.events``) to project later, on any cluster.
    """
    cfg = (cfg or TrainConfig()).with_(**overrides) if overrides else (cfg or TrainConfig())
    with SaveDirLock() as lock:  # one run per save dir: held until the run ends
        check_config(cfg, seams, lock=lock)
        check_projection_config(cfg, project, as_model, stack)
        record = record_events or project is not None
        calibrate = project is not None and str(project).lower() in ("local", "binder")
        args = (cfg, on_step, return_state, seams, record, calibrate)
        if cluster is not None:
            if cluster.world_size != cfg.world_size:
                raise ValueError(f"the cluster has {cluster.world_size} ranks but the config asks "
                                 f"for world_size={cfg.world_size}; use a matching Cluster or "
                                 "world_size")
            result = cluster.run(run_rank, *args)[0]
        else:
            backend = cfg.backend or ("gloo" if get_strategy(cfg.strategy).nccl_refusal else None)
            with Cluster(cfg.world_size, backend, timeout=cfg.timeout) as c:
                result = c.run(run_rank, *args)[0]
    return add_projection(result, project, as_model, stack)


def check_projection_config(cfg: TrainConfig, project: str | None, as_model=None,
                            stack: str | None = None) -> None:
    """Refuse, before any process starts, a projection that cannot be made (an unknown cluster or
    model size, a free-running strategy, a layout the bigger model cannot take)."""
    from .planning.projection import MODEL_SIZES, check_projection
    if project is not None and isinstance(as_model, str) and as_model.lower() not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {as_model!r}{did_you_mean(as_model, MODEL_SIZES)}; "
                          f"choose one of: {', '.join(MODEL_SIZES)}")
    if stack is not None and project is None:
        raise ConfigError("--stack needs --project CLUSTER (the stack prices the projected "
                          "kernels); e.g. --project dgx-h100 --stack eager")
    if project is not None and str(project).lower() in ("local", "binder") and (
            cfg.backend == "nccl"):
        raise ConfigError(f"--project {project} re-times the run on this machine's CPU from a "
                          "calibration of its CPU kernels and loopback; a run on GPUs (--backend "
                          "nccl) is not that machine: project it on a named cluster "
                          "(minitrain clusters) or run it with --backend gloo")
    try:
        if stack is not None:
            from .planning.kernels import stack_named
            stack_named(stack)
        check_projection(project, as_model, get_strategy(cfg.strategy).layout(cfg),
                         strategy=cfg.strategy, world_size=cfg.world_size, model=cfg.model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def add_projection(result: RunResult | None, project: str | None, as_model=None,
                   stack: str | None = None) -> RunResult:
    """``result`` with ``summary.projection``: the run re-timed on ``project`` at ``as_model``
    (:func:`minitrain.planning.projection.project`).  A GPipe or 1F1B pipeline of equal
    micro-batches is projected with ``even=True`` (each gets the same share of its rank's FLOPs,
    as in lesson 05: :func:`minitrain.planning.projection.even_work`); its ``even`` says which."""
    if project is None or result is None:
        return result
    from .planning.projection import even_work
    from .planning.projection import project as reproject
    result.summary.projection = reproject(result, project, as_model, stack=stack,
                                          even=even_work(result.summary))
    return result
