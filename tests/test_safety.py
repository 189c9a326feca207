"""No checkpoint lost or mixed up, and divergence stops the run: a used save dir is refused unless
resumed or overwritten, the data stream is compared on resume, a step appears only when complete,
a NaN loss ends the run with the step and the fix, and JSON output stays JSON."""

import json
import subprocess
import sys

import pytest

from minitrain import TrainConfig, train
from minitrain.checkpoint.core import CheckpointError, find_checkpoint
from minitrain.runtime.launch import RankError
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
    assert resumed.summary.start_step == 4


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
    assert len(kept.losses) == 6


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


# --------------------------------------------------------------------------------------------------
# One run per save dir, one lineage per save dir, unfinished saves, a full disk
# --------------------------------------------------------------------------------------------------


def _lock_holder(save_dir, timeout_s=90.0):
    """The pid written in ``save_dir``'s lock file once a run holds it (None until then)."""
    import os
    import time
    lock = os.path.join(save_dir, ".minitrain-lock")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(open(lock).read())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    return None


def test_two_runs_on_one_save_dir_the_second_is_refused_and_a_killed_one_frees_it(tmp_path,
                                                                                  clusters):
    """Run A holds its --save-dir; run B, started on it meanwhile, is refused in one line naming
    A; A killed by SIGKILL leaves the directory free for the next run (the kernel drops the lock)."""
    import os
    import signal
    save = tmp_path / "ck"
    a = subprocess.Popen([sys.executable, "-m", "minitrain", "train", "--model", "nano",
                          "--batch-size", "4", "--steps", "1000000", "--save-every", "100000",
                          "--save-dir", str(save)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        assert _lock_holder(save) == a.pid, "run A never took its save dir"
        b = run_cli("--model", "nano", "--batch-size", "4", "--steps", "2", "--save-dir", str(save))
        assert b.returncode == 2, b.stderr
        assert f"is in use by another run (pid {a.pid} on " in b.stderr, b.stderr
        assert "Traceback" not in b.stderr and len(b.stderr.strip().splitlines()) == 1
        with pytest.raises(CheckpointError, match="in use by another run"):
            train(NANO.with_(save_dir=str(save)), cluster=clusters(1))  # from Python too
    finally:
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
    result = train(NANO.with_(save_dir=str(save), overwrite=True, steps=2), cluster=clusters(1))
    assert result.summary.checkpoints == [str(save / "step-000002")]
    assert not (save / ".minitrain-lock").exists()  # a run that ends removes its lock file


def test_a_second_history_in_one_save_dir_is_refused_or_replaces_the_later_steps(tmp_path,
                                                                                  clusters):
    """Resuming an older step into the same directory would leave `--resume DIR` finding the other
    history's latest step: refused, or with --overwrite the later steps go and this run's are
    the ones found."""
    save = tmp_path / "L"
    train(NANO.with_(steps=6, save_every=2, save_dir=str(save)), cluster=clusters(1))
    older = NANO.with_(steps=5, resume=str(save / "step-000002"), save_dir=str(save), lr=0.01)
    with pytest.raises(CheckpointError) as info:
        train(older, cluster=clusters(1))
    text = str(info.value)
    assert "is older than the latest checkpoint" in text and "(step-000006)" in text
    assert "--overwrite to delete the steps after step-000002 (step-000004, step-000006)" in text
    again = train(older.with_(overwrite=True), cluster=clusters(1))
    assert again.summary.start_step == 2
    assert sorted(p.name for p in save.iterdir()) == ["step-000002", "step-000005"]
    assert find_checkpoint(save) == save / "step-000005"
    latest = train(NANO.with_(steps=6, resume=str(save)), cluster=clusters(1))
    assert latest.summary.resumed_from == str(save / "step-000005")


def test_only_an_unfinished_save_is_named_with_the_real_choice(tmp_path, no_spawn):
    save = tmp_path / "U"
    (save / "step-000001.tmp").mkdir(parents=True)
    (save / "step-000001.tmp" / "rank00000.pt").write_bytes(b"partial")
    with pytest.raises(CheckpointError) as info:
        train(NANO.with_(resume=str(save)))
    text = str(info.value)
    assert "only unfinished saves (step-000001.tmp" in text and "nothing can be resumed" in text
    assert f"--save-dir {save} --overwrite" in text
    with pytest.raises(CheckpointError) as info:
        train(NANO.with_(save_dir=str(save)))
    text = str(info.value)
    assert "holds only unfinished saves (step-000001.tmp)" in text and "--overwrite" in text
    assert "--resume" not in text  # (resuming it cannot work: not offered)


def _fill(path, leave=0):
    """Fill the file system of ``path`` with a ballast file, leaving ``leave`` bytes."""
    import os
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(path, "ballast"), "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave))
        except OSError:
            pass


def _rank_with_full_disk(cfg, full_at_save: int):
    """On every rank: the real run, with the disk "full" from the ``full_at_save``-th save on
    (each rank's rank file write raises ENOSPC, as the kernel does)."""
    import errno

    from minitrain.checkpoint import core as checkpoint
    from minitrain.train import run_rank
    real, calls = checkpoint.write_whole, [0]

    def write(path, data):
        if path.name.startswith("rank"):
            calls[0] += 1
            if calls[0] >= full_at_save:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)
    checkpoint.write_whole = write
    try:
        return run_rank(cfg)
    finally:
        checkpoint.write_whole = real


def test_a_full_disk_during_a_save_is_said_and_what_was_kept(tmp_path, clusters):
    """ENOSPC at a rank file's write (injected where the bytes are written): every rank stops with
    the same one-line error, the unfinished step is removed, the complete ones are kept."""
    from minitrain.checkpoint.consolidate import check_output
    save = tmp_path / "ck"
    cfg = NANO.with_(strategy="ddp", world_size=2, steps=6, save_every=2, save_dir=str(save))
    with pytest.raises(RankError) as info:
        clusters(2).run(_rank_with_full_disk, cfg, 2)
    err = info.value
    assert err.exc_type == "CheckpointError", str(err)
    assert err.message.startswith(f"no space left on {save} (writing rank ")
    assert "step 4 was not saved and its unfinished step-000004.tmp was removed" in err.message
    assert f"the complete checkpoints are kept (step-000002: --resume {save} takes step-000002)" \
        in err.message
    assert "\n" not in err.message
    assert sorted(p.name for p in save.iterdir()) == ["step-000002"]
    assert find_checkpoint(save) == save / "step-000002" and check_output(tmp_path / "x.pt")


def test_a_full_disk_during_a_consolidate_is_said_in_one_line_and_nothing_is_left(
        first_run, tmp_path, monkeypatch, capsys):
    """ENOSPC once the consolidated file's first bytes are written (injected at ``os.write`` on its
    temporary): one line saying so, the earlier file as it was, no temporary left behind."""
    import errno
    import os

    from minitrain.cli import main
    out = tmp_path / "full.pt"
    out.write_bytes(b"an earlier full.pt")
    real, hits = os.write, []

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if os.path.dirname(target) == str(tmp_path) and target.endswith(".tmp"):
            hits.append(target)
            if len(hits) > 1:  # the first chunk lands: a partial temporary is on disk
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data[:4096])
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(first_run), str(out)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(hits) == 2, (hits, err)
    assert err.startswith(f"minitrain consolidate: error: no space left on {tmp_path}: the "
                          "consolidated state_dict needs "), err
    assert f"nothing was written ({out} is as it was)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]  # no temporary left
    assert out.read_bytes() == b"an earlier full.pt"


def test_the_cli_says_a_ranks_checkpoint_error_in_one_line(first_run, tmp_path):
    """A checkpoint refused inside the ranks (a corrupt rank file: its SHA-256) is one line."""
    import shutil
    copy = tmp_path / "ck"
    shutil.copytree(first_run / "step-000004", copy / "step-000004")
    data = bytearray((copy / "step-000004" / "rank00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "step-000004" / "rank00000.pt").write_bytes(bytes(data))
    out = run_cli("--model", "nano", "--batch-size", "4", "--steps", "6", "--resume", str(copy))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"minitrain train: error: {copy / 'step-000004' / 'rank00000.pt'} is "
        "corrupt: its SHA-256 differs from meta.json; use another checkpoint"], out.stderr


_FULL_DISK = r'''
import json, os, subprocess, sys
from pathlib import Path
root = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], check=True)
from minitrain import TrainConfig, train
from minitrain.runtime.launch import RankError
from minitrain.checkpoint.core import CheckpointError
from minitrain.checkpoint.consolidate import consolidate_to
from minitrain.model import PRESETS

def fill_after_the_first_save(step, loss):
    if step == 2:  # the first save (after step 2) is complete; now the disk fills up
        st = os.statvfs(root)
        with open(root / "ballast", "wb") as f:
            try:
                f.write(b"\0" * (st.f_bavail * st.f_frsize))
            except OSError:
                pass

out = {}
cfg = TrainConfig(strategy="ddp", world_size=2, steps=6, save_every=2, batch_size=4,
                  model=PRESETS["nano"], save_dir=str(root / "ck"))
try:
    train(cfg, on_step=fill_after_the_first_save)
except RankError as exc:
    out["save"] = [exc.exc_type, exc.message]
out["left"] = sorted(os.listdir(root / "ck"))
try:
    consolidate_to(root / "ck", root / "full.pt")
except CheckpointError as exc:
    out["consolidate"] = str(exc)
out["root"] = sorted(os.listdir(root))
print(json.dumps(out))
'''


def test_a_real_full_disk_during_a_save_and_a_consolidate(tmp_path):
    """On a small tmpfs (a mount namespace of our own, so nothing is mounted outside the test):
    the disk fills after the first save; the next save says so in one line and keeps the first,
    and consolidating onto the full disk says so and leaves no temporary behind."""
    import shutil
    if not shutil.which("unshare"):
        pytest.skip("needs unshare (util-linux) to mount a tmpfs")
    root = tmp_path / "small"
    root.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no user/mount namespaces here: the injected ENOSPC test covers the message")
    import os

    import minitrain
    here = os.path.dirname(os.path.dirname(minitrain.__file__))  # the minitrain under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                           str(script), str(root)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    kind, message = out["save"]
    assert kind == "CheckpointError" and message.startswith(f"no space left on {root / 'ck'}")
    assert "step 4 was not saved" in message and "(step-000002: --resume" in message
    assert out["left"] == ["step-000002"]
    assert out["consolidate"].startswith(f"no space left on {root}: the consolidated state_dict "
                                         "needs ")
    assert out["root"] == ["ballast", "ck"]  # no full.pt, no temporary
