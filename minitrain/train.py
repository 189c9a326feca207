"""The training loop every strategy shares, and ``train()``, its Python entry point (lessons 00–08).

``run_rank(cfg)`` is what each rank executes — from :class:`minitrain.launch.Cluster`, from
``launch``, or directly under ``torchrun`` — so the same code path serves notebooks, scripts and real
clusters.  Rank 0 reports each step through ``on_step``; at the end every rank's tracer summary and
memory ledger are gathered to rank 0 (outside the tracer, so they do not count as training traffic).
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

from .checkpoint import check_checkpoint_config, load_checkpoint
from .comm import Comm, Tracer
from .data import ArithmeticData
from .launch import Cluster
from .strategies import TrainConfig, get_strategy

__all__ = ["run_rank", "train", "check_config"]


def check_config(cfg: TrainConfig) -> None:
    """Refuse a configuration that cannot run (unknown strategy, bad sizes, a checkpoint that does
    not match) before spawning."""
    get_strategy(cfg.strategy).check(cfg)
    check_checkpoint_config(cfg)


def run_rank(cfg: TrainConfig, on_step=None, return_state: bool = False) -> dict:
    """Train on this rank (the process group must exist); rank 0 returns the run's summary.

    ``on_step(step, loss)`` is called on rank 0 after every step.  Returns, on rank 0,
    ``{"losses": [...], "summary": {...}}`` (plus ``"state"``, the trained weights as a plain
    state_dict, with ``return_state``); on the other ranks ``{"rank": r}``.
    """
    comm = Comm(None, Tracer(), "world")
    strategy = get_strategy(cfg.strategy)(cfg, comm)
    if cfg.resume:
        load_checkpoint(strategy, cfg.resume)  # before the tracer is cleared: not training traffic
    data = ArithmeticData(cfg.model.seq_len, cfg.seed)
    comm.tracer.clear()
    losses, times = strategy.fit(data, on_step if comm.rank == 0 else None)
    mine = {"comm": comm.tracer.summary(), "memory": strategy.memory(), "report": strategy.report(),
            "precision": strategy.precision_report()}
    gathered = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if comm.rank != 0:
        return {"rank": comm.rank}
    summary = {
        "strategy": cfg.strategy,
        "world_size": comm.size,
        "backend": dist.get_backend(),
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "params": cfg.model.num_params(),
        "precision": cfg.precision,
        "checkpoint_activations": cfg.checkpoint_activations,
        # rank 0's dynamic loss scaler (every rank of a lockstep strategy holds the same one)
        "loss_scaler": gathered[0]["precision"]["loss_scaler"],
        "final_loss": losses[-1],
        "step_time_s": statistics.median(times),
        "start_step": strategy.start_step,  # > 0 when resumed: losses are of steps start_step..
        "resumed_from": getattr(strategy, "resumed_from", None),
        "checkpoints": strategy.saved_checkpoints,
        "comm": [g["comm"] for g in gathered],
        "memory": [g["memory"] for g in gathered],
    }
    if any(g["report"] for g in gathered):
        summary["report"] = [g["report"] for g in gathered]
    out = {"losses": losses, "summary": summary}
    if return_state:
        out["state"] = {k: v.detach().cpu().clone() for k, v in strategy.state_dict().items()}
    return out


def train(cfg: TrainConfig | None = None, *, cluster: Cluster | None = None, on_step=None,
          return_state: bool = False, **overrides) -> dict:
    """Train from Python (a notebook, a test) and return rank 0's ``{"losses", "summary"}``.

    ``train(strategy="single", steps=50)`` builds a :class:`TrainConfig` from keywords.  Pass a
    running ``cluster`` of the right size to reuse its ranks (fast: no start-up); otherwise one is
    started for the call and stopped after it.  ``on_step`` runs on rank 0 (its prints are forwarded).
    """
    cfg = (cfg or TrainConfig()).with_(**overrides) if overrides else (cfg or TrainConfig())
    check_config(cfg)
    if cluster is not None:
        if cluster.world_size != cfg.world_size:
            raise ValueError(f"the cluster has {cluster.world_size} ranks but the config asks for "
                             f"world_size={cfg.world_size}; use a matching Cluster or world_size")
        return cluster.run(run_rank, cfg, on_step, return_state)[0]
    with Cluster(cfg.world_size, cfg.backend, timeout=cfg.timeout) as c:
        return c.run(run_rank, cfg, on_step, return_state)[0]
