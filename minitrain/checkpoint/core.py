"""Sharded checkpoints: each rank saves its own part and a run resumes to the same losses (lesson 08);
resuming on another layout goes through :mod:`minitrain.strategies.portable`.

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
behind.  ``meta.json`` is checked against its schema (:mod:`minitrain.checkpoint.format`) before anything in it is
used: a hand-edited or damaged one is refused in one line.  A rank file that is missing, of another size than
``meta.json`` says, or whose SHA-256 differs, is refused naming the file; loading uses
``torch.load(..., weights_only=True)``: only tensors and plain containers.  The *data position* is
the step (a batch is a pure function of seed and step: :mod:`minitrain.data`); the RNG states are
saved per rank and restored.  :mod:`minitrain.checkpoint.checks` refuses, before any process starts,
a ``--save-dir`` or ``--resume`` that cannot work; :mod:`minitrain.checkpoint.consolidate` reads a checkpoint
offline (one plain state_dict, or the layout-free form).

What goes into a rank's file is the strategy's ``checkpointer``'s business
(:class:`~minitrain.strategies.base.Checkpointer`: ``layout(cfg)``, ``save(strategy)``,
``load(strategy, read)``, ``consolidate(cfg, read)``, and ``portable_optimizer``/``load_portable``
where it reshards through the layout-free form of :mod:`minitrain.strategies.portable`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .format import (FORMAT, META, VERSION, CheckpointError, find_checkpoint,
                                meta_problem, rank_file, save_failure, size_text, step_dir)
from ..model import GPTConfig
from ..strategies import Checkpointer, Strategy, TrainConfig, portable

__all__ = ["CheckpointError", "checkpoint_support", "find_checkpoint", "read_meta", "check_files",
           "maybe_save", "save_checkpoint", "load_checkpoint", "RankFiles", "saved_config"]

def checkpoint_support(cls: type[Strategy]) -> str | None:
    """None if strategy ``cls`` saves and resumes checkpoints (it has a checkpointer), else why not."""
    if isinstance(cls.checkpointer, Checkpointer):
        return None
    return f"strategy {cls.name!r} cannot save checkpoints: {cls.checkpointer}"


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


def serialized(obj) -> bytes:
    """``torch.save(obj)``'s bytes (written by :func:`write_whole`: a full disk is an OSError
    there, not a C++ stream error inside torch's zip writer)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_whole(path: Path, data: bytes) -> None:
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
            status = [save_failure(exc, cfg, steps_done, f"the directory {path.name}")]
    dist.broadcast_object_list(status, src=root, group=comm.group)
    if status[0]:
        raise CheckpointError(status[0])
    name = rank_file(comm.rank)
    payload = {"format": FORMAT, "rank": comm.rank, "step": steps_done, "rng": _rng_state(),
               "state": strategy.checkpointer.save(strategy)}
    data = serialized(payload)
    try:
        write_whole(path / name, data)
        mine = (name, {"rank": comm.rank, "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    except OSError as exc:
        mine = (name, save_failure(exc, cfg, steps_done, f"rank {comm.rank}'s file, "
                                                          f"{size_text(len(data))}"))
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
                write_whole(path / META, json.dumps(meta, indent=1).encode())
            except OSError as exc:
                raise _Failed(save_failure(exc, cfg, steps_done, META)) from None
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
# Loading (every rank)
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
            portable.load_resharded(strategy, saved_config(meta), read)
            strategy.resharded_from = portable.describe(saved)
            rank = rank if rank < saved["world_size"] else 0  # a new rank: rank 0's RNG
        else:
            strategy.checkpointer.load(strategy, read)
        _set_rng_state(read.payload(rank)["rng"])
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise not_as_described(path, exc) from None
    for group in getattr(strategy.optimizer, "param_groups", []):
        group["lr"] = strategy.cfg.lr  # this run's --lr, not the saved one
    strategy.start_step = meta["step"]
    strategy.resumed_from = str(path)
    return meta["step"]


def saved_config(meta: dict) -> TrainConfig:
    layout = meta["layout"]
    return TrainConfig(strategy=layout["strategy"], world_size=layout["world_size"],
                       model=GPTConfig(**layout["model"]), precision=layout["precision"],
                       options=meta["config"].get("options", {}))


def not_as_described(path: Path, exc: BaseException) -> CheckpointError:
    """A checkpoint whose rank files do not hold what its meta.json describes (e.g. a world size
    edited by hand: shards of the wrong shape)."""
    text = " ".join(str(exc).split())
    return CheckpointError(f"{path}: the rank files do not hold what {META} describes "
                           f"({type(exc).__name__}: {text[:200]}); was {META} edited? Use another "
                           "checkpoint")
