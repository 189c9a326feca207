"""A learner's mistakes diagnosed in seconds: deadlocks, wrong peers, mismatched calls, signals,
every failing rank kept, and a cluster that stays consistent whatever happens to a run."""

import os
import pickle
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from conftest import pid_alive
from minitrain import Cluster, CollectiveTimeout, RankError
from minitrain.runtime.diagnostics import format_error
from minitrain.runtime.launch import Deadlock
from minitrain.runtime.watch import died


def skips_the_all_reduce():
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    return t.tolist()


def wrong_ring_peer():
    r = dist.get_rank()
    t = torch.ones(2)
    if r == 0:
        dist.recv(t, 2)  # rank 2 sends nothing: it should have been rank 1
    if r == 1:
        dist.send(t, 0)


def both_receive_first():
    t = torch.ones(3)
    dist.recv(t, 1 - dist.get_rank())


def sleeps_while_the_other_returns():
    if dist.get_rank() == 1:
        time.sleep(4)
    return dist.get_rank()


@pytest.fixture(scope="module")
def two():
    with Cluster(2, backend="gloo", timeout=20) as c:
        yield c


def test_a_skipped_collective_is_named_within_seconds(two):
    t0 = time.monotonic()
    with pytest.raises(Deadlock) as info:
        two.run(skips_the_all_reduce)
    assert time.monotonic() - t0 < 6
    text = str(info.value)
    assert "rank 1 returned" in text
    assert "rank 0 waiting in all_reduce at test_diagnostics.py:" in text and "dist.all_reduce(t)" in text
    assert "--- stack of rank 0 ---" in text
    # the same facts as data, for the checkers: no parsing of the text above
    err = info.value
    waiting, returned = err.where[0], err.where[1]
    assert (waiting.state, waiting.op, returned.state) == ("waiting", "all_reduce", "returned")
    assert waiting.frame.code == "dist.all_reduce(t)" and waiting.frame.name == "skips_the_all_reduce"
    assert waiting.frame.file == __file__
    assert "--- stack of rank" not in format_error(err, details=False)
    assert str(pickle.loads(pickle.dumps(err))) == text  # it travels (a grader's process) whole
    assert two.run(lambda: dist.get_rank()) == [0, 1]  # the group is usable again


def test_a_wrong_ring_peer_is_named_within_seconds():
    with Cluster(3, backend="gloo", timeout=20) as c:
        t0 = time.monotonic()
        with pytest.raises(Deadlock) as info:
            c.run(wrong_ring_peer)
        assert time.monotonic() - t0 < 6
    text = str(info.value)
    assert "rank 0 waiting in recv" in text and "rank 1 waiting in send" in text
    assert "rank 2 returned" in text
    where = info.value.where
    assert [(where[r].state, where[r].op) for r in range(3)] == [
        ("waiting", "recv"), ("waiting", "send"), ("returned", "")]


def test_a_rank_that_is_only_slow_is_not_a_deadlock(two):
    assert two.run(sleeps_while_the_other_returns) == [0, 1]


def test_when_every_rank_waits_their_lines_are_shown_and_kept(capsys):
    with Cluster(2, backend="gloo", timeout=11) as c:
        with pytest.raises(CollectiveTimeout) as info:
            c.run(both_receive_first)
    err = capsys.readouterr().err
    assert "every rank is waiting for another" in err
    assert "rank 0 waiting in recv at test_diagnostics.py" in err
    assert "rank 1 waiting in recv at test_diagnostics.py" in err
    text = str(info.value)
    assert "rank 0 was waiting in recv" in text and "rank 1 was waiting in recv" in text
    assert "also failed" in text  # the other rank's error is kept
    err = info.value
    assert err.op == "recv" and err.timeout_s == 11 and err.frame.name == "both_receive_first"
    assert [(s.state, s.op) for s in err.waiting()] == [("waiting", "recv")] * 2


def test_every_failing_rank_is_kept(two):
    def both_raise():
        raise ValueError(f"bad input on rank {dist.get_rank()}")
    with pytest.raises(RankError) as info:
        two.run(both_raise)
    text = str(info.value)
    assert "bad input on rank 0" in text and "bad input on rank 1" in text
    assert len(info.value.others) == 1


def test_a_timeout_is_reported_before_a_peer_that_went_away():
    c = Cluster(2, backend="gloo", timeout=5)
    peer = c._error(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", "", False)
    timeout = c._error(1, "RuntimeError", "Timed out waiting 5000ms for recv", "", True)
    cause = c._error(1, "ValueError", "shapes differ", "", False)
    assert sorted([peer, timeout, cause], key=lambda e: e.priority) == [cause, timeout, peer]


def test_a_killed_rank_is_said_to_be_likely_out_of_memory(two):
    def killed():
        if dist.get_rank() == 1:
            time.sleep(1)  # the parent samples each rank's memory while it waits
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)
    with pytest.raises(RankError, match="signal 9") as info:
        two.run(killed)
    assert "out-of-memory" in str(info.value) and "resident memory" in str(info.value)
    assert info.value.signal == 9 and info.value.exc_type == ""


def test_an_aborted_rank_shows_its_native_message(two):
    def aborts():
        if dist.get_rank() == 1:
            os.write(2, b"gloo: sizes of the buffers do not match\n")
            os.abort()
        time.sleep(5)
    with pytest.raises(RankError, match="signal 6") as info:
        two.run(aborts)
    text = str(info.value)
    assert "collective mismatch" in text and "sizes of the buffers do not match" in text
    assert info.value.signal == 6 and "sizes of the buffers" in info.value.native


def test_an_abort_reason_is_read_once_from_the_native_message():
    native = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at ../gloo/allreduce.cc:12] a == b. 4 vs 8\n")
    err = died(1, -6, 1234, native, None)
    assert (err.signal, err.abort_reason) == (6, "a == b. 4 vs 8")
    assert "signal 6" in str(err) and "collective mismatch" in str(err)
    assert died(1, -9, 1234, "", 2**30).hint.count("1,024 MiB") == 1
    assert died(0, 3, 1234, "", None).signal is None and "exited with code 3" in str(died(0, 3, 1, "", None))


def test_a_learners_destroy_process_group_is_refused_and_repaired(two):
    with pytest.raises(RankError, match="destroy_process_group"):
        two.run(dist.destroy_process_group)
    assert two.run(lambda: dist.get_world_size()) == [2, 2]


def test_a_subprocess_a_rank_started_goes_with_it():
    with Cluster(1, backend="gloo") as c:
        pid = c.run(lambda: subprocess.Popen(["sleep", "60"]).pid)[0]
        assert pid_alive(pid)
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs Linux /proc")
def test_a_second_cluster_does_not_hold_the_first_ones_socket():
    with Cluster(1, backend="gloo") as first, Cluster(1, backend="gloo") as second:
        fd = first._listen_fd
        mine = os.readlink(f"/proc/self/fd/{fd}")

        def holds(fd, target):
            try:
                return os.readlink(f"/proc/self/fd/{fd}") == target
            except OSError:
                return False
        assert second.run(holds, fd, mine) == [False]


def test_an_interrupt_while_sending_leaves_the_cluster_consistent(two, monkeypatch):
    conn = two.start()._conns[1]
    calls = []

    def interrupted(self, payload):
        calls.append(1)
        raise KeyboardInterrupt
    monkeypatch.setattr(type(conn), "send_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        two.run(lambda: 1)
    monkeypatch.undo()
    assert calls and not two.alive
    assert two.run(lambda: dist.get_rank(), timeout=30) == [0, 1]


def test_a_result_that_cannot_be_unpickled_names_its_rank(two):
    def unpicklable():
        class Local:  # pickled by value... but its module-level reference is missing here
            pass
        import pickle
        return pickle.dumps(Local) if False else _Boom()
    with pytest.raises(RankError, match="could not be unpickled"):
        two.run(unpicklable)


class _Boom:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("cannot be rebuilt here")


def test_a_cell_defined_after_the_ranks_started_still_shows_its_line(two):
    """A rank forked before a notebook cell ran has no copy of its source; the parent fills it in."""
    import linecache

    two.start()
    src = ("def late_cell():\n"
           "    if dist.get_rank() == 0:\n"
           "        dist.all_reduce(torch.ones(1))  # the line to show\n")
    path = "/tmp/ipykernel_0/late_cell.py"  # how ipykernel names a cell; the file never exists
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    try:
        namespace = {"dist": dist, "torch": torch}
        exec(compile(src, path, "exec"), namespace)
        with pytest.raises(Deadlock) as info:
            two.run(namespace["late_cell"])
    finally:
        linecache.cache.pop(path, None)
    text = str(info.value)
    assert "rank 0 waiting in all_reduce at cell line 3: dist.all_reduce(torch.ones(1))" in text
    frame = info.value.where[0].frame
    assert (frame.file, frame.line, frame.in_cell) == (path, 3, True)
    assert frame.code == "dist.all_reduce(torch.ones(1))  # the line to show"
    assert "    dist.all_reduce(torch.ones(1))  # the line to show" in text  # in its stack too


def test_shipping_keeps_a_cells_file_name_and_source(tmp_path):
    """What the ranks get (minitrain.runtime.shipping): the code's real file name, whatever cloudpickle
    renames it to, and the source of a file that exists only in this process's linecache."""
    import linecache

    from minitrain.runtime import shipping

    src = "def cell_fn(x):\n    y = x + 1  # the second line\n    return y\n"
    path = "/tmp/ipykernel_0/shipped_cell.py"  # never on disk, as with a notebook cell
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    namespace: dict = {}
    exec(compile(src, path, "exec"), namespace)
    try:
        data = shipping.dumps(namespace["cell_fn"])
    finally:
        linecache.cache.pop(path, None)
    assert linecache.getline(path, 2) == ""  # the receiver has no copy of the cell...
    try:
        fn = shipping.loads(data)
        assert fn(1) == 2
        assert fn.__code__.co_filename == path  # ...until loads() puts it there
        assert linecache.getline(path, 2).strip() == "y = x + 1  # the second line"
    finally:
        linecache.cache.pop(path, None)
    real = tmp_path / "module_on_disk.py"
    real.write_text(src)
    exec(compile(src, str(real), "exec"), namespace)
    sources, _ = pickle.loads(shipping.dumps(namespace["cell_fn"]))
    assert sources == {}  # a function from a file on disk ships no source: the rank reads it


def test_a_rank_whose_peer_vanished_while_it_waited_is_shown_waiting():
    from minitrain.runtime.diagnostics import Frame
    from minitrain.runtime.watch import Watch, raised

    frames = (Frame(__file__, 39, "both_receive_first", "dist.recv(t, 1 - dist.get_rank())"),
              Frame("/x/torch/distributed/distributed_c10d.py", 1, "recv", ""))
    timeout = raised(1, "RuntimeError", "Timed out waiting 11000ms for recv operation to complete",
                     "", frames, 11)
    peer_lost = raised(0, "RuntimeError", "Connection closed by peer [127.0.0.1]:1", "", frames)
    user = raised(0, "ValueError", "bad input", "", frames[:1])
    replies = [("error",), ("error",)]
    where = Watch(2, []).states(replies, [timeout, peer_lost])
    assert [(where[r].state, where[r].op) for r in (0, 1)] == [("waiting", "recv")] * 2
    where = Watch(2, []).states(replies, [timeout, user])  # an ordinary exception stays a failure
    assert where[0].state == "failed"
