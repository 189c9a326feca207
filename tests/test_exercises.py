"""The exercise workflow: checkers that can fail, and lessons/ generated from solutions/."""

import json
import time
from pathlib import Path

import pytest
import torch

from minitrain import exercises
from minitrain.comm import ring_all_reduce
from minitrain.exercises import PLACEHOLDER, build_exercise, check, normalise, problem, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_lessons_are_generated_from_the_solutions_and_up_to_date(capsys):
    assert exercises.main(["build", "--check"]) == 0, "run: python -m minitrain.exercises build"
    stale = ROOT / "solutions" / "00_why_one_device_is_not_enough.ipynb"
    text = stale.read_text()
    try:  # the check must be able to fail: a solution edited without a build is caught
        stale.write_text(text.replace("Lesson 00", "Lesson 00 (edited)", 1))
        assert exercises.main(["build", "--check"]) == 1
        assert "out of date" in capsys.readouterr().out
    finally:
        stale.write_text(text)
    names = sorted(p.name for p in (ROOT / "solutions").glob("[0-9]*.ipynb"))
    assert names == sorted(p.name for p in (ROOT / "lessons").glob("[0-9]*.ipynb"))
    assert len(names) >= 2


def test_no_answer_reaches_the_learners_notebooks():
    for path in (ROOT / "lessons").glob("[0-9]*.ipynb"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
        assert PLACEHOLDER in text, f"{path.name} has no exercise"


def test_stored_outputs_are_small_and_hold_only_verdicts():
    for folder in ("lessons", "solutions"):
        for path in (ROOT / folder).glob("[0-9]*.ipynb"):
            nb = json.loads(path.read_text())
            assert "widgets" not in nb["metadata"]
            outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
            assert outputs, f"{path.name}: no check cell"
            for o in outputs:
                assert o["output_type"] == "stream" and "".join(o["text"]).startswith("✓ ")
            assert path.stat().st_size < 60_000


def test_build_replaces_the_answer_and_keeps_the_rest():
    solution = {"metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 4, "cells": [
        {"cell_type": "code", "metadata": {}, "execution_count": 3, "outputs": [{"output_type": "stream", "name": "stdout", "text": "x"}],
         "source": "def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION\n"},
        {"cell_type": "code", "metadata": {}, "execution_count": 4, "outputs": [],
         "source": '# NBVAL_CHECK_OUTPUT\ncheck("ring_all_reduce", f)'},
    ]}
    nb = build_exercise(solution)
    assert nb["cells"][0]["source"] == f"def f(x):\n    y = 1\n    {PLACEHOLDER}"
    assert nb["cells"][0]["outputs"] == [] and "widgets" not in nb["metadata"]
    assert nb["cells"][1]["outputs"][0]["text"] == [verdict("ring_all_reduce") + "\n"]
    assert normalise(solution)["cells"][0]["source"] == solution["cells"][0]["source"]


@pytest.mark.parametrize("source, message", [
    ("# BEGIN SOLUTION\nx = 1\n", "without '# END SOLUTION'"),
    ("x = 1\n# END SOLUTION\n", "without '# BEGIN SOLUTION'"),
])
def test_broken_markers_are_refused(source, message):
    nb = {"metadata": {}, "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": source}]}
    with pytest.raises(ValueError, match=message):
        build_exercise(nb)


def zero_right(psi, n, stage):
    return 2 * psi / (n if stage >= 3 else 1) + 2 * psi / (n if stage >= 2 else 1) + 12 * psi / (n if stage >= 1 else 1)


def test_zero_checker_passes_right_and_fails_wrong(capsys):
    assert problem("zero_bytes_per_device", zero_right) is None
    assert "returned None" in problem("zero_bytes_per_device", lambda psi, n, stage: None)
    assert "expected" in problem("zero_bytes_per_device", lambda psi, n, stage: 16 * psi / n)
    assert "raised ZeroDivisionError" in problem("zero_bytes_per_device", lambda psi, n, stage: 1 / 0)
    check("zero_bytes_per_device", zero_right)
    assert capsys.readouterr().out == verdict("zero_bytes_per_device") + "\n"


def ring_with_all_reduce(tensor, comm):
    comm.all_reduce(tensor)
    return tensor


def ring_behind_the_tracers_back(tensor, comm):
    import torch.distributed as dist
    dist.all_reduce(tensor)
    return tensor


def ring_that_only_receives(tensor, comm):
    comm.recv(torch.empty(1), (comm.rank - 1) % comm.size)  # everyone waits: a deadlock
    return tensor


def ring_off_by_one(tensor, comm):
    ring_all_reduce(tensor, comm)
    tensor += 1
    return tensor


def test_ring_checker_passes_the_reference_and_catches_mistakes():
    assert problem("ring_all_reduce", ring_all_reduce) is None
    assert "send/recv" in problem("ring_all_reduce", ring_with_all_reduce)
    assert "expected" in problem("ring_all_reduce", ring_off_by_one)
    assert "expected" in problem("ring_all_reduce", lambda t, c: t)  # the blank exercise
    assert "no send went through comm" in problem("ring_all_reduce", ring_behind_the_tracers_back)
    t0 = time.perf_counter()
    assert "with 2 ranks" in problem("ring_all_reduce", ring_that_only_receives)
    assert time.perf_counter() - t0 < 15  # the deadlock is cut by the collective timeout


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="ring_all_reduce"):
        check("nope", print)


def zero1_right(flat_params, flat_grads, shard, optimizer, comm):
    size, r = flat_params.numel() // comm.size, comm.rank
    shard.grad = flat_grads[r * size:(r + 1) * size].clone()
    optimizer.step()
    comm.all_gather(flat_params, shard.detach())


def zero1_without_gather(flat_params, flat_grads, shard, optimizer, comm):
    size, r = flat_params.numel() // comm.size, comm.rank
    shard.grad = flat_grads[r * size:(r + 1) * size].clone()
    optimizer.step()
    flat_params[r * size:(r + 1) * size] = shard.detach()


def test_zero1_step_checker():
    assert problem("zero1_step", zero1_right) is None
    assert "all-gather every rank's shard" in problem("zero1_step", zero1_without_gather)
    assert "differ from Adam" in problem("zero1_step", lambda *args: None)


def scale_right(scale, good, found_inf, interval):
    if found_inf:
        return scale / 2, 0, False
    good += 1
    return (scale * 2, 0, True) if good == interval else (scale, good, True)


def test_loss_scale_update_checker():
    assert problem("loss_scale_update", scale_right) is None
    never_grows = lambda s, g, f, i: (s / 2, 0, False) if f else (s, g + 1, True)  # noqa: E731
    assert "double after" in problem("loss_scale_update", never_grows)
    steps_anyway = lambda s, g, f, i: (*scale_right(s, g, f, i)[:2], True)  # noqa: E731
    assert "skip the optimizer step" in problem("loss_scale_update", steps_anyway)
    assert "return a tuple" in problem("loss_scale_update", lambda *a: None)


def one_f_one_b_right(rank, stages, microbatches):
    warmup = min(stages - rank - 1, microbatches)
    actions = [f"F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    return actions + [f"B{m}" for m in range(microbatches - warmup, microbatches)]


def test_one_f_one_b_checker():
    assert problem("one_f_one_b", one_f_one_b_right) is None
    gpipe = lambda r, p, m: [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]  # noqa: E731
    assert "that is GPipe" in problem("one_f_one_b", gpipe)
    # no warm-up: valid and within the memory bound, but the ranks wait on each other
    eager = lambda r, p, m: [a for i in range(m) for a in (f"F{i}", f"B{i}")]  # noqa: E731
    assert "time units where 1F1B takes" in problem("one_f_one_b", eager)
    backwards_first = lambda r, p, m: one_f_one_b_right(r, p, m)[::-1]  # noqa: E731
    assert "comes before" in problem("one_f_one_b", backwards_first)
    assert "returned None" in problem("one_f_one_b", lambda r, p, m: None)
    assert "is not an action" in problem("one_f_one_b", lambda r, p, m: ["forward 0"])
    missing = lambda r, p, m: one_f_one_b_right(r, p, m)[:-1]  # noqa: E731
    assert "missing" in problem("one_f_one_b", missing)


def test_mesh_groups_checker():
    from minitrain.parallel.mesh import MeshShape

    assert problem("mesh_groups", lambda dp, pp, tp, axis: MeshShape(dp, pp, tp).groups(axis)) is None
    everyone = lambda dp, pp, tp, axis: [list(range(dp * pp * tp))]  # noqa: E731
    assert "is not a dp group" in problem("mesh_groups", everyone)
    # the data index fastest instead of the tensor index: groups of the right size, wrong ranks
    data_fastest = lambda dp, pp, tp, axis: [  # noqa: E731
        [r for r in range(dp * pp * tp) if _coords_data_fastest(r, dp, pp, tp, axis) == key]
        for key in sorted({_coords_data_fastest(r, dp, pp, tp, axis) for r in range(dp * pp * tp)})]
    assert "tensor index fastest" in problem("mesh_groups", data_fastest)
    assert "returned None" in problem("mesh_groups", lambda *a: None)
    twice = lambda dp, pp, tp, axis: MeshShape(dp, pp, tp).groups(axis) * 2  # noqa: E731
    assert "exactly one group" in problem("mesh_groups", twice)


def _coords_data_fastest(r, dp, pp, tp, axis):
    d, rest = r % dp, r // dp
    t, p = rest % tp, rest // tp
    return tuple(v for k, v in (("dp", d), ("pp", p), ("tp", t)) if k != axis)


class ColumnRight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        return grad_x, flat.T @ x.reshape(-1, x.shape[-1]), flat.sum(0), None


class ColumnWithoutTheSum(ColumnRight):
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        return grad_out @ weight, flat.T @ x.reshape(-1, x.shape[-1]), flat.sum(0), None


class ColumnBlank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ...  # YOUR CODE HERE

    @staticmethod
    def backward(ctx, grad_out):
        ...  # YOUR CODE HERE


class ColumnNone(torch.autograd.Function):  # written, but returns nothing
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad_out):
        return None, None, None, None


def test_column_parallel_linear_checker():
    assert problem("column_parallel_linear", ColumnRight) is None
    assert "sum it over the ranks" in problem("column_parallel_linear", ColumnWithoutTheSum)
    assert problem("column_parallel_linear", ColumnBlank).startswith("not written yet: ColumnBlank")
    assert "forward returned NoneType" in problem("column_parallel_linear", ColumnNone)


def test_a_blank_exercise_says_not_written_yet_and_an_error_names_the_learners_line():
    from minitrain.exercises import CHECKS

    def blank_bytes(psi, n, stage):
        ...  # YOUR CODE HERE

    for name in CHECKS:  # every exercise, before its checker runs anything
        assert problem(name, blank_bytes).startswith("not written yet: blank_bytes still has")

    def broken_bytes(psi, n, stage):
        per_param = {0: 16}
        return psi * per_param[stage]

    message = problem("zero_bytes_per_device", broken_bytes)
    assert "raised KeyError: 1" in message and "line 3 of your broken_bytes: return psi * per_param[stage]" in message


def merge_right(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def test_online_softmax_merge_checker():
    assert problem("online_softmax_merge", merge_right) is None

    def blank_merge(out_a, lse_a, out_b, lse_b):
        ...  # YOUR CODE HERE
    assert "not written yet" in problem("online_softmax_merge", blank_merge)
    no_rescale = lambda oa, la, ob, lb: (oa + ob, torch.logaddexp(la, lb))  # noqa: E731
    assert "exp(lse_a - lse)" in problem("online_softmax_merge", no_rescale)
    with_max = lambda oa, la, ob, lb: (merge_right(oa, la, ob, lb)[0], torch.maximum(la, lb))  # noqa: E731
    assert "logaddexp" in problem("online_softmax_merge", with_max)

    def own_lse(oa, la, ob, lb):  # exp(lse_b - lse_b) style slip: NaN on fully masked rows
        lse = torch.logaddexp(la, lb)
        return (torch.exp(la - lse).unsqueeze(-1) * oa + (torch.exp(lb) / torch.exp(lse)).unsqueeze(-1)
                * ob * torch.exp(lb - lb).unsqueeze(-1)), lse
    assert "NaN" in problem("online_softmax_merge", own_lse)
    assert "(out, lse)" in problem("online_softmax_merge", lambda *a: merge_right(*a)[0])


def dispatch_right(output, input, output_splits, input_splits, comm):
    r, works = comm.rank, []
    ins, outs = input.split(input_splits), output.split(output_splits)
    for p in range(comm.size):
        if p != r:
            works.append(comm.isend(ins[p].contiguous(), p))
            works.append(comm.irecv(outs[p], p))
    outs[r].copy_(ins[r])
    for w in works:
        w.wait()
    return output


def test_all_to_all_dispatch_checker():
    assert problem("all_to_all_dispatch", dispatch_right) is None

    def blank_dispatch(output, input, output_splits, input_splits, comm):
        ...  # YOUR CODE HERE
    assert "not written yet" in problem("all_to_all_dispatch", blank_dispatch)
    swapped = lambda o, i, os, is_, c: dispatch_right(o, i, is_, os, c)  # noqa: E731
    assert "not the other way round" in problem("all_to_all_dispatch", swapped)

    def library(output, input, output_splits, input_splits, comm):
        torch.distributed.all_to_all_single(output, input, output_splits, input_splits,
                                            group=comm.group)
        return output
    assert "not dist.all_to_all_single" in problem("all_to_all_dispatch", library)
    assert "return output" in problem("all_to_all_dispatch",
                                      lambda *a: (dispatch_right(*a), None)[1])
