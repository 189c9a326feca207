"""The model-parallel seams (lessons 05, 06, 08): each filled from outside with a reference function
— what a learner's correct exercise does — runs inside the real strategy (``train(cfg, seams=...)``)
and gives the losses of the package's own path."""

import pytest

from answers.lesson04 import zero1_step
from answers.lesson05 import one_f_one_b, stage_step
from answers.lesson06 import ColumnParallel as ColumnParallelLinear
from answers.lesson06 import RowParallel as RowParallelLinear
from answers.lesson06 import VocabParallelCE
from answers.lesson08 import mesh_groups
from minitrain import GPTConfig, TrainConfig, train
from minitrain.comm import ring_all_reduce

# the reference functions are the exercises' solutions (tests/answers/): what a learner's correct
# answer does.  4 layers (2 stages x 2 chunks), 4 heads (tp 2), a batch of 8 (2 replicas, micro-batches)
CFG = TrainConfig(steps=3, batch_size=8, seed=0,
                  model=GPTConfig(n_layer=4, n_head=4, d_model=32, seq_len=16))


TENSOR = {"column_parallel_linear": ColumnParallelLinear, "row_parallel_linear": RowParallelLinear}
PIPE = {"one_f_one_b": one_f_one_b, "stage_step": stage_step}

CASES = {
    "pipeline 1f1b": (CFG.with_(strategy="pipeline", world_size=2,
                                options={"schedule": "1f1b", "microbatches": 4}), PIPE),
    "pipeline zb-h1": (CFG.with_(strategy="pipeline", world_size=2,
                                 options={"schedule": "zb-h1", "microbatches": 3}),
                       {"stage_step": stage_step}),
    "pipeline interleaved": (CFG.with_(strategy="pipeline", world_size=2,
                                       options={"schedule": "interleaved", "microbatches": 2}),
                             {"stage_step": stage_step}),
    "tensor": (CFG.with_(strategy="tensor", world_size=2),
               {**TENSOR, "vocab_parallel_cross_entropy": VocabParallelCE}),
    "3d 1x2x2": (CFG.with_(strategy="3d", world_size=4, options={"pp": 2, "tp": 2}),
                 {**PIPE, **TENSOR, "mesh_groups": mesh_groups}),
    "3d 2x1x2": (CFG.with_(strategy="3d", world_size=4, options={"dp": 2, "tp": 2}),
                 {**TENSOR, "mesh_groups": mesh_groups}),
    "3d 2x2x1 ring": (CFG.with_(strategy="3d", world_size=4,
                               options={"dp": 2, "pp": 2, "zero_stage": 0, "microbatches": 2}),
                      {**PIPE, "mesh_groups": mesh_groups, "ring_all_reduce": ring_all_reduce}),
    "3d 2x1x2 zero1": (CFG.with_(strategy="3d", world_size=4, options={"dp": 2, "tp": 2}),
                       {"zero1_step": zero1_step}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_seam_filled_from_outside_gives_the_packages_losses(clusters, case):
    cfg, seams = CASES[case]
    cluster = clusters(cfg.world_size)
    ours = train(cfg, cluster=cluster).losses
    theirs = train(cfg, cluster=cluster, seams=seams).losses
    assert theirs == ours


def test_the_seams_reach_the_technique(clusters):
    """A wrong function in a seam changes the run: the seam is really used."""
    def gpipe(rank, P, M):  # valid, but not 1F1B: still the same losses
        return [f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)]

    cfg, _ = CASES["pipeline 1f1b"]
    run = train(cfg, cluster=clusters(2), seams={"one_f_one_b": gpipe})
    assert run.summary.report[0]["peak_in_flight"] == {0: 4, 1: 4}  # GPipe holds all M
    with pytest.raises(Exception, match="not an action"):
        train(cfg, cluster=clusters(2), seams={"one_f_one_b": lambda r, P, M: ["X0"]})


def test_the_ring_seam_carries_the_3d_replicas_gradients(clusters):
    """With --zero-stage 0 the replicas' gradient all-reduce is the given ring: send/recv on dp."""
    cfg, seams = CASES["3d 2x2x1 ring"]
    run = train(cfg, cluster=clusters(4), seams={"ring_all_reduce": ring_all_reduce})
    ours = train(cfg, cluster=clusters(4))
    dp_calls = lambda r: r.summary.report[0]["comm_by_group"]["dp"]["calls"]  # noqa: E731
    assert dp_calls(run) == 4 * (2 - 1) * dp_calls(ours)  # 2 phases x (N-1) sends and recvs


def test_a_seam_the_layout_does_not_use_is_refused_before_spawning(no_spawn):
    """ZeRO-1 reduce-scatters: a ring given for the replicas' all-reduce would be silently unused."""
    from minitrain.strategies import ConfigError

    cfg = CFG.with_(strategy="3d", world_size=4, options={"dp": 2, "tp": 2})
    with pytest.raises(ConfigError, match="add --zero-stage 0"):
        train(cfg, seams={"ring_all_reduce": ring_all_reduce})
