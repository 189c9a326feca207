"""The widgets' pure functions, the collectives demo and the alpha-beta cost model."""

import numpy as np
import pytest

from minitrain.planning.costmodel import bus_bandwidth, crossover_bytes, fit_alpha_beta, predict
from minitrain.memory import GB
from minitrain.viz.collectives import before_after_html, collective_demo
from minitrain.viz.memory import MODELS, MemoryCalculator, bar_html, per_device
from minitrain.viz.ring import RingWidget, contributors, frame_html, record_ring, ring_frames


def test_per_device_follows_the_formulas():
    llama = MODELS["LLaMA 7B"]
    base = per_device(llama, devices=1, zero_stage=0)
    assert base["parameters"] + base["gradients"] + base["optimizer_states"] == 16 * 7e9
    z3 = per_device(llama, devices=8, zero_stage=3)
    assert z3["parameters"] + z3["gradients"] + z3["optimizer_states"] == 16 * 7e9 / 8
    assert z3["activations"] == base["activations"]  # ZeRO does not shard activations
    assert per_device(llama, recompute=True)["activations"] < base["activations"] / 10


def test_bar_html_says_whether_it_fits():
    b = per_device(MODELS["LLaMA 7B"])
    html = bar_html(b, 80)
    assert f'{b["total"] / GB:,.1f} GB per device' in html and "does not fit" in html
    small = per_device(MODELS["GPT-2 XL (1.5B)"], devices=8, zero_stage=3)
    assert ">fits<" in bar_html(small, 80)
    assert html.count("mt-seg-") == 4


def test_memory_calculator_reacts_to_its_controls():
    calc = MemoryCalculator()
    before = calc.out.value
    calc.devices.value, calc.zero.value = 8, "3"
    assert calc.out.value != before
    assert "44.6 GB per device" in calc.out.value


def test_ring_frames_from_a_real_run(clusters):
    n = 4
    frames = ring_frames(record_ring(clusters(n)))
    assert len(frames) == 1 + 2 * (n - 1)
    assert frames[0]["chunks"][2] == [[4.0]] * n  # rank 2 starts with 2**2 everywhere
    after_rs = frames[n - 1]  # end of reduce-scatter: rank r owns the full chunk r+1
    for r in range(n):
        assert after_rs["chunks"][r][(r + 1) % n] == [2.0 ** n - 1]
    assert all(c == [[15.0]] * n for c in frames[-1]["chunks"])
    assert frames[1]["moves"] == [(r, (r + 1) % n, r) for r in range(n)]
    html = frame_html(frames[1], 1, len(frames))
    assert "reduce-scatter, step 1 of 3" in html and html.count("mt-ring-cell") == n * n
    widget = RingWidget(frames)
    widget.slider.value = len(frames) - 1
    assert "all-gather, step 3 of 3" in widget.out.value


def test_contributors_decode_partial_sums():
    assert contributors(5, 4) == [0, 2]
    assert contributors(15, 4) == [0, 1, 2, 3]


def test_ring_frames_refuse_ragged_records():
    with pytest.raises(ValueError, match="same number of steps"):
        ring_frames([[{}], []])


@pytest.mark.parametrize("op, expect", [
    ("broadcast", lambda r, n: [float(i) for i in range(n)]),
    ("all_reduce", lambda r, n: [float(i * n + 10 * sum(range(n))) for i in range(n)]),
    ("reduce_scatter", lambda r, n: [float(r * n + 10 * sum(range(n)))]),
    ("all_gather", lambda r, n: [float(10 * q + i) for q in range(n) for i in range(n)]),
])
def test_collective_demo_before_and_after(clusters, op, expect):
    n = 3
    results = clusters(n).run(collective_demo, op)
    for r, (before, after, _sent) in enumerate(results):
        assert before == [10.0 * r + i for i in range(n)]
        assert after == expect(r, n)
    assert f"<b>{op}</b>" in before_after_html(op, results)


def test_the_reduce_table_marks_what_the_non_root_ranks_hold_as_undefined():
    results = [([0.0], [6.0], 0.0), ([1.0], [5.0], 4.0), ([2.0], [2.0], 4.0)]
    html = before_after_html("reduce", results)
    assert html.count("*</td>") == 2 and "not defined by reduce" in html and "a chain" in html
    assert "*</td>" not in before_after_html("all_reduce", [(b, [6.0], s) for b, _, s in results])


def test_send_recv_demo_moves_rank_zeros_tensor_to_rank_one(clusters):
    results = clusters(3).run(collective_demo, "send/recv")
    assert results[1][1] == results[0][0] and results[2][1] == results[2][0]
    assert results[0][2] == 12 and results[1][2] == 0  # bytes sent


def test_alpha_beta_fit_recovers_known_parameters():
    n, alpha, beta = 4, 50e-6, 1 / 2e9
    sizes = np.array([2 ** k for k in range(4, 25)], float)
    rng = np.random.default_rng(0)
    times = predict(sizes, n, alpha, beta) * rng.uniform(0.97, 1.03, sizes.size)
    a, b = fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.1)
    assert crossover_bytes(n, alpha, beta) == pytest.approx(n * alpha / beta)
    assert bus_bandwidth([1e9], [1.0], 4)[0] == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        fit_alpha_beta(sizes, times, 1)


def test_timeline_rows_and_plot_from_a_real_ddp_run(clusters):
    from minitrain import TrainConfig, train
    from minitrain.viz.timeline import plot_ddp_timeline, timeline_rows
    cfg = TrainConfig(strategy="ddp", world_size=2, steps=2, batch_size=8,
                      options={"bucket_mb": 0.2, "timeline": True})
    reports = train(cfg, cluster=clusters(2)).summary.report
    rows = timeline_rows(reports)
    assert [r["rank"] for r in rows] == [0, 1]
    assert min(r["backward"][0] for r in rows) == 0.0
    for r in rows:
        assert len(r["buckets"]) == len(reports[0]["bucket_bytes"]) > 1
        assert all(start <= end for _, start, end, _ in r["buckets"])
    fig = plot_ddp_timeline(reports)
    assert len(fig.axes[0].patches) == 2 * (1 + len(rows[0]["buckets"]))


def test_sharding_grid_follows_the_stages():
    from minitrain.viz.sharding import grid

    owned, total = [(0, 5), (5, 10)], 10
    for stage, sharded in enumerate([(), ("optimizer_states",), ("optimizer_states", "gradients"),
                                     ("optimizer_states", "gradients", "parameters")]):
        rows = grid(owned, total, stage)
        for row, (s, e) in zip(rows, owned):
            for kind in ("parameters", "gradients", "optimizer_states"):
                assert row[kind] == ([(s, e)] if kind in sharded else [(0, total)])
        assert rows[0]["total_bytes"] == sum(
            {"parameters": 2, "gradients": 2, "optimizer_states": 12}[k] * (5 if k in sharded else 10)
            for k in ("parameters", "gradients", "optimizer_states"))


def test_sharding_widget_draws_the_real_partition():
    from minitrain import GPT, PRESETS
    from minitrain.planning.analysis import shard_layout
    from minitrain.viz.sharding import ShardingWidget

    model = GPT(PRESETS["nano"], seed=0)
    widget = ShardingWidget(model, n=3, stage=3)
    layout = shard_layout([p for p in model.parameters() if p.requires_grad], 3)
    html = widget.out.value
    assert html.count('class="mt-shard-row"') == 3
    assert f"{layout.total:,} elements" in html
    widget.n.value = 5
    assert widget.out.value.count('class="mt-shard-row"') == 5
    stage3 = widget.out.value
    widget.stage.value = "0"
    assert widget.out.value != stage3


def test_ring_attention_frames_follow_the_ring_and_count_the_work():
    from minitrain.parallel.context import balanced_layout, ring_work
    from minitrain.viz.context import RingAttentionWidget, frame_html, ring_attention_frames

    frames = ring_attention_frames(16, 4)
    assert len(frames) == 4 and frames[-1]["sends"] == []
    assert [f["ranks"][1]["holds"] for f in frames] == [1, 0, 3, 2]  # rank r - s's block at step s
    assert all(len(r["merged"]) == 4 for r in frames[-1]["ranks"])
    work = ring_work(balanced_layout(16, 4)[1])
    assert [r["pairs_so_far"] for r in frames[-1]["ranks"]] == [sum(w) for w in work]
    html = frame_html(frames[1], 1, 4)
    assert html.count("mt-cp-row") == 4 and "(idle)" not in html
    lopsided = ring_attention_frames(16, 4, "contiguous")
    assert "(idle)" in frame_html(lopsided[1], 1, 4)  # rank 0 sees nothing of a later block
    with pytest.raises(ValueError, match="do not split"):
        ring_attention_frames(5, 4)
    widget = RingAttentionWidget()
    widget.step.value = 3
    assert "step 4/4" in widget.out.value
    widget.ranks.value = 2
    assert widget.step.max == 1 and "step 2/2" in widget.out.value


def test_memory_calculator_says_why_more_devices_change_nothing_at_zero_stage_0():
    calc = MemoryCalculator()
    assert "mt-hint" not in calc.out.value  # one device, stage 0: nothing to explain
    one = calc.out.value
    calc.devices.value = 8
    assert "every device holds all the weights" in calc.out.value and "8 devices" in calc.out.value
    assert calc.out.value.split('<div class="mt-hint"')[0] == one  # the same bytes per device
    calc.zero.value = "1"
    assert "mt-hint" not in calc.out.value
    calc.devices.value = 1
    assert "nothing to shard" in calc.out.value


def test_mesh_colours_every_machine_apart_and_cuts_the_groups_table():
    import matplotlib
    matplotlib.use("Agg")
    from minitrain.parallel.mesh import MeshShape
    from minitrain.viz.mesh import MeshWidget, groups_html, machine_colors

    for machines in (1, 8, 10, 11, 20, 21, 64):
        assert len(set(machine_colors(machines))) == machines
    small = groups_html(MeshShape(2, 2, 2))
    assert small.count("<tr>") == 1 + 8 and "more ranks" not in small
    big = groups_html(MeshShape(4, 4, 4))
    assert big.count("<tr>") == 1 + 16 and "48 more ranks, not shown (rank 16 to 63)" in big
    widget = MeshWidget(4, 4, 4, devices_per_node=1)
    ax = widget.fig.axes[0]
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "colour = machine (1 device each)"
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[0] == "machine m0: rank 0" and labels[-1] == "… 48 more machines"
    assert sum("· m63" in t.get_text() for t in ax.texts) == 1  # every rank names its machine
    faces = {p.get_facecolor() for p in ax.patches if p.get_alpha() == 0.35}
    assert len(faces) == 64
    widget.per_node.value = 4
    assert [t.get_text() for t in widget.fig.axes[0].get_legend().get_texts()][1] == \
        "machine m1: ranks 4–7"
    one_row = MeshWidget(1, 4, 1, devices_per_node=2)  # a grid one rank high still names both machines
    assert [t.get_text() for t in one_row.fig.axes[0].get_legend().get_texts()] == \
        ["machine m0: ranks 0–1", "machine m1: ranks 2–3"]
