"""Lesson 07: the dynamic loss-scale update."""

from __future__ import annotations

from .core import exercise, raised


@exercise('loss_scale_update',
          "halves on overflow and skips the step, doubles after a run of good steps")
def _check_loss_scale_update(fn) -> str | None:
    """The learner's rule, step by step, against DynamicLossScaler on an overflow pattern."""
    from ..precision import DynamicLossScaler

    ref = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=3)
    scale, good = ref.scale, 0
    pattern = [True, True, False, False, False, False, True, False, False, False, False]
    for step, found_inf in enumerate(pattern):
        ref.update(found_inf)
        try:
            out = fn(scale, good, found_inf, 3)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(f"step {step}: {fn.__name__}(...)", exc, fn)
        if not isinstance(out, tuple) or len(out) != 3:
            return "return a tuple (new_scale, new_good_steps, take_step)"
        scale, good, take = out
        if bool(take) == found_inf:
            return (f"step {step}: found_inf={found_inf} but take_step={take}: skip the optimizer "
                    "step exactly when a gradient overflowed")
        if scale != ref.scale:
            return (f"step {step} (found_inf={found_inf}): scale {scale:g}, expected {ref.scale:g} "
                    "(halve on overflow; double after growth_interval good steps in a row)")
        if good != ref.good_steps:
            return (f"step {step}: good_steps {good}, expected {ref.good_steps} (reset it to 0 on "
                    "overflow and whenever the scale grows)")
    return None
