"""``single``: one process, one model, Adam — the baseline every parallel strategy must equal.

The worked example of the contract in :mod:`.base`: a name and a help line, ``check`` (what only it
cannot run), ``__init__`` (the model and the optimizer), ``train_step``, and a ``checkpointer``.
:class:`Replica` is the checkpointer of every strategy whose ranks hold identical replicas
(``single``, ``ddp-naive``, ``ddp``, ``context``).
"""

from __future__ import annotations

import torch

from ..model import GPT
from ..precision import PRECISIONS
from .base import Checkpointer, Lockstep, TrainConfig, register, strategy_names
from .options import ConfigError
from .portable import from_optimizer_state, to_optimizer_state

__all__ = ["Replica", "Single"]


class Replica(Checkpointer):
    """Identical replicas: rank 0 writes the model and the optimizer once, every rank loads them.
    ``reshards``: it also takes a portable state (another layout's checkpoint) whole."""

    def __init__(self, reshards: bool = False):
        self.reshards = reshards

    def save(self, strategy) -> dict:
        if strategy.comm.rank != 0:
            return {}
        return {"model": strategy.model.state_dict(), "optimizer": strategy.optimizer.state_dict()}

    def load(self, strategy, read) -> None:
        state = read(0)
        strategy.model.load_state_dict(state["model"])
        strategy.optimizer.load_state_dict(state["optimizer"])

    def consolidate(self, cfg: TrainConfig, read) -> dict:
        return read(0)["model"]

    def portable_optimizer(self, cfg: TrainConfig, read) -> dict:
        """The optimizer's parameters are the model's, in ``named_parameters()`` order."""
        names = [n for n, p in GPT(cfg.model).named_parameters() if p.requires_grad]
        return from_optimizer_state(read(0)["optimizer"], names, masters=cfg.precision != "fp32")

    @torch.no_grad()
    def load_portable(self, strategy, weights: dict, optim: dict) -> None:
        strategy.model.load_state_dict(weights)
        names = {id(p): n for n, p in strategy.model.named_parameters()}
        order = [names[id(p)] for group in strategy.optimizer.param_groups for p in group["params"]]
        strategy.optimizer.load_state_dict(
            to_optimizer_state(strategy.optimizer.state_dict(), order, optim, weights))


@register
class Single(Lockstep):
    """One process, one model, Adam: the reference every parallel strategy must equal."""

    name = "single"
    help = "one process: the baseline every parallel strategy is checked against"
    precisions = tuple(PRECISIONS)
    seams = ("loss_scale_update", "mixed_precision_step", "recompute_block")
    checkpointer = Replica(reshards=True)

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        if cfg.world_size != 1:
            others = [n for n in strategy_names() if n != "single"]
            raise ConfigError(f"strategy 'single' runs on one rank, got --world-size "
                              f"{cfg.world_size}; use --world-size 1 or a parallel strategy "
                              f"({', '.join(others) or 'none yet'})")

    def __init__(self, cfg: TrainConfig, comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.model = self.build_model()
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.optimizer_step(self.model, x.to(self.device), y.to(self.device)).item()
