"""Pipeline parallelism on real ranks (lesson 05): the model cut into stages, and an executor that
runs one rank's row of a schedule table (:mod:`minitrain.parallel.schedules`) and records what ran.

Papers: GPipe — Huang et al., 2019; 1F1B — Narayanan et al., 2019 (PipeDream) and 2021
(PipeDream-Flush); interleaved 1F1B — Narayanan et al., 2021 (Megatron-LM); zero bubble — Qi et al.,
2024 (the I/W split of :class:`SplitLinear`).

A stage sends its activations to the next stage and their gradients back, point to point; with V
chunks per rank, virtual stage s runs on rank s % P.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..comm import Comm
from ..device import now
from ..memory import ActivationMeter
from ..model import GPT, loss_fn
from .schedules import Action, Table, split_layers

__all__ = ["PipelineStage", "SplitLinear", "split_weight_gradients", "stage_step",
           "PipelineExecutor"]


# --------------------------------------------------------------------------------------------------
# The model cut into stages
# --------------------------------------------------------------------------------------------------


class PipelineStage(nn.Module):
    """Virtual stage ``stage`` of ``n_stages``: the GPT's embedding (first stage), its share of the
    blocks, and the head (last stage) — the same module objects, under the same names, so the
    stages' state_dicts put together are the single-process state_dict.

    ``parts(kind, module)``, if given, builds each piece from the GPT's (``kind`` is "embed",
    "block" or "head"): e.g. :class:`~minitrain.parallel.tensor_gpt.TensorParallelParts`, whose
    tensor-parallel layers make the stages of the 3D mesh.
    """

    def __init__(self, model: GPT, stage: int, n_stages: int, parts=None):
        super().__init__()
        make = parts or (lambda kind, module: module)
        self.stage, self.first, self.last = stage, stage == 0, stage == n_stages - 1
        self.embed = make("embed", model.embed) if self.first else None
        layers = split_layers(model.cfg.n_layer, n_stages)[stage]
        self.blocks = nn.ModuleDict({str(i): make("block", model.blocks[i]) for i in layers})
        self.head = make("head", model.head) if self.last else None
        self.checkpoint_activations = model.checkpoint_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            recompute = self.checkpoint_activations and torch.is_grad_enabled()
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(x) if self.head is not None else x

    def split_linears(self) -> list["SplitLinear"]:
        return [m for m in self.modules() if isinstance(m, SplitLinear)]


class _LinearIW(torch.autograd.Function):
    """y = x Wᵀ + b whose backward can leave the weight-gradient GEMM (gᵀx) for later."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        grad_x = g @ weight
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        if layer.key is not None:  # I pass: keep (x, g) for the W pass, no dW now
            layer.stash.setdefault(layer.key, []).append((x, g))
            return grad_x, None, grad_b, None
        return grad_x, _weight_grad(x, g), grad_b, None


def _weight_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class SplitLinear(nn.Module):
    """A Linear layer (the same ``weight`` and ``bias``) for zero-bubble schedules.

    In an I pass (``key`` = the micro-batch) backward computes the gradient w.r.t. the input — what
    the previous stage waits for — and the bias gradient, and stashes the layer's input and output
    gradient; :meth:`weight_grad` (the W pass) does the big GEMM gᵀx later.  Small parameters
    (LayerNorm gains and biases, embeddings, Linear biases) get their gradients in I: they cost
    little, and splitting them would need the same trick in every module.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.key = None
        self.stash: dict[int, list] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearIW.apply(x, self.weight, self.bias, self)

    def weight_grad(self, key: int) -> None:
        for x, g in self.stash.pop(key, []):
            dw = _weight_grad(x, g)
            self.weight.grad = dw if self.weight.grad is None else self.weight.grad.add_(dw)


def split_weight_gradients(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`SplitLinear` (same parameters)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, SplitLinear(child))
    return module


def stage_step(action: Action, stage: PipelineStage, inp, saved: dict, send, loss):
    """One action of one stage — the package's; ``PipelineExecutor(stage_step=fn)`` takes another.

    Forward (``action.kind == "F"``): ``inp`` is the micro-batch's ids (first stage) or the
    activation the previous stage sent.  Run the stage; on the last stage ``loss(out)`` turns the
    output into the micro-batch's share of the loss.  Keep ``(inp, out)`` in
    ``saved[(microbatch, stage)]`` for the backward, ``send`` the output (detached) to the next
    stage, and return the loss on the last stage (None elsewhere).

    Backward (``B``, or ``I`` under zero bubble): ``inp`` is the gradient of the stage's output
    that the next stage sent (None on the last stage: its output is the loss).  Take back
    ``(inp, out)``, backpropagate, ``send`` the input's gradient to the previous stage.  ``send``
    does nothing at the ends of the pipeline.
    """
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


_stage_step = stage_step  # the default, under a name PipelineExecutor's parameter does not hide


# --------------------------------------------------------------------------------------------------
# The executor: one rank's row of the table, on the real ranks
# --------------------------------------------------------------------------------------------------


class PipelineExecutor:
    """Runs this rank's row of ``table`` for one batch, and records what really happened.

    Activations go to the next stage and their gradients back with non-blocking sends.  After each
    action, the sends it made and the receive the next action needs are posted together, in one
    exchange (:meth:`~minitrain.comm.Comm.exchange`, as PyTorch's pipelining and Megatron-LM post
    them): NCCL runs a pair's messages in the order they were posted, so a rank that posted all its
    receives first would wait on them before its sends could go, and so would its peer.  Send
    handles are kept (their buffers are never reused within a step) and waited at its end; a
    message on the same channel matches in posting order, so no tag is needed to tell one
    micro-batch's from another's.  ``timeline`` holds,
    after :meth:`step`, one ``{"rank", "action", "ready", "start", "end", "send"}`` per action:
    seconds after rank 0 left that barrier (one clock for all ranks of a host; ranks on different
    hosts have different clocks, so there only each rank's own times compare).  ``ready`` is when
    the rank turned to the action, ``start`` when its input had arrived (``start - ready`` is the
    wait for the message, counted as idle), ``send`` the seconds its sends took to post (inside
    the action: gloo copies into the socket in the calling thread).  ``messages`` holds one
    ``{"rank", "to", "grad", "microbatch", "stage", "posted", "returned"}`` per send (``stage``:
    the receiving virtual stage), so a wait can be matched to the send that ended it.

    Micro-batches are ``torch.tensor_split`` of the batch (sizes may differ by one); micro-batch
    m's loss is weighted by its share of the batch, so the accumulated gradient and the summed loss
    are the global mean's.  ``peak_bytes`` is the most activation memory held at once (bytes saved
    for backward by the forwards not yet backwarded — until W under zero-bubble).

    ``stage_step`` runs one F, B or I action on its stage (signature of :func:`stage_step`, the
    default); ``activation_shape(b, t)`` and ``loss(output, targets)`` say what travels between
    stages and how the last stage's output becomes a micro-batch's mean loss.
    """

    def __init__(self, stages: dict[int, PipelineStage], table: Table, comm: Comm,
                 microbatches: int, d_model: int, *, activation_shape=None, loss=loss_fn,
                 stage_step=None):
        self.stages, self.comm, self.M, self.d_model = stages, comm, microbatches, d_model
        self.stage_step = stage_step or _stage_step  # one F, B or I action of one stage
        # what travels between stages for a micro-batch of b samples of t tokens (default (b, t, d));
        # the 3D mesh (lesson 08) sends tensor-parallel activations, (t, b, d) or a sequence shard
        self.activation_shape = activation_shape or (lambda b, t: (b, t, d_model))
        self.loss = loss  # (last stage's output, targets) -> the micro-batch's mean loss
        self.P = len(table)
        self.S = 1 + max(a.stage for row in table for a in row if a is not None)
        first = next(p for st in stages.values() for p in st.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.row = [a for a in table[comm.rank] if a is not None]
        self.meter = ActivationMeter(nn.ModuleList(stages.values()))
        self.timeline: list[dict] = []
        self.held: dict[tuple, int] = {}
        self.peak_bytes = 0

    # -- messages: channel numbers name (activation or gradient, micro-batch, receiving stage)

    def _channel(self, grad: bool, m: int, stage: int) -> int:
        return 1 + 2 * (stage * self.M + m) + grad

    def _needs(self, a: Action) -> tuple[bool, int] | None:
        """(is a gradient, from stage) of the message action ``a`` waits for, if any."""
        if a.kind == "F" and a.stage > 0:
            return False, a.stage - 1
        if a.kind in "BI" and a.stage < self.S - 1:
            return True, a.stage + 1
        return None

    def _post(self, a: Action | None):
        """Post the sends queued so far and the receive action ``a`` needs, in one exchange; the
        receive's (buffer, handle), or None when ``a`` takes nothing from another rank."""
        need = self._needs(a) if a is not None else None
        recvs = []
        if need is not None and need[1] % self.P != self.comm.rank:
            buf = torch.empty(self.shapes[a.microbatch], dtype=self.dtype, device=self.device)
            recvs = [(buf, need[1] % self.P, self._channel(need[0], a.microbatch, a.stage))]
        if not recvs and not self.outgoing:
            return None
        posted = now()
        works = self.comm.exchange([m[:3] for m in self.outgoing], recvs, tag="pp")
        returned = now()
        if self.outgoing:  # what posting this action's sends took (a receive alone: nothing)
            self.sending += returned - posted
        for (t, dst, _, grad, m, stage), work in zip(self.outgoing, works):
            self.sends.append((work, t))
            self.messages.append({"rank": self.comm.rank, "to": dst, "grad": grad, "microbatch": m,
                                  "stage": stage, "posted": posted - self.t0,
                                  "returned": returned - self.t0})
        self.outgoing = []
        return (recvs[0][0], works[-1]) if recvs else None

    def _receive(self, a: Action, posted) -> torch.Tensor:
        if posted is not None:
            buf, work = posted
            work.wait()
            return buf
        return self.local.pop((a.kind == "F", a.microbatch, a.stage))

    def _send(self, t: torch.Tensor, grad: bool, m: int, stage: int) -> None:
        dst = stage % self.P
        if dst == self.comm.rank:  # the next virtual stage lives here too (e.g. one rank)
            self.local[(not grad, m, stage)] = t
        else:  # posted after the action, with the next action's receive (:meth:`_post`)
            self.outgoing.append((t, dst, self._channel(grad, m, stage), grad, m, stage))

    # -- the actions

    def _sender(self, grad: bool, m: int, stage: int):
        """``send(t)`` for a stage_step: to virtual ``stage``; nothing past the pipeline's ends."""
        if not 0 <= stage < self.S:
            return lambda t: None
        return lambda t: self._send(t, grad, m, stage)

    def _forward(self, a: Action, inp) -> None:
        stage, m = self.stages[a.stage], a.microbatch
        y = self.ys[m]
        loss = lambda out: self.loss(out, y) * (y.shape[0] / self.batch)  # noqa: E731
        with self.meter.measure():
            out = self.stage_step(a, stage, inp, self.saved, self._sender(False, m, a.stage + 1),
                                  loss)
        self.held[(m, a.stage)] = self.meter.last
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))
        if stage.last:
            self.losses.append(out.detach())

    def _backward(self, a: Action, grad) -> None:
        stage, m = self.stages[a.stage], a.microbatch
        split = stage.split_linears() if a.kind == "I" else []
        for layer in split:
            layer.key = m
        self.stage_step(a, stage, grad, self.saved, self._sender(True, m, a.stage - 1), None)
        for layer in split:
            layer.key = None
        if a.kind == "B":
            self.held.pop((m, a.stage))

    def weights_pass(self, a: Action, _) -> None:
        """A W action: the weight gradients its I pass left for later (ZB-H1)."""
        for layer in self.stages[a.stage].split_linears():
            layer.weight_grad(a.microbatch)
        self.held.pop((a.microbatch, a.stage))

    def _input(self, a: Action, posted):
        if a.kind == "F" and a.stage == 0:
            return self.xs[a.microbatch]
        if self._needs(a) is None:
            return None
        t = self._receive(a, posted)
        return t.requires_grad_() if a.kind == "F" else t

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward the batch ``(x, y)`` by this rank's row; gradients accumulate in
        the stages' ``.grad``.  Returns the batch's mean loss (the same float on every rank)."""
        self.xs, self.ys = torch.tensor_split(x, self.M), torch.tensor_split(y, self.M)
        self.batch = x.shape[0]
        self.shapes = [self.activation_shape(len(t), x.shape[1]) for t in self.xs]
        self.saved, self.local, self.sends, self.outgoing, self.losses = {}, {}, [], [], []
        run = {"F": self._forward, "B": self._backward, "I": self._backward, "W": self.weights_pass}
        self.t0 = t0 = self._common_t0()
        self.timeline, self.messages = [], []
        posted = self._post(self.row[0] if self.row else None)
        for i, a in enumerate(self.row):
            ready = now()
            inp = self._input(a, posted)  # waiting for a message is idle time, not the action's
            start, self.sending = now(), 0.0
            run[a.kind](a, inp)
            posted = self._post(self.row[i + 1] if i + 1 < len(self.row) else None)
            self.timeline.append({"rank": self.comm.rank, "action": a, "ready": ready - t0,
                                  "start": start - t0, "end": now() - t0, "send": self.sending})
        for work, _ in self.sends:
            work.wait()
        return self._global_loss()

    def _common_t0(self) -> float:
        """After a barrier, rank 0's clock reading, for every rank: one time origin for the step.
        (:func:`~minitrain.device.now` reads the machine's monotonic clock, shared by the ranks
        of one host; each rank's own reading after the barrier could differ by milliseconds.)"""
        self.comm.untraced.barrier()
        t0 = torch.tensor([now()], dtype=torch.float64, device=self.device)
        self.comm.untraced.broadcast(t0, 0)
        return t0.item()

    def _global_loss(self) -> float:
        """The last stage's summed loss, broadcast to every rank (a metric: untraced)."""
        total = (torch.stack(self.losses).sum().float() if self.losses
                 else torch.zeros((), device=self.device))
        self.comm.untraced.broadcast(total, (self.S - 1) % self.P)
        return total.item()
