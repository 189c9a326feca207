"""Recording a run for the projection: when each forward, backward and optimizer step ran.

:func:`recording` keeps, on a strategy's tracer, what :mod:`minitrain.planning.recorded` turns into
each rank's program for the replay, beside the communicator's own events (every call with its issue
order, asynchronous issue and wait):

* ``tracer.marks``: each forward's, backward's and optimizer step's start and end (the training
  loop marks each step's, ``"step"`` and ``"step_end"``);
* ``tracer.untraced``: the calls made through ``comm.untraced`` (a metric's all-reduce, a pipeline's
  barrier), which are not training traffic but make the ranks wait for each other.

Everything is observed through hooks on the strategy's own objects — its modules and its
optimizer — and autograd's hooks on the graph its forwards build; nothing of ``torch`` is replaced.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["recording", "Recording"]


def _modules(strategy) -> list[nn.Module]:
    """Every module the strategy holds (its model, and the wrapper it calls forward on), each
    with all its submodules, once."""
    seen: dict[int, nn.Module] = {}
    for held in vars(strategy).values():
        if isinstance(held, nn.Module):
            for m in held.modules():
                seen.setdefault(id(m), m)
    return list(seen.values())


def _torch_optimizer(optimizer):
    """The ``torch.optim`` optimizer a strategy's optimizer steps: itself, or the one a wrapper of
    ours (ZeRO's, host offload) forwards to as its ``optim``; None where there is none."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optim", None)
    return optimizer


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


@contextmanager
def recording(strategy):
    """While the block runs, record on ``strategy.comm.tracer`` what
    :mod:`minitrain.planning.projection` needs to re-time the run (``tracer.recording`` is on):

    * a forward: the outermost call of the strategy's modules outside a backward (a recomputation
      inside a backward belongs to the backward), ``"forward"`` to ``"forward_end"``;
    * a backward: from when autograd reaches a forward's output to the end of that backward pass,
      after what the backward left to do at its end (DDP's wait for its last buckets),
      ``"backward"`` to ``"backward_end"``;
    * an optimizer step: the step of the strategy's ``torch.optim`` optimizer (inside ZeRO's
      step, the shard's), ``"optimizer"`` to ``"optimizer_end"``;
    * a zero-bubble pipeline's W pass (its weight gradients, computed outside autograd by the
      pipeline executor's ``weights_pass``), ``"weights"`` to ``"weights_end"``;
    * the calls made through ``comm.untraced``, in ``tracer.untraced``.

    The hooks are on the strategy's modules and optimizer only, and are removed on exit."""
    tracer = strategy.comm.tracer
    queue = torch.autograd.Variable._execution_engine.queue_callback
    depth, in_backward = [0], [False]

    def backward_end() -> None:
        tracer.mark("backward_end")
        in_backward[0] = False

    def backward_start(_grads) -> None:
        if not in_backward[0]:
            in_backward[0] = True
            tracer.mark("backward")
            # queued from a final callback, it runs after those queued during the backward
            queue(lambda: queue(backward_end))

    def enter(_module, _args) -> None:
        if not in_backward[0]:
            if depth[0] == 0:
                tracer.mark("forward")
            depth[0] += 1

    def leave(_module, _args, output) -> None:
        if in_backward[0] or depth[0] == 0:
            return
        depth[0] -= 1
        if depth[0] == 0:
            tracer.mark("forward_end")
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.grad_fn is not None:
                        t.grad_fn.register_prehook(backward_start)

    handles = []
    for m in _modules(strategy):
        handles.append(m.register_forward_pre_hook(enter, prepend=True))
        handles.append(m.register_forward_hook(leave, prepend=True, always_call=True))
    optimizer = _torch_optimizer(getattr(strategy, "optimizer", None))
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(lambda *_: tracer.mark("optimizer")))
        handles.append(optimizer.register_step_post_hook(lambda *_: tracer.mark("optimizer_end")))
    executor = getattr(strategy, "executor", None)
    weights_pass = getattr(executor, "weights_pass", None)
    if weights_pass is not None:
        def marked(*args):
            tracer.mark("weights")
            try:
                return weights_pass(*args)
            finally:
                tracer.mark("weights_end")
        executor.weights_pass = marked
    was, tracer.recording = tracer.recording, True
    try:
        yield tracer
    finally:
        tracer.recording = was
        for h in handles:
            h.remove()
        if weights_pass is not None:
            executor.weights_pass = weights_pass


class Recording:
    """What :mod:`minitrain.planning.projection` replays, recorded while the run trains (``on``):
    around the loop, every collective and each forward's, backward's and optimizer step's edges
    (:func:`recording`); at each step, its start and end (tracer marks).  Off, it records
    nothing.  A callback of :func:`minitrain.train.fit`."""

    def __init__(self, strategy, on: bool = True):
        self.tracer, self.on = strategy.comm.tracer, on
        self._block = recording(strategy) if on else contextlib.nullcontext()

    def __enter__(self):
        self._block.__enter__()
        return self

    def __exit__(self, *exc):
        return self._block.__exit__(*exc)

    def begin(self, step: int) -> None:
        self.tracer.mark("step", step)

    def end(self, step: int, loss: float) -> None:
        self.tracer.mark("step_end", step)

    def export(self) -> dict | None:
        """This rank's log (:meth:`minitrain.comm.Tracer.export`), or None when off."""
        return self.tracer.export() if self.on else None
