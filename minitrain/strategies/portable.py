"""The layout-free ("portable") training state a checkpoint is resharded through (lesson 08).

A checkpoint is cut for its layout: ``single`` and ``ddp`` save one replica and torch's Adam
``state_dict`` (indexed by parameter position), ZeRO saves each rank's flat, padded shard of every
unit and its optimizer's states for that shard.  To resume on another strategy or world size — what
``torch.distributed.checkpoint`` does for PyTorch users — both are turned into one form that names
every value by its parameter:

* the weights: the single-process ``state_dict`` (what ``consolidate_checkpoint`` returns);
* the optimizer: ``{"params": {name: {"exp_avg": full tensor, "exp_avg_sq": ..., "step": scalar,
  "master": fp32 weight (mixed precision only)}}, "loss_scaler": its state or None}``, ``name``
  as in ``model.named_parameters()`` (a tied weight once, under its first name).

A saved layout makes it offline (``Strategy.consolidate_optimizer(cfg, read)``); a freshly built
strategy takes its own cut of it (``Strategy.load_portable_state(weights, optim)``).  An optimizer
state is *elementwise* when it has the parameter's shape (Adam's moments): cut like the weights; a
0-dim tensor (Adam's ``step``) is the same for every element.
"""

from __future__ import annotations

import math

import torch

__all__ = ["from_optimizer_state", "to_optimizer_state", "unshard_optimizer", "shard_optimizer_state"]


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
