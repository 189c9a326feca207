"""``single``: one process, one model, Adam — the baseline every parallel strategy must equal."""

from __future__ import annotations

import torch

from ..memory import ActivationMeter
from ..precision import PRECISIONS
from .base import ConfigError, Lockstep, TrainConfig, register, strategy_names


@register
class Single(Lockstep):
    """One process, one model, Adam: the reference every parallel strategy must equal."""

    name = "single"
    help = "one process: the baseline every parallel strategy is checked against"
    precisions = tuple(PRECISIONS)
    seams = ("loss_scale_update", "mixed_precision_step", "recompute_block")
    checkpoint_refusal = None  # the replica defaults
    reshardable = True

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
        self.meter = ActivationMeter(self.model)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.optimizer_step(self.model, x.to(self.device), y.to(self.device)).item()
