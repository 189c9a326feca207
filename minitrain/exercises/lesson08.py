"""Lesson 08: the process groups of a 3D mesh."""

from __future__ import annotations

import torch

from .core import exercise, raised, ranks
from .inside import Row, inside


#: (dp, pp, tp) meshes the mesh_groups checker tries, odd sizes and size-1 axes included
_MESH_SHAPES = [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 1), (1, 1, 1), (2, 1, 3)]


def _mesh_groups_of(fn, dp: int, pp: int, tp: int, axis: str):
    """The learner's groups, each sorted, or the sentence saying why they are not groups."""
    call = f"{getattr(fn, '__name__', 'your function')}({dp}, {pp}, {tp}, {axis!r})"
    try:
        got = fn(dp, pp, tp, axis)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(call, exc, fn)
    if got is None:
        return f"{call} returned None: return a list of groups, each a list of ranks"
    try:
        return sorted(sorted(int(r) for r in g) for g in got)
    except (TypeError, ValueError):
        return f"{call} returned {got!r}: return a list of lists of ranks, like [[0, 1], [2, 3]]"


def _mesh_groups_rank(groups: dict) -> dict:
    """On each rank: build the learner's groups (every rank creates every group, in order) and
    all-reduce the rank numbers over this rank's group of each axis."""
    import torch.distributed as dist

    out = {}
    for axis, axis_groups in groups.items():
        mine = None
        for g in axis_groups:
            group = dist.new_group(g)
            if dist.get_rank() in g:
                mine = group
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mine)
        out[axis] = t.item()
    return out


@exercise('mesh_groups',
          "the dp, pp and tp groups of six meshes, odd sizes included, all-reduces over "
          "them on 4 ranks, and a 2 × 1 × 2 mesh built from them trains like one process")
def _check_mesh_groups(fn) -> str | None:
    """The groups of every axis for several meshes, then used for real on 4 ranks (2 x 1 x 2)."""
    from ..launch import RankError
    from ..parallel.mesh import MeshShape

    for dp, pp, tp in _MESH_SHAPES:
        s = MeshShape(dp, pp, tp)
        for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            groups = _mesh_groups_of(fn, dp, pp, tp, axis)
            if isinstance(groups, str):
                return groups
            where = f"dp={dp}, pp={pp}, tp={tp}, axis {axis!r}"
            if sorted(r for g in groups for r in g) != list(range(s.size)):
                return (f"{where}: every rank 0..{s.size - 1} must be in exactly one group; "
                        f"got {groups}")
            want = sorted(s.groups(axis))
            if groups != want:
                wrong = next(g for g in groups if g not in want)
                return (f"{where}: {wrong} is not a {axis} group — a group's ranks differ only in "
                        f"the {axis} coordinate, with rank = (p·dp + d)·tp + t (tensor index "
                        f"fastest, then data, then pipeline); expected {want} ({size} ranks each)")
    s = MeshShape(2, 1, 2)
    groups = {axis: _mesh_groups_of(fn, 2, 1, 2, axis) for axis in ("dp", "tp")}
    try:
        sums = ranks(4).run(_mesh_groups_rank, groups, timeout=60)
    except RankError as exc:
        return f"on 4 ranks: {str(exc).splitlines()[0]}"
    for r, got in enumerate(sums):
        for axis, total in got.items():
            if total != sum(s.group_of(r, axis)):
                return (f"on 4 ranks: rank {r}'s all-reduce over its {axis} group gave {total:g}, "
                        f"expected {sum(s.group_of(r, axis))}")
    return inside("mesh_groups", fn, _mesh_run_cfg(), measure=_mesh_bytes)


def _mesh_model():
    from ..model import GPTConfig
    return GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


def _mesh_bytes(summary: dict, cfg, package) -> list:
    """Bytes rank 0 sent per step on each axis of the mesh, beside the lessons' formulas."""
    rep, dp = summary["report"][0], cfg.options.dp
    sent = {axis: row["sent_bytes"] for axis, row in rep["comm_by_group"].items()}
    return [Row("dp: ZeRO-1 reduce-scatter + all-gather", sent.get("dp", 0.0),
                "2(dp−1)/dp·4Ψ_r", 2 * (dp - 1) / dp * 4 * rep["params_local"]),
            Row("tp: the tensor-parallel all-reduces", sent.get("tp", 0.0))]


def _mesh_run_cfg():
    from ..strategies import TrainConfig
    return TrainConfig(strategy="3d", world_size=4, steps=3, batch_size=8, model=_mesh_model(),
                       options={"dp": 2, "pp": 1, "tp": 2})
