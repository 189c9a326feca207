"""What ``--save-dir``, ``--save-every``, ``--resume`` and ``--overwrite`` must satisfy, refused
before any process starts, naming the fix, so that a checkpoint is never lost nor mixed with another
run's (lesson 08): the save dir is probed for writability and may not hold another run's steps
(unless this run resumes from it, or ``--overwrite`` deletes them); the checkpoint resumed must
exist, be complete (unfinished saves are skipped, and said so), match the run's layout (or be
resharded: :mod:`minitrain.strategies.portable`), model, precision and data stream, and lie before
``--steps``.  The files themselves: :mod:`minitrain.checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .checkpoint import (META, STEP_DIR, CheckpointError, check_files, checkpoint_support,
                         find_checkpoint, read_meta)
from .strategies import TrainConfig, get_strategy, portable

__all__ = ["check_checkpoint_config", "clear_save_dir", "skipped_saves"]


def check_checkpoint_config(cfg: TrainConfig) -> dict | None:
    """Refuse ``--save-dir``/``--save-every``/``--resume`` that cannot work, before any process
    starts.  Returns the resumed checkpoint's metadata (None without ``--resume``)."""
    if cfg.save_every is not None and cfg.save_every < 1:
        raise CheckpointError(f"--save-every must be at least 1, got {cfg.save_every}")
    if cfg.save_every is not None and not cfg.save_dir:
        raise CheckpointError("--save-every needs --save-dir DIR: where to write the checkpoints")
    if not (cfg.save_dir or cfg.resume):
        return None
    why = checkpoint_support(get_strategy(cfg.strategy))
    if why:
        raise CheckpointError(f"{'--resume' if cfg.resume else '--save-dir'}: {why}")
    if cfg.save_dir:
        _check_save_dir(cfg)
    if not cfg.resume:
        return None
    path = find_checkpoint(cfg.resume)
    for name in skipped_saves(cfg.resume, path):
        print(f"minitrain: {Path(cfg.resume) / name} did not finish saving (no {META}); resuming "
              f"from {path.name}", file=sys.stderr, flush=True)
    meta = read_meta(path)
    saved, now = meta["layout"], portable.layout_of(cfg)
    problem = portable.mismatch(saved, now, path)
    if problem:
        raise CheckpointError(problem)
    if portable.bridges(saved, now):
        print(f"minitrain: resharding {path} ({portable.describe(saved)}) for {portable.describe(now)}",
              file=sys.stderr, flush=True)
    if meta["step"] >= cfg.steps:
        raise CheckpointError(f"{path} is at step {meta['step']}, and --steps {cfg.steps} is already "
                              f"reached (--steps counts from the start); use --steps "
                              f"{meta['step'] + cfg.steps} to train {cfg.steps} more")
    check_files(path, meta)
    return {**meta, "path": str(path)}


def _previous_saves(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if STEP_DIR.match(p.name.removesuffix(".tmp"))) \
        if save_dir.is_dir() else []


def _check_save_dir(cfg: TrainConfig) -> None:
    """``--save-dir`` must be writable (probed now, not after training) and hold no other run's
    checkpoints, unless this run resumes from it or ``--overwrite`` is given."""
    where = existing = Path(cfg.save_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(f"--save-dir {where}: {existing} is a file, not a directory; choose a "
                              "path in a directory")
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".minitrain-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"--save-dir {where} cannot be written ({exc.strerror or exc}); "
                              "choose a writable directory") from None
    old = _previous_saves(where)
    if old and not (_resuming_here(cfg) or cfg.overwrite):
        shown = ", ".join(old[:3]) + (" ..." if len(old) > 3 else "")
        raise CheckpointError(f"--save-dir {where} already holds checkpoints ({shown}) of an earlier "
                              f"run; resume it (--resume {where}), pass --overwrite to delete them, "
                              "or choose an empty directory")


def _resuming_here(cfg: TrainConfig) -> bool:
    here = Path(cfg.save_dir).resolve()
    return bool(cfg.resume) and here in (Path(cfg.resume).resolve(), Path(cfg.resume).resolve().parent)


def clear_save_dir(cfg: TrainConfig) -> None:
    """With ``--overwrite`` (and not resuming from it): delete the earlier run's steps (rank 0)."""
    where = Path(cfg.save_dir)
    if cfg.overwrite and not _resuming_here(cfg):
        for name in _previous_saves(where):
            shutil.rmtree(where / name, ignore_errors=True)


def skipped_saves(where, chosen: Path) -> list[str]:
    """Saves in the save dir ``where``, from the step ``chosen`` on, that did not finish."""
    path, step = Path(where), int(STEP_DIR.match(chosen.name).group(1))
    if (path / META).is_file():
        return []
    return [p.name for p in sorted(path.iterdir())
            if (m := STEP_DIR.match(p.name.removesuffix(".tmp"))) and p.is_dir() and p != chosen
            and (p.name.endswith(".tmp") or not (p / META).is_file()) and int(m.group(1)) >= step]
