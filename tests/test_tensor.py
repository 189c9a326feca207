"""Tensor parallel (Megatron) and sequence parallel: equal to one process at TP = 1, 2, 3 and 4;
f and g; the vocabulary-parallel loss against the full cross-entropy, padding included; the
collectives per layer counted by the tracer; refusals before spawning."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minitrain import GPTConfig, TrainConfig, train
from minitrain.comm import Comm
from minitrain.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, Split,
                                       VocabParallelLinear, f, g, gather_from_sequence_parallel,
                                       merge_shards,
                                       reduce_scatter_to_sequence_parallel, shard_tensor,
                                       vocab_parallel_cross_entropy)
from minitrain.strategies import ConfigError
from minitrain.train import check_config
from conftest import assert_same_run

CFG = TrainConfig(steps=20, batch_size=8, seed=0)
#: 6 heads split over 3 ranks; 32 positions pad to 33 and a vocabulary of 13 to 15 under TP = 3
SIX_HEADS = GPTConfig(n_layer=2, n_head=6, d_model=48, seq_len=32)
TIED = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, tie_weights=True)


@pytest.fixture(scope="module")
def runs(clusters):
    """``runs(n, sp, model)``: ``tensor`` on n ranks (n = 0: ``single``), each run once."""
    cache = {}

    def get(n, sp=False, model=CFG.model):
        key = (n, sp, model)
        if key not in cache:
            cfg = CFG.with_(model=model) if n == 0 else CFG.with_(
                strategy="tensor", world_size=n, model=model, options={"sequence_parallel": sp})
            cache[key] = train(cfg, cluster=clusters(max(n, 1)), return_state=True)
        return cache[key]
    return get


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_tensor_parallel_equals_a_single_process(runs, n, sp):
    assert_same_run(runs(n, sp), runs(0))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_three_ranks_six_heads_with_padded_vocabulary_and_sequence(runs, sp):
    run = runs(3, sp, SIX_HEADS)
    assert_same_run(run, runs(0, model=SIX_HEADS))
    report = run.summary.report[0]
    assert report["vocab_padded"] == 15 and report["heads_per_rank"] == 2
    assert report["shapes"]["blocks.0.attn.qkv.weight"] == [3 * 48 // 3, 48]
    assert report["shapes"]["blocks.0.mlp.proj.weight"] == [48, 4 * 48 // 3]


def test_tied_embedding_and_head_share_one_vocabulary_shard(runs):
    assert_same_run(runs(2, True, TIED), runs(0, model=TIED))


def parameters_per_rank(m: GPTConfig, n: int) -> int:
    """Split matrices (vocabulary padded to a multiple of n) over n, plus what every rank repeats:
    LayerNorms, row-parallel biases, position embedding."""
    d, ff, vocab = m.d_model, m.ff, -(-m.vocab_size // n) * n
    split = 2 * vocab * d + m.n_layer * (3 * d * d + d * d + ff * d + ff + ff * d)
    replicated = m.seq_len * d + m.n_layer * (4 * d + 2 * d) + 2 * d
    return split // n + replicated


@pytest.mark.parametrize("n, model", [(2, CFG.model), (4, CFG.model), (3, SIX_HEADS)])
def test_each_rank_holds_its_shard_of_the_model_states(runs, n, model):
    for mem in runs(n, False, model).summary.memory:
        assert mem["bytes"]["parameters"] == 4 * parameters_per_rank(model, n)
        assert mem["bytes"]["gradients"] == mem["bytes"]["parameters"]  # fp32 Adam: 4 + 4 + 8
        assert mem["bytes"]["optimizer_states"] == 2 * mem["bytes"]["parameters"]


def test_the_cli_keeps_the_json_contract():
    out = subprocess.run([sys.executable, "-m", "minitrain", "train", "--strategy", "tensor",
                          "--world-size", "2", "--sequence-parallel", "--steps", "3", "--model",
                          "nano", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["step"] for line in lines[:-1]] == [0, 1, 2]
    summary = lines[-1]["summary"]
    assert summary["final_loss"] == lines[-2]["loss"] and summary["step_time_s"] > 0
    assert len(summary["comm"]) == len(summary["memory"]) == 2
    for comm in summary["comm"]:  # per step: 2 per layer and 1 each for embedding and head
        assert comm["reduce_scatter"]["calls"] == comm["all_gather"]["calls"] == 3 * (4 * 2 + 2)
    assert summary["report"][0]["sequence_parallel"] is True


# -- the collectives, counted by the tracer --------------------------------------------------------


def per_layer(run, rank=0):
    return run.summary.report[rank]["comm_per_layer"]


@pytest.mark.parametrize("n", [2, 4])
def test_two_all_reduces_forward_and_two_backward_per_layer(runs, n):
    run = runs(n)
    t, b, d = CFG.model.seq_len, CFG.batch_size, CFG.model.d_model
    activation = 4 * t * b * d  # one (t, b, d) fp32 tensor
    for rank in range(n):
        rows = per_layer(run, rank)
        for i in range(CFG.model.n_layer):
            layer = rows[f"blocks.{i}"]
            assert {k: v["calls"] for k, v in layer.items()} == {
                "all_reduce forward": 2, "all_reduce backward": 2}
            assert layer["all_reduce forward"]["bytes"] == 2 * activation
        assert {k: v["calls"] for k, v in rows["embed"].items()} == {"all_reduce forward": 1}
        assert {k: v["calls"] for k, v in rows["head"].items()} == {"all_reduce backward": 1}
        assert {k: v["calls"] for k, v in rows["loss"].items()} == {"all_reduce forward": 2}
        total = run.summary.comm[rank]["all_reduce"]["calls"] / CFG.steps
        assert total == 4 * CFG.model.n_layer + 4


@pytest.mark.parametrize("n", [2, 4])
def test_sequence_parallel_trades_each_all_reduce_for_a_reduce_scatter_and_an_all_gather(runs, n):
    plain, sp = per_layer(runs(n)), per_layer(runs(n, True))
    for i in range(CFG.model.n_layer):
        layer = sp[f"blocks.{i}"]
        assert {k: v["calls"] for k, v in layer.items()} == {
            "all_gather forward": 2, "reduce_scatter forward": 2,
            "reduce_scatter backward": 2, "all_gather backward": 2}
        sent = sum(v["sent_bytes"] for v in layer.values())  # Korthikanti: the same traffic
        assert sent == pytest.approx(sum(v["sent_bytes"] for v in plain[f"blocks.{i}"].values()))
    assert {k: v["calls"] for k, v in sp["sequence-parallel-grads"].items()} == {
        "all_reduce backward": 1}


# -- the pieces, on live ranks ---------------------------------------------------------------------


def f_and_g():
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward; and the
    sequence-parallel pair.  Returns what differs from the definitions (empty: nothing)."""
    comm = Comm()
    r, n = comm.rank, comm.size
    wrong = []
    x = torch.full((4, 3), float(r + 1), requires_grad=True)
    weight = torch.arange(12.0).view(4, 3) * (r + 1)
    y = f(x, comm)
    (y * weight).sum().backward()
    total = sum(range(1, n + 1))
    if not torch.equal(y, x) or not torch.equal(x.grad, torch.arange(12.0).view(4, 3) * total):
        wrong.append("f")
    ops = [(e.op, e.tag) for e in comm.tracer.events]
    if ops != [("all_reduce", "f backward")]:
        wrong.append(f"f traced {ops}")
    comm.tracer.clear()
    x.grad = None
    z = g(x, comm)
    (z * weight).sum().backward()
    if not torch.equal(z, torch.full((4, 3), float(total))) or not torch.equal(x.grad, weight):
        wrong.append("g")
    if [(e.op, e.tag) for e in comm.tracer.events] != [("all_reduce", "g forward")]:
        wrong.append("g traced")
    comm.tracer.clear()
    s = torch.arange(2.0 * 3).view(2, 3).add(10 * r).requires_grad_()  # my 2 positions
    full = gather_from_sequence_parallel(s, comm)
    expect = torch.cat([torch.arange(6.0).view(2, 3) + 10 * k for k in range(n)])
    (full * (r + 1)).sum().backward()
    if not torch.equal(full, expect) or not torch.equal(s.grad, torch.full((2, 3), float(total))):
        wrong.append("gather")
    p = torch.ones(2 * n, 3, requires_grad=True)
    out = reduce_scatter_to_sequence_parallel(p * (r + 1), comm)
    out.sum().backward()
    if not torch.equal(out, torch.full((2, 3), float(total))) or \
            not torch.equal(p.grad, torch.full((2 * n, 3), float(r + 1))):
        wrong.append("reduce-scatter")
    ops = [(e.op, e.tag) for e in comm.tracer.events]
    if ops != [("all_gather", "sp forward"), ("reduce_scatter", "sp backward"),
               ("reduce_scatter", "sp forward"), ("all_gather", "sp backward")]:
        wrong.append(f"sequence ops traced {ops}")
    return wrong


def test_f_and_g_forward_and_backward(clusters):
    assert clusters(2).run(f_and_g) == [[], []]


def mlp_equals_full(sp: bool):
    """GeLU(XA)B with A column- and B row-parallel vs the full layers: output and gradients."""
    comm = Comm()
    r, n = comm.rank, comm.size
    torch.manual_seed(0)  # the same full layers and input on every rank
    fc, proj = nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(6, 2, 8, requires_grad=True)
    ref = proj(F.gelu(fc(x)))
    ref.pow(2).sum().backward()
    col = ColumnParallelLinear.from_linear(fc, comm, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(proj, comm, sequence_parallel=sp)
    xs = x.detach().clone().requires_grad_()
    inp = xs[r * 6 // n:(r + 1) * 6 // n] if sp else xs
    out = row(F.gelu(col(inp)))
    out.pow(2).sum().backward()
    want = ref[r * 6 // n:(r + 1) * 6 // n] if sp else ref
    grad_x, grad_bias = xs.grad.clone(), row.bias.grad.clone()
    if sp:  # each rank holds the gradient of its own positions only: sum them
        dist.all_reduce(grad_x)
        dist.all_reduce(grad_bias)
    return [torch.allclose(out, want, atol=1e-6), torch.allclose(grad_x, x.grad, atol=1e-6),
            torch.allclose(col.weight.grad, shard_tensor(fc.weight.grad, r, n), atol=1e-6),
            torch.allclose(col.bias.grad, shard_tensor(fc.bias.grad, r, n), atol=1e-6),
            torch.allclose(row.weight.grad, shard_tensor(proj.weight.grad, r, n, dim=1), atol=1e-6),
            torch.allclose(grad_bias, proj.bias.grad, atol=1e-6)]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_column_then_row_parallel_equals_the_full_mlp(clusters, sp):
    for checks in clusters(2).run(mlp_equals_full, sp):
        assert all(checks), checks


def cross_entropy_against_full(pad_value: float):
    """The vocabulary-parallel loss and its gradient vs F.cross_entropy on the gathered logits;
    the padded columns hold ``pad_value``, which must change nothing."""
    comm = Comm()
    r, n = comm.rank, comm.size
    vocab = 13
    per = -(-vocab // n)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 3, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (16, 3), generator=gen)
    target[:n] = torch.arange(n).mul(per).unsqueeze(1)  # some target on every rank's slice
    full = logits.clone().requires_grad_()
    F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1)).backward()
    padded = torch.cat([logits, torch.full((16, 3, per * n - vocab), pad_value)], -1)
    mine = padded[..., r * per:(r + 1) * per].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, r * per, vocab, comm).mean()
    loss.backward()
    want = full.grad
    want = torch.cat([want, torch.zeros(16, 3, per * n - vocab)], -1)[..., r * per:(r + 1) * per]
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
    ops = [(e.op, e.tag) for e in comm.tracer.events]
    return loss.item(), ref.item(), torch.allclose(mine.grad, want, atol=1e-7), ops


@pytest.mark.parametrize("n", [3, 4])
def test_vocab_parallel_cross_entropy_equals_the_full_one(clusters, n):
    for pad_value in (0.0, 50.0):  # padded logits larger than every real one: still left out
        for loss, ref, grads_equal, ops in clusters(n).run(cross_entropy_against_full, pad_value):
            assert loss == pytest.approx(ref, rel=1e-6) and grads_equal
            assert ops == [("all_reduce", "loss forward")] * 2  # the max; the logit and sum-exp


def test_shard_and_merge_put_the_fused_qkv_back():
    q, k, v = (torch.arange(8.0).repeat_interleave(2).view(8, 2) + 100 * i for i in range(3))
    qkv = torch.cat([q, k, v])  # (3·8, 2): [q; k; v]
    shards = [shard_tensor(qkv, r, 2, parts=3) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([q[4:], k[4:], v[4:]]))  # rank 1's heads of each
    assert torch.equal(merge_shards(shards, Split(0, 3)), qkv)
    vocab = torch.arange(13.0).view(13, 1)
    padded = torch.cat([vocab, torch.zeros(1, 1)])
    assert torch.equal(merge_shards([shard_tensor(padded, r, 2) for r in range(2)], Split(0, 1, 13)),
                       vocab)
    with pytest.raises(ValueError, match="pad it to a multiple of 2"):
        shard_tensor(vocab, 0, 2)


def test_the_vocabulary_layer_pads_its_outputs_and_a_column_parallel_one_refuses():
    """13 outputs over 2 ranks: the output layer over the vocabulary keeps 7 rows a rank (one of
    padding, 13 real); a column-parallel linear names the dimension that does not split."""
    from types import SimpleNamespace

    comm = SimpleNamespace(size=2, rank=1)
    head = VocabParallelLinear(4, 13, comm, bias=False)
    assert head.output_size_per_partition == 7 and head.split == Split(0, 1, 13)
    assert head.weight.tp_split == Split(0, 1, 13)
    with pytest.raises(ValueError, match="out_features=13.* does not split into 1 part"):
        ColumnParallelLinear(4, 13, comm, bias=False)


# -- refusals, before any process starts -----------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    (dict(world_size=3), "n_head=4 does not split over --tp 3"),
    (dict(world_size=3), "use --tp 1, 2, 4, or --n-head 6 --d-model 96"),
    (dict(world_size=2, options={"tp": 4}), "--tp 4 must equal --world-size 2"),
    (dict(world_size=2, model=GPTConfig(d_ff=99)), "d_ff=99 does not split over --tp 2"),
    (dict(world_size=2, checkpoint_activations=True), "cannot checkpoint activations"),
    (dict(world_size=2, precision="bf16-mixed"), "supports --precision fp32 only"),
])
def test_impossible_configurations_are_refused_with_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(CFG.with_(strategy="tensor", **changes))
    check_config(CFG.with_(strategy="tensor", world_size=3, model=SIX_HEADS,
                           options={"sequence_parallel": True}))  # 32 positions over 3: padded
