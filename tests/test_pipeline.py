"""Pipeline parallel (lesson 05): schedules as data, the validator, the executor on real ranks.

Pure tests (no processes) check the tables: the ideal bubble equals (p−1)/(v·m+p−1), ZB-H1 beats
1F1B, the peak in-flight micro-batches, and the validator's refusals.  Distributed tests run every
schedule on 2–4 ranks against a single process, and measure the bubble of real runs.
"""

import pytest

from minitrain.planning.analysis import bubble_formula, bubble_fraction, peak_in_flight
from minitrain.parallel.schedules import (COSTS, SCHEDULES, Action, ScheduleError, make_schedule,
                                          orders, simulate, split_layers, validate)
from minitrain.strategies.options import in_cli_words

F, B = (lambda m, s: Action("F", m, s)), (lambda m, s: Action("B", m, s))


def shapes():
    """(schedule, P, M, V) for every schedule that allows it, P = 1..4."""
    out = []
    for P in (1, 2, 3, 4):
        for M in sorted({1, P, 2 * P + 1, 8}):
            out += [("gpipe", P, M, 1), ("1f1b", P, M, 1), ("zb-h1", P, M, 1)]
            if M % P == 0:
                out += [("interleaved", P, M, 2), ("interleaved", P, M, 3)]
        out.append(("naive", P, 1, 1))
    return out


# -- the tables -------------------------------------------------------------------------------------


def test_action_prints_as_in_the_lesson():
    assert str(Action("F", 3, 1)) == "F3@s1" and str(Action("W", 0, 7)) == "W0@s7"
    assert set(SCHEDULES) == {"naive", "gpipe", "1f1b", "interleaved", "zb-h1"}
    assert COSTS == {"F": 1, "B": 2, "I": 1, "W": 1}


@pytest.mark.parametrize("name,P,M,V", shapes())
def test_every_made_schedule_is_valid_and_keeps_its_order(name, P, M, V):
    table = make_schedule(name, P, M, V)
    validate(table, P, M, V)
    assert [[a for a in row if a is not None] for row in table] == orders(name, P, M, V)
    # the Nones are the idle units of the simulation, so the table redraws the timeline
    span = max(e["end"] for e in simulate(table))
    assert all(sum(COSTS[a.kind] if a else 1 for a in row) <= span for row in table)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 9])
def test_ideal_bubble_of_gpipe_and_1f1b_is_the_formula(P, M):
    for name in ("gpipe", "1f1b"):
        tl = simulate(make_schedule(name, P, M))
        assert bubble_fraction(tl, P) == bubble_formula(P, M) == (P - 1) / (M + P - 1)
    assert bubble_fraction(simulate(make_schedule("naive", P, 1)), P) == bubble_formula(P, 1)


@pytest.mark.parametrize("P,M,V", [(2, 2, 2), (2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 4, 3), (3, 9, 4)])
def test_interleaving_shrinks_the_bubble_by_v(P, M, V):
    ideal = bubble_fraction(simulate(make_schedule("interleaved", P, M, V)), P)
    assert ideal == pytest.approx(bubble_formula(P, M, V), rel=0.05)
    assert ideal < bubble_formula(P, M)


@pytest.mark.parametrize("P,M", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (4, 9)])
def test_zb_h1_has_a_smaller_bubble_than_1f1b_with_the_same_peak_memory(P, M):
    zb, one = make_schedule("zb-h1", P, M), make_schedule("1f1b", P, M)
    assert bubble_fraction(simulate(zb), P) < bubble_fraction(simulate(one), P)
    if M >= P:  # Qi et al.: bubble (p−1)(F+I−W) instead of (p−1)(F+I+W), a third with unit costs
        span = M * 3 + (P - 1) * (COSTS["F"] + COSTS["I"] - COSTS["W"])
        assert max(e["end"] for e in simulate(zb)) == span
    assert max(peak_in_flight(zb).values()) == max(peak_in_flight(one).values()) == min(P, M)


@pytest.mark.parametrize("P,M", [(2, 4), (3, 7), (4, 9)])
def test_1f1b_holds_at_most_p_micro_batches_and_gpipe_all_of_them(P, M):
    assert peak_in_flight(make_schedule("1f1b", P, M)) == {r: min(P - r, M) for r in range(P)}
    assert peak_in_flight(make_schedule("gpipe", P, M)) == {r: M for r in range(P)}


def test_the_schedules_refuse_impossible_shapes_with_the_fix():
    with pytest.raises(ScheduleError, match="microbatches=1"):
        make_schedule("naive", 2, 4)
    with pytest.raises(ScheduleError, match="multiple of stages=2.*use microbatches=4"):
        make_schedule("interleaved", 2, 5, 2)
    with pytest.raises(ScheduleError, match="chunks >= 2"):
        make_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ScheduleError, match="chunks=1"):
        make_schedule("zb-h1", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule='dualpipe'"):
        make_schedule("dualpipe", 2, 4)


def test_a_schedule_refusal_carries_its_parameter_and_the_cli_words_it_from_them():
    """The strategy words the refusal from its fields (3d calls stages --pp), not from its text."""
    with pytest.raises(ScheduleError) as info:
        make_schedule("interleaved", 2, 5, 2)
    refusal = info.value
    assert (refusal.parameter, refusal.value) == ("microbatches", 5)
    assert refusal.mentions == (("stages", 2), ("microbatches", 4))
    assert str(in_cli_words(refusal, {"stages": "--pp {}"})).endswith(
        "multiple of --pp 2, got 5; use --microbatches 4")


def test_split_layers_is_balanced_and_allows_uneven_counts():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in split_layers(7, 3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="at least 5 layers"):
        split_layers(4, 5)


# -- the validator ----------------------------------------------------------------------------------


def gpipe_2x2():
    return [[F(0, 0), F(1, 0), None, None, B(0, 0), B(1, 0)],
            [None, F(0, 1), F(1, 1), B(0, 1), B(1, 1)]]


def test_the_validator_accepts_a_hand_written_table():
    validate(gpipe_2x2(), 2, 2)


def test_the_validator_names_a_backward_before_its_forward():
    t = gpipe_2x2()
    t[1] = [B(0, 1), F(0, 1), F(1, 1), B(1, 1)]
    with pytest.raises(ScheduleError, match=r"rank 1: B0@s1 comes before F0@s1"):
        validate(t, 2, 2)


def test_the_validator_names_both_ends_of_a_deadlock():
    # rank 0 wants B0's gradient before it forwards micro-batch 1; rank 1 wants F1 first
    t = [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(0, 1), F(1, 1), B(0, 1), B(1, 1)]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits on B0@s0 \(needs B0@s1\), "
                                            r"rank 1 waits on F1@s1 \(needs F1@s0\)"):
        validate(t, 2, 2)


def test_the_validator_names_a_missing_action():
    t = gpipe_2x2()
    t[0].remove(B(1, 0))
    with pytest.raises(ScheduleError, match=r"missing: B1@s0 \(rank 0\)"):
        validate(t, 2, 2)


def test_the_validator_names_an_action_on_the_wrong_rank_or_twice():
    t = gpipe_2x2()
    t[0][1] = F(1, 1)
    with pytest.raises(ScheduleError, match=r"rank 0: F1@s1 is on the wrong rank; stage 1 runs "
                                            r"on rank 1"):
        validate(t, 2, 2)
    t = gpipe_2x2()
    t[1].append(B(1, 1))
    with pytest.raises(ScheduleError, match=r"rank 1: B1@s1 appears twice"):
        validate(t, 2, 2)


def test_the_validator_checks_the_zero_bubble_split():
    t = make_schedule("zb-h1", 2, 2)
    t[1] = [a for a in t[1] if a != Action("W", 1, 1)]
    with pytest.raises(ScheduleError, match=r"missing: W1@s1"):
        validate(t, 2, 2)
    t = make_schedule("zb-h1", 2, 2)
    i, w = t[0].index(Action("I", 0, 0)), t[0].index(Action("W", 0, 0))
    t[0][i], t[0][w] = t[0][w], t[0][i]
    with pytest.raises(ScheduleError, match=r"rank 0: W0@s0 comes before I0@s0"):
        validate(t, 2, 2)


# -- on real ranks ----------------------------------------------------------------------------------

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from minitrain import GPTConfig, TrainConfig, train  # noqa: E402
from minitrain.parallel.pipeline import PipelineStage  # noqa: E402
from minitrain.strategies.pipeline import run_schedule  # noqa: E402
from minitrain.strategies import ConfigError  # noqa: E402
from minitrain.train import check_config  # noqa: E402
from conftest import assert_same_run  # noqa: E402

# 8 layers: interleaving 4 ranks x 2 chunks needs 8 stages; batch 12 splits unevenly into 9 or 7
CFG = TrainConfig(steps=20, batch_size=12, seed=0,
                  model=GPTConfig(n_layer=8, n_head=2, d_model=32, seq_len=16))


def allowed(P):
    """(schedule, M, chunks, refusal) for M in {1, P, 2P+1}; refusal = None where it may run."""
    out = []
    for M in sorted({1, P, 2 * P + 1}):
        out += [("gpipe", M, None, None), ("1f1b", M, None, None), ("zb-h1", M, None, None),
                ("naive", M, None, None if M == 1 else "--microbatches 1"),
                ("interleaved", M, 2, None if M % P == 0 else f"multiple of --stages {P}")]
    return out


EQUALITY = [(P, *c) for P in (2, 3, 4) for c in allowed(P)]


@pytest.fixture(scope="module")
def single(clusters):
    return train(CFG, cluster=clusters(1), return_state=True)


def pipe_cfg(P, schedule, M, chunks=None, **changes):
    opts = {"schedule": schedule, "microbatches": M, "chunks": chunks}
    return CFG.with_(strategy="pipeline", world_size=P, options=opts, **changes)


@pytest.mark.parametrize("P,schedule,M,chunks,refusal", EQUALITY)
def test_every_schedule_equals_a_single_process(clusters, single, P, schedule, M, chunks, refusal):
    cfg = pipe_cfg(P, schedule, M, chunks)
    if refusal:
        with pytest.raises(ConfigError, match=refusal):
            check_config(cfg)
        return
    run = train(cfg, cluster=clusters(P), return_state=True)
    assert_same_run(run, single)
    reports = run.summary.report
    assert [r["rank"] for r in reports] == list(range(P))
    rep = reports[0]
    assert (rep["schedule"], rep["stages"], rep["microbatches"]) == (schedule, P, M)
    # the measured timeline holds every action of the table, each once, on its rank
    done = sorted((e["rank"], e["action"]) for e in rep["timeline"])
    assert done == sorted((r, a) for r, row in enumerate(rep["table"]) for a in row if a)
    assert rep["peak_in_flight"] == rep["peak_in_flight_ideal"]


def test_the_cli_options_are_refused_before_spawning_with_the_fix():
    cases = [
        (dict(options={"stages": 3}), "--stages 3 must equal --world-size 2"),
        (dict(options={"schedule": "dualpipe"}), "--schedule must be one of naive, gpipe, 1f1b, "
                                                  "interleaved, zb-h1, got 'dualpipe'"),
        (dict(options={"microbatches": 13}), "--microbatches 12 or fewer"),
        (dict(options={"schedule": "interleaved", "chunks": 1, "microbatches": 2}), "--chunks 2"),
        (dict(options={"schedule": "zb-h1", "chunks": 2}), "got --chunks 2; use --chunks 1"),
        (dict(options={"schedule": "interleaved", "chunks": 5}), "use --n-layer 10"),
        (dict(model=GPTConfig(n_layer=1)), "use --n-layer 2"),
        (dict(options={"schedule": "zb-h1"}, checkpoint_activations=True), "zb-h1 cannot"),
        (dict(precision="bf16-mixed"), "--precision fp32"),
    ]
    for changes, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_config(CFG.with_(strategy="pipeline", world_size=2, **changes))


def test_activation_checkpointing_gives_the_same_losses(clusters, single):
    cfg = pipe_cfg(2, "1f1b", 4, steps=5, checkpoint_activations=True)
    run = train(cfg, cluster=clusters(2))
    assert run.losses == pytest.approx(single.losses[:5], rel=1e-5)


def test_run_schedule_gives_a_notebook_the_measured_timeline(clusters):
    out = clusters(2).run(run_schedule, "gpipe", 4, batch_size=8)
    assert out[0]["timeline"] == out[1]["timeline"]  # every rank sees all ranks' timeline
    tl = out[0]["timeline"]
    assert {e["rank"] for e in tl} == {0, 1} and len(tl) == 16
    assert all(0 <= e["start"] <= e["end"] for e in tl)
    assert out[0]["losses"] == out[1]["losses"]


# -- measured bubbles and activations ---------------------------------------------------------------
#
# Two kinds of run.  (1) Stages whose actions take a known time (a real stage, plus a sleep of
# 20 ms in forward and 40 ms in backward: B = 2F as in the ideal): the executor's *measured* bubble
# must be the formula within 10 %, whatever else the machine is doing (a sleep needs no core).
# (2) The real model on 2 ranks: its bubble depends on how the ranks share the cores and on message
# latency, so here it only has to be near the formula; the 10 % target for real compute is measured
# by benchmarks/pipeline_bench.py, which prints measured vs (p-1)/(m+p-1).

SLEEP_F, SLEEP_B = 0.020, 0.040


class _Sleep(torch.autograd.Function):
    """Identity that takes SLEEP_F seconds in forward and SLEEP_B in backward."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(SLEEP_F)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(SLEEP_B)
        return g


class _TimedStage(PipelineStage):
    def forward(self, x):
        return _Sleep.apply(super().forward(x))


def _timed_bubbles(schedule: str, M: int, steps: int) -> list[float]:
    """On each rank: ``steps`` steps of ``schedule`` with timed stages; every step's bubble."""
    import torch.distributed as dist

    from minitrain.comm import Comm
    from minitrain.data import ArithmeticData
    from minitrain.model import GPT
    from minitrain.parallel.pipeline import PipelineExecutor

    comm, cfg = Comm(), GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16)
    P = comm.size
    table = make_schedule(schedule, P, M)
    stage = _TimedStage(GPT(cfg, seed=0), comm.rank, P)
    executor = PipelineExecutor({comm.rank: stage}, table, comm, M, cfg.d_model)
    data, bubbles = ArithmeticData(cfg.seq_len, 0), []
    for step in range(steps):
        x, y = data.batch(step, 2 * M)
        executor.step(x, y)
        everyone = [None] * P
        dist.all_gather_object(everyone, executor.timeline)
        bubbles.append(bubble_fraction([e for tl in everyone for e in tl], P))
    return bubbles


@pytest.mark.parametrize("P,M", [(2, 4), (3, 4)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_of_timed_stages_is_the_formula_within_ten_percent(clusters, schedule, P, M):
    bubbles = clusters(P).run(_timed_bubbles, schedule, M, 4)[0]
    measured, formula = statistics.median(bubbles[1:]), bubble_formula(P, M)  # step 0 warms up
    assert abs(measured - formula) <= 0.1 * formula, (
        f"{schedule} P={P} M={M}: measured {measured:.4f} (per step {[round(b, 3) for b in bubbles]})"
        f" vs (p-1)/(m+p-1) = {formula:.4f}")


def test_a_wrong_schedule_measures_a_different_bubble(clusters):
    """The measurement can fail: the naive schedule (M = 1) on timed stages is far from M = 4's."""
    naive = statistics.median(clusters(2).run(_timed_bubbles, "naive", 1, 3)[0][1:])
    assert abs(naive - bubble_formula(2, 1)) <= 0.1 * bubble_formula(2, 1)
    assert naive > 2 * bubble_formula(2, 4)


# a balanced model where compute dominates sends: 2 blocks per stage, 4 micro-batches of 8 samples
BUBBLE = TrainConfig(steps=8, batch_size=32, seed=0, strategy="pipeline", world_size=2,
                     model=GPTConfig(n_layer=4, n_head=4, d_model=256, seq_len=64))


@pytest.fixture(scope="module")
def measured(clusters):
    cache = {}

    def get(schedule):
        if schedule not in cache:
            cfg = BUBBLE.with_(options={"schedule": schedule, "microbatches": 4})
            cache[schedule] = train(cfg, cluster=clusters(2)).summary.report[0]
        return cache[schedule]
    return get


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_of_the_real_model_is_near_the_formula(measured, schedule):
    rep = measured(schedule)
    formula = rep["bubble_formula"]
    assert formula == pytest.approx(1 / 5)
    assert rep["bubble_ideal"] == pytest.approx(formula)
    # half to one and a half times: message latency and cores shared with other processes move it
    # (measured here 0.20-0.22, on a busy CI machine 0.23-0.24); a pipeline that serialised its
    # stages would measure (p-1)/p = 0.5, one that measured nothing 0
    assert 0.5 * formula <= rep["bubble_measured"] <= 1.5 * formula, (
        f"measured {rep['bubble_measured']:.4f} vs (p-1)/(m+p-1) = {formula:.4f}; per step "
        f"{[round(b, 3) for b in rep['bubble_per_step']]}")


def test_1f1b_holds_at_most_p_micro_batches_gpipe_all_m(measured):
    one, gpipe = measured("1f1b"), measured("gpipe")
    assert max(one["peak_in_flight"].values()) <= 2 == max(one["peak_in_flight_ideal"].values())
    assert gpipe["peak_in_flight"] == {0: 4, 1: 4} == gpipe["peak_in_flight_ideal"]
    # and the activation bytes held follow: GPipe's first stage holds 2x 1F1B's
    assert gpipe["activation_bytes_peak"] > 1.8 * one["activation_bytes_peak"]


def _waits_and_messages(schedule: str, M: int):
    """On each rank: one step of ``schedule`` on timed stages; (timeline, messages)."""
    from minitrain.comm import Comm
    from minitrain.data import ArithmeticData
    from minitrain.model import GPT
    from minitrain.parallel.pipeline import PipelineExecutor

    comm, cfg = Comm(), GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16)
    stage = _TimedStage(GPT(cfg, seed=0), comm.rank, comm.size)
    executor = PipelineExecutor({comm.rank: stage}, make_schedule(schedule, comm.size, M), comm, M,
                                cfg.d_model)
    x, y = ArithmeticData(cfg.seq_len, 0).batch(0, 2 * M)
    executor.step(x, y)
    return executor.timeline, executor.messages


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_timeline_says_where_a_rank_waited_and_for_which_message(clusters, schedule):
    """Every action records when its rank turned to it (``ready``) and the seconds its sends took;
    every message that ended a wait was posted before the wait ended (one host clock)."""
    M = 4
    res = clusters(2).run(_waits_and_messages, schedule, M)
    timeline = [e for tl, _ in res for e in tl]
    posted = {(m["grad"], m["microbatch"], m["stage"]): m for _, msgs in res for m in msgs}
    assert len(posted) == 2 * M  # F0..3 activations to stage 1, B0..3 gradients to stage 0
    assert all(m["posted"] <= m["returned"] for m in posted.values())
    for e in timeline:
        a = e["action"]
        assert e["ready"] <= e["start"] <= e["end"] and e["send"] >= 0
        needs = (False, a.microbatch, 1) if (a.kind, a.stage) == ("F", 1) else (
            (True, a.microbatch, 0) if (a.kind, a.stage) == ("B", 0) else None)
        if needs is not None and e["start"] - e["ready"] > 0.005:  # waited for its message
            assert posted[needs]["posted"] <= e["start"], (str(a), e, posted[needs])
    # the first forward on stage 1 waits for stage 0's (SLEEP_F), the last stage sends no activation
    first = next(e for e in timeline if str(e["action"]) == "F0@s1")
    assert first["start"] - first["ready"] >= 0.5 * SLEEP_F
    assert all(e["send"] == 0 for e in timeline if e["action"].kind == "F" and e["action"].stage == 1)
