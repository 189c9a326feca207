"""Lesson 00: the ZeRO bytes per device."""

from __future__ import annotations

from .core import exercise, raised


@exercise('zero_bytes_per_device',
          "equals 4Ψ+12Ψ/N, 2Ψ+14Ψ/N and 16Ψ/N, and the ZeRO paper's numbers")
def _check_zero_bytes(fn) -> str | None:
    from ..memory import model_state_bytes

    cases = [(7.5e9, 64, s) for s in range(4)] + [(1e6, n, s) for n in (1, 2, 3, 8) for s in range(4)]
    for psi, n, stage in cases:
        want = model_state_bytes(psi, n, stage, "mixed-adam")["total"]
        try:
            got = fn(psi, n, stage)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(f"{fn.__name__}({psi:g}, {n}, {stage})", exc, fn)
        if got is None:
            return f"{fn.__name__}({psi:g}, {n}, {stage}) returned None: return the number of bytes"
        if abs(got - want) > 1e-6 * want:
            return (f"{fn.__name__}({psi:g}, {n}, {stage}) = {got:,.0f} bytes, expected {want:,.0f} "
                    "(2 + 2 + 12 bytes per parameter; stage 1 shards the 12, stage 2 also the "
                    "gradients' 2, stage 3 everything)")
    return None
