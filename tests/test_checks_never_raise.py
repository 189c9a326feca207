"""A check never raises, whatever the learner's function returns or does (lessons 05, 06, 07, 09):
odd return values, a tensor of the wrong dtype or shape, an exception, an autograd Function that
returns float64 — each gets a sentence, never an exception out of the checker."""

import pytest
import torch

from minitrain.course.exercises import CHECKS


def _returning(value):
    def fn(*args, **kwargs):
        return value
    fn.__name__ = f"returns_{type(value).__name__}"
    return fn


def _raising(*args, **kwargs):
    raise ValueError("boom")


ODD = [None, "x", 42, 3.5, [1, 2], (1,), {"a": 1}, torch.zeros(2),
       torch.zeros(3, 5, dtype=torch.float64), torch.zeros((), dtype=torch.int64),
       (torch.zeros(2),) * 4, (torch.zeros(2), torch.zeros(2)), ["F0", 3], [1.5, "B0"]]


class Float64(torch.autograd.Function):
    """Forward returns its first input in float64; backward passes the gradient straight back."""

    @staticmethod
    def forward(ctx, x, *rest):
        ctx.rest = len(rest)
        return x.double()

    @staticmethod
    def backward(ctx, grad):
        return (grad.float(),) + (None,) * ctx.rest


ALONE = ["one_f_one_b", "loss_scale_update", "online_softmax_merge", "moe_router",
         "mixed_precision_step", "recompute_block", "gemm_time"]
ON_RANKS = ["vocab_parallel_cross_entropy", "column_parallel_linear", "row_parallel_linear",
            "all_to_all_dispatch", "stage_step"]


@pytest.mark.parametrize("name", ALONE)
def test_odd_answers_get_a_sentence(name):
    checker = CHECKS[name][0]
    for fn in [_returning(v) for v in ODD] + [_raising]:
        found = checker(fn)
        assert isinstance(found, str) and found, f"{name}: {fn.__name__} got {found!r}"


@pytest.mark.parametrize("name", ON_RANKS)
def test_odd_answers_on_ranks_get_a_sentence(name):
    checker = CHECKS[name][0]
    odd = [_returning(None), _returning(torch.zeros(3, 5, dtype=torch.float64)), _raising]
    if name in ("vocab_parallel_cross_entropy", "column_parallel_linear", "row_parallel_linear"):
        odd.append(Float64)
    for fn in odd:
        found = checker(fn)
        assert isinstance(found, str) and found, f"{name}: {getattr(fn, '__name__', fn)} got {found!r}"


class Float64Loss(torch.autograd.Function):
    """A cross-entropy of the right shape, in float64 (here: zeros)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        return torch.zeros(target.shape, dtype=torch.float64)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, None


def test_a_loss_of_the_right_shape_in_float64_gets_a_sentence():
    found = CHECKS["vocab_parallel_cross_entropy"][0](Float64Loss)
    assert isinstance(found, str) and found
