"""Lesson 08: the groups of a 3D mesh."""

from answers import Answers


def mesh_groups(dp, pp, tp, axis):
    groups = {}
    for rank in range(dp * pp * tp):
        rest, t = divmod(rank, tp)
        p, d = divmod(rest, dp)
        key = tuple(v for k, v in (("dp", d), ("pp", p), ("tp", t)) if k != axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def everyone_in_one_group(dp, pp, tp, axis):
    return [list(range(dp * pp * tp))]


def data_index_fastest(dp, pp, tp, axis):
    """Groups of the right sizes, from the wrong numbering: the data index varies fastest."""
    groups = {}
    for rank in range(dp * pp * tp):
        rest, d = divmod(rank, dp)
        p, t = divmod(rest, tp)
        key = tuple(v for k, v in (("dp", d), ("pp", p), ("tp", t)) if k != axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def forgot_to_return(dp, pp, tp, axis):
    mesh_groups(dp, pp, tp, axis)


def each_group_twice(dp, pp, tp, axis):
    return mesh_groups(dp, pp, tp, axis) * 2


def axis_swapped(dp, pp, tp, axis):
    """The tp groups given for dp and the other way round."""
    return mesh_groups(dp, pp, tp, {"dp": "tp", "tp": "dp"}.get(axis, axis))


ANSWERS = {"mesh_groups": Answers(mesh_groups, [
    (everyone_in_one_group, "is not a dp group"),
    (data_index_fastest, "tensor index fastest"),
    (forgot_to_return, "returned None"),
    (each_group_twice, "exactly one group"),
    (axis_swapped, "is not a dp group"),
])}
