"""This machine's α-β, fitted on a run's own recorded events (minitrain.planning.recorded), on hand-made
logs: what is timed, from when, and what a stalled step does to the fit."""

from types import SimpleNamespace

import pytest

from minitrain.planning.costmodel import ring_steps
from minitrain.planning.recorded import completed_at, fit_run, message_times

MS = 1e-3


def ev(ident, op, start, *, end=None, returned=None, wait_start=None, wait_end=None,
       ranks=(0, 1), nbytes=1000):
    """One tracer event: blocking when ``wait_end`` is None, else asynchronous (``end`` before
    ``wait_end``: its work's future saw it complete; ``end`` equal to it: a work without one)."""
    async_op = wait_end is not None
    return {"op": op, "bytes": nbytes, "start": start, "end": end, "group": "world", "peer": None,
            "tag": "", "id": ident, "async_op": async_op,
            "returned": returned if async_op else None, "wait_start": wait_start,
            "wait_end": wait_end, "ranks": list(ranks), "channel": 0, "root": 0, "traced": True}


def run_of(steps_per_rank: list[list[list[dict]]], length=0.1) -> dict:
    """A result whose rank r ran the steps ``steps_per_rank[r]`` (events with times relative to
    each step's start), the steps one after another, ``length`` seconds apart."""
    logs = []
    for steps in steps_per_rank:
        events, marks = [], []
        for i, step in enumerate(steps):
            t0 = 10.0 + i * length
            marks += [(t0, "step", i), (t0 + length * 0.9, "step_end", i)]
            for e in step:
                shifted = dict(e)
                for k in ("start", "end", "returned", "wait_start", "wait_end"):
                    if shifted[k] is not None:
                        shifted[k] += t0
                shifted["id"] += 1000 * i
                events.append(shifted)
        logs.append({"events": events, "marks": marks})
    return SimpleNamespace(events=logs, summary=SimpleNamespace(world_size=len(steps_per_rank)))


WARM_UP: list[dict] = []  # the first recorded step is left out of the fit


def test_what_each_rank_saw_complete():
    assert completed_at(ev(0, "all_reduce", 0.0, end=2 * MS)) == 2 * MS  # blocking: returned
    seen = ev(0, "all_gather", 0.0, end=3 * MS, returned=0.1 * MS, wait_start=5 * MS,
              wait_end=5.1 * MS)
    assert completed_at(seen) == 3 * MS  # its future fired while the rank computed
    unseen = ev(0, "reduce_scatter", 0.0, end=5.1 * MS, returned=0.1 * MS, wait_start=5 * MS,
                wait_end=5.1 * MS)
    assert completed_at(unseen) is None  # no future: its end is only its wait's return


def test_a_collective_is_timed_from_its_last_issue_to_its_last_members_completion():
    # rank 1 issues 1 ms late; rank 0 sees it complete at 3 ms, rank 1 at 3.5 ms (its future),
    # each computing meanwhile and waiting for it long after
    r0 = [ev(1, "all_gather", 0.0, end=3 * MS, returned=0.1 * MS, wait_start=9 * MS,
             wait_end=9.1 * MS)]
    r1 = [ev(1, "all_gather", 1 * MS, end=3.5 * MS, returned=1.1 * MS, wait_start=8 * MS,
             wait_end=8.1 * MS)]
    [(op, n, nbytes, seconds, step)] = message_times(run_of([[WARM_UP, r0], [WARM_UP, r1]]))
    assert (op, n, nbytes, step) == ("all_gather", 2, 1000, 1)
    assert seconds == pytest.approx(2.5 * MS)  # not the 9 ms until the ranks came to wait


def test_a_collective_queued_behind_another_on_its_group_is_timed_from_when_the_group_was_free():
    # two gathers issued back to back: the second can start only when the first is done (one
    # stream per group, as the replay runs them), so it took 7 - 5 ms, not 7 - 0.2 ms
    rank = [ev(1, "all_gather", 0.0, end=5 * MS, returned=0.1 * MS, wait_start=6 * MS,
               wait_end=6.1 * MS),
            ev(2, "all_gather", 0.2 * MS, end=7 * MS, returned=0.3 * MS, wait_start=8 * MS,
               wait_end=8.1 * MS)]
    times = message_times(run_of([[WARM_UP, rank], [WARM_UP, rank]]))
    assert [round(t[3] / MS, 6) for t in times] == [5.0, 2.0]


def test_a_work_without_a_future_is_not_timed_and_takes_the_alpha_of_all():
    step = [ev(1, "all_gather", 0.0, end=2 * MS),
            ev(2, "reduce_scatter", 3 * MS, end=12 * MS, returned=3.1 * MS, wait_start=11 * MS,
               wait_end=12 * MS)]
    run = run_of([[WARM_UP, step], [WARM_UP, step]])
    assert [t[0] for t in message_times(run)] == ["all_gather"]
    fit = fit_run(run, beta=0.0)
    assert set(fit["per_op"]) == {"all_gather"}
    assert fit["alpha"] == pytest.approx(2 * MS / ring_steps("all_gather", 2))


def test_alpha_is_the_typical_steps_a_stalled_step_does_not_move_it():
    def step(*ms):
        return [ev(i, "all_gather", 20 * MS * i, end=20 * MS * i + t * MS)
                for i, t in enumerate(ms)]
    # a step's collectives add up to its mean (1 and 3 ms: 2 ms); one stalled step of five
    steps = [WARM_UP, step(1, 3), step(2, 2), step(30, 30), step(2, 2), step(1.5, 2.5)]
    fit = fit_run(run_of([steps, steps], length=0.2), beta=0.0)
    per_step = ring_steps("all_gather", 2)
    assert fit["per_op"]["all_gather"][0] == pytest.approx(2 * MS / per_step)
    assert fit["alpha"] == pytest.approx(2 * MS / per_step)  # the mean would be 7.6 ms
    # without a sweep's β, least squares over every collective: the stall counts
    assert fit_run(run_of([steps, steps], length=0.2))["alpha"] > 5 * MS / per_step
