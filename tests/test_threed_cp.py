"""The 4D mesh: strategy ``3d`` with ``--cp``, context parallelism as a fourth axis
(DP × CP × PP × TP): the mesh's arithmetic, equal to one process for several shapes, the ring's
bytes beside the theory, the seams, and the refusals before spawning."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import assert_same_run
from minitrain import GPTConfig, TrainConfig, train
from minitrain.parallel.context import merge_attention
from minitrain.parallel.mesh import Coords, MeshShape
from minitrain.strategies import ConfigError
from minitrain.train import check_config

# 2 layers (2 stages), 2 heads (tp 2), a sequence of 15: padded to 16 for cp 2, to 18 for cp 3
MODEL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=15)
CFG = TrainConfig(steps=6, batch_size=4, seed=0, model=MODEL)


def mesh_cfg(dp, cp, pp, tp, **options) -> TrainConfig:
    opts = {"dp": dp, "cp": cp, "pp": pp, "tp": tp, **options}
    return CFG.with_(strategy="3d", world_size=dp * cp * pp * tp, options=opts)


@pytest.fixture(scope="module")
def single():
    return train(CFG, return_state=True)


# -- the arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, pp, tp, cp", [(2, 2, 2, 2), (1, 1, 2, 3), (3, 2, 1, 2), (2, 1, 1, 4)])
def test_four_axes_tile_the_world_tensor_fastest_then_context(dp, pp, tp, cp):
    s = MeshShape(dp, pp, tp, cp)
    assert s.size == dp * cp * pp * tp and s.axes == ("dp", "pp", "tp", "cp")
    assert [s.rank(s.coords(r)) for r in range(s.size)] == list(range(s.size))
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)):
        groups = s.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(s.size))  # a partition
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along the axis
            assert len({tuple(v for k, v in vars(s.coords(r)).items() if k != axis)
                        for r in g}) == 1
    # tp fastest, then cp, then dp, then pp (tp and cp talk every layer: the nearest ranks)
    for r in range(s.size):
        c = s.coords(r)
        assert r == ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp
    assert s.group_of(0, "cp") == [c * tp for c in range(cp)]


def test_without_cp_the_mesh_is_lesson_08s():
    for dp, pp, tp in [(2, 2, 2), (3, 1, 2), (2, 3, 1)]:
        three, four = MeshShape(dp, pp, tp), MeshShape(dp, pp, tp, 1)
        assert three == four and three.axes == ("dp", "pp", "tp")
        for r in range(three.size):
            c = three.coords(r)
            assert r == (c.pp * dp + c.dp) * tp + c.tp and c.cp == 0
        assert all(three.groups(a) == four.groups(a) for a in three.axes)


# -- on real ranks ---------------------------------------------------------------------------------

SHAPES = {  # name: (dp, cp, pp, tp, extra options)
    "1x2x1x2": (1, 2, 1, 2, {}),
    "1x2x2x1": (1, 2, 2, 1, {"microbatches": 2}),
    "2x2x1x1 zero1": (2, 2, 1, 1, {}),
    "2x2x1x1 zero0": (2, 2, 1, 1, {"zero_stage": 0}),
    "1x2x1x2 sequence-parallel": (1, 2, 1, 2, {"sequence_parallel": True}),
    "1x3x1x1": (1, 3, 1, 1, {}),
    "1x2x2x2": (1, 2, 2, 2, {"microbatches": 2}),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_4d_equals_a_single_process(clusters, single, name):
    dp, cp, pp, tp, options = SHAPES[name]
    cfg = mesh_cfg(dp, cp, pp, tp, **options)
    run = train(cfg, cluster=clusters(cfg.world_size), return_state=True)
    assert_same_run(run, single)  # every step's loss within 1e-5 relative, the final weights
    s = MeshShape(dp, pp, tp, cp)
    padded = 2 * cp * -(-MODEL.seq_len // (2 * cp))
    for r, rep in enumerate(run.summary.report):
        assert MeshShape(rep["dp"], rep["pp"], rep["tp"], rep["cp"]) == s
        assert Coords(**rep["coords"]) == s.coords(r)
        assert rep["groups"] == {axis: s.group_of(r, axis) for axis in s.axes}
        # each rank holds 1/cp of the (padded) sequence: a chunk from the front, its mirror
        assert rep["padded_len"] == padded and rep["tokens_per_rank"] == padded // cp
        chunk, c = padded // (2 * cp), s.coords(r).cp
        assert rep["positions"] == [*range(c * chunk, (c + 1) * chunk),
                                    *range((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)]
        # the ring's bytes per step (tracer) are the theory's: 3cp-2 blocks of the local heads
        assert rep["cp_ring_sent_bytes_per_step"] == rep["cp_ring_sent_bytes_theory"] > 0
    sent = {axis for axis, row in run.summary.report[0]["comm_by_group"].items()
            if row["sent_bytes"] > 0}
    assert sent == {axis for axis, n in (("dp", dp), ("cp", cp), ("pp", pp), ("tp", tp)) if n > 1}


# -- seams -----------------------------------------------------------------------------------------


def mesh_groups_3d(dp, pp, tp, axis):
    """The groups of one axis of a 3D mesh (lesson 08's exercise), rank = (p·dp + d)·tp + t."""
    return MeshShape(dp, pp, tp).groups(axis)


def test_seams_in_the_4d_mesh(clusters):
    cfg = mesh_cfg(1, 2, 1, 2)
    cluster = clusters(4)
    ours = train(cfg, cluster=cluster).losses
    seams = {"online_softmax_merge": merge_attention}
    assert train(cfg, cluster=cluster, seams=seams).losses == ours
    # the merge really runs inside: one that keeps only the first part changes the losses
    keep_first = lambda out_a, lse_a, out_b, lse_b: (out_a, lse_a)  # noqa: E731
    wrong = train(cfg, cluster=cluster, seams={"online_softmax_merge": keep_first}).losses
    assert wrong != ours


# -- refusals, before any process starts -----------------------------------------------------------


@pytest.mark.parametrize("changes, seams, message", [
    (dict(world_size=6, options={"dp": 1, "cp": 2, "tp": 2}), None,
     r"--dp 1 x --cp 2 x --pp 1 x --tp 2 = 4 ranks \(the product dp·cp·pp·tp\) but --world-size "
     r"is 6; use --world-size 4"),
    (dict(world_size=4, options={"cp": 2}, model=GPTConfig(n_layer=2, n_head=2, d_model=32,
                                                           seq_len=3)), None,
     "seq_len 3 is shorter than 2 x --cp 2 chunks .*; use --seq-len 4 or more, or a smaller --cp"),
    (dict(world_size=6, options={"cp": 2, "tp": 3}), None, "n_head=2 does not split over --tp 3"),
    (dict(world_size=4, options={"cp": 2, "pp": 2, "schedule": "zb-h1"}), None,
     "cannot run --schedule zb-h1"),
    (dict(world_size=4, options={"cp": 0}), None, "--cp must be at least 1"),
    (dict(world_size=4, options={"cp": 2}, checkpoint_activations=True), None,
     "cannot checkpoint activations"),
    (dict(world_size=4, options={"cp": 2, "tp": 2}), {"mesh_groups": mesh_groups_3d},
     "numbers the ranks of a 3D mesh, and this run has --cp 2: the 4D mesh numbers its own"),
    (dict(world_size=4, options={"tp": 2}), {"online_softmax_merge": merge_attention},
     "with --cp 1 there is no ring; add --cp 2"),
])
def test_what_the_4d_mesh_cannot_run_is_refused_with_the_fix(changes, seams, message):
    with pytest.raises(ConfigError, match=message):
        check_config(CFG.with_(strategy="3d", **changes), seams)


def test_the_cli_trains_the_4d_mesh():
    out = subprocess.run([sys.executable, "-m", "minitrain", "train", "--strategy", "3d",
                          "--cp", "2", "--tp", "2", "--world-size", "4", "--model", "nano",
                          "--steps", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    report = lines[-1]["summary"]["report"][0]
    assert (report["dp"], report["cp"], report["pp"], report["tp"]) == (1, 2, 1, 2)
    assert report["comm_by_group"]["cp"]["sent_bytes"] > 0
    assert sum("step" in line for line in lines) == 2 and torch.isfinite(
        torch.tensor([line["loss"] for line in lines if "step" in line])).all()
