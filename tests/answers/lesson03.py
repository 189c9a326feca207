"""Lesson 03: top-k compression with error feedback — the solution and typical mistakes."""

import torch

from answers import Answers


def topk_ef(grad, residual, k):
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    values = corrected[indices]
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return indices, values, new_residual


def topk_of_grad_alone(grad, residual, k):
    """Chooses from this step's gradient, ignoring what is owed."""
    corrected = grad + residual
    indices = grad.abs().topk(k).indices
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return indices, corrected[indices], new_residual


def residual_not_zeroed(grad, residual, k):
    """Keeps the sent entries in the residual too: they are sent twice."""
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    return indices, corrected[indices], corrected.clone()


def topk_by_value(grad, residual, k):
    """The k largest values, not magnitudes: negative entries are never sent."""
    corrected = grad + residual
    indices = corrected.topk(k).indices
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return indices, corrected[indices], new_residual


def one_too_many(grad, residual, k):
    """k + 1 entries."""
    corrected = grad + residual
    indices = corrected.abs().topk(min(k + 1, corrected.numel())).indices
    new_residual = corrected.clone()
    new_residual[indices] = 0
    return indices, corrected[indices], new_residual


def residual_dropped(grad, residual, k):
    """Forgets error feedback: the rest is thrown away."""
    corrected = grad + residual
    indices = corrected.abs().topk(k).indices
    return indices, corrected[indices], torch.zeros_like(grad)


ANSWERS = {
    "topk_error_feedback": Answers(topk_ef, [
        (topk_of_grad_alone, "k largest entries of grad alone"),
        (residual_not_zeroed, "still holds the entries you sent"),
        (topk_by_value, "largest in magnitude |x|"),
        (one_too_many, "returned 2 indices and 2 values: send exactly k = 1"),
        (residual_dropped, "everything you did not send is lost"),
    ]),
}
