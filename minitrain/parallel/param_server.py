"""Parameter server: synchronous, asynchronous and bounded-staleness training (lesson 03).

Papers: Li et al., 2014, "Scaling Distributed Machine Learning with the Parameter Server" (OSDI);
Dean et al., 2012, "Large Scale Distributed Deep Networks" (Downpour SGD, asynchronous updates);
Ho et al., 2013, "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server"
(SSP); Zheng et al., 2017, "Asynchronous SGD with Delay Compensation" (DC-ASGD).  Ranks 0..S-1
are servers owning a partition of the parameters (:func:`partition`) and their Adam state; the
others are workers that push gradients (a header on ``HEADER``, the gradient on ``GRAD``) and pull
weights (``PARAMS``) with real point-to-point messages.  Modes: ``sync`` (average all W gradients
per clock), ``ssp`` with bound s (a pull is answered when clock − version ≤ s; s = 0 is sync),
``async`` (each gradient applied on arrival, with its staleness logged; optional delay compensation).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.nn as nn

from ..comm import Comm
from ..data import shard
from ..memory import ActivationMeter
from ..strategies import ConfigError, Strategy, TrainConfig, register
from .flat import FlatUnit
from .compression import (add_compression_arguments, as_error_feedback, check_compression,
                          parse_compressor)

__all__ = ["partition", "ParameterServer", "Worker", "delay_compensated", "parse_slow_workers",
           "HEADER", "GRAD", "PARAMS"]

HEADER, GRAD, PARAMS, FINAL = 1, 2, 3, 4  # wire channels (torch.distributed's send/recv tags)


def partition(params: list[torch.Tensor], servers: int) -> list[list[int]]:
    """Keys (parameter indices) per server, balanced by size: largest parameter first onto the
    least-loaded server (the LPT rule); each server's keys stay in model order."""
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    load, keys = [0] * servers, [[] for _ in range(servers)]
    for k in sorted(range(len(params)), key=lambda k: -params[k].numel()):
        s = min(range(servers), key=lambda s: (load[s], s))
        keys[s].append(k)
        load[s] += params[k].numel()
    return [sorted(ks) for ks in keys]


def parse_slow_workers(spec) -> dict[int, float]:
    """``"1:0.05,2:0.2"`` → ``{1: 0.05, 2: 0.2}`` (worker index: seconds added to each step)."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return {int(k): float(v) for k, v in spec.items()}
    out = {}
    for part in str(spec).split(","):
        worker, sep, secs = part.partition(":")
        try:
            out[int(worker)] = float(secs)
        except ValueError:
            raise ConfigError(f"bad --slow-worker {part!r}; use WORKER:SECONDS, e.g. 1:0.05 "
                              "(several separated by commas)") from None
        if not sep or out[int(worker)] < 0:
            raise ConfigError(f"bad --slow-worker {part!r}; use WORKER:SECONDS with SECONDS >= 0")
    return out


def delay_compensated(g: torch.Tensor, w_now: torch.Tensor, w_used: torch.Tensor,
                      lam: float) -> torch.Tensor:
    """DC-ASGD: g + λ·g⊙g⊙(w_now − w_used) — the gradient at the weights it was computed on,
    moved towards the current weights with g⊙g as a cheap stand-in for the Hessian's diagonal."""
    return g + lam * g * g * (w_now - w_used)


class ParameterServer:
    """One server: owns some keys and their Adam state; answers pushes and pulls.

    ``serve(steps)`` runs until every worker has pushed ``steps`` gradients, and returns the log of
    applied gradients: ``{"version", "worker", "clock", "version_used", "staleness", "loss", "time"}``.
    """

    def __init__(self, comm: Comm, params: list[torch.Tensor], workers: list[int], lr: float,
                 mode: str = "sync", staleness: int | None = None, delay_comp: float = 0.0,
                 compressor=None):
        if mode not in ("sync", "ssp", "async"):
            raise ValueError(f"mode must be 'sync', 'ssp' or 'async', got {mode!r}")
        if mode == "ssp" and (staleness is None or staleness < 0):
            raise ValueError(f"mode 'ssp' needs a staleness bound >= 0, got {staleness}")
        self.comm, self.workers, self.mode = comm, workers, mode
        self.bound, self.delay_comp, self.compressor = staleness, delay_comp, compressor
        self.params = [nn.Parameter(p.detach().clone()) for p in params]
        self.unit = FlatUnit(self.params)  # the keys laid end to end: what goes on the wire
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.numel = sum(p.numel() for p in self.params)
        self.version = 0
        self.log: list[dict] = []
        self.on_round = None  # called with (round, mean loss) after every W applied gradients
        self.sent_to: dict[int, torch.Tensor] = {}  # worker -> the weights it last pulled (DC-ASGD)
        self.outbox: list = []  # replies in flight: (work, tensor kept alive until sent)
        self.t0 = time.perf_counter()

    # -- messages -----------------------------------------------------------------------------------

    def send_params(self, worker: int) -> None:
        """Answer a pull without blocking (a server that waited on one slow receiver would stall
        every other worker — and, with several servers, could deadlock against them)."""
        weights = self.unit.flatten()
        if self.delay_comp:
            self.sent_to[worker] = weights
        version = torch.tensor([float(self.version)], dtype=torch.float64)
        self.outbox = [(w, t) for w, t in self.outbox if not w.is_completed()]
        for t, tag in ((version, "pull:version"), (weights, "pull")):
            self.outbox.append((self.comm.isend(t, worker, tag=tag, channel=PARAMS), t))

    def recv_header(self, worker: int | None) -> tuple[int, int, int, float]:
        header = torch.zeros(3, dtype=torch.float64)
        src = self.comm.recv(header, worker, tag="push:header", channel=HEADER)
        clock, used, loss = header.tolist()
        return src, int(clock), int(used), loss

    def recv_grad(self, worker: int) -> torch.Tensor:
        if self.compressor is None:
            g = torch.empty(self.numel)
            self.comm.recv(g, worker, tag="push", channel=GRAD)
            return g
        payload = [torch.empty(shape, dtype=dtype) for shape, dtype in self.compressor.layout(self.numel)]
        for part in payload:
            self.comm.recv(part, worker, tag=f"push:{self.compressor.name}", channel=GRAD)
        return self.compressor.decompress(payload, self.numel)

    # -- updates ------------------------------------------------------------------------------------

    def compensate(self, g: torch.Tensor, worker: int) -> torch.Tensor:
        if not self.delay_comp or worker not in self.sent_to:
            return g
        return delay_compensated(g, self.unit.flatten(), self.sent_to[worker], self.delay_comp)

    def apply(self, g: torch.Tensor) -> None:
        """One Adam step on this server's keys with flat gradient ``g``; a new version."""
        for p, view in zip(self.params, self.unit.views(g)):
            p.grad = view.clone()
        self.optimizer.step()
        self.version += 1

    def record(self, worker, clock, used, loss) -> None:
        """Log a gradient just applied: it moved the weights from version ``self.version - 1``."""
        applied_to = self.version - 1
        self.log.append(dict(version=applied_to, worker=worker, clock=clock, version_used=used,
                             staleness=applied_to - used, loss=loss,
                             time=time.perf_counter() - self.t0))
        w = len(self.workers)
        if self.on_round is not None and len(self.log) % w == 0:
            self.on_round(len(self.log) // w - 1, sum(e["loss"] for e in self.log[-w:]) / w)

    # -- the loops ----------------------------------------------------------------------------------

    def serve(self, steps: int) -> list[dict]:
        for w in self.workers:  # the initial pull: every worker starts from the server's weights
            self.send_params(w)
        if self.mode == "sync":
            for clock in range(steps):
                self.sync_clock(clock, last=clock == steps - 1)
        elif self.mode == "ssp":
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
        order); answer a worker's pull for clock c only when c − version ≤ bound."""
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
                if want - self.version <= self.bound:
                    self.send_params(v)
                    del waiting[v]

    def serve_async(self, steps: int) -> None:
        """Apply each gradient the moment it arrives; the sender pulls the result at once."""
        for _ in range(len(self.workers) * steps):
            w, clock, used, loss = self.recv_header(None)
            g = self.compensate(self.recv_grad(w), w)
            self.apply(g)
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
        t0 = time.perf_counter()
        for i, (s, unit) in enumerate(zip(self.servers, self.units)):
            version = torch.zeros(1, dtype=torch.float64)
            self.comm.recv(version, s, tag="pull:version", channel=PARAMS)
            weights = torch.empty(unit.total)
            self.comm.recv(weights, s, tag="pull", channel=PARAMS)
            unit.unflatten(weights)
            self.versions[i] = int(version.item())
        self.wait_s += time.perf_counter() - t0

    def push(self, clock: int, loss: float) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow worker (a busy machine, a straggler GPU)
        for i, (s, unit) in enumerate(zip(self.servers, self.units)):
            header = torch.tensor([clock, self.versions[i], loss], dtype=torch.float64)
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


# --------------------------------------------------------------------------------------------------
# Strategies for `minitrain train`
# --------------------------------------------------------------------------------------------------


class _ParameterServerStrategy(Strategy):
    """ps-sync and ps-async: S servers (ranks 0..S-1), W = world − S workers."""

    mode = "sync"
    checkpoint_refusal = ("the parameter server's ranks do not step in lockstep (a server applies "
                          "whichever worker's gradient comes first), so no step has one consistent "
                          "state to save; use ddp or zero1-3 for checkpoints")

    @classmethod
    def add_arguments(cls, parser) -> None:
        if "--servers" in parser._option_string_actions:  # ps-sync and ps-async share them
            return
        parser.add_argument("--servers", type=int, default=1,
                            help="ps-*: server ranks holding the parameters (default 1); the "
                                 "other ranks are workers")
        parser.add_argument("--staleness", type=int, default=None,
                            help="ps-async: bound s on how many versions a worker may run ahead "
                                 "(SSP; 0 = synchronous); default: no bound")
        parser.add_argument("--delay-comp", type=float, default=0.0,
                            help="ps-async: DC-ASGD's lambda (default 0: off)")
        parser.add_argument("--slow-worker", default=None,
                            help="ps-*: WORKER:SECONDS[,...] sleep added to those workers' steps")
        add_compression_arguments(parser)

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        o = cfg.options
        servers = o.get("servers", 1)
        workers = cfg.world_size - servers
        if servers < 1 or workers < 1:
            raise ConfigError(f"{cls.name} needs at least one server and one worker: --servers "
                              f"{servers} of --world-size {cfg.world_size} leaves {workers} workers; "
                              f"use --world-size {servers + max(1, workers)} or fewer --servers")
        if cfg.batch_size % workers:
            raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {workers} "
                              f"workers; use a multiple of {workers}")
        if cls.mode == "sync" and (o.get("staleness") is not None or o.get("delay_comp")):
            raise ConfigError("--staleness and --delay-comp apply to ps-async; use "
                              "--strategy ps-async (--staleness 0 behaves as ps-sync)")
        if o.get("staleness") is not None and o["staleness"] < 0:
            raise ConfigError(f"--staleness must be >= 0, got {o['staleness']}")
        if o.get("delay_comp", 0.0) < 0:
            raise ConfigError(f"--delay-comp must be >= 0, got {o['delay_comp']}")
        for w in parse_slow_workers(o.get("slow_worker")):
            if not 0 <= w < workers:
                raise ConfigError(f"--slow-worker {w}: workers are numbered 0..{workers - 1}")
        check_compression(cfg)

    def __init__(self, cfg: TrainConfig, comm: Comm):
        super().__init__(cfg, comm)
        o = cfg.options
        self.n_servers = o.get("servers", 1)
        self.server_ranks = list(range(self.n_servers))
        self.worker_ranks = list(range(self.n_servers, comm.size))
        self.model = self.build_model()
        params = list(self.model.parameters())
        self.keys = partition(params, self.n_servers)
        compressor = parse_compressor(o.get("compress"))
        self.is_server = comm.rank < self.n_servers
        if self.is_server:
            mode = self.mode if o.get("staleness") is None else "ssp"
            self.role = ParameterServer(comm, [params[k] for k in self.keys[comm.rank]],
                                        self.worker_ranks, cfg.lr, mode, o.get("staleness"),
                                        o.get("delay_comp", 0.0), compressor)
            self.model, self.optimizer = nn.ParameterList(self.role.params), self.role.optimizer
        else:
            self.index = comm.rank - self.n_servers
            self.role = Worker(comm, self.model, self.keys, self.server_ranks, compressor,
                               o.get("error_feedback", True),
                               parse_slow_workers(o.get("slow_worker")).get(self.index, 0.0))
            self.optimizer = None
            self.meter = ActivationMeter(self.model)
        self.crash = o.get("crash_worker")  # (worker, clock): fault injection for tests/lesson

    def train_step(self, x, y) -> float:
        """Servers and workers do not step in lockstep (a server answers whoever pushes first),
        so there is no single-step call: :meth:`fit` runs each rank's whole loop."""
        raise TypeError(f"{self.name} ranks do not step in lockstep; call fit(data) instead")

    def fit(self, data, on_step=None):
        t0 = time.perf_counter()
        if self.is_server:
            self.role.on_round = on_step  # progress as rounds of W gradients are applied
            losses = self.losses_per_round(self.role.serve(self.cfg.steps))
        else:
            losses = self.work(data)
        seconds = (time.perf_counter() - t0) / self.cfg.steps
        self.gather_final_weights()
        return losses, [seconds] * self.cfg.steps

    def work(self, data) -> list[float]:
        w, n = self.index, len(self.worker_ranks)
        self.role.pull()
        losses = []
        for clock in range(self.cfg.steps):
            if self.crash is not None and tuple(self.crash) == (w, clock):
                os._exit(3)  # simulate a worker dying mid-run (the launcher must report it)
            x, y = data.batch(clock, self.cfg.batch_size)
            losses.append(self.role.step(clock, shard(x, w, n), shard(y, w, n), self.meter))
            if clock + 1 < self.cfg.steps:
                self.role.pull()
        return losses

    def losses_per_round(self, log: list[dict]) -> list[float]:
        """One loss per step: the mean over each round of W applied gradients (sync and SSP: the
        clock's W gradients; async: W consecutive arrivals)."""
        w = len(self.worker_ranks)
        return [sum(e["loss"] for e in log[i:i + w]) / w for i in range(0, len(log), w)]

    def gather_final_weights(self) -> None:
        """Servers send their keys to server 0, so rank 0 can return the whole model (untraced)."""
        with self.comm.tracer.paused():
            if not self.is_server:
                return
            if self.comm.rank != 0:
                self.comm.send(self.role.unit.flatten(), 0, channel=FINAL)
                return
            self._full_model = self.build_model()
            full = list(self._full_model.parameters())
            for s in range(1, self.n_servers):
                unit = FlatUnit([full[k] for k in self.keys[s]])
                weights = torch.empty(unit.total)
                self.comm.recv(weights, s, channel=FINAL)
                unit.unflatten(weights)
            FlatUnit([full[k] for k in self.keys[0]]).unflatten(self.role.unit.flatten())

    def state_dict(self) -> dict:
        return self._full_model.state_dict()

    def report(self) -> dict:
        """Role, keys, bytes sent to each peer (lesson 03 draws the graph from it); servers add
        the log of applied gradients, workers the time they spent waiting for pulls."""
        sent: dict[int, int] = {}
        for e in self.comm.tracer.events:
            if e.op == "send":
                sent[e.peer] = sent.get(e.peer, 0) + e.bytes
        out = {"rank": self.comm.rank, "sent_to": sent}
        if self.is_server:
            return {**out, "role": "server", "mode": self.role.mode, "bound": self.role.bound,
                    "keys": len(self.keys[self.comm.rank]), "numel": self.role.numel,
                    "log": self.role.log}
        return {**out, "role": "worker", "worker": self.index, "wait_s": self.role.wait_s}


@register
class PSSync(_ParameterServerStrategy):
    name = "ps-sync"
    help = "parameter server, synchronous: servers average all workers' gradients each step"
    mode = "sync"


@register
class PSAsync(_ParameterServerStrategy):
    name = "ps-async"
    help = ("parameter server, asynchronous (--staleness s: bounded, SSP; --delay-comp: DC-ASGD)")
    mode = "async"
