"""3D parallelism (lesson 08): the mesh's arithmetic, the groups on real ranks, and strategy `3d`
equal to one process for data x pipeline x tensor layouts."""

import pytest

from conftest import assert_same_run
from minitrain import GPTConfig, TrainConfig, train
from minitrain.parallel.mesh import Coords, MeshShape
from minitrain.strategies import ConfigError
from minitrain.train import check_config

# 4 layers (2 pipeline stages x 2 chunks), 4 heads (tp 2), a sequence of 15 (odd: sequence
# parallelism pads it), a batch of 12 (2 or 3 replicas, micro-batches of uneven size)
CFG = TrainConfig(steps=20, batch_size=12, seed=0,
                  model=GPTConfig(n_layer=4, n_head=4, d_model=32, seq_len=15))


def mesh_cfg(dp, pp, tp, **options) -> TrainConfig:
    opts = {"dp": dp, "pp": pp, "tp": tp, "microbatches": 3, **options}
    return CFG.with_(strategy="3d", world_size=dp * pp * tp, options=opts)


@pytest.fixture(scope="module")
def single():
    return train(CFG, return_state=True)


# -- the arithmetic ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, pp, tp", [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 1)])
def test_coordinates_and_groups_tile_the_world(dp, pp, tp):
    s = MeshShape(dp, pp, tp)
    assert [s.rank(s.coords(r)) for r in range(s.size)] == list(range(s.size))
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        groups = s.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(s.size))  # a partition
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along the axis
            others = {tuple(v for k, v in vars(s.coords(r)).items() if k != axis) for r in g}
            assert len(others) == 1
    # tensor groups are neighbouring ranks (one machine); pipeline stages are the furthest apart
    assert s.groups("tp")[0] == list(range(tp))
    assert s.coords(s.size - 1) == Coords(dp - 1, pp - 1, tp - 1)
    assert s.group_of(0, "pp") == [p * dp * tp for p in range(pp)]


# -- on real ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dp, pp, tp", [(2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 1, 1)])
def test_3d_equals_a_single_process(clusters, single, dp, pp, tp):
    run = train(mesh_cfg(dp, pp, tp), cluster=clusters(dp * pp * tp), return_state=True)
    assert_same_run(run, single)
    reports = run.summary.report
    s = MeshShape(dp, pp, tp)
    for r, rep in enumerate(reports):
        assert MeshShape(rep["dp"], rep["pp"], rep["tp"]) == s
        assert Coords(**rep["coords"]) == s.coords(r)
        assert rep["groups"] == {axis: s.group_of(r, axis) for axis in ("dp", "pp", "tp")}
    # each axis really carried traffic, and only the axes that exist
    sent = {axis for axis, row in reports[0]["comm_by_group"].items() if row["sent_bytes"] > 0}
    assert sent == {axis for axis, n in (("dp", dp), ("pp", pp), ("tp", tp)) if n > 1}


@pytest.mark.parametrize("options", [{"sequence_parallel": True},
                                     {"schedule": "interleaved", "chunks": 2, "microbatches": 2},
                                     {"schedule": "gpipe", "zero_stage": 0}])
def test_3d_with_sequence_parallel_interleaving_or_without_zero(clusters, single, options):
    run = train(mesh_cfg(2, 2, 2, **options), cluster=clusters(8), return_state=True)
    assert_same_run(run, single)


def test_tensor_collectives_per_layer_and_zero1_shards_over_dp(clusters):
    steps, M = 2, 3
    cfg = mesh_cfg(2, 2, 2).with_(steps=steps)
    reports = {z: train(cfg.with_(options={**cfg.options.given(), "zero_stage": z}),
                        cluster=clusters(8)).summary for z in (0, 1)}
    rep = reports[1].report[0]  # rank 0: replica 0, stage 0 (blocks 0 and 1), tensor rank 0
    assert rep["stages"] == {0: [0, 1]}
    for block in ("blocks.0", "blocks.1"):
        ops = rep["comm_per_layer"][block]
        # Megatron: per layer and micro-batch, g's 2 all-reduces forward, f's 2 backward
        assert ops["all_reduce forward"]["calls"] == 2 * M
        assert ops["all_reduce backward"]["calls"] == 2 * M
    mem = {z: reports[z].memory[0]["bytes"] for z in (0, 1)}
    # ZeRO-1: Adam's two moments of this rank's shards, split over the 2 replicas
    assert mem[1]["optimizer_states"] < 0.55 * mem[0]["optimizer_states"]
    assert mem[1]["parameters"] == mem[0]["parameters"]


@pytest.mark.parametrize("changes, message", [
    (dict(world_size=4, options={"dp": 2, "pp": 2, "tp": 2}), "use --world-size 8"),
    (dict(world_size=6, batch_size=8, options={"dp": 3, "pp": 2}), "does not split over --dp 3"),
    (dict(world_size=3, options={"tp": 3}), "n_head=4 does not split over --tp 3"),
    (dict(world_size=4, options={"pp": 2, "schedule": "zb-h1"}), "cannot run --schedule zb-h1"),
    (dict(world_size=4, options={"pp": 2, "microbatches": 7}), "each data-parallel replica's batch"),
    (dict(world_size=4, options={"pp": 2, "stages": 4}), "--stages is not an option of strategy .3d."),
    (dict(world_size=2, options={"pp": 2}, model=GPTConfig(n_layer=1)), "use --n-layer 2"),
    (dict(world_size=2, checkpoint_activations=True), "cannot checkpoint activations"),
])
def test_bad_meshes_are_refused_before_spawning_with_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        check_config(CFG.with_(strategy="3d", **changes))


def test_a_4d_mesh_refuses_a_3d_groups_function_naming_the_parameter():
    """``mesh_groups(dp, pp, tp, axis)`` has one shape, the 3D mesh's; a mesh with cp > 1 numbers
    its ranks over four axes and says so in the technique's words (no CLI flag)."""
    from types import SimpleNamespace

    from minitrain.parallel.mesh import Mesh

    with pytest.raises(ValueError, match=r"cp=2: leave mesh_groups=None") as info:
        Mesh(MeshShape(1, 1, 1, cp=2), SimpleNamespace(size=2, rank=0),
             mesh_groups=lambda dp, pp, tp, axis: MeshShape(dp, pp, tp).groups(axis))
    assert "--" not in str(info.value)


# -- the mesh widget --------------------------------------------------------------------------------


def test_the_mesh_picture_is_the_strategys_arithmetic():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minitrain.viz.mesh import MeshWidget, cells, group_rows, plot_mesh

    s = MeshShape(2, 2, 2)
    grid = cells(s, devices_per_node=4)
    assert [(c["dp"], c["pp"], c["tp"]) for c in grid] == [
        (s.coords(r).dp, s.coords(r).pp, s.coords(r).tp) for r in range(8)]  # (cp: 0 in 3D)
    assert [c["node"] for c in grid] == [0, 0, 0, 0, 1, 1, 1, 1]  # a pipeline stage per machine
    assert len({(c["x"], c["y"]) for c in grid}) == 8  # no two ranks drawn on one square
    rows = group_rows(s)
    assert rows[5] == {"rank": 5, "dp": [5, 7], "pp": [1, 5], "tp": [4, 5]}
    fig, ax = plt.subplots()
    plot_mesh(ax, s, 4)
    assert sum(t.get_text().startswith("rank ") for t in ax.texts) == 8
    plt.close(fig)
    widget = MeshWidget(1, 3, 2, devices_per_node=2)
    assert widget.shape == MeshShape(1, 3, 2)
    widget.tp.value = 1
    assert widget.shape.size == 3
    plt.close("all")
