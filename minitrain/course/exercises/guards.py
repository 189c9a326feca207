"""What guards a learner's function: wrappers the checkers put around it, so that the techniques in
:mod:`minitrain.parallel` call every function in a seam the same way, the package's or the learner's.

A seam has one shape (``ring_all_reduce(tensor, comm) -> the sum``, ``zero3_hook(unit, comm,
moment)``, ...).  A learner's function may be looser than that shape — a ring that sums in place and
returns nothing, a top-k that returns lists — or may do what would crash a rank or silently corrupt a
run — a collective into ZeRO-3's freed buffer, a bucket's all-reduce never waited for.  The wrappers
here make the first fit the shape and turn the second into an error that says what happened, before
the function goes into its seam (:func:`plug`, used by :func:`~minitrain.course.exercises.inside.inside` and
:func:`~minitrain.course.exercises.inside.your_minitrain`).  The spies the checkers watch a learner's
function through (a communicator that notes every all-reduce, a work handle that notes its wait) are
here too.  Each wrapper is a small class, so that it travels to the ranks with the learner's function.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ...comm import Comm

__all__ = ["ReturnsTheTensor", "TopkAsTensors", "GuardedUnit", "GuardedZero3Hook", "WatchedWork",
           "WatchingComm", "GuardedGradReady", "GuardedEndOfBackward", "QuietMeanLoss",
           "DistCall", "dist_calls", "plug"]


# --------------------------------------------------------------------------------------------------
# What really went over the wire: every torch.distributed call, the tracer's or not
# --------------------------------------------------------------------------------------------------

#: the torch.distributed functions a learner may call (directly, or through a Comm)
WATCHED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
           "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send",
           "recv", "isend", "irecv", "barrier", "_all_gather_base", "_reduce_scatter_base",
           "batch_isend_irecv")
_NAMES = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
          "all_to_all_single": "all_to_all", "isend": "send", "irecv": "recv"}


class DistCall:
    """One call of a ``torch.distributed`` function seen by :func:`dist_calls`: ``op`` (the
    collective's name: ``isend`` is ``send``, ``all_gather_into_tensor`` is ``all_gather``),
    ``function`` (the name called), ``numel`` and ``nbytes`` of its first tensor argument (for a
    list argument, of all its tensors), ``group`` (the group's global ranks), ``member`` (whether
    this rank is in it: torch skips a collective on a group the rank is not in), ``direct`` (True
    when it did not go through a :class:`~minitrain.comm.Comm`, so the tracer never saw it),
    ``sent`` (for a send: a copy of the values sent, at the moment they were sent), ``peer``,
    ``reduce_op`` (a reduction's op by name: ``"SUM"``, ``"MAX"``, ...) and, for an asynchronous
    call, ``touched``: which of its tensors were written in place before its handle's ``wait()``
    (index -> how, :func:`how_written`)."""

    def __init__(self, function, args, kwargs, direct, keep_inputs: bool = False):
        self.function, self.op, self.direct = function, _NAMES.get(function, function), direct
        tensors = [a for a in args if torch.is_tensor(a)]
        lists = [t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
        first = tensors[:1] or lists
        self.numel = sum(t.numel() for t in first)
        self.nbytes = sum(t.numel() * t.element_size() for t in first)
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args[1:] if type(a).__name__ == "ProcessGroup"), None)
        try:
            world = dist.get_world_size()
            self.group = tuple(range(world) if group is None
                               else dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError, AttributeError):
            self.group = ()
        self.member = dist.get_rank() in self.group if self.group else True
        self.sent = tensors[0].detach().clone() if self.op == "send" and tensors else None
        self.ptr = tensors[0].data_ptr() if tensors else None
        self.tensors = tensors + lists  # its tensor arguments
        #: with ``keep_inputs``: copies of them as the call began (an in-place collective's input)
        self.inputs = [t.detach().clone() for t in self.tensors] if keep_inputs else None
        self.op_arg = kwargs.get("op", next(
            (a for a in args[1:] if type(a).__name__ in ("RedOpType", "ReduceOp")), None))
        self.reduce_op = _reduce_op_name(self.op_arg) if self.op in _REDUCING else None
        self.waited = None  # an asynchronous call's handle: whether wait() was called on it
        self.versions = None  # an asynchronous call's tensors' versions when it returned
        self.touched = None  # which were written in place before its wait(): index -> how
        peer = kwargs.get("dst", kwargs.get("src"))
        if peer is None and self.op in ("send", "recv") and len(args) > 1 and \
                isinstance(args[1], int):
            peer = args[1]
        self.peer = peer

    def __repr__(self) -> str:
        return f"DistCall({self.function}, numel={self.numel}, direct={self.direct})"


#: the collectives that take a reduction op (``op=``; SUM when none is given)
_REDUCING = ("all_reduce", "reduce", "reduce_scatter")


def _reduce_op_name(op) -> str:
    """``"SUM"``, ``"MAX"``, ... for a ``torch.distributed.ReduceOp`` (SUM when ``op`` is None)."""
    if op is None:
        return "SUM"
    for name in ("SUM", "MAX", "MIN", "PRODUCT", "AVG", "BAND", "BOR", "BXOR"):
        try:
            if op == getattr(dist.ReduceOp, name):
                return name
        except (AttributeError, TypeError):
            continue
    return str(getattr(op, "name", op))


class InPlaceNames(TorchFunctionMode):
    """While it is active (``with InPlaceNames():`` around a learner's code), the last in-place
    write to each tensor memory is noted by name — ``t /= n`` is ``div_`` with ``n``, ``t[i] = x``
    is ``__setitem__``, ``torch.mul(a, b, out=t)`` is ``mul`` (out=) — so that a check that saw a
    tensor change (:func:`changed`) can say how (:func:`how_written`)."""

    active: list = []  # the modes entered, innermost last

    def __init__(self):
        super().__init__()
        self.last: dict = {}  # storage address -> (function name, its second argument)

    def __enter__(self):
        InPlaceNames.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        InPlaceNames.active.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = kwargs.get("out") if torch.is_tensor(kwargs.get("out")) else (
            args[0] if args and torch.is_tensor(args[0]) and (
                name == "__setitem__" or name.startswith("__i")
                or (name.endswith("_") and not name.startswith("_"))) else None)
        if target is not None:
            try:
                self.last[target.untyped_storage().data_ptr()] = (
                    name + (" (out=)" if "out" in kwargs else ""),
                    args[1] if len(args) > 1 else None)
            except (RuntimeError, AttributeError):
                pass
        return func(*args, **kwargs)


def how_written(tensor: torch.Tensor, n: int) -> str:
    """How ``tensor`` was last written in place, in words, from the active :class:`InPlaceNames`:
    ``"divided by N = 2 (div_)"``, ``"written in place (copy_)"``; ``"written in place"`` when no
    mode saw it."""
    last = None
    for mode in reversed(InPlaceNames.active):
        last = mode.last.get(tensor.untyped_storage().data_ptr())
        if last is not None:
            break
    if last is None:
        return "written in place"
    name, arg = last
    number = arg.item() if torch.is_tensor(arg) and arg.numel() == 1 else arg
    if name in ("div_", "true_divide_", "__itruediv__", "__idiv__"):
        return (f"divided by N = {n} ({name})" if isinstance(number, (int, float)) and number == n
                else f"divided ({name})")
    if name in ("mul_", "__imul__") and isinstance(number, (int, float)) and number:
        return (f"divided by N = {n} (multiplied by 1/N, {name})"
                if abs(number * n - 1) < 1e-6 else f"multiplied ({name})")
    return f"written in place ({name})"


def versions(tensors) -> list:
    """The version counters of ``tensors``: an in-place write (``t /= n``, ``t.copy_(...)``, a
    write into a view) increments one; a collective running on the tensor does not."""
    return [t._version for t in tensors]


def changed(tensors, before) -> list:
    """The indices of ``tensors`` written in place since their :func:`versions` were ``before``."""
    return [k for k, (t, v) in enumerate(zip(tensors, before)) if t._version != v]


class _NotedWork:
    """A work handle that notes on its :class:`DistCall` that it was waited for, and which of the
    call's tensors were written in place while it was in flight (before this wait)."""

    def __init__(self, work, call):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        call = self._call
        if not call.waited and call.versions is not None:
            n = len(call.group) or 1
            call.touched = {k: how_written(call.tensors[k], n)
                            for k in changed(call.tensors, call.versions)}
        call.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def dist_calls(keep_inputs: bool = False):
    """While the block runs, note every call of a ``torch.distributed`` collective or point-to-point
    function on this rank (a list of :class:`DistCall`, yielded): those made through a
    :class:`~minitrain.comm.Comm` (the tracer's) and those made directly, which the tracer never
    sees — what a check must observe to know what really went over the wire.  ``keep_inputs``:
    each call keeps a copy of its tensors as it began (``inputs``; an all-reduce overwrites its
    input).  Restores the functions on exit."""
    from ...comm import _inside

    calls: list = []
    saved = {name: getattr(dist, name) for name in WATCHED if hasattr(dist, name)}

    def watch(name, fn):
        def call(*args, **kwargs):
            noted = None
            try:
                noted = DistCall(name, args, kwargs, not getattr(_inside, "depth", 0),
                                 keep_inputs)
                calls.append(noted)
            except Exception:  # noqa: BLE001 - noting a call must never break it
                pass
            out = fn(*args, **kwargs)
            if noted is not None and out is not None and hasattr(out, "wait"):
                noted.waited = False
                noted.versions = versions(noted.tensors)
                return _NotedWork(out, noted)
            return out
        return call

    for name, fn in saved.items():
        setattr(dist, name, watch(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def bypassed(calls: list, ops=None) -> list:
    """The calls of ``calls`` (from :func:`dist_calls`) that did not go through a Comm (the tracer
    never saw them), of ``ops`` (names, default any)."""
    return [c for c in calls if c.direct and (ops is None or c.op in ops)]


# --------------------------------------------------------------------------------------------------
# Fitting a looser function to its seam's shape
# --------------------------------------------------------------------------------------------------


class ReturnsTheTensor:
    """A ring ``fn(tensor, comm)`` that sums in place may return nothing (lesson 01 allows it): the
    seam's shape is ``(tensor, comm) -> the sum``, so the tensor is returned for it."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, tensor: torch.Tensor, comm) -> torch.Tensor:
        out = self.fn(tensor, comm)
        return tensor if out is None else out


class TopkAsTensors:
    """A top-k ``fn(grad, residual, k)`` may return its ``(indices, values, new_residual)`` as lists
    or arrays (lesson 03's check reads them so): the seam's shape is three tensors."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, grad: torch.Tensor, residual: torch.Tensor, k: int):
        indices, values, new_residual = self.fn(grad, residual, k)
        return torch.as_tensor(indices), torch.as_tensor(values), torch.as_tensor(new_residual)


# --------------------------------------------------------------------------------------------------
# ZeRO-3's hook: no collective into a freed buffer
# --------------------------------------------------------------------------------------------------


class GuardedUnit:
    """A ZeRO-3 unit as a learner's hook sees it: the package's
    :class:`~minitrain.parallel.fsdp_unit.Unit`, except that ``full`` cannot be replaced (the
    module's parameters are views of it) and, while it is freed, reading it raises — a collective
    into a tensor without memory would crash the rank."""

    def __init__(self, unit):
        object.__setattr__(self, "_unit", unit)

    @property
    def full(self) -> torch.Tensor:
        if not self._unit.gathered:
            raise RuntimeError(f"unit.full of {self._unit.name!r} has no memory now (it is freed): "
                               "unit.allocate() gives it memory (its contents undefined)")
        return self._unit.full

    def __getattr__(self, name: str):
        return getattr(self._unit, name)

    def __setattr__(self, name: str, value) -> None:
        if name == "full":
            raise AttributeError("unit.full cannot be replaced: the module's parameters are views of "
                                 "it; fill it instead")
        setattr(self._unit, name, value)

    def __repr__(self) -> str:
        return repr(self._unit)


class GuardedZero3Hook:
    """A learner's ``hook(unit, comm, moment)``, given a :class:`GuardedUnit`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, unit, comm, moment: str):
        return self.fn(GuardedUnit(unit), comm, moment)


# --------------------------------------------------------------------------------------------------
# DDP's hooks: watched all-reduces, and "did you wait?"
# --------------------------------------------------------------------------------------------------


class WatchedWork:
    """A work handle that notes when it is first waited for (``waited_at``; ``on_wait(time)`` is
    told too).  ``end`` is the wrapped handle's, where it has one."""

    def __init__(self, work, on_wait=None):
        self.work, self.on_wait = work, on_wait
        self.waited_at: float | None = None

    def wait(self):
        if self.waited_at is None:
            self.waited_at = time.perf_counter()
            if self.on_wait is not None:
                self.on_wait(self.waited_at)
        return self.work.wait()

    @property
    def waited(self) -> bool:
        return self.waited_at is not None

    @property
    def end(self):
        return getattr(self.work, "end", None)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class WatchingComm(Comm):
    """A communicator whose all-reduces and reduce-scatters are noted in ``launches``: when, of
    which bucket (``identify(tensor) -> (bucket index or None, gradients in it so far)``; a
    reduce-scatter's input), how many elements, blocking or not, when it was waited for
    (``"waited"``), and which of its tensors (``"tensors"``: name -> tensor) were written in place
    while it was in flight (``"touched"``: name -> how, :func:`how_written`)."""

    def __init__(self, launches: list, identify, group=None):
        super().__init__(group)
        self.launches, self.identify = launches, identify

    def _watch(self, op, tensor, async_op, call, tensors):
        slot, got = self.identify(tensor)
        launch = dict(time=time.perf_counter(), slot=slot, got=got, numel=tensor.numel(),
                      async_op=async_op, waited=None, work=None, op=op, tensors=tensors,
                      touched={})
        self.launches.append(launch)
        work = call()
        if not async_op:
            launch["waited"] = launch["time"]
            return work
        launch["work"] = work
        names = list(tensors)
        seen = versions(tensors.values())

        def on_wait(t):
            launch["waited"] = t
            for k in changed(list(tensors.values()), seen):
                launch["touched"][names[k]] = how_written(tensors[names[k]], self.size)
        return WatchedWork(work, on_wait=on_wait)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False, tag=""):
        return self._watch("all_reduce", tensor, async_op, lambda: super(WatchingComm, self)
                           .all_reduce(tensor, op=op, async_op=async_op, tag=tag),
                           {"bucket.buffer": tensor})

    def reduce_scatter(self, output, input, op=dist.ReduceOp.SUM, async_op=False, tag=""):
        swapped(output, input, self.size, "bucket.grad_shard", "bucket.buffer")
        return self._watch("reduce_scatter", input, async_op, lambda: super(WatchingComm, self)
                           .reduce_scatter(output, input, op=op, async_op=async_op, tag=tag),
                           {"bucket.grad_shard": output, "bucket.buffer": input})


def swapped(output, input, n: int, shard: str = "", whole: str = "") -> None:
    """Raise, saying what was passed, when ``reduce_scatter(output, input)`` got its two tensors
    the wrong way round: an output N times the input's size, where the output is one rank's
    1/N of the input.  ``shard``, ``whole``: what the two are called in the exercise."""
    if n > 1 and output.numel() == input.numel() * n:
        raise ValueError(
            f"comm.reduce_scatter(output, input) got an output of {output.numel()} elements and "
            f"an input of {input.numel()}: the output is N = {n} times the input, so the two "
            "arguments look swapped — the output (first) is this rank's 1/N shard"
            f"{', ' + shard if shard else ''}; the input (second) the whole tensor"
            f"{', ' + whole if whole else ''}")


class ShapeCheckedComm(Comm):
    """A communicator whose reduce-scatter says so when its output and input look swapped
    (:func:`swapped`), instead of asking for padding."""

    def reduce_scatter(self, output, input, op=dist.ReduceOp.SUM, async_op=False, tag=""):
        swapped(output, input, self.size)
        return super().reduce_scatter(output, input, op=op, async_op=async_op, tag=tag)


#: how each bucket collective is launched, by its word
_LAUNCH = {"all-reduce": "comm.all_reduce(bucket.buffer, async_op=True)",
           "reduce-scatter": "comm.reduce_scatter(bucket.grad_shard, bucket.buffer, async_op=True)"}


def _launched(bucket, comm) -> bool:
    """Whether the bucket's collective was started through the comm grad_ready got: DDP's
    :class:`~minitrain.parallel.data_parallel.BucketComm` and ZeRO-2's
    :class:`~minitrain.parallel.zero.ShardComm` note when (``launched_at``, on the comm or on the
    bucket; reset at each backward's start)."""
    return (getattr(comm, "launched_at", None) is not None
            or getattr(bucket, "launched_at", None) is not None)


class GuardedGradReady:
    """A learner's ``grad_ready(bucket, i, grad, comm)``; the handle it leaves in ``bucket.work`` is
    watched (:class:`WatchedWork`), for :class:`GuardedEndOfBackward`.  ``handles``: bucket index
    -> the handle it kept, or None for a bucket whose collective it started without keeping the
    handle in ``bucket.work`` (shared with :class:`GuardedEndOfBackward`, which empties it at each
    end of backward)."""

    def __init__(self, fn, handles: dict | None = None):
        self.fn = fn
        self.handles = {} if handles is None else handles

    def __call__(self, bucket, i, grad, comm):
        out = self.fn(bucket, i, grad, comm)
        if bucket.work is not None and not isinstance(bucket.work, WatchedWork):
            bucket.work = WatchedWork(bucket.work)
        if bucket.work is not None:
            self.handles[bucket.index] = bucket.work
        elif _launched(bucket, comm):
            self.handles.setdefault(bucket.index, None)
        return out


class GuardedEndOfBackward:
    """A learner's ``end_of_backward(buckets)``; once it returns, every bucket's collective (an
    ``word``: all-reduce for DDP, reduce-scatter for ZeRO-2) must have been launched, its handle
    kept in ``bucket.work`` and (where it was watched) waited for, or the optimizer would read a
    buffer that is not the mean.  ``handles``: :class:`GuardedGradReady`'s."""

    def __init__(self, fn, word: str = "all-reduce", handles: dict | None = None):
        self.fn, self.word = fn, word
        self.handles = {} if handles is None else handles

    def __call__(self, buckets):
        handles = dict(self.handles)
        self.handles.clear()
        out = self.fn(buckets)
        for b in buckets:
            work = b.work if b.work is not None else handles.get(b.index)
            if work is None and b.index in handles:
                raise RuntimeError(
                    f"bucket {b.index}'s {self.word} was launched during backward, but its handle "
                    "was not kept in bucket.work (None at the end of backward), so nobody can "
                    f"wait for it: keep the handle, bucket.work = {_LAUNCH[self.word]}, and wait "
                    "for it in end_of_backward")
            if work is None:
                raise RuntimeError(
                    f"bucket {b.index}'s {self.word} was never launched (bucket.work is None at "
                    "the end of backward): start it once the bucket's last gradient is in")
            if isinstance(work, WatchedWork) and not work.waited:
                raise RuntimeError(
                    f"bucket {b.index}'s {self.word} was launched but not waited for by the end "
                    "of backward: its sum may not have arrived when the optimizer reads it")
        return out


# --------------------------------------------------------------------------------------------------
# The debugging lab's mean loss inside a strategy
# --------------------------------------------------------------------------------------------------


class QuietMeanLoss:
    """A learner's ``mean_loss(loss) -> the mean over the ranks`` (lesson 01b) as a strategy's
    ``mean_loss`` seam: what it prints and torch's warnings are dropped (it runs every step), and
    what it returns — a one-element tensor or a number — is given back as a float."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, loss: torch.Tensor) -> float:
        import contextlib
        import io
        import warnings

        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.fn(loss)
        if out is None:
            raise TypeError("your mean_loss returned None: return the mean loss (a one-element "
                            "tensor)")
        return float(out.reshape(-1)[0]) if torch.is_tensor(out) else float(out)


# --------------------------------------------------------------------------------------------------
# Into the seam
# --------------------------------------------------------------------------------------------------


def _bucket_hooks(pair, word: str = "all-reduce"):
    grad_ready, end_of_backward = pair
    handles: dict = {}
    return (GuardedGradReady(grad_ready, handles),
            GuardedEndOfBackward(end_of_backward, word, handles))


def _shard_hooks(pair):
    return _bucket_hooks(pair, "reduce-scatter")


#: seam -> how a learner's function is wrapped before it goes in (the others go in as they are)
GUARDS = {
    "ring_all_reduce": ReturnsTheTensor,
    "topk_error_feedback": TopkAsTensors,
    "zero3_hook": GuardedZero3Hook,
    "bucket_hooks": _bucket_hooks,
    "zero2_hooks": _shard_hooks,
    "mean_loss": QuietMeanLoss,
}


def plug(seam: str, fn):
    """The learner's ``fn``, guarded as seam ``seam`` needs, ready for ``train(cfg, seams=...)``."""
    guard = GUARDS.get(seam)
    return fn if guard is None else guard(fn)
