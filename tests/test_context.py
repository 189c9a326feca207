"""Context parallelism (lesson 09): the online-softmax merge, ring attention equal to full causal
attention forward and backward, and strategy ``context`` equal to one process."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minitrain import GPTConfig, TrainConfig, train
from minitrain.comm import Comm
from minitrain.parallel.context import (balanced_layout, block_attention, merge_attention,
                                        ring_work)
from minitrain.strategies import ConfigError
from minitrain.train import check_config

from conftest import assert_same_run

MODEL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=15)  # 15: padded for every cp > 1
CFG = TrainConfig(steps=6, batch_size=4, model=MODEL)


def test_merge_equals_full_attention_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    pos = torch.arange(10)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = block_attention(q, k[:, :, :4], v[:, :, :4], pos, pos[:4])
    b = block_attention(q, k[:, :, 4:], v[:, :, 4:], pos, pos[4:])
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, torch.logsumexp(
        (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~torch.ones(10, 10).tril().bool(),
                                                         float("-inf")), -1))
    dout = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, (q, k, v), dout)
    g_out = torch.autograd.grad(out, (q, k, v), dout)
    for x, y in zip(g_out, g_ref):
        torch.testing.assert_close(x, y)


def _ring_job(t):
    from minitrain.parallel.context import ring_attention
    comm = Comm()
    g = torch.Generator().manual_seed(1)
    padded, pos = balanced_layout(t, comm.size)
    q, k, v, dout = (torch.randn(2, 2, padded, 8, generator=g, dtype=torch.float64)
                     for _ in range(4))
    full = [z.clone().requires_grad_() for z in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    idx = pos[comm.rank]
    mine = [z[:, :, idx].clone().requires_grad_() for z in (q, k, v)]
    out = ring_attention(*mine, pos, comm)
    out.backward(dout[:, :, idx])
    return [float((out - ref[:, :, idx]).abs().max())] + [
        float((m.grad - f.grad[:, :, idx]).abs().max()) for m, f in zip(mine, full)]


@pytest.mark.parametrize("n", [2, 3])
def test_ring_attention_equals_full_attention(clusters, n):
    for errors in clusters(n).run(_ring_job, 11):
        assert max(errors) < 1e-12, errors


def test_balanced_layout_balances_causal_work():
    _, pos = balanced_layout(16, 4)
    work = ring_work(pos)
    assert sorted(set(sum(row) for row in work)) == [sum(work[0])]  # equal totals per rank
    assert all(len(set(row[1:])) == 1 for row in work)  # and equal at every later ring step


@pytest.fixture(scope="module")
def single():
    return train(CFG, return_state=True)


@pytest.mark.parametrize("n,opts", [(2, {}), (3, {}), (4, {"cp": 2})])
def test_context_equals_single(clusters, single, n, opts):
    run = train(CFG.with_(strategy="context", world_size=n, options=opts),
                cluster=clusters(n), return_state=True)
    assert_same_run(run, single)
    rep = run.summary.report[0]
    assert rep["ring_sent_bytes_per_step"] == rep["ring_sent_bytes_theory"]
    assert rep["padded_len"] % (2 * rep["cp"]) == 0


def test_merge_seam_from_outside(clusters, single):
    def merge(out_a, lse_a, out_b, lse_b):
        m = torch.maximum(lse_a, lse_b)
        wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
        s = wa + wb
        return (wa.unsqueeze(-1) * out_a + wb.unsqueeze(-1) * out_b) / s.unsqueeze(-1), m + s.log()
    cfg = CFG.with_(strategy="context", world_size=2)
    run = train(cfg, cluster=clusters(2), seams={"online_softmax_merge": merge},
                return_state=True)
    assert_same_run(run, single)


def test_context_refusals():
    with pytest.raises(ConfigError, match="--cp 1, 2, 4"):
        check_config(CFG.with_(strategy="context", world_size=4, options={"cp": 3}))
    with pytest.raises(ConfigError, match="seq-len"):
        check_config(CFG.with_(strategy="context", world_size=4,
                               model=dataclasses.replace(MODEL, seq_len=6)))
