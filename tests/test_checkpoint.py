"""Sharded checkpoints (lesson 08): 5 steps + save + resume 5 equals 10 uninterrupted, for every
strategy that saves; consolidation gives the single-process state_dict; damaged or mismatched
checkpoints are refused before any process starts, naming the problem and the fix."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

from minitrain import GPT, GPTConfig, TrainConfig, train
from minitrain.checkpoint.core import CheckpointError, checkpoint_support, find_checkpoint
from minitrain.checkpoint.consolidate import consolidate
from minitrain.cli import build_parser, config_from_args, main
from minitrain.runtime.launch import RankError
from minitrain.model import PRESETS
from minitrain.strategies import Checkpointer, Lockstep, Single, get_strategy, strategy_names

NANO = PRESETS["nano"]
BASE = TrainConfig(steps=10, batch_size=6, seed=0, model=NANO)
CASES = {  # name: (strategy, world size, options, precision)
    "single": ("single", 1, {}, "fp32"),
    "single-bf16": ("single", 1, {}, "bf16-mixed"),
    "ddp-naive": ("ddp-naive", 2, {}, "fp32"),
    "ddp": ("ddp", 2, {}, "fp32"),
    "zero1": ("zero1", 2, {}, "fp32"),
    "zero2-buckets-3-ranks": ("zero2", 3, {"bucket_mb": 0.01}, "fp32"),  # several padded units
    "zero3": ("zero3", 2, {}, "fp32"),
    "zero3-3-ranks-offload": ("zero3", 3, {"offload": True}, "fp32"),
    "zero2-bf16-offload": ("zero2", 2, {"offload": True}, "bf16-mixed"),
    "pipeline": ("pipeline", 2, {"microbatches": 3}, "fp32"),
    "tensor": ("tensor", 2, {}, "fp32"),
    "tensor-sequence-parallel": ("tensor", 2, {"sequence_parallel": True}, "fp32"),
    "tensor-3-ranks-sequence-parallel": ("tensor", 3, {"sequence_parallel": True}, "fp32"),
    "3d": ("3d", 8, {"dp": 2, "pp": 2, "tp": 2, "microbatches": 3}, "fp32"),  # ZeRO-1 over dp
    "3d-zero0-sequence-parallel": ("3d", 4, {"dp": 2, "tp": 2, "zero_stage": 0,
                                             "sequence_parallel": True}, "fp32"),
    "3d-interleaved": ("3d", 4, {"pp": 2, "tp": 2, "schedule": "interleaved", "chunks": 2,
                                 "microbatches": 2}, "fp32"),
    "3d-cp": ("3d", 4, {"dp": 2, "cp": 2}, "fp32"),  # cp ranks hold replicas; ZeRO-1 over dp
    "expert": ("expert", 2, {}, "fp32"),  # each rank saves its own experts
}
MODELS = {  # where nano does not fit: 3 heads for tp 3 (vocabulary 13 and sequence 16 padded),
    "tensor-3-ranks-sequence-parallel": GPTConfig(n_layer=2, n_head=3, d_model=24, seq_len=16),
    "3d-interleaved": GPTConfig(n_layer=4, n_head=2, d_model=32, seq_len=16),  # 4 layers: 2x2 stages
    "expert": dataclasses.replace(PRESETS["tiny-moe"], n_layer=2, d_model=32, seq_len=16),
}


def config(name: str, **changes) -> TrainConfig:
    strategy, n, options, precision = CASES[name]
    return BASE.with_(strategy=strategy, world_size=n, options=options, precision=precision,
                      model=MODELS.get(name, NANO), **changes)


@pytest.fixture(scope="module")
def saved(clusters, tmp_path_factory):
    """Per case, once: the uninterrupted run, and the first 5 steps saved to a directory."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg, root = config(name), tmp_path_factory.mktemp(name)
            cluster = clusters(cfg.world_size)
            full = train(cfg, cluster=cluster, return_state=True)
            first = train(cfg.with_(steps=5, save_dir=str(root)), cluster=cluster,
                          return_state=True)
            cache[name] = (cfg, root, full, first)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CASES))
def test_resume_gives_the_uninterrupted_run(saved, clusters, name):
    cfg, root, full, first = saved(name)
    resumed = train(cfg.with_(resume=str(root)), cluster=clusters(cfg.world_size),
                    return_state=True)
    assert resumed.summary.start_step == 5
    assert resumed.summary.resumed_from == str(root / "step-000005")
    assert first.losses == full.losses[:5]
    assert len(resumed.losses) == 5
    for a, b in zip(resumed.losses, full.losses[5:]):
        assert abs(a - b) <= 1e-6 * abs(b), (resumed.losses, full.losses[5:])
    for key, value in full.state.items():
        torch.testing.assert_close(resumed.state[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", list(CASES))
def test_consolidation_is_the_single_process_state_dict(saved, name):
    cfg, root, _, first = saved(name)
    state = consolidate(root)
    assert list(state) == list(first.state)  # the single-process names, in its order
    for key, value in first.state.items():
        assert torch.equal(state[key], value), key
    model = GPT(cfg.model)
    model.load_state_dict({k: v.float() for k, v in state.items()})  # strict: every key, shape


def test_each_rank_writes_its_own_file_and_the_files_load_weights_only(saved):
    cfg, root, _, _ = saved("zero3")
    ckpt = root / "step-000005"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 5 and meta["layout"]["strategy"] == "zero3"
    assert sorted(meta["files"]) == ["rank00000.pt", "rank00001.pt"]
    shards = [torch.load(ckpt / f"rank0000{r}.pt", weights_only=True) for r in range(2)]
    assert all(s["step"] == 5 and s["rank"] == r for r, s in enumerate(shards))
    owned = sum(u["shard"].numel() for s in shards for u in s["state"]["model"]["units"])
    assert NANO.num_params() <= owned < NANO.num_params() + 2 * 10  # 1/N each, plus padding


def test_save_every_and_resume_from_an_earlier_step(clusters, tmp_path):
    cfg = config("ddp", steps=6, save_dir=str(tmp_path), save_every=2)
    full = train(cfg, cluster=clusters(2))
    assert full.summary.checkpoints == [str(tmp_path / f"step-00000{k}") for k in (2, 4, 6)]
    assert find_checkpoint(tmp_path) == tmp_path / "step-000006"  # a save dir: its latest
    again = train(config("ddp", steps=6, resume=str(tmp_path / "step-000002")), cluster=clusters(2))
    assert again.losses == pytest.approx(full.losses[2:], rel=1e-6)


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def copy_of(saved, tmp_path):
    """A private copy of a saved case's checkpoint, to damage."""
    def get(name):
        cfg, root, _, _ = saved(name)
        shutil.copytree(root, tmp_path / name)
        return cfg, tmp_path / name, tmp_path / name / "step-000005"
    return get


@pytest.mark.parametrize("change, message", [
    # (another strategy or world size among single, ddp and zero1-3 reshards: tests/test_reshard.py)
    (dict(strategy="pipeline", options={"microbatches": 3}),
     "saved by strategy 'zero3', this run is 'pipeline'; a checkpoint is resharded on load"),
    (dict(model=NANO.__class__(n_layer=3, n_head=2, d_model=32, seq_len=16)),
     "n_layer 2 there, 3 here; resume with the same model (--n-layer 2)"),
    (dict(precision="bf16-mixed"), "saved in --precision fp32, this run uses bf16-mixed"),
    (dict(steps=5), "at step 5, and --steps 5 is already reached"),
])
def test_a_mismatched_checkpoint_is_refused_before_spawning(saved, no_spawn, change, message):
    cfg, root, _, _ = saved("zero3")
    with pytest.raises(CheckpointError) as info:
        train(cfg.with_(resume=str(root), **change))
    assert message in str(info.value)


@pytest.mark.parametrize("name, change, message", [
    ("tensor-3-ranks-sequence-parallel", dict(world_size=1), "saved on 3 ranks, this run has 1"),
    ("3d", dict(batch_size=8, options={"dp": 4, "pp": 1, "tp": 2, "microbatches": 1}),
     ("cut for other 3d options: dp 2 there, 4 here, pp 2 there, 1 here; resume with the "
      "checkpoint's (--dp, --pp)")),
    ("3d", dict(options={**CASES["3d"][2], "zero_stage": 0}), "zero_stage 1 there, 0 here"),
    ("3d-interleaved", dict(options={"pp": 2, "tp": 2, "microbatches": 2}), "chunks 2 there, 1 here"),
    ("3d-cp", dict(options={"dp": 1, "cp": 4}),
     "cp 2 there, 4 here, dp 2 there, 1 here; resume with the checkpoint's (--cp, --dp)"),
    ("expert", dict(world_size=4, batch_size=8), "saved on 2 ranks, this run has 4"),
])
def test_a_tensor_or_3d_checkpoint_resumes_only_on_its_mesh(saved, no_spawn, name, change, message):
    cfg, root, _, _ = saved(name)
    with pytest.raises(CheckpointError) as info:
        train(cfg.with_(resume=str(root), **change))
    assert message in str(info.value)


def test_a_missing_rank_file_is_refused(copy_of, no_spawn):
    cfg, root, ckpt = copy_of("zero3")
    os.remove(ckpt / "rank00001.pt")
    with pytest.raises(CheckpointError, match="rank00001.pt is missing"):
        train(cfg.with_(resume=str(root)))
    with pytest.raises(CheckpointError, match="rank00001.pt is missing"):
        consolidate(root)


def test_a_truncated_rank_file_is_refused(copy_of, no_spawn):
    cfg, root, ckpt = copy_of("pipeline")
    data = (ckpt / "rank00000.pt").read_bytes()
    (ckpt / "rank00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or was replaced"):
        train(cfg.with_(resume=str(root)))


def test_an_unfinished_save_is_refused(copy_of, no_spawn):
    cfg, root, ckpt = copy_of("ddp")
    os.remove(ckpt / "meta.json")
    with pytest.raises(CheckpointError, match=r"only unfinished saves \(step-000005: .* nothing can "
                                              r"be resumed"):
        train(cfg.with_(resume=str(root)))
    with pytest.raises(CheckpointError, match="has no meta.json: the save did not finish"):
        train(cfg.with_(resume=str(ckpt)))
    with pytest.raises(CheckpointError, match="does not exist"):
        train(cfg.with_(resume=str(root / "nowhere")))


def test_a_corrupt_rank_file_is_refused_when_read(copy_of, clusters):
    cfg, root, ckpt = copy_of("zero1")
    data = bytearray((ckpt / "rank00001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the SHA-256 tells
    (ckpt / "rank00001.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank00001.pt is corrupt"):
        consolidate(root)
    with pytest.raises(RankError, match="rank00001.pt is corrupt"):
        train(cfg.with_(resume=str(root)), cluster=clusters(2))


@pytest.mark.parametrize("cfg, message", [
    (BASE.with_(strategy="ps-sync", world_size=3, save_dir="x"), "do not step in lockstep"),
    (BASE.with_(strategy="ddp", world_size=2, save_dir="x", options={"compress": "topk:0.1"}),
     "--compress cannot be checkpointed yet"),
    (BASE.with_(save_every=2), "--save-every needs --save-dir"),
    (BASE.with_(save_dir="x", save_every=0), "--save-every must be at least 1"),
])
def test_what_cannot_be_checkpointed_is_refused(no_spawn, cfg, message):
    with pytest.raises(Exception) as info:
        train(cfg)
    assert message in str(info.value)


def test_a_checkpointer_is_complete_or_absent_with_its_reason():
    class Bare(Lockstep):  # no checkpointer: refused, saying why
        name = "bare"
    assert checkpoint_support(Bare) == ("strategy 'bare' cannot save checkpoints: it has no "
                                        "checkpointer yet (see Checkpointer in "
                                        "minitrain/strategies/base.py)")

    class Half(Checkpointer):  # saves, but cannot load or consolidate
        def save(self, strategy):
            return {}
    with pytest.raises(TypeError, match="abstract"):
        Half()

    class Sharded(Single):  # an ordinary attribute: a subclass inherits it (or sets its own)
        name = "sharded"
    assert checkpoint_support(Sharded) is None and Sharded.checkpointer is Single.checkpointer


@pytest.mark.parametrize("name", strategy_names())
def test_a_checkpointer_that_reshards_implements_both_halves(name):
    checkpointer = get_strategy(name).checkpointer
    if isinstance(checkpointer, Checkpointer) and checkpointer.reshards:
        for method in ("portable_optimizer", "load_portable"):
            assert getattr(type(checkpointer), method) is not getattr(Checkpointer, method), \
                f"{name}'s checkpointer reshards but does not implement {method}"


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def test_cli_flags_reach_the_config(tmp_path):
    args = build_parser().parse_args(["train", "--save-dir", "ck", "--save-every", "3",
                                      "--resume", str(tmp_path)])
    cfg = config_from_args(args)
    assert cfg.save_dir == os.path.abspath("ck") and cfg.save_every == 3
    assert cfg.resume == str(tmp_path) and not hasattr(cfg.options, "save_dir")


def test_cli_consolidates_and_refuses(saved, tmp_path, capsys, no_spawn):
    cfg, root, _, first = saved("pipeline")
    assert main(["consolidate", str(root), str(tmp_path / "full.pt")]) == 0
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in first.state.items())
    with pytest.raises(SystemExit) as info:
        main(["train", "--strategy", "pipeline", "--world-size", "2", "--model", "nano",
              "--n-layer", "4", "--microbatches", "3", "--resume", str(root)])
    assert info.value.code == 2
    assert "n_layer 2 there, 4 here; resume with the same model (--n-layer 2)" in \
        capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Misuse: meta.json edited by hand, consolidate pointed where it must not write
# --------------------------------------------------------------------------------------------------


def _drop(*keys):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        del meta[keys[-1]]
    return edit


def _put(value, *keys):
    def edit(meta):
        for k in keys[:-1]:
            meta = meta[k]
        meta[keys[-1]] = value
    return edit


HAND_EDITS = {  # name: (edit of meta.json, what the refusal says is wrong)
    "layout removed": (_drop("layout"), "layout is missing"),
    "files removed": (_drop("files"), "files is missing"),
    "config removed": (_drop("config"), "config is missing"),
    "step removed": (_drop("step"), "step is missing"),
    'step "10"': (_put("10", "step"), 'step is a string ("10"), not an integer'),
    "step null": (_put(None, "step"), "step is null, not an integer"),
    "step 0": (_put(0, "step"), "step is 0; a checkpoint is saved after at least one step"),
    "step 7": (_put(7, "step"), "step is 7 but the directory is step-000005"),
    "step true": (_put(True, "step"), "step is a boolean (true), not an integer"),
    'world_size "2"': (_put("2", "layout", "world_size"),
                       'layout.world_size is a string ("2"), not an integer'),
    "world_size 1": (_put(1, "layout", "world_size"),
                     "files lists 2 rank files (rank00000.pt, rank00001.pt) but layout.world_size "
                     "is 1"),
    "world_size 0": (_put(0, "layout", "world_size"), "layout.world_size is 0"),
    "an extra model key": (_put(1, "layout", "model", "extra"),
                           "layout.model.extra is not a key minitrain writes"),
    "a model key removed": (_drop("layout", "model", "d_model"), "layout.model.d_model is missing"),
    "a model that cannot be": (_put(3, "layout", "model", "n_head"),
                               "layout.model is not a valid model (d_model=32 is not divisible"),
    "mlp 5": (_put(5, "layout", "model", "mlp"), "layout.model.mlp is an integer (5), not a string"),
    "mlp unknown": (_put("relu", "layout", "model", "mlp"),
                    "layout.model is not a valid model (GPTConfig.mlp"),
    "strategy unknown": (_put("zero4", "layout", "strategy"),
                         "layout.strategy 'zero4' is not a strategy of this minitrain"),
    "precision unknown": (_put("fp8", "layout", "precision"), "layout.precision 'fp8' is not one of"),
    "files: a list": (_put([], "files"), "files is a list ([]), not an object"),
    'bytes "x"': (_put("x", "files", "rank00000.pt", "bytes"),
                  'files.rank00000.pt.bytes is a string ("x"), not an integer'),
    "sha256 null": (_put(None, "files", "rank00000.pt", "sha256"),
                    "files.rank00000.pt.sha256 is null, not a string"),
    "options removed": (_drop("config", "options"), "config.options is missing"),
    "an extra key": (_put(1, "note"), "note is not a key minitrain writes"),
}


@pytest.fixture
def zero3_saved(saved):
    """zero3's case saved (before ``no_spawn``, when listed first)."""
    saved("zero3")


@pytest.mark.parametrize("name", list(HAND_EDITS))
def test_a_hand_edited_meta_json_is_refused_in_one_line(zero3_saved, copy_of, no_spawn, name):
    edit, problem = HAND_EDITS[name]
    cfg, root, ckpt = copy_of("zero3")
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for attempt in (lambda: train(cfg.with_(resume=str(root))), lambda: consolidate(root)):
        with pytest.raises(CheckpointError) as info:
            attempt()
        text = str(info.value)
        assert f"{ckpt / 'meta.json'} is not as minitrain wrote it: {problem}" in text, text
        assert "undo the edit" in text and "\n" not in text


def test_rank_files_that_do_not_match_their_meta_json_are_refused(copy_of, clusters, capsys):
    """meta.json edited consistently (world size 1, one file listed): the schema holds, but the
    zero3 shard in the file is not the whole model — refused naming both, not a shape error."""
    cfg, root, ckpt = copy_of("zero3")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["layout"]["world_size"] = 1
    del meta["files"]["rank00001.pt"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"the rank files do not hold what meta.json "
                                              r"describes \(.*\); was meta.json edited"):
        consolidate(root)
    with pytest.raises(SystemExit):
        main(["consolidate", str(root), str(ckpt.parent.parent / "out.pt")])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the rank files do not hold what meta.json describes" in err


def _special(tmp_path, kind):
    import stat
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":  # a copy of /dev/full's node: only root may make one
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        except PermissionError:
            pytest.skip("making a device node needs root")
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("where", ["a rank file", "meta.json", "inside the step", "a directory",
                                   "empty", "fifo", "device", "a link into the checkpoint"])
def test_consolidate_never_damages_a_checkpoint_nor_replaces_what_is_not_a_file(
        copy_of, tmp_path, capsys, where):
    _, root, ckpt = copy_of("ddp")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    out = {"a rank file": ckpt / "rank00000.pt", "meta.json": ckpt / "meta.json",
           "inside the step": ckpt / "full.pt", "empty": ""}.get(where)
    if where in ("fifo", "device", "a directory"):
        out = _special(tmp_path, {"a directory": "dir"}.get(where, where))
    if where == "a link into the checkpoint":
        out = tmp_path / "link.pt"
        out.symlink_to(ckpt / "rank00001.pt")
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(ckpt), str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    expected = {"a directory": "it is a directory", "empty": "no output file given",
                "fifo": "it is a pipe, not a regular file", "device": "it is a character device"
                }.get(where, f"it is inside the checkpoint {ckpt}")
    assert expected in err, err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # the checkpoint untouched
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    if where in ("fifo", "device", "a directory"):
        import stat
        mode = os.lstat(out).st_mode
        assert {"fifo": stat.S_ISFIFO, "device": stat.S_ISCHR, "a directory": stat.S_ISDIR}[where](mode)
    assert consolidate(root)  # and it still consolidates
