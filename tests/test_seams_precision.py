"""Lesson 07's seams: the fp32-master step and the recomputed block, filled from outside by the
lesson's solutions, run inside the real strategies and train exactly as the package's own code."""

import sys
from pathlib import Path

import pytest

from minitrain import GPTConfig, TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))
from answers.lesson07 import forgets_to_copy_back, recompute, step  # noqa: E402

MODEL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)
CFG = TrainConfig(steps=4, batch_size=8, seed=0, model=MODEL)

CASES = [
    ("single", 1, dict(precision="bf16-mixed"), "mixed_precision_step", step),
    ("single", 1, dict(precision="fp16-mixed", loss_scale=2.0 ** 20), "mixed_precision_step", step),
    ("ddp", 2, dict(precision="fp16-mixed", loss_scale=2.0 ** 20), "mixed_precision_step", step),
    ("ddp-naive", 2, dict(precision="bf16-mixed"), "mixed_precision_step", step),
    ("ddp", 2, dict(checkpoint_activations=True), "recompute_block", recompute),
    ("single", 1, dict(checkpoint_activations=True, precision="bf16-mixed"), "recompute_block",
     recompute),
]


@pytest.mark.parametrize("strategy, world, more, seam, fn", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_a_precision_seam_filled_from_outside_trains_like_the_package(clusters, strategy, world,
                                                                      more, seam, fn):
    cfg = CFG.with_(strategy=strategy, world_size=world, **more)
    own = train(cfg, cluster=clusters(world))
    theirs = train(cfg, cluster=clusters(world), seams={seam: fn})
    assert theirs.losses == own.losses
    assert theirs.summary.loss_scaler == own.summary.loss_scaler
    if seam == "recompute_block":  # only the blocks' inputs are kept, as with the package's
        assert (theirs.summary.memory[0]["bytes"]["activations_peak"]
                == own.summary.memory[0]["bytes"]["activations_peak"])


def test_the_fp16_run_skips_steps_through_the_seam(clusters):
    cfg = CFG.with_(precision="fp16-mixed", loss_scale=2.0 ** 20)
    run = train(cfg, cluster=clusters(1), seams={"mixed_precision_step": step})
    assert run.summary.loss_scaler["skipped_steps"] > 0


def test_the_seam_is_really_called(clusters):
    """A step that forgets to copy the masters back never changes the model: from the second step
    on its losses are not the package's (the model still holds the first step's weights)."""
    cfg = CFG.with_(precision="bf16-mixed", steps=3)
    stuck = train(cfg, cluster=clusters(1), seams={"mixed_precision_step": forgets_to_copy_back})
    own = train(cfg, cluster=clusters(1))
    assert stuck.losses[0] == own.losses[0]
    assert all(a != b for a, b in zip(stuck.losses[1:], own.losses[1:]))


def test_the_ledger_splits_the_optimizer_states_by_key(clusters):
    summary = train(CFG.with_(precision="bf16-mixed"), cluster=clusters(1)).summary
    psi, by_state = summary.params, summary.memory[0]["by_state"]
    assert by_state["master"] == 4 * psi
    assert by_state["exp_avg"] == by_state["exp_avg_sq"] == 4 * psi
