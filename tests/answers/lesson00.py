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


def zero2_shards_the_weights(psi, n, stage):
    """Stage 2 shards the weights too (as only stage 3 does)."""
    return 2 * psi / (n if stage >= 2 else 1) + 2 * psi / (n if stage >= 2 else 1) + \
        12 * psi / (n if stage >= 1 else 1)


def returns_a_string(psi, n, stage):
    return f"{zero_bytes_per_device(psi, n, stage) / 1e9:.1f} GB"


def returns_a_dict(psi, n, stage):
    total = zero_bytes_per_device(psi, n, stage)
    return {"total": total}


ANSWERS = {
    "zero_bytes_per_device": Answers(zero_bytes_per_device, [
        (everything_sharded_at_every_stage, "gives the same 1,875,000,000 bytes at every stage"),
        (gradients_not_sharded_at_stage_2, "you did not divide the gradients by N, but stage 2 shards them"),
        (adam_states_without_the_master, "you counted 8 bytes per parameter of optimizer states"),
        (stage_counted_from_zero, "you divided the optimizer states by N, but stage 0 keeps them whole"),
        (zero2_shards_the_weights, "you divided the weights by N, but stage 2 keeps them whole"),
        (returns_a_string, "returned str '120.0 GB': return the number of bytes"),
        (returns_a_dict, "returned dict"),
        (returns_nothing, "returned None"),
        (divides_by_zero, "raised ZeroDivisionError"),
    ]),
}
