"""``ps-sync`` and ``ps-async``: S server ranks hold the parameters, W = world − S workers push
gradients and pull weights (lesson 03).  The ranks do not step together: the strategy is
:class:`~minitrain.strategies.base.FreeRunning` and runs each rank's own loop."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..data import shard
from ..device import now
from ..parallel.compression import as_error_feedback, parse_compressor
from ..parallel.flat import FlatUnit
from ..parallel.param_server import FINAL, Consistency, ParameterServer, Worker, partition
from .base import FreeRunning, TrainConfig, register
from .options import ConfigError, at_least, option
from .data_parallel import Compression, check_batch_split, check_compression

__all__ = ["PSOptions", "PSSync", "PSAsync", "parse_slow_workers", "parse_crash_worker"]


def _non_negative(value) -> str | None:
    return None if value is None or 0 <= value < math.inf else "must be >= 0 (and finite)"


@dataclass(frozen=True)
class PSOptions(Compression):
    servers: int = option(1, "server ranks holding the parameters; the other ranks are workers",
                          check=at_least(1))
    staleness: int | None = option(None, "ps-async: bound s on how many versions a worker may run "
                                         "ahead (SSP; 0 = synchronous) (default: no bound)",
                                   check=_non_negative)
    delay_comp: float = option(0.0, "ps-async: DC-ASGD's lambda (0: off)", check=_non_negative)
    staleness_lr: bool = option(False, "ps-async: divide a gradient's learning rate by its "
                                       "staleness (staleness-aware async SGD)")
    slow_worker: str | None = option(None, "WORKER:SECONDS[,...] sleep added to those workers' "
                                           "steps (default: none)", metavar="W:S")
    crash_worker: str | None = option(None, "WORKER:STEP: that worker exits at that step (fault "
                                            "injection, lesson 03) (default: none)", metavar="W:T")


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
        if not sep or not 0 <= out[int(worker)] < math.inf:
            raise ConfigError(f"bad --slow-worker {part!r}; use WORKER:SECONDS with SECONDS >= 0")
    return out


def parse_crash_worker(spec) -> tuple[int, int] | None:
    """``"1:3"`` or ``(1, 3)`` → ``(1, 3)``: worker 1 dies at step 3."""
    if spec is None:
        return None
    try:
        worker, step = spec.split(":") if isinstance(spec, str) else spec
        return int(worker), int(step)
    except (TypeError, ValueError):
        raise ConfigError(f"bad --crash-worker {spec!r}; use WORKER:STEP, e.g. 1:3") from None


class _ParameterServerStrategy(FreeRunning):
    """ps-sync and ps-async: S servers (ranks 0..S-1), W = world − S workers."""

    mode = "sync"
    options = PSOptions
    seams = ("topk_error_feedback",)
    nccl_refusal = ("a server receives from whichever worker sends first (a receive from any "
                    "source, matched by tag); NCCL has neither: it matches a pair's messages in "
                    "the order they were posted, from a named peer")
    checkpointer = ("the parameter server's ranks do not step in lockstep (a server applies "
                    "whichever worker's gradient comes first), so no step has one consistent state "
                    "to save; use ddp or zero1-3 for checkpoints")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        o = cfg.options
        workers = cfg.world_size - o.servers
        if workers < 1:
            raise ConfigError(f"{cls.name} needs at least one server and one worker: --servers "
                              f"{o.servers} of --world-size {cfg.world_size} leaves {workers} "
                              f"workers; use --world-size {o.servers + 1} or fewer --servers")
        check_batch_split(cfg, workers, "workers")
        if cls.mode == "sync" and (o.staleness is not None or o.delay_comp or o.staleness_lr):
            raise ConfigError("--staleness, --delay-comp and --staleness-lr apply to ps-async; use "
                              "--strategy ps-async (--staleness 0 behaves as ps-sync)")
        if o.staleness_lr and o.staleness is not None:
            raise ConfigError("--staleness-lr scales each gradient applied on arrival; with "
                              "--staleness (SSP) a clock's gradients are averaged in one step: "
                              "leave out one of the two")
        for w, seconds in parse_slow_workers(o.slow_worker).items():
            if not 0 <= w < workers:
                raise ConfigError(f"--slow-worker {w}: workers are numbered 0..{workers - 1}")
            if seconds >= cfg.timeout:  # the servers would wait on it until the run timed out
                raise ConfigError(f"--slow-worker {w}:{seconds:g} must be shorter than --timeout "
                                  f"{cfg.timeout:g}: the servers wait at most that long for a "
                                  f"worker's gradient; use fewer seconds (or a larger --timeout)")
        parse_crash_worker(o.crash_worker)
        check_compression(cfg)

    def __init__(self, cfg, comm, seams=None):
        if comm.device.type != "cpu":  # a cluster started on NCCL and handed in
            raise ConfigError(f"{self.name} cannot run on NCCL: {self.nccl_refusal}; start the "
                              "cluster with backend='gloo'")
        super().__init__(cfg, comm, seams)
        o = cfg.options
        self.n_servers = o.servers
        self.server_ranks = list(range(self.n_servers))
        self.worker_ranks = list(range(self.n_servers, comm.size))
        self.model = self.build_model()
        params = list(self.model.parameters())
        self.keys = partition(params, self.n_servers)
        compressor = parse_compressor(o.compress)
        self.is_server = comm.rank < self.n_servers
        if self.is_server:
            mode = self.mode if o.staleness is None else "ssp"
            self.role = ParameterServer(comm, [params[k] for k in self.keys[comm.rank]],
                                        self.worker_ranks, cfg.lr,
                                        Consistency(mode, o.staleness, o.delay_comp,
                                                    o.staleness_lr), compressor)
            self.model, self.optimizer = nn.ParameterList(self.role.params), self.role.optimizer
        else:
            self.index = comm.rank - self.n_servers
            ef = as_error_feedback(compressor, o.error_feedback,
                                   topk_error_feedback=self.seams.topk_error_feedback)
            self.role = Worker(comm, self.model, self.keys, self.server_ranks, ef,
                               delay_s=parse_slow_workers(o.slow_worker).get(self.index, 0.0))
            self.optimizer = None
        self.crash = parse_crash_worker(o.crash_worker)  # fault injection for tests and the lesson

    def run(self, data, on_step=None):
        t0 = now()
        if self.is_server:
            self.role.on_round = on_step  # progress as rounds of W gradients are applied
            losses = self.losses_per_round(self.role.serve(self.cfg.steps))
        else:
            losses = self.work(data)
        seconds = (now() - t0) / self.cfg.steps
        return losses, [seconds] * self.cfg.steps

    def work(self, data) -> list[float]:
        w, n = self.index, len(self.worker_ranks)
        self.role.pull()
        losses = []
        for clock in range(self.cfg.steps):
            if self.crash == (w, clock):
                os._exit(3)  # simulate a worker dying mid-run (the launcher must report it)
            x, y = data.batch(clock, self.cfg.batch_size)
            x, y = shard(x, w, n).to(self.device), shard(y, w, n).to(self.device)
            losses.append(self.role.step(clock, x, y, self.meter))
            if clock + 1 < self.cfg.steps:
                self.role.pull()
        return losses

    def losses_per_round(self, log: list[dict]) -> list[float]:
        """One loss per step: the mean over each round of W applied gradients (sync and SSP: the
        clock's W gradients; async: W consecutive arrivals)."""
        w = len(self.worker_ranks)
        return [sum(e["loss"] for e in log[i:i + w]) / w for i in range(0, len(log), w)]

    @torch.no_grad()
    def final_state(self) -> dict | None:
        """Servers send their keys to server 0, which returns the whole model."""
        if not self.is_server:
            return None
        if self.comm.rank != 0:
            self.comm.send(self.role.unit.flatten(), 0, channel=FINAL)
            return None
        full_model = self.build_model()
        full = list(full_model.parameters())
        for s in range(1, self.n_servers):
            unit = FlatUnit([full[k] for k in self.keys[s]])
            weights = torch.empty(unit.total, device=self.comm.device)
            self.comm.recv(weights, s, channel=FINAL)
            unit.unflatten(weights)
        FlatUnit([full[k] for k in self.keys[0]]).unflatten(self.role.unit.flatten())
        return full_model.state_dict()

    def report(self) -> dict:
        """Role, keys, bytes sent to each peer (lesson 03 draws the graph from it); servers add
        the log of applied gradients, workers the time they spent waiting for pulls."""
        sent: dict[int, int] = {}
        for e in self.comm.tracer.events:
            if e.op == "send":
                sent[e.peer] = sent.get(e.peer, 0) + e.bytes
        out = {"rank": self.comm.rank, "sent_to": sent}
        if self.is_server:
            consistency = self.role.consistency
            return {**out, "role": "server", "mode": consistency.mode,
                    "bound": consistency.staleness,
                    "keys": len(self.keys[self.comm.rank]), "numel": self.role.numel,
                    "log": self.role.log}
        return {**out, "role": "worker", "worker": self.index, "wait_s": self.role.wait_s}


@register
class PSSync(_ParameterServerStrategy):
    name = "ps-sync"
    help = "parameter server, synchronous: servers average all workers' gradients each step"
    mode = "sync"
    apart = ("the parameter server's ranks run their own loops (servers and workers never step "
             "together)")


@register
class PSAsync(_ParameterServerStrategy):
    name = "ps-async"
    help = ("parameter server, asynchronous (--staleness s: bounded, SSP; --delay-comp: DC-ASGD; "
            "--staleness-lr: the step divided by the staleness)")
    mode = "async"
    apart = "the asynchronous parameter server's workers never step together"
