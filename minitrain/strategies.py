"""The strategy registry: ``--strategy NAME`` → a class, so new techniques plug in without CLI edits.

A strategy is a class with

* ``name`` and ``help`` — what the CLI lists;
* ``add_arguments(parser)`` — its own options (e.g. ``--bucket-mb``), added to ``minitrain train``;
* ``check(cfg)`` — refuses impossible configurations with :class:`ConfigError` *before* any process
  is started, naming the fix;
* ``__init__(cfg, comm)`` — builds the model, wrappers and optimizer on one rank;
* ``train_step(x, y)`` — one optimizer step on the *global* batch ``(x, y)`` (each strategy takes the
  slice its rank needs) returning the global mean loss as a float;
* ``fit(data, on_step)`` — the loop over steps (shared; overridden where ranks do not step together);
* ``memory()`` — this rank's memory ledger.

``Single`` here is the baseline every other strategy is proven equal to.  Parallel strategies live in
``minitrain/parallel/`` (one file each) and register themselves when imported.
"""

from __future__ import annotations

import abc
import argparse
import importlib
import pkgutil
import time
from dataclasses import dataclass, field, replace

import torch

from .comm import Comm
from .memory import ActivationMeter, ledger, rss_bytes
from .model import GPT, GPTConfig, PRESETS

__all__ = ["ConfigError", "TrainConfig", "Strategy", "Single", "register", "get_strategy",
           "strategy_names"]


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process starts, with the fix in it."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the same object reaches every rank."""

    strategy: str = "single"
    world_size: int = 1
    steps: int = 20
    seed: int = 0
    batch_size: int = 16
    lr: float = 1e-3
    model: GPTConfig = field(default_factory=lambda: PRESETS["tiny"])
    backend: str | None = None
    timeout: float = 120.0
    options: dict = field(default_factory=dict)  # strategy-specific options from add_arguments

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)


_REGISTRY: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty 'name'")
    _REGISTRY[cls.name] = cls
    return cls


def _load_parallel() -> None:
    """Import every module in ``minitrain.parallel`` so their ``@register`` decorators run."""
    from . import parallel
    for mod in pkgutil.iter_modules(parallel.__path__):
        importlib.import_module(f"{parallel.__name__}.{mod.name}")


def strategy_names() -> list[str]:
    _load_parallel()
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["Strategy"]:
    """The class registered as ``name``; a :class:`ConfigError` listing the choices otherwise."""
    _load_parallel()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: "
                          f"{', '.join(sorted(_REGISTRY))}") from None


class Strategy(abc.ABC):
    """Base class: shared checks, and the pieces of a training step every strategy has."""

    name = ""
    help = ""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this strategy's own options (none by default)."""

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        """Raise :class:`ConfigError` if ``cfg`` cannot run.  Subclasses call ``super().check``."""
        for name in ("world_size", "steps", "batch_size"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, "
                                  f"got {getattr(cfg, name)}")
        if cfg.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {cfg.lr}")
        if cfg.backend == "nccl" and torch.cuda.device_count() < cfg.world_size:
            raise ConfigError(f"--backend nccl needs {cfg.world_size} GPUs, found "
                              f"{torch.cuda.device_count()}; use --backend gloo")

    def __init__(self, cfg: TrainConfig, comm: Comm):
        self.cfg, self.comm = cfg, comm
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.distributed.get_backend() == "nccl") else torch.device("cpu")
        self.meter = ActivationMeter()

    def build_model(self) -> GPT:
        """The tiny GPT, bit-equal on every rank (deterministic init from the seed)."""
        return GPT(self.cfg.model, seed=self.cfg.seed).to(self.device)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.cfg.lr)

    @abc.abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""

    def fit(self, data, on_step=None) -> tuple[list[float], list[float]]:
        """Run ``cfg.steps`` steps on batches from ``data``; return (losses, seconds per step).

        The lockstep loop every strategy shares.  A strategy whose ranks do not step together (the
        asynchronous parameter server) overrides it.  ``on_step(step, loss)`` follows each step.
        """
        losses, times = [], []
        for step in range(self.cfg.steps):
            x, y = data.batch(step, self.cfg.batch_size)
            t0 = time.perf_counter()
            loss = self.train_step(x, y)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
        return losses, times

    def state_dict(self) -> dict:
        """The full model's weights as a plain single-process state_dict (on every rank that has it)."""
        return self.model.state_dict()

    def report(self) -> dict:
        """Strategy-specific facts for the summary (bucket sizes, timelines, bubbles...)."""
        return {}

    def memory(self) -> dict:
        out = ledger(self.model, self.optimizer, self.meter.peak)
        out["rss_peak"] = rss_bytes(peak=True)
        return out


@register
class Single(Strategy):
    """One process, one model, Adam: the reference every parallel strategy must equal."""

    name = "single"
    help = "one process: the baseline every parallel strategy is checked against"

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        if cfg.world_size != 1:
            raise ConfigError(f"strategy 'single' runs on one rank, got --world-size "
                              f"{cfg.world_size}; use --world-size 1 or a parallel strategy "
                              f"({', '.join(n for n in strategy_names() if n != 'single') or 'none yet'})")

    def __init__(self, cfg: TrainConfig, comm: Comm):
        super().__init__(cfg, comm)
        self.model = self.build_model()
        self.meter = ActivationMeter(self.model)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self.meter.measure():
            loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        return loss.item()
