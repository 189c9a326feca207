"""Parameter server: synchronous, asynchronous and bounded-staleness training (lesson 03).

Papers: Li et al., 2014, "Scaling Distributed Machine Learning with the Parameter Server" (OSDI);
Dean et al., 2012, "Large Scale Distributed Deep Networks" (Downpour SGD, asynchronous updates);
Ho et al., 2013, "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server"
(SSP); Zheng et al., 2017, "Asynchronous SGD with Delay Compensation" (DC-ASGD); Zhang et al.,
2016, "Staleness-aware Async-SGD for Distributed Deep Learning" (the learning rate divided by
the gradient's staleness).  Ranks 0..S-1
are servers owning a partition of the parameters (:func:`partition`) and their Adam state; the
others are workers that push gradients (a header on ``HEADER``, the gradient on ``GRAD``) and pull
weights (``PARAMS``) with real point-to-point messages.  Modes: ``sync`` (average all W gradients
per clock), ``ssp`` with bound s (a pull is answered when clock − version ≤ s; s = 0 is sync),
``async`` (each gradient applied on arrival, with its staleness logged; optional delay compensation
and staleness-aware learning rate).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..comm import Comm
from ..device import now
from .compression import as_error_feedback
from .errors import ParameterError
from .flat import FlatUnit

__all__ = ["partition", "Consistency", "ParameterServer", "Worker", "delay_compensated", "HEADER",
           "GRAD", "PARAMS", "FINAL"]

HEADER, GRAD, PARAMS, FINAL = 1, 2, 3, 4  # wire channels (torch.distributed's send/recv tags)


def partition(params: list[torch.Tensor], servers: int) -> list[list[int]]:
    """Keys (parameter indices) per server, balanced by size: largest parameter first onto the
    least-loaded server (the LPT rule); each server's keys stay in model order."""
    if servers < 1:
        raise ParameterError("{}: need at least one server", ("servers", servers))
    load, keys = [0] * servers, [[] for _ in range(servers)]
    for k in sorted(range(len(params)), key=lambda k: -params[k].numel()):
        s = min(range(servers), key=lambda s: (load[s], s))
        keys[s].append(k)
        load[s] += params[k].numel()
    return [sorted(ks) for ks in keys]


def delay_compensated(g: torch.Tensor, w_now: torch.Tensor, w_used: torch.Tensor,
                      lam: float) -> torch.Tensor:
    """DC-ASGD: g + λ·g⊙g⊙(w_now − w_used) — the gradient at the weights it was computed on,
    moved towards the current weights with g⊙g as a cheap stand-in for the Hessian's diagonal."""
    return g + lam * g * g * (w_now - w_used)


@dataclass(frozen=True)
class Consistency:
    """When a server applies the gradients it receives (the paper's consistency models).

    ``mode``: ``"sync"`` (one averaged step per clock, from every worker), ``"ssp"`` (the same,
    but a worker may run ahead until its clock minus the server's version exceeds ``staleness``)
    or ``"async"`` (each gradient applied on arrival).  ``delay_comp``: λ of DC-ASGD
    (:func:`delay_compensated`; 0: off), for ``ssp`` and ``async``.  ``staleness_lr``: ``async``
    only, a gradient τ versions stale steps with the learning rate divided by τ.
    """

    mode: str = "sync"
    staleness: int | None = None
    delay_comp: float = 0.0
    staleness_lr: bool = False

    def __post_init__(self):
        if self.mode not in ("sync", "ssp", "async"):
            raise ParameterError("unknown {}; use 'sync', 'ssp' or 'async'", ("mode", self.mode))
        if self.mode == "ssp" and (self.staleness is None or self.staleness < 0):
            raise ParameterError("mode 'ssp' needs a staleness bound >= 0, got {}",
                                 ("staleness", self.staleness))
        if self.staleness_lr and self.mode != "async":
            raise ValueError("staleness_lr divides each arriving gradient's step by its staleness: "
                             "mode 'async' only")


class ParameterServer:
    """One server: owns some keys and their Adam state; answers pushes and pulls, applying the
    gradients as ``consistency`` (a :class:`Consistency`) says.  ``compressor``: how the workers'
    gradients arrive (None: whole).

    ``serve(steps)`` runs until every worker has pushed ``steps`` gradients, and returns the log of
    applied gradients: ``{"version", "worker", "clock", "version_used", "staleness", "loss", "time"}``.
    """

    def __init__(self, comm: Comm, params: list[torch.Tensor], workers: list[int], lr: float,
                 consistency: Consistency = Consistency(), compressor=None):
        self.comm, self.workers, self.compressor = comm, workers, compressor
        self.consistency = consistency
        self.params = [nn.Parameter(p.detach().clone()) for p in params]
        self.unit = FlatUnit(self.params)  # the keys laid end to end: what goes on the wire
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.numel = sum(p.numel() for p in self.params)
        self.version = 0
        self.log: list[dict] = []
        self.on_round = None  # called with (round, mean loss) after every W applied gradients
        self.sent_to: dict[int, torch.Tensor] = {}  # worker -> the weights it last pulled (DC-ASGD)
        self.outbox: list = []  # replies in flight: (work, tensor kept alive until sent)
        self.t0 = now()
        self.device = self.params[0].device if self.params else comm.device

    # -- messages -----------------------------------------------------------------------------------

    def send_params(self, worker: int) -> None:
        """Answer a pull without blocking (a server that waited on one slow receiver would stall
        every other worker — and, with several servers, could deadlock against them)."""
        weights = self.unit.flatten()
        if self.consistency.delay_comp:
            self.sent_to[worker] = weights
        version = torch.tensor([float(self.version)], dtype=torch.float64, device=self.device)
        self.outbox = [(w, t) for w, t in self.outbox if not w.is_completed()]
        for t, tag in ((version, "pull:version"), (weights, "pull")):
            self.outbox.append((self.comm.isend(t, worker, tag=tag, channel=PARAMS), t))

    def recv_header(self, worker: int | None) -> tuple[int, int, int, float]:
        header = torch.zeros(3, dtype=torch.float64, device=self.device)
        src = self.comm.recv(header, worker, tag="push:header", channel=HEADER)
        clock, used, loss = header.tolist()
        return src, int(clock), int(used), loss

    def recv_grad(self, worker: int) -> torch.Tensor:
        if self.compressor is None:
            g = torch.empty(self.numel, device=self.device)
            self.comm.recv(g, worker, tag="push", channel=GRAD)
            return g
        payload = [torch.empty(shape, dtype=dtype, device=self.device)
                   for shape, dtype in self.compressor.layout(self.numel)]
        for part in payload:
            self.comm.recv(part, worker, tag=f"push:{self.compressor.name}", channel=GRAD)
        return self.compressor.decompress(payload, self.numel)

    # -- updates ------------------------------------------------------------------------------------

    def compensate(self, g: torch.Tensor, worker: int) -> torch.Tensor:
        lam = self.consistency.delay_comp
        if not lam or worker not in self.sent_to:
            return g
        return delay_compensated(g, self.unit.flatten(), self.sent_to[worker], lam)

    def apply(self, g: torch.Tensor, lr_scale: float = 1.0) -> None:
        """One Adam step on this server's keys with flat gradient ``g`` (its learning rate times
        ``lr_scale``); a new version."""
        for p, view in zip(self.params, self.unit.views(g)):
            p.grad = view.clone()
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] *= lr_scale
        self.optimizer.step()
        for group, lr in zip(groups, base):
            group["lr"] = lr
        self.version += 1

    def record(self, worker, clock, used, loss) -> None:
        """Log a gradient just applied: it moved the weights from version ``self.version - 1``."""
        applied_to = self.version - 1
        self.log.append(dict(version=applied_to, worker=worker, clock=clock, version_used=used,
                             staleness=applied_to - used, loss=loss,
                             time=now() - self.t0))
        w = len(self.workers)
        if self.on_round is not None and len(self.log) % w == 0:
            self.on_round(len(self.log) // w - 1, sum(e["loss"] for e in self.log[-w:]) / w)

    # -- the loops ----------------------------------------------------------------------------------

    def serve(self, steps: int) -> list[dict]:
        for w in self.workers:  # the initial pull: every worker starts from the server's weights
            self.send_params(w)
        if self.consistency.mode == "sync":
            for clock in range(steps):
                self.sync_clock(clock, last=clock == steps - 1)
        elif self.consistency.mode == "ssp":
            self.serve_ssp(steps)
        else:
            self.serve_async(steps)
        for work, _ in self.outbox:
            work.wait()
        self.outbox.clear()
        return self.log

    def sync_clock(self, clock: int, last: bool) -> None:
        """Gradients from every worker, in worker order; one averaged step; everyone pulls."""
        grads, losses = [], []
        for w in self.workers:
            _, c, used, loss = self.recv_header(w)
            grads.append(self.recv_grad(w))
            losses.append((w, c, used, loss))
        self.apply(torch.stack(grads).mean(0))
        for w, c, used, loss in losses:
            self.record(w, c, used, loss)
        if not last:
            for w in self.workers:
                self.send_params(w)

    def serve_ssp(self, steps: int) -> None:
        """Take pushes in arrival order; apply clock c once all W arrived (averaged in worker
        order); answer a worker's pull for clock c only when c − version ≤ the staleness bound."""
        pending: dict[int, dict[int, tuple]] = {}  # clock -> worker -> (grad, used, loss)
        waiting: dict[int, int] = {}  # worker -> the clock it wants to compute next
        for _ in range(len(self.workers) * steps):
            w, clock, used, loss = self.recv_header(None)
            g = self.compensate(self.recv_grad(w), w)
            pending.setdefault(clock, {})[w] = (g, used, loss)
            while len(pending.get(self.version, {})) == len(self.workers):
                arrived = pending.pop(self.version)
                self.apply(torch.stack([arrived[v][0] for v in self.workers]).mean(0))
                for v in self.workers:
                    self.record(v, self.version - 1, arrived[v][1], arrived[v][2])
            if clock + 1 < steps:
                waiting[w] = clock + 1
            for v, want in sorted(waiting.items()):
                if want - self.version <= self.consistency.staleness:
                    self.send_params(v)
                    del waiting[v]

    def serve_async(self, steps: int) -> None:
        """Apply each gradient the moment it arrives; the sender pulls the result at once.  With
        ``staleness_lr``, a gradient τ versions stale steps with the learning rate divided by τ
        (τ ≥ 1; Zhang et al., 2016: the staler the gradient, the smaller its step)."""
        for _ in range(len(self.workers) * steps):
            w, clock, used, loss = self.recv_header(None)
            g = self.compensate(self.recv_grad(w), w)
            stale = self.version - used
            self.apply(g, 1.0 / max(1, stale) if self.consistency.staleness_lr else 1.0)
            self.record(w, clock, used, loss)
            if clock + 1 < steps:
                self.send_params(w)


class Worker:
    """Computes gradients on its slice of each batch; pushes them to every server, pulls weights."""

    def __init__(self, comm: Comm, model: nn.Module, keys: list[list[int]], servers: list[int],
                 compressor=None, error_feedback: bool = True, delay_s: float = 0.0):
        self.comm, self.model, self.servers = comm, model, servers
        params = list(model.parameters())
        self.shards = [[params[k] for k in ks] for ks in keys]
        self.units = [FlatUnit(ps) for ps in self.shards]
        self.ef = as_error_feedback(compressor, error_feedback)
        self.delay_s = delay_s
        self.versions = [0] * len(servers)
        self.wait_s = 0.0

    def pull(self) -> None:
        t0 = now()
        for i, (s, unit) in enumerate(zip(self.servers, self.units)):
            version = torch.zeros(1, dtype=torch.float64, device=self.comm.device)
            self.comm.recv(version, s, tag="pull:version", channel=PARAMS)
            weights = torch.empty(unit.total, device=self.comm.device)
            self.comm.recv(weights, s, tag="pull", channel=PARAMS)
            unit.unflatten(weights)
            self.versions[i] = int(version.item())
        self.wait_s += now() - t0

    def push(self, clock: int, loss: float) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow worker (a busy machine, a straggler GPU)
        for i, (s, unit) in enumerate(zip(self.servers, self.units)):
            header = torch.tensor([clock, self.versions[i], loss], dtype=torch.float64,
                                  device=self.comm.device)
            self.comm.send(header, s, tag="push:header", channel=HEADER)
            g = unit.flatten([p.grad for p in unit.params])  # no gradient: zeros
            if self.ef is None:
                self.comm.send(g, s, tag="push", channel=GRAD)
                continue
            payload, _ = self.ef.compress(g, key=i)
            for part in payload:
                self.comm.send(part.contiguous(), s, tag=f"push:{self.ef.compressor.name}",
                               channel=GRAD)

    def step(self, clock: int, x: torch.Tensor, y: torch.Tensor, meter=None) -> float:
        self.model.zero_grad(set_to_none=True)
        with meter.measure() if meter is not None else contextlib.nullcontext():
            loss = self.model(x, y)
        loss.backward()
        self.push(clock, loss.item())
        return loss.item()
