"""What is refused before any process starts: the checks every strategy gets
(:func:`check_common`), then the strategy's own (``Strategy.check``), in :func:`check_strategy`."""

from __future__ import annotations

import math

import torch

from ..precision import PRECISIONS
from ..runtime.launch import MAX_TIMEOUT_S
from .base import Seams, Strategy, TrainConfig, get_strategy, strategy_names
from .fit import check_fits_machine
from .options import ConfigError, Options, did_you_mean

__all__ = ["check_strategy", "check_common", "MIN_RUN_TIMEOUT_S", "SEED_RANGE"]

#: the shortest --timeout a run may ask for: starting the ranks and one step's collectives take
#: longer than a second on a busy machine (the process group itself takes down to a millisecond,
#: :data:`~minitrain.runtime.launch.MIN_TIMEOUT_S`)
MIN_RUN_TIMEOUT_S = 1.0
#: torch's random generators take a 64-bit unsigned seed
SEED_RANGE = (0, 2**64 - 1)


def check_strategy(cfg: TrainConfig, seams=None) -> type[Strategy]:
    """Everything about the strategy that can be refused before spawning: :func:`check_common`,
    then the strategy's own ``check``.  Returns its class."""
    cls = get_strategy(cfg.strategy)
    check_common(cls, cfg, Seams.of(seams))
    cls.check(cfg)
    return cls


def check_common(cls: type[Strategy], cfg: TrainConfig, seams: Seams | None = None) -> None:
    """Sizes (at least 1, and what fits the machine: :func:`check_fits_machine`), seed, learning
    rate, timeout, precision, backend, the options' own checks and the seams."""
    for name in ("world_size", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, "
                              f"got {getattr(cfg, name)}")
    if not SEED_RANGE[0] <= cfg.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed must be from {SEED_RANGE[0]} to {SEED_RANGE[1]} (2**64 - 1: "
                          f"torch's random generators take a 64-bit unsigned seed), got {cfg.seed}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if not (math.isfinite(cfg.timeout) and cfg.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {cfg.timeout}")
    if not MIN_RUN_TIMEOUT_S <= cfg.timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout must be from {MIN_RUN_TIMEOUT_S:g} s (starting the ranks and "
                          "one step's collectives take longer than that on a busy machine: a "
                          f"shorter timeout fails runs that are fine) to {MAX_TIMEOUT_S:g} s (a week: "
                          f"a collective that waits longer is stuck), got {cfg.timeout:g}")
    _check_precision(cls, cfg)
    if cfg.backend == "nccl" and cls.nccl_refusal:
        raise ConfigError(f"{cls.name} cannot run on NCCL: {cls.nccl_refusal}; use --backend gloo")
    if cfg.backend == "nccl" and torch.cuda.device_count() < cfg.world_size:
        raise ConfigError(f"--backend nccl needs {cfg.world_size} GPUs, found "
                          f"{torch.cuda.device_count()}; use --backend gloo")
    if isinstance(cfg.options, Options):
        cfg.options.validate()
    for name in (seams.given() if seams else []):
        if name not in cls.seams:
            takers = [n for n in strategy_names() if name in get_strategy(n).seams]
            raise ConfigError(f"strategy {cls.name!r} has no seam {name!r}; strategies that take "
                              f"it: {', '.join(takers) or 'none'}")
    if seams is not None and seams.given():
        cls.check_seams(cfg, seams)
    check_fits_machine(cfg)



def _check_precision(cls: type[Strategy], cfg: TrainConfig) -> None:
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {cfg.precision!r}"
                          f"{did_you_mean(cfg.precision, PRECISIONS)}; choose one of: "
                          f"{', '.join(PRECISIONS)}")
    if cfg.precision not in cls.precisions:
        able = [n for n in strategy_names() if cfg.precision in get_strategy(n).precisions]
        raise ConfigError(f"strategy {cls.name!r} supports --precision "
                          f"{' or '.join(cls.precisions)} only, got {cfg.precision}; use "
                          f"--precision fp32, or a strategy that supports {cfg.precision} "
                          f"({', '.join(able) or 'none'})")
    if cfg.loss_scale is not None:
        if not (cfg.loss_scale >= 0 and math.isfinite(cfg.loss_scale)):
            raise ConfigError(f"--loss-scale must be >= 0 (0 turns loss scaling off), "
                              f"got {cfg.loss_scale}")
        if cfg.loss_scale > 0 and cfg.precision == "fp32":
            raise ConfigError("--loss-scale applies to mixed precision; add --precision "
                              "fp16-mixed (or bf16-mixed)")
    if cfg.loss_scale_growth < 1:
        raise ConfigError(f"--loss-scale-growth must be >= 1 (good steps before the scale "
                          f"doubles), got {cfg.loss_scale_growth}")
    if cfg.checkpoint_activations and not cls.recomputes:
        raise ConfigError(f"strategy {cls.name!r} cannot checkpoint activations; leave out "
                          "--checkpoint-activations")
