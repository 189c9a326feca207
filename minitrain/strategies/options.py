"""A strategy's typed options, and the words every refusal shares.

An :class:`Options` record holds a strategy's own settings: one field per ``--flag``, each made with
:func:`option` (default, help, check, choices).  A configuration that cannot run is refused with a
:class:`ConfigError` naming the fix: the flag (:func:`flag`), a mistyped name's closest choice
(:func:`did_you_mean`), a technique's refusal in the CLI's words (:func:`in_cli_words`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field, fields

from ..parallel.errors import ParameterError

__all__ = ["ConfigError", "closest", "did_you_mean", "positive", "at_least", "option", "flag",
           "CLI_FORMS", "in_cli_words", "Options", "NoOptions", "Replicas", "option_fields"]


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process starts, with the fix in it."""


def closest(given, choices) -> str | None:
    """The choice a mistyped ``given`` most likely meant (``difflib``; else the same word in another
    case, or the one choice it begins), or None."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(given), choices, n=1, cutoff=0.6)
    if not close:  # "ZERO3", "pipe"
        low = str(given).lower()
        close = [c for c in choices if c.lower() == low] or \
                ([c for c in choices if c.lower().startswith(low)] if len(low) >= 2 else [])
    return close[0] if close else None


def did_you_mean(given, choices) -> str:
    """``" (did you mean 'zero3'?)"`` for a mistyped ``given``, else ``""``."""
    close = closest(given, choices)
    return f" (did you mean {close!r}?)" if close else ""


# --------------------------------------------------------------------------------------------------
# Typed options
# --------------------------------------------------------------------------------------------------


def positive(value) -> str | None:
    """A check for :func:`option`: None (unset) or a positive finite number."""
    if value is None or (math.isfinite(value) and value > 0):
        return None
    return "must be a positive number"


def at_least(low: int):
    """A check for :func:`option`: None (unset) or an integer >= ``low``."""
    def check(value) -> str | None:
        return None if value is None or value >= low else f"must be at least {low}"
    return check


def option(default, help: str, *, check=None, choices=None, metavar: str | None = None):
    """One field of an :class:`Options` record: its default, its ``--help`` text, and optionally a
    ``check(value) -> problem or None`` and the allowed ``choices``."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices,
                                            "metavar": metavar})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: how the CLI says a technique's parameter where it is not simply its flag: ``{name: form}``,
#: ``form`` with ``{}`` for the value
CLI_FORMS = {"batch": "--batch-size {}"}


def in_cli_words(refusal: ParameterError, forms: dict | None = None) -> ConfigError:
    """A technique's refusal (a :class:`~minitrain.parallel.errors.ParameterError`) in the CLI's
    words, from its fields: each parameter it mentions as its flag and value (``--chunks 1``), or as
    :data:`CLI_FORMS` and ``forms`` word it (3d says ``stages`` as ``{"stages": "--pp {}"}``)."""
    forms = {**CLI_FORMS, **(forms or {})}
    return ConfigError(refusal.worded(
        lambda name, shown: forms.get(name, flag(name) + " {}").format(shown)))


@dataclass(frozen=True)
class Options:
    """Base of a strategy's typed options.  Combine shared fields by inheritance, so each is
    defined once (``class Zero2Options(Buckets, Offload)``)."""

    def validate(self) -> None:
        """Each field's own check and choices; a :class:`ConfigError` naming the flag."""
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ConfigError(f"{flag(f.name)} must be one of {', '.join(map(str, choices))}, "
                                  f"got {value!r}{did_you_mean(value, choices)}")
            check = f.metadata.get("check")
            problem = check(value) if check is not None else None
            if problem:
                raise ConfigError(f"{flag(f.name)} {problem}, got {value!r}")

    def given(self) -> dict:
        """The fields that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class NoOptions(Options):
    """A strategy without options of its own."""


@dataclass(frozen=True)
class Replicas(Options):
    """The data-parallel axis beside a model-parallel one (3d, context)."""

    dp: int | None = option(None, "data-parallel replicas beside the other axes (default: the "
                            "world size divided by the other axes)", check=at_least(1))


def option_fields(cls: type[Options]) -> list[tuple[dataclasses.Field, type]]:
    """``(field, its resolved type)`` for every field of an options record (for the CLI)."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]
