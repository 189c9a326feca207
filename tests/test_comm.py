"""Traced collectives and the ring all-reduce built from send/recv."""

import pytest
import torch
import torch.distributed as dist

from minitrain import Comm, ring_all_reduce
from minitrain.comm import ring_sent_bytes

SHAPES = [(1,), (7,), (10,), (1001,), (3, 5)]  # sizes that do and do not divide by 2, 3, 4


def ring_vs_builtin(shapes, pieces=None):
    comm = Comm()
    out = []
    for i, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(100 * i + comm.rank)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        expected = x.clone()
        dist.all_reduce(expected)
        got = ring_all_reduce(x.clone(), comm, pieces=pieces)
        out.append(torch.allclose(got, expected, rtol=1e-12, atol=1e-12))
    sends = [e for e in comm.tracer.events if e.op == "send"]
    return out, sum(e.bytes for e in sends), len(sends)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(clusters, n):
    results = clusters(n).run(ring_vs_builtin, SHAPES)
    total = sum(torch.Size(s).numel() for s in SHAPES) * 8  # float64
    for rank, (equal, sent, calls) in enumerate(results):
        assert all(equal), f"rank {rank}: {equal}"
        assert calls == 2 * (n - 1) * len(SHAPES)
        # what the ring really sent is 2(N-1)/N of the data, up to the uneven chunk sizes
        assert abs(sent - 2 * (n - 1) / n * total) <= 2 * (n - 1) * len(SHAPES) * 8
    # over all ranks every chunk is sent exactly 2(N-1) times... in total: 2(N-1) x data
    assert sum(r[1] for r in results) == 2 * (n - 1) * total


@pytest.mark.parametrize("n", [2, 3])
def test_ring_in_pieces_equals_dist_all_reduce(clusters, n):
    """Each chunk sent as several sub-chunks (the pipelined ring): same sum, same bytes."""
    shapes = [(10,), (1001,)]
    total = sum(torch.Size(s).numel() for s in shapes) * 8
    for pieces in (2, 5):
        results = clusters(n).run(ring_vs_builtin, shapes, pieces)
        for rank, (equal, sent, calls) in enumerate(results):
            assert all(equal), f"pieces={pieces}, rank {rank}: {equal}"
            assert calls > 2 * (n - 1) * len(shapes), "the chunks were not cut into pieces"
        assert sum(r[1] for r in results) == 2 * (n - 1) * total


def ring_on_a_view():
    comm = Comm()
    base = torch.arange(12.0).reshape(3, 4) * (comm.rank + 1)
    view = base.t()  # not contiguous
    ring_all_reduce(view, comm)
    return base


def test_ring_all_reduce_works_in_place_on_non_contiguous_tensors(clusters):
    out = clusters(3).run(ring_on_a_view)
    assert all(torch.equal(o, torch.arange(12.0).reshape(3, 4) * 6) for o in out)


def every_collective():
    comm = Comm()
    r, n = comm.rank, comm.size
    res = {}
    t = torch.full((4,), float(r))
    comm.broadcast(t, src=1)
    res["broadcast"] = t.tolist()
    t = torch.full((4,), float(r + 1))
    comm.reduce(t, dst=0)
    res["reduce"] = t.tolist() if r == 0 else None
    t = torch.full((4,), float(r + 1))
    work = comm.all_reduce(t, async_op=True)
    work.wait()
    res["all_reduce"] = t.tolist()
    inp = torch.arange(2.0 * n) + r
    out = torch.empty(2)
    comm.reduce_scatter(out, inp)
    res["reduce_scatter"] = out.tolist()
    out = torch.empty(2 * n)
    comm.all_gather(out, torch.full((2,), float(r)))
    res["all_gather"] = out.tolist()
    if r == 0:
        comm.send(torch.tensor([5.0, 6.0]), dst=1)
    elif r == 1:
        t = torch.empty(2)
        comm.recv(t, src=0)
        res["recv"] = t.tolist()
    try:
        comm.reduce_scatter(torch.empty(3), torch.empty(2 * n))
    except ValueError as exc:
        res["error"] = str(exc)
    return res, comm.tracer.summary()


def test_every_traced_collective_computes_and_records(clusters):
    n = 3
    results = clusters(n).run(every_collective)
    for r, (res, summary) in enumerate(results):
        assert res["broadcast"] == [1.0] * 4
        assert res["all_reduce"] == [6.0] * 4
        assert res["reduce_scatter"] == [sum(2 * r + k + q for q in range(n)) for k in range(2)]
        assert res["all_gather"] == [float(q) for q in range(n) for _ in range(2)]
        assert "pad it" in res["error"]
        # the tracer: payload bytes and what the ring model says this rank sends
        assert summary["all_reduce"] == pytest.approx(
            {"calls": 1, "bytes": 16, "sent_bytes": 2 * 2 / 3 * 16, "seconds": summary["all_reduce"]["seconds"]})
        assert summary["reduce_scatter"]["bytes"] == 4 * 2 * n
        assert summary["reduce_scatter"]["sent_bytes"] == pytest.approx(2 / 3 * 24)
        assert summary["all_gather"]["sent_bytes"] == pytest.approx(2 / 3 * 24)
        assert summary["broadcast"]["sent_bytes"] == (0 if r == 0 else 16)  # chain 1 -> 2 -> 0
    assert results[0][0]["reduce"] == [6.0] * 4
    assert results[1][0]["recv"] == [5.0, 6.0]
    assert results[0][1]["send"]["sent_bytes"] == 8 and results[1][1]["recv"]["sent_bytes"] == 0


def sub_communicators():
    world = Comm()
    group = dist.new_group([1, 2])
    if world.rank not in (1, 2):
        return None
    sub = world.sub(group, "pair")
    t = torch.tensor([float(world.rank)])
    sub.all_reduce(t)
    if sub.rank == 0:
        sub.send(torch.tensor([9.0]), dst=1)  # group rank 1 = world rank 2
        got = None
    else:
        got = torch.empty(1)
        sub.recv(got, src=0)
        got = got.item()
    return sub.rank, sub.global_rank(1), t.item(), got, [e.group for e in world.tracer.events]


def test_sub_communicators_use_group_ranks_and_share_the_tracer(clusters):
    out = clusters(3).run(sub_communicators)
    assert out[0] is None
    assert out[1] == (0, 2, 3.0, None, ["pair", "pair"])
    assert out[2] == (1, 2, 3.0, 9.0, ["pair", "pair"])


def test_ring_model_bytes():
    assert ring_sent_bytes("all_reduce", 1000, 4) == 1500
    assert ring_sent_bytes("all_gather", 1000, 4) == 750
    assert ring_sent_bytes("all_reduce", 1000, 1) == 0
    assert ring_sent_bytes("broadcast", 10, 4, rank=3, root=0) == 0
    assert ring_sent_bytes("reduce", 10, 4, rank=0, root=0) == 0
    with pytest.raises(ValueError, match="unknown op"):
        ring_sent_bytes("alltoall", 10, 2)


def _waited_twice():
    comm = Comm()
    out = torch.zeros(2)
    work = comm.reduce_scatter(out, torch.ones(2 * comm.size) * (comm.rank + 1), async_op=True)
    work.wait()
    first = out.tolist()
    out.div_(2)  # what is done to the output after the wait stays
    work.wait()
    return first, out.tolist()


def test_a_handle_waited_on_twice_leaves_what_was_done_after_the_first_wait(clusters):
    """gloo's reduce-scatter copies its result into the output at every wait() of torch's handle
    (NCCL's does not): Comm's handle waits on it once, so code that changes the output after its
    wait (a ZeRO-2 end_of_backward) runs alike on CPUs and GPUs."""
    for first, after in clusters(2).run(_waited_twice):
        assert first == [3.0, 3.0] and after == [1.5, 1.5]
