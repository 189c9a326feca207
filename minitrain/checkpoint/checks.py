"""What ``--save-dir``, ``--save-every``, ``--resume`` and ``--overwrite`` must satisfy, refused
before any process starts, naming the fix, so that a checkpoint is never lost nor mixed with another
run's (lesson 08):

* **one run per save dir at a time**: a run holds ``DIR/.minitrain-lock`` (``flock``) from its
  checks to its end (:class:`SaveDirLock`); a second run on the same directory is refused, naming
  the first.  The kernel releases the lock when the holder dies (even by SIGKILL), so a crashed run
  never leaves the directory stuck.
* the save dir is probed for writability and may not hold another run's steps (unless this run
  resumes from it, or ``--overwrite`` deletes them); a dir holding only unfinished saves says so.
* **one lineage per save dir**: resuming from a step older than the save dir's latest, into the same
  directory, is refused — its later steps belong to the run that went on from there, and ``--resume
  DIR`` would find them, not this run's.  ``--overwrite`` deletes the steps after the one resumed
  (that lineage is given up); or save into another directory.
* the checkpoint resumed must exist, be complete (unfinished saves are skipped, and said so), match
  the run's layout (or be resharded: :mod:`minitrain.strategies.portable`), model, precision and data
  stream, and lie before ``--steps``.

The files themselves: :mod:`minitrain.checkpoint.core`.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from .core import check_files, checkpoint_support, read_meta
from .format import (META, STEP_DIR, CheckpointError, find_checkpoint, size_text,
                                step_of, unfinished_saves)
from ..runtime.rankfolder import HELD_LOCK_FDS  # a forked rank closes its copy of the lock
from ..strategies import TrainConfig, get_strategy, portable
from ..strategies.fit import SAVED_BYTES

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one run per save dir is then the user's to keep)
    fcntl = None

__all__ = ["check_checkpoint_config", "clear_save_dir", "skipped_saves", "SaveDirLock", "LOCK",
           "later_steps"]

#: the lock file a run holds in its --save-dir (removed when it ends; a crashed run's stays, free)
LOCK = ".minitrain-lock"


class SaveDirLock:
    """One run per ``--save-dir`` at a time: ``flock`` on ``DIR/.minitrain-lock``, taken by
    :meth:`acquire` (refused, naming the holder, if another run has it) and held until
    :meth:`release` (``with SaveDirLock() as lock: ...``), which removes the file.  The kernel
    drops the lock when the holding process dies, however it dies (the file then stays, free)."""

    def __init__(self):
        self.fd: int | None = None
        self.path: Path | None = None

    def acquire(self, save_dir) -> None:
        if fcntl is None or self.fd is not None:
            return
        path = Path(save_dir) / LOCK
        fd = _try_lock(path)
        self.fd, self.path = fd, path
        HELD_LOCK_FDS.add(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": datetime.datetime.now().isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)[:300]}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError:
            pass  # who holds it is only for the message

    def release(self) -> None:
        if self.fd is not None:
            HELD_LOCK_FDS.discard(self.fd)
            _unlock(self.fd, self.path)
        self.fd = self.path = None

    def __enter__(self) -> "SaveDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlock(fd: int, path: Path) -> None:
    """Remove the lock file (while still holding it: a run that opened it meanwhile sees it gone
    and opens the next one), then let the lock go."""
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _try_lock(path: Path) -> int:
    """A descriptor of ``path`` holding its flock, or the refusal naming the run that holds it."""
    for _ in range(100):  # (only a run that removes the file as we open it makes us go round)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise CheckpointError(f"--save-dir {path.parent}: its lock file {LOCK} cannot be "
                                  f"opened ({exc.strerror or exc}); remove {path}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except (OSError, ValueError):
                holder = {}
            os.close(fd)
            who = (f" (pid {holder.get('pid')} on {holder.get('host')}, since "
                   f"{holder.get('since')}: {holder.get('command')})" if holder.get("pid") else "")
            raise CheckpointError(f"--save-dir {path.parent} is in use by another run{who}; one "
                                  "run saves into a directory at a time: wait for that run to end, "
                                  "or choose another --save-dir") from None
        except OSError:  # a file system without locks: nothing to hold
            return fd
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the file we locked was removed by the run that let it go: again
    raise CheckpointError(f"--save-dir {path.parent}: its lock file {LOCK} keeps changing; is "
                          "another run starting there?")


def _probe_lock(save_dir) -> None:
    """Refuse now if another run holds ``save_dir`` (without holding it)."""
    if fcntl is None:
        return
    path = Path(save_dir) / LOCK
    if not path.exists():
        return
    _unlock(_try_lock(path), path)


def check_checkpoint_config(cfg: TrainConfig, lock: SaveDirLock | bool | None = None) -> dict | None:
    """Refuse ``--save-dir``/``--save-every``/``--resume`` that cannot work, before any process
    starts.  Returns the resumed checkpoint's metadata (None without ``--resume``).

    ``lock``: a :class:`SaveDirLock` takes the save dir for this run (held until it is released),
    before the save dir's contents are checked; None only checks that no other run holds it; False
    skips that (a torchrun rank other than 0, whose rank 0 holds it)."""
    for name in ("save_dir", "resume"):
        value = getattr(cfg, name)
        if value is not None and not str(value).strip():
            raise CheckpointError(f"--{name.replace('_', '-')} is empty: give a directory (or leave "
                                  f"--{name.replace('_', '-')} out)")
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
        _check_save_dir(cfg, lock)
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


def _check_save_dir(cfg: TrainConfig, lock: SaveDirLock | bool | None = None) -> None:
    """``--save-dir`` must be writable (probed now, not after training), used by no other run
    (``lock``: see :func:`check_checkpoint_config`) and hold no other run's checkpoints, unless
    this run resumes from it (and then from its latest step) or ``--overwrite`` is given."""
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
    if isinstance(lock, SaveDirLock):
        lock.acquire(where)
    elif lock is None:
        _probe_lock(where)
    old = _previous_saves(where)
    if old and not (_resuming_here(cfg) or cfg.overwrite):
        unfinished = unfinished_saves(where)
        if len(unfinished) == len(old):  # nothing complete: nothing to resume
            shown = ", ".join(old[:3]) + (" ..." if len(old) > 3 else "")
            raise CheckpointError(f"--save-dir {where} holds only unfinished saves ({shown}) of an "
                                  "earlier run that stopped before any checkpoint was complete; "
                                  "nothing can be resumed from them: pass --overwrite to delete "
                                  "them, or choose an empty directory")
        shown = ", ".join(old[:3]) + (" ..." if len(old) > 3 else "")
        raise CheckpointError(f"--save-dir {where} already holds checkpoints ({shown}) of an earlier "
                              f"run; resume it (--resume {where}), pass --overwrite to delete them, "
                              "or choose an empty directory")
    if _resuming_here(cfg) and not cfg.overwrite:
        later = later_steps(cfg, complete_only=True)
        if later:
            resumed = find_checkpoint(cfg.resume)
            shown = ", ".join(later[:3]) + (" ..." if len(later) > 3 else "")
            raise CheckpointError(
                f"--resume {resumed} is older than the latest checkpoint in --save-dir {where} "
                f"({later[-1]}): this run would save a second history into it, and --resume "
                f"{where} would then find the other one's {later[-1]}; pass --overwrite to delete "
                f"the steps after {resumed.name} ({shown}), or save into another --save-dir")
    _check_space(cfg, where)


def _check_space(cfg: TrainConfig, where: Path) -> None:
    """The checkpoints the run will keep must fit the free space of the save dir's file system:
    each at least :data:`~minitrain.strategies.fit.SAVED_BYTES` per parameter (the weight and
    Adam's two moments, in fp32)."""
    try:
        st = os.statvfs(where)
    except (OSError, AttributeError):
        return
    free = st.f_bavail * st.f_frsize
    if cfg.overwrite:  # what --overwrite deletes is free for this run
        doomed = later_steps(cfg) if _resuming_here(cfg) else _previous_saves(where)
        free += sum(f.stat().st_size for name in doomed for f in (where / name).rglob("*")
                    if f.is_file())
    start = 0
    if cfg.resume:
        try:
            start = read_meta(find_checkpoint(cfg.resume))["step"]
        except CheckpointError:
            pass  # (refused in its own words below)
    steps = max(0, cfg.steps - start)
    every = cfg.save_every or steps or 1
    saves = steps // every + (1 if steps % every else 0)
    each = cfg.model.num_params() * SAVED_BYTES
    if saves * each > free:
        most = max(1, free // max(1, each))
        fix = (f"save less often (--save-every {-(-steps // most)} keeps {most}), " if most < saves and
               cfg.save_every else "")
        raise CheckpointError(f"--save-dir {where}: the run keeps {saves} checkpoint"
                              f"{'s' if saves != 1 else ''} of at least {size_text(each)} each "
                              f"({SAVED_BYTES} bytes per parameter: weight and Adam's two moments), "
                              f"{size_text(saves * each)} in all, but {where} has {size_text(free)} free; "
                              f"{fix}free space, or choose another --save-dir")


def later_steps(cfg: TrainConfig, complete_only: bool = False) -> list[str]:
    """The save dir's steps after the one this run resumes from, when it resumes from its own save
    dir (another lineage, deleted by ``--overwrite``), by step; ``complete_only``: those with
    ``meta.json`` (the ones ``--resume DIR`` would find)."""
    if not (cfg.save_dir and _resuming_here(cfg)):
        return []
    try:
        resumed = step_of(find_checkpoint(cfg.resume))
    except CheckpointError:
        return []  # (refused in its own words by check_checkpoint_config)
    if resumed is None:
        return []
    where, found = Path(cfg.save_dir), []
    for name in _previous_saves(where):
        step = int(name.removesuffix(".tmp").split("-")[1])
        complete = not name.endswith(".tmp") and (where / name / META).is_file()
        if step > resumed and (complete or not complete_only):
            found.append((step, name))
    return [name for _, name in sorted(found)]


def _resuming_here(cfg: TrainConfig) -> bool:
    here = Path(cfg.save_dir).resolve()
    return bool(cfg.resume) and here in (Path(cfg.resume).resolve(), Path(cfg.resume).resolve().parent)


def clear_save_dir(cfg: TrainConfig) -> None:
    """With ``--overwrite`` (rank 0): delete the earlier run's steps — or, resuming from the save
    dir itself, the steps after the one resumed (the lineage this run replaces)."""
    where = Path(cfg.save_dir)
    if not cfg.overwrite:
        return
    doomed = later_steps(cfg) if _resuming_here(cfg) else _previous_saves(where)
    for name in doomed:
        shutil.rmtree(where / name, ignore_errors=True)


def skipped_saves(where, chosen: Path) -> list[str]:
    """Saves in the save dir ``where``, from the step ``chosen`` on, that did not finish."""
    path, step = Path(where), int(STEP_DIR.match(chosen.name).group(1))
    if (path / META).is_file():
        return []
    return [p.name for p in sorted(path.iterdir())
            if (m := STEP_DIR.match(p.name.removesuffix(".tmp"))) and p.is_dir() and p != chosen
            and (p.name.endswith(".tmp") or not (p / META).is_file()) and int(m.group(1)) >= step]
