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
that did not finish is never taken for one.  A rank file that is missing, of another size than
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
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .model import GPTConfig
from .strategies import Checkpointer, ConfigError, Strategy, TrainConfig, get_strategy, portable

__all__ = ["CheckpointError", "META", "checkpoint_support", "find_checkpoint",
           "read_meta", "check_files", "maybe_save", "save_checkpoint", "load_checkpoint",
           "RankFiles", "consolidate", "consolidate_to", "portable_state"]

FORMAT, VERSION = "minitrain-checkpoint", 1
META = "meta.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


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
    if steps:
        raise CheckpointError(f"no complete checkpoint in {path}: {', '.join(p.name for _, p in steps)}"
                              f" lack {META} (a save that did not finish writes it last); "
                              "resume from another checkpoint")
    if STEP_DIR.match(path.name) or any(path.glob("rank*.pt")):
        raise CheckpointError(f"{path} has no {META}: the save did not finish (the rank files are "
                              f"written first, {META} last); resume from an earlier checkpoint")
    raise CheckpointError(f"no checkpoint in {path}: neither {META} nor step-* directories; pass "
                          "the --save-dir of an earlier run, or one of its step-* directories")


def read_meta(path: Path) -> dict:
    """``meta.json`` of checkpoint directory ``path``, checked for format and version."""
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


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def maybe_save(strategy: Strategy, step: int) -> None:
    """After step ``step`` (0-based), on every rank: save if ``cfg.save_every`` divides the steps
    done, and always after the last step."""
    cfg, done = strategy.cfg, step + 1
    if done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0):
        save_checkpoint(strategy, done)


def save_checkpoint(strategy: Strategy, steps_done: int) -> Path:
    """Every rank writes its file, then rank 0 writes ``meta.json`` (a collective; untraced)."""
    cfg, comm = strategy.cfg, strategy.comm
    final = step_dir(cfg.save_dir, steps_done)
    path = final.with_name(final.name + ".tmp")  # the step appears, complete, by one rename
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier(group=comm.group)
    name = rank_file(comm.rank)
    payload = {"format": FORMAT, "rank": comm.rank, "step": steps_done, "rng": _rng_state(),
               "state": strategy.checkpointer.save(strategy)}
    _write_atomically(path / name, lambda tmp: torch.save(payload, tmp))
    mine = (name, {"rank": comm.rank, "bytes": (path / name).stat().st_size,
                   "sha256": _sha256(path / name)})
    files = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, files, dst=comm.global_rank(0), group=comm.group)
    if comm.rank == 0:
        config = {**cfg.__dict__, "model": cfg.model.to_dict(),
                  "options": dataclasses.asdict(cfg.options)}
        meta = {"format": FORMAT, "version": VERSION, "step": steps_done,
                "layout": portable.layout_of(cfg),
                "config": json.loads(json.dumps(config, default=lambda v: getattr(v, "name", None)
                                                or str(v))),
                "files": dict(files), "torch": torch.__version__,
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        _write_atomically(path / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
        if final.exists():
            shutil.rmtree(final)
        os.replace(path, final)
    dist.barrier(group=comm.group)
    strategy.saved_checkpoints.append(str(final))
    return final


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
    if portable.bridges(saved, now):
        portable.load_resharded(strategy, _saved_config(meta), read)
        strategy.resharded_from = portable.describe(saved)
        rank = rank if rank < saved["world_size"] else 0  # a new rank: rank 0's RNG
    else:
        strategy.checkpointer.load(strategy, read)
    _set_rng_state(read.payload(rank)["rng"])
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


def consolidate(where) -> dict:
    """The full model of checkpoint ``where`` as a plain single-process state_dict (the keys and
    shapes of ``GPT(cfg).state_dict()``): what the run's ``final_state()`` was at that step."""
    path, cfg, read = _open(where)
    why = checkpoint_support(get_strategy(cfg.strategy))
    if why:
        raise CheckpointError(f"cannot consolidate {path}: {why}")
    return get_strategy(cfg.strategy).checkpointer.consolidate(cfg, read)


def consolidate_to(where, out) -> Path:
    """:func:`consolidate` and ``torch.save`` the state_dict to ``out``; returns its path."""
    state = consolidate(where)
    out = Path(out)
    if out.parent and not out.parent.exists():
        raise CheckpointError(f"cannot write {out}: {out.parent} does not exist")
    _write_atomically(out, lambda tmp: torch.save(state, tmp))
    return out


def portable_state(where) -> tuple[dict, dict]:
    """(weights, optimizer state) of checkpoint ``where`` in the layout-free form any reshardable
    strategy loads (:mod:`minitrain.strategies.portable`), offline."""
    path, cfg, read = _open(where)
    if not portable.reshardable(get_strategy(cfg.strategy)):
        raise CheckpointError(f"{path} was saved by {cfg.strategy!r}, which does not reshard; "
                              f"resharding covers {', '.join(portable.reshardable_names())}")
    return portable.portable_form(cfg, read)
