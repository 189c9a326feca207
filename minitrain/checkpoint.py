"""Sharded checkpoints: each rank saves its own part, a run resumes to the same losses, and a
checkpoint consolidates into a plain single-process state_dict (lesson 08).

On disk, one directory per saved step under ``--save-dir DIR``::

    DIR/step-000005/rank00000.pt   one file per rank, written by that rank: {"format", "rank",
    DIR/step-000005/rank00001.pt   "step", "rng", "state"}; "state" is what the strategy's
    ...                            checkpointer saved on that rank (its shard, or a replica)
    DIR/step-000005/meta.json      written last, by rank 0: the step, the layout the state was cut
                                   for (strategy, world size, model, precision, the checkpointer's
                                   options), the whole config, and each rank file's size and SHA-256

A step is written as ``step-000005.tmp/`` and renamed when complete (``meta.json`` last), so a save
that did not finish is never taken for one; every file is written under a temporary name and renamed,
and a write that fails (a full disk: "no space left on DIR", with what was kept) leaves no temporary
behind.  ``meta.json`` is checked against its schema (:data:`META_SCHEMA`) before anything in it is
used: a hand-edited or damaged one is refused in one line.  A rank file that is missing, of another size than
``meta.json`` says, or whose SHA-256 differs, is refused naming the file; loading uses
``torch.load(..., weights_only=True)``: only tensors and plain containers.  The *data position* is
the step (a batch is a pure function of seed and step: :mod:`minitrain.data`); the RNG states are
saved per rank and restored.  :mod:`minitrain.checkpoint_checks` refuses, before any process starts,
a ``--save-dir`` or ``--resume`` that cannot work.

What goes into a rank's file is the strategy's ``checkpointer``'s business
(:class:`~minitrain.strategies.base.Checkpointer`: ``layout(cfg)``, ``save(strategy)``,
``load(strategy, read)``, ``consolidate(cfg, read)``, and ``portable_optimizer``/``load_portable``
where it reshards through the layout-free form of :mod:`minitrain.strategies.portable`).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import stat
from pathlib import Path

import torch
import torch.distributed as dist

from .model import GPTConfig
from .precision import PRECISIONS
from .strategies import (Checkpointer, ConfigError, Strategy, TrainConfig, get_strategy, portable,
                         strategy_names)

__all__ = ["CheckpointError", "META", "META_SCHEMA", "checkpoint_support", "find_checkpoint",
           "read_meta", "meta_problem", "check_files", "maybe_save", "save_checkpoint",
           "load_checkpoint", "RankFiles", "consolidate", "consolidate_to", "check_output",
           "portable_state", "unfinished_saves", "step_of"]

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


def checkpoint_support(cls: type[Strategy]) -> str | None:
    """None if strategy ``cls`` saves and resumes checkpoints (it has a checkpointer), else why not."""
    if isinstance(cls.checkpointer, Checkpointer):
        return None
    return f"strategy {cls.name!r} cannot save checkpoints: {cls.checkpointer}"


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


def read_meta(path: Path) -> dict:
    """``meta.json`` of checkpoint directory ``path``, checked for format and version, then
    against :data:`META_SCHEMA` (every key, type and bound) before anything in it is used."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / META} cannot be read ({exc}); the checkpoint is damaged: "
                              "resume from another one") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minitrain checkpoint ({META} has no "
                              f"format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {meta.get('version')}; this "
                              f"minitrain reads version {VERSION}")
    problem = meta_problem(meta, path)
    if problem:
        raise CheckpointError(f"{path / META} is not as minitrain wrote it: {problem}; undo the "
                              f"edit (minitrain writes {META}, with each rank file's size and "
                              "SHA-256), or use another checkpoint")
    return meta


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
    problem = _keys_problem(layout["model"], {k: (v, True) for k, v in model_kinds.items()},
                            "layout.model.")
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


def _verified(path: Path, meta: dict, rank: int, sha256: bool = True) -> Path:
    """Rank ``rank``'s file of checkpoint ``path``, there with the size and SHA-256 meta lists."""
    name, world = rank_file(rank), meta["layout"]["world_size"]
    file, listed = path / name, meta["files"].get(name)
    if listed is None or not file.is_file():
        raise CheckpointError(f"{path}: {name} is missing (the checkpoint has {world} rank "
                              "files); it cannot be resumed or consolidated without it — copy "
                              "it back, or use another checkpoint")
    if file.stat().st_size != listed["bytes"]:
        raise CheckpointError(f"{file} has {file.stat().st_size} bytes but {META} says "
                              f"{listed['bytes']}: the file is truncated or was replaced; "
                              "use another checkpoint")
    if sha256 and _sha256(file) != listed["sha256"]:
        raise CheckpointError(f"{file} is corrupt: its SHA-256 differs from {META}; use another "
                              "checkpoint")
    return file


def check_files(path: Path, meta: dict) -> None:
    """Every rank file ``meta.json`` lists is there, with the size it lists."""
    for rank in range(meta["layout"]["world_size"]):
        _verified(path, meta, rank, sha256=False)


# --------------------------------------------------------------------------------------------------
# Saving (every rank, together)
# --------------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _serialized(obj) -> bytes:
    """``torch.save(obj)``'s bytes (written by :func:`_write_file`: a full disk is an OSError
    there, not a C++ stream error inside torch's zip writer)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    """``data`` into ``path``, whole or not at all: written under a temporary name in the same
    directory, flushed to disk, then renamed over ``path``; the temporary is removed if anything
    fails (and the OSError raised)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(3).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _kept(save_dir) -> str:
    """What a save dir still holds, for a failed save's message."""
    path = Path(save_dir)
    done = sorted(p.name for p in path.iterdir() if STEP_DIR.match(p.name) and (p / META).is_file()) \
        if path.is_dir() else []
    if not done:
        return "no complete checkpoint is kept (this was the run's first save)"
    return (f"the complete checkpoints are kept ({', '.join(done[-3:])}"
            f"{', ...' if len(done) > 3 else ''}: --resume {path} takes {done[-1]})")


def _save_failure(exc: OSError, cfg: TrainConfig, step: int, what: str) -> str:
    """One line for a save that could not be written: the cause, the step lost, what was kept."""
    where = Path(cfg.save_dir)
    if _disk_full(exc):
        cause = f"no space left on {where} (writing {what})"
        fix = "free space there, or choose another --save-dir"
    else:
        cause = f"cannot write {what} under {where} ({exc.strerror or exc})"
        fix = "fix that, or choose another --save-dir"
    return (f"{cause}: step {step} was not saved and its unfinished {step_dir(where, step).name}.tmp "
            f"was removed; {_kept(where)}; {fix}")


def maybe_save(strategy: Strategy, step: int) -> None:
    """After step ``step`` (0-based), on every rank: save if ``cfg.save_every`` divides the steps
    done, and always after the last step."""
    cfg, done = strategy.cfg, step + 1
    if done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0):
        save_checkpoint(strategy, done)


def save_checkpoint(strategy: Strategy, steps_done: int) -> Path:
    """Every rank writes its file, then rank 0 writes ``meta.json`` (collectives; untraced).

    The ranks agree on the outcome: if any rank's file or ``meta.json`` cannot be written (a full
    disk), rank 0 removes the unfinished ``step-N.tmp`` and every rank raises the same
    :class:`CheckpointError` (what failed, and what was kept)."""
    cfg, comm = strategy.cfg, strategy.comm
    final = step_dir(cfg.save_dir, steps_done)
    path = final.with_name(final.name + ".tmp")  # the step appears, complete, by one rename
    root = comm.global_rank(0)
    status = [None]
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            status = [_save_failure(exc, cfg, steps_done, f"the directory {path.name}")]
    dist.broadcast_object_list(status, src=root, group=comm.group)
    if status[0]:
        raise CheckpointError(status[0])
    name = rank_file(comm.rank)
    payload = {"format": FORMAT, "rank": comm.rank, "step": steps_done, "rng": _rng_state(),
               "state": strategy.checkpointer.save(strategy)}
    data = _serialized(payload)
    try:
        _write_file(path / name, data)
        mine = (name, {"rank": comm.rank, "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    except OSError as exc:
        mine = (name, _save_failure(exc, cfg, steps_done, f"rank {comm.rank}'s file, "
                                                          f"{_size(len(data))}"))
    files = [None] * comm.size
    dist.all_gather_object(files, mine, group=comm.group)
    failed = next((entry for _, entry in files if isinstance(entry, str)), None)
    if comm.rank == 0:
        try:
            if failed:
                raise _Failed(failed)
            config = {**cfg.__dict__, "model": cfg.model.to_dict(),
                      "options": dataclasses.asdict(cfg.options)}
            meta = {"format": FORMAT, "version": VERSION, "step": steps_done,
                    "layout": portable.layout_of(cfg),
                    "config": json.loads(json.dumps(config, default=lambda v: getattr(v, "name", None)
                                                    or str(v))),
                    "files": dict(files), "torch": torch.__version__,
                    "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
            try:
                _write_file(path / META, json.dumps(meta, indent=1).encode())
            except OSError as exc:
                raise _Failed(_save_failure(exc, cfg, steps_done, META)) from None
            if final.exists():
                shutil.rmtree(final)
            os.replace(path, final)
        except _Failed as exc:
            shutil.rmtree(path, ignore_errors=True)  # frees the space the other ranks' files took
            status = [str(exc)]
    else:
        status = [None]
    dist.broadcast_object_list(status, src=root, group=comm.group)
    if status[0]:
        raise CheckpointError(status[0])
    strategy.saved_checkpoints.append(str(final))
    return final


class _Failed(Exception):
    """A save that rank 0 abandons (the message is every rank's CheckpointError)."""


# --------------------------------------------------------------------------------------------------
# Loading (every rank) and consolidating (one process)
# --------------------------------------------------------------------------------------------------


class RankFiles:
    """``read(r)``: rank r's saved state from checkpoint ``path``, verified against ``meta.json``
    (size and SHA-256) and loaded with ``weights_only=True`` on the CPU; each file read once."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self._cache: dict[int, dict] = {}

    def payload(self, rank: int) -> dict:
        if rank not in self._cache:
            self._cache[rank] = self._load(rank)
        return self._cache[rank]

    def __call__(self, rank: int) -> dict:
        return self.payload(rank)["state"]

    def _load(self, rank: int) -> dict:
        file = _verified(self.path, self.meta, rank)
        try:
            payload = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CheckpointError(f"{file} cannot be loaded ({type(exc).__name__}: {exc}); use "
                                  "another checkpoint") from None
        if payload.get("rank") != rank or payload.get("step") != self.meta["step"]:
            raise CheckpointError(f"{file} holds rank {payload.get('rank')} at step "
                                  f"{payload.get('step')}, not rank {rank} at step "
                                  f"{self.meta['step']}: files from different saves were mixed")
        return payload


def load_checkpoint(strategy: Strategy, where) -> int:
    """On every rank: restore ``strategy`` and the RNG from the checkpoint ``where`` names (its
    own layout, or another one resharded), set ``strategy.start_step`` and return it."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    saved, now = meta["layout"], portable.layout_of(strategy.cfg)
    problem = portable.mismatch(saved, now, path)
    if problem:
        raise CheckpointError(problem)
    read, rank = RankFiles(path, meta), strategy.comm.rank
    try:
        if portable.bridges(saved, now):
            portable.load_resharded(strategy, _saved_config(meta), read)
            strategy.resharded_from = portable.describe(saved)
            rank = rank if rank < saved["world_size"] else 0  # a new rank: rank 0's RNG
        else:
            strategy.checkpointer.load(strategy, read)
        _set_rng_state(read.payload(rank)["rng"])
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise _not_as_described(path, exc) from None
    for group in getattr(strategy.optimizer, "param_groups", []):
        group["lr"] = strategy.cfg.lr  # this run's --lr, not the saved one
    strategy.start_step = meta["step"]
    strategy.resumed_from = str(path)
    return meta["step"]


def _open(where) -> tuple[Path, TrainConfig, RankFiles]:
    """Checkpoint ``where`` for offline use: its path, the config it was saved under (as far as
    its layout goes) and its verified rank files."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    check_files(path, meta)
    return path, _saved_config(meta), RankFiles(path, meta)


def _saved_config(meta: dict) -> TrainConfig:
    layout = meta["layout"]
    return TrainConfig(strategy=layout["strategy"], world_size=layout["world_size"],
                       model=GPTConfig(**layout["model"]), precision=layout["precision"],
                       options=meta["config"].get("options", {}))


def _not_as_described(path: Path, exc: BaseException) -> CheckpointError:
    """A checkpoint whose rank files do not hold what its meta.json describes (e.g. a world size
    edited by hand: shards of the wrong shape)."""
    text = " ".join(str(exc).split())
    return CheckpointError(f"{path}: the rank files do not hold what {META} describes "
                           f"({type(exc).__name__}: {text[:200]}); was {META} edited? Use another "
                           "checkpoint")


def consolidate(where) -> dict:
    """The full model of checkpoint ``where`` as a plain single-process state_dict (the keys and
    shapes of ``GPT(cfg).state_dict()``): what the run's ``final_state()`` was at that step."""
    path, cfg, read = _open(where)
    why = checkpoint_support(get_strategy(cfg.strategy))
    if why:
        raise CheckpointError(f"cannot consolidate {path}: {why}")
    try:
        return get_strategy(cfg.strategy).checkpointer.consolidate(cfg, read)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise _not_as_described(path, exc) from None


def _inside_a_checkpoint(path: Path) -> Path | None:
    """The checkpoint directory (``meta.json``, or a ``step-N``/``step-N.tmp`` name) that ``path``
    would be written inside, or None."""
    for folder in path.parents:
        if (folder / META).exists() or STEP_DIR.match(folder.name) or UNFINISHED_DIR.match(folder.name):
            return folder
    return None


def check_output(out) -> Path:
    """Where :func:`consolidate_to` may write ``out`` (resolved), or a :class:`CheckpointError`:
    a path is needed; it may not lie inside a checkpoint (its files are the checkpoint); an
    existing ``out`` must be a regular file (never a directory, a device or a pipe)."""
    if out is None or not str(out).strip():
        raise CheckpointError("no output file given: name the .pt file to write, e.g. "
                              "minitrain consolidate ck full.pt")
    given = Path(out).expanduser()
    path = given.resolve()  # through symbolic links: where the bytes would really go
    inside = _inside_a_checkpoint(path)
    if inside is not None:
        raise CheckpointError(f"cannot write {given}: it is inside the checkpoint {inside}, whose "
                              "files are the checkpoint (writing there would damage it); write "
                              f"it outside, e.g. {inside.parent / 'full.pt'}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise CheckpointError(f"cannot write {given}: {exc.strerror or exc}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise CheckpointError(f"cannot write {given}: it is a directory; name a file in it, e.g. "
                              f"{given / 'full.pt'}")
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise CheckpointError(f"cannot write {given}: it is {kind}, not a regular file; name a "
                              "file to write")
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot write {given}: {given.parent} does not exist")
    return path


def consolidate_to(where, out) -> Path:
    """:func:`consolidate` and ``torch.save`` the state_dict to ``out``; returns its path.

    ``out`` is checked first (:func:`check_output`); it is written whole or not at all (no
    temporary left behind), and a full disk is said as such."""
    path = check_output(out)
    state = consolidate(where)
    data = _serialized(state)
    try:
        _write_file(path, data)
    except OSError as exc:
        if _disk_full(exc):
            raise CheckpointError(f"no space left on {path.parent}: the consolidated state_dict "
                                  f"needs {_size(len(data))}; nothing was written ({out} is as it "
                                  "was); free space there, or write it elsewhere") from None
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}") from None
    return Path(out)


def portable_state(where) -> tuple[dict, dict]:
    """(weights, optimizer state) of checkpoint ``where`` in the layout-free form any reshardable
    strategy loads (:mod:`minitrain.strategies.portable`), offline."""
    path, cfg, read = _open(where)
    if not portable.reshardable(get_strategy(cfg.strategy)):
        raise CheckpointError(f"{path} was saved by {cfg.strategy!r}, which does not reshard; "
                              f"resharding covers {', '.join(portable.reshardable_names())}")
    return portable.portable_form(cfg, read)
