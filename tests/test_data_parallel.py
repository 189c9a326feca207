"""Data parallel: naive DP and DDP equal a single process, and PyTorch's DDP; buckets, no_sync, bytes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minitrain import GPT, ArithmeticData, Comm, GPTConfig, PRESETS, TrainConfig, train
from minitrain.comm import written_bytes
from minitrain.data import shard
from minitrain.planning.analysis import overlap_fraction
from minitrain.parallel.data_parallel import DistributedDataParallel, NaiveDataParallel
from minitrain.parallel.flat import FIRST_BUCKET_BYTES, MIB, make_buckets
from conftest import assert_same_run

CFG = TrainConfig(steps=20, batch_size=12, seed=0)


@pytest.fixture(scope="module")
def single(clusters):
    return train(CFG, cluster=clusters(1), return_state=True)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy, options", [("ddp-naive", {}), ("ddp", {"bucket_mb": 0.1}),
                                               ("ddp", {})])
def test_data_parallel_equals_a_single_process(clusters, single, n, strategy, options):
    run = train(CFG.with_(strategy=strategy, world_size=n, options=options), cluster=clusters(n),
                return_state=True)
    assert_same_run(run, single)


def tied_frozen_model():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, tie_weights=True)
    model = GPT(cfg, seed=1)
    model.embed.pos.weight.requires_grad_(False)
    return model


def train_with(wrapper_cls, make_model, steps=5, **kwargs):
    model = make_model()
    r, n = dist.get_rank(), dist.get_world_size()
    ddp = wrapper_cls(model, **kwargs)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = ArithmeticData(16, 0)
    for step in range(steps):
        x, y = data.batch(step, 4 * n)
        opt.zero_grad()
        ddp(shard(x, r, n), shard(y, r, n)).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, \
        {k: p.grad is None for k, p in model.named_parameters()}


def ours_and_torchs(make_model, **kwargs):
    mine = train_with(DistributedDataParallel, make_model, **kwargs)
    theirs = train_with(TorchDDP, make_model, **kwargs)
    return mine, theirs


@pytest.mark.parametrize("n", [2, 3])
def test_equals_pytorch_ddp_with_tied_and_frozen_parameters(clusters, n):
    (mine, mine_none), (theirs, theirs_none) = clusters(n).run(
        ours_and_torchs, tied_frozen_model, bucket_cap_mb=0.05)[0]
    assert mine_none == theirs_none and mine_none["embed.pos.weight"]
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-7)


class WithUnused(nn.Module):
    """A GPT plus a layer used by rank 0 only, and one used by nobody."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)  # the two Linear layers below use the global RNG
        self.gpt = GPT(PRESETS["nano"], seed=2)
        self.only_rank0 = nn.Linear(PRESETS["nano"].vocab_size, PRESETS["nano"].vocab_size)
        self.nobody = nn.Linear(4, 4)

    def forward(self, x, y):
        logits = self.gpt(x)
        if dist.get_rank() == 0:
            logits = logits + self.only_rank0(logits)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_unused_parameters_match_pytorch(clusters):
    (mine, mine_none), (theirs, theirs_none) = clusters(2).run(
        ours_and_torchs, WithUnused, find_unused_parameters=True, bucket_cap_mb=0.01)[0]
    assert mine_none == theirs_none
    assert mine_none["nobody.weight"] and not mine_none["only_rank0.weight"]
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-7)


def unused_without_flag():
    try:
        train_with(DistributedDataParallel, WithUnused, steps=1)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_unused_parameters_without_the_flag_are_a_clear_error(clusters):
    message = clusters(2).run(unused_without_flag)[1]
    assert "nobody.weight" in message and "find_unused_parameters=True" in message


def accumulate_with_no_sync():
    r, n = dist.get_rank(), dist.get_world_size()
    model = GPT(PRESETS["nano"], seed=3)
    reference = GPT(PRESETS["nano"], seed=3)
    x, y = ArithmeticData(16, 0).batch(0, 8 * n)
    reference(x, y).backward()  # the large batch, in one process
    comm = Comm()
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=0.01)
    comm.tracer.clear()
    xs, ys = shard(x, r, n), shard(y, r, n)
    with ddp.no_sync():
        (ddp(xs[:4], ys[:4]) / 2).backward()
    calls_after_first = comm.tracer.summary().get("all_reduce", {}).get("calls", 0)
    (ddp(xs[4:], ys[4:]) / 2).backward()
    errors = [(p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
              for p, q in zip(model.parameters(), reference.parameters())]
    return calls_after_first, comm.tracer.summary()["all_reduce"]["calls"], len(ddp.buckets), max(errors)


def test_no_sync_accumulation_equals_the_large_batch_step(clusters):
    for first, total, buckets, err in clusters(3).run(accumulate_with_no_sync):
        assert first == 0 and total == buckets > 1
        assert err < 1e-5


def bytes_per_step(bucket_mb, steps=3):
    model = GPT(PRESETS["tiny"], seed=0)
    comm = Comm()
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=bucket_mb)
    ddp.timeline = []
    data = ArithmeticData(32, 0)
    r, n = comm.rank, comm.size
    comm.tracer.clear()
    dist.barrier()
    before = written_bytes()
    for step in range(steps):
        x, y = data.batch(step, 4 * n)
        ddp(shard(x, r, n), shard(y, r, n)).backward()
    dist.barrier()
    wire = written_bytes() - before
    s = comm.tracer.summary()["all_reduce"]
    return dict(grad_bytes=4 * model.num_params(), bytes=s["bytes"] / steps,
                sent=s["sent_bytes"] / steps, calls=s["calls"] / steps, buckets=len(ddp.buckets),
                wire=wire / steps, timeline=ddp.timeline)


@pytest.mark.parametrize("n", [2, 4])
def test_traced_bytes_match_the_ring_and_the_wire(clusters, n):
    results = clusters(n).run(bytes_per_step, 0.2)
    for r in results:
        assert r["bytes"] == r["grad_bytes"]
        assert r["sent"] == pytest.approx(2 * (n - 1) / n * r["grad_bytes"])
        assert r["calls"] == r["buckets"] == len(r["timeline"][0]["buckets"]) > 1
        # what gloo really wrote to this rank's sockets (the kernel's count for the process, so
        # no other traffic on the machine is in it) is the ring's volume, and a few headers
        ring = 2 * (n - 1) / n * r["grad_bytes"]
        assert ring <= r["wire"] <= 1.01 * ring


def test_buckets_overlap_backward(clusters):
    timeline = clusters(2).run(bytes_per_step, 0.1)[0]["timeline"]
    for step in timeline:
        starts = [b["start"] for b in step["buckets"]]
        assert starts == sorted(starts) and starts[0] >= step["backward_start"]
        assert starts[0] < step["backward_end"]  # the first bucket went out during backward
        assert 0 < overlap_fraction(step) <= 1


def test_buckets_are_filled_in_reverse_and_closed_at_the_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 200, 300, 50, 1000)]
    buckets = make_buckets(params, cap_bytes=1500)
    assert [[p.numel() for p in b.params] for b in buckets] == [[1000], [50, 300, 200], [100]]
    assert [b.nbytes for b in buckets] == [4000, 2200, 400]
    assert make_buckets(params, cap_bytes=1e9)[0].params == params[::-1]
    first_small = make_buckets(params, cap_bytes=1e9, first_cap_bytes=100)
    assert [[p.numel() for p in b.params] for b in first_small] == [[1000], [50, 300, 200, 100]]


@pytest.mark.parametrize("cap_mb, first", [(0.01, None), (0.25, None), (1, None), (0.01, 20_000),
                                           (25, FIRST_BUCKET_BYTES)])
def test_buckets_match_pytorch_ddp(cap_mb, first):
    """Same model, same caps: our bucket layout is the one torch's DDP computes."""
    params = [p for p in GPT(PRESETS["small"], seed=0).parameters()]
    params.append(nn.Parameter(torch.zeros(7, dtype=torch.float64)))  # a dtype of its own
    ours = make_buckets(params, cap_mb * MIB, first)
    limits = [int(cap_mb * MIB)] if first is None else [first, int(cap_mb * MIB)]
    theirs, _ = dist._compute_bucket_assignment_by_size(params[::-1], limits, [False] * len(params))
    reverse = params[::-1]
    assert [[id(p) for p in b.params] for b in ours] == \
        [[id(reverse[i]) for i in b] for b in sorted(theirs, key=min)]


def test_naive_dp_broadcasts_the_start_and_averages_gradients(clusters):
    def naive():
        comm = Comm()
        model = GPT(PRESETS["nano"], seed=comm.rank)  # different on purpose: broadcast fixes it
        dp = NaiveDataParallel(model, comm)
        x, y = ArithmeticData(16, 0).batch(0, 2 * comm.size)
        dp(shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
        dp.sync_gradients()
        return [p.grad.clone() for p in model.parameters()], comm.tracer.summary()
    out = clusters(3).run(naive)
    for grads, summary in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, out[0][0]))
    assert out[0][1]["all_reduce"]["calls"] == len(out[0][0])  # one call per parameter


def test_cli_runs_ddp_and_refuses_bad_batches(clusters):
    from minitrain.strategies import ConfigError
    from minitrain.train import check_config
    with pytest.raises(ConfigError, match="does not split over 3 ranks; use a multiple of 3"):
        check_config(TrainConfig(strategy="ddp", world_size=3, batch_size=16))
    with pytest.raises(ConfigError, match="--bucket-mb must be a positive number"):
        check_config(TrainConfig(strategy="ddp", world_size=2, options={"bucket_mb": 0}))
