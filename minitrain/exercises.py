"""Exercise checkers for the lessons, and the tool that writes the learners' notebooks from solutions.

How an exercise works (lessons 00–08):

* the learner writes a function in an exercise cell;
* the next cell, marked ``# NBVAL_CHECK_OUTPUT``, calls ``check("name", their_function)``, which runs
  the checker and prints one fixed line: the pass verdict, or a line starting with ``✗`` that says
  what is wrong (it never raises, so "Run All" goes on through the rest of the lesson, which uses the
  package's own implementation);
* ``pytest --nbval-lax`` compares that cell's output with the stored pass verdict: a blank or wrong
  exercise fails there, a correct one passes.

One source of truth: the teacher's notebooks in ``solutions/`` hold the answers between
``# BEGIN SOLUTION`` and ``# END SOLUTION`` lines.  ``python -m minitrain.exercises build`` writes
``lessons/`` from them, replacing each answer by a placeholder, stripping outputs (no widget state,
no images) and storing the pass verdict as the check cells' expected output.  ``--check`` only
verifies that ``lessons/`` is up to date (a test runs it).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

__all__ = ["check", "problem", "verdict", "CHECKS", "build_exercise", "normalise", "main"]

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
PLACEHOLDER = "...  # YOUR CODE HERE"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


# --------------------------------------------------------------------------------------------------
# Checkers: each returns None when the function is right, or a sentence saying what is wrong.
# --------------------------------------------------------------------------------------------------


def _check_zero_bytes(fn) -> str | None:
    from .memory import model_state_bytes

    cases = [(7.5e9, 64, s) for s in range(4)] + [(1e6, n, s) for n in (1, 2, 3, 8) for s in range(4)]
    for psi, n, stage in cases:
        want = model_state_bytes(psi, n, stage, "mixed-adam")["total"]
        try:
            got = fn(psi, n, stage)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return f"{fn.__name__}({psi:g}, {n}, {stage}) raised {type(exc).__name__}: {exc}"
        if got is None:
            return f"{fn.__name__}({psi:g}, {n}, {stage}) returned None: return the number of bytes"
        if abs(got - want) > 1e-6 * want:
            return (f"{fn.__name__}({psi:g}, {n}, {stage}) = {got:,.0f} bytes, expected {want:,.0f} "
                    "(2 + 2 + 12 bytes per parameter; stage 1 shards the 12, stage 2 also the "
                    "gradients' 2, stage 3 everything)")
    return None


def _ring_rank(fn, sizes):
    """On each rank: the learner's ring vs dist.all_reduce, for every size."""
    import torch.distributed as dist

    from .comm import Comm

    comm = Comm()
    for size in sizes:
        gen = torch.Generator().manual_seed(1000 * size + comm.rank)
        x = torch.randn(size, generator=gen, dtype=torch.float64)
        want = x.clone()
        dist.all_reduce(want)
        got = fn(x, comm)
        if got is None:
            got = x
        if not torch.allclose(got, want, rtol=1e-10, atol=1e-10):
            return f"size {size}: rank {comm.rank} got {got[:4].tolist()}..., expected {want[:4].tolist()}..."
        if comm.tracer.summary().get("all_reduce"):
            return "it called all_reduce: build it from send/recv (comm.isend, comm.recv) only"
    if not comm.tracer.summary().get("send"):
        return "no send went through comm: build it from comm.isend and comm.recv"
    return None


def _check_ring_all_reduce(fn) -> str | None:
    return _on_clusters(_ring_rank, fn, (2, 3, 4), [1, 5, 12, 103])


def _sync_rank(fn):
    """On each rank: the learner's gradient sync vs the full batch's gradients in one process."""
    from .comm import Comm
    from .data import ArithmeticData, shard
    from .model import GPT, PRESETS

    comm = Comm()
    r, n = comm.rank, comm.size
    x, y = ArithmeticData(16, 0).batch(0, 4 * n)
    reference = GPT(PRESETS["nano"], seed=7)
    reference(x, y).backward()
    model = GPT(PRESETS["nano"], seed=7)
    model(shard(x, r, n), shard(y, r, n)).backward()
    fn(model, comm)
    if not comm.tracer.summary().get("all_reduce"):
        return "no all_reduce went through comm: call comm.all_reduce(p.grad) for each parameter"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            return f"rank {r}: {name}.grad is None after your sync"
        if torch.allclose(p.grad, q.grad * n, rtol=1e-4, atol=1e-7) and n > 1:
            return f"rank {r}: {name}.grad is the sum over ranks: divide by comm.size to average"
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7):
            return f"rank {r}: {name}.grad differs from the full batch's gradient"
    return None


def _check_sync_gradients(fn) -> str | None:
    return _on_clusters(_sync_rank, fn, sizes=(2, 3))


_RANKS: dict = {}  # (world size, collective timeout) -> a running Cluster, kept between checks


def ranks(n: int, timeout: float = 5):
    """A running cluster of ``n`` ranks for the checkers, started once and reused by every check
    (starting ranks is most of a check's time).  A check that fails or times out leaves it to be
    restarted by its next run; :func:`release` stops them all."""
    from .launch import Cluster

    key = (n, timeout)
    if key not in _RANKS:
        _RANKS[key] = Cluster(n, timeout=timeout, threads=1, forward_output=False)
    return _RANKS[key]


def release() -> None:
    """Stop the checkers' ranks (they are also stopped when the kernel exits)."""
    while _RANKS:
        _RANKS.popitem()[1].close()


def _on_clusters(rank_fn, fn, sizes=(2, 3, 4), *args) -> str | None:
    """Run ``rank_fn(fn, *args)`` on running clusters of each size; the first problem found, or None."""
    from .launch import RankError

    for n in sizes:
        try:
            problems = [p for p in ranks(n).run(rank_fn, fn, *args, timeout=60) if p]
        except RankError as exc:
            return f"with {n} ranks: {str(exc).splitlines()[0]}"
        except TimeoutError:
            return f"with {n} ranks it did not finish within 60 s (a rank waiting for a message?)"
        if problems:
            return f"with {n} ranks, {problems[0]}"
    return None


def _check_topk_error_feedback(fn) -> str | None:
    """Against the definition (top k of grad + residual; the rest kept), on random tensors."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((10, 1), (100, 7), (1000, 100), (5, 5)):
        grad, residual = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
        corrected = grad + residual
        want_idx = corrected.abs().topk(k).indices
        try:
            out = fn(grad.clone(), residual.clone(), k)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return f"n={n}, k={k}: raised {type(exc).__name__}: {exc}"
        if not isinstance(out, tuple) or len(out) != 3 or any(t is None for t in out):
            return "return a tuple (indices, values, new_residual)"
        idx, values, new_residual = (torch.as_tensor(t) for t in out)
        if sorted(idx.long().tolist()) != sorted(want_idx.tolist()):
            if sorted(grad.abs().topk(k).indices.tolist()) == sorted(idx.long().tolist()) != \
                    sorted(want_idx.tolist()):
                return (f"n={n}, k={k}: you chose the top k of grad; choose them from "
                        "grad + residual (that is what error feedback means)")
            return f"n={n}, k={k}: wrong indices; keep the k entries of grad + residual largest in |x|"
        order = idx.long().argsort()
        if not torch.allclose(values[order], corrected[idx.long()][order]):
            return f"n={n}, k={k}: values must be (grad + residual) at the chosen indices"
        expected = corrected.clone()
        expected[want_idx] = 0
        if not torch.allclose(new_residual, expected):
            return (f"n={n}, k={k}: the new residual must be grad + residual with the sent "
                    "entries set to zero")
    return None


def _zero1_rank(fn):
    """On each rank: three ZeRO-1 steps of the learner's vs Adam on the whole vector in one process."""
    import torch.nn as nn

    from .comm import Comm

    comm = Comm()
    n, r = comm.size, comm.rank
    numel = 12 * n  # a multiple of N: the padding is the caller's job
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(3)]  # the same on every rank
    reference = nn.Parameter(start.clone())
    ref_opt = torch.optim.Adam([reference], lr=0.1)
    flat_params = start.clone()
    size = numel // n
    shard = nn.Parameter(start[r * size:(r + 1) * size].clone())
    optimizer = torch.optim.Adam([shard], lr=0.1)
    for step, g in enumerate(grads):
        reference.grad = g.clone()
        ref_opt.step()
        fn(flat_params, g.clone(), shard, optimizer, comm)
        if not torch.allclose(flat_params, reference.detach(), rtol=1e-5, atol=1e-6):
            wrong = (flat_params - reference.detach()).abs().gt(1e-5).nonzero().flatten()
            owner = int(wrong[0]) // size if len(wrong) else -1
            if torch.allclose(shard.detach(), reference.detach()[r * size:(r + 1) * size],
                              rtol=1e-5, atol=1e-6):
                return (f"step {step}: your own shard is right but element {int(wrong[0])} "
                        f"(rank {owner}'s shard) is not: all-gather every rank's shard into flat_params")
            return (f"step {step}: rank {r}'s parameters differ from Adam on the whole vector; give "
                    "the shard its slice of the gradient (elements rank·S to (rank+1)·S), then step")
    ops = comm.tracer.summary()
    if not ops.get("all_gather"):
        return "no all_gather went through comm: use comm.all_gather(flat_params, shard.detach())"
    if ops.get("all_reduce") or ops.get("broadcast"):
        return "only an all_gather is needed: the gradients are already averaged on every rank"
    return None


def _check_zero1_step(fn) -> str | None:
    return _on_clusters(_zero1_rank, fn, sizes=(2, 3))


def _column_parallel_rank(fn):
    """On each rank: the learner's column-parallel Function on this rank's output columns of a full
    nn.Linear, forward and backward, against the full layer (lesson 06)."""
    import torch.nn as nn

    from .comm import Comm

    comm = Comm()
    r, n = comm.rank, comm.size
    gen = torch.Generator().manual_seed(6)
    full, per = nn.Linear(6, 4 * n), 4
    with torch.no_grad():  # the same full layer, input and upstream gradient on every rank
        full.weight.copy_(torch.randn(full.weight.shape, generator=gen))
        full.bias.copy_(torch.randn(full.bias.shape, generator=gen))
    x, upstream = torch.randn(3, 5, 6, generator=gen), torch.randn(3, 5, 4 * n, generator=gen)
    ref_x = x.clone().requires_grad_()
    want = full(ref_x)
    (want * upstream).sum().backward()
    rows = slice(r * per, (r + 1) * per)
    weight = full.weight[rows].detach().clone().requires_grad_()
    bias = full.bias[rows].detach().clone().requires_grad_()
    mine = x.clone().requires_grad_()
    comm.tracer.clear()
    try:
        y = fn.apply(mine, weight, bias, comm)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return f"rank {r}: forward raised {type(exc).__name__}: {exc}"
    if not torch.is_tensor(y):
        return f"forward returned {type(y).__name__}: return X·A_r + b_r (F.linear(x, weight, bias))"
    if tuple(y.shape) != (3, 5, per):
        return (f"rank {r}: forward returned shape {tuple(y.shape)}, expected (3, 5, {per}): "
                "this rank's columns of the output only")
    if not torch.allclose(y, want[..., rows], rtol=1e-5, atol=1e-6):
        return f"rank {r}: forward differs from columns {r * per}:{(r + 1) * per} of the full layer's output"
    if comm.tracer.events:
        return ("forward communicated: a column-parallel layer needs none in forward, every rank "
                "already has all of X")
    try:
        (y * upstream[..., rows]).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return f"rank {r}: backward raised {type(exc).__name__}: {exc}"
    for name, got, ref in (("weight", weight.grad, full.weight.grad[rows]),
                           ("bias", bias.grad, full.bias.grad[rows])):
        if got is None or not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
            return (f"rank {r}: the {name} gradient differs from the full layer's rows "
                    f"{r * per}:{(r + 1) * per} (dL/dA_r = Xᵀ·dL/dY_r, summed over all tokens)")
    if mine.grad is None:
        return f"rank {r}: backward returned no gradient for x"
    own = upstream[..., rows] @ weight.detach()
    if torch.allclose(mine.grad, own, rtol=1e-5, atol=1e-5):
        return (f"rank {r}: dL/dX is only this rank's part (dL/dY_r·A_rᵀ): sum it over the ranks "
                "with comm.all_reduce — the f operator's backward")
    if not torch.allclose(mine.grad, ref_x.grad, rtol=1e-5, atol=1e-5):
        return f"rank {r}: dL/dX differs from the full layer's"
    if [e.op for e in comm.tracer.events] != ["all_reduce"]:
        return (f"backward should make exactly one comm.all_reduce (of dL/dX), it made "
                f"{[e.op for e in comm.tracer.events] or 'none through comm'}")
    return None


def _check_column_parallel_linear(fn) -> str | None:
    return _on_clusters(_column_parallel_rank, fn, sizes=(2, 3))


def _check_loss_scale_update(fn) -> str | None:
    """The learner's rule, step by step, against DynamicLossScaler on an overflow pattern."""
    from .precision import DynamicLossScaler

    ref = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=3)
    scale, good = ref.scale, 0
    pattern = [True, True, False, False, False, False, True, False, False, False, False]
    for step, found_inf in enumerate(pattern):
        ref.update(found_inf)
        try:
            out = fn(scale, good, found_inf, 3)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return f"step {step}: raised {type(exc).__name__}: {exc}"
        if not isinstance(out, tuple) or len(out) != 3:
            return "return a tuple (new_scale, new_good_steps, take_step)"
        scale, good, take = out
        if bool(take) == found_inf:
            return (f"step {step}: found_inf={found_inf} but take_step={take}: skip the optimizer "
                    "step exactly when a gradient overflowed")
        if scale != ref.scale:
            return (f"step {step} (found_inf={found_inf}): scale {scale:g}, expected {ref.scale:g} "
                    "(halve on overflow; double after growth_interval good steps in a row)")
        if good != ref.good_steps:
            return (f"step {step}: good_steps {good}, expected {ref.good_steps} (reset it to 0 on "
                    "overflow and whenever the scale grows)")
    return None


#: (P, M) the 1F1B checker tries: fewer, as many and more micro-batches than stages, an odd P
_PIPE_CASES = [(2, 1), (2, 4), (3, 2), (3, 3), (3, 5), (4, 4), (4, 7)]
#: run for real: P ranks, M micro-batches, batch size (3 ranks: 12 samples in 5 uneven micro-batches)
_PIPE_RUNS = {2: (4, 8), 3: (5, 12)}


def _pipe_model():
    from .model import GPTConfig
    return GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16)


def _one_f_one_b_table(fn, P: int, M: int):
    """The learner's rows as a table of Actions (stage = rank), or the sentence saying what is wrong."""
    import re

    from .parallel.schedules import Action

    table = []
    for r in range(P):
        call = f"{getattr(fn, '__name__', 'your function')}({r}, {P}, {M})"
        try:
            row = fn(r, P, M)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return f"{call} raised {type(exc).__name__}: {exc}"
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
    from .comm import Comm
    from .data import ArithmeticData
    from .model import GPT
    from .parallel.pipeline import PipelineExecutor, PipelineStage

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
    from .data import ArithmeticData
    from .model import GPT

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


def _check_one_f_one_b(fn) -> str | None:
    """Valid (the validator), 1F1B's memory bound, 1F1B's order or makespan, then run for real."""
    from .launch import RankError
    from .parallel.schedules import ScheduleError, orders, peak_in_flight, simulate, validate

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



#: (dp, pp, tp) meshes the mesh_groups checker tries, odd sizes and size-1 axes included
_MESH_SHAPES = [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 1), (1, 1, 1), (2, 1, 3)]


def _mesh_groups_of(fn, dp: int, pp: int, tp: int, axis: str):
    """The learner's groups, each sorted, or the sentence saying why they are not groups."""
    call = f"{getattr(fn, '__name__', 'your function')}({dp}, {pp}, {tp}, {axis!r})"
    try:
        got = fn(dp, pp, tp, axis)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return f"{call} raised {type(exc).__name__}: {exc}"
    if got is None:
        return f"{call} returned None: return a list of groups, each a list of ranks"
    try:
        return sorted(sorted(int(r) for r in g) for g in got)
    except (TypeError, ValueError):
        return f"{call} returned {got!r}: return a list of lists of ranks, like [[0, 1], [2, 3]]"


def _mesh_groups_rank(groups: dict) -> dict:
    """On each rank: build the learner's groups (every rank creates every group, in order) and
    all-reduce the rank numbers over this rank's group of each axis."""
    import torch.distributed as dist

    out = {}
    for axis, axis_groups in groups.items():
        mine = None
        for g in axis_groups:
            group = dist.new_group(g)
            if dist.get_rank() in g:
                mine = group
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mine)
        out[axis] = t.item()
    return out


def _check_mesh_groups(fn) -> str | None:
    """The groups of every axis for several meshes, then used for real on 4 ranks (2 x 1 x 2)."""
    from .launch import RankError
    from .parallel.mesh import MeshShape

    for dp, pp, tp in _MESH_SHAPES:
        s = MeshShape(dp, pp, tp)
        for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            groups = _mesh_groups_of(fn, dp, pp, tp, axis)
            if isinstance(groups, str):
                return groups
            where = f"dp={dp}, pp={pp}, tp={tp}, axis {axis!r}"
            if sorted(r for g in groups for r in g) != list(range(s.size)):
                return (f"{where}: every rank 0..{s.size - 1} must be in exactly one group; "
                        f"got {groups}")
            want = sorted(s.groups(axis))
            if groups != want:
                wrong = next(g for g in groups if g not in want)
                return (f"{where}: {wrong} is not a {axis} group — a group's ranks differ only in "
                        f"the {axis} coordinate, with rank = (p·dp + d)·tp + t (tensor index "
                        f"fastest, then data, then pipeline); expected {want} ({size} ranks each)")
    s = MeshShape(2, 1, 2)
    groups = {axis: _mesh_groups_of(fn, 2, 1, 2, axis) for axis in ("dp", "tp")}
    try:
        sums = ranks(4, timeout=10).run(_mesh_groups_rank, groups, timeout=60)
    except RankError as exc:
        return f"on 4 ranks: {str(exc).splitlines()[0]}"
    for r, got in enumerate(sums):
        for axis, total in got.items():
            if total != sum(s.group_of(r, axis)):
                return (f"on 4 ranks: rank {r}'s all-reduce over its {axis} group gave {total:g}, "
                        f"expected {sum(s.group_of(r, axis))}")
    return None

CHECKS = {
    "zero_bytes_per_device": (_check_zero_bytes,
                              "equals 4Ψ+12Ψ/N, 2Ψ+14Ψ/N and 16Ψ/N, and the ZeRO paper's numbers"),
    "ring_all_reduce": (_check_ring_all_reduce,
                        "equals dist.all_reduce at 2, 3 and 4 ranks, sizes 1, 5, 12 and 103, "
                        "using send/recv only"),
    "sync_gradients": (_check_sync_gradients,
                       "every rank holds the full batch's gradients at 2 and 3 ranks"),
    "zero1_step": (_check_zero1_step,
                   "equals Adam on the whole parameter vector at 2 and 3 ranks, sharded"),
    "column_parallel_linear": (_check_column_parallel_linear,
                               "equals the full nn.Linear's output columns and gradients at 2 and "
                               "3 ranks, with one all-reduce, in backward"),
    "loss_scale_update": (_check_loss_scale_update,
                          "halves on overflow and skips the step, doubles after a run of good steps"),
    "topk_error_feedback": (_check_topk_error_feedback,
                            "sends the k largest entries of grad + residual and keeps the rest"),
    "mesh_groups": (_check_mesh_groups,
                    "the dp, pp and tp groups of six meshes, odd sizes included, and all-reduces "
                    "over them on 4 ranks"),
    "one_f_one_b": (_check_one_f_one_b,
                    "valid 1F1B order for P = 2, 3, 4 with M below, equal to and above P, at most "
                    "P − rank micro-batches in flight; trains like one process on 2 and 3 ranks"),
}


def verdict(name: str) -> str:
    """The fixed line a correct solution prints (stored as the check cell's expected output)."""
    return f"✓ {name}: correct — {CHECKS[name][1]}"


def check(name: str, fn) -> None:
    """Check the learner's ``fn`` for exercise ``name`` and print one line: the verdict.

    Returns nothing, so the check cell's only output is that line (nbval compares it).
    Use :func:`problem` to get the reason as a value."""
    found = problem(name, fn)
    print(verdict(name) if found is None else f"✗ {name}: {found}")


def problem(name: str, fn) -> str | None:
    """What is wrong with ``fn`` for exercise ``name``, or None when it is correct."""
    if name not in CHECKS:
        raise KeyError(f"no exercise called {name!r}; known: {', '.join(CHECKS)}")
    return CHECKS[name][0](fn)


# --------------------------------------------------------------------------------------------------
# solutions/ -> lessons/
# --------------------------------------------------------------------------------------------------


def _strip_solution(source: str) -> str:
    out, inside = [], False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{PLACEHOLDER}\n")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "".join(out).rstrip("\n")


def _check_name(source: str) -> str | None:
    if not source.lstrip().startswith(CHECK_MARK):
        return None
    for name in CHECKS:
        if f'check("{name}"' in source:
            return name
    raise ValueError(f"a {CHECK_MARK} cell must call check(\"<exercise>\", ...):\n{source}")


def normalise(nb: dict) -> dict:
    """Outputs stripped, except the check cells, which hold the pass verdict; no widget state."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        name = _check_name(source)
        cell["execution_count"] = None if name is None else 1  # nbval skips "unrun" cells
        cell["outputs"] = [] if name is None else [
            {"name": "stdout", "output_type": "stream", "text": [verdict(name) + "\n"]}]
    return nb


def build_exercise(solution: dict) -> dict:
    """The learner's notebook: every answer replaced by a placeholder."""
    nb = normalise(solution)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            if BEGIN in source or END in source:
                cell["source"] = _strip_solution(source)
    return nb


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(prog="python -m minitrain.exercises",
                                     description="write lessons/ from solutions/")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if lessons/ or solutions/ are out of date")
    parser.add_argument("--solutions", type=Path, default=root / "solutions")
    parser.add_argument("--lessons", type=Path, default=root / "lessons")
    args = parser.parse_args(argv)
    stale = []
    for src in sorted(args.solutions.glob("[0-9]*.ipynb")):
        solution = json.loads(src.read_text())
        targets = {src: _dump(normalise(solution)),
                   args.lessons / src.name: _dump(build_exercise(solution))}
        for path, text in targets.items():
            if not path.exists() or path.read_text() != text:
                stale.append(path)
                if not args.check:
                    path.write_text(text)
    for path in stale:
        print(("out of date: " if args.check else "wrote ") + str(path))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
