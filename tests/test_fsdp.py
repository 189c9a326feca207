"""ZeRO-3 shaped like FSDP2: the user's own optimizer over ``model.parameters()`` on models that are
not minitrain's GPT, the mixed-precision policy, replicated parameters, refusals, prefetch timeline."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minitrain.comm import Comm
from minitrain.parallel.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from minitrain.planning.analysis import hidden_fraction, merge_intervals
from minitrain.viz.fsdp import unit_timeline_rows


class TiedMLP(nn.Module):
    """A plain MLP whose decoder reuses the encoder's weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 8)
        self.mid = nn.Sequential(nn.Linear(8, 33), nn.GELU(), nn.Linear(33, 8))
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(self.enc(x))))

    @staticmethod
    def batch(step, n):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 8, generator=g)

    @staticmethod
    def loss(out, y):
        return F.mse_loss(out.float(), y)


class EmbedNorm(nn.Module):
    """Embedding, LayerNorm, a residual stack of linears, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(13, 12)
        self.norm = nn.LayerNorm(12)
        self.layers = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])
        self.head = nn.Linear(12, 13)

    def forward(self, idx):
        h = self.norm(self.emb(idx))
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return self.head(h)

    @staticmethod
    def batch(step, n):
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 13, (4 * n, 5), generator=g), torch.randint(0, 13, (4 * n, 5), generator=g)

    @staticmethod
    def loss(out, y):
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


MODELS = {"tied-mlp": TiedMLP, "embed-norm": EmbedNorm}


def optimizer(params, policy):
    """AdamW; SGD for the bf16 comparisons (Adam turns a rounding-size gradient into a full step)."""
    return torch.optim.SGD(params, lr=0.1) if policy else torch.optim.AdamW(params, lr=1e-2)


def train(model_name, how, steps=3, policy=None):
    """Train on this rank's slice with the user's own loop; return the full state (fp32)."""
    cls = MODELS[model_name]
    model = cls()
    r, n = dist.get_rank(), dist.get_world_size()
    if how == "fsdp":
        replicate = list(model.norm.parameters()) if model_name == "embed-norm" and not policy else ()
        fsdp = FullyShardedDataParallel(model, Comm(), mp_policy=policy, replicate=replicate)
        run = model
    elif how == "ddp":
        run = TorchDDP(model)
    opt = optimizer(run.parameters(), policy)
    for step in range(steps):
        x, y = cls.batch(step, n)
        cls.loss(run(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
        opt.step()
        opt.zero_grad()
    if how == "fsdp":
        dtypes = {p.dtype for p in model.parameters()}
        return fsdp.full_state_dict(), dtypes
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, None


def reference(model_name, steps=3, dtype=None):
    """One process, the whole batch; with ``dtype``: fp32 masters, forward/backward on a copy cast to
    ``dtype`` (what the policy computes), gradients upcast."""
    cls = MODELS[model_name]
    model = cls()
    opt = optimizer(model.parameters(), dtype)
    n = dist.get_world_size()
    for step in range(steps):
        x, y = cls.batch(step, n)
        if dtype is None:
            cls.loss(model(x), y).backward()
        else:
            low = copy.deepcopy(model).to(dtype)
            cls.loss(low(x.to(dtype) if x.is_floating_point() else x), y).backward()
            for p, q in zip(model.parameters(), low.parameters()):
                p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(model_name):
    ref = reference(model_name)
    ddp, _ = train(model_name, "ddp")
    fsdp, dtypes = train(model_name, "fsdp")
    return ref, ddp, fsdp, dtypes


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_the_users_optimizer_over_model_parameters_equals_ddp_and_one_process(clusters, n, model_name):
    for ref, ddp, fsdp, dtypes in clusters(n).run(compare, model_name):
        assert dtypes == {torch.float32}
        assert fsdp.keys() == ref.keys()
        for k in ref:
            assert fsdp[k].shape == ref[k].shape
            torch.testing.assert_close(fsdp[k], ddp[k], rtol=0, atol=1e-6, msg=k)
            torch.testing.assert_close(fsdp[k], ref[k], rtol=0, atol=1e-6, msg=k)
            assert not torch.equal(ref[k], MODELS[model_name]().state_dict()[k])  # it trained


def bf16_policy(model_name):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    Comm().tracer.clear()
    state, dtypes = train(model_name, "fsdp", policy=policy)
    return reference(model_name, dtype=torch.bfloat16), state, dtypes


@pytest.mark.parametrize("model_name", list(MODELS))
def test_bf16_policy_equals_a_bf16_reference_and_hands_fp32_to_the_optimizer(clusters, model_name):
    for ref16, state, dtypes in clusters(2).run(bf16_policy, model_name):
        assert dtypes == {torch.float32}  # the user's optimizer steps fp32 shards
        for k in ref16:
            assert state[k].dtype == torch.float32
            torch.testing.assert_close(state[k], ref16[k], rtol=1.6e-2, atol=1e-3, msg=k)


def computes_in_bf16():
    model = TiedMLP()
    comm = Comm()
    seen = []
    model.mid[0].register_forward_hook(lambda m, a, out: seen.append((a[0].dtype, m.weight.dtype)))
    FullyShardedDataParallel(model, comm, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    x, y = TiedMLP.batch(0, comm.size)
    comm.tracer.clear()
    TiedMLP.loss(model(x), y).backward()
    events = comm.tracer.events
    grads = {p.grad.dtype for p in model.parameters()}
    return seen, {(e.op, e.bytes) for e in events}, grads, None


def test_bf16_policy_gathers_and_reduces_in_16_bits(clusters):
    for seen, ops, grads, _ in clusters(2).run(computes_in_bf16):
        assert seen == [(torch.bfloat16, torch.bfloat16)]
        assert grads == {torch.float32}
        assert {op for op, _ in ops} == {"all_gather", "reduce_scatter"}


def replicated_grads():
    r, n = dist.get_rank(), dist.get_world_size()
    ref = EmbedNorm()
    x, y = EmbedNorm.batch(0, n)
    EmbedNorm.loss(ref(x), y).backward()
    model = EmbedNorm()
    FullyShardedDataParallel(model, Comm(), replicate=list(model.norm.parameters()))
    EmbedNorm.loss(model(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    return ([(type(p), p.grad.clone()) for p in model.norm.parameters()],
            [p.grad.clone() for p in ref.norm.parameters()])


def test_unsharded_parameters_stay_whole_with_averaged_gradients(clusters):
    out = clusters(3).run(replicated_grads)
    for got, ref in out:
        for (kind, g), want in zip(got, ref):
            assert kind is nn.Parameter and g.shape == want.shape == (12,)
            torch.testing.assert_close(g, want, rtol=0, atol=1e-6)


def optimizer_before_wrapping():
    model = TiedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    FullyShardedDataParallel(model, Comm())
    x, y = TiedMLP.batch(0, dist.get_world_size())
    TiedMLP.loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def test_an_optimizer_built_before_wrapping_is_refused_with_the_fix(clusters):
    for message in clusters(2).run(optimizer_before_wrapping):
        assert message is not None and "built before wrapping" in message
        assert "model.parameters()" in message


def timeline_run():
    model = EmbedNorm()
    fsdp = FullyShardedDataParallel(model, Comm())
    fsdp.timeline = []
    for step in range(2):
        x, y = EmbedNorm.batch(step, dist.get_world_size())
        fsdp.timeline.clear()
        EmbedNorm.loss(model(x), y).backward()
    return fsdp.timeline, hidden_fraction(fsdp.timeline), len(fsdp._sharded)


def test_prefetch_issues_the_next_gather_before_the_current_unit_computes(clusters):
    for timeline, hidden, units in clusters(2).run(timeline_run):
        kinds = {(e["kind"], e["backward"]) for e in timeline}
        assert {("gather", False), ("compute", False), ("free", False), ("gather", True),
                ("compute", True), ("reduce_scatter", True)} <= kinds
        gathers = [e for e in timeline if e["kind"] == "gather" and not e["backward"]]
        computes = [e for e in timeline if e["kind"] == "compute" and not e["backward"]]
        assert len(gathers) == len(computes) == units
        # forward: unit k+1's gather was issued before unit k's compute ended
        for g, c in zip(gathers[1:], computes[:-1]):
            assert g["start"] <= c["end"]
        assert 0.0 <= hidden <= 1.0
        rows = unit_timeline_rows([timeline])
        assert {row["kind"] for row in rows[0]["bars"]} >= {"gather", "compute", "reduce_scatter"}


def test_hidden_fraction_and_timeline_rows_are_pure():
    tl = [dict(unit=0, kind="gather", start=0.0, end=2.0, backward=False),
          dict(unit=0, kind="compute", start=2.0, end=5.0, backward=False),
          dict(unit=1, kind="gather", start=3.0, end=4.0, backward=False),
          dict(unit=1, kind="compute", start=5.0, end=6.0, backward=False),
          dict(unit=0, kind="free", start=5.0, end=5.0, backward=False)]
    assert hidden_fraction(tl) == pytest.approx(1 / 3)
    assert hidden_fraction([]) is None
    assert merge_intervals([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    rows = unit_timeline_rows([tl, tl])
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["bars"][0] == dict(unit=0, kind="gather", start=0.0, end=2000.0, backward=False)
    assert rows[0]["hidden"] == pytest.approx(1 / 3)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from minitrain.viz.fsdp import plot_fsdp_timeline

    for names, labels in ((None, ["unit 0", "unit 1"]), ({0: "embedding", 1: "block 0"}, ["embedding", "block 0"])):
        fig = plot_fsdp_timeline([tl, tl], names)  # one colour per unit, and a legend saying which
        assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == labels
        plt.close(fig)
