"""The projection: the replay's rules on hand-made event logs, the scaling of every message
to a bigger model, the refusals, and the surfaces (train(project=...), the CLI's JSON, clusters).
Behaviour only: no test asserts how long anything took here."""

import functools
import json
import math
import re
import statistics
import subprocess
import sys

from dataclasses import replace
from types import SimpleNamespace

import pytest

from minitrain import train
from minitrain.planning import clusters as clusters_module
from minitrain.planning.clusters import PRESETS, calibrate_here, describe, get_cluster
from minitrain.planning.kernels import STACKS, gemm_seconds, rank_compute
from minitrain.planning.recorded import windows
from minitrain.cli import format_clusters, main
from minitrain.model import GPTConfig, PRESETS as MODELS, training_flops
from minitrain.record import Layout
from minitrain.strategies import TrainConfig, get_strategy
from minitrain.planning.projection import (KINDS, MODEL_SIZES, Instance, Op, ReplayError, breakdown,
                                  check_projection, ddp_timeline, even_work, pipeline_timeline,
                                  project, rank_work, replay, target_model)
from minitrain.viz.pipeline import bubble_summary
from minitrain.viz.timeline import timeline_rows

C = Op  # shorthand for the hand-made programs


def compute(seconds):
    return Op("compute", seconds)


def issue(key):
    return Op("issue", 0.0, key)


def wait(key):
    return Op("wait", 0.0, key)


def coll(name, members, seconds):
    return Instance("all_reduce", tuple(members), 0.0, seconds=seconds)


# --------------------------------------------------------------------------------------------------
# The replay's rules, on hand-made logs
# --------------------------------------------------------------------------------------------------


def test_compute_that_overlaps_a_collective_runs_on_the_sms_nccl_leaves():
    """A span half overlapped by a collective is lengthened by half of sms/(sms - comm_sms) - 1;
    a span nothing overlaps, and one beside a point-to-point message, keep their time."""
    from minitrain.planning.projection import _overlap_stretch
    c, p = ("c", (0,), 0), ("p", 0, 1, 0)
    programs = {0: [issue(c), compute(1.0), wait(c), compute(1.0)],
                1: [issue(p), compute(1.0), wait(p)]}
    instances = {c: coll("x", (0,), 0.5), p: Instance("send", (1, 0), 0.0, seconds=0.5)}
    programs[0].insert(0, wait(p))  # rank 0 receives the message first
    programs[0].insert(0, issue(p))
    out = replay(programs, instances, issue_cost=False)
    stretch = _overlap_stretch(programs, instances, out, 1.25)
    spans = [op for op in programs[0] if op.kind == "compute"]
    assert stretch[id(spans[0])] == pytest.approx(1 + 0.25 * 0.5)
    assert stretch.get(id(spans[1]), 1.0) == 1.0
    assert stretch.get(id(programs[1][1]), 1.0) == 1.0


def test_a_collective_starts_when_its_last_member_issues_it():
    key = ("c", (0, 1), 0)
    programs = {0: [compute(1.0), issue(key), wait(key), compute(0.5)],
                1: [compute(3.0), issue(key), wait(key), compute(0.5)]}
    out = replay(programs, {key: coll("x", (0, 1), 0.25)})
    assert out["comm"][key] == pytest.approx((3.0, 3.25))
    assert out["ranks"][0]["end"] == out["ranks"][1]["end"] == pytest.approx(3.75)
    parts = breakdown(out)
    # rank 0 waited 2.25 s: 2 s for rank 1 (idle), 0.25 s for the all-reduce itself (exposed)
    assert parts["exposed_comm_s"] == pytest.approx(0.25)
    assert parts["idle_s"] == pytest.approx(1.0)  # mean over the two ranks: (2 + 0) / 2
    assert parts["compute_s"] + parts["exposed_comm_s"] + parts["idle_s"] == pytest.approx(3.75)


@pytest.mark.parametrize("cost, end, hidden", [(0.5, 3.0, 1.0), (5.0, 6.0, 0.4)])
def test_a_wait_blocks_and_overlap_hides_exactly_what_the_timeline_says(cost, end, hidden):
    """Issued at 1 s, then 2 s of compute, then waited for: a 0.5 s all-reduce is hidden entirely,
    a 5 s one for the 2 s of compute that ran beside it."""
    key = ("c", (0, 1), 0)
    prog = [compute(1.0), issue(key), compute(2.0), wait(key)]
    out = replay({0: list(prog), 1: list(prog)}, {key: coll("x", (0, 1), cost)})
    assert out["step_time"] == pytest.approx(end)
    assert out["comm"][key] == pytest.approx((1.0, 1.0 + cost))
    parts = breakdown(out)
    assert parts["hidden_comm_share"] == pytest.approx(hidden)
    assert parts["exposed_comm_s"] == pytest.approx(max(0.0, cost - 2.0))
    waits = [s for s in out["ranks"][0]["segments"] if s["kind"] == "wait"]
    assert waits[0]["end"] - waits[0]["start"] == pytest.approx(max(0.0, cost - 2.0))


def test_a_message_arrives_one_transfer_after_its_send():
    key = ("p", 0, 1, 0, 0)
    programs = {0: [compute(2.0), issue(key), compute(1.0), wait(key)],
                1: [issue(key), compute(0.5), wait(key), compute(1.0)]}
    inst = Instance("send", (0, 1), 1e6, seconds=0.75)
    out = replay(programs, {key: inst})
    assert out["comm"][key] == pytest.approx((2.0, 2.75))  # posted at 0 and 2: starts at 2
    assert out["ranks"][1]["end"] == pytest.approx(3.75)  # waited from 0.5 to 2.75, then 1 s
    assert out["ranks"][0]["end"] == pytest.approx(3.0)


def test_a_group_runs_its_collectives_one_after_another():
    a, b = ("c", (0, 1), 0), ("c", (0, 1), 1)
    prog = [issue(a), issue(b), wait(a), wait(b)]
    out = replay({0: list(prog), 1: list(prog)}, {a: coll("a", (0, 1), 1.0), b: coll("b", (0, 1), 1.0)})
    assert out["comm"][b] == pytest.approx((1.0, 2.0))  # the stream is busy until a is done


def test_a_wait_for_something_a_member_never_issues_is_reported_not_hung():
    key = ("c", (0, 1), 0)
    with pytest.raises(ReplayError, match=r"rank 0 waits for all_reduce .* rank\(s\) \[1\]"):
        replay({0: [issue(key), wait(key)], 1: [compute(1.0)]}, {key: coll("x", (0, 1), 1.0)})


def test_the_measured_compute_is_replayed_as_measured_and_priced_by_a_compute_function():
    out = replay({0: [compute(1.0), compute(2.0)]}, {}, compute=lambda r, op: op.seconds / 10)
    assert out["step_time"] == pytest.approx(0.3)


# --------------------------------------------------------------------------------------------------
# Clusters and model sizes
# --------------------------------------------------------------------------------------------------


def test_every_preset_says_where_its_numbers_come_from():
    rows = {r["cluster"]: r for r in describe()}
    assert {"dgx-a100", "dgx-h100", "ib-a100", "ib-h100", "eth-25g", "local", "binder"} <= set(rows)
    for key, spec in PRESETS.items():
        row = rows[key]
        assert row["peak_tflops"] > 0 and row["sms"] > 0 and 0 < row["mamf_tflops"] < row["peak_tflops"]
        assert 0 < row["achievable_bw_gbps"] <= row["memory_bw_gbps"] and row["launch_us"] > 0
        assert "sustained_fraction" not in row  # no training run sets a rate
        assert all(len(src) > 20 for src in row["sources"])
    assert "datasheet" in rows["dgx-h100"]["sources"][0] and "MAMF" in rows["dgx-h100"]["sources"][0]
    assert "nccl-tests" in rows["dgx-h100"]["sources"][1]
    assert get_cluster("ib-h100x8").devices == 64


def test_clusters_says_how_to_measure_this_machine_and_starts_nothing(no_spawn, capsys):
    assert main(["clusters"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("local", "binder"):
        at = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
        assert "numbers:" in lines[at + 1] and "'minitrain clusters --calibrate'" in lines[at + 1]
    with pytest.raises(SystemExit) as info:
        main(["clusters", "--calibrate", "--ranks", "1"])
    assert info.value.code == 2 and "at least 2 ranks" in capsys.readouterr().err
    # too many ranks for the cores is refused before any rank starts (no_spawn), naming the bound
    with pytest.raises(SystemExit) as info:
        main(["clusters", "--calibrate", "--ranks", "1000"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--ranks 1000: at most" in err and "core(s)" in err


def test_clusters_calibrate_lists_this_machine_measured_on_the_spot(clusters, monkeypatch, capsys):
    """`--calibrate` prints the FLOP rate per rank and lesson 01's α-β, measured now on running
    ranks (here the fixture's, standing in for the two it would start), and Binder's from them."""
    monkeypatch.setattr(clusters_module, "calibrate_here",
                        functools.partial(calibrate_here, cluster=clusters(2)))
    assert main(["clusters", "--calibrate", "--json"]) == 0
    rows = {r["cluster"]: r for r in json.loads(capsys.readouterr().out)}
    local, binder = rows["local"], rows["binder"]
    assert local["ranks"] == binder["ranks"] == 2
    for row in (local, binder):
        assert row["flop_rate_per_rank_gflops"] > 0 and row["memory_bw_per_rank_gbps"] > 0
        assert math.isfinite(row["alpha_us"]) and row["alpha_us"] >= 0
        assert 0 < row["beta_s_per_byte"] < 1e-6 and row["p2p_alpha_us"] > 0
        assert len(row["derived"]) > 40
    # Binder: this machine's rate per core on one core that both ranks share, its α-β, 2 GB
    assert binder["peak_tflops"] == local["peak_tflops"]
    assert binder["flop_rate_per_rank_gflops"] == pytest.approx(binder["peak_tflops"] * 1e3 / 2)
    assert (binder["alpha_us"], binder["beta_s_per_byte"]) == (local["alpha_us"],
                                                                local["beta_s_per_byte"])
    assert binder["memory_gb"] == 2.0 and "not measured on Binder" in binder["derived"]
    text = format_clusters(list(rows.values()))  # what `minitrain clusters --calibrate` prints
    assert re.search(r"^local .*\n +[\d,.]+ GFLOP/s per rank \(2 ranks on \d+ core\(s\)\).* α "
                     r"[\d,.]+ µs per ring step, β [\d.]+ ns/byte", text, re.MULTILINE)
    assert "how: measured now with 2 ranks at once" in text


def test_a_group_that_leaves_the_node_pays_the_network():
    spec = get_cluster("ib-h100x2")
    inside = spec.seconds("all_reduce", 1e9, [0] * 8)
    across = spec.seconds("all_reduce", 1e9, [0] * 4 + [1] * 4)
    one_per_node = spec.seconds("all_reduce", 1e9, [0, 1])
    assert inside < across < one_per_node
    assert spec.placement(16) == [0] * 8 + [1] * 8 and spec.placement(2) == [0, 1]


def test_model_sizes_are_the_published_shapes():
    assert MODEL_SIZES["1.3b"].num_params() == pytest.approx(1.3e9, rel=0.1)
    assert MODEL_SIZES["7b"].num_params() == pytest.approx(6.7e9, rel=0.05)
    moe = target_model("1.3b", MODELS["tiny-moe"])
    assert (moe.n_expert, moe.top_k) == (4, 2) and moe.ff == moe.d_model * 2


def test_training_flops_are_narayanans_formula():
    cfg = GPTConfig(vocab_size=51200, seq_len=2048, n_layer=24, n_head=24, d_model=2304)
    L, h, s, V = 24, 2304, 2048, 51200
    assert training_flops(cfg, 1) == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))
    assert training_flops(cfg, 1, recompute=True) == pytest.approx(
        96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)))


# --------------------------------------------------------------------------------------------------
# Refusals, before any process starts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("project_, as_model, kw, message", [
    ("dgx-h200", None, {}, "unknown cluster 'dgx-h200' (did you mean 'dgx-h100'?); choose one of: dgx-a100, dgx-h100"),
    ("dgx-h100", "70b", {}, "unknown model size '70b'; choose one of: gpt2, 1.3b"),
    (None, "7b", {}, "--as-model needs --project"),
    ("dgx-h100", None, {"strategy": "ps-sync", "world_size": 3}, "cannot be projected"),
    ("dgx-h100", "1.3b", {"strategy": "ps-async", "world_size": 3},
     "strategy 'ps-async' cannot be projected: the asynchronous parameter server's workers never "
     "step together"),
    ("dgx-h100", None, {"strategy": "ddp", "world_size": 16}, "do not fit"),
    ("dgx-h100", "1.3b", {"strategy": "tensor", "world_size": 3}, "do not split over tensor"),
    ("local", "1.3b", {"strategy": "pipeline", "world_size": 2,
                       "model": GPTConfig(n_layer=2)}, None),
])
def test_impossible_projections_are_refused_naming_the_choices(project_, as_model, kw, message):
    """Refused by the layout the strategy declares (``Strategy.layout(cfg)``)."""
    cfg = TrainConfig(strategy=kw.get("strategy", "single"), world_size=kw.get("world_size", 1))
    layout = get_strategy(cfg.strategy).layout(cfg)
    kw = {**kw, "strategy": cfg.strategy}
    if message is None:
        check_projection(project_, as_model, layout, **kw)  # possible: no error
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        check_projection(project_, as_model, layout, **kw)


def test_the_cli_refuses_a_projection_before_any_process_starts(no_spawn, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--strategy", "ddp", "--world-size", "2", "--project", "nowhere"])
    assert info.value.code == 2
    assert "unknown cluster 'nowhere'; choose one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown cluster"):
        train(strategy="ddp", world_size=2, project="nowhere")
    # the free-running parameter servers say why, from the CLI and from Python
    with pytest.raises(SystemExit) as info:
        main(["train", "--strategy", "ps-async", "--world-size", "3", "--project", "dgx-h100"])
    assert info.value.code == 2
    assert "'ps-async' cannot be projected: the asynchronous" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'ps-async' cannot be projected"):
        train(strategy="ps-async", world_size=3, project="dgx-h100", as_model="1.3b")
    # a stack that does not exist, or one without a projection to price
    with pytest.raises(SystemExit) as info:
        main(["train", "--strategy", "ddp", "--world-size", "2", "--project", "dgx-h100",
              "--stack", "fast"])
    assert info.value.code == 2
    assert "unknown stack 'fast' (did you mean 'flash'?); choose one of: eager" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="--stack needs --project CLUSTER"):
        train(strategy="ddp", world_size=2, stack="eager")


# --------------------------------------------------------------------------------------------------
# Real runs: recording, scaling, the surfaces
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_run(clusters):
    return train(strategy="ddp", world_size=2, steps=3, batch_size=8, cluster=clusters(2),
                 project="dgx-h100", as_model="1.3b")


def test_fits_counts_activation_recomputation(clusters):
    """A 7B model on 2 devices with ZeRO-3 and 4 sequences each does not fit 80 GB keeping every
    activation, and fits recomputing them: each layer keeps its input alone, 2·s·b·h bytes, not
    s·b·h·(34 + 5·a·s/h) (Korthikanti et al., 2022)."""
    run = train(strategy="zero3", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                record_events=True)
    kept, again = (project(run, "dgx-h100", "7b", recompute=r) for r in (None, True))
    cfg = MODEL_SIZES["7b"]
    ratio = 2 / (34 + 5 * cfg.n_head * cfg.seq_len / cfg.d_model)
    assert again.memory[0]["activations"] == pytest.approx(kept.memory[0]["activations"] * ratio)
    assert kept.fits is False and again.fits is True
    assert again.step_time_s > kept.step_time_s  # the forward again


def test_degrees_that_are_not_a_mesh_are_refused_saying_what_they_take(ddp_run):
    """``degrees`` take an axis ("dp" or "tp") and a whole number of devices; anything else is one
    ValueError naming it (0 is not "unset"; 2.5 and "8" are not a number of devices)."""
    for bad, said in [({"dp": 0}, "got 0"), ({"dp": 2.5}, "got 2.5"), ({"dp": "8"}, "got '8'"),
                      ({"dp": True}, "got True"), ({"pp": 2}, "got 'pp'"), ([8], "got [8]")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            project(ddp_run, "dgx-h100", "1.3b", degrees=bad)
    assert project(ddp_run, "dgx-h100", "1.3b", degrees={"dp": 8, "tp": None}).degrees == {"dp": 8}


def test_degrees_re_size_only_an_axis_the_run_has(ddp_run):
    """A DDP run has one axis, dp: ``degrees`` may make it 8 replicas, or give tp its own size of
    1, but not split every replica over 8 tensor-parallel ranks, which no strategy of that run did
    and whose traffic it never recorded.  The message names the run's axes."""
    with pytest.raises(ValueError, match=r"no tp axis \(its axes: dp 2\)"):
        project(ddp_run, "ib-h100x8", "1.3b", degrees={"dp": 8, "tp": 8})
    assert project(ddp_run, "dgx-h100", "1.3b", degrees={"dp": 8, "tp": 1}).degrees == {
        "dp": 8, "tp": 1}


def test_project_refuses_a_layout_the_target_model_cannot_take(clusters):
    """What the CLI refuses before a run starts, ``project()`` refuses too: 12 heads do not split
    over 8 tensor-parallel ranks, and the message says so."""
    run = train(strategy="tensor", world_size=2, steps=2, batch_size=4, cluster=clusters(2),
                record_events=True)
    twelve = GPTConfig(n_layer=2, n_head=12, d_model=768, d_ff=3072, seq_len=64, vocab_size=64)
    with pytest.raises(ValueError, match="12 heads .* do not split over tensor parallelism 8"):
        project(run, "dgx-h100", twelve, degrees={"tp": 8})
    assert project(run, "dgx-h100", twelve, degrees={"tp": 4}).degrees == {"tp": 4}


def test_a_free_running_run_is_refused_by_its_record_not_its_name(ddp_run):
    """project() reads the run's layout: a record whose ranks share no step is refused with the
    reason it gives, whatever the strategy is called; a lockstep record named like a parameter
    server is projected."""
    apart = Layout(free_running="its ranks run their own loops")
    refused = replace(ddp_run, summary=replace(ddp_run.summary, layout=apart))
    with pytest.raises(ValueError, match="'ddp' cannot be projected: its ranks run their own loops"):
        project(refused, "dgx-h100", "1.3b")
    named = replace(ddp_run, summary=replace(ddp_run.summary, strategy="ps-sync"))
    assert project(named, "dgx-h100", "1.3b").step_time_s == pytest.approx(
        project(ddp_run, "dgx-h100", "1.3b").step_time_s)


def test_recording_keeps_issue_order_waits_steps_and_optimizer_steps(ddp_run):
    log = ddp_run.events[0]
    kinds = [k for _, k, _ in log["marks"]]
    assert kinds.count("step") == kinds.count("step_end") == 3
    assert kinds.count("optimizer") == kinds.count("optimizer_end") == 3
    ids = [e["id"] for e in log["events"]]
    assert len(set(ids)) == len(ids)
    buckets = [e for e in log["events"] if e["tag"].startswith("bucket")]
    assert buckets and all(e["async_op"] and e["wait_start"] is not None for e in buckets)
    assert all(e["ranks"] == (0, 1) for e in buckets)
    # the loss's untraced all-reduce is seen (it synchronises the ranks) but is not training traffic
    untraced = [e for e in log["events"] if not e["traced"]]
    assert [e["op"] for e in untraced] == ["all_reduce"] * 3
    assert ddp_run.summary.comm[0]["total"]["calls"] == len(buckets)


def test_ddp_bytes_scale_to_the_closed_form_at_the_target_size(ddp_run):
    """Per step each rank all-reduces 4Ψ bytes of fp32 gradients (2Ψ in bf16), Ψ the target's."""
    for precision, item in (("fp32", 4), ("bf16-mixed", 2)):
        p = project(ddp_run, "dgx-h100", "7b", precision=precision)
        psi = MODEL_SIZES["7b"].num_params()
        for rank in (0, 1):
            sent = sum(e["bytes"] for e in p.timeline[rank] if e.get("tag", "").startswith("bucket"))
            assert sent == pytest.approx(item * psi, rel=1e-9)
        n = 2
        assert 2 * (n - 1) / n * sent == pytest.approx(item * psi)


def shapes_params(cfg) -> tuple[int, int]:
    """(Ψ, Ψ of the experts' MLPs) counted from the shapes: token and position embeddings (V·d,
    s·d); per block two LayerNorms (2·2d), Q, K, V without bias (3d²), the output projection
    (d² + d) and a d→ff→d MLP with biases (2·d·ff + ff + d) — with E experts E such MLPs and a
    router (d·E); the final LayerNorm (2d) and an untied head (V·d)."""
    d, ff, V, s, L, E = cfg.d_model, cfg.ff, cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_expert
    mlp = 2 * d * ff + ff + d
    experts = L * E * mlp
    block = 4 * d + 3 * d * d + d * d + d + (E * mlp + d * E if E else mlp)
    return V * d + s * d + L * block + 2 * d + V * d, experts


def test_shapes_params_counts_the_models_parameters():
    # the GPT-2 shaped sizes; the Llama ones are checked against Meta's published counts in
    # tests/test_kernels.py
    gpt2_shaped = (cfg for cfg in MODEL_SIZES.values() if not cfg.llama_fields())
    for cfg in (*gpt2_shaped, MODELS["tiny"], target_model("1.3b", MODELS["tiny-moe"])):
        assert shapes_params(cfg)[0] == cfg.num_params()


def step_sent(p, rank, op=None, tags=None) -> float:
    """Bytes of the projected step's communications of ``rank``'s timeline (by op, by tag)."""
    return sum(e["bytes"] for e in p.timeline[rank] if e["op"] != "compute"
               and (op is None or e["op"] == op)
               and (tags is None or e.get("tag", "").startswith(tags)))


def messages_sent(p, rank) -> float:
    """Bytes of the point-to-point messages ``rank`` sent in the projected step (by the replay's
    keys: ("p", src, dst, channel, n)), each with the layers it stands for."""
    return sum(inst.bytes * inst.repeat for key, inst in p.replay["instances"].items()
               if key[0] == "p" and key[1] == rank)


@pytest.mark.parametrize("strategy, options", [("zero1", {}), ("zero2", {"bucket_mb": 0.2})])
def test_zero12_bytes_scale_to_the_closed_form_at_the_target_size(strategy, options, clusters):
    """ZeRO-1 and -2, per step: each rank reduce-scatters the whole gradient (the tracer counts a
    reduce-scatter's input: item·Ψ bytes; ZeRO-2 in buckets) and all-gathers the whole updated
    parameters (its output: item·Ψ), Ψ the target's; on a ring each rank sends (n−1)/n of each,
    2(n−1)/n·item·Ψ — what DDP's all-reduce sends."""
    n = 2
    run = train(strategy=strategy, world_size=n, steps=2, batch_size=8, cluster=clusters(n),
                options=options, record_events=True)
    if strategy == "zero2":  # buckets: each one scaled with the parameters it carries
        assert len(run.summary.report[0]["bucket_bytes"]) > 1
    psi, _ = shapes_params(MODEL_SIZES["7b"])
    # the flat vector is padded to a multiple of n (each bucket's, ZeRO-2): at most n−1 elements
    # per bucket of the tiny model's, which scale with it
    pad = 8 * (n - 1) / shapes_params(MODELS["tiny"])[0]
    for precision, item in (("fp32", 4), ("bf16-mixed", 2)):
        p = project(run, "dgx-h100", "7b", precision=precision)
        for rank in range(n):
            scattered = step_sent(p, rank, "reduce_scatter")
            gathered = step_sent(p, rank, "all_gather")
            assert scattered == pytest.approx(item * psi, rel=pad)
            assert gathered == pytest.approx(item * psi, rel=pad)
            assert (n - 1) / n * (scattered + gathered) == pytest.approx(
                2 * (n - 1) / n * item * psi, rel=pad)


def test_context_ring_bytes_scale_to_the_closed_form_at_the_target_size(clusters):
    """Ring attention on cp ranks, per layer and step: each rank's K and V for its s/cp positions
    of its b sequences (2·b·(s/cp)·d values) go cp−1 hops forward, cp−1 again in backward, and
    cp hops carrying dK/dV (the last takes them home): (3cp−2) such blocks per layer, for each of
    the target's L layers.  The gradients are all-reduced whole (item·Ψ)."""
    cp = 2
    run = train(strategy="context", world_size=cp, steps=2, batch_size=8, cluster=clusters(cp),
                options={"cp": cp}, record_events=True)
    cfg = MODEL_SIZES["1.3b"]
    b = 8  # one replica (dp = 1): every sequence of the batch
    for precision, item in (("fp32", 4), ("bf16-mixed", 2)):
        p = project(run, "dgx-h100", "1.3b", precision=precision)
        block = 2 * b * (cfg.seq_len // cp) * cfg.d_model * item
        for rank in range(cp):
            assert messages_sent(p, rank) == pytest.approx(cfg.n_layer * (3 * cp - 2) * block,
                                                           rel=1e-9)
            assert step_sent(p, rank, "all_reduce", "grads") == pytest.approx(
                item * shapes_params(cfg)[0], rel=1e-9)


def test_expert_all_to_all_bytes_scale_to_the_closed_form_at_the_target_size(clusters):
    """Two experts, each token routed to both (top-2), one expert per rank: per layer each rank's
    dispatch sends all its (b/ep)·s tokens to the other rank (d values each) and its combine sends
    back as many (the other rank's tokens, through its expert); backward sends the gradients of
    both: 4·(b/ep)·s·d·item bytes per layer, whatever the router chose.  The gradient all-reduce
    carries the replicated parameters only (Ψ less the experts': each has one owner)."""
    ep, b = 2, 8
    model = GPTConfig(n_expert=2, top_k=2, d_ff=128)
    run = train(strategy="expert", world_size=ep, steps=2, batch_size=b, cluster=clusters(ep),
                model=model, record_events=True)
    cfg = target_model("1.3b", model)
    assert (cfg.n_expert, cfg.top_k) == (2, 2)
    psi, experts = shapes_params(cfg)
    for precision, item in (("fp32", 4), ("bf16-mixed", 2)):
        p = project(run, "dgx-h100", "1.3b", precision=precision)
        for rank in range(ep):
            assert messages_sent(p, rank) == pytest.approx(
                cfg.n_layer * 4 * (b // ep) * cfg.seq_len * cfg.d_model * item, rel=1e-9)
            assert step_sent(p, rank, "all_reduce", "grads") == pytest.approx(
                item * (psi - experts), rel=1e-9)


def test_zero3_gathers_scale_unit_by_unit(clusters):
    run = train(strategy="zero3", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                record_events=True)
    target = MODEL_SIZES["1.3b"]
    p = project(run, "dgx-h100", "1.3b", precision="fp32", steps=[1])
    gathers = {}
    for e in p.timeline[0]:
        if e.get("tag", "").startswith("params-unit"):
            gathers.setdefault(e["tag"], e["bytes"])  # a unit's first gather (forward)
    # the embedding and head units carry theirs; each run block stands for L'/L target blocks
    assert gathers["params-unit0"] == pytest.approx(4 * target.embed_params(), rel=1e-3)
    assert sum(gathers.values()) == pytest.approx(4 * target.num_params(), rel=1e-3)


def test_a_calibration_on_many_ranks_keeps_every_kernel_measurement(clusters):
    """The ranks' calibrations reduced to one: each of the measured lists whole (the GEMM grid of
    shapes, the elementwise ops, attention's grid), every rate positive."""
    cal = calibrate_here(cluster=clusters(2))["kernels"]
    assert set(cal) == {"gemm", "gemm_shapes", "gemm_shapes_cold", "cache_bytes", "bandwidth",
                        "op_overhead_s", "dispatch", "ops", "attention"}
    for key in ("gemm_shapes", "gemm_shapes_cold"):
        assert len(cal[key]) == 27 and all(len(p) == 4 and p[3] > 0 for p in cal[key])
    assert cal["cache_bytes"] > 0  # Linux says how large the CPU's cache is
    assert {(p[0], p[1]) for p in cal["ops"]} == {(op, phase) for op in ("norm", "gelu", "add")
                                                  for phase in ("forward", "backward")}
    assert len(cal["ops"]) == 12 and all(p[3] > 0 for p in cal["ops"])
    assert len(cal["attention"]) == 8 and all(p[3] > 0 for p in cal["attention"])
    assert set(cal["dispatch"]) == {"gemm", "memory", "attention", "optimizer"}


def test_tensor_parallel_activations_scale_with_batch_sequence_and_hidden(clusters):
    run = train(strategy="tensor", world_size=2, steps=2, batch_size=4, cluster=clusters(2),
                record_events=True)
    target = MODEL_SIZES["1.3b"]
    p = project(run, "dgx-h100", "1.3b", steps=[1])  # bf16: 2 bytes
    layer = [e for e in p.timeline[0] if e.get("tag", "").startswith("blocks.0.")]
    assert layer
    one = 4 * target.seq_len * target.d_model * 2  # batch 4 (the run's) x s x h, bf16
    per_layer = target.n_layer / GPTConfig().n_layer
    assert all(e["bytes"] == pytest.approx(one * per_layer) for e in layer)


def test_train_adds_a_projection_beside_the_measurement(ddp_run):
    p = ddp_run.summary.projection
    for key in ("cluster", "model", "step_time_s", "compute_s", "exposed_comm_s", "bubble_s",
                "hidden_comm_share", "mfu", "measured_step_s", "sources"):
        assert key in p.to_dict()
    assert p.cluster == "dgx-h100" and p.model.startswith("1.3b")
    assert 0 < p.mfu < 1
    parts = p.compute_s + p.exposed_comm_s + p.bubble_s + p.idle_s
    assert parts == pytest.approx(p.step_time_s)
    # compute is the rank's kernels priced on the device under the GPU's default stack
    # ("flash"), the optimizer's bytes with them; the time by kind adds up to the step
    assert p.stack == "flash" and set(p.time_by_kind) == set(KINDS)
    assert sum(p.time_by_kind.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    for name in ("dgx-a100", "dgx-h100"):
        for stack in ("eager", "flash"):
            # communication that takes no SMs: compute is the kernels' sum
            free = replace(STACKS[stack], comm_sms=0)
            q = project(ddp_run, name, "1.3b", stack=free)
            kernels = kernel_compute(ddp_run, MODEL_SIZES["1.3b"], name, stack)
            assert q.compute_s == pytest.approx(kernels, rel=1e-9)
            # NCCL's SMs taken: the overlapped spans run on the rest, at most all of it slower
            q = project(ddp_run, name, "1.3b", stack=stack)
            sms = get_cluster(name).device.kernels.sms
            assert kernels < q.compute_s <= kernels * sms / (sms - STACKS[stack].comm_sms) + 1e-12
    assert project(ddp_run, "dgx-h100", "1.3b", stack="eager").mfu < p.mfu
    with pytest.raises(ValueError, match=r"unknown stack 'fast' \(did you mean 'flash'\?\); "
                                         "choose one of: eager"):
        project(ddp_run, "dgx-h100", "1.3b", stack="fast")


def test_project_prices_gemms_with_the_function_given(ddp_run):
    """project(gemm=...): the package's own rule gives the same step; GEMMs priced twice as long
    give a longer one, with twice the GEMM share of compute against the rest."""
    base = project(ddp_run, "dgx-h100", "7b", stack="flash")
    same = project(ddp_run, "dgx-h100", "7b", stack="flash", gemm=gemm_seconds)
    slow = project(ddp_run, "dgx-h100", "7b", stack="flash",
                   gemm=lambda *a: 2 * gemm_seconds(*a))
    assert same.step_time_s == base.step_time_s
    assert slow.step_time_s > base.step_time_s
    share = lambda p: p.time_by_kind["gemm"] / p.time_by_kind["memory"]  # noqa: E731
    assert share(slow) == pytest.approx(2 * share(base))


def kernel_compute(run, target, cluster: str, stack: str = "flash") -> float:
    """The mean over ranks of each rank's step priced by the kernel model: the run's
    micro-batches of batch / (dp · micro-batches) sequences through the rank's blocks."""
    lay, s = run.summary.layout, run.summary
    per_mb = s.batch_size / (lay.dp * lay.microbatches)
    out = []
    for r in range(s.world_size):
        w = rank_work(s, target, r)
        c = rank_compute(target, get_cluster(cluster).device.kernels, STACKS[stack],
                         tokens_per_microbatch=int(per_mb) * target.seq_len,
                         micro_batch=int(per_mb), microbatches=lay.microbatches, blocks=w.blocks,
                         head=w.head, embed=w.embed, tp=w.tp, cp=lay.cp, ep=lay.ep,
                         sp=bool(s.options.get("sequence_parallel")), opt_params=w.opt_params,
                         recompute="full" if s.checkpoint_activations else STACKS[stack].recompute)
        out.append(c.total_s)
    return statistics.fmean(out)


#: every lockstep strategy (and pipeline schedule) through train(project=...), on the fewest ranks
#: that show its communication (ddp: ddp_run above)
LOCKSTEP = [
    ("single", 1, {}, "tiny"),
    ("ddp-naive", 2, {}, "tiny"),
    ("zero1", 2, {}, "tiny"),
    ("zero2", 2, {}, "tiny"),
    ("zero3", 2, {}, "tiny"),
    ("tensor", 2, {}, "tiny"),
    ("context", 2, {"cp": 2}, "tiny"),
    ("expert", 2, {}, "tiny-moe"),
    ("3d", 4, {"pp": 2, "tp": 2}, "tiny"),
    ("pipeline", 2, {"schedule": "naive"}, "tiny"),
    ("pipeline", 2, {"schedule": "gpipe", "microbatches": 4}, "tiny"),
    ("pipeline", 2, {"schedule": "1f1b", "microbatches": 4}, "tiny"),
    ("pipeline", 2, {"schedule": "interleaved", "microbatches": 4}, "tiny"),
    ("pipeline", 2, {"schedule": "zb-h1", "microbatches": 4}, "tiny"),
]


@pytest.mark.parametrize("strategy, world, options, model", LOCKSTEP,
                         ids=[f"{s}-{o.get('schedule', w)}" for s, w, o, _ in LOCKSTEP])
def test_every_lockstep_strategy_is_projected_by_train(strategy, world, options, model, clusters):
    run = train(strategy=strategy, world_size=world, steps=2, batch_size=8, options=options,
                model=MODELS[model], cluster=clusters(world), project="dgx-h100", as_model="1.3b")
    p = run.summary.projection
    assert p.cluster == "dgx-h100" and p.model.startswith("1.3b")
    parts = ("compute_s", "exposed_comm_s", "bubble_s", "idle_s")
    for key in ("step_time_s", "mfu", "comm_s") + parts:
        value = getattr(p, key)
        assert math.isfinite(value) and value >= 0, (key, value)
    assert p.step_time_s > 0 and 0 < p.mfu < 1
    # by construction (replay.breakdown): a rank's segments tile its step — compute, and waits
    # that are exposed communication while its communication is in flight, else idle (bubble on a
    # pipeline's messages) — and the rest to the slowest rank's end is idle (bubble in a
    # pipeline); the parts are means over the ranks, so they add up to the step time
    assert sum(getattr(p, k) for k in parts) == pytest.approx(p.step_time_s, rel=1e-9)
    pipelined = strategy == "pipeline" or "pp" in options
    assert (p.bubble_s > 0) if pipelined else (p.bubble_s == 0)
    if world == 1:  # nothing is sent: nothing to hide
        assert p.hidden_comm_share is None and p.exposed_comm_s == p.comm_s == 0
    else:  # exposed communication is the part of the time in flight no compute ran beside
        assert 0 < p.comm_s and p.exposed_comm_s <= p.comm_s * (1 + 1e-9)
        assert p.hidden_comm_share == pytest.approx(1 - p.exposed_comm_s / p.comm_s,
                                                       abs=1e-9)
    # compute: each rank's kernels on the H100 (its optimizer step with them), the mean over
    # ranks, the spans that overlapped communication on the SMs NCCL left them; MFU: the model
    # FLOPs at peak
    device = get_cluster("dgx-h100").device
    target = MODEL_SIZES["1.3b"] if model == "tiny" else target_model("1.3b", MODELS[model])
    works = [rank_work(run.summary, target, r) for r in range(world)]
    kernels = kernel_compute(run, target, "dgx-h100")
    slowest = device.kernels.sms / (device.kernels.sms - STACKS["flash"].comm_sms)
    assert kernels * (1 - 1e-9) <= p.compute_s <= kernels * slowest * (1 + 1e-9)
    assert p.mfu == pytest.approx(sum(w.model_flops for w in works) / (
        p.step_time_s * world * device.peak_flops), rel=1e-9)
    # the summary is project()'s: equal micro-batches of GPipe and 1F1B with equal work (as
    # lesson 05 projects them), every other run as measured
    lay = run.summary.layout
    even = lay.schedule in ("gpipe", "1f1b") and lay.microbatches > 1  # a pipeline, 3d's too
    assert p.even is even and (strategy == "3d") <= even
    assert p.step_time_s == pytest.approx(
        project(run, "dgx-h100", "1.3b", even=even).step_time_s, rel=1e-12)


def test_even_work_is_for_gpipe_and_1f1b_of_equal_micro_batches_in_any_mesh():
    def summary(schedule="1f1b", m=4, batch=8, **axes):
        return SimpleNamespace(batch_size=batch, layout=Layout(pp=2, schedule=schedule,
                                                               microbatches=m, **axes))
    assert even_work(summary()) and even_work(summary(schedule="gpipe"))
    assert not even_work(summary(batch=10))  # tensor_split: micro-batches of 3, 3, 2, 2
    assert not even_work(summary(schedule="interleaved"))  # its chunks differ (embedding, head)
    assert not even_work(summary(schedule="zb-h1"))  # its backward is two passes of unlike work
    assert not even_work(summary(schedule="naive", m=1))
    assert even_work(summary(dp=2, tp=2))  # a 3D mesh: each replica's 4 sequences in 4 of 1
    assert not even_work(summary(dp=2, tp=2, batch=12))  # 6 sequences per replica in 4: unequal
    assert not even_work(SimpleNamespace(batch_size=8, layout=Layout(dp=2)))


def test_a_bigger_model_that_does_not_fit_says_so(ddp_run):
    p = project(ddp_run, "dgx-h100", "13b")
    assert p.fits is False  # 16 bytes per parameter of 13B replicated: over 80 GB
    assert p.memory[0]["optimizer_states"] == pytest.approx(12 * MODEL_SIZES["13b"].num_params())


def test_the_run_replayed_on_this_machine_keeps_its_measured_compute(ddp_run):
    p = project(ddp_run, "local")
    assert p.compute_mode == "measured" and p.cluster == "local"
    measured = [s for s in p.replay["ranks"][0]["segments"] if s["kind"] == "compute"]
    assert all(s["end"] - s["start"] == pytest.approx(s["measured"][1] - s["measured"][0])
               for s in measured)


def test_a_pipeline_projection_reports_its_bubble_and_redraws_its_timeline(clusters):
    run = train(strategy="pipeline", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                options={"schedule": "gpipe", "microbatches": 4}, record_events=True)
    p = project(run, "dgx-h100", "1.3b")
    assert p.bubble_s > 0 and p.exposed_comm_s >= 0
    sends = [e for e in p.timeline[0] if e["op"] == "send"]
    assert len(sends) == 4  # one activation per micro-batch, forward
    assert sends[0]["bytes"] == pytest.approx(2 * MODEL_SIZES["1.3b"].seq_len * 2048 * 2)
    timeline, q = pipeline_timeline(run, "dgx-h100", "1.3b")
    measured = run.summary.report[0]["timeline"]
    assert [e["action"] for e in timeline] == [e["action"] for e in measured]
    assert all(e["ready"] <= e["start"] <= e["end"] <= q.step_time_s * (1 + 1e-9)
               for e in timeline)
    summary = bubble_summary(timeline, 2, 4)
    assert 0 < summary["bubble"] < 1


def test_a_stack_that_overlaps_tensor_parallel_communication_hides_it(clusters):
    """The "flash" stack's tp_overlap: each tensor-parallel all-reduce runs beside the compute
    after it (Megatron's --tp-comm-overlap), on the SMs NCCL leaves; without it (the same stack
    but tp_overlap off) each is waited for where it was issued."""
    run = train(strategy="tensor", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                project="local")  # recorded, and calibrated for this machine's check below
    on = project(run, "dgx-h100", "1.3b", degrees={"tp": 8}, stack="flash")
    off = project(run, "dgx-h100", "1.3b", degrees={"tp": 8},
                  stack=replace(STACKS["flash"], tp_overlap=False))
    assert on.exposed_comm_s < 0.5 * off.exposed_comm_s
    assert on.step_time_s < off.step_time_s and on.hidden_comm_share > off.hidden_comm_share
    assert on.compute_s > off.compute_s  # the overlapped compute ran on fewer SMs
    parts = on.compute_s + on.exposed_comm_s + on.bubble_s + on.idle_s
    assert parts == pytest.approx(on.step_time_s)
    # on this machine's CPU (measured compute) nothing is moved
    assert project(run, "local", stack="flash").step_time_s == pytest.approx(
        project(run, "local", stack=replace(STACKS["flash"], tp_overlap=False)).step_time_s)


def test_even_gives_a_pipelines_equal_micro_batches_equal_time(clusters):
    """even=True: every forward of a rank gets the same share of its FLOPs (equal micro-batches),
    so on the cluster the first stage's forwards take the same time; the ranks' compute is kept."""
    run = train(strategy="pipeline", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                options={"schedule": "gpipe", "microbatches": 4}, record_events=True)
    _, p = pipeline_timeline(run, "dgx-h100", "1.3b")
    timeline, q = pipeline_timeline(run, "dgx-h100", "1.3b", even=True)
    forwards = [e["end"] - e["start"] for e in q.timeline[0]
                if e["op"] == "compute" and e["phase"] == "forward"]
    assert len(forwards) == 4 and max(forwards) == pytest.approx(min(forwards), rel=1e-6)
    assert q.compute_s == pytest.approx(p.compute_s, rel=1e-6)  # the same FLOPs, shared out


def test_a_zero_bubble_pipelines_w_passes_are_recorded_and_priced(clusters):
    """ZB-H1's W passes (weight gradients outside autograd) are recorded as their own intervals,
    given their share of the backward's FLOPs, and re-timed: the same compute as 1F1B's, a
    smaller bubble (its W fills 1F1B's idle time)."""
    runs = {s: train(strategy="pipeline", world_size=2, steps=2, batch_size=8, cluster=clusters(2),
                     options={"schedule": s, "microbatches": 4}, record_events=True)
            for s in ("1f1b", "zb-h1")}
    for r in range(2):
        spans = windows(runs["zb-h1"].events[r]["marks"])[-1][3]
        assert len(spans["weights"]) == 4 and len(spans["backward"]) == 4
        assert not windows(runs["1f1b"].events[r]["marks"])[-1][3]["weights"]
    p = {s: project(run, "dgx-h100", "1.3b", even=True) for s, run in runs.items()}
    assert p["zb-h1"].compute_s == pytest.approx(p["1f1b"].compute_s, rel=1e-3)
    # how much smaller depends on the W passes' measured share of the backward; any share is some
    idle = {s: q.bubble_s + q.idle_s for s, q in p.items()}
    assert idle["zb-h1"] < 0.95 * idle["1f1b"], idle


def test_the_ddp_timeline_is_redrawn_on_the_cluster(clusters):
    run = train(strategy="ddp", world_size=2, steps=3, batch_size=8, cluster=clusters(2),
                options={"timeline": True, "bucket_mb": 0.2}, record_events=True)
    p = project(run, "dgx-h100", "1.3b")
    rows = timeline_rows(ddp_timeline(run, p))
    assert len(rows) == 2 and len(rows[0]["buckets"]) == len(run.summary.report[0]["bucket_bytes"])
    start, end = rows[0]["backward"]
    assert start < end <= p.step_time_s * 1e3
    # the buckets carry the 1.3B model's gradients (bf16), all of them once
    assert sum(b[3] for b in rows[0]["buckets"]) == pytest.approx(2 * MODEL_SIZES["1.3b"].num_params())


def test_the_cli_prints_the_projection_in_its_json():
    out = subprocess.run([sys.executable, "-m", "minitrain", "train", "--steps", "2", "--model",
                          "nano", "--project", "dgx-h100", "--as-model", "gpt2", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])["summary"]
    p = summary["projection"]
    assert p["cluster"] == "dgx-h100" and p["model"].startswith("gpt2")
    for key in ("step_time_s", "compute_s", "exposed_comm_s", "bubble_s", "hidden_comm_share", "mfu"):
        assert key in p
    listed = subprocess.run([sys.executable, "-m", "minitrain", "clusters"], capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0 and "dgx-h100" in listed.stdout and "source:" in listed.stdout
