"""Lesson 01: the ring all-reduce, and typical wrong rings."""

import torch

from answers import Answers


def ring(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):  # reduce-scatter
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i] += incoming
    for step in range(n - 1):  # all-gather
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i].copy_(incoming)
    return tensor


def ring_slow_but_right(tensor, comm):
    """Correct but not a ring: every rank sends its whole tensor to every other (passes; the
    report shows it sends (N-1)/N·... times more)."""
    n, r = comm.size, comm.rank
    mine = tensor.clone()
    works = [comm.isend(mine, p) for p in range(n) if p != r]
    for p in range(n):
        if p != r:
            incoming = torch.empty_like(mine)
            comm.recv(incoming, p)
            tensor += incoming
    for w in works:
        w.wait()
    return tensor


def ring_off_by_one(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i] += incoming
    for step in range(n - 1):  # all-gather: one chunk too far back
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i].copy_(incoming)
    return tensor


def ring_send_send(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        comm.send(chunks[send_i].contiguous(), right)  # blocks until the right one receives
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        chunks[recv_i] += incoming
    return tensor


def ring_without_all_gather(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i] += incoming
    return tensor


def ring_adds_into_the_sent_chunk(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (r - step) % n, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[send_i] += incoming  # the wrong chunk
    for step in range(n - 1):
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i].copy_(incoming)
    return tensor


def ring_with_all_reduce(tensor, comm):
    comm.all_reduce(tensor)
    return tensor


def ring_behind_the_tracers_back(tensor, comm):
    import torch.distributed as dist
    dist.all_reduce(tensor, group=comm.group)
    return tensor


def ring_that_only_receives(tensor, comm):
    comm.recv(torch.empty(1, dtype=tensor.dtype), (comm.rank - 1) % comm.size)
    return tensor


def ring_averages(tensor, comm):
    """Divides by N at the end (the mean, not the sum asked for)."""
    ring(tensor, comm)
    tensor /= comm.size
    return tensor


def ring_index_past_the_end(tensor, comm):
    """Forgets the modulo: rank N-1 asks for chunk N."""
    n, r = comm.size, comm.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_i, recv_i = r + step, (r - step - 1) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i] += incoming
    for step in range(n - 1):
        send_i, recv_i = (r + 1 - step) % n, (r - step) % n
        work = comm.isend(chunks[send_i].contiguous(), right)
        incoming = torch.empty_like(chunks[recv_i])
        comm.recv(incoming, left)
        work.wait()
        chunks[recv_i].copy_(incoming)
    return tensor


ANSWERS = {
    "ring_all_reduce": Answers(ring, [
        (ring_off_by_one, "some chunk was received into, or added to, the wrong place"),
        (ring_send_send, "Every rank is in a blocking send"),
        (ring_without_all_gather, "the all-gather phase must pass the finished chunks around"),
        (ring_adds_into_the_sent_chunk, "line 11 of your ring_adds_into_the_sent_chunk"),
        (ring_with_all_reduce, "build it from send/recv"),
        (ring_behind_the_tracers_back, "no send went through comm"),
        (ring_that_only_receives, "Every rank is receiving and none is sending"),
        (ring_averages, "the full sum 3 divided by 2"),
        (ring_index_past_the_end, "IndexError"),
    ]),
}

#: right answers other than the notebook's that must pass too (correct but slow: the report says so)
def ring_in_place_returns_nothing(tensor, comm):
    """Sums in place and returns nothing ("in place is fine"): the check's guard returns the tensor
    for it inside DDP, whose seam's shape is (tensor, comm) -> the sum."""
    ring(tensor, comm)


ALSO_RIGHT = {"ring_all_reduce": [ring_in_place_returns_nothing, ring_slow_but_right]}  # report(): the last
