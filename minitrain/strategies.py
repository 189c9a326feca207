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
* ``memory()`` — this rank's memory ledger;
* ``checkpoint_state()``, ``load_checkpoint_state(read)``, ``consolidate_checkpoint(cfg, read)``,
  ``checkpoint_layout(cfg)`` and ``checkpoint_refusal`` — sharded checkpoints (lesson 08,
  :mod:`minitrain.checkpoint`); the defaults serve ranks holding identical replicas.

Precision and activation checkpointing (lesson 07) are trainer options every strategy sees in
``cfg``: ``build_model()`` casts the model to 16 bits (``--precision bf16-mixed|fp16-mixed``) and
turns on per-block checkpointing (``--checkpoint-activations``); ``make_optimizer()`` then returns a
:class:`~minitrain.precision.MixedPrecisionOptimizer` holding the fp32 masters (and, for fp16, a
:class:`~minitrain.precision.DynamicLossScaler`); ``backward(loss)`` scales the loss when there is a
scaler.  A strategy lists the precisions it honours in ``precisions`` (fp32 only by default, so one
that builds its own optimizer is not silently wrong) and sets ``checkpointing = False`` if it cannot
honour checkpointing; ``check`` refuses the rest.

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
from .precision import PRECISIONS, DynamicLossScaler, MixedPrecisionOptimizer, cast_model_

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
    precision: str = "fp32"  # "fp32", "bf16-mixed" or "fp16-mixed" (minitrain.precision)
    checkpoint_activations: bool = False  # recompute each block's activations in backward
    loss_scale: float | None = None  # initial dynamic loss scale; None: 2**16 for fp16, else off; 0: off
    save_dir: str | None = None  # write sharded checkpoints under it (lesson 08, minitrain.checkpoint)
    save_every: int | None = None  # ... every this many steps, and after the last (None: the last only)
    resume: str | None = None  # a checkpoint (or a save_dir: its latest) to resume from; steps counts from 0

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
    #: the ``--precision`` values this strategy honours (mixed ones need build_model/make_optimizer/
    #: backward used as Single does); any other is refused by ``check``
    precisions: tuple = ("fp32",)
    #: whether ``--checkpoint-activations`` is honoured (it is, for a model from ``build_model()``)
    checkpointing: bool = True

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
        cls.check_precision(cfg)
        if cfg.backend == "nccl" and torch.cuda.device_count() < cfg.world_size:
            raise ConfigError(f"--backend nccl needs {cfg.world_size} GPUs, found "
                              f"{torch.cuda.device_count()}; use --backend gloo")

    @classmethod
    def check_precision(cls, cfg: TrainConfig) -> None:
        """Refuse an unknown or unsupported ``--precision``, a bad ``--loss-scale``, and
        ``--checkpoint-activations`` where the strategy cannot honour it."""
        if cfg.precision not in PRECISIONS:
            raise ConfigError(f"unknown --precision {cfg.precision!r}; choose one of: "
                              f"{', '.join(PRECISIONS)}")
        if cfg.precision not in cls.precisions:
            able = [n for n in strategy_names() if cfg.precision in _REGISTRY[n].precisions]
            raise ConfigError(f"strategy {cls.name!r} supports --precision "
                              f"{' or '.join(cls.precisions)} only, got {cfg.precision}; use "
                              f"--precision fp32, or a strategy that supports {cfg.precision} "
                              f"({', '.join(able) or 'none'})")
        if cfg.loss_scale is not None:
            if cfg.loss_scale < 0:
                raise ConfigError(f"--loss-scale must be >= 0 (0 turns loss scaling off), "
                                  f"got {cfg.loss_scale}")
            if cfg.loss_scale > 0 and cfg.precision == "fp32":
                raise ConfigError("--loss-scale applies to mixed precision; add --precision "
                                  "fp16-mixed (or bf16-mixed)")
        if cfg.checkpoint_activations and not cls.checkpointing:
            raise ConfigError(f"strategy {cls.name!r} cannot checkpoint activations; leave out "
                              "--checkpoint-activations")

    def __init__(self, cfg: TrainConfig, comm: Comm):
        self.cfg, self.comm = cfg, comm
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.distributed.get_backend() == "nccl") else torch.device("cpu")
        self.meter = ActivationMeter()
        self.master_weights: dict = {}  # {16-bit parameter: fp32 copy}, filled by build_model
        self.loss_scaler: DynamicLossScaler | None = None  # set by make_optimizer (fp16-mixed)
        self.start_step = 0  # where fit() starts: set by minitrain.checkpoint.load_checkpoint
        self.saved_checkpoints: list[str] = []

    def build_model(self) -> GPT:
        """The tiny GPT, bit-equal on every rank (deterministic init from the seed).

        With ``cfg.checkpoint_activations`` each block is recomputed in backward.  With a mixed
        ``cfg.precision`` the model is cast to bf16/fp16 and the fp32 weights from *before* the cast
        are kept in ``self.master_weights`` for :meth:`make_optimizer`.
        """
        model = GPT(self.cfg.model, seed=self.cfg.seed,
                    checkpoint_activations=self.cfg.checkpoint_activations).to(self.device)
        if self.cfg.precision != "fp32":
            self.master_weights.update(cast_model_(model, PRECISIONS[self.cfg.precision]))
        return model

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """Adam; under mixed precision, Adam on fp32 masters (plus a loss scaler for fp16)."""
        if self.cfg.precision == "fp32":
            return torch.optim.Adam(params, lr=self.cfg.lr)
        scale = self.cfg.loss_scale
        if scale is None and self.cfg.precision == "fp16-mixed":
            scale = 2.0 ** 16
        self.loss_scaler = DynamicLossScaler(scale) if scale else None
        params = list(params)
        masters = {p: self.master_weights.pop(p) for p in params if p in self.master_weights}
        return MixedPrecisionOptimizer(params, torch.optim.Adam, master_weights=masters,
                                       loss_scaler=self.loss_scaler, lr=self.cfg.lr)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss multiplied by the loss scale when there is one."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        loss.backward()

    def precision_report(self) -> dict:
        """Precision facts for the summary: the loss scaler's state (None without scaling)."""
        scaler = getattr(self, "loss_scaler", None)
        return {"precision": self.cfg.precision,
                "checkpoint_activations": self.cfg.checkpoint_activations,
                "loss_scaler": scaler.state_dict() if scaler else None}

    @abc.abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""

    def fit(self, data, on_step=None) -> tuple[list[float], list[float]]:
        """Run ``cfg.steps`` steps on batches from ``data``; return (losses, seconds per step).

        The lockstep loop every strategy shares.  A strategy whose ranks do not step together (the
        asynchronous parameter server) overrides it.  ``on_step(step, loss)`` follows each step.
        """
        losses, times = [], []
        for step in range(self.start_step, self.cfg.steps):
            x, y = data.batch(step, self.cfg.batch_size)
            t0 = time.perf_counter()
            loss = self.train_step(x, y)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            if on_step is not None:
                on_step(step, loss)
            if self.cfg.save_dir:
                from .checkpoint import maybe_save
                maybe_save(self, step)
        return losses, times

    def state_dict(self) -> dict:
        """The full model's weights as a plain single-process state_dict (on every rank that has it)."""
        return self.model.state_dict()

    # -- checkpoints (lesson 08; files, metadata and checks in minitrain.checkpoint) -----------------
    #: None where the class saves and resumes checkpoints, else why not.  Only a registered class's
    #: *own* None counts (minitrain.checkpoint.checkpoint_support): a subclass whose state lies
    #: differently must implement the methods below and declare it again.
    checkpoint_refusal: str | None = None

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        """This strategy's options that decide how its state is cut (JSON values); a checkpoint
        resumes only under the same (strategy, world size, model and precision are compared too)."""
        return {}

    def checkpoint_state(self) -> dict:
        """This rank's part of the training state, for its checkpoint file: tensors and plain
        containers (``torch.load(weights_only=True)`` reads them back).  Default, for ranks that
        hold identical replicas (single, ddp): rank 0 writes the model and optimizer state_dicts
        once, the others nothing."""
        if self.comm.rank != 0:
            return {}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, read) -> None:
        """Restore what :meth:`checkpoint_state` saved; ``read(r)`` returns rank r's saved part.
        Default: every replica loads rank 0's."""
        state = read(0)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate_checkpoint(cls, cfg: TrainConfig, read) -> dict:
        """The full model as a plain single-process state_dict from the ranks' saved parts —
        offline, without a process group.  Default: rank 0's replica."""
        return read(0)["model"]

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
    precisions = tuple(PRECISIONS)
    checkpoint_refusal = None  # the replica defaults

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
        self.backward(loss)
        self.optimizer.step()
        return loss.item()
