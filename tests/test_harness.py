"""The harness (minitrain/strategies/): typed options, refusals naming the fix, the seams, and the
line between techniques (minitrain/parallel/) and the harness."""

import argparse
import ast
import re
from pathlib import Path

import pytest

from minitrain import TrainConfig, train
from minitrain.cli import build_parser
from minitrain.precision import DynamicLossScaler
from minitrain.strategies import ConfigError, get_strategy, strategy_names
from minitrain.strategies.options import option_fields

from answers.lesson07 import scale_update as _reference_loss_scale_update  # lesson 07's solution

PARALLEL = Path(__file__).resolve().parents[1] / "minitrain" / "parallel"


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_every_strategy_has_typed_options_and_every_option_is_a_flag_with_its_default():
    flags = {s for a in _train_parser()._actions for s in a.option_strings}
    for name in strategy_names():
        record = get_strategy(name).options
        assert record is not None, f"strategy {name!r} has no typed Options record"
        for f, _ in option_fields(record):
            assert "--" + f.name.replace("_", "-") in flags, (name, f.name)
    for action in _train_parser()._actions:
        if action.option_strings and action.dest not in ("help", "json", "world_size", "n_layer",
                                                         "n_head", "d_model", "seq_len"):
            assert "(default:" in (action.help or ""), f"{action.option_strings[0]}: {action.help}"


@pytest.mark.parametrize("strategy, options, takers", [
    ("ddp", {"tp": 2}, ["3d", "tensor"]),
    ("zero2", {"chunks": 2}, ["3d", "pipeline"]),
    ("single", {"offload": True}, ["zero1", "zero2", "zero3"]),
])
def test_an_option_the_strategy_does_not_take_is_refused_naming_who_takes_it(strategy, options,
                                                                              takers):
    key = next(iter(options))
    with pytest.raises(ConfigError) as info:
        TrainConfig(strategy=strategy, world_size=2, options=options)
    message = str(info.value)
    assert f"--{key} is not an option of strategy {strategy!r}" in message
    for name in takers:
        assert name in message


def test_options_are_typed_records_and_survive_a_change_of_strategy():
    cfg = TrainConfig(strategy="zero2", world_size=2, options={"bucket_mb": 0.5})
    assert cfg.options.bucket_mb == 0.5 and cfg.options.offload is False
    assert cfg.with_(strategy="ddp").options.bucket_mb == 0.5  # ddp takes bucket_mb too
    with pytest.raises(ConfigError, match="--bucket-mb is not an option of strategy 'zero1'"):
        cfg.with_(strategy="zero1")


def test_a_seam_the_strategy_does_not_have_is_refused():
    with pytest.raises(ConfigError, match="strategy 'single' has no seam 'ring_all_reduce'"):
        train(TrainConfig(), seams={"ring_all_reduce": lambda t, comm: t})
    with pytest.raises(ConfigError, match="no seam called 'ring'"):
        train(TrainConfig(), seams={"ring": lambda t, comm: t})



def test_the_loss_scale_seam_runs_inside_the_real_strategy(clusters):
    cfg = TrainConfig(steps=6, precision="fp16-mixed", loss_scale=2.0 ** 30, model=TrainConfig().model)
    own = train(cfg, cluster=clusters(1))
    theirs = train(cfg, cluster=clusters(1), seams={"loss_scale_update": _reference_loss_scale_update})
    assert theirs.losses == own.losses
    assert theirs.summary.loss_scaler["history"] == own.summary.loss_scaler["history"]
    assert own.summary.loss_scaler["skipped_steps"] > 0  # the rule was exercised

    def never_skips(scale, good, found_inf, interval):
        return scale, good, True
    wrong = train(cfg, cluster=clusters(1), seams={"loss_scale_update": never_skips})
    assert wrong.summary.loss_scaler["scale"] != own.summary.loss_scaler["scale"]


def test_the_scaler_seam_alone():
    rule = DynamicLossScaler(8.0, growth_interval=2, loss_scale_update=_reference_loss_scale_update)
    own = DynamicLossScaler(8.0, growth_interval=2)
    for found_inf in (True, False, False, False, True, False):
        rule.update(found_inf)
        own.update(found_inf)
        assert (rule.scale, rule.good_steps, rule.skipped_steps) == \
            (own.scale, own.good_steps, own.skipped_steps)


HARNESS_IMPORT = re.compile(r"^\s*(from|import)\s+(\.\.|minitrain\.)(strategies|train|cli|checkpoint)\b",
                            re.MULTILINE)


@pytest.mark.parametrize("path", sorted(PARALLEL.glob("*.py")), ids=lambda p: p.name)
def test_a_technique_file_is_the_technique(path):
    text = path.read_text()
    assert not HARNESS_IMPORT.search(text), f"{path.name} imports the training harness"
    assert "TrainConfig" not in text, f"{path.name} reads a TrainConfig: that is the harness's job"
    assert len(text.splitlines()) <= 460, f"{path.name} has {len(text.splitlines())} lines"


STRATEGIES = PARALLEL.parent / "strategies"
ABOVE_STRATEGIES = {"train", "cli", "checkpoint", "checkpoint_checks", "grade", "exercises", "viz"}


def _minitrain_imports(path: Path) -> set[str]:
    """The top-level minitrain modules a file of minitrain/<package>/ imports, anywhere in it
    (inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..x import y
            out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.update([node.module.split(".")[1]] if node.module.startswith("minitrain.") else [])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("minitrain."))
    return out


@pytest.mark.parametrize("path", sorted(STRATEGIES.glob("*.py")), ids=lambda p: p.name)
def test_a_strategy_file_imports_nothing_from_the_layers_above(path):
    above = _minitrain_imports(path) & ABOVE_STRATEGIES
    assert not above, f"strategies/{path.name} imports {', '.join(sorted(above))}: move what it needs down"


@pytest.mark.parametrize("strategy, world, options, axes", [
    ("single", 1, {}, {"dp": 1}),
    ("zero2", 2, {}, {"dp": 2, "zero_stage": 2}),
    ("pipeline", 2, {"schedule": "interleaved", "microbatches": 4},
     {"pp": 2, "schedule": "interleaved", "microbatches": 4, "virtual_stages": 2}),
    ("tensor", 2, {}, {"tp": 2, "dp": 1}),
    ("3d", 4, {"pp": 2, "tp": 2}, {"dp": 1, "pp": 2, "tp": 2, "zero_stage": 1}),
])
def test_a_run_carries_the_layout_its_strategy_declares(strategy, world, options, axes, clusters):
    """The record's layout is the strategy's declaration (``Strategy.layout(cfg)``), and it is
    what ran: the sizes, a pipeline's stages on each rank, a mesh's groups as its ranks saw them."""
    cfg = TrainConfig(strategy=strategy, world_size=world, steps=2, batch_size=8,
                      options=options)
    run = train(cfg, cluster=clusters(world))
    layout = run.summary.layout
    assert layout == get_strategy(strategy).layout(cfg)
    assert {k: getattr(layout, k) for k in axes} == axes
    assert layout.free_running is None
    for rank, rep in enumerate(run.summary.report or []):
        if "layers" in rep:  # the pipeline's stages on this rank
            assert layout.stages_of(rank) == sorted(rep["layers"])
        if "groups" in rep:  # the 3D mesh's
            assert sorted(layout.stages_of(rank)) == sorted(rep["stages"])
            for axis, ranks in rep["groups"].items():
                assert tuple(ranks) in layout.groups[axis]


def test_a_free_running_strategy_declares_why_its_ranks_share_no_step():
    cfg = TrainConfig(strategy="ps-async", world_size=3)
    assert "never step together" in get_strategy("ps-async").layout(cfg).free_running
    assert get_strategy("ddp").layout(TrainConfig(strategy="ddp", world_size=2)).free_running is None
