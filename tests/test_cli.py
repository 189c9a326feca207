"""``minitrain train``: the JSON contract, loss falling, refusals before spawning, torchrun."""

import json
import subprocess
import sys

import pytest

from minitrain import TrainConfig, train
from minitrain.cli import main
from minitrain.strategies import ConfigError, strategy_names

CONTRACT = ["--strategy", "single", "--world-size", "1", "--steps", "20", "--seed", "0",
            "--batch-size", "16", "--json"]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minitrain", *args], capture_output=True,
                          text=True, timeout=timeout)


def parse(stdout: str):
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return [l for l in lines if "step" in l], lines[-1]["summary"]


@pytest.fixture(scope="module")
def contract_run():
    out = run_cli("train", *CONTRACT)
    assert out.returncode == 0, out.stderr
    return out


def test_json_contract(contract_run):
    steps, summary = parse(contract_run.stdout)
    assert [s["step"] for s in steps] == list(range(20))
    assert all(set(s) == {"step", "loss"} for s in steps)
    for key in ("final_loss", "step_time_s", "params", "comm", "memory"):
        assert key in summary
    assert summary["final_loss"] == steps[-1]["loss"]
    assert summary["params"] == TrainConfig().model.num_params()
    assert len(summary["comm"]) == len(summary["memory"]) == 1
    assert summary["memory"][0]["bytes"]["parameters"] == 4 * summary["params"]
    assert summary["step_time_s"] > 0


def test_loss_falls(contract_run):
    steps, _ = parse(contract_run.stdout)
    first, last = steps[0]["loss"], sum(s["loss"] for s in steps[-5:]) / 5
    assert last < first - 0.3, (first, last)


def test_the_python_api_gives_the_cli_numbers(contract_run, clusters):
    steps, _ = parse(contract_run.stdout)
    result = train(TrainConfig(steps=20, seed=0, batch_size=16), cluster=clusters(1))
    # same numbers up to float rounding (the CLI's ranks may use more threads than the fixture's)
    assert result.losses == pytest.approx([s["loss"] for s in steps], rel=1e-5)


def test_loss_falls_far_in_a_few_hundred_steps(clusters):
    result = train(TrainConfig(steps=300, batch_size=16), cluster=clusters(1))
    # from ln(13) ~ 2.56 towards the ~1.0 floor set by the random operands
    assert result.losses[0] > 2.4 and sum(result.losses[-20:]) / 20 < 1.7


def test_readable_output_without_json():
    out = run_cli("train", "--steps", "3", "--model", "nano")
    assert out.returncode == 0, out.stderr
    assert "strategy single on 1 rank(s)" in out.stdout and "rank 0: params" in out.stdout
    assert "3/3" in out.stderr  # the progress bar


def test_the_readable_summary_says_what_offload_put_on_the_host():
    out = run_cli("train", "--strategy", "zero1", "--world-size", "2", "--offload", "--steps", "2",
                  "--model", "nano")
    assert out.returncode == 0, out.stderr
    assert "optimizer step are in host memory" in out.stdout
    rank0 = next(line for line in out.stdout.splitlines() if line.startswith("rank 0:"))
    device, host = rank0.split("; host: ")
    assert "optimizer 0.0 KiB" in device and "optimizer 0.0 KiB" not in host, rank0
    plain = run_cli("train", "--strategy", "zero1", "--world-size", "2", "--steps", "2",
                    "--model", "nano")
    assert "host" not in plain.stdout


@pytest.mark.parametrize("args, message", [
    (["--strategy", "nope"], "unknown strategy 'nope'; choose one of: " + ", ".join(sorted(strategy_names()))),
    (["--world-size", "2"], "strategy 'single' runs on one rank"),
    (["--strategy", "ddp", "--world-size", "3"], "use a multiple of 3 (e.g. 15)"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--n-head", "3"], "not divisible by n_head=3"),
    (["--strategy", "tensor", "--world-size", "3"], "n_head=4 does not split over --tp 3"),
])
def test_bad_configurations_are_refused_before_any_process_starts(no_spawn, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["train", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_strategy_registry_lists_every_technique():
    assert {"single", "ddp", "ddp-naive", "ps-sync", "ps-async", "zero1", "zero2", "zero3",
            "pipeline", "tensor"} <= set(strategy_names())
    with pytest.raises(ConfigError, match="choose one of"):
        train(strategy="missing")


def test_the_train_command_runs_under_torchrun():
    direct = run_cli("train", *CONTRACT[:4], "--steps", "3", "--json")
    under = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "1", "-m", "minitrain", "train", "--strategy",
                            "single", "--steps", "3", "--json"],
                           capture_output=True, text=True, timeout=120)
    assert under.returncode == 0, under.stderr[-3000:]
    assert parse(under.stdout)[0] == parse(direct.stdout)[0]


def test_the_pipeline_summary_reports_its_bubble():
    out = run_cli("train", "--strategy", "pipeline", "--world-size", "2", "--microbatches", "4",
                  "--schedule", "gpipe", "--steps", "2", "--model", "nano")
    assert out.returncode == 0, out.stderr
    assert "pipeline gpipe: 2 stages, 4 micro-batches" in out.stdout
    assert "(p-1)/(v*m+p-1) = 20.0%" in out.stdout  # 1/5 for p=2, m=4
    js = run_cli("train", "--strategy", "pipeline", "--world-size", "2", "--microbatches", "4",
                 "--steps", "2", "--model", "nano", "--json")
    steps, summary = parse(js.stdout)
    report = summary["report"][0]
    assert len(steps) == 2 and report["schedule"] == "1f1b"
    assert 0 < report["bubble_measured"] < 1 and report["bubble_formula"] == pytest.approx(0.2)


def test_help_shows_each_default_once(monkeypatch):
    """A flag whose help says its default itself gets no second "(default: none)"."""
    from minitrain.cli import build_parser

    monkeypatch.setenv("COLUMNS", "1000")
    text = build_parser().commands["train"].format_help().split("\noptions:", 1)[1]
    lines = []  # one entry per flag (a long flag's help starts on the next line)
    for line in text.splitlines():
        if line.startswith("  -"):
            lines.append(line)
        elif lines and line.startswith("   "):
            lines[-1] += " " + line.strip()
    assert len(lines) > 30
    twice = [line.split()[0] for line in lines if line.count("(default") > 1]
    assert not twice, twice
    for name in ("--backend", "--loss-scale", "--tp", "--compress", "--bucket-mb", "--dp"):
        line = next(line for line in lines if line.lstrip().startswith(name + " "))
        assert line.count("(default") == 1, line


@pytest.mark.parametrize("args, hint", [
    (["train", "--strategy", "zer3"], "unknown strategy 'zer3' (did you mean 'zero3'?)"),
    (["train", "--strategy", "DDP"], "(did you mean 'ddp'?)"),
    (["train", "--tpp", "2"], "--tpp: did you mean --tp?"),
    (["train", "--stpes", "5"], "--stpes: did you mean --steps?"),
    (["train", "--bucket_mb=1"], "--bucket_mb: did you mean --bucket-mb?"),
    (["trian"], "invalid choice: 'trian' (did you mean 'train'?)"),
    (["train", "--model", "tinny"], "invalid choice: 'tinny' (did you mean 'tiny'?)"),
    (["train", "--precision", "bf16"], "(did you mean 'bf16-mixed'?)"),
    (["train", "--strategy", "pipeline", "--world-size", "2", "--schedule", "1fb1"],
     "(did you mean '1f1b'?)"),
    (["train", "--strategy", "ddp", "--world-size", "2", "--project", "dgx-h10"],
     "unknown cluster 'dgx-h10' (did you mean 'dgx-h100'?)"),
    (["train", "--strategy", "ddp", "--world-size", "2", "--project", "dgx-h100", "--as-model", "7bb"],
     "unknown model size '7bb' (did you mean '7b'?)"),
    (["clusters", "--jsn"], "--jsn: did you mean --json?"),
])
def test_a_mistyped_name_gets_a_did_you_mean(no_spawn, capsys, args, hint):
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and hint in err, err
    assert "Traceback" not in err


def test_no_did_you_mean_without_a_close_name(no_spawn, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--strategy", "quantum"])
    assert "did you mean" not in capsys.readouterr().err
