"""The 3D mesh (lesson 08): data × pipeline × tensor parallel ranks on one world, and a process
group for each axis.

Paper: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (PTD-P: tensor parallel inside a node, pipeline parallel across nodes, data parallel
over the rest).

``world = dp · pp · tp`` ranks; rank ``(p · dp + d) · tp + t`` sits at coordinates ``(d, p, t)``:
the tensor index varies fastest (a tensor group on one machine: it talks every layer), the
pipeline index slowest (it talks least).  :class:`Mesh` builds every group explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..comm import Comm

__all__ = ["Coords", "MeshShape", "Mesh"]


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: data-parallel replica ``dp``, pipeline stage ``pp``, tensor rank ``tp``."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the three axes; pure arithmetic, no processes (drawn by the lesson)."""

    dp: int
    pp: int
    tp: int

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, c: Coords) -> int:
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        rest, t = divmod(rank, self.tp)
        p, d = divmod(rest, self.dp)
        return Coords(d, p, t)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` ("dp", "pp" or "tp"): the ranks that differ only there."""
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        if axis not in sizes:
            raise ValueError(f"axis must be one of dp, pp, tp; got {axis!r}")
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            key = tuple(getattr(c, a) for a in sizes if a != axis)
            out.setdefault(key, []).append(r)
        return list(out.values())

    def group_of(self, rank: int, axis: str) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)


class Mesh:
    """This rank's place in a ``dp × pp × tp`` mesh and a :class:`Comm` for each axis.

    Every rank of ``comm`` must build it (``dist.new_group`` is collective: all ranks create every
    group, in the same order).  The communicators share ``comm``'s tracer, named "dp", "pp", "tp".
    ``groups(dp, pp, tp, axis) -> [[ranks], ...]`` replaces :meth:`MeshShape.groups` (lesson 08's
    exercise).
    """

    def __init__(self, shape: MeshShape, comm: Comm, groups=None):
        if shape.size != comm.size:
            raise ValueError(f"a {shape.dp}x{shape.pp}x{shape.tp} mesh needs {shape.size} ranks, "
                             f"the group has {comm.size}")
        self.shape, self.coords = shape, shape.coords(comm.rank)
        for axis in ("tp", "dp", "pp"):
            mine = None
            every = (groups(shape.dp, shape.pp, shape.tp, axis) if groups is not None
                     else shape.groups(axis))
            for ranks in every:
                group = dist.new_group([comm.global_rank(r) for r in ranks])
                if comm.rank in ranks:
                    mine = group
            if mine is None:
                raise ValueError(f"rank {comm.rank} is in no {axis} group of {every}")
            setattr(self, axis, comm.sub(mine, axis))

    def destroy(self) -> None:
        """Free this rank's three groups (their connections and threads): a notebook that runs
        the strategy again builds new ones."""
        for axis in ("tp", "dp", "pp"):
            comm = getattr(self, axis)
            if comm.group is not None:
                dist.destroy_process_group(comm.group)

    def __repr__(self) -> str:
        c = self.coords
        return f"Mesh({self.shape.dp}x{self.shape.pp}x{self.shape.tp}, dp={c.dp}, pp={c.pp}, tp={c.tp})"
