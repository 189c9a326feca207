"""The projection widget: what it draws for a DDP, a pipeline and a tensor-parallel run —
the measured step and the projected one in the lesson's own form, the step's parts, the summary
naming the cluster, the model and the sources — the messages in place of a projection, and the
widget's reactions to its controls (re-projecting the one recorded run, never training again)."""

import html
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from minitrain import train
from minitrain.planning.clusters import get_cluster
from minitrain.planning.projection import MODEL_SIZES, pipeline_timeline, project
from minitrain.record import Layout
from minitrain.viz.projection import (ProjectionWidget, kind_bar_html, kind_parts,
                                      projection_figure, projection_view,
                                      step_parts, stream_rows, summary_html)


@pytest.fixture(scope="module")
def runs(clusters):
    c = clusters(2)
    return {
        "ddp": train(strategy="ddp", world_size=2, steps=3, batch_size=8, cluster=c,
                     options={"timeline": True, "bucket_mb": 0.2}, record_events=True),
        "pipeline": train(strategy="pipeline", world_size=2, steps=2, batch_size=8, cluster=c,
                          options={"schedule": "gpipe", "microbatches": 4}, record_events=True),
        "tensor": train(strategy="tensor", world_size=2, steps=3, batch_size=4, cluster=c,
                        record_events=True),
    }


def _parts_add_up(view):
    p = view["projection"]
    assert sum(x["seconds"] for x in view["parts"]) == pytest.approx(p.step_time_s)
    assert [x["name"] for x in view["parts"]] == ["compute", "exposed communication", "bubble",
                                                  "idle"]


def _names_cluster_model_and_sources(view, cluster, size):
    text = view["html"]
    spec = get_cluster(cluster)
    assert spec.title in text and f"as <b>{size}" in text
    assert all(html.escape(source) in text for source in spec.row()["sources"])
    assert "measured here" in text and "per step" in text
    assert ("fits" in text) or ("does not fit" in text)


def test_a_ddp_run_is_drawn_as_backward_and_buckets_measured_and_projected(runs):
    run = runs["ddp"]
    view = projection_view(run, "dgx-h100", "1.3b")
    assert view["message"] is None and view["kind"] == "ddp"
    measured, projected = view["measured"], view["projected"]
    assert [r["rank"] for r in measured] == [r["rank"] for r in projected] == [0, 1]
    buckets = run.summary.report[0]["bucket_bytes"]
    assert len(measured[0]["buckets"]) == len(projected[0]["buckets"]) == len(buckets)
    # measured: the tiny model's fp32 gradients; projected: the 1.3B model's in bf16, each once
    assert sum(b[3] for b in measured[0]["buckets"]) == pytest.approx(sum(buckets))
    assert sum(b[3] for b in projected[0]["buckets"]) == pytest.approx(
        2 * MODEL_SIZES["1.3b"].num_params())
    p = view["projection"]
    assert projected[0]["backward"][1] <= p.step_time_s * 1e3
    assert view["measured_step_ms"] == pytest.approx(p.replay["measured"] * 1e3)
    _parts_add_up(view)
    _names_cluster_model_and_sources(view, "dgx-h100", "1.3b")


def test_a_pipeline_run_is_drawn_as_two_gantt_charts_with_the_same_actions(runs):
    view = projection_view(runs["pipeline"], "ib-h100x2", "7b")
    assert view["message"] is None and view["kind"] == "pipeline"
    assert [e["action"] for e in view["projected"]] == [e["action"] for e in view["measured"]]
    assert view["projection"].bubble_s > 0
    _parts_add_up(view)
    _names_cluster_model_and_sources(view, "ib-h100x2", "7b")
    fig = projection_figure(view)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("measured here")
    assert titles[1].startswith("projected on ib-h100x2 as 7b")
    assert titles[2] == "the projected step's parts"


def test_any_other_strategy_is_drawn_as_compute_and_communication_streams(runs):
    run = runs["tensor"]
    view = projection_view(run, "dgx-a100", "own")
    assert view["message"] is None and view["kind"] == "streams"
    p = view["projection"]
    assert p.model.startswith("the run's own")
    for rank, (mine, theirs) in enumerate(zip(view["measured"], view["projected"])):
        timeline = [e for e in p.timeline[rank] if e["op"] != "compute"]
        # the same communications, measured and projected; the projected ones as replayed
        assert len(mine["comm"]) == len(theirs["comm"]) == len(timeline)
        assert sorted(c[3] for c in theirs["comm"]) == sorted(e["bytes"] for e in timeline)
        assert {c[2] for c in theirs["comm"]} == {"world"}  # the tensor-parallel group
        # the projected compute is the replay's: its mean over ranks is the step's compute part
        measured_span = max(c[1] for c in mine["compute"] + [(0, 0)] + mine["comm"])
        assert measured_span <= view["measured_step_ms"] * 1.001
    busy = [sum(b - a for a, b, _ in r["compute"]) for r in view["projected"]]
    assert sum(busy) / len(busy) == pytest.approx(p.compute_s * 1e3)
    assert stream_rows(run, p, measured=False) == view["projected"]


def test_what_cannot_be_projected_gets_a_sentence_not_a_chart(runs):
    run = runs["ddp"]
    apart = Layout(free_running="its ranks run their own loops")
    cases = [(replace(run, events=None), "dgx-h100", "1.3b", "kept no events"),
             (replace(run, summary=replace(run.summary, layout=apart)), "dgx-h100", "1.3b",
              "cannot be projected"),
             (run, "eth-25gx1", "own", "do not fit"),
             (run, "nowhere", "own", "unknown cluster 'nowhere'")]
    for result, cluster, size, words in cases:
        view = projection_view(result, cluster, size)
        assert words in view["message"], view["message"]
        assert projection_figure(view) is None
        assert "mt-projection-note" in summary_html(view)
        assert html.escape(words) in summary_html(view)


def test_the_step_parts_are_the_projections_own():
    p = SimpleNamespace(step_time_s=2.0, compute_s=1.0, exposed_comm_s=0.5, bubble_s=0.25,
                        idle_s=0.25)
    assert [(x["name"], x["share"]) for x in step_parts(p)] == [
        ("compute", 0.5), ("exposed communication", 0.25), ("bubble", 0.125), ("idle", 0.125)]


def test_the_time_by_kind_is_drawn_as_one_bar_of_the_projections_own_shares(runs):
    p = SimpleNamespace(step_time_s=2.0, time_by_kind={
        "gemm": 1.0, "attention": 0.25, "memory": 0.25, "optimizer": 0.0, "launch": 0.0,
        "exposed_comm": 0.5, "bubble": 0.0, "idle": 0.0})
    parts = kind_parts(p)
    assert [(x["name"], x["share"]) for x in parts] == [
        ("GEMMs", 0.5), ("attention", 0.125), ("memory-bound kernels", 0.125),
        ("exposed communication", 0.25)]  # kinds that take no time are left out
    bar = kind_bar_html(parts)
    assert bar.count("width:") == 5 and "width:50.00%" in bar and "width:25.00%" in bar
    view = projection_view(runs["ddp"], "dgx-h100", "1.3b", stack="eager")
    assert view["projection"].stack == "eager" and "mt-projection-kinds" in view["html"]
    assert "<code>eager</code> stack" in view["html"]
    assert sum(x["share"] for x in view["kinds"]) == pytest.approx(1.0)


def test_the_widget_re_projects_the_recorded_run_at_every_change(runs, monkeypatch):
    import minitrain.viz.projection as module

    calls = []
    real = module.projection_view
    monkeypatch.setattr(module, "projection_view",
                        lambda *a, **kw: calls.append(a[1:]) or real(*a, **kw))
    w = ProjectionWidget(runs["tensor"])
    assert (w.cluster.value, w.model.value) == ("dgx-h100", "1.3b")
    assert "local" not in w.cluster.options  # this run was not calibrated
    first_png, first_text = w.image.value, w.text.value
    assert get_cluster("dgx-h100").title in first_text
    w.cluster.value = "eth-25g"
    assert w.image.value != first_png and get_cluster("eth-25g").title in w.text.value
    w.model.value = "own"
    assert "the run&#x27;s own" in w.text.value
    w.model.value, w.cluster.value = "1.3b", "dgx-h100"  # through settings seen before
    assert w.text.value == first_text
    assert calls == [("dgx-h100", "1.3b"), ("eth-25g", "1.3b"), ("eth-25g", "own")]  # cached
    assert w.view["projection"].step_time_s == pytest.approx(
        project(runs["tensor"], "dgx-h100", "1.3b").step_time_s)


def test_degrees_re_project_the_run_on_a_bigger_mesh_as_the_lesson_does(runs):
    """``degrees={"dp": 8}`` reaches the projection: the 2 ranks stand for 8 replicas, each
    bucket's all-reduce runs over a ring of 8 (longer than over 2), and the summary says so."""
    run = runs["ddp"]
    plain = projection_view(run, "dgx-h100", "1.3b")
    eight = projection_view(run, "dgx-h100", "1.3b", degrees={"dp": 8})
    assert (plain["devices"], eight["devices"]) == (2, 8)
    assert plain["projection"].degrees is None and eight["projection"].degrees == {"dp": 8}
    assert "on 2 devices" in re.sub("<[^>]+>", "", plain["html"])
    assert "on 8 devices (the run's 2 ranks drawn, standing for data parallelism of 8)" in \
        html.unescape(re.sub("<[^>]+>", "", eight["html"]))

    def allreduce_ms(view):
        return sum(b1 - b0 for row in view["projected"] for _, b0, b1, _ in row["buckets"])
    assert allreduce_ms(eight) > allreduce_ms(plain) > 0
    # the same numbers the lesson's own call gives
    p = project(run, "dgx-h100", "1.3b", degrees={"dp": 8})
    assert eight["projection"].step_time_s == p.step_time_s
    assert eight["projection"].exposed_comm_s == p.exposed_comm_s
    assert "(8 devices, 2 drawn)" in projection_figure(eight).axes[1].get_title()
    # a mesh bigger than the cluster is a sentence, not a chart
    assert "do not fit" in projection_view(run, "dgx-h100", "1.3b", degrees={"dp": 64})["message"]


def test_even_reaches_a_pipelines_projection(runs):
    run = runs["pipeline"]
    even = projection_view(run, "dgx-h100", "1.3b", even=True)
    timeline, p = pipeline_timeline(run, "dgx-h100", "1.3b", even=True)
    assert even["projected"] == timeline and even["projection"].step_time_s == p.step_time_s
    assert even["projected"] != projection_view(run, "dgx-h100", "1.3b", even=False)["projected"]
    # by default as the CLI projects it: GPipe's 4 equal micro-batches do equal work
    assert projection_view(run, "dgx-h100", "1.3b")["projected"] == timeline


def test_the_widget_keeps_its_projection_options_at_every_setting(runs):
    w = ProjectionWidget(runs["ddp"], "dgx-h100", "1.3b", degrees={"dp": 8})
    assert w.view["devices"] == 8
    w.cluster.value, w.model.value = "ib-h100", "7b"
    assert w.view["devices"] == 8 and w.view["projection"].degrees == {"dp": 8}
    assert w.view["projection"].step_time_s == project(
        runs["ddp"], "ib-h100", "7b", degrees={"dp": 8}).step_time_s


def test_a_widget_says_why_instead_of_drawing(runs):
    w = ProjectionWidget(replace(runs["ddp"], events=None))
    assert "kept no events" in w.text.value and w.image.layout.display == "none"


def test_a_calibrated_run_is_also_offered_on_this_machine(runs):
    """A run trained with project="local" carries this machine's calibration: the widget offers
    this machine and Binder beside the presets, and replays the run's own compute there."""
    run = runs["tensor"]
    calibration = {"ranks": 2, "cores": 2, "alpha": 2e-5, "beta": 1e-9, "flop_rate": 5e9,
                   "memory_rate": 5e9}
    calibrated = replace(run, summary=replace(run.summary, calibration=calibration))
    w = ProjectionWidget(calibrated, "local", "own")
    assert {"local", "binder"} <= set(w.cluster.options)
    p = w.view["projection"]
    assert p.cluster == "local" and p.compute_mode == "measured"
    assert "per device at most" in w.text.value and "of 80 GB" not in w.text.value
