"""What a checkpoint is on disk (lesson 08): its folders and file names, ``meta.json``'s schema, where
the latest complete one is, and the one-line message for a save that could not be written.

:mod:`minitrain.checkpoint.core` saves and loads through these; :mod:`minitrain.checkpoint.checks` refuses
a bad ``--save-dir``/``--resume`` before any process starts; :mod:`minitrain.checkpoint.consolidate` reads a
checkpoint offline.  The layout on disk is described at the top of :mod:`minitrain.checkpoint.core`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
from pathlib import Path

from ..model import GPTConfig
from ..precision import PRECISIONS
from ..strategies import ConfigError, TrainConfig, strategy_names

__all__ = ["CheckpointError", "FORMAT", "VERSION", "META", "META_SCHEMA", "STEP_DIR",
           "UNFINISHED_DIR", "rank_file", "step_dir", "step_of", "find_checkpoint",
           "unfinished_saves", "meta_problem", "disk_full", "size_text", "save_failure"]

FORMAT, VERSION = "minitrain-checkpoint", 1
META = "meta.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
UNFINISHED_DIR = re.compile(r"^step-(\d+)\.tmp$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved, resumed or consolidated; the message names the fix."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def step_dir(save_dir, step: int) -> Path:
    return Path(save_dir) / f"step-{step:06d}"


# --------------------------------------------------------------------------------------------------
# Finding and verifying a checkpoint
# --------------------------------------------------------------------------------------------------


def find_checkpoint(where) -> Path:
    """The checkpoint directory ``where`` names: itself if it holds ``meta.json``, else its
    latest complete ``step-*`` directory (a save dir)."""
    path = Path(where)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist; pass the "
                              "--save-dir of an earlier run, or one of its step-* directories")
    if (path / META).is_file():
        return path
    steps = sorted((int(m.group(1)), p) for p in path.iterdir()
                   if p.is_dir() and (m := STEP_DIR.match(p.name)))
    done = [p for _, p in steps if (p / META).is_file()]
    if done:
        return done[-1]
    unfinished = unfinished_saves(path)
    if unfinished:
        shown = ", ".join(unfinished[:3]) + (" ..." if len(unfinished) > 3 else "")
        raise CheckpointError(f"no complete checkpoint in {path}: only unfinished saves ({shown}: the "
                              f"run stopped before {META}, written last, was there), and nothing "
                              "can be resumed from those; train from the start (--save-dir "
                              f"{path} --overwrite deletes them), or resume from another checkpoint")
    if STEP_DIR.match(path.name) or UNFINISHED_DIR.match(path.name) or any(path.glob("rank*.pt")):
        raise CheckpointError(f"{path} has no {META}: the save did not finish (the rank files are "
                              f"written first, {META} last); resume from an earlier checkpoint")
    raise CheckpointError(f"no checkpoint in {path}: neither {META} nor step-* directories; pass "
                          "the --save-dir of an earlier run, or one of its step-* directories")


def unfinished_saves(save_dir) -> list[str]:
    """The saves in ``save_dir`` that did not finish (``step-N.tmp``, or ``step-N`` without
    ``meta.json``), by step."""
    path = Path(save_dir)
    if not path.is_dir():
        return []
    found = []
    for p in path.iterdir():
        m = STEP_DIR.match(p.name) or UNFINISHED_DIR.match(p.name)
        if m and p.is_dir() and (p.name.endswith(".tmp") or not (p / META).is_file()):
            found.append((int(m.group(1)), p.name))
    return [name for _, name in sorted(found)]


def step_of(path: Path) -> int | None:
    """The step a ``step-N`` directory's name says (None for another name)."""
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------------
# meta.json's schema: what save_checkpoint writes, checked whole before use
# --------------------------------------------------------------------------------------------------

_INT, _STR, _DICT = "an integer", "a string", "an object"


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: _INT, float: "a number", str: _STR, list: "a list", dict: _DICT}.get(
        type(value), type(value).__name__)


def _model_fields() -> dict:
    """GPTConfig's fields and the JSON kinds each may hold."""
    kinds = {}
    for f in dataclasses.fields(GPTConfig):
        hint = str(f.type)
        if "bool" in hint:
            kinds[f.name] = ("a boolean",)
        elif "str" in hint:
            kinds[f.name] = (_STR,)
        elif "float" in hint:
            kinds[f.name] = ("a number", _INT) + (("null",) if "None" in hint else ())
        else:
            kinds[f.name] = (_INT,) + (("null",) if "None" in hint else ())
    return kinds


#: meta.json, as :func:`save_checkpoint` writes it: key -> (JSON kinds, required?).  Nested parts
#: ("layout", "layout.model", "files") are checked by :func:`meta_problem`, which also checks that
#: the parts agree (one rank file per rank of the layout, the step of the directory's name).
META_SCHEMA = {
    "format": ((_STR,), True),          # "minitrain-checkpoint"
    "version": ((_INT,), True),         # 1
    "step": ((_INT,), True),            # steps done, >= 1; the directory is step-<step>
    "layout": ((_DICT,), True),         # strategy, world_size, model, precision, options[, data]
    "config": ((_DICT,), True),         # the whole TrainConfig (its "options": an object)
    "files": ((_DICT,), True),          # rankNNNNN.pt -> {"rank", "bytes", "sha256"}, one per rank
    "torch": ((_STR,), False),          # the torch version that saved it
    "saved_at": ((_STR,), False),       # ISO 8601, UTC
}
LAYOUT_SCHEMA = {
    "strategy": ((_STR,), True), "world_size": ((_INT,), True), "model": ((_DICT,), True),
    "precision": ((_STR,), True), "options": ((_DICT,), True), "data": ((_DICT,), False),
}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _keys_problem(obj: dict, schema: dict, where: str) -> str | None:
    for key, (kinds, required) in schema.items():
        if key not in obj:
            if required:
                return f"{where}{key} is missing"
            continue
        if _kind(obj[key]) not in kinds:
            shown = "" if obj[key] is None else f" ({json.dumps(obj[key])[:40]})"
            return f"{where}{key} is {_kind(obj[key])}{shown}, not {kinds[0]}"
    extra = sorted(set(obj) - set(schema))
    if extra:
        return f"{where}{extra[0]} is not a key minitrain writes"
    return None


def meta_problem(meta: dict, path: Path | None = None) -> str | None:
    """What is wrong with ``meta`` (a parsed ``meta.json`` of directory ``path``), or None."""
    problem = _keys_problem(meta, META_SCHEMA, "")
    if problem:
        return problem
    step = meta["step"]
    if step < 1:
        return f"step is {step}; a checkpoint is saved after at least one step"
    named = step_of(path) if path is not None else None
    if named is not None and named != step:
        return f"step is {step} but the directory is {path.name}"
    layout = meta["layout"]
    problem = _keys_problem(layout, LAYOUT_SCHEMA, "layout.")
    if problem:
        return problem
    if layout["strategy"] not in strategy_names():
        return (f"layout.strategy {layout['strategy']!r} is not a strategy of this minitrain "
                f"({', '.join(strategy_names())})")
    world = layout["world_size"]
    if world < 1:
        return f"layout.world_size is {world}; a run has at least one rank"
    if layout["precision"] not in PRECISIONS:
        return f"layout.precision {layout['precision']!r} is not one of {', '.join(PRECISIONS)}"
    model_kinds = _model_fields()
    # the fields only a Llama-shaped target sets are optional: a GPT-2 shaped model (what the
    # course trains) may leave them out
    optional = set(GPTConfig.SHAPE_FIELDS)
    problem = _keys_problem(layout["model"], {k: (v, k not in optional)
                                              for k, v in model_kinds.items()}, "layout.model.")
    if problem:
        return problem
    try:
        GPTConfig(**layout["model"])
    except ValueError as exc:
        return f"layout.model is not a valid model ({exc})"
    data = layout.get("data")
    if data is not None:
        problem = _keys_problem(data, {"seed": ((_INT,), True), "batch_size": ((_INT,), True)},
                                "layout.data.")
        if problem:
            return problem
    if not isinstance(meta["config"].get("options", {}), dict):
        return f"config.options is {_kind(meta['config']['options'])}, not {_DICT}"
    if "options" not in meta["config"]:
        return "config.options is missing"
    files = meta["files"]
    expected = [rank_file(r) for r in range(world)] if world == len(files) else []
    if sorted(files) != expected:
        return (f"files lists {len(files)} rank file{'s' if len(files) != 1 else ''} "
                f"({', '.join(sorted(files)[:3])}{' ...' if len(files) > 3 else ''}) but "
                f"layout.world_size is {world} (one file per rank: "
                f"{', '.join(rank_file(r) for r in range(min(world, 3)))}{' ...' if world > 3 else ''})")
    for rank, name in enumerate(expected):
        entry = files[name]
        if not isinstance(entry, dict):
            return f"files.{name} is {_kind(entry)}, not {_DICT}"
        problem = _keys_problem(entry, {"rank": ((_INT,), True), "bytes": ((_INT,), True),
                                        "sha256": ((_STR,), True)}, f"files.{name}.")
        if problem:
            return problem
        if entry["rank"] != rank:
            return f"files.{name}.rank is {entry['rank']}, not {rank}"
        if entry["bytes"] < 0:
            return f"files.{name}.bytes is {entry['bytes']}"
        if not _SHA256.match(entry["sha256"]):
            return f"files.{name}.sha256 is not 64 hexadecimal digits"
    return None


# --------------------------------------------------------------------------------------------------
# A save that could not be written, in one line
# --------------------------------------------------------------------------------------------------


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def size_text(n: float) -> str:
    """``n`` bytes for people: 1.5 GiB, 3.2 MiB, 700 bytes."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} bytes"


def _kept(save_dir) -> str:
    """What a save dir still holds, for a failed save's message."""
    path = Path(save_dir)
    done = sorted(p.name for p in path.iterdir() if STEP_DIR.match(p.name) and (p / META).is_file()) \
        if path.is_dir() else []
    if not done:
        return "no complete checkpoint is kept (this was the run's first save)"
    return (f"the complete checkpoints are kept ({', '.join(done[-3:])}"
            f"{', ...' if len(done) > 3 else ''}: --resume {path} takes {done[-1]})")


def save_failure(exc: OSError, cfg: TrainConfig, step: int, what: str) -> str:
    """One line for a save that could not be written: the cause, the step lost, what was kept."""
    where = Path(cfg.save_dir)
    if disk_full(exc):
        cause = f"no space left on {where} (writing {what})"
        fix = "free space there, or choose another --save-dir"
    else:
        cause = f"cannot write {what} under {where} ({exc.strerror or exc})"
        fix = "fix that, or choose another --save-dir"
    return (f"{cause}: step {step} was not saved and its unfinished {step_dir(where, step).name}.tmp "
            f"was removed; {_kept(where)}; {fix}")
