"""Lesson 00: the ZeRO bytes per device."""

from answers import Answers


def zero_bytes_per_device(psi, n, stage):
    weights, grads, optimizer = 2 * psi, 2 * psi, 12 * psi
    if stage >= 1:
        optimizer /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return weights + grads + optimizer


def everything_sharded_at_every_stage(psi, n, stage):
    return 16 * psi / n


def gradients_not_sharded_at_stage_2(psi, n, stage):
    """Stage 2 shards only the optimizer states, like stage 1."""
    return 2 * psi / (n if stage >= 3 else 1) + 2 * psi / (n if stage >= 3 else 1) + \
        12 * psi / (n if stage >= 1 else 1)


def adam_states_without_the_master(psi, n, stage):
    """8 bytes of optimizer states (momentum and variance), forgetting the fp32 master copy."""
    return 2 * psi / (n if stage >= 3 else 1) + 2 * psi / (n if stage >= 2 else 1) + \
        8 * psi / (n if stage >= 1 else 1)


def stage_counted_from_zero(psi, n, stage):
    """Stage s shards one kind more than it does (stage 1 already the gradients)."""
    return zero_bytes_per_device(psi, n, min(stage + 1, 3))


def returns_nothing(psi, n, stage):
    2 * psi + 2 * psi + 12 * psi / n  # computed, never returned


def divides_by_zero(psi, n, stage):
    return 16 * psi / (n - n)


ANSWERS = {
    "zero_bytes_per_device": Answers(zero_bytes_per_device, [
        (everything_sharded_at_every_stage, "16Ψ/N at every stage"),
        (gradients_not_sharded_at_stage_2, "that is stage 1's number — stage 2 also shards the gradients"),
        (adam_states_without_the_master, "you counted 8"),
        (stage_counted_from_zero, "that is stage 1's number — at stage 0 nothing is sharded"),
        (returns_nothing, "returned None"),
        (divides_by_zero, "raised ZeroDivisionError"),
    ]),
}
