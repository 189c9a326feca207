"""Expert parallelism (lesson 09): the all-to-all from send/recv equal to all_to_all_single with
uneven splits, strategy ``expert`` equal to one process on a MoE model (with and without drops)."""

import dataclasses

import pytest
import torch

from minitrain import TrainConfig, train
from minitrain.comm import Comm
from minitrain.model import GPT, PRESETS
from minitrain.strategies import ConfigError
from minitrain.train import check_config

from conftest import assert_same_run

MOE = dataclasses.replace(PRESETS["tiny-moe"], n_layer=2, seq_len=12, d_model=32, n_head=2,
                          d_ff=64)
CFG = TrainConfig(steps=5, batch_size=4, model=MOE)


def _a2a_job():
    from minitrain.parallel.expert import all_to_all, all_to_all_reference
    comm = Comm()
    n, r = comm.size, comm.rank
    split = lambda src, dst: (3 * src + 2 * dst + src * dst) % 5  # noqa: E731 (uneven, some 0)
    ins, outs = [split(r, p) for p in range(n)], [split(p, r) for p in range(n)]
    x = torch.arange(sum(ins) * 3, dtype=torch.float32).view(-1, 3) + 100 * r
    mine = all_to_all(x.new_empty(sum(outs), 3), x, outs, ins, comm)
    ref = all_to_all_reference(x.new_empty(sum(outs), 3), x, outs, ins, comm)
    return torch.equal(mine, ref), sum(outs)


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_equals_reference(clusters, n):
    results = clusters(n).run(_a2a_job)
    assert all(same for same, _ in results)
    assert any(rows for _, rows in results)


def test_moe_model_counts_and_trains():
    assert GPT(MOE).num_params() == MOE.num_params()
    model = GPT(MOE)
    x = torch.randint(0, 13, (2, 12))
    loss = model(x, x)
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad is not None
    assert sum(model.blocks[0].mlp.tokens_per_expert) == 2 * 12 * MOE.top_k


@pytest.fixture(scope="module", params=[None, 1.0], ids=["no-drops", "drops"])
def case(request):
    cfg = CFG.with_(model=dataclasses.replace(MOE, capacity_factor=request.param))
    return cfg, train(cfg, return_state=True)


@pytest.mark.parametrize("n", [2, 4])
def test_expert_equals_single(clusters, case, n):
    cfg, ref = case
    run = train(cfg.with_(strategy="expert", world_size=n), cluster=clusters(n),
                return_state=True)
    assert_same_run(run, ref)
    rep = run.summary.report[0]
    assert (sum(rep["dropped"]) > 0) == (cfg.model.capacity_factor is not None)
    assert rep["all_to_all_sent_bytes_per_step"] == pytest.approx(rep["all_to_all_bytes_routed"])


def test_dispatch_seam_from_outside(clusters, case):
    cfg, ref = case

    def dispatch(output, input, output_splits, input_splits, comm):
        torch.distributed.all_to_all_single(output, input, output_splits, input_splits,
                                            group=comm.group)
        return output
    from answers.lesson09 import router

    run = train(cfg.with_(strategy="expert", world_size=2), cluster=clusters(2),
                seams={"all_to_all_dispatch": dispatch, "moe_router": router}, return_state=True)
    assert_same_run(run, ref)


def test_capacity_is_per_sequence_and_dropped_assignments_never_travel():
    """GShard's rule: in each group (one sequence) an expert's queue takes every first choice, in
    token order, before any second choice, and keeps the first `capacity`."""
    from minitrain.model import moe_router

    logits = torch.tensor([[[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0]]],  # 1 group, 3 tokens
                          requires_grad=True)
    experts, gates, keep, aux = moe_router(logits, 2, 2)
    # expert 0's queue: token 0's and token 1's first choices; expert 2's: token 1's second, token
    # 2's second; expert 1: token 2's first, then token 0's second
    assert experts.tolist() == [[[0, 1], [0, 2], [1, 2]]]
    assert keep.tolist() == [[[True, True], [True, True], [True, True]]]
    experts, gates, keep, aux = moe_router(logits, 2, 1)
    assert keep.tolist() == [[[True, False], [False, True], [True, False]]]
    assert torch.allclose(gates.sum(-1), torch.ones(1, 3))
    assert aux.requires_grad


def test_expert_refusals():
    with pytest.raises(ConfigError, match="tiny-moe"):
        check_config(TrainConfig(strategy="expert", world_size=2))
    with pytest.raises(ConfigError, match="does not split"):
        check_config(CFG.with_(strategy="expert", world_size=3))


def test_expert_odd_world_size(clusters):
    cfg = CFG.with_(steps=3, batch_size=6, model=dataclasses.replace(MOE, n_expert=6, top_k=2))
    ref = train(cfg, return_state=True)
    run = train(cfg.with_(strategy="expert", world_size=3), cluster=clusters(3),
                return_state=True)
    assert_same_run(run, ref)
