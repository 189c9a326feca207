"""No checkpoint lost or mixed up, and divergence stops the run: a used save dir is refused unless
resumed or overwritten, the data stream is compared on resume, a step appears only when complete,
a NaN loss ends the run with the step and the fix, and JSON output stays JSON."""

import json
import subprocess
import sys

import pytest

from minitrain import TrainConfig, train
from minitrain.checkpoint import CheckpointError, find_checkpoint
from minitrain.launch import RankError
from minitrain.model import PRESETS

NANO = TrainConfig(steps=4, batch_size=4, seed=0, model=PRESETS["nano"])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minitrain", "train", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def first_run(clusters, tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    train(NANO.with_(save_dir=str(root), save_every=2), cluster=clusters(1))
    return root


def test_steps_appear_whole_and_no_temporary_is_left(first_run):
    names = sorted(p.name for p in first_run.iterdir())
    assert names == ["step-000002", "step-000004"]
    assert all((first_run / n / "meta.json").is_file() for n in names)


def test_a_used_save_dir_is_refused_unless_resumed_or_overwritten(first_run, clusters):
    with pytest.raises(CheckpointError, match="already holds checkpoints .* --overwrite"):
        train(NANO.with_(save_dir=str(first_run), seed=1), cluster=clusters(1))
    resumed = train(NANO.with_(steps=6, save_dir=str(first_run), resume=str(first_run)),
                    cluster=clusters(1))
    assert resumed["summary"]["start_step"] == 4


def test_overwrite_deletes_the_earlier_runs_steps(tmp_path, clusters):
    train(NANO.with_(save_dir=str(tmp_path), save_every=1), cluster=clusters(1))
    assert len(list(tmp_path.glob("step-*"))) == 4
    train(NANO.with_(steps=2, save_dir=str(tmp_path), overwrite=True, seed=3), cluster=clusters(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    with pytest.raises(CheckpointError, match="--seed 3, this run has 0"):
        train(NANO.with_(steps=6, resume=str(tmp_path)), cluster=clusters(1))


def test_the_data_stream_is_compared_on_resume(first_run, clusters):
    with pytest.raises(CheckpointError, match="--batch-size 4, this run has 8"):
        train(NANO.with_(steps=6, batch_size=8, resume=str(first_run)), cluster=clusters(1))


def test_an_unfinished_save_is_skipped_and_said(first_run, tmp_path, capsys):
    import shutil
    copy = tmp_path / "ck"
    for name in ("step-000002", "step-000004"):  # (other tests may have saved more into first_run)
        shutil.copytree(first_run / name, copy / name)
    (copy / "step-000004" / "meta.json").unlink()         # a save that died before meta.json
    shutil.copytree(copy / "step-000002", copy / "step-000006.tmp")  # one that died mid-way
    assert find_checkpoint(copy).name == "step-000002"
    from minitrain.train import check_config
    check_config(NANO.with_(steps=8, resume=str(copy)))
    err = capsys.readouterr().err
    assert "step-000004 did not finish saving" in err and "step-000006.tmp" in err
    assert "resuming from step-000002" in err


def test_a_diverging_run_stops_with_the_step_and_the_fix(clusters):
    with pytest.raises(RankError) as info:
        train(NANO.with_(lr=1e4, steps=6, model=TrainConfig().model), cluster=clusters(1))
    text = str(info.value)
    assert "Diverged" in text and "training diverged; lower --lr (now 10000)" in text
    kept = train(NANO.with_(lr=1e4, steps=6, allow_nonfinite=True, model=TrainConfig().model),
                 cluster=clusters(1))
    assert len(kept["losses"]) == 6


def test_the_cli_exits_non_zero_and_its_json_stays_json():
    out = run_cli("--lr", "1e4", "--steps", "6", "--json")
    assert out.returncode == 1
    assert "training diverged; lower --lr" in out.stderr and "Traceback" not in out.stderr
    lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
             for line in out.stdout.splitlines()]
    assert lines and lines[-1]["loss"] is None
    kept = run_cli("--lr", "1e4", "--steps", "4", "--json", "--allow-nonfinite")
    assert kept.returncode == 0, kept.stderr
    summary = json.loads(kept.stdout.splitlines()[-1], parse_constant=lambda c: pytest.fail(c))
    assert summary["summary"]["final_loss"] is None
