"""Lesson 00: the ZeRO bytes per device."""

from __future__ import annotations

import itertools
import math
import numbers

from .core import exercise, raised

#: what each ZeRO stage shards: weights (2 bytes), gradients (2), optimizer states (12)
_SHARDED = {0: set(), 1: {"optimizer states"}, 2: {"optimizer states", "gradients"},
            3: {"optimizer states", "gradients", "weights"}}
_KINDS = ("weights", "gradients", "optimizer states")


def _number(got) -> float | None:
    """``got`` as a float when it is one real number (int, float, a NumPy scalar, a one-element
    tensor or array), else None."""
    if isinstance(got, bool):
        return None
    if isinstance(got, numbers.Real):
        return float(got)
    size = got.numel() if callable(getattr(got, "numel", None)) else getattr(got, "size", None)
    if size == 1 and callable(getattr(got, "item", None)):
        try:
            value = got.item()
        except (TypeError, ValueError, RuntimeError):
            return None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
    return None


def _explain(got: float, psi: float, n: int) -> tuple[set, dict] | None:
    """Which kinds a number divides by N, and how many bytes per parameter it counts for each:
    (sharded kinds, {kind: bytes}) when ``got`` is 2Ψ/a + 2Ψ/b + kΨ/c for whole bytes k (a, b,
    c each 1 or N), else None."""
    if n == 1:
        return None
    per = {"weights": (2, 4, 1), "gradients": (2, 4, 1), "optimizer states": (12, 8, 4, 16)}
    for cut in itertools.product((False, True), repeat=3):
        for sizes in itertools.product(*(per[k] for k in _KINDS)):
            total = sum(b * psi / (n if c else 1) for b, c in zip(sizes, cut))
            if abs(total - got) <= 1e-6 * abs(got):
                return ({k for k, c in zip(_KINDS, cut) if c}, dict(zip(_KINDS, sizes)))
    return None


def _and(words) -> str:
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _diagnose(got: float, want: float, psi: float, n: int, stage: int, by_stage: dict) -> str:
    """What the learner's number is, said from what was observed: its value at every stage, and
    (where it decomposes into 2 + 2 + 12 bytes per parameter, some divided by N) which kinds it
    sharded and how many bytes it counted — beside what stage ``stage`` shards."""
    told = []
    values = [v for v in by_stage.values() if v is not None]
    if len(by_stage) == 4 and len(values) == 4 and max(values) - min(values) <= 1e-9 * abs(max(values)):
        told.append(f"your function gives the same {got:,.0f} bytes at every stage (0 to 3), but "
                    "each stage shards one more kind of model state")
    found = _explain(got, psi, n)
    if found is not None:
        cut, sizes = found
        counted = {k: b for k, b in sizes.items() if b != {"optimizer states": 12}.get(k, 2)}
        for kind, b in counted.items():
            if kind == "optimizer states":
                told.append(f"you counted {b} bytes per parameter of optimizer states; they are 12 "
                            "— the fp32 master weights (4), Adam's momentum (4) and variance (4)")
            else:
                told.append(f"you counted {b} bytes per parameter of {kind}; in mixed precision "
                            f"they are 2 (bf16)")
        should = _SHARDED[stage]
        extra, missing = sorted(cut - should, key=_KINDS.index), sorted(should - cut, key=_KINDS.index)
        if extra:
            told.append(f"you divided the {_and(extra)} by N, but stage {stage} keeps "
                        "them whole on every device (only stage "
                        f"{min(s for s in _SHARDED if set(extra) <= _SHARDED[s])} shards them)")
        if missing:
            told.append(f"you did not divide the {_and(missing)} by N, but stage {stage} shards "
                        "them")
        same = [s for s in range(4) if s != stage and _SHARDED[s] == cut]
        if (extra or missing) and same and not counted:
            told.append(f"that is stage {same[0]}'s number")
    if not told:
        ratio = got / want if want else math.nan
        told.append(f"that is {ratio:.3g}× the right number; count 2 + 2 + 12 bytes per parameter "
                    "(weights, gradients, optimizer states) and divide by N what stage "
                    f"{stage} shards: {_and(sorted(_SHARDED[stage], key=_KINDS.index)) if stage else 'nothing'}")
    return "; ".join(told)


def _stages(fn, psi, n) -> dict:
    """The learner's numbers at every stage for (psi, n) (None where it raised or is no number)."""
    out = {}
    for s in range(4):
        try:
            out[s] = _number(fn(psi, n, s))
        except Exception:  # noqa: BLE001 - the learner's code may raise anything
            out[s] = None
    return out


@exercise('zero_bytes_per_device',
          "the bytes per device of no ZeRO and of stages 1, 2 and 3, for 7.5B parameters on 64 "
          "devices (the ZeRO paper's numbers) and for 1, 2, 3 and 8 devices")
def _check_zero_bytes(fn) -> str | None:
    from ...memory import model_state_bytes

    cases = [(7.5e9, 64, s) for s in range(4)] + [(1e6, n, s) for n in (1, 2, 3, 8) for s in range(4)]
    for psi, n, stage in cases:
        want = model_state_bytes(psi, n, stage, "mixed-adam")["total"]
        call = f"{getattr(fn, '__name__', 'your function')}({psi:g}, {n}, {stage})"
        try:
            out = fn(psi, n, stage)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(call, exc, fn)
        if out is None:
            return f"{call} returned None: return the number of bytes"
        got = _number(out)
        if got is None:
            shown = repr(out)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return (f"{call} returned {type(out).__name__} {shown}: return the number of bytes, "
                    "one number (an int or a float)")
        if not math.isfinite(got):
            return f"{call} = {got}: return a finite number of bytes"
        if abs(got - want) > 1e-6 * want:
            return (f"{call} = {got:,.0f} bytes, expected {want:,.0f}: "
                    f"{_diagnose(got, want, psi, n, stage, _stages(fn, psi, n))}")
    return None
