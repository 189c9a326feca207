"""Lesson 00: the ZeRO bytes per device."""

from __future__ import annotations

from .core import exercise, raised

#: what each ZeRO stage shards, in the learner's terms
_SHARDS = {0: "at stage 0 nothing is sharded (plain data parallelism: all 16 bytes on every device)",
           1: "stage 1 shards only the optimizer states (12Ψ/N), weights and gradients stay whole",
           2: "stage 2 also shards the gradients (2Ψ + 2Ψ/N + 12Ψ/N)",
           3: "stage 3 shards the weights too (16Ψ/N)"}


def _diagnose(got: float, psi: float, n: int, stage: int) -> str:
    from ..memory import model_state_bytes

    def close(a, b):
        return abs(a - b) <= 1e-6 * abs(b)

    if stage < 3 and close(got, 16 * psi / n):
        return (f"that is 16Ψ/N at every stage: only stage 3 divides all 16 bytes by N — "
                f"{_SHARDS[stage]}")
    for other in range(4):
        if other != stage and close(got, model_state_bytes(psi, n, other)["total"]):
            return f"that is stage {other}'s number — {_SHARDS[stage]}"
    for k in (8, 4):
        p, g = 2 * psi / (n if stage >= 3 else 1), 2 * psi / (n if stage >= 2 else 1)
        if close(got, p + g + k * psi / (n if stage >= 1 else 1)):
            return (f"the optimizer's 12 bytes per parameter are the fp32 master weights (4), Adam's "
                    f"momentum (4) and variance (4); you counted {k}")
    return ("2 + 2 + 12 bytes per parameter; stage 1 shards the 12, stage 2 also the gradients' 2, "
            "stage 3 everything")


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
            return (f"{fn.__name__}({psi:g}, {n}, {stage}) = {got:,.0f} bytes, expected {want:,.0f}: "
                    f"{_diagnose(got, psi, n, stage)}")
    return None
