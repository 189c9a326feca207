"""The bubble widget of lesson 05: its pure functions on real ideal schedules, the Gantt drawing
and the widget's reactions (no processes: the "real run" is a callable returning a timeline in
seconds)."""

import pytest

from minitrain.planning.analysis import bubble_fraction
from minitrain.parallel.schedules import Action, ScheduleError, make_schedule, simulate
from minitrain.viz.pipeline import (BubbleWidget, bar_color, bubble_summary, gantt_figure,
                                    gantt_rows, ideal_timeline, plot_gantt)


def ideal(name, p, m, v=1):
    return simulate(make_schedule(name, p, m, v))


def test_gantt_rows_are_the_tables_actions_at_their_ideal_times():
    p, m = 3, 4
    table = make_schedule("gpipe", p, m)
    rows = gantt_rows(simulate(table), p)
    assert [r["rank"] for r in rows] == [0, 1, 2]
    fill = m + p - 1  # the last forward ends at M+P-1; then backwards (2 units each) drain back
    for rank, row in enumerate(rows):
        actions = [a for a in table[rank] if a is not None]
        assert [b["label"] for b in row["bars"]] == [f"{a.kind}{a.microbatch}" for a in actions]
        assert [(b["kind"], b["microbatch"], b["stage"], b["chunk"]) for b in row["bars"]] == \
            [(a.kind, a.microbatch, a.stage, 0) for a in actions]
        forwards = [b for b in row["bars"] if b["kind"] == "F"]
        backwards = [b for b in row["bars"] if b["kind"] == "B"]
        assert [(b["start"], b["end"]) for b in forwards] == \
            [(mb + rank, mb + rank + 1) for mb in range(m)]
        first_b = fill + 2 * (p - 1 - rank)
        assert [(b["start"], b["end"]) for b in backwards] == \
            [(first_b + 2 * k, first_b + 2 * k + 2) for k in range(m)]
        assert row["busy"] == 3 * m and row["idle_total"] == 3 * fill - 3 * m
    assert rows[0]["idle"] == [(m, fill + 2 * (p - 1))]  # rank 0 waits while the others turn round
    assert rows[2]["idle"] == [(0, 2), (fill + 2 * m, 3 * fill)]  # fills, then drains early


def test_idle_gaps_add_up_to_the_bubble():
    for name, p, m in [("gpipe", 3, 4), ("1f1b", 4, 6), ("gpipe", 5, 2), ("1f1b", 2, 1)]:
        timeline = ideal(name, p, m)
        rows = gantt_rows(timeline, p)
        makespan = max(e["end"] for e in timeline)
        idle = sum(e - s for r in rows for s, e in r["idle"])
        assert idle == pytest.approx(bubble_fraction(timeline, p) * p * makespan)
        for r in rows:  # gaps never overlap a bar and cover the rest of the window
            spans = sorted([(b["start"], b["end"]) for b in r["bars"]] + r["idle"])
            assert spans[0][0] == 0 and spans[-1][1] == makespan
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (3, 4), (4, 8), (8, 16)])
def test_ideal_bubble_equals_the_formula(name, p, m):
    s = bubble_summary(ideal(name, p, m), p, m)
    assert s["bubble"] == pytest.approx(s["formula"]) == pytest.approx((p - 1) / (m + p - 1))
    assert s["makespan"] == 3 * (m + p - 1)
    assert s["busy"] == {r: 3 * m for r in range(p)}
    assert sum(s["idle"].values()) == pytest.approx(s["bubble"] * p * s["makespan"])
    if name == "gpipe":  # every micro-batch's activations are held until backward starts
        assert s["peak_in_flight"] == {r: m for r in range(p)}
    else:  # 1F1B holds at most P micro-batches (P - rank on rank r)
        assert s["peak_in_flight"][0] == min(p, m)
        assert all(v <= p for v in s["peak_in_flight"].values())


def test_interleaved_chunks_and_microbatches_get_their_own_colours():
    p, m, v = 2, 4, 2
    timeline = ideal("interleaved", p, m, v)
    s = bubble_summary(timeline, p, m, v)
    assert s["formula"] == pytest.approx((p - 1) / (v * m + p - 1))
    bars = [b for r in gantt_rows(timeline, p) for b in r["bars"]]
    assert {b["chunk"] for b in bars} == {0, 1}
    assert all(b["chunk"] == b["stage"] // p and b["rank"] == b["stage"] % p for b in bars)
    f0 = {b["chunk"]: b["color"] for b in bars if b["kind"] == "F" and b["microbatch"] == 0}
    assert f0[0] != f0[1]
    shades = {b["color"] for b in bars if b["kind"] == "F" and b["chunk"] == 0}
    assert len(shades) == m  # one shade per micro-batch
    assert bar_color("F", 0, 4) != bar_color("B", 0, 4) != bar_color("W", 0, 4)
    assert bar_color("F", 0, 4) == "#4c72b0"  # the first micro-batch has the base colour


def test_plot_gantt_draws_one_bar_per_action_and_hatched_idle():
    p, m = 3, 4
    timeline = ideal("gpipe", p, m)
    fig = gantt_figure(timeline, p, title="gpipe")
    ax = fig.axes[0]
    assert len(ax.patches) == len(timeline) == 2 * p * m
    assert all(patch.get_gid() == "action" for patch in ax.patches)
    idle = [c for c in ax.collections if c.get_gid() == "idle"]
    assert len(idle) == p and all(c.get_hatch() == "///" for c in idle)
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    labels = {t.get_text() for t in ax.texts}
    assert {"F0", "B3"} <= labels
    assert ax.get_xlim() == (0, 18) and ax.get_title() == "gpipe"


def test_plot_gantt_draws_a_measured_timeline_in_ms():
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg")
    timeline = [dict(e, start=e["start"] * 1e-3, end=e["end"] * 1e-3, action=str(e["action"]))
                for e in ideal("1f1b", 2, 3)]  # seconds, actions as strings (report()'s form)
    ax = Figure().add_subplot()
    plot_gantt(ax, timeline, 2, unit="ms")
    assert len(ax.patches) == len(timeline)
    assert ax.get_xlim() == pytest.approx((0, 12))
    assert ax.get_xlabel() == "ms since the step started"
    with pytest.raises(ValueError, match="unit"):
        plot_gantt(ax, timeline, 2, unit="s")
    with pytest.raises(ValueError, match="stages=1"):
        gantt_rows(timeline, 1)


def test_widget_redraws_when_its_controls_change():
    w = BubbleWidget(stages=4, microbatches=8, schedule="1f1b")
    assert w.summary["bubble"] == pytest.approx(3 / 11) and w.error is None
    assert "ideal bubble" in w.text.value and "27.3%" in w.text.value
    assert w.image.value[:4] == b"\x89PNG" and w.chunks.disabled
    first_fig, first_png = w.fig, w.image.value
    w.microbatches.value = 4
    assert w.summary["microbatches"] == 4 and "42.9%" in w.text.value  # 3/7
    assert w.fig is not first_fig and w.image.value != first_png
    assert len(w.fig.axes[0].patches) == 2 * 4 * 4
    w.stages.value = 2
    assert w.summary["bubble"] == pytest.approx(1 / 5) and len(w.fig.axes[0].patches) == 16
    w.microbatches.value = 8
    w.schedule.value = "interleaved"  # V becomes usable, and at least 2
    assert not w.chunks.disabled and w.chunks.value == 2
    assert w.summary["chunks"] == 2 and w.summary["formula"] == pytest.approx(1 / 17)
    assert "(p−1)/(v·m+p−1)" in w.text.value
    w.schedule.value = "gpipe"
    assert w.chunks.disabled and w.summary["chunks"] == 1


@pytest.mark.parametrize("schedule, p, m, words", [
    ("naive", 4, 8, "Set micro-batches M to 1 (it is 8)"),
    ("interleaved", 4, 6, "Set micro-batches M to a multiple of 4, such as 4")])
def test_widget_says_why_a_combination_cannot_run_instead_of_a_plot(schedule, p, m, words):
    w = BubbleWidget(stages=p, microbatches=m)
    w.schedule.value = schedule
    with pytest.raises(ScheduleError):
        make_schedule(*w.config())
    assert words in w.error and w.fig is None and w.summary is None
    assert "mt-pipeline-refusal" in w.text.value and words in w.text.value
    assert "=" not in w.error  # the widget's words, not the API's "microbatches=1"
    assert w.image.layout.display == "none"
    w.schedule.value = "gpipe"  # a valid one brings the plot back
    assert w.error is None and w.image.layout.display != "none" and w.fig is not None


@pytest.mark.parametrize("n_layer, batch", [(None, None), (4, 16), (8, 3)])
def test_refusal_agrees_with_the_schedules_own_check(n_layer, batch):
    from minitrain.parallel.schedules import SCHEDULES, check_schedule
    from minitrain.viz.pipeline import refusal

    for name in SCHEDULES:
        for p in range(1, 9):
            for m in range(1, 17):
                for v in range(1, 5):
                    try:
                        check_schedule(name, p, m, v, n_layer=n_layer, batch=batch)
                        ok = True
                    except ScheduleError:
                        ok = False
                    why = refusal(name, p, m, v, n_layer=n_layer, batch=batch)
                    assert (why is None) == ok, (name, p, m, v, why)
                    assert why is None or "=" not in why, why


def fake_run(slow_backward=1.25, cluster=2):
    """A stand-in for the lesson's cluster run: the ideal timeline in seconds from 0.5 ms after
    t0, backwards slower and the last backward 1 ms late (a straggler), so the measured bubble is
    not the formula's."""
    calls = []

    def run(schedule, stages, microbatches, chunks):
        calls.append((schedule, stages, microbatches, chunks))
        if stages != cluster:
            raise ValueError(f"the cluster has {cluster} ranks: use stages={cluster}")
        table = make_schedule(schedule, stages, microbatches, chunks)
        costs = {"F": 1.0, "B": 2.0 * slow_backward, "I": 1.0, "W": 1.0}
        timeline = [dict(e, start=e["start"] * 1e-3 + 0.5e-3, end=e["end"] * 1e-3 + 0.5e-3)
                    for e in simulate(table, costs)]
        last = max(timeline, key=lambda e: e["end"])
        last["start"] += 1e-3
        last["end"] += 1e-3
        return timeline
    run.calls = calls
    return run


def test_run_button_draws_the_measured_timeline_and_its_bubble():
    run = fake_run()
    w = BubbleWidget(run=run, stages=2, microbatches=4, schedule="gpipe")
    assert w.measured_image.layout.display == "none" and w.measured_summary is None
    w.run_button.click()
    assert run.calls == [("gpipe", 2, 4, 1)]
    expected = run("gpipe", 2, 4, 1)
    s = w.measured_summary
    assert s["bubble"] == pytest.approx(bubble_fraction(expected, 2))
    assert s["formula"] == pytest.approx(1 / 5) and s["bubble"] != pytest.approx(s["formula"])
    assert f"measured bubble <span class=\"mt-bubble-value\">{100 * s['bubble']:.1f}%" in \
        w.measured_text.value
    span = max(e["end"] for e in expected) - min(e["start"] for e in expected)
    assert f"makespan {span * 1e3:.1f} ms" in w.measured_text.value
    ax = w.measured_fig.axes[0]
    assert ax.get_xlim() == pytest.approx((0.5, 0.5 + span * 1e3))
    assert len(ax.patches) == len(expected) and ax.get_xlabel() == "ms since the step started"
    assert w.measured_image.value[:4] == b"\x89PNG" and w.measured_image.layout.display != "none"
    assert "ideal bubble" in w.text.value  # the ideal one is still there


def test_run_button_shows_the_runs_error_for_another_p():
    run = fake_run(cluster=2)
    w = BubbleWidget(run=run, stages=3, microbatches=4, schedule="1f1b")
    w.run_button.click()
    assert run.calls == [("1f1b", 3, 4, 1)]
    assert w.measured_error == "The run on the real ranks failed: the cluster has 2 ranks: use stages=2"
    assert "use stages=2" in w.measured_text.value and "mt-pipeline-error" in w.measured_text.value
    assert w.measured_fig is None and w.measured_image.layout.display == "none"
    assert not w.run_button.disabled  # a failed run does not lock the button


def test_widget_knowing_the_cluster_size_does_not_call_run_for_another_p():
    run = fake_run(cluster=2)
    w = BubbleWidget(run=run, stages=4, microbatches=4, ranks=2)
    assert "P = 2" in w.run_button.description
    assert w.run_button.disabled and "set stages P = 2" in w.run_note.value
    w.run_measured()
    assert run.calls == [] and "set stages P = 2" in w.measured_text.value
    w.stages.value = 2
    assert not w.run_button.disabled and w.run_note.value == ""
    w.run_button.click()
    assert run.calls == [("1f1b", 2, 4, 1)] and w.measured_summary["stages"] == 2


def test_run_button_is_disabled_for_what_the_model_or_batch_cannot_run():
    run = fake_run(cluster=2)
    w = BubbleWidget(run=run, stages=2, microbatches=4, ranks=2, n_layer=4, batch=3)
    assert w.run_button.disabled and "The batch has 3 samples" in w.run_note.value
    w.microbatches.value = 2
    assert not w.run_button.disabled
    w.schedule.value = "interleaved"
    w.chunks.value = 3
    assert w.run_button.disabled and "set chunks V to 2 or fewer" in w.run_note.value
    assert w.fig is not None  # the ideal schedule is still drawn: only the model is too small
    w.chunks.value = 2
    assert not w.run_button.disabled and w.run_note.value == ""


def test_a_refused_run_teaches_the_widget_the_models_limit():
    """Not told n_layer, the widget runs V = 4 on a 4-layer model; the ranks refuse it (in the
    CLI's words); the widget says why in its own and disables the button for such settings."""
    from minitrain.runtime.launch import RankError

    calls = []

    def run(schedule, stages, microbatches, chunks):
        calls.append(chunks)
        if stages * chunks > 4:
            raise RankError(0, "ConfigError: --stages 2 x --chunks 4 = 8 pipeline stages but the "
                            "model has 4 layers; use --n-layer 8 or more, or fewer stages/chunks",
                            "Traceback (most recent call last):\n  ...", "ConfigError")
        return fake_run()(schedule, stages, microbatches, chunks)

    w = BubbleWidget(run=run, stages=2, microbatches=4, schedule="interleaved", ranks=2)
    w.chunks.value = 4
    assert not w.run_button.disabled
    w.run_button.click()
    assert calls == [4] and w.n_layer == 4
    assert w.measured_text.value == ""  # said once, beside the button
    for text in (w.measured_error, w.run_note.value):
        assert "The model has 4 layers" in text and "set chunks V to 2 or fewer" in text
        assert "--n-layer" not in text and "Traceback" not in text
    assert w.run_button.disabled
    w.chunks.value = 2
    w.run_button.click()
    assert calls == [4, 2] and w.measured_summary["chunks"] == 2


def test_a_measurement_under_changed_controls_is_marked_and_faded():
    w = BubbleWidget(run=fake_run(), stages=2, microbatches=4, schedule="gpipe", ranks=2)
    w.run_button.click()
    fresh = w.measured_image.value
    assert "mt-bubble-stale" not in w.measured_text.value
    w.microbatches.value = 8
    assert "mt-bubble-stale" in w.measured_text.value
    assert "Measured earlier for gpipe, P = 2, M = 4" in w.measured_text.value
    assert w.measured_image.value != fresh and w.measured_summary["microbatches"] == 4
    w.microbatches.value = 4  # back to the measured setting: no longer marked
    assert "mt-bubble-stale" not in w.measured_text.value and w.measured_image.value == fresh


def test_the_button_is_disabled_while_its_run_runs_and_a_click_meanwhile_is_ignored():
    seen = []

    def run(*args):
        seen.append((w.run_button.disabled, w.run_button.description))
        w.run_button.click()  # a second click while running: ignored
        return fake_run()(*args)

    w = BubbleWidget(run=run, stages=2, microbatches=4, schedule="gpipe", ranks=2)
    w.run_button.click()
    assert seen == [(True, "Running…")]
    assert not w.run_button.disabled and w.run_button.description == "Run on real ranks (P = 2)"


def test_widget_without_run_has_no_button():
    w = BubbleWidget()
    assert not hasattr(w, "run_button")
    with pytest.raises(RuntimeError, match="run callable"):
        w.run_measured()


def test_string_actions_are_parsed_and_bad_ones_refused():
    timeline = ideal("1f1b", 2, 2)
    as_str = [dict(e, action=str(e["action"])) for e in timeline]
    assert bubble_summary(as_str, 2, 2) == bubble_summary(timeline, 2, 2)
    assert str(Action("F", 3, 1)) == "F3@s1"
    with pytest.raises(ValueError, match="not an action"):
        gantt_rows([dict(timeline[0], action="X1")], 2)


def test_a_refused_or_failed_run_keeps_the_last_measurement_marked():
    def run(schedule, stages, microbatches, chunks):
        if microbatches == 8:
            raise RuntimeError("rank 1 failed: the ranks lost each other\n\n--- traceback from "
                               "rank 1 ---\nTraceback (most recent call last): ...")
        return fake_run()(schedule, stages, microbatches, chunks)

    w = BubbleWidget(run=run, stages=2, microbatches=4, schedule="gpipe", ranks=2, batch=8)
    w.run_button.click()
    w.microbatches.value = 8
    w.run_button.click()
    text = w.measured_text.value
    assert "The run on the real ranks failed: the ranks lost each other" in text
    assert "Traceback" not in text and "rank 1 failed" not in text
    assert "mt-bubble-stale" in text and w.measured_summary["microbatches"] == 4
    assert w.measured_image.layout.display != "none" and not w.run_button.disabled
    w.microbatches.value = 16  # more than the batch: refused beside the button, chart kept
    assert w.run_button.disabled and "The batch has 8 samples" in w.run_note.value
    w.run_measured()
    assert "The batch has 8 samples" in w.measured_text.value
    assert "mt-bubble-stale" in w.measured_text.value


def test_interleaved_chunks_take_their_share_of_a_stage_on_the_drawn_time_axis():
    """A chunk holds 1/v of a stage's layers: drawn with a whole unit per chunk, interleaving
    would look slower than 1F1B, when it is faster (same bubble fraction either way)."""
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.use("Agg")
    p, m, v = 4, 8, 2
    flat, inter = ideal_timeline("1f1b", p, m), ideal_timeline("interleaved", p, m, v)
    assert flat == ideal("1f1b", p, m)
    span = lambda tl: max(e["end"] for e in tl)  # noqa: E731
    assert span(inter) < span(flat) == 3 * (m + p - 1)
    assert bubble_fraction(inter, p) == pytest.approx(bubble_fraction(ideal("interleaved", p, m, v), p))
    ax = Figure().add_subplot()
    plot_gantt(ax, inter, p)
    assert ax.get_xlabel() == "time (a stage's F = 1, B = 2 units; each of its 2 chunks takes 1/2 of that)"
    plot_gantt(ax, ideal("interleaved", p, m, v), p)  # one unit per chunk: the label says so
    assert ax.get_xlabel() == "time (F = 1, B = 2, I = W = 1 unit per chunk)"
    w = BubbleWidget(stages=p, microbatches=m, schedule="interleaved")
    assert w.summary["makespan"] == span(inter) and "makespan 28.5 units" in w.text.value
