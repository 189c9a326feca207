"""Sharded checkpoints: each rank saves its own part, a run resumes to the same losses, and a
checkpoint consolidates into a plain single-process state_dict (lesson 08).

On disk, one directory per saved step under ``--save-dir DIR``::

    DIR/step-000005/rank00000.pt   one file per rank, written by that rank: {"format", "rank",
    DIR/step-000005/rank00001.pt   "step", "rng", "state"}; "state" is what the rank's strategy
    ...                            returned from checkpoint_state() (its shard, or a replica)
    DIR/step-000005/meta.json      written last, by rank 0: the step, the layout the state was cut
                                   for (strategy, world size, model, precision, the strategy's own
                                   options), the whole config, and each rank file's size and SHA-256

A step is written as ``step-000005.tmp/`` and renamed when complete (``meta.json`` last), so a save
that did not finish is never taken for one: resuming from a save dir takes its latest complete step
and says which unfinished ones it skipped.  A directory without ``meta.json`` is refused; a rank file that is
missing, shorter or longer than ``meta.json`` says, or whose SHA-256 differs, is refused naming the
file.  Loading uses ``torch.load(..., weights_only=True)``: only tensors and plain containers.

The *data position* is the step: a batch is a pure function of (seed, step) (:mod:`minitrain.data`),
so a run resumed at step k reads exactly the batches the uninterrupted run read from step k on.
The RNG states (torch, CUDA, Python's ``random``) are saved per rank and restored, although the
course's training draws no random numbers.

A save dir that holds another run's steps is refused (unless this run resumes from it, or
``--overwrite`` deletes them); the seed and the global batch (the data stream) are compared on
resume like the layout.

What a strategy implements (``minitrain/strategies/base.py``; defaults there are for ranks that hold
identical replicas, as single and ddp do):

* ``checkpoint_refusal = None`` on the registered class itself (not inherited) — else ``check``
  refuses ``--save-dir``/``--resume`` with the reason;
* ``checkpoint_layout(cfg)`` — the options that decide how the state is cut (compared on resume);
* ``checkpoint_state()`` — this rank's part: tensors and plain containers;
* ``load_checkpoint_state(read)`` — restore it; ``read(r)`` is rank r's saved part (verified);
* ``consolidate_checkpoint(cfg, read)`` — the full single-process state_dict, offline;
* for resharding, ``reshardable = True`` on the registered class itself, and
  ``consolidate_optimizer(cfg, read)`` (the portable optimizer state, offline) and
  ``load_portable_state(weights, optim)`` (this rank's cut of it).

Resharding: a checkpoint is not stranded by its layout.  When the saved layout differs from the run's
only in the strategy, the world size or the strategy's options (ZeRO offload, buckets), and both
strategies reshard (``single``, ``ddp-naive``, ``ddp``, ``zero1``-``zero3``), every rank reads every
saved part, turns it into the layout-free *portable* form (:mod:`minitrain.strategies.portable`:
the weights as a single-process state_dict, Adam's ``exp_avg``/``exp_avg_sq``/``step`` — and the
fp32 masters under mixed precision — per parameter name) and takes its own cut of it: a replica
loads it whole, a ZeRO rank its flat shard of each unit and the same slice of each moment (zero in
the padding), as ``torch.distributed.checkpoint`` reshards for PyTorch users.  The step is the data
position, so the loss stream goes on: zero3 on 4 ranks resumed as zero1 on 3 gives the uninterrupted
zero1 run's losses (fp32: within float rounding of the different reductions before the save).  A
rank the saved run did not have takes rank 0's RNG state.  The model, the precision and the data
stream (seed, global batch) must still match; ``pipeline``, ``tensor`` and ``3d`` checkpoints resume
only on their own layout (refused with the fix: resume with the saved layout, or consolidate and
start a new run from the weights).  :func:`portable_state` gives the portable form offline.
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
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .model import GPTConfig
from .strategies import ConfigError, Strategy, TrainConfig, get_strategy, strategy_names

__all__ = ["CheckpointError", "META", "checkpoint_support", "find_checkpoint", "read_meta",
           "check_checkpoint_config", "maybe_save", "save_checkpoint", "load_checkpoint",
           "RankFiles", "consolidate", "consolidate_to", "reshardable", "portable_state"]

FORMAT, VERSION = "minitrain-checkpoint", 1
META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model", "seq_len": "--seq-len"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved, resumed or consolidated; the message names the fix."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def step_dir(save_dir, step: int) -> Path:
    return Path(save_dir) / f"step-{step:06d}"


# --------------------------------------------------------------------------------------------------
# What a run's checkpoint must agree on
# --------------------------------------------------------------------------------------------------


def checkpoint_support(cls: type[Strategy]) -> str | None:
    """None if strategy ``cls`` saves and resumes checkpoints, else why not.  Only the registered
    class's *own* ``checkpoint_refusal = None`` counts: a subclass whose state lies differently
    (``tensor`` is a ``single`` on a shard) must implement the methods and declare it again."""
    if "checkpoint_refusal" in cls.__dict__:
        return cls.__dict__["checkpoint_refusal"]
    inherited = getattr(cls, "checkpoint_refusal", None)
    return inherited or (f"strategy {cls.name!r} does not implement checkpoints yet (it needs "
                         "checkpoint_state, load_checkpoint_state and consolidate_checkpoint, and "
                         "checkpoint_refusal = None on its class)")


def _options(options) -> dict:
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options)


def _json(value):
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "name", None) or str(v)))


def layout_of(cfg: TrainConfig) -> dict:
    """What decides how the state is cut: a checkpoint resumes only under the same."""
    cls = get_strategy(cfg.strategy)
    return _json({"strategy": cfg.strategy, "world_size": cfg.world_size,
                  "model": cfg.model.to_dict(), "precision": cfg.precision,
                  "options": cls.checkpoint_layout(cfg),
                  # the data stream: batch k is a function of (seed, k, global batch)
                  "data": {"seed": cfg.seed, "batch_size": cfg.batch_size}})


def reshardable(cls: type[Strategy]) -> bool:
    """True if strategy ``cls`` resumes checkpoints of other layouts through the portable form
    (its registered class itself says ``reshardable = True``, as for ``checkpoint_refusal``)."""
    return cls.__dict__.get("reshardable") is True and checkpoint_support(cls) is None


def reshardable_names() -> list[str]:
    return [n for n in strategy_names() if reshardable(get_strategy(n))]


def _reshards(saved: dict, now: dict) -> bool:
    """The layouts differ only where resharding reaches (strategy, world size, the options that
    cut the state), and both strategies reshard."""
    cut = any(saved[k] != now[k] for k in ("strategy", "world_size", "options"))
    try:
        both = all(reshardable(get_strategy(layout["strategy"])) for layout in (saved, now))
    except ConfigError:  # a strategy this minitrain does not know
        return False
    return cut and both


def _mismatch(saved: dict, now: dict, where: Path) -> str | None:
    """The first difference between the checkpoint's layout and this run's that cannot be
    resumed, as a refusal (None: the same layout, or one :func:`_reshards` bridges)."""
    resharded = _reshards(saved, now)
    fixed = [n for n in strategy_names()
             if checkpoint_support(get_strategy(n)) is None and n not in reshardable_names()]
    only = (f"; a checkpoint is resharded on load between {', '.join(reshardable_names())} only "
            f"({', '.join(fixed)} resume on their own layout)")
    if saved["strategy"] != now["strategy"] and not resharded:
        return (f"{where} was saved by strategy {saved['strategy']!r}, this run is "
                f"{now['strategy']!r}{only}; resume with --strategy {saved['strategy']}, or "
                f"consolidate it (minitrain consolidate {where} OUT.pt) for a plain state_dict")
    if saved["world_size"] != now["world_size"] and not resharded:
        return (f"{where} was saved on {saved['world_size']} ranks, this run has "
                f"{now['world_size']}{only}; resume with --world-size {saved['world_size']}, or "
                f"consolidate it")
    if saved["model"] != now["model"]:
        diffs = [k for k in saved["model"] if saved["model"][k] != now["model"].get(k)]
        fix = " ".join(f"{_FLAGS[k]} {saved['model'][k]}" for k in diffs if k in _FLAGS)
        return (f"{where} holds a different model: "
                + ", ".join(f"{k} {saved['model'][k]} there, {now['model'].get(k)} here" for k in diffs)
                + f"; resume with the same model{' (' + fix + ')' if fix else ''}")
    if saved["precision"] != now["precision"]:
        return (f"{where} was saved in --precision {saved['precision']}, this run uses "
                f"{now['precision']}; resume with --precision {saved['precision']}")
    if saved["options"] != now["options"] and not resharded:
        keys = sorted(set(saved["options"]) | set(now["options"]))
        diffs = [k for k in keys if saved["options"].get(k) != now["options"].get(k)]
        return (f"{where} was cut for other {now['strategy']} options: "
                + ", ".join(f"{k} {saved['options'].get(k)} there, {now['options'].get(k)} here"
                            for k in diffs)
                + "; resume with the checkpoint's (--" + ", --".join(k.replace("_", "-") for k in diffs)
                + ")")
    data = saved.get("data")
    if data is not None and data != now["data"]:
        key = next(k for k in data if data[k] != now["data"].get(k))
        return (f"{where} was trained with --{key.replace('_', '-')} {data[key]}, this run has "
                f"{now['data'].get(key)}: the data stream would differ from the interrupted run's; "
                f"resume with --{key.replace('_', '-')} {data[key]}")
    return None


def _describe(layout: dict) -> str:
    n = layout["world_size"]
    return f"{layout['strategy']} on {n} rank{'s' if n != 1 else ''}"


# --------------------------------------------------------------------------------------------------
# Finding and checking a checkpoint (before any process starts)
# --------------------------------------------------------------------------------------------------


def skipped_saves(where) -> list[str]:
    """Saves in the save dir ``where`` newer than the step a resume takes, that did not finish."""
    path = Path(where)
    if not path.is_dir() or (path / META).is_file():
        return []
    chosen = find_checkpoint(path)
    out = []
    for p in sorted(path.iterdir()):
        m = _STEP_DIR.match(p.name.removesuffix(".tmp"))
        if m and p.is_dir() and (p.name.endswith(".tmp") or not (p / META).is_file()) \
                and p != chosen and int(m.group(1)) >= int(_STEP_DIR.match(chosen.name).group(1)):
            out.append(p.name)
    return out


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
                   if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    done = [p for _, p in steps if (p / META).is_file()]
    if done:
        return done[-1]
    if steps:
        raise CheckpointError(f"no complete checkpoint in {path}: {', '.join(p.name for _, p in steps)}"
                              f" lack {META} (a save that did not finish writes it last); "
                              "resume from another checkpoint")
    if _STEP_DIR.match(path.name) or any(path.glob("rank*.pt")):
        raise CheckpointError(f"{path} has no {META}: the save did not finish (the rank files are "
                              f"written first, {META} last); resume from an earlier checkpoint")
    raise CheckpointError(f"no checkpoint in {path}: neither {META} nor step-* directories; pass "
                          "the --save-dir of an earlier run, or one of its step-* directories")


def read_meta(path: Path) -> dict:
    """``meta.json`` of checkpoint directory ``path``, checked for format and completeness."""
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


def check_files(path: Path, meta: dict) -> None:
    """Every rank file ``meta.json`` lists is there, with the size it lists."""
    files = meta["files"]
    world = meta["layout"]["world_size"]
    for rank in range(world):
        name = rank_file(rank)
        if name not in files or not (path / name).is_file():
            raise CheckpointError(f"{path}: {name} is missing (the checkpoint has {world} rank "
                                  "files); it cannot be resumed or consolidated without it — copy "
                                  "it back, or use another checkpoint")
        size = (path / name).stat().st_size
        if size != files[name]["bytes"]:
            raise CheckpointError(f"{path / name} has {size} bytes but {META} says "
                                  f"{files[name]['bytes']}: the file is truncated or was replaced; "
                                  "use another checkpoint")


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
    for name in skipped_saves(cfg.resume):
        print(f"minitrain: {Path(cfg.resume) / name} did not finish saving (no {META}); resuming "
              f"from {path.name}", file=sys.stderr, flush=True)
    meta = read_meta(path)
    problem = _mismatch(meta["layout"], layout_of(cfg), path)
    if problem:
        raise CheckpointError(problem)
    if _reshards(meta["layout"], layout_of(cfg)):
        print(f"minitrain: resharding {path} ({_describe(meta['layout'])}) for "
              f"{_describe(layout_of(cfg))}", file=sys.stderr, flush=True)
    if meta["step"] >= cfg.steps:
        raise CheckpointError(f"{path} is at step {meta['step']}, and --steps {cfg.steps} is already "
                              f"reached (--steps counts from the start); use --steps "
                              f"{meta['step'] + cfg.steps} to train {cfg.steps} more")
    check_files(path, meta)
    return {**meta, "path": str(path)}


def _previous_saves(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if _STEP_DIR.match(p.name.removesuffix(".tmp"))) \
        if save_dir.is_dir() else []


def _check_save_dir(cfg: TrainConfig) -> None:
    """``--save-dir`` must be writable (probed now, not after training) and hold no other run's
    checkpoints, unless this run resumes from it or ``--overwrite`` is given."""
    where = Path(cfg.save_dir)
    existing = where
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
               "state": strategy.checkpoint_state()}
    _write_atomically(path / name, lambda tmp: torch.save(payload, tmp))
    mine = (name, {"rank": comm.rank, "bytes": (path / name).stat().st_size,
                   "sha256": _sha256(path / name)})
    files = [None] * comm.size if comm.rank == 0 else None
    dist.gather_object(mine, files, dst=comm.global_rank(0), group=comm.group)
    if comm.rank == 0:
        meta = {"format": FORMAT, "version": VERSION, "step": steps_done, "layout": layout_of(cfg),
                "config": _json({**cfg.__dict__, "model": cfg.model.to_dict(),
                                 "options": _options(cfg.options)}),
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
        name = rank_file(rank)
        file, listed = self.path / name, self.meta["files"].get(name)
        if listed is None or not file.is_file():
            raise CheckpointError(f"{self.path}: {name} is missing; copy it back, or use another "
                                  "checkpoint")
        if file.stat().st_size != listed["bytes"] or _sha256(file) != listed["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its size or SHA-256 differs from {META}; "
                                  "use another checkpoint")
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
    """On every rank: restore ``strategy`` and the RNG from the checkpoint ``where`` names, set
    ``strategy.start_step`` and return it (the step to run next)."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    problem = _mismatch(meta["layout"], layout_of(strategy.cfg), path)
    if problem:
        raise CheckpointError(problem)
    read, rank = RankFiles(path, meta), strategy.comm.rank
    if _reshards(meta["layout"], layout_of(strategy.cfg)):
        # every rank reads every saved part and takes its own cut of the whole (small models)
        saved_cfg, cls = _saved_config(meta), get_strategy(meta["layout"]["strategy"])
        strategy.load_portable_state(cls.consolidate_checkpoint(saved_cfg, read),
                                     cls.consolidate_optimizer(saved_cfg, read))
        strategy.resharded_from = _describe(meta["layout"])
        rank = rank if rank < meta["layout"]["world_size"] else 0  # a new rank: rank 0's RNG
    else:
        strategy.load_checkpoint_state(read)
    _set_rng_state(read.payload(rank)["rng"])
    optimizer = getattr(strategy, "optimizer", None)
    for group in getattr(optimizer, "param_groups", []):
        group["lr"] = strategy.cfg.lr  # this run's --lr, not the saved one
    strategy.start_step = meta["step"]
    strategy.resumed_from = str(path)
    return meta["step"]


def consolidate(where) -> dict:
    """The full model of checkpoint ``where`` as a plain single-process state_dict (the keys and
    shapes of ``GPT(cfg).state_dict()``): what ``strategy.state_dict()`` returned at that step."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    check_files(path, meta)
    layout = meta["layout"]
    cls = get_strategy(layout["strategy"])
    why = checkpoint_support(cls)
    if why:
        raise CheckpointError(f"cannot consolidate {path}: {why}")
    return cls.consolidate_checkpoint(_saved_config(meta), RankFiles(path, meta))


def portable_state(where) -> tuple[dict, dict]:
    """(weights, optimizer state) of checkpoint ``where`` in the layout-free form any reshardable
    strategy loads (:mod:`minitrain.strategies.portable`), offline."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    check_files(path, meta)
    cls = get_strategy(meta["layout"]["strategy"])
    if not reshardable(cls):
        raise CheckpointError(f"{path} was saved by {cls.name!r}, which does not reshard; "
                              f"resharding covers {', '.join(reshardable_names())}")
    cfg, read = _saved_config(meta), RankFiles(path, meta)
    return cls.consolidate_checkpoint(cfg, read), cls.consolidate_optimizer(cfg, read)


def _saved_config(meta: dict) -> TrainConfig:
    """The config a checkpoint was saved under, as far as its layout goes."""
    layout = meta["layout"]
    return TrainConfig(strategy=layout["strategy"], world_size=layout["world_size"],
                       model=GPTConfig(**layout["model"]), precision=layout["precision"],
                       options=meta["config"].get("options", {}))


def consolidate_to(where, out) -> Path:
    """:func:`consolidate` and ``torch.save`` the state_dict to ``out``; returns its path."""
    state = consolidate(where)
    out = Path(out)
    if out.parent and not out.parent.exists():
        raise CheckpointError(f"cannot write {out}: {out.parent} does not exist")
    _write_atomically(out, lambda tmp: torch.save(state, tmp))
    return out
