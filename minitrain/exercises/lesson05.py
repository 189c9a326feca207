"""Lesson 05: the 1F1B order of one pipeline rank."""

from __future__ import annotations

import torch

from .core import exercise, raised, ranks


#: (P, M) the 1F1B checker tries: fewer, as many and more micro-batches than stages, an odd P
_PIPE_CASES = [(2, 1), (2, 4), (3, 2), (3, 3), (3, 5), (4, 4), (4, 7)]


#: run for real: P ranks, M micro-batches, batch size (3 ranks: 12 samples in 5 uneven micro-batches)
_PIPE_RUNS = {2: (4, 8), 3: (5, 12)}


def _pipe_model():
    from ..model import GPTConfig
    return GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16)


def _one_f_one_b_table(fn, P: int, M: int):
    """The learner's rows as a table of Actions (stage = rank), or the sentence saying what is wrong."""
    import re

    from ..parallel.schedules import Action

    table = []
    for r in range(P):
        call = f"{getattr(fn, '__name__', 'your function')}({r}, {P}, {M})"
        try:
            row = fn(r, P, M)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(call, exc, fn)
        if row is None:
            return f"{call} returned None: return a list of strings like ['F0', 'F1', 'B0', ...]"
        if isinstance(row, str) or not isinstance(row, (list, tuple)):
            return f"{call} returned {type(row).__name__}: return a list of strings like ['F0', 'B0']"
        actions = []
        for item in row:
            match = re.fullmatch(r"([FB])(\d+)", item.strip()) if isinstance(item, str) else None
            if match is None:
                return (f"{call}: {item!r} is not an action; write 'F3' for the forward of "
                        "micro-batch 3 and 'B3' for its backward")
            actions.append(Action(match.group(1), int(match.group(2)), r))
        table.append(actions)
    return table


def _one_f_one_b_rank(tables: dict):
    """On each rank: a few training steps running the learner's table; the losses (same on every
    rank), for the parent to compare with one process."""
    from ..comm import Comm
    from ..data import ArithmeticData
    from ..model import GPT
    from ..parallel.pipeline import PipelineExecutor, PipelineStage

    comm = Comm()
    P = comm.size
    M, batch = _PIPE_RUNS[P]
    model = GPT(_pipe_model(), seed=0)
    stage = PipelineStage(model, comm.rank, P)
    executor = PipelineExecutor({comm.rank: stage}, tables[P], comm, M, _pipe_model().d_model)
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)
    data, losses = ArithmeticData(_pipe_model().seq_len, 0), []
    for step in range(3):
        x, y = data.batch(step, batch)
        optimizer.zero_grad(set_to_none=True)
        losses.append(executor.step(x, y))
        optimizer.step()
    return losses


def _one_f_one_b_single(batch: int) -> list[float]:
    """The same three steps in one process: the whole batch, no pipeline."""
    from ..data import ArithmeticData
    from ..model import GPT

    model = GPT(_pipe_model(), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, losses = ArithmeticData(_pipe_model().seq_len, 0), []
    for step in range(3):
        x, y = data.batch(step, batch)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@exercise('one_f_one_b',
          "valid 1F1B order for P = 2, 3, 4 with M below, equal to and above P, at most "
                    "P − rank micro-batches in flight; trains like one process on 2 and 3 ranks")
def _check_one_f_one_b(fn) -> str | None:
    """Valid (the validator), 1F1B's memory bound, 1F1B's order or makespan, then run for real."""
    from ..launch import RankError
    from ..parallel.schedules import ScheduleError, orders, peak_in_flight, simulate, validate

    tables = {}
    for P, M in _PIPE_CASES:
        where = f"P={P}, M={M}"
        table = _one_f_one_b_table(fn, P, M)
        if isinstance(table, str):
            return table
        try:
            validate(table, P, M)
        except ScheduleError as exc:
            return f"{where}: {exc}  (the validator writes 'F3' of rank 1 as F3@s1: stage 1 = rank 1)"
        peaks = peak_in_flight(table)
        for r in range(P):
            bound = min(P - r, M)
            if peaks[r] > bound:
                gpipe = " — that is GPipe, which keeps all M in flight" if peaks[r] == M else ""
                return (f"{where}: rank {r} holds {peaks[r]} micro-batches' activations at once"
                        f"{gpipe}; 1F1B holds at most P − rank = {bound}: after {P - r - 1} warm-up "
                        "forwards, alternate one forward and one backward")
        reference = orders("1f1b", P, M)
        if table != reference:
            span = max(e["end"] for e in simulate(table))
            best = max(e["end"] for e in simulate(reference))
            if span > best:
                r = next(r for r in range(P) if table[r] != reference[r])
                return (f"{where}: valid, but it takes {span:g} time units where 1F1B takes "
                        f"{best:g} (F = 1, B = 2); rank {r} runs "
                        f"{[f'{a.kind}{a.microbatch}' for a in table[r]]}")
        if P in _PIPE_RUNS and M == _PIPE_RUNS[P][0]:
            tables[P] = table
    for P, (M, batch) in _PIPE_RUNS.items():
        if P not in tables:
            table = _one_f_one_b_table(fn, P, M)
            if isinstance(table, str):
                return table
            tables[P] = table
        try:
            losses = ranks(P).run(_one_f_one_b_rank, tables, timeout=60)[0]
        except RankError as exc:
            return f"run on {P} ranks: {str(exc).splitlines()[0]}"
        except TimeoutError:
            return f"run on {P} ranks: it did not finish within 60 s (a rank waiting for a message?)"
        want = _one_f_one_b_single(batch)
        for step, (a, b) in enumerate(zip(losses, want)):
            if abs(a - b) > 1e-5 * abs(b):
                return (f"run on {P} ranks, M={M}: step {step} loss {a:.6f}, one process "
                        f"{b:.6f}")
    return None
