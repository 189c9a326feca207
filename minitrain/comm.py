"""Traced collectives and a ring all-reduce built from send/recv (lesson 01).

A :class:`Comm` is a communicator in the MPI sense: one process group plus a :class:`Tracer` that
records every call and the bytes this rank puts on the wire under the ring algorithms of the cost
model (:func:`ring_sent_bytes`).  Every technique in ``minitrain.parallel`` is handed a ``Comm``
(never a global), so the tracer sees every byte it moves; ``comm.sub(group)`` is a sub-group's
communicator sharing the tracer, and ``comm.untraced`` the same one for calls that are not training
traffic (a metric, a synchronisation).  :func:`ring_all_reduce` is the ring written out with
point-to-point sends (Patarasuk and Yuan, 2009, "Bandwidth Optimal All-reduce Algorithms for
Clusters of Workstations"; Li et al., 2020, "PyTorch Distributed").
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from .device import HostTensorError, group_device, now, taint_of

#: The environment variable that sends every point-to-point message with tag 0 (see
#: :meth:`Comm.wire_tag`).
P2P_TAG0_ENV = "MINITRAIN_P2P_TAG0"

__all__ = ["Event", "Tracer", "Comm", "ring_all_reduce", "backend_all_reduce", "all_reduce_coalesced",
           "ring_sent_bytes", "loopback_tx_bytes", "written_bytes", "P2P_TAG0_ENV"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the first names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def written_bytes() -> int | None:
    """Bytes this process has written so far — to files, pipes and sockets alike — from the
    kernel's count (Linux's /proc/self/io, ``wchar``).  Across some collectives of a CPU run it
    is what this rank's backend handed its sockets, whatever else the machine sends; ``None``
    where there is no /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def loopback_tx_bytes() -> int | None:
    """Bytes sent so far on this machine's loopback interface, from the kernel's counters (Linux).

    All ranks of a CPU run talk over loopback, so the difference across some collectives is what
    the backend really put on the wire (plus a little TCP overhead and any other local traffic).
    ``None`` where there is no /proc/net/dev.
    """
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])
    except OSError:
        pass
    return None


def ring_sent_bytes(op: str, nbytes: int, n: int, rank: int = 0, root: int = 0) -> float:
    """Bytes one rank sends for ``op`` on ``n`` ranks under the ring model (lesson 01).

    For a payload of B bytes (what the tracer records as ``bytes``; ``sent_bytes`` is this):

    ====================  ===================  ====================================================
    op                    payload (``bytes``)  sent by each rank (``sent_bytes``)
    ====================  ===================  ====================================================
    all_reduce            B                    2(N-1)/N · B   (reduce-scatter, then all-gather)
    reduce_scatter        B (the full input)   (N-1)/N · B
    all_gather            B (the full output)  (N-1)/N · B
    broadcast / reduce    B                    B on every rank but the last of the chain / the root
    send / recv           B                    B / 0
    ====================  ===================  ====================================================

    ``broadcast`` and ``reduce`` are modelled as a chain around the ring: a broadcast starts at the
    root and stops at the rank before it; a reduce starts after the root and ends at it.
    """
    if op == "send":
        return float(nbytes)
    if n == 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    if op == "broadcast":
        return 0.0 if rank == (root - 1) % n else float(nbytes)
    if op == "reduce":
        return 0.0 if rank == root else float(nbytes)
    raise ValueError(f"unknown op {op!r}")


@dataclass(kw_only=True)
class Event:
    """One traced call on one rank (built with keywords: ``Event(op="send", bytes=..., ...)``)."""

    op: str
    bytes: int = 0
    sent_bytes: float = 0.0
    start: float = 0.0
    end: float = 0.0
    group: str = ""
    peer: int | None = None
    tag: str = ""
    # what the projection (minitrain.planning.projection) replays: issue order, asynchronous issue and wait
    id: int = -1                      # issue order on this rank
    async_op: bool = False
    returned: float | None = None     # when the issuing call returned (asynchronous calls)
    wait_start: float | None = None   # asynchronous: when this rank began to wait for it
    wait_end: float | None = None     # ... and when that wait returned
    ranks: tuple = ()                 # the group's global ranks (peer and root index it)
    channel: int = 0                  # point to point: the wire tag a send and its receive share
    root: int = 0                     # broadcast / reduce: the root's group rank
    traced: bool = True               # False: a call through ``comm.untraced`` (a metric, a
    #                                   barrier): not training traffic

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Tracer:
    """Records every call a :class:`Comm` makes on this rank.  ``enabled=False`` pauses recording."""

    events: list[Event] = field(default_factory=list)
    enabled: bool = True
    t0: float = field(default_factory=now)
    #: while ``recording`` (:func:`minitrain.planning.recording.recording` sets it, for the
    #: projection): (time, kind, value) marks — "step"/"step_end" around each training step, and the
    #: forwards', backwards' and optimizer steps' edges — and the calls made through
    #: ``comm.untraced`` (not training traffic, so kept apart from ``events``)
    marks: list = field(default_factory=list)
    untraced: list[Event] = field(default_factory=list)
    recording: bool = False
    _ids: itertools.count = field(default_factory=itertools.count, repr=False)

    def record(self, event: Event) -> None:
        """Keep ``event``: in ``events``, or, for an untraced call, in ``untraced`` while
        recording."""
        if not self.enabled:
            return
        if event.traced:
            self.events.append(event)
        elif self.recording:
            self.untraced.append(event)

    def next_id(self) -> int:
        return next(self._ids)

    def mark(self, kind: str, value=None) -> None:
        """Note an instant (a step's start, an optimizer step's end...) while recording."""
        if self.recording and self.enabled:
            self.marks.append((now(), kind, value))

    def clear(self) -> None:
        self.events.clear()
        self.marks.clear()
        self.untraced.clear()
        self.t0 = now()

    def export(self) -> dict:
        """Everything recorded, as plain data (what :mod:`minitrain.planning.projection` replays)."""
        keys = ("op", "bytes", "start", "end", "group", "peer", "tag", "id", "async_op", "returned",
                "wait_start", "wait_end", "ranks", "channel", "root", "traced")
        return {"events": [{k: getattr(e, k) for k in keys} for e in self.events + self.untraced],
                "marks": list(self.marks)}

    @contextmanager
    def paused(self):
        """Calls inside this block are not recorded at all (e.g. gathering the trained weights)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def summary(self) -> dict:
        """``{op: {"calls", "bytes", "sent_bytes", "seconds"}}`` plus a ``"total"`` row."""
        rows: dict = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0, "seconds": 0.0})
        for e in self.events:
            for key in (e.op, "total"):
                row = rows[key]
                row["calls"] += 1
                row["bytes"] += e.bytes
                row["sent_bytes"] += e.sent_bytes
                row["seconds"] += e.seconds
        return {k: dict(v) for k, v in rows.items()}

    def timeline(self) -> list[dict]:
        """Events as dicts with times relative to the tracer's start (for plots)."""
        return [dict(op=e.op, bytes=e.bytes, start=e.start - self.t0, end=e.end - self.t0,
                     group=e.group, peer=e.peer, tag=e.tag) for e in self.events]


#: per thread: > 0 while a Comm call is running (what it calls on torch.distributed is that call's
#: own; the course's guards tell such calls from a learner's direct ones by it)
_inside = threading.local()


@contextmanager
def _one_call():
    """While a Comm call runs what it calls on torch.distributed (counted per thread in
    ``_inside.depth``)."""
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


class _TracedWork:
    """Wraps an async ``Work`` handle, waited on once however often ``wait()`` is called; the
    event is recorded then.

    Its end time is when the op really completed where the backend tells (gloo's collectives: the
    work's future completes when the data has arrived), else when it was waited on (gloo's
    point-to-point; NCCL, whose futures complete when the work is queued, and whose ``wait()``
    makes the current stream wait: :func:`minitrain.device.now` then reads the time the
    collective was done) — so timelines show true overlap.
    """

    def __init__(self, work, on_done, host_future: bool = True):
        self._work, self._on_done, self._done, self._end = work, on_done, False, None
        self.end: float | None = None  # when the op completed, once waited on
        self.wait_start: float | None = None  # when wait() was first called
        if host_future:
            try:
                work.get_future().add_done_callback(self._completed)
            except (AttributeError, RuntimeError):
                pass

    def _completed(self, _fut) -> None:
        self._end = now()

    def wait(self):
        if self.wait_start is None:
            self.wait_start = now()
        if self._work is not None and not self._done:
            # the backend's handle is waited on once: gloo's reduce-scatter copies its result
            # into the output at every wait(), which would undo what was done to the output
            # after the first (NCCL's would not) — so the same code runs alike on both
            self._work.wait()
        if not self._done:
            self._done = True
            returned = now()
            self.end = self._end if self._end is not None else returned
            self._on_done(self.end, self.wait_start, returned)
        return True

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


class Comm:
    """A process group and a tracer: the only way strategies in minitrain communicate.

    Ranks passed to a ``Comm`` (``dst``, ``src``, ``peer``) are ranks *inside its group*, as in MPI.

    Arguments:
        group: a ``torch.distributed`` process group (``None``: the default, whole-world group).
        tracer: where calls are recorded (a new one if not given).
        name: label for the group in the trace (``"world"``, ``"dp"``, ``"tp"``...).
        traced: False for calls that are not training traffic (see :attr:`untraced`).
    """

    def __init__(self, group=None, tracer: Tracer | None = None, name: str = "world",
                 traced: bool = True):
        self.group = group
        self.tracer = tracer if tracer is not None else Tracer()
        self.name = name
        self.traced = traced
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.ranks = tuple(range(dist.get_world_size()) if group is None
                           else dist.get_process_group_ranks(group))
        #: where this group's tensors must live: the rank's GPU under NCCL, else the CPU
        self.device = group_device(group)

    def sub(self, group, name: str) -> "Comm":
        """A communicator over ``group`` that records into the same tracer."""
        return Comm(group, self.tracer, name, self.traced)

    @cached_property
    def untraced(self) -> "Comm":
        """This communicator for calls that are not training traffic — a metric's all-reduce, a
        barrier: ``comm.untraced.all_reduce(loss)``.  They stay out of the tracer's ``events``
        (and so out of its byte summary, which the lessons compare with the cost model); while
        recording for the projection they are kept in ``tracer.untraced``, with ``traced=False``
        and the group ``"untraced"``, because they make the ranks wait for each other."""
        return self if not self.traced else Comm(self.group, self.tracer, self.name, traced=False)

    def global_rank(self, group_rank: int) -> int:
        """The world rank of this group's rank ``group_rank``."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size})"

    # -- recording ----------------------------------------------------------------------------------

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        """Every tensor of a call is on this group's device, and none was made without one
        (:class:`minitrain.device.HostTaint`, a CPU test mode): on NCCL a CPU tensor would stop
        the run."""
        for t in tensors:
            if t.device.type != self.device.type:
                raise ValueError(
                    f"{op} on group {self.name!r}: a tensor on {t.device}, but this group's "
                    f"backend runs on {self.device.type}; make it with device=comm.device (or "
                    f".to(comm.device) first)")
            where = taint_of(t)
            if where is not None:
                raise HostTensorError(
                    f"{op} on group {self.name!r}: the tensor was made without a device ({where}); "
                    "on a GPU it would be a CPU tensor handed to NCCL; give its factory "
                    "device=comm.device")

    def _record(self, op, nbytes, *, peer=None, root=0, async_op=False, tag="", channel=0,
                sent=None):
        """The start of a traced call: returns ``done(end, wait_start, wait_end, returned)``,
        which records its event."""
        start = now()
        if sent is None:
            sent = ring_sent_bytes(op, nbytes, self.size, self.rank, root)
        ident = self.tracer.next_id()

        def done(end, wait_start=None, wait_end=None, returned=None):
            self.tracer.record(Event(
                op=op, bytes=nbytes, sent_bytes=sent, start=start, end=end, peer=peer, id=ident,
                group=self.name if self.traced else "untraced",
                tag=tag or ("" if self.traced else "untraced"), async_op=async_op,
                returned=returned, wait_start=wait_start, wait_end=wait_end, ranks=self.ranks,
                channel=channel, root=root, traced=self.traced))
        return done

    def _traced(self, op, nbytes, call, *, peer=None, root=0, async_op=False, tag="", channel=0,
                tensors=(), sent=None):
        self._check(op, *tensors)
        done = self._record(op, nbytes, peer=peer, root=root, async_op=async_op, tag=tag,
                            channel=channel, sent=sent)
        with _one_call():
            work = call()
        if async_op:
            return self._handle(work, done, now())
        done(now())
        return None

    def _handle(self, work, done, returned: float) -> "_TracedWork":
        """An asynchronous call's handle, which records the call's event once waited on (its
        completion time from the work's future where the backend's future tells it: gloo)."""
        return _TracedWork(work, lambda end, ws, we: done(end, ws, we, returned),
                           host_future=self.device.type == "cpu")

    # -- point to point -----------------------------------------------------------------------------

    def wire_tag(self, channel: int) -> int:
        """The tag a message on ``channel`` goes with.  NCCL ignores tags: it matches a pair's
        messages in the order they were posted.  ``MINITRAIN_P2P_TAG0=1`` sends every message
        with tag 0, so that gloo matches the same way and a CPU run shows what NCCL would do."""
        return 0 if os.environ.get(P2P_TAG0_ENV, "") not in ("", "0") else channel

    def exchange(self, sends=(), recvs=(), tag: str = "") -> list:
        """Post point-to-point sends and receives together, as one batch
        (``torch.distributed.batch_isend_irecv``): ``sends`` and ``recvs`` are ``(tensor, peer)``
        or ``(tensor, peer, channel)`` with group ranks.  Returns one handle per message, sends
        first; ``wait()`` each.

        NCCL runs a pair's messages in the order they were posted, on one stream: a rank that
        sends and then receives waits for its peer to receive first, and two peers that both send
        first wait for each other once a message outgrows NCCL's buffers.  Posted as one batch,
        the sends and receives run together, so every exchange in the package goes through
        here."""
        items = [("send", *m) for m in sends] + [("recv", *m) for m in recvs]
        if not items:
            return []
        ops, dones = [], []
        for kind, t, peer, *rest in items:
            channel = rest[0] if rest else 0
            self._check(kind, t)
            ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t,
                                  self.global_rank(peer), self.group, self.wire_tag(channel)))
            dones.append(self._record(kind, _nbytes(t), peer=peer, async_op=True, tag=tag,
                                      channel=channel))
        with _one_call():
            works = dist.batch_isend_irecv(ops)
        returned = now()
        return [self._handle(w, d, returned) for w, d in zip(works, dones)]

    def send(self, tensor: torch.Tensor, dst: int, tag: str = "", channel: int = 0) -> None:
        """Blocking send to group rank ``dst``.  ``channel`` is the wire tag (see
        :meth:`wire_tag`); ``tag`` is only the trace's label.  The package's own exchanges use
        :meth:`exchange`; this and :meth:`recv`, :meth:`isend`, :meth:`irecv` are MPI's calls, as
        a learner writes them."""
        self._traced("send", _nbytes(tensor), lambda: dist.send(
            tensor, self.global_rank(dst), group=self.group, tag=self.wire_tag(channel)),
            peer=dst, tag=tag, channel=channel, tensors=(tensor,))

    def recv(self, tensor: torch.Tensor, src: int | None, tag: str = "", channel: int = 0) -> int:
        """Blocking receive from group rank ``src`` — or, with ``src=None``, from whichever rank's
        message on ``channel`` comes first (a parameter server's inbox; gloo only: NCCL has no
        receive from any source).  Returns the sender."""
        if src is None and self.device.type != "cpu":
            raise ValueError("a receive from any source (src=None) needs gloo: NCCL matches a "
                             "message only with a named sender; name src, or run on gloo")
        sender = []
        self._traced("recv", _nbytes(tensor), lambda: sender.append(dist.recv(
            tensor, None if src is None else self.global_rank(src), group=self.group,
            tag=self.wire_tag(channel))), peer=src, tag=tag, channel=channel, tensors=(tensor,))
        got = sender[0] if sender and sender[0] is not None and sender[0] >= 0 else src
        if src is None and self.group is not None:
            got = dist.get_group_rank(self.group, got)
        if src is None and self.traced and self.tracer.enabled and self.tracer.events:
            self.tracer.events[-1].peer = got
        return got

    def isend(self, tensor: torch.Tensor, dst: int, tag: str = "", channel: int = 0):
        return self._traced("send", _nbytes(tensor), lambda: dist.isend(
            tensor, self.global_rank(dst), group=self.group, tag=self.wire_tag(channel)),
            peer=dst, async_op=True, tag=tag, channel=channel, tensors=(tensor,))

    def irecv(self, tensor: torch.Tensor, src: int, tag: str = "", channel: int = 0):
        return self._traced("recv", _nbytes(tensor), lambda: dist.irecv(
            tensor, self.global_rank(src), group=self.group, tag=self.wire_tag(channel)),
            peer=src, async_op=True, tag=tag, channel=channel, tensors=(tensor,))

    # -- collectives --------------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False, tag: str = ""):
        return self._traced("broadcast", _nbytes(tensor), lambda: dist.broadcast(
            tensor, self.global_rank(src), group=self.group, async_op=async_op),
            root=src, async_op=async_op, tag=tag, tensors=(tensor,))

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op=dist.ReduceOp.SUM, tag: str = ""):
        return self._traced("reduce", _nbytes(tensor), lambda: dist.reduce(
            tensor, self.global_rank(dst), op=op, group=self.group),
            root=dst, tag=tag, tensors=(tensor,))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   tag: str = ""):
        return self._traced("all_reduce", _nbytes(tensor), lambda: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=async_op), async_op=async_op, tag=tag,
            tensors=(tensor,))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                       async_op: bool = False, tag: str = ""):
        """``output`` (numel n) gets this rank's 1/N slice of the sum of every rank's ``input``."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"output.numel() x world size = {output.numel() * self.size}; pad it")
        return self._traced("reduce_scatter", _nbytes(input), lambda: _reduce_scatter_single(
            output, input, op=op, group=self.group, async_op=async_op), async_op=async_op, tag=tag,
            tensors=(output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   tag: str = ""):
        """``output`` (numel N·n) gets every rank's ``input`` (numel n), concatenated by rank."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"input.numel() x world size = {input.numel() * self.size}")
        return self._traced("all_gather", _nbytes(output), lambda: _all_gather_single(
            output, input, group=self.group, async_op=async_op), async_op=async_op, tag=tag,
            tensors=(output, input))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], tag: str = "") -> torch.Tensor:
        """``torch.distributed.all_to_all_single`` with uneven splits (rows to and from each
        rank); returns ``output``.  Traced as its payload (``input``'s bytes) and what this rank
        sends: every row but its own."""
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        sent = (sum(input_splits) - input_splits[self.rank]) * row
        self._traced("all_to_all", _nbytes(input), lambda: dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group), tag=tag,
            tensors=(output, input), sent=sent)
        return output

    def barrier(self) -> None:
        self._traced("barrier", 0, lambda: dist.barrier(group=self.group))


def backend_all_reduce(tensor: torch.Tensor, comm: Comm, tag: str = "") -> torch.Tensor:
    """The backend's all-reduce in the shape of the ``ring_all_reduce`` seam: sums ``tensor`` over
    ``comm``'s ranks (in place) and returns it.  :func:`ring_all_reduce` has the same shape."""
    comm.all_reduce(tensor, tag=tag)
    return tensor


@torch.no_grad()
def all_reduce_coalesced(tensors: list, comm: Comm, tag: str = "", divide_by: int = 1,
                         ring_all_reduce=None) -> None:
    """Sum ``tensors`` over ``comm``'s ranks in place with one all-reduce of them flattened
    together (one message instead of one per tensor), then divide by ``divide_by``.

    ``ring_all_reduce(flat, comm) -> the sum`` does the summing: the package's
    :func:`ring_all_reduce`, or a learner's ring (lesson 01's exercise); None:
    :func:`backend_all_reduce` (traced as ``tag``)."""
    if not tensors or comm.size == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if ring_all_reduce is None:
        summed = backend_all_reduce(flat, comm, tag)
    else:
        summed = ring_all_reduce(flat, comm)
    if divide_by != 1:
        summed = summed.div(divide_by)
    for t, piece in zip(tensors, summed.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


#: Sub-chunk size the ring pipelines in (bytes): a chunk of C bytes goes as ceil(C / this) pieces
#: (at most :data:`RING_MAX_PIECES`), so the next piece travels while the last one is being added.
RING_PIECE_BYTES = 2 << 20
RING_MAX_PIECES = 16


def _pieces(chunk: torch.Tensor, pieces: int | None) -> int:
    if pieces is None:
        nbytes = chunk.numel() * chunk.element_size()
        pieces = min(RING_MAX_PIECES, max(1, -(-nbytes // RING_PIECE_BYTES)))
    return max(1, min(pieces, chunk.numel()))


def ring_all_reduce(tensor: torch.Tensor, comm: Comm, record: list | None = None,
                    pieces: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ``comm``'s ranks in place, with a ring of sends and receives.

    The flat tensor is cut into N chunks (``tensor_split``: sizes may differ by one element).
    Reduce-scatter: in step s, rank r sends chunk (r - s) to its right neighbour and adds the chunk
    (r - s - 1) it receives from its left one; after N-1 steps rank r holds the full sum of chunk
    (r + 1).  All-gather: N-1 more steps pass the finished chunks around the ring.  Each rank sends
    2(N-1)/N of the tensor in total, whatever N is: that is why the ring is bandwidth-optimal.

    Pipelined, as NCCL and gloo do: each chunk travels as ``pieces`` sub-chunks (default: about
    2 MiB each, one for small tensors).  Piece j of step s+1 is sent, and its receive posted, in
    one exchange (:meth:`Comm.exchange`) as soon as piece j of step s has arrived and been added,
    so sending, receiving and adding overlap instead of taking turns.

    ``record``, if given, receives this rank's chunks after every step (the ring widget of
    lesson 01 draws them).
    """
    n, r = comm.size, comm.rank
    if n == 1:
        return tensor
    flat = tensor.data.view(-1) if tensor.is_contiguous() else tensor.data.reshape(-1)
    chunks = list(torch.tensor_split(flat, n))
    k = _pieces(chunks[0], pieces)
    parts = [list(torch.tensor_split(c, k)) for c in chunks]
    right, left = (r + 1) % n, (r - 1) % n
    steps = [("reduce-scatter", s) for s in range(n - 1)] + [("all-gather", s) for s in range(n - 1)]
    # step t: send chunk (r - s) (reduce-scatter) or (r - s + 1) (all-gather), receive the one before
    send_of = [(r - s + (phase == "all-gather")) % n for phase, s in steps]
    scratch = [[torch.empty_like(p) for p in parts[0]] for _ in range(2)]  # incoming partial sums
    _snapshot(record, "start", 0, None, None, chunks)

    def into_of(t: int, j: int) -> torch.Tensor:
        recv_i = (send_of[t] - 1) % n
        # partial sums land in scratch (then added); finished pieces straight in place, unless a
        # snapshot of the step before must not see them yet
        return (scratch[t % 2][j][:parts[recv_i][j].numel()]
                if steps[t][0] == "reduce-scatter" or record is not None else parts[recv_i][j])

    def post(t: int, js) -> list:
        """Step t's pieces js: each sent right and received from the left in one exchange."""
        intos = [into_of(t, j) for j in js]
        works = comm.exchange([(parts[send_of[t]][j], right, j) for j in js],
                              [(into, left, j) for into, j in zip(intos, js)], tag="ring")
        sends.extend(works[:len(js)])
        return list(zip(works[len(js):], intos))

    sends: list = []
    recvs = post(0, range(k))
    for t, (phase, s) in enumerate(steps):
        recv_i = (send_of[t] - 1) % n
        following = []
        for j in range(k):
            work, into = recvs[j]
            work.wait()
            if phase == "reduce-scatter":
                parts[recv_i][j].add_(into)
            elif into is not parts[recv_i][j]:
                parts[recv_i][j].copy_(into)
            if t + 1 < len(steps) and record is None:
                following += post(t + 1, [j])  # piece j of the next step: the one just received
        if record is not None:
            _snapshot(record, phase, s, send_of[t], recv_i, chunks)
            following = post(t + 1, range(k)) if t + 1 < len(steps) else []
        recvs = following
    for work in sends:
        work.wait()
    if not tensor.is_contiguous():
        tensor.data.copy_(flat.view_as(tensor))
    return tensor


def _snapshot(record, phase, step, sent, received, chunks) -> None:
    if record is not None:
        record.append(dict(phase=phase, step=step, sent=sent, received=received,
                           chunks=[c.tolist() for c in chunks]))
