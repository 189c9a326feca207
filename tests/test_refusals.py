"""Every invalid input is refused before any rank starts: non-zero exit, no traceback, and a
message that names the flag to fix (the table is the learner's and the engineer's usual mistakes)."""

import pytest

from minitrain.strategies import get_strategy, strategy_names
from minitrain.strategies.fit import Machine
from minitrain.strategies.options import flag, option_fields
from minitrain.cli import main

FILE = __file__  # a regular file: nothing can be saved under it

TABLE = [  # (arguments after "train", the flag or name the message must contain)
    (["--world-size", "0"], "--world-size"),
    (["--world-size", "-1"], "--world-size"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-5"], "--steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-3"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--precision", "bf16"], "--precision"),
    (["--precision", "fp16-mixed", "--loss-scale", "-1"], "--loss-scale"),
    (["--precision", "fp16-mixed", "--loss-scale", "nan"], "--loss-scale"),
    (["--loss-scale", "1024"], "--loss-scale"),
    (["--precision", "fp16-mixed", "--loss-scale-growth", "0"], "--loss-scale-growth"),
    (["--strategy", "nope"], "strategy"),
    (["--model", "huge"], "--model"),
    (["--n-head", "3"], "n_head"),
    (["--seq-len", "0"], "seq_len"),
    (["--strategy", "single", "--world-size", "2"], "--world-size"),
    (["--strategy", "ddp", "--world-size", "3"], "--batch-size"),
    (["--strategy", "ddp", "--world-size", "2", "--bucket-mb", "0"], "--bucket-mb"),
    (["--strategy", "ddp", "--world-size", "2", "--bucket-mb", "nan"], "--bucket-mb must be a positive"),
    (["--strategy", "ddp", "--world-size", "2", "--bucket-mb", "-1"], "--bucket-mb"),
    (["--strategy", "ddp", "--world-size", "2", "--compress", "zip"], "--compress"),
    (["--strategy", "ddp", "--world-size", "2", "--compress", "topk:0"], "--compress"),
    (["--strategy", "ddp", "--world-size", "2", "--compress", "topk:2"], "--compress"),
    (["--strategy", "ddp", "--world-size", "2", "--tp", "2"],
     "--tp is not an option of strategy 'ddp' (strategies that take it: 3d, tensor"),
    (["--strategy", "zero2", "--world-size", "2", "--chunks", "2"],
     "--chunks is not an option of strategy 'zero2' (strategies that take it: 3d, pipeline"),
    (["--strategy", "zero3", "--world-size", "2", "--checkpoint-activations"], "--checkpoint-activations"),
    (["--strategy", "zero1", "--world-size", "2", "--precision", "fp16-mixed"], "--precision"),
    (["--strategy", "ps-sync", "--world-size", "2", "--servers", "0"], "--servers"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--staleness", "-1"],
     "--staleness"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--delay-comp", "nan"],
     "--delay-comp"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--slow-worker", "x"],
     "--slow-worker"),
    (["--strategy", "pipeline", "--world-size", "2", "--microbatches", "0"], "--microbatches"),
    (["--strategy", "pipeline", "--world-size", "2", "--chunks", "0"], "--chunks"),
    (["--strategy", "pipeline", "--world-size", "2", "--schedule", "dualpipe"], "--schedule"),
    (["--strategy", "pipeline", "--world-size", "8"], "pipeline stages but the model has 4 layers"),
    (["--strategy", "pipeline", "--world-size", "2", "--stages", "0"], "--stages"),
    (["--strategy", "pipeline", "--world-size", "2", "--stages", "3"], "--stages"),
    (["--strategy", "context", "--world-size", "2", "--cp", "0"], "--cp"),
    (["--strategy", "context", "--world-size", "2", "--cp", "3"], "--cp"),
    (["--strategy", "expert", "--world-size", "2", "--model", "tiny-moe", "--ep", "0"], "--ep"),
    (["--strategy", "expert", "--world-size", "2", "--model", "tiny-moe", "--ep", "3"], "--ep"),
    (["--strategy", "tensor", "--world-size", "2", "--tp", "0"], "--tp"),
    (["--strategy", "tensor", "--world-size", "3"], "--tp"),
    (["--strategy", "3d", "--world-size", "8", "--dp", "3", "--pp", "2", "--tp", "2"], "--dp"),
    (["--strategy", "3d", "--world-size", "4", "--zero-stage", "2"], "--zero-stage"),
    (["--save-dir", FILE + "/ck"], "--save-dir"),
    (["--save-dir", "/proc/minitrain-ck"], "--save-dir"),
    (["--save-every", "2"], "--save-dir"),
    (["--resume", "/nonexistent/minitrain-ck"], "no checkpoint at"),
    (["--strategy", "ps-sync", "--world-size", "3", "--batch-size", "12", "--save-dir", "x"], "--save-dir"),
    (["--save-dir", ""], "--save-dir is empty"),
    (["--resume", ""], "--resume is empty"),
    # every size has an upper bound that fits the machine, said with the bound and why
    (["--strategy", "ddp", "--world-size", "1000000000", "--batch-size", "1000000000"],
     "--world-size 1000000000 does not fit this machine: each rank takes"),
    (["--batch-size", "1000000000"], "--batch-size 1000000000 does not fit this machine: the "
                                     "activations kept for backward"),
    (["--batch-size", "100000"], "--batch-size 100000 does not fit this machine"),
    (["--steps", "1000000000000"], "--steps 1000000000000 does not fit this machine: a run keeps "
                                   "each step's loss and time"),
    (["--seq-len", "100000"], "--seq-len 100000 does not fit this machine"),
    (["--seq-len", "100000", "--checkpoint-activations"],
     "--seq-len 100000 does not fit this machine: one step would take at least"),
    (["--seq-len", "10000000"], "the model (--seq-len 10000000) does not fit this machine: "
                                "640,200,960 parameters"),
    (["--d-model", "100000"], "the model (--d-model 100000) does not fit this machine"),
    (["--n-layer", "1000000"], "the model (--n-layer 1000000) does not fit this machine"),
    (["--timeout", "1e-9"], "--timeout must be from 1 s"),
    (["--timeout", "0.5"], "--timeout must be from 1 s"),
    (["--timeout", "1e12"], "to 604800 s (a week"),
    (["--timeout", "inf"], "--timeout"),
    (["--seed", "1099511627776000000000"], "--seed must be from 0 to 18446744073709551615"),
    (["--seed", "-1"], "--seed must be from 0"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--slow-worker", "0:1e9"],
     "--slow-worker 0:1e+09 must be shorter than --timeout 120"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--slow-worker", "0:inf"],
     "bad --slow-worker '0:inf'"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--slow-worker", "0:nan"],
     "bad --slow-worker '0:nan'"),
    (["--strategy", "ps-async", "--world-size", "3", "--batch-size", "12", "--delay-comp", "inf"],
     "--delay-comp must be >= 0 (and finite)"),
]

#: the machine the table's bounds are judged on (the course's reference: 2 cores, 8 GiB, the
#: usual 1024 open files), so that a row does not depend on where the tests run
REFERENCE = Machine(memory=8 * 2**30, cores=2, open_files=1024)


@pytest.fixture(autouse=True)
def reference_machine(monkeypatch):
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls, backend=None: REFERENCE))


def test_every_checked_flag_has_a_refusal_in_the_table():
    """Each option that a strategy checks (a check or a list of choices), and each flag of the run
    with a rule of its own, is tried with a bad value above: a new checked option needs a row."""
    rows = " ".join(" ".join(args) for args, _ in TABLE)
    checked = {flag(f.name) for name in strategy_names()
               for f, _ in option_fields(get_strategy(name).options)
               if f.metadata.get("check") or f.metadata.get("choices")}
    run_rules = {"--world-size", "--steps", "--batch-size", "--lr", "--timeout", "--precision",
                 "--loss-scale", "--loss-scale-growth", "--save-dir", "--save-every", "--resume",
                 "--strategy", "--model", "--seed", "--seq-len", "--d-model", "--n-layer",
                 "--slow-worker"}
    missing = sorted(f for f in checked | run_rules if f not in rows.split())
    assert not missing, f"flags with a rule but no refusal row: {missing}"


@pytest.mark.parametrize("args, names", TABLE, ids=[" ".join(a) for a, _ in TABLE])
def test_refused_before_any_rank_starts_naming_the_flag(no_spawn, capsys, args, names):
    with pytest.raises(SystemExit) as info:
        main(["train", *args, "--steps" if "--steps" not in args else "--seed", "2"])
    err = capsys.readouterr().err
    assert info.value.code not in (0, None), err
    assert "Traceback" not in err
    assert names in err, err


def test_stale_torchrun_variables_are_refused_not_waited_on(monkeypatch, capsys):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["train", "--steps", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "half a torchrun environment" in err and "unset RANK WORLD_SIZE MASTER_ADDR" in err


def test_oversubscription_is_warned(monkeypatch, capsys):
    import os

    from minitrain import TrainConfig
    from minitrain.train import check_config
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_config(TrainConfig(strategy="ddp", world_size=16, batch_size=16))
    assert "16 ranks on 2 CPU cores" in capsys.readouterr().err


BINDER = Machine(memory=2 * 2**30, cores=1, open_files=1024)  # the smallest machine the course runs on


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(strategy="ddp", world_size=8, batch_size=64),
    dict(strategy="3d", world_size=8, options={"dp": 2, "pp": 2, "tp": 2}, batch_size=16),
    dict(strategy="zero3", world_size=4, steps=2000, batch_size=256),
    dict(strategy="single", model="small", batch_size=64, steps=200),
    dict(strategy="pipeline", world_size=4, batch_size=64, options={"microbatches": 16}),
])
def test_the_courses_runs_fit_the_smallest_machine_it_runs_on(cfg):
    """The bounds only refuse what cannot run: every size a lesson uses fits Binder's 1 CPU, 2 GB."""
    from minitrain import TrainConfig
    from minitrain.model import PRESETS
    from minitrain.strategies.fit import check_fits_machine
    cfg = dict(cfg)
    model = PRESETS[cfg.pop("model", "tiny")]
    check_fits_machine(TrainConfig(model=model, **cfg), BINDER)


def test_the_bounds_follow_the_machine():
    """More ranks than memory (24 MiB each) or open files allow; a batch whose activations do not
    fit; the bound given fits and one more does not."""
    import re

    from minitrain import ConfigError, TrainConfig
    from minitrain.strategies.fit import check_fits_machine
    with pytest.raises(ConfigError, match=r"--world-size 100 does not fit this machine: each rank "
                                          r"takes at least 24.0 MiB .* at most --world-size 85 "):
        check_fits_machine(TrainConfig(strategy="ddp", world_size=100, batch_size=100), BINDER)
    few_files = Machine(memory=2**40, cores=64, open_files=256)
    with pytest.raises(ConfigError, match=r"open files .* the limit is 256 \(ulimit -n\); at most "
                                          r"--world-size 48 "):
        check_fits_machine(TrainConfig(strategy="ddp", world_size=64, batch_size=64), few_files)
    with pytest.raises(ConfigError) as info:
        check_fits_machine(TrainConfig(batch_size=20000), BINDER)
    most = int(re.search(r"at most --batch-size (\d+) fits", str(info.value)).group(1))
    check_fits_machine(TrainConfig(batch_size=most), BINDER)
    with pytest.raises(ConfigError):
        check_fits_machine(TrainConfig(batch_size=most + 1), BINDER)
