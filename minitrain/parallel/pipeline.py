"""Pipeline parallelism: schedules as data, a validator, and an executor that records what ran (lesson 05).

Papers: GPipe — Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism"; 1F1B — Narayanan et al., 2019, "PipeDream: Generalized Pipeline Parallelism for DNN
Training", and 2021, "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush); interleaved
1F1B — Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"; zero bubble — Qi et al., 2023, "Zero Bubble Pipeline Parallelism" (ZB-H1).  Seeds 000
and 003.

The model's layers are cut into P *stages*, one per rank: the embedding goes with the first stage,
the head and the loss with the last, the transformer blocks are shared out as evenly as they go
(:func:`split_layers`).  A batch is cut into M *micro-batches*; a stage forwards micro-batch m when
the previous stage has sent it the activation, and backwards it when the next stage has sent the
gradient of that activation.  The idle time this forces is the *bubble*: (p−1)/(m+p−1) of the step
for GPipe and 1F1B, (p−1)/(v·m+p−1) for interleaved 1F1B with v model chunks per rank.

**A schedule is data** (a :data:`Table`): for each rank, the ordered list of :class:`Action` s it
runs — ``F`` forward, ``B`` backward, or, for zero-bubble, ``I`` (gradient w.r.t. the stage's input:
what the previous stage waits for) and ``W`` (gradient w.r.t. the weights: nobody waits for it) —
with ``None`` for one unit of idle time.  The same table is

1. made: :func:`make_schedule` writes each rank's *order* of actions (GPipe, 1F1B, Megatron's
   interleaving, ZB-H1) and then :func:`simulate` s it with the ideal durations :data:`COSTS`
   (F = 1, B = 2 = I + W) to place the idles;
2. checked: :func:`validate` (every action once, on the right rank, after what it needs, no
   deadlock) before anything runs;
3. run: :class:`PipelineExecutor` follows its rank's row on the real ranks, sending activations and
   gradients to the neighbouring stages point to point, and records the real start and end of every
   action (:attr:`PipelineExecutor.timeline`) — the measured bubble and in-flight activations come
   from that record, not from the table;
4. drawn: ``minitrain.viz.pipeline`` draws the ideal and the measured timelines with the same code.

Virtual stages (interleaved 1F1B): with V chunks per rank the model is cut into P·V stages and
stage s runs on rank s % P, so a micro-batch goes round the ranks V times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..comm import Comm
from ..memory import ActivationMeter, ledger, rss_bytes
from ..model import GPT, loss_fn
from ..strategies import ConfigError, Strategy, TrainConfig, register

__all__ = ["Action", "COSTS", "SCHEDULES", "Table", "ScheduleError", "make_schedule", "orders",
           "validate", "simulate", "bubble_fraction", "bubble_formula", "peak_in_flight",
           "dependencies", "split_layers", "PipelineStage", "SplitLinear", "PipelineExecutor",
           "Pipeline", "pipeline_options", "check_pipeline", "run_schedule"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` (F, B, I or W) of micro-batch ``microbatch`` on virtual
    stage ``stage`` (it runs on rank ``stage % P``)."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


#: ideal durations in units of one forward: a backward costs two (input- and weight-gradient GEMMs)
COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
Table = list  # list[list[Action | None]]: table[rank] = that rank's actions in order, None = idle


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the offending action."""


# --------------------------------------------------------------------------------------------------
# Making schedules: each rank's order of actions, then the ideal timing
# --------------------------------------------------------------------------------------------------


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """Blocks of each stage: as even as possible, the first ``n_layer % n_stages`` get one more."""
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} stages need at least {n_stages} layers, got {n_layer}")
    q, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + q + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _check_shape(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError("stages, microbatches and chunks must be >= 1, got "
                            f"{stages}, {microbatches}, {chunks}")
    if name == "naive" and microbatches != 1:
        raise ScheduleError(f"the naive schedule runs one batch, no micro-batches: use "
                            f"microbatches=1 (got {microbatches}), or gpipe/1f1b to use micro-batches")
    if name == "interleaved":
        if chunks < 2:
            raise ScheduleError(f"interleaved 1F1B needs chunks >= 2 model chunks per rank, got "
                                f"{chunks}; use chunks=2 (or 1f1b for one chunk)")
        if microbatches % stages:
            fix = stages * max(1, round(microbatches / stages))
            raise ScheduleError(f"interleaved 1F1B (Megatron) needs microbatches to be a multiple of "
                                f"stages={stages}, got {microbatches}; use {fix}")
    elif chunks != 1:
        raise ScheduleError(f"{name} runs one model chunk per rank, got chunks={chunks}; use "
                            "chunks=1, or the interleaved schedule")


def _one_f_one_b(P: int, M: int, r: int, backward: str = "B") -> list[Action]:
    """PipeDream-Flush: P−r−1 warm-up forwards, then one forward / one backward, then the rest."""
    warmup = min(P - r - 1, M)
    order = [Action("F", m, r) for m in range(warmup)]
    for i in range(M - warmup):
        order += [Action("F", warmup + i, r), Action(backward, i, r)]
    return order + [Action(backward, m, r) for m in range(M - warmup, M)]


def _interleaved(P: int, M: int, V: int, r: int) -> list[Action]:
    """Megatron's interleaved 1F1B order on rank r (M a multiple of P).

    The k-th forward of a rank is micro-batch ``(k // (P·V))·P + k % P`` of chunk
    ``(k // P) % V``: groups of P micro-batches go through chunk 0, then chunk 1, ...  Backwards
    go through the chunks in reverse.  Warm-up: 2(P−r−1) + (V−1)·P forwards.
    """
    def action(kind: str, k: int) -> Action:
        group, inner = divmod(k, P * V)
        chunk = inner // P if kind == "F" else V - 1 - inner // P
        return Action(kind, group * P + inner % P, chunk * P + r)

    total = M * V
    warmup = min(2 * (P - r - 1) + (V - 1) * P, total)
    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    return order + [action("B", k) for k in range(total - warmup, total)]


def _zb_h1(P: int, M: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2023): 1F1B's F and I order, with each W put where the rank would wait.

    A greedy list schedule in unit time: a free rank runs its next F or I (in 1F1B order) if its
    inputs are there; otherwise it runs its oldest pending W, filling what would be bubble.  A rank
    never holds more than P micro-batches forwarded but not yet W'd — 1F1B's peak on the first
    stage, so the activation memory is 1F1B's.  Leftover Ws run at the end.
    """
    todo = [_one_f_one_b(P, M, r, backward="I") for r in range(P)]
    out: list[list[Action]] = [[] for _ in range(P)]
    pending: list[list[Action]] = [[] for _ in range(P)]
    held = [0] * P  # forwarded, not yet W'd
    done: dict[Action, int] = {}  # action -> end time
    t = 0
    while any(todo) or any(pending):
        started = []
        for r in range(P):
            if out[r] and done.get(out[r][-1], t + 1) > t:
                continue  # still busy
            nxt = todo[r][0] if todo[r] else None
            ready = nxt is not None and all(done.get(d, t + 1) <= t for d in dependencies(nxt, P, "I"))
            if ready and not (nxt.kind == "F" and held[r] >= P and pending[r]):
                todo[r].pop(0)
                held[r] += nxt.kind == "F"
                if nxt.kind == "I":
                    pending[r].append(Action("W", nxt.microbatch, nxt.stage))
                started.append((r, nxt))
            elif pending[r]:
                held[r] -= 1
                started.append((r, pending[r].pop(0)))
        for r, a in started:
            out[r].append(a)
            done[a] = t + COSTS[a.kind]
        t += 1
    return out


def orders(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (no idles): the heart of each schedule."""
    _check_shape(name, stages, microbatches, chunks)
    P, M = stages, microbatches
    if name in ("naive", "gpipe"):  # all forwards, then all backwards
        return [[Action("F", m, r) for m in range(M)] + [Action("B", m, r) for m in range(M)]
                for r in range(P)]
    if name == "1f1b":
        return [_one_f_one_b(P, M, r) for r in range(P)]
    if name == "interleaved":
        return [_interleaved(P, M, chunks, r) for r in range(P)]
    return _zb_h1(P, M)


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Table:
    """The ideal table of schedule ``name``: each rank's order, with ``None`` for each idle unit
    (placed by :func:`simulate` with :data:`COSTS`)."""
    table = orders(name, stages, microbatches, chunks)
    return with_idles(table, simulate(table))


def with_idles(table: Table, timeline: list[dict]) -> Table:
    """``table`` with one ``None`` per unit of time each rank waits in ``timeline`` (integer costs)."""
    out: Table = [[] for _ in table]
    clock = [0.0] * len(table)
    for e in sorted(timeline, key=lambda e: (e["rank"], e["start"])):
        r = e["rank"]
        out[r] += [None] * round(e["start"] - clock[r])
        out[r].append(e["action"])
        clock[r] = e["end"]
    return out


# --------------------------------------------------------------------------------------------------
# Checking and simulating a table
# --------------------------------------------------------------------------------------------------


def dependencies(a: Action, n_stages: int, backward: str = "B") -> list[Action]:
    """What ``a`` needs done first: F(m,s) ← F(m,s−1); B/I(m,s) ← F(m,s) and the input gradient of
    (m,s+1) (its ``backward``: B, or I under zero-bubble); W(m,s) ← I(m,s)."""
    m, s = a.microbatch, a.stage
    if a.kind == "F":
        return [Action("F", m, s - 1)] if s > 0 else []
    if a.kind == "W":
        return [Action("I", m, s)]
    return [Action("F", m, s)] + ([Action(backward, m, s + 1)] if s + 1 < n_stages else [])


def _actions(table: Table) -> list[tuple[int, Action]]:
    return [(r, a) for r, row in enumerate(table) for a in row if a is not None]


def simulate(table: Table, costs: dict = COSTS) -> list[dict]:
    """The ideal timeline of ``table``: each rank runs its actions in order, each as soon as the
    rank is free and what it needs has finished (sends never block, receives do).  ``None``
    entries are ignored: the waits are recomputed from the dependencies.

    Returns ``[{"rank", "action", "start", "end"}]`` in units of time; raises :class:`ScheduleError`
    naming the blocked actions when no rank can go on (a deadlock).
    """
    acts = _actions(table)
    n_stages = 1 + max((a.stage for _, a in acts), default=0)
    present = {a for _, a in acts}
    rows = [[a for a in row if a is not None] for row in table]
    pos, free = [0] * len(rows), [0.0] * len(rows)
    end: dict[Action, float] = {}
    timeline = []
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while pos[r] < len(row):
                a = row[pos[r]]
                deps = _deps_in(a, n_stages, present)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                end[a] = free[r] = start + costs[a.kind]
                timeline.append({"rank": r, "action": a, "start": start, "end": end[a]})
                pos[r] += 1
                progress = True
    blocked = [(r, row[pos[r]]) for r, row in enumerate(rows) if pos[r] < len(row)]
    if blocked:
        waits = []
        for r, a in blocked:
            missing = [d for d in _deps_in(a, n_stages, present) if d not in end]
            waits.append(f"rank {r} waits on {a} (needs {', '.join(map(str, missing))})")
        raise ScheduleError("deadlock: " + ", ".join(waits))
    return timeline


def _deps_in(a: Action, n_stages: int, present: set) -> list[Action]:
    """dependencies() with the next stage's input gradient as whichever of B / I the table has."""
    backward = "I" if Action("I", a.microbatch, a.stage + 1) in present else "B"
    return dependencies(a, n_stages, backward)


def validate(table: Table, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raise :class:`ScheduleError` unless ``table`` can run: every forward and backward (B, or
    I and W) of every (micro-batch, stage) exactly once, on rank ``stage % stages``, each after what
    it needs on its own rank, and no deadlock between ranks."""
    P, S = stages, stages * chunks
    if len(table) != P:
        raise ScheduleError(f"the table has {len(table)} rows, expected one per rank ({P})")
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(table):
        for i, a in enumerate(row):
            if a is None:
                continue
            if not isinstance(a, Action) or a.kind not in COSTS:
                raise ScheduleError(f"rank {r}: {a!r} is not an Action of kind F, B, I or W")
            if not (0 <= a.microbatch < microbatches and 0 <= a.stage < S):
                raise ScheduleError(f"rank {r}: {a} is out of range (micro-batches 0..{microbatches - 1},"
                                    f" stages 0..{S - 1})")
            if a.stage % P != r:
                raise ScheduleError(f"rank {r}: {a} is on the wrong rank; stage {a.stage} runs on "
                                    f"rank {a.stage % P}")
            if a in where:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            where[a] = (r, i)
    for m in range(microbatches):
        for s in range(S):
            split = Action("I", m, s) in where or Action("W", m, s) in where
            if split and Action("B", m, s) in where:
                raise ScheduleError(f"rank {s % P}: B{m}@s{s} and I/W{m}@s{s} both present; use "
                                    "either B or the I+W pair")
            for kind in ("F", "I", "W") if split else ("F", "B"):
                if Action(kind, m, s) not in where:
                    raise ScheduleError(f"missing: {Action(kind, m, s)} (rank {s % P})")
    present = set(where)
    for a, (r, i) in where.items():
        for d in _deps_in(a, S, present):
            if where[d][0] == r and where[d][1] > i:
                raise ScheduleError(f"rank {r}: {a} comes before {d}")
    simulate(table)


# --------------------------------------------------------------------------------------------------
# What a timeline says: bubble and activations in flight
# --------------------------------------------------------------------------------------------------


def bubble_fraction(timeline: list[dict], stages: int) -> float:
    """Idle share of the step: 1 − busy / (stages · makespan), makespan from the first start to the
    last end.  Works for ideal (:func:`simulate`) and measured (executor) timelines."""
    if not timeline:
        return 0.0
    span = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    total = stages * span
    busy = sum(e["end"] - e["start"] for e in timeline)
    return (total - busy) / total if total > 0 else 0.0


def bubble_formula(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p−1)/(v·m + p−1): GPipe and 1F1B (v = 1), interleaved 1F1B with v chunks per rank."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def peak_in_flight(table_or_timeline) -> dict[int, int]:
    """Per rank, the most (micro-batch, stage) pairs forwarded and not yet backwarded at any time
    — what sets activation memory.  Under zero-bubble a pair is held until its W (the weight
    gradient still needs the stashed layer inputs).  Accepts a table or a timeline."""
    rows: dict[int, list[Action]] = {}
    if table_or_timeline and isinstance(table_or_timeline[0], dict):
        for e in sorted(table_or_timeline, key=lambda e: (e["rank"], e["start"])):
            rows.setdefault(e["rank"], []).append(_as_action(e["action"]))
    else:
        rows = {r: [a for a in row if a is not None] for r, row in enumerate(table_or_timeline)}
    peaks = {}
    for r, acts in rows.items():
        held = peak = 0
        for a in acts:
            held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks[r] = peak
    return peaks


def _as_action(a) -> Action:
    """An Action from an Action or its string ("F3@s1"), so reported timelines can be re-read."""
    if isinstance(a, Action):
        return a
    kind, rest = a[0], a[1:]
    m, s = rest.split("@s")
    return Action(kind, int(m), int(s))


# --------------------------------------------------------------------------------------------------
# The model cut into stages
# --------------------------------------------------------------------------------------------------


class PipelineStage(nn.Module):
    """Virtual stage ``stage`` of ``n_stages``: the GPT's embedding (first stage), its share of the
    blocks, and the head (last stage) — the same module objects, under the same names, so the
    stages' state_dicts put together are the single-process state_dict."""

    def __init__(self, model: GPT, stage: int, n_stages: int):
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == n_stages - 1
        self.embed = model.embed if self.first else None
        layers = split_layers(model.cfg.n_layer, n_stages)[stage]
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.head = model.head if self.last else None
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


# --------------------------------------------------------------------------------------------------
# The executor: one rank's row of the table, on the real ranks
# --------------------------------------------------------------------------------------------------


class PipelineExecutor:
    """Runs this rank's row of ``table`` for one batch, and records what really happened.

    Activations go to the next stage and their gradients back with non-blocking sends (handles kept,
    waited at the end of the step); every receive the row needs is posted before the step starts
    and waited where the action needs it.  ``timeline`` holds, after :meth:`step`, one
    ``{"rank", "action", "start", "end"}`` per action: seconds after rank 0 left the barrier that
    starts the step (one clock for all ranks of a host; ranks on different hosts have different
    clocks, so there only each rank's own times compare); an action starts once its input has
    arrived, so waiting counts as idle.

    Micro-batches are ``torch.tensor_split`` of the batch (sizes may differ by one); micro-batch
    m's loss is weighted by its share of the batch, so the accumulated gradient and the summed loss
    are the global mean's.  ``peak_bytes`` is the most activation memory held at once (bytes saved
    for backward by the forwards not yet backwarded — until W under zero-bubble).
    """

    def __init__(self, stages: dict[int, PipelineStage], table: Table, comm: Comm,
                 microbatches: int, d_model: int, *, activation_shape=None, loss=loss_fn):
        self.stages, self.comm, self.M, self.d_model = stages, comm, microbatches, d_model
        # what travels between stages for a micro-batch of b samples of t tokens (default (b, t, d));
        # the 3D mesh (lesson 08) sends tensor-parallel activations, (t, b, d) or a sequence shard
        self.activation_shape = activation_shape or (lambda b, t: (b, t, d_model))
        self.loss = loss  # (last stage's output, targets) -> the micro-batch's mean loss
        self.P = len(table)
        self.S = 1 + max(a.stage for _, a in _actions(table))
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

    def _post_receives(self, shapes: list[tuple], dtype) -> None:
        self.inbox = {}
        for a in self.row:
            need = self._needs(a)
            if need is None or need[1] % self.P == self.comm.rank:
                continue  # nothing to receive, or it comes from this rank (self.local)
            buf = torch.empty(shapes[a.microbatch], dtype=dtype, device=self.device)
            work = self.comm.irecv(buf, need[1] % self.P, tag="pp",
                                   channel=self._channel(need[0], a.microbatch, a.stage))
            self.inbox[a] = (buf, work)

    def _receive(self, a: Action) -> torch.Tensor:
        if a in self.inbox:
            buf, work = self.inbox.pop(a)
            work.wait()
            return buf
        return self.local.pop((a.kind == "F", a.microbatch, a.stage))

    def _send(self, t: torch.Tensor, grad: bool, m: int, stage: int) -> None:
        dst = stage % self.P
        if dst == self.comm.rank:  # the next virtual stage lives here too (e.g. one rank)
            self.local[(not grad, m, stage)] = t
        else:
            work = self.comm.isend(t, dst, tag="pp", channel=self._channel(grad, m, stage))
            self.sends.append((work, t))

    # -- the actions

    def _forward(self, a: Action, inp) -> None:
        stage, m = self.stages[a.stage], a.microbatch
        with self.meter.measure():
            out = stage(inp)
            if stage.last:
                y = self.ys[m]
                out = self.loss(out, y) * (y.shape[0] / self.batch)
        self.held[(m, a.stage)] = self.meter.last
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))
        self.saved[(m, a.stage)] = (inp, out)
        if stage.last:
            self.losses.append(out.detach())
        else:
            self._send(out.detach(), False, m, a.stage + 1)

    def _backward(self, a: Action, grad) -> None:
        stage, m = self.stages[a.stage], a.microbatch
        inp, out = self.saved.pop((m, a.stage))
        split = stage.split_linears() if a.kind == "I" else []
        for layer in split:
            layer.key = m
        out.backward(grad)  # grad is None on the last stage: out is the loss
        for layer in split:
            layer.key = None
        if a.stage > 0:
            self._send(inp.grad, True, m, a.stage - 1)
        if a.kind == "B":
            self.held.pop((m, a.stage))

    def _weights(self, a: Action, _) -> None:
        for layer in self.stages[a.stage].split_linears():
            layer.weight_grad(a.microbatch)
        self.held.pop((a.microbatch, a.stage))

    def _input(self, a: Action):
        if a.kind == "F" and a.stage == 0:
            return self.xs[a.microbatch]
        if self._needs(a) is None:
            return None
        t = self._receive(a)
        return t.requires_grad_() if a.kind == "F" else t

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward the batch ``(x, y)`` by this rank's row; gradients accumulate in
        the stages' ``.grad``.  Returns the batch's mean loss (the same float on every rank)."""
        self.xs, self.ys = torch.tensor_split(x, self.M), torch.tensor_split(y, self.M)
        self.batch = x.shape[0]
        self._post_receives([self.activation_shape(len(t), x.shape[1]) for t in self.xs], self.dtype)
        self.saved, self.local, self.sends, self.losses = {}, {}, [], []
        run = {"F": self._forward, "B": self._backward, "I": self._backward, "W": self._weights}
        t0 = self._common_t0()
        self.timeline = []
        for a in self.row:
            inp = self._input(a)  # waiting for a message is idle time, not the action's
            start = time.perf_counter()
            run[a.kind](a, inp)
            self.timeline.append({"rank": self.comm.rank, "action": a,
                                  "start": start - t0, "end": time.perf_counter() - t0})
        for work, _ in self.sends:
            work.wait()
        return self._global_loss()

    def _common_t0(self) -> float:
        """After a barrier, rank 0's clock reading, for every rank: one time origin for the step.
        (``perf_counter`` is the machine's monotonic clock, shared by the ranks of one host;
        each rank's own reading after the barrier could differ by milliseconds.)"""
        dist.barrier(group=self.comm.group)
        t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
        dist.broadcast(t0, self.comm.global_rank(0), group=self.comm.group)
        return t0.item()

    def _global_loss(self) -> float:
        """The last stage's summed loss, broadcast to every rank (a metric: untraced)."""
        total = (torch.stack(self.losses).sum().float() if self.losses
                 else torch.zeros((), device=self.device))
        dist.broadcast(total, self.comm.global_rank((self.S - 1) % self.P), group=self.comm.group)
        return total.item()



# --------------------------------------------------------------------------------------------------
# The strategy for `minitrain train`, and a one-call runner for notebooks
# --------------------------------------------------------------------------------------------------


def pipeline_options(cfg: TrainConfig, stages: int | None = None) -> tuple[str, int, int, int]:
    """(schedule, stages P, micro-batches M, chunks V) from ``cfg.options``, with the defaults:
    1f1b, P = ``stages`` or the world size, M = P (1 for naive), V = 1 (2 for interleaved)."""
    o = cfg.options
    schedule = o.get("schedule") or "1f1b"
    stages = stages or o.get("stages") or cfg.world_size
    microbatches = o.get("microbatches") or (1 if schedule == "naive" else stages)
    chunks = o.get("chunks") or (2 if schedule == "interleaved" else 1)
    return schedule, stages, microbatches, chunks


def check_pipeline(cfg: TrainConfig, schedule: str, P: int, M: int, V: int, batch: int,
                   batch_name: str = "--batch-size") -> None:
    """Refuse, naming the fix, a pipeline of P stages x V chunks running M micro-batches of a batch
    of ``batch`` samples (the whole batch here; a data-parallel replica's share in the 3D mesh)."""
    n_layer = cfg.model.n_layer
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown --schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    if M < 1 or V < 1:
        raise ConfigError(f"--microbatches and --chunks must be >= 1, got {M} and {V}")
    if P * V > n_layer:
        raise ConfigError(f"{P} stages x {V} chunks = {P * V} pipeline stages but the model has "
                          f"{n_layer} layers; use --n-layer {P * V} or more, or fewer "
                          "stages/chunks")
    if M > batch:
        raise ConfigError(f"--microbatches {M} is more than {batch_name} {batch}: each micro-batch "
                          f"needs at least one sample; use --microbatches {batch} or fewer")
    if schedule == "naive" and M != 1:
        raise ConfigError(f"--schedule naive runs the whole batch at once; use --microbatches 1 "
                          f"(got {M}), or --schedule gpipe/1f1b for micro-batches")
    if schedule == "interleaved" and V < 2:
        raise ConfigError(f"--schedule interleaved needs --chunks 2 or more, got {V}")
    if schedule == "interleaved" and M % P:
        raise ConfigError(f"--schedule interleaved needs --microbatches a multiple of --stages "
                          f"{P} (Megatron), got {M}; use --microbatches "
                          f"{P * max(1, round(M / P))}")
    if schedule != "interleaved" and V != 1:
        raise ConfigError(f"--schedule {schedule} runs one model chunk per rank; leave out "
                          f"--chunks {V} (or use --schedule interleaved)")
    if cfg.model.tie_weights and P > 1:
        raise ConfigError("pipeline cannot tie the embedding (first stage) to the head (last "
                          "stage); use a model with tie_weights=False")
    if schedule == "zb-h1" and cfg.checkpoint_activations:
        raise ConfigError("--schedule zb-h1 cannot checkpoint activations (the W pass needs "
                          "the stashed inputs); leave out --checkpoint-activations")


@register
class Pipeline(Strategy):
    """One stage (or V chunks) per rank; the batch in micro-batches run by a schedule table."""

    name = "pipeline"
    help = ("pipeline parallel: layers split into --stages, --microbatches run by --schedule "
            "naive|gpipe|1f1b|interleaved|zb-h1 (--chunks for interleaved)")
    checkpoint_refusal = None  # each rank saves its stages and their optimizer state

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--stages", type=int, default=None,
                            help="pipeline: number of stages (default and only choice: world size)")
        parser.add_argument("--microbatches", type=int, default=None,
                            help="pipeline: micro-batches per batch (default: stages; naive: 1)")
        parser.add_argument("--schedule", default=None,
                            help=f"pipeline: {', '.join(SCHEDULES)} (default 1f1b)")
        parser.add_argument("--chunks", type=int, default=None,
                            help="pipeline: model chunks per rank (interleaved; default 2 there)")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super().check(cfg)
        schedule, P, M, V = pipeline_options(cfg)
        if P != cfg.world_size:
            raise ConfigError(f"--stages {P} must equal --world-size {cfg.world_size} (one rank per "
                              f"stage); use --world-size {P} or leave --stages out")
        check_pipeline(cfg, schedule, P, M, V, cfg.batch_size)

    def __init__(self, cfg: TrainConfig, comm: Comm):
        super().__init__(cfg, comm)
        self.schedule, self.P, self.M, self.V = pipeline_options(cfg)
        self.table = make_schedule(self.schedule, self.P, self.M, self.V)
        validate(self.table, self.P, self.M, self.V)
        model, n_stages = self.build_model(), self.P * self.V
        self.stages = {s: PipelineStage(model, s, n_stages)
                       for s in range(comm.rank, n_stages, self.P)}
        if self.schedule == "zb-h1":
            for stage in self.stages.values():
                split_weight_gradients(stage)
        self.model = nn.ModuleList(self.stages.values())  # this rank's parameters only
        self.optimizer = self.make_optimizer(self.model.parameters())
        self.executor = PipelineExecutor(self.stages, self.table, comm, self.M, cfg.model.d_model)
        self.timelines: list[list[dict]] = []  # this rank's measured timeline, per step

    def train_step(self, x, y) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.executor.step(x.to(self.device), y.to(self.device))
        self.optimizer.step()  # after the flush: every micro-batch's gradient is in
        self.timelines.append(self.executor.timeline)
        return loss

    def fit(self, data, on_step=None):
        out = super().fit(data, on_step)
        self.gather()
        return out

    def gather(self) -> None:
        """Every rank gets all ranks' timelines; rank 0 the full state_dict (untraced)."""
        everyone = [None] * self.comm.size
        dist.all_gather_object(everyone, self.timelines, group=self.comm.group)
        self.step_timelines = [sorted((e for rank in everyone for e in rank[i]),
                                      key=lambda e: (e["rank"], e["start"]))
                               for i in range(len(self.timelines))]
        states = [None] * self.comm.size if self.comm.rank == 0 else None
        mine = {k: v.detach().cpu() for k, v in self.stage_state().items()}
        dist.gather_object(mine, states, dst=self.comm.global_rank(0), group=self.comm.group)
        self._state = merge_stages(states, self.cfg.model) if states is not None else None

    def stage_state(self) -> dict:
        """This rank's stages' state_dict under the single-process names (no ModuleList index)."""
        return {k.split(".", 1)[1]: v for k, v in self.model.state_dict().items()}

    # -- checkpoints (lesson 08): each rank saves its stages and their optimizer state --------------

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        _, stages, _, chunks = pipeline_options(cfg)
        return {"stages": stages, "chunks": chunks}

    def checkpoint_state(self) -> dict:
        return {"model": self.stage_state(), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, read) -> None:
        state = read(self.comm.rank)
        indexed = {k.split(".", 1)[1]: k for k in self.model.state_dict()}
        self.model.load_state_dict({indexed[k]: v for k, v in state["model"].items()})
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate_checkpoint(cls, cfg: TrainConfig, read) -> dict:
        return merge_stages([read(r)["model"] for r in range(cfg.world_size)], cfg.model)

    def state_dict(self) -> dict:
        """The full model's state_dict, single-process names, on rank 0 after :meth:`fit`."""
        if getattr(self, "_state", None) is None:
            raise RuntimeError("pipeline gathers the full state at the end of fit(), on rank 0 only")
        return self._state

    def memory(self) -> dict:
        out = ledger(self.model, self.optimizer, self.executor.peak_bytes)
        out["rss_peak"] = rss_bytes(peak=True)
        return out

    def report(self) -> dict:
        """The schedule, its ideal table and the measured run: ``bubble_measured`` is the median of
        the steps' bubbles (the first step left out when there are more); ``timeline`` is the last
        step's measured timeline (all ranks, actions as strings); ``peak_in_flight`` is measured
        from it, ``peak_in_flight_ideal`` read from the table."""
        steps = getattr(self, "step_timelines", None) or [self.executor.timeline]
        bubbles = [bubble_fraction(t, self.P) for t in steps]
        ideal = simulate(self.table)
        return {
            "rank": self.comm.rank, "schedule": self.schedule, "stages": self.P,
            "microbatches": self.M, "chunks": self.V,
            "layers": {s: list(split_layers(self.cfg.model.n_layer, self.P * self.V)[s])
                       for s in self.stages},
            "bubble_measured": statistics.median(bubbles[1:] or bubbles),
            "bubble_per_step": bubbles,
            "bubble_formula": bubble_formula(self.P, self.M, self.V),
            "bubble_ideal": bubble_fraction(ideal, self.P),
            "peak_in_flight": peak_in_flight(steps[-1]),
            "peak_in_flight_ideal": peak_in_flight(self.table),
            "activation_bytes_peak": self.executor.peak_bytes,
            "timeline": [{**e, "action": str(e["action"])} for e in steps[-1]],
            "table": [[str(a) if a is not None else None for a in row] for row in self.table],
        }


def merge_stages(states: list[dict], model) -> dict:
    """The single-process state_dict of GPT(``model``) from the ranks' stage states, in its order."""
    merged = {k: v for s in states for k, v in s.items()}
    return {k: merged[k] for k in GPT(model).state_dict()}


def run_schedule(schedule: str = "1f1b", microbatches: int | None = None,
                 chunks: int | None = None, *, model=None, batch_size: int = 8, steps: int = 1,
                 seed: int = 0, lr: float = 1e-3) -> dict:
    """Run ``steps`` pipeline steps on every rank of a live cluster, one stage per rank — for a
    notebook: ``cluster.run(run_schedule, "gpipe", 4)[0]``.

    Returns (on every rank) :meth:`Pipeline.report` plus ``"losses"``: ``timeline`` is the last
    step's measured timeline of all ranks, ``table`` the ideal table, beside their bubbles.
    """
    from ..data import ArithmeticData
    from ..model import PRESETS

    cfg = TrainConfig(strategy="pipeline", world_size=dist.get_world_size(), steps=steps,
                      seed=seed, batch_size=batch_size, lr=lr, model=model or PRESETS["tiny"],
                      options={"schedule": schedule, "microbatches": microbatches,
                               "chunks": chunks})
    Pipeline.check(cfg)
    strategy = Pipeline(cfg, Comm())
    losses, _ = strategy.fit(ArithmeticData(cfg.model.seq_len, seed))
    return {**strategy.report(), "losses": losses}
