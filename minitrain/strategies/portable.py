"""Resharding: a checkpoint resumed on another strategy or world size, through the layout-free
("portable") training state (lesson 08) — and, before that, which layouts a checkpoint resumes on at
all: its own (:func:`layout_of`), another one :func:`bridges` reaches, or refused with the reason
and the fix (:func:`mismatch`).

A checkpoint is cut for its layout: ``single`` and ``ddp`` save one replica and torch's Adam
``state_dict`` (indexed by parameter position), ZeRO saves each rank's flat, padded shard of every
unit and its optimizer's states for that shard.  When the saved layout differs from the run's only in
the strategy, the world size or the strategy's options (ZeRO offload, buckets), and both strategies'
checkpointers reshard (``single``, ``ddp-naive``, ``ddp``, ``zero1``-``zero3``), every rank reads
every saved part, turns it into one form that names every value by its parameter, and takes its own
cut of it — as ``torch.distributed.checkpoint`` reshards for PyTorch users:

* the weights: the single-process ``state_dict`` (what the checkpointer's ``consolidate`` returns);
* the optimizer: ``{"params": {name: {"exp_avg": full tensor, "exp_avg_sq": ..., "step": scalar,
  "master": fp32 weight (mixed precision only)}}, "loss_scaler": its state or None}``, ``name``
  as in ``model.named_parameters()`` (a tied weight once, under its first name).

The saved layout's checkpointer makes it offline (``portable_optimizer(cfg, read)``); the run's
takes its cut (``load_portable(strategy, weights, optim)``): a replica loads it whole, a ZeRO rank
its flat shard of each unit and the same slice of each moment (zero in the padding).  An optimizer
state is *elementwise* when it has the parameter's shape (Adam's moments): cut like the weights; a
0-dim tensor (Adam's ``step``) is the same for every element.  The step is the data position, so the
loss stream goes on; the model, the precision and the data stream must still match.  A rank the
saved run did not have takes rank 0's RNG state.  The other strategies that checkpoint
(``pipeline``, ``tensor``, ``3d``, ``context``, ``expert``) resume only on their own layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .base import Checkpointer, Strategy, TrainConfig, get_strategy, strategy_names
from .options import ConfigError

__all__ = ["layout_of", "mismatch", "describe", "reshardable", "reshardable_names", "bridges",
           "scope", "portable_form", "load_resharded", "from_optimizer_state",
           "to_optimizer_state", "unshard_optimizer", "shard_optimizer_state"]

_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "d_model": "--d-model", "seq_len": "--seq-len"}


# --------------------------------------------------------------------------------------------------
# Which layouts a checkpoint resumes on: its own, another through the portable form, or refused
# --------------------------------------------------------------------------------------------------


def layout_of(cfg: TrainConfig) -> dict:
    """What decides how the state is cut (``meta.json``'s "layout", JSON values): a checkpoint
    resumes under the same layout, or under another that :func:`bridges` reaches."""
    layout = {"strategy": cfg.strategy, "world_size": cfg.world_size, "model": cfg.model.to_dict(),
              "precision": cfg.precision,
              "options": get_strategy(cfg.strategy).checkpointer.layout(cfg),
              # the data stream: batch k is a function of (seed, k, global batch)
              "data": {"seed": cfg.seed, "batch_size": cfg.batch_size}}
    return json.loads(json.dumps(layout, default=lambda v: getattr(v, "name", None) or str(v)))


def mismatch(saved: dict, now: dict, where: Path) -> str | None:
    """The first difference between the checkpoint's layout and this run's that cannot be
    resumed, as a refusal (None: the same layout, or one that resharding bridges)."""
    bridged = bridges(saved, now)
    only = f"; {scope()}"
    if saved["strategy"] != now["strategy"] and not bridged:
        return (f"{where} was saved by strategy {saved['strategy']!r}, this run is "
                f"{now['strategy']!r}{only}; resume with --strategy {saved['strategy']}, or "
                f"consolidate it (minitrain consolidate {where} OUT.pt) for a plain state_dict")
    if saved["world_size"] != now["world_size"] and not bridged:
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
    if saved["options"] != now["options"] and not bridged:
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


def describe(layout: dict) -> str:
    """``"zero3 on 4 ranks"``."""
    n = layout["world_size"]
    return f"{layout['strategy']} on {n} rank{'s' if n != 1 else ''}"


def reshardable(cls: type[Strategy]) -> bool:
    """True if strategy ``cls``'s checkpointer resumes other layouts through the portable form."""
    return isinstance(cls.checkpointer, Checkpointer) and cls.checkpointer.reshards


def reshardable_names() -> list[str]:
    return [n for n in strategy_names() if reshardable(get_strategy(n))]


def bridges(saved: dict, now: dict) -> bool:
    """True if two layouts (:func:`layout_of`) differ, only where resharding reaches (the
    strategy, the world size, the options that cut the state), and both strategies reshard."""
    cut = any(saved[k] != now[k] for k in ("strategy", "world_size", "options"))
    try:
        both = all(reshardable(get_strategy(layout["strategy"])) for layout in (saved, now))
    except ConfigError:  # a strategy this minitrain does not know
        return False
    return cut and both


def scope() -> str:
    """Where resharding reaches, for a refusal that names it."""
    names = reshardable_names()
    fixed = [n for n in strategy_names()
             if isinstance(get_strategy(n).checkpointer, Checkpointer) and n not in names]
    return (f"a checkpoint is resharded on load between {', '.join(names)} only "
            f"({', '.join(fixed)} resume on their own layout)")


def portable_form(saved: TrainConfig, read) -> tuple[dict, dict]:
    """(weights, optimizer state) of the checkpoint saved under ``saved``, offline."""
    checkpointer = get_strategy(saved.strategy).checkpointer
    return checkpointer.consolidate(saved, read), checkpointer.portable_optimizer(saved, read)


def load_resharded(strategy: Strategy, saved: TrainConfig, read) -> None:
    """On every rank: ``strategy`` takes its cut of another layout's checkpoint (every rank reads
    every saved part: the course's models are small)."""
    strategy.checkpointer.load_portable(strategy, *portable_form(saved, read))


# --------------------------------------------------------------------------------------------------
# The portable form of our optimizers' states
# --------------------------------------------------------------------------------------------------


def _split(sd: dict) -> tuple[list | None, dict]:
    """(fp32 masters or None, the inner torch optimizer's state_dict) of one of our optimizers'
    ``state_dict()``: torch's Adam, :class:`~minitrain.precision.MixedPrecisionOptimizer` or
    :class:`~minitrain.parallel.zero.HostOffload` (``{"masters": [...], "optimizer": ...}``)."""
    return (sd["masters"], sd["optimizer"]) if "masters" in sd else (None, sd)


def from_optimizer_state(sd: dict, names: list[str], masters: bool) -> dict:
    """The portable optimizer state of a replica's optimizer ``state_dict`` whose parameters, in
    order, are ``names``; ``masters``: keep the fp32 masters (mixed precision)."""
    saved_masters, adam = _split(sd)
    positions = [i for group in adam["param_groups"] for i in group["params"]]
    if len(positions) != len(names):
        raise ValueError(f"the optimizer holds {len(positions)} parameters, the model "
                         f"{len(names)}")
    params = {}
    for k, (i, name) in enumerate(zip(positions, names)):
        entry = {key: value for key, value in adam["state"].get(i, {}).items()}
        if masters and saved_masters is not None:
            entry["master"] = saved_masters[k]
        params[name] = entry
    return {"params": params, "loss_scaler": sd.get("loss_scaler")}


def to_optimizer_state(template: dict, names: list[str], portable: dict, weights: dict) -> dict:
    """A ``state_dict`` for a replica's optimizer (``template``: its fresh ``state_dict()``, whose
    parameters, in order, are ``names``) from the portable state; a missing master is the weight."""
    has_masters, adam = _split(template)
    entries = portable["params"]
    positions = [i for group in adam["param_groups"] for i in group["params"]]
    state = {}
    for i, name in zip(positions, names):
        moments = {k: v.clone() for k, v in entries.get(name, {}).items() if k != "master"}
        if moments:  # a parameter never stepped has no state
            state[i] = moments
    inner = {"state": state, "param_groups": adam["param_groups"]}
    if has_masters is None:
        return inner
    masters = [entries.get(n, {}).get("master", weights[n]).float().clone() for n in names]
    return {**template, "masters": masters, "optimizer": inner,
            **({"loss_scaler": portable["loss_scaler"]} if portable.get("loss_scaler") else {})}


def unshard_optimizer(states: list[dict], masters: bool) -> dict:
    """The portable optimizer state from every ZeRO rank's saved state (``{"model": shard_state,
    "optimizer": the shard optimizer's state_dict}``), in rank order: per unit, each elementwise
    state's shards concatenated, the padding dropped and cut into the parameters (as
    :func:`~minitrain.strategies.zero.unshard_state` does for the weights)."""
    model = states[0]["model"]
    first = {}  # unit-parameter name -> its name in the model (the first state_dict key holding it)
    for key in model["order"]:
        if key in model["keys"]:
            first.setdefault(model["keys"][key], key)
    split = [_split(s["optimizer"]) for s in states]
    params: dict[str, dict] = {}
    for i, unit in enumerate(model["units"]):
        names = [first[n] for n in unit["names"]]
        for name in names:
            params[name] = {}
        per_rank = [adam["state"].get(i, {}) for _, adam in split]
        columns = {key: [entry[key] for entry in per_rank] for key in per_rank[0]}
        if masters and split[0][0] is not None:
            columns["master"] = [m[i] for m, _ in split]
        for key, shards in columns.items():
            if shards[0].dim() == 0:  # a scalar (Adam's step): every element's
                for name in names:
                    params[name][key] = shards[0].clone()
                continue
            flat, offset = torch.cat([s.reshape(-1) for s in shards]), 0
            for name, shape in zip(names, unit["shapes"]):
                n = math.prod(shape)
                params[name][key] = flat[offset:offset + n].view(shape).clone()
                offset += n
    return {"params": params, "loss_scaler": states[0]["optimizer"].get("loss_scaler")}


def shard_optimizer_state(template: dict, units: list, rank: int, portable: dict,
                          weights: dict) -> dict:
    """A ``state_dict`` for a ZeRO rank's shard optimizer (``template``: its fresh
    ``state_dict()``) from the portable state.  ``units``: ``(layout, parameter names)`` of each
    flat unit the optimizer steps, in order; rank ``rank``'s slice ``layout.owned_range(rank)`` of
    each elementwise state (zero in the padding), the scalars as they are."""
    has_masters, adam = _split(template)
    entries = portable["params"]
    state, masters = {}, []
    for i, (layout, names) in enumerate(units):
        lo, hi = layout.owned_range(rank)
        stepped = [entries[n] for n in names if n in entries]
        keys = [k for k in (stepped[0] if stepped else {}) if k != "master"]
        if keys:
            state[i] = {}
        for key in keys:
            values = [entries.get(n, {}).get(key) for n in names]
            if values[0].dim() == 0:
                state[i][key] = values[0].clone()
            else:
                state[i][key] = layout.flatten(values, dtype=torch.float32)[lo:hi].clone()
        if has_masters is not None:
            full = [entries.get(n, {}).get("master", weights[n]) for n in names]
            masters.append(layout.flatten(full, dtype=torch.float32)[lo:hi].clone())
    inner = {"state": state, "param_groups": adam["param_groups"]}
    if has_masters is None:
        return inner
    return {**template, "masters": masters, "optimizer": inner}
