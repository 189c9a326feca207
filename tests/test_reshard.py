"""A checkpoint is not stranded by its layout: a run saved by one strategy on N ranks resumes on
another strategy and world size (weights and Adam state re-sharded on load through the portable
form, :mod:`minitrain.strategies.portable`), and its losses equal an uninterrupted run of the
resumed strategy within 1e-5; what cannot be resharded is refused before spawning."""

import sys

import pytest
import torch

from minitrain import GPT, GPTConfig, TrainConfig, train
from minitrain.checkpoint.core import CheckpointError
from minitrain.checkpoint.consolidate import portable_state
from minitrain.model import PRESETS

BASE = TrainConfig(steps=4, batch_size=12, seed=0, model=PRESETS["nano"])  # 12 splits on 1-4 ranks
SAVE_AT = 2
TIED = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, tie_weights=True)


def cfg_of(side: str, **changes) -> TrainConfig:
    """``"zero2@3"``, ``"zero2@3+offload"``: strategy, world size, a boolean option."""
    strategy, rest = side.split("@")
    n, *flags = rest.split("+")
    return BASE.with_(strategy=strategy, world_size=int(n), options={f: True for f in flags},
                      **changes)


@pytest.fixture(scope="module")
def runs(clusters, tmp_path_factory):
    """Cached per layout: the uninterrupted run, and the first SAVE_AT steps saved."""
    full, saves = {}, {}

    def uninterrupted(side, **changes):
        key = (side, tuple(sorted(changes.items())))
        if key not in full:
            cfg = cfg_of(side, **changes)
            full[key] = train(cfg, cluster=clusters(cfg.world_size), return_state=True)
        return full[key]

    def saved(side, **changes):
        key = (side, tuple(sorted(changes.items())))
        if key not in saves:
            cfg = cfg_of(side, steps=SAVE_AT, **changes)
            root = tmp_path_factory.mktemp(side.replace("@", "-").replace("+", "-"))
            train(cfg.with_(save_dir=str(root)), cluster=clusters(cfg.world_size))
            saves[key] = root
        return saves[key]
    return uninterrupted, saved


TABLE = [  # (saved, resumed, precision); fp32 rows: within 1e-5 of the resumed strategy's own run
    ("zero3@2", "ddp@3", "fp32"),
    ("ddp@2", "zero1@3", "fp32"),
    ("zero2@3", "single@1", "fp32"),
    ("single@1", "zero3@2", "fp32"),
    ("zero1@2", "zero2@4", "fp32"),
    ("zero3@4", "zero1@3", "fp32"),
    ("ddp-naive@2", "zero3@3", "fp32"),
    ("zero2@2+offload", "ddp-naive@3", "fp32"),
    ("zero3@3", "zero3@2+offload", "fp32"),
    # bf16: the rounding of a 16-bit gradient reduction depends on the ranks, so an exact match
    # needs the same reductions before and after the save (2 ranks: a + b either way)
    ("zero3@2", "zero1@2", "bf16-mixed"),
    ("ddp@2", "zero2@2+offload", "bf16-mixed"),
    ("zero2@2", "ddp-naive@2", "bf16-mixed"),
]


@pytest.mark.parametrize("saved_as, resumed_as, precision", TABLE,
                         ids=[f"{a}->{b}-{p}" for a, b, p in TABLE])
def test_resume_on_another_layout_gives_the_uninterrupted_run(runs, clusters, saved_as, resumed_as,
                                                              precision):
    uninterrupted, saved = runs
    root = saved(saved_as, precision=precision)
    ref = uninterrupted(resumed_as, precision=precision)
    cfg = cfg_of(resumed_as, precision=precision, resume=str(root))
    out = train(cfg, cluster=clusters(cfg.world_size), return_state=True)
    assert out.summary.start_step == SAVE_AT
    assert out.summary.resharded_from == saved_as.split("+")[0].replace("@", " on ") + \
        (" rank" if saved_as.split("+")[0].endswith("@1") else " ranks")
    assert len(out.losses) == BASE.steps - SAVE_AT
    diff = max(abs(a - b) for a, b in zip(out.losses, ref.losses[SAVE_AT:]))
    print(f"{saved_as} -> {resumed_as} ({precision}): max loss difference {diff:.2e}",
          file=sys.stderr)
    assert diff <= 1e-5, (out.losses, ref.losses[SAVE_AT:])
    for name, value in ref.state.items():
        torch.testing.assert_close(out.state[name], value, rtol=1e-4, atol=5e-5, msg=name)


def test_a_chain_of_layouts(runs, clusters, tmp_path):
    """zero3 on 4 ranks -> zero1 on 3 (saving again) -> single: the uninterrupted single run."""
    uninterrupted, saved = runs
    root = saved("zero3@4", precision="fp32")
    again = tmp_path / "zero1"
    mid = train(cfg_of("zero1@3", steps=3, resume=str(root), save_dir=str(again)),
                cluster=clusters(3))
    end = train(cfg_of("single@1", resume=str(again)), cluster=clusters(1))
    assert mid.summary.resharded_from == "zero3 on 4 ranks"
    assert end.summary.resharded_from == "zero1 on 3 ranks"
    ref = uninterrupted("single@1", precision="fp32").losses
    assert mid.losses + end.losses == pytest.approx(ref[SAVE_AT:], abs=1e-5)


def test_a_tied_model_reshards(clusters, tmp_path):
    """A tied weight is one parameter (one Adam state) under its first name in every layout."""
    ref = train(cfg_of("ddp@3", model=TIED), cluster=clusters(3))
    train(cfg_of("zero3@2", model=TIED, steps=SAVE_AT, save_dir=str(tmp_path)), cluster=clusters(2))
    out = train(cfg_of("ddp@3", model=TIED, resume=str(tmp_path)), cluster=clusters(3))
    assert out.losses == pytest.approx(ref.losses[SAVE_AT:], abs=1e-5)


def test_the_portable_state_names_every_parameter(runs):
    """Offline: the zero3 shards and the single replica give the same portable state (names,
    shapes, step; values within float rounding of the different reductions)."""
    _, saved = runs
    weights, optim = portable_state(saved("zero3@2", precision="fp32"))
    weights_1, optim_1 = portable_state(saved("single@1", precision="fp32"))
    model = GPT(BASE.model)
    assert list(optim["params"]) == [n for n, _ in model.named_parameters()] == list(optim_1["params"])
    model.load_state_dict(weights)
    for name, p in model.named_parameters():
        entry, other = optim["params"][name], optim_1["params"][name]
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == p.shape
        assert float(entry["step"]) == float(other["step"]) == SAVE_AT
        torch.testing.assert_close(entry["exp_avg"], other["exp_avg"], rtol=1e-4, atol=1e-7)
    for name, value in weights_1.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def pipeline_save(clusters, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    cfg = BASE.with_(strategy="pipeline", world_size=2, steps=SAVE_AT, options={"microbatches": 2})
    train(cfg.with_(save_dir=str(root)), cluster=clusters(2))
    return cfg, root


def test_a_pipeline_checkpoint_is_not_resharded(pipeline_save, runs, no_spawn):
    cfg, root = pipeline_save
    with pytest.raises(CheckpointError) as info:
        train(BASE.with_(strategy="ddp", world_size=2, resume=str(root)))
    message = str(info.value)
    assert "saved by strategy 'pipeline', this run is 'ddp'" in message
    assert "resharded on load between ddp, ddp-naive, single, zero1, zero2, zero3 only (" in message
    same_layout = message.split(" only (", 1)[1].split(" resume on their own layout)")[0].split(", ")
    assert {"3d", "pipeline", "tensor"} <= set(same_layout)
    assert "resume with --strategy pipeline" in message
    _, saved = runs
    with pytest.raises(CheckpointError, match="saved by strategy 'ddp', this run is 'pipeline'"):
        train(cfg.with_(steps=4, resume=str(saved("ddp@2", precision="fp32"))))  # nor the other way


def test_what_resharding_keeps_refusing(runs, no_spawn):
    """Model, precision and the data stream must still match."""
    _, saved = runs
    root = saved("zero3@2", precision="fp32")
    for change, message in [
            (dict(precision="bf16-mixed"), "saved in --precision fp32, this run uses bf16-mixed"),
            (dict(seed=1), "trained with --seed 0, this run has 1"),
            (dict(model=TIED), "tie_weights False there, True here")]:
        with pytest.raises(CheckpointError, match=message.replace("-", r"\-")):
            train(cfg_of("ddp@3", resume=str(root), **change))
