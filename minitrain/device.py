"""Where a rank's tensors live and what time it is: the same code right on CPU ranks (gloo) and GPU
ranks (NCCL) (lesson 01).

NCCL takes CUDA tensors only, queues its work on a stream of its own and returns before that work
is done; gloo takes CPU tensors and returns when it is.  Three rules keep the package right on
both, each enforced by a test that runs on CPU (``tests/test_device_rules.py``):

- a tensor is made on a device: every factory (``torch.zeros``, ``torch.tensor``, ...) names its
  ``device=`` — :func:`group_device` says which a group's collectives run on — or derives from a
  tensor that has one (``x.new_zeros``, ``torch.zeros_like``); ``device="cpu"`` marks a host-only
  tensor (a step's counter, a checkpoint's metadata);
- time is read from :func:`now`: on a GPU it first waits for the work queued on the current stream,
  so a timestamp is when the work was done, not when it was queued;
- :class:`HostTaint` is a test mode for CPU runs, where every device is the CPU and a forgotten
  ``device=`` goes unnoticed: a tensor the package makes without a device is tainted, and it is an
  error when one reaches a collective or meets a parameter (a GPU run would stop there).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["group_device", "on_device", "now", "HostTaint", "HostTensorError", "taint_of",
           "TAINT_ENV", "FACTORIES"]

#: The environment variable that turns :class:`HostTaint` on in every rank a cluster starts.
TAINT_ENV = "MINITRAIN_TAINT"

#: The factories that make a tensor from nothing (the ones a device rule is about).
FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
             "randperm", "linspace", "eye")


def group_device(group=None) -> torch.device:
    """The device ``group``'s collectives run on: this rank's current GPU under NCCL, else the CPU
    (``None``: the default group; the CPU when no group has been started)."""
    if dist.is_available() and dist.is_initialized():
        if str(dist.get_backend(group)).lower() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level table ``t`` (made once, on the host: ``device="cpu"``) where a kernel on
    ``device`` can read it: itself on the CPU, a copy on a GPU.  The one way such a tensor reaches
    a kernel."""
    return t if device.type == "cpu" else t.to(device)


def now() -> float:
    """Seconds on one clock for the whole package (``time.perf_counter``).  Where this process
    uses a GPU, the work queued on its current stream is waited for first (NCCL's calls and
    their futures return when the work is queued): the time read is when that work was done.  A
    collective on NCCL's own stream is waited for by its ``wait()``, which makes the current
    stream wait for it."""
    if torch.cuda.is_initialized():  # cheap: no device query on a machine without a GPU
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


class HostTensorError(RuntimeError):
    """A tensor made without a device reached a collective or met a parameter."""


_TAINT = "_minitrain_host"
_FACTORY_FUNCS = {getattr(torch, name) for name in FACTORIES}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


def taint_of(t) -> str | None:
    """Where ``t`` was made without a device ("file:line in function"), or None."""
    return getattr(t, _TAINT, None) if isinstance(t, torch.Tensor) else None


def _caller() -> str | None:
    """The package's line that called the factory (None: not the package's own code)."""
    frame = sys._getframe(2)
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("minitrain") or name == __name__:
        return None
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class HostTaint(TorchFunctionMode):
    """On CPU ranks, find the tensors a GPU run would find on the wrong device.

    Inside this mode a tensor that the package's code makes with a factory and no ``device=`` is
    tainted, and so is whatever is computed from it; moving it (``.to(device)``, ``.cuda()``) or
    copying it into a tensor that has a device clears it.  A tainted tensor that meets a
    ``torch.nn.Parameter`` in an op raises :class:`HostTensorError` naming the line that made it;
    :class:`minitrain.comm.Comm` raises the same when one reaches a collective.  Turned on in a
    cluster's ranks by ``MINITRAIN_TAINT=1`` (:data:`TAINT_ENV`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FACTORY_FUNCS:
            # device=None passed on (a module's factory_kwargs, as torch.nn's): the caller chose
            if "device" not in kwargs:
                where = _caller()
                if where is not None and isinstance(out, torch.Tensor):
                    setattr(out, _TAINT, where)
            return out
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        # a 0-dim CPU tensor may meet CUDA tensors in an op (a scalar): only a collective minds it
        where = next((taint_of(t) for t in inputs if taint_of(t) and t.dim() > 0), None)
        if where is None:
            return out
        if func in _MOVES:
            moved = (func is not torch.Tensor.to or "device" in kwargs
                     or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:]))
            if func is torch.Tensor.copy_ and taint_of(args[0]):
                moved = False  # copied into a tainted tensor: still host-made
            if moved:
                for t in _tensors(out):
                    if taint_of(t):
                        delattr(t, _TAINT)
                return out
        if any(isinstance(t, torch.nn.Parameter) for t in inputs):
            raise HostTensorError(
                f"a tensor made without a device ({where}) meets a parameter in "
                f"{getattr(func, '__name__', func)}: on a GPU they would be on different devices; "
                "give the factory device= (the parameter's .device) or make it from a tensor that "
                "has one (x.new_zeros, torch.zeros_like)")
        for t in _tensors(out):
            try:
                setattr(t, _TAINT, where)
            except (AttributeError, RuntimeError):
                pass
        return out


def taint_from_env() -> HostTaint | None:
    """Enter :class:`HostTaint` for the rest of this process when :data:`TAINT_ENV` is set."""
    if os.environ.get(TAINT_ENV, "") not in ("", "0"):
        mode = HostTaint()
        mode.__enter__()
        return mode
    return None
