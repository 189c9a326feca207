"""Pipeline parallel (lesson 05): schedules as data, the validator, the executor on real ranks.

Pure tests (no processes) check the tables: the ideal bubble equals (p−1)/(v·m+p−1), ZB-H1 beats
1F1B, the peak in-flight micro-batches, and the validator's refusals.  Distributed tests run every
schedule on 2–4 ranks against a single process, and measure the bubble of real runs.
"""

import pytest

from minitrain.parallel.pipeline import (COSTS, SCHEDULES, Action, ScheduleError, bubble_formula,
                                         bubble_fraction, make_schedule, orders, peak_in_flight,
                                         simulate, split_layers, validate)

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
    with pytest.raises(ScheduleError, match="multiple of stages=2.*use 4"):
        make_schedule("interleaved", 2, 5, 2)
    with pytest.raises(ScheduleError, match="chunks >= 2"):
        make_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ScheduleError, match="chunks=1"):
        make_schedule("zb-h1", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'dualpipe'"):
        make_schedule("dualpipe", 2, 4)


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
