"""Mixed precision from scratch: 16-bit weights and gradients, fp32 master weights, loss scaling.

Lesson 07 (the 16 bytes per parameter, bf16 or fp16, why loss scaling); paper: Micikevicius et al.,
2018, "Mixed Precision Training".  :func:`cast_model_` takes fp32 masters and casts the model to 16
bits; :class:`MixedPrecisionOptimizer` steps Adam on the masters and writes them back (2 + 2 + 12 =
16 bytes per parameter, the 12 in ``optimizer.state`` so ZeRO can shard them);
:class:`DynamicLossScaler` is fp16's loss scale, with the rule of ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["PRECISIONS", "compute_dtype", "cast_model_", "DynamicLossScaler", "loss_scale_update",
           "MixedPrecisionOptimizer", "mixed_precision_step", "gradient_underflow"]

#: ``--precision`` → the dtype weights and gradients are kept in (fp32: no mixed precision)
PRECISIONS = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of weights and gradients under ``precision`` ('fp32', 'bf16-mixed', 'fp16-mixed')."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; choose one of: "
                         f"{', '.join(PRECISIONS)}") from None


@torch.no_grad()
def cast_model_(model: nn.Module, dtype: torch.dtype) -> dict:
    """Cast ``model``'s parameters (and floating buffers) to ``dtype`` in place; return the masters.

    The masters — ``{parameter: fp32 copy}`` — are taken *before* the cast, so they hold the exact
    fp32 weights.  Pass them to :class:`MixedPrecisionOptimizer` (``master_weights=``), which keeps
    them as they are (no second copy).  Parameters stay the same objects (``module.to`` replaces
    their ``.data``), so wrappers and hooks built on them keep working.
    """
    masters = {p: p.detach().float().clone() for p in model.parameters()}
    model.to(dtype)
    return masters


def loss_scale_update(scale: float, good_steps: int, found_inf: bool, growth_interval: int,
                      growth_factor: float = 2.0, backoff_factor: float = 0.5):
    """The rule of ``torch.amp.GradScaler`` (the package's; lesson 07's exercise writes it): on an
    overflow, back off and skip the step; after ``growth_interval`` good steps in a row, grow.
    Returns ``(new_scale, new_good_steps, take_step)``."""
    if found_inf:
        return scale * backoff_factor, 0, False
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0, True
    return scale, good_steps, True


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. §3.2; the rule of ``torch.amp.GradScaler``).

    ``scale(loss)`` before backward; ``unscale_(grads)`` on the fp32 gradient copies returns whether
    any is inf/NaN; ``update(found_inf)`` then halves the scale (the step is skipped) or, after
    ``growth_interval`` consecutive good steps, doubles it.  Everything is inspectable: ``scale``,
    ``skipped_steps``, ``good_steps`` (since the last change), ``steps`` and ``history`` (the scale
    used at each step, and whether that step was skipped).

    ``loss_scale_update=`` is a seam (lesson 07's exercise): ``fn(scale, good_steps, found_inf,
    growth_interval) -> (new_scale, new_good_steps, take_step)``; None: :func:`loss_scale_update`
    with this scaler's factors.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 loss_scale_update=None):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                             "growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.loss_scale_update = loss_scale_update  # None: the package's loss_scale_update
        self.steps = self.skipped_steps = self.good_steps = 0
        self.history: list[tuple[float, bool]] = []  # (scale used, skipped?) per step

    def _package_rule(self, scale: float, good_steps: int, found_inf: bool, growth_interval: int):
        """:func:`loss_scale_update` with this scaler's growth and backoff factors."""
        return loss_scale_update(scale, good_steps, found_inf, growth_interval, self.growth_factor,
                                 self.backoff_factor)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss · S``: backward from it gives S times the gradients."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads) -> bool:
        """Divide the (fp32) gradients by S in place; True if any of them is inf or NaN."""
        grads = [g for g in grads if g is not None]
        if not grads:
            return False
        torch._foreach_mul_(grads, 1.0 / self.scale)
        return not bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def update(self, found_inf: bool) -> None:
        """After a step: on overflow skip it and back off; after enough good steps, grow."""
        self.history.append((self.scale, bool(found_inf)))
        self.steps += 1
        rule = self.loss_scale_update or self._package_rule
        self.scale, self.good_steps, take = rule(self.scale, self.good_steps, bool(found_inf),
                                                 self.growth_interval)
        self.skipped_steps += not take

    def state_dict(self) -> dict:
        """The scaler's state as plain numbers (what the training summary reports)."""
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "steps": self.steps,
                "good_steps": self.good_steps, "growth_interval": self.growth_interval,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        for key in ("scale", "skipped_steps", "steps", "good_steps", "growth_interval",
                    "growth_factor", "backoff_factor"):
            setattr(self, key, state[key])
        self.history = [tuple(h) for h in state.get("history", [])]


@torch.no_grad()
def mixed_precision_step(params, masters, optimizer, loss_scale: float | None = None) -> bool:
    """One step of ``optimizer`` (over the fp32 ``masters``) for the 16-bit ``params``.

    Each master gets its parameter's gradient in fp32, divided by ``loss_scale`` when there is one;
    if any of them is then inf or NaN (fp16 overflowed) nothing changes and the step is skipped.
    Otherwise the optimizer steps the masters, which are rounded back into the parameters.
    Returns True when the step was taken.  (Lesson 07's exercise: the ``mixed_precision_step``
    seam of :class:`MixedPrecisionOptimizer`.)
    """
    for p, m in zip(params, masters):
        m.grad = None if p.grad is None else p.grad.float()  # a new fp32 tensor for 16-bit p
    grads = [m.grad for m in masters if m.grad is not None]
    if loss_scale is not None and grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)
        if not bool(torch.stack([g.isfinite().all() for g in grads]).all()):
            return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)  # round to nearest 16-bit value
    return True


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Steps ``optimizer_class`` on fp32 master copies of 16-bit parameters.

    ``MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)`` — shaped like
    PyTorch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``.

    Arguments:
        params: the model's (bf16/fp16) parameters, or parameter groups.
        optimizer_class: the optimizer run on the masters (``torch.optim.Adam``).
        master_weights: ``{parameter: fp32 tensor}`` from :func:`cast_model_` (used as they are);
            a parameter missing from it gets ``p.float()`` — its 16-bit value, upcast.
        loss_scaler: a :class:`DynamicLossScaler` (fp16); None: no scaling (bf16).
        mixed_precision_step: ``mixed_precision_step(params, masters, inner_optimizer,
            loss_scale) -> took_step``, the step itself (lesson 07's exercise); None: the
            package's :func:`mixed_precision_step`.
        **defaults: the inner optimizer's hyperparameters (``lr``, ``betas``, ...).

    ``self.state[p]`` holds ``"master"`` and, after the first step, the inner optimizer's state
    for that parameter (``exp_avg``, ``exp_avg_sq``, ``step``: the same tensors, not copies), so the
    memory ledger counts 4 + 4 + 4 = 12 bytes of optimizer state per parameter.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, master_weights: dict | None = None,
                 loss_scaler: DynamicLossScaler | None = None, mixed_precision_step=None,
                 **defaults):
        super().__init__(params, defaults)
        master_weights = master_weights or {}
        self.loss_scaler = loss_scaler
        self.mixed_precision_step = mixed_precision_step  # None: the package's
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (16-bit weight, fp32 master)
        groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                m = master_weights.get(p)
                m = p.detach().float().clone() if m is None else m.detach()
                self.state[p]["master"] = m
                self.pairs.append((p, m))
                masters.append(m)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.optimizer = optimizer_class(groups, **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """fp32 gradient copies → (unscale, skip on overflow) → inner step → round into the weights.

        Returns the closure's loss, if one was given.  On a skipped step nothing changes but the
        loss scale (the weights and the Adam state are untouched).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})  # e.g. an lr schedule
        params, masters = [p for p, _ in self.pairs], [m for _, m in self.pairs]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        master_step = self.mixed_precision_step or mixed_precision_step
        took = bool(master_step(params, masters, self.optimizer, scale))
        if self.loss_scaler is not None:
            self.loss_scaler.update(not took)
        if took:
            for p, m in self.pairs:
                self.state[p].update(self.optimizer.state[m])
        for _, m in self.pairs:
            m.grad = None  # the fp32 gradients live only during the step
        return loss

    def state_dict(self) -> dict:
        return {"masters": [m for _, m in self.pairs], "optimizer": self.optimizer.state_dict(),
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        for (p, m), saved in zip(self.pairs, state_dict["masters"], strict=True):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for p, m in self.pairs:
            self.state[p] = {"master": m, **self.optimizer.state[m]}
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


@torch.no_grad()
def gradient_underflow(grads16, grads32) -> float:
    """Fraction of gradient elements that are zero in 16 bits but not in the fp32 reference —
    the ones lost to underflow (lesson 07 shows fp16 with and without loss scaling)."""
    lost = total = 0
    for g16, g32 in zip(grads16, grads32):
        nonzero = g32 != 0
        lost += int(((g16 == 0) & nonzero).sum())
        total += int(nonzero.sum())
    return lost / max(total, 1)
