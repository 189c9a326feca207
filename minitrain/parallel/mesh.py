"""The 3D mesh (lesson 08): data × pipeline × tensor parallel ranks on one world, and a process
group for each axis — and its fourth axis, context parallel (lesson 09).

Paper: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (PTD-P: tensor parallel inside a node, pipeline parallel across nodes, data parallel
over the rest).

``world = dp · pp · tp`` ranks; rank ``(p · dp + d) · tp + t`` sits at coordinates ``(d, p, t)``:
the tensor index varies fastest (a tensor group on one machine: it talks every layer), the
pipeline index slowest (it talks least).  :class:`Mesh` builds every group explicitly.

With ``cp`` context-parallel ranks (each holds 1/cp of every sequence),
``world = dp · cp · pp · tp`` and rank ``((p · dp + d) · cp + c) · tp + t`` sits at ``(d, p, t, c)``: tensor fastest, then
context (its ring also talks every layer: the next-fastest links), then data, then pipeline — the
order of Megatron-LM's ``tp-cp-dp-pp``.  With ``cp = 1`` it is the 3D numbering above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..comm import Comm
from .errors import ParameterError

__all__ = ["Coords", "MeshShape", "Mesh"]


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: data-parallel replica ``dp``, pipeline stage ``pp``, tensor rank ``tp``,
    and context-parallel rank ``cp`` (0 in a 3D mesh)."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the axes; pure arithmetic, no processes (drawn by the lesson).  ``cp`` (the
    fourth axis, context parallel) is 1 in a 3D mesh."""

    dp: int
    pp: int
    tp: int
    cp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes this mesh has: dp, pp, tp, and cp when it is more than 1."""
        return ("dp", "pp", "tp", "cp") if self.cp > 1 else ("dp", "pp", "tp")

    def rank(self, c: Coords) -> int:
        return ((c.pp * self.dp + c.dp) * self.cp + c.cp) * self.tp + c.tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.size:
            raise ParameterError(f"{{}} is outside a mesh of {self.size} ranks", ("rank", rank))
        rest, t = divmod(rank, self.tp)
        rest, c = divmod(rest, self.cp)
        p, d = divmod(rest, self.dp)
        return Coords(d, p, t, c)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ("dp", "pp", "tp" or "cp"): the ranks that differ only
        there."""
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp}
        if axis not in sizes:
            raise ParameterError("unknown {}; use dp, pp, tp or cp", ("axis", axis))
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            key = tuple(getattr(c, a) for a in sizes if a != axis)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)


class Mesh:
    """This rank's place in a ``dp × pp × tp`` mesh (``× cp``) and a :class:`Comm` for each axis.

    Every rank of ``comm`` must build it (``dist.new_group`` is collective: all ranks create every
    group, in the same order).  The communicators share ``comm``'s tracer, named "dp", "pp", "tp"
    (and "cp"; with ``cp = 1`` no context groups are built and ``self.cp`` is None).
    ``mesh_groups(dp, pp, tp, axis) -> [[ranks], ...]`` replaces :meth:`MeshShape.groups`
    (lesson 08's exercise) in a 3D mesh; a mesh with ``cp > 1`` numbers its ranks over four axes,
    so it builds its own groups and refuses ``mesh_groups``.
    """

    def __init__(self, shape: MeshShape, comm: Comm, mesh_groups=None):
        if shape.size != comm.size:
            raise ValueError(f"a {_sizes(shape)} mesh needs {shape.size} ranks, "
                             f"the group has {comm.size}")
        if mesh_groups is not None and shape.cp > 1:
            raise ParameterError("mesh_groups(dp, pp, tp, axis) numbers the ranks of a 3D mesh and "
                                 "this mesh has {}: leave {} (the mesh numbers its ranks "
                                 "((p·dp + d)·cp + c)·tp + t), or use {}", ("cp", shape.cp),
                                 ("mesh_groups", None), ("cp", 1), parameter="mesh_groups",
                                 value=mesh_groups)
        self.shape, self.coords = shape, shape.coords(comm.rank)
        self.cp = None
        for axis in self.axes:
            mine = None
            if mesh_groups is None:
                every = shape.groups(axis)
            else:
                every = mesh_groups(shape.dp, shape.pp, shape.tp, axis)
            for ranks in every:
                group = dist.new_group([comm.global_rank(r) for r in ranks])
                if comm.rank in ranks:
                    mine = group
            if mine is None:
                raise ValueError(f"rank {comm.rank} is in no {axis} group of {every}")
            setattr(self, axis, comm.sub(mine, axis))

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes whose groups this mesh builds, in the order every rank builds them."""
        return ("tp", "cp", "dp", "pp") if self.shape.cp > 1 else ("tp", "dp", "pp")

    def destroy(self) -> None:
        """Free this rank's groups (their connections and threads): a notebook that runs the
        strategy again builds new ones."""
        for axis in self.axes:
            comm = getattr(self, axis)
            if comm.group is not None:
                dist.destroy_process_group(comm.group)

    def __repr__(self) -> str:
        c = self.coords
        where = f"dp={c.dp}, pp={c.pp}, tp={c.tp}" + (f", cp={c.cp}" if self.shape.cp > 1 else "")
        return f"Mesh({_sizes(self.shape)}, {where})"


def _sizes(shape: MeshShape) -> str:
    base = f"{shape.dp}x{shape.pp}x{shape.tp}"
    return base + (f" (cp {shape.cp})" if shape.cp > 1 else "")
