"""A real run re-timed on a cluster: every timing the course teaches, shown where it holds (issue 25).

On a laptop the ranks share two cores over loopback, so a run's own times say little about a real
cluster.  But the run *recorded* what it did — every collective with its bytes and group, when each
rank issued it and waited for it (:mod:`minitrain.comm`), each step's optimizer step — and
:func:`project` replays that record on a cluster model (:mod:`minitrain.clusters`), discrete-event:

* each rank has one compute stream and, per process group, one communication stream (NCCL gives
  every process group its own stream);
* a compute span (the time between two calls into the communicator) takes its share of the rank's
  FLOPs for the step — computed from the model's shapes and the layout (forward, backward,
  recomputation: :func:`minitrain.model.training_flops`) and split over the spans by their measured
  durations — at the device's sustained FLOP rate; the optimizer's spans, memory-bound, move 28
  bytes per parameter of the rank's shard at the memory bandwidth;
* a collective starts when every member of its group has issued it (and its stream is free), and
  takes its α-β time on the link its group spans — inside a node or across nodes, from the rank
  placement (:meth:`~minitrain.clusters.ClusterSpec.seconds`);
* a point-to-point message arrives one transfer after both its send and its receive are posted;
* a wait blocks the compute stream until its communication is done.

``project(result, "dgx-h100", model="7b")`` re-times the same layout for a bigger model of the
same family: each message scaled by what it carries — gradients and weights by the parameters of
the layers they stand for, activations by micro-batch × sequence × hidden — and each per-layer
message repeated for the target's layers.  ``project(result, "local")`` replays the run with its own
measured compute on this machine's α-β: it must give the measured step time back (the
self-consistency of ``benchmarks/projection_bench.py``).

Output: each rank's projected timeline (tracer-style events), the step time and its parts
(compute, exposed communication, bubble, idle), the share of communication hidden, MFU, and the
memory per device from the ledger, scaled.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace

from .clusters import ClusterSpec, get_cluster, parse
from .memory import GB, model_state_bytes
from .model import GPTConfig, training_flops
from .parallel.schedules import split_layers

__all__ = ["MODEL_SIZES", "target_model", "check_projection", "project", "replay", "Op",
           "Instance", "ReplayError", "rank_work", "Scaler", "format_projection", "breakdown", "warp", "ddp_timeline",
           "pipeline_timeline",
           "NOT_REPLAYED"]

#: Bigger models of the same family (GPT-2 shaped: 4h-wide GeLU MLPs, learned positions), by the
#: shapes of Brown et al., 2020, "Language Models are Few-Shot Learners", Table 2.1 (GPT-3 XL 1.3B,
#: 2.7B, 6.7B, 13B — its 13B's d_model 5140 is 5120 here, 40 heads of 128) and Radford et al., 2019
#: (GPT-2 124M); vocabulary 50,257, 2,048 positions.
MODEL_SIZES = {
    "gpt2": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "1.3b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "2.7b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=32, n_head=32, d_model=2560),
    "7b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=32, n_head=32, d_model=4096),
    "13b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=40, n_head=40, d_model=5120),
}
#: free-running strategies: their ranks share no steps to replay
NOT_REPLAYED = {"ps-sync": "the parameter server's ranks run their own loops (servers and "
                           "workers never step together), so there is no shared step to re-time",
                "ps-async": "the asynchronous parameter server's workers never step together, so "
                            "there is no shared step to re-time"}
#: Adam's update reads the weight, the gradient and two moments and writes three: 7 fp32 words
ADAM_BYTES = 28
_DATA_PARALLEL = ("single", "ddp", "ddp-naive", "zero1", "zero2", "zero3", "expert")


class ReplayError(RuntimeError):
    """The event log cannot be replayed (a wait whose communication is never issued by all)."""


# --------------------------------------------------------------------------------------------------
# The model to project to, and the checks made before any process starts
# --------------------------------------------------------------------------------------------------


def target_model(as_model, run: GPTConfig) -> GPTConfig:
    """The GPTConfig ``as_model`` names (a key of :data:`MODEL_SIZES`, a GPTConfig, or None: the
    run's own model); a mixture of experts keeps the run's experts, top-k and expert width ratio."""
    if as_model is None:
        return run
    if isinstance(as_model, GPTConfig):
        cfg = as_model
    else:
        key = str(as_model).lower()
        if key not in MODEL_SIZES:
            raise ValueError(f"unknown model size {as_model!r}; choose one of: "
                             f"{', '.join(MODEL_SIZES)} (or pass a GPTConfig)")
        cfg = MODEL_SIZES[key]
    if run.n_expert and not cfg.n_expert:
        cfg = replace(cfg, n_expert=run.n_expert, top_k=run.top_k,
                      d_ff=cfg.d_model * run.ff // run.d_model)
    return cfg


def check_projection(project: str | None, as_model=None, *, strategy: str = "", world_size: int = 1,
                     options: dict | None = None, model: GPTConfig | None = None,
                     batch_size: int | None = None) -> None:
    """Raise ValueError, naming the choices, for a projection that cannot be made: an unknown
    cluster or model size, a free-running strategy, more ranks than the cluster has, or a layout the
    target model cannot take (heads or layers that do not split)."""
    if project is None:
        if as_model is not None:
            raise ValueError("--as-model needs --project CLUSTER (the model is projected on a "
                             "cluster); e.g. --project dgx-h100 --as-model 7b")
        return
    name, _ = parse(project)
    if strategy in NOT_REPLAYED:
        raise ValueError(f"strategy {strategy!r} cannot be projected: {NOT_REPLAYED[strategy]}; "
                         "project a lockstep strategy (ddp, zero1-3, pipeline, tensor, 3d, ...)")
    cluster = get_cluster(project) if name not in ("local", "binder") else None
    if cluster is not None and world_size > cluster.devices:
        raise ValueError(f"{world_size} ranks do not fit {cluster.title}: it has {cluster.devices} "
                         f"devices; use {name}xN with N >= {math.ceil(world_size / 8)} nodes or "
                         "fewer ranks")
    run = model or GPTConfig()
    cfg = target_model(as_model, run)
    opts = options or {}
    tp = opts.get("tp") or (world_size if strategy == "tensor" else 1)
    if cfg.n_head % tp or cfg.ff % tp:
        raise ValueError(f"--as-model {as_model}: its {cfg.n_head} heads (d_ff {cfg.ff}) do not "
                         f"split over tensor parallelism {tp}")
    stages = (opts.get("stages") or world_size) if strategy == "pipeline" else opts.get("pp") or 1
    chunks = opts.get("chunks") or (2 if opts.get("schedule") == "interleaved" else 1)
    if stages * chunks > cfg.n_layer:
        raise ValueError(f"--as-model {as_model}: {cfg.n_layer} layers cannot fill {stages} stages "
                         f"x {chunks} chunks")
    cp = opts.get("cp") or 1
    if cfg.seq_len % (2 * cp if cp > 1 else 1):
        raise ValueError(f"--as-model {as_model}: its {cfg.seq_len} positions do not split over "
                         f"context parallelism {cp} (2·cp chunks)")


# --------------------------------------------------------------------------------------------------
# The layout: what each rank computes and holds
# --------------------------------------------------------------------------------------------------


def _report(summary: dict, rank: int) -> dict:
    reports = summary.get("report") or []
    return reports[rank] if rank < len(reports) and reports[rank] else {}


def _stages(report: dict, key: str) -> list[int]:
    return sorted(int(s) for s in (report.get(key) or {}))


def _layout(summary: dict) -> dict:
    """dp, pp, tp, cp, ep, micro-batches, virtual stages of the run (from its options and reports)."""
    s, w = summary["strategy"], summary["world_size"]
    opts = summary.get("options") or {}
    r0 = _report(summary, 0)
    out = {"dp": 1, "pp": 1, "tp": 1, "cp": 1, "ep": 1, "m": 1, "chunks": 1, "zero": 0}
    if s in _DATA_PARALLEL:
        out["dp"] = w
        out["zero"] = int(s[-1]) if s.startswith("zero") else 0
        out["ep"] = w if s == "expert" else 1
    elif s == "pipeline":
        out.update(pp=w, m=r0.get("microbatches", w), chunks=r0.get("chunks", 1))
    elif s == "tensor":
        out["tp"] = w
    elif s == "context":
        out.update(dp=r0.get("dp", 1), cp=r0.get("cp", w))
    elif s == "3d":
        out.update(dp=r0["dp"], pp=r0["pp"], tp=r0["tp"], cp=r0.get("cp", 1),
                   m=r0.get("microbatches", 1), chunks=r0.get("chunks", 1),
                   zero=r0.get("zero_stage", opts.get("zero_stage", 1)))
    else:
        raise ValueError(f"strategy {s!r} cannot be projected: "
                         f"{NOT_REPLAYED.get(s, 'its layout is not known to the projection')}")
    return out


@dataclass
class RankWork:
    """What one rank computes per step and holds, at one model size."""

    tokens: float          # tokens through this rank's blocks per step
    blocks: int            # transformer blocks it holds
    embed: bool
    head: bool
    tp: int
    flops: float           # per step, forward + backward (+ recomputation)
    model_flops: float     # the same without recomputation (MFU's numerator)
    params: float          # parameters this rank holds (its replica's share)
    opt_params: float      # parameters whose optimizer step it takes (ZeRO: 1/dp of them)
    block_params: float    # per block, this rank's share
    embed_params: float
    head_params: float


def rank_work(summary: dict, cfg: GPTConfig, rank: int, degrees: dict | None = None,
              recompute: bool | None = None) -> RankWork:
    """Rank ``rank``'s work per step for model ``cfg`` in the run's layout (the run's own model, or
    a bigger one: the same stages, degrees and batch; blocks split as the run split its own);
    ``degrees`` ({"tp": 8}) re-sizes tensor parallelism (data parallelism leaves a rank's work
    as it is: each replica takes its own micro-batches)."""
    lay, s = dict(_layout(summary)), summary["strategy"]
    lay.update({k: v for k, v in (degrees or {}).items() if k == "tp"})
    rep = _report(summary, rank)
    batch, seq = summary["batch_size"], cfg.seq_len
    L, tp = cfg.n_layer, lay["tp"]
    embed = head = True
    if s in ("pipeline", "3d"):
        stages = _stages(rep, "layers" if s == "pipeline" else "stages")
        virtual = lay["pp"] * lay["chunks"]
        split = split_layers(L, virtual)
        blocks = sum(len(split[st]) for st in stages)
        embed, head = 0 in stages, virtual - 1 in stages
    else:
        blocks = L
    tokens = batch * seq / (_layout(summary)["dp"] * lay["cp"])
    if recompute is None:
        recompute = bool(summary.get("checkpoint_activations"))
    flops = training_flops(cfg, tokens, blocks, head, tp=tp, recompute=recompute)
    model_flops = training_flops(cfg, tokens, blocks, head, tp=tp)
    block = cfg.block_params() / tp
    if cfg.n_expert and lay["ep"] > 1:
        d, ff = cfg.d_model, cfg.ff
        expert = (d * ff + ff) + (ff * d + d)
        block -= cfg.n_expert * expert * (1 - 1 / lay["ep"])
    emb = cfg.embed_params() / (tp if tp > 1 else 1) if embed else 0.0
    hd = cfg.head_params() / tp if head else 0.0
    params = blocks * block + emb + hd
    dp = (degrees or {}).get("dp") or lay["dp"]
    opt = params / dp if lay["zero"] >= 1 else params
    return RankWork(tokens, blocks, embed, head, tp, flops, model_flops, params, opt, block, emb, hd)


# --------------------------------------------------------------------------------------------------
# What a message carries, and how it scales to another model size
# --------------------------------------------------------------------------------------------------

_PARAM_TAGS = ("bucket", "grad", "params", "replicated-grads", "sequence-parallel-grads",
               "compressed:", "ring", "state-unit", "push", "pull")
_CONSTANT_TAGS = ("loss", "moe counts", "unused-map", "untraced", "init")


def _carries(event: dict) -> str:
    """"param" (gradients, weights), "activation", or "constant" (a metric, a count)."""
    tag = event.get("tag") or ""
    if not event.get("traced", True) or tag in _CONSTANT_TAGS or tag.startswith("head.loss"):
        return "constant"
    if tag.startswith(_PARAM_TAGS):
        return "param"
    return "activation"


def _per_layer(event: dict, cfg: GPTConfig) -> str | None:
    """"block" when the message belongs to one transformer layer (a per-layer collective, a
    ZeRO-3 block unit), "embed"/"head" for those units, None otherwise."""
    tag = event.get("tag") or ""
    if tag.startswith(("params-unit", "grad-unit")):
        i = int(tag.split("unit")[1])
        return "embed" if i == 0 else "block" if i <= cfg.n_layer else "head"
    if tag.startswith(("blocks.", "cp ", "all_to_all")) or ".blocks." in tag:
        return "block"
    return None


class Scaler:
    """Bytes of one message at the target size, and how many such messages it stands for.

    Gradients and weights scale with the parameters they carry: a ZeRO-3 unit with its own
    (embedding, head, or one block's), a bucket or a flat shard with the rank's parameters.
    Activations scale with micro-batch × sequence × hidden (per-token scalars, a
    vocabulary-parallel loss's, with micro-batch × sequence).  A per-layer message stands for L'/L
    of the target's layers (``repeat``).  ``itemsizes``: (run, target) bytes per element."""

    def __init__(self, summary: dict, run: GPTConfig, target: GPTConfig,
                 itemsizes: tuple[int, int] = (4, 4), degrees: dict | None = None):
        self.run, self.target, self.items = run, target, itemsizes
        self.same = run == target and itemsizes[0] == itemsizes[1] and not degrees
        self.dtype = itemsizes[1] / itemsizes[0]
        world = summary["world_size"]
        mine = [rank_work(summary, run, r) for r in range(world)]
        theirs = [rank_work(summary, target, r, degrees) for r in range(world)]
        self.param_ratio = [t.params / max(m.params, 1.0) for m, t in zip(mine, theirs)]
        self.block_ratio = [t.block_params / max(m.block_params, 1.0) for m, t in zip(mine, theirs)]
        lay = _layout(summary)
        self.tokens_mb = summary["batch_size"] / (lay["dp"] * lay["m"]) * run.seq_len / lay["cp"]

    def __call__(self, event: dict, rank: int) -> tuple[float, float]:
        nbytes, kind = float(event["bytes"]), _carries(event)
        if self.same:
            return nbytes, 1.0
        run, target = self.run, self.target
        layer = _per_layer(event, run)
        repeat = target.n_layer / run.n_layer if layer == "block" else 1.0
        if kind == "constant":
            return nbytes, repeat
        if kind == "param":
            if layer == "block":
                return nbytes * self.dtype * self.block_ratio[rank], repeat
            if layer in ("embed", "head"):
                attr = "embed_params" if layer == "embed" else "head_params"
                return nbytes * self.dtype * getattr(target, attr)() / getattr(run, attr)(), 1.0
            return nbytes * self.dtype * self.param_ratio[rank], 1.0
        per_token = nbytes / self.items[0] / max(self.tokens_mb, 1.0)
        width = target.d_model / run.d_model if per_token > 4 else 1.0
        return nbytes * self.dtype * target.seq_len / run.seq_len * width, repeat


# --------------------------------------------------------------------------------------------------
# Event logs -> per-rank programs
# --------------------------------------------------------------------------------------------------


@dataclass
class Op:
    """One entry of a rank's program: ``compute`` (``seconds`` measured, ``phase`` "forward",
    "model" (backward, recomputation, anything else of the step) or "optimizer"), ``issue`` (post communication ``key``; ``seconds``: the call's own time) or
    ``wait`` (block until ``key`` is done; ``seconds``: how long it blocked when measured)."""

    kind: str
    seconds: float = 0.0
    key: tuple | None = None
    phase: str = "model"
    measured: tuple = (0.0, 0.0)   # the measured interval (relative to the step's start)
    blocking: bool = False         # issue: the call itself returned only once it was done (gloo)
    weight: float | None = None    # compute: its share of the step's FLOPs (default: seconds)


@dataclass
class Instance:
    """One communication: ``op`` on ``members`` (global ranks; a send's are (src, dst)), ``bytes``
    per member, ``repeat`` back-to-back copies (a per-layer message standing for several layers)."""

    op: str
    members: tuple
    bytes: float
    repeat: float = 1.0
    group: str = ""
    tag: str = ""
    seconds: float | None = None   # fixed cost (tests); else the cluster's


def _windows(marks: list) -> list[tuple]:
    """[(step, start, end, {"optimizer": [(start, end), ...], "forward": [...], "backward": [...]})]
    from a rank's marks (the intervals of its optimizer steps, forwards and backwards)."""
    out, start, open_, spans = [], None, {}, {"optimizer": [], "forward": [], "backward": []}
    for t, kind, value in marks:
        if kind == "step":
            start, spans = (value, t), {"optimizer": [], "forward": [], "backward": []}
        elif kind == "step_end" and start is not None:
            out.append((start[0], start[1], t, spans))
            start = None
        elif kind in spans:
            open_[kind] = t
        elif kind.endswith("_end") and kind[:-4] in spans and open_.get(kind[:-4]) is not None:
            spans[kind[:-4]].append((open_.pop(kind[:-4]), t))
    return out


def _program(rank: int, events: list[dict], t0: float, t1: float, spans) -> tuple:
    """One rank's program for the step [t0, t1], and its communications as {key: (event, role)}."""
    evs = sorted((e for e in events if t0 <= e["start"] <= t1), key=lambda e: e["id"])
    counters: dict = defaultdict(int)
    keyed = []
    for e in evs:
        op, ranks = e["op"], tuple(e["ranks"]) or (rank,)
        if op in ("send", "recv"):
            peer = ranks[e["peer"]] if e["peer"] is not None else None
            src, dst = (rank, peer) if op == "send" else (peer, rank)
            c = ("p", src, dst, e["channel"], op)
            key = ("p", src, dst, e["channel"], counters[c])
        else:
            c = ("c", ranks)
            key = ("c", ranks, counters[c])
        counters[c] += 1
        keyed.append((key, e))
    points = []
    for key, e in keyed:
        if e["async_op"]:
            points.append((e["start"], 0, "issue", key, e))
            if e["wait_start"] is not None and e["wait_start"] <= t1:
                points.append((e["wait_start"], 1, "wait", key, e))
        else:
            points.append((e["start"], 0, "sync", key, e))
    points.sort(key=lambda p: (p[0], p[1], p[4]["id"]))
    ops: list[Op] = []
    cur = t0

    if not isinstance(spans, dict):  # a plain list: the optimizer's intervals
        spans = {"optimizer": spans, "forward": []}
    optimizer, forward = spans["optimizer"], spans["forward"]

    def compute(a: float, b: float) -> None:
        cuts = sorted({a, b, *[x for iv in optimizer + forward for x in iv if a < x < b]})
        for x, y in zip(cuts, cuts[1:]):
            if y > x:
                mid = (x + y) / 2
                phase = ("optimizer" if any(s <= mid <= e for s, e in optimizer) else
                         "forward" if any(s <= mid <= e for s, e in forward) else "model")
                ops.append(Op("compute", y - x, phase=phase, measured=(x - t0, y - t0)))

    for t, _, kind, key, e in points:
        if t > cur:
            compute(cur, t)
        cur = max(cur, t)
        if kind == "issue":
            took = max(0.0, (e["returned"] or t) - t)
            blocking = e["op"] not in ("send", "recv") and e["end"] <= t + took + 1e-4
            ops.append(Op("issue", took, key, measured=(t - t0, t + took - t0), blocking=blocking))
            cur = max(cur, t + took)
        elif kind == "sync":
            ops.append(Op("issue", 0.0, key, measured=(t - t0, t - t0)))
            ops.append(Op("wait", e["end"] - t, key, measured=(t - t0, e["end"] - t0)))
            cur = max(cur, e["end"])
        else:
            ops.append(Op("wait", e["wait_end"] - t, key, measured=(t - t0, e["wait_end"] - t0)))
            cur = max(cur, e["wait_end"])
    if t1 > cur:
        compute(cur, t1)
    return ops, {key: e for key, e in keyed}


# --------------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------------


def replay(programs: dict, instances: dict, cost=None, compute=None, issue_cost: bool = True,
           start: dict | None = None) -> dict:
    """Replay ``programs`` ({rank: [Op]}) discrete-event.  ``instances``: {key: Instance};
    ``cost(instance)`` its seconds (default ``instance.seconds``); ``compute(rank, op)`` a compute
    span's seconds (default its measured ``op.seconds``); ``issue_cost``: posting takes the
    issuing call's measured time on the compute stream, or, when that call returned only once the
    communication was done (``op.blocking``: gloo on a CPU), blocks until it is done — else
    posting costs nothing (a GPU's launch).  ``start``: {rank: when it starts} (default 0).

    Rules: a collective starts when every member has issued it and each member's previous
    collective on that group has finished; a point-to-point message when both its send and its
    receive are posted; each takes ``cost``.  A wait blocks its rank's compute stream until the
    communication is done.  Returns ``{"ranks": {rank: {"end", "segments"}}, "comm": {key:
    (start, end)}, "step_time"}``; raises :class:`ReplayError` when some rank can never go on."""
    cost = cost or (lambda inst: inst.seconds * inst.repeat)
    compute = compute or (lambda rank, op: op.seconds)
    t = {r: (start or {}).get(r, 0.0) for r in programs}
    t0 = dict(t)
    pc = {r: 0 for r in programs}
    segs: dict = {r: [] for r in programs}
    issued: dict = defaultdict(dict)
    done: dict = {}
    stream_prev: dict = {}  # collective key -> the previous key on each member's stream
    last_on_stream: dict = {}
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "issue" and op.key[0] == "c":
                slot = (r, op.key[1])
                stream_prev.setdefault(op.key, []).append(last_on_stream.get(slot))
                last_on_stream[slot] = op.key

    def resolve(key) -> bool:
        if key in done:
            return True
        inst = instances[key]
        members = inst.members
        if any(m not in issued[key] for m in members):
            return False
        start = max(issued[key][m] for m in members)
        for prev in stream_prev.get(key, []):
            if prev is not None:
                if prev not in done:
                    return False
                start = max(start, done[prev][1])
        done[key] = (start, start + cost(inst))
        return True

    pending: set = set()
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if op.kind == "compute":
                    d = compute(r, op)
                    segs[r].append({"kind": "compute", "phase": op.phase, "start": t[r],
                                    "end": t[r] + d, "measured": op.measured})
                    t[r] += d
                elif op.kind == "issue":
                    if op.key not in instances:
                        raise ReplayError(f"rank {r} issues {op.key}, which no instance describes")
                    if op.key not in issued or r not in issued[op.key]:
                        issued[op.key][r] = t[r]
                        if not resolve(op.key):
                            pending.add(op.key)
                    if issue_cost and op.blocking:  # the call returned once it was done
                        if op.key not in done:
                            break
                        end = done[op.key][1]
                        segs[r].append({"kind": "wait", "key": op.key, "start": t[r],
                                        "end": max(t[r], end), "measured": op.measured})
                        t[r] = max(t[r], end)
                    else:
                        d = op.seconds if issue_cost else 0.0
                        segs[r].append({"kind": "issue", "key": op.key, "start": t[r],
                                        "end": t[r] + d, "measured": op.measured})
                        t[r] += d
                else:
                    if not resolve(op.key):
                        break
                    end = done[op.key][1]
                    segs[r].append({"kind": "wait", "key": op.key, "start": t[r],
                                    "end": max(t[r], end), "measured": op.measured})
                    t[r] = max(t[r], end)
                pc[r] += 1
                progress = True
        for key in list(pending):
            if resolve(key):
                pending.discard(key)
                progress = True
    stuck = {r: prog[pc[r]] for r, prog in programs.items() if pc[r] < len(prog)}
    if stuck:
        lines = []
        for r, op in sorted(stuck.items()):
            inst = instances.get(op.key)
            missing = [m for m in (inst.members if inst else ()) if m not in issued[op.key]]
            lines.append(f"rank {r} waits for {op.key[0] == 'p' and 'a message' or inst.op} "
                         f"{op.key}: not issued by rank(s) {missing}")
        raise ReplayError("the event log cannot be replayed: " + "; ".join(lines))
    first = min(t0.values(), default=0.0)
    return {"ranks": {r: {"start": t0[r], "end": t[r], "segments": segs[r]} for r in programs},
            "comm": done,
            "step_time": max(t.values(), default=0.0) - first}


# --------------------------------------------------------------------------------------------------
# This machine's α-β, fitted on the run's own messages
# --------------------------------------------------------------------------------------------------


def message_times(result: dict) -> list[tuple]:
    """(op, ranks, bytes, seconds) of the run's own communications, as the ranks saw them (one
    clock: the ranks of one host): a collective from its last member's issue to its members'
    completion (their mean: each rank waits for its own, and a loaded machine delays some), when
    every member blocked on it (a rank computing meanwhile slows its completion on shared cores); a message from its send's post to its arrival, seen by a receiver that
    was already waiting for it.  The first recorded step is left out (warm-up)."""
    out = []
    logs = result["events"]
    steps = len(_windows(logs[0]["marks"]))
    for i in range(1 if steps > 1 else 0, steps):
        issue, finish, meta, sends, recvs = defaultdict(dict), defaultdict(dict), {}, {}, {}
        for r, log in enumerate(logs):
            _, t0, t1, opts = _windows(log["marks"])[i]
            _, keyed = _program(r, log["events"], t0, t1, opts)
            for key, e in keyed.items():
                if key[0] == "p":
                    (sends if e["op"] == "send" else recvs)[key] = e
                    continue
                issue[key][r] = e["start"]
                # when this rank could go on: its call returned, or its wait did
                finish[key][r] = max(e["end"], e["returned"] or 0.0, e["wait_end"] or 0.0)
                if key not in meta or meta[key] is not None:
                    meta[key] = (e["op"], len(key[1]), e["bytes"])
                # a rank that went on computing meanwhile delayed the op's completion (two cores):
                # only communications every member blocked on at once are timed
                if e["async_op"] and e["end"] > (e["returned"] or e["start"]) + 1e-4 and (
                        e["wait_start"] is None or e["wait_start"] - (e["returned"] or 0) > 5e-5):
                    meta[key] = None
        for key, m in meta.items():
            if m is None:
                continue
            op, n, nbytes = m
            if n > 1 and len(issue[key]) == n:
                out.append((op, n, nbytes, max(1e-7, max(finish[key].values())
                                              - max(issue[key].values()))))
        for key, rv in recvs.items():
            sd = sends.get(key)
            if sd is None or rv["wait_start"] is None:
                continue
            # only a receiver already waiting when the send was posted saw the message arrive
            if rv["start"] <= sd["start"] and rv["wait_start"] <= sd["start"]:
                out.append(("send", 2, rv["bytes"], max(1e-7, rv["wait_end"] - sd["start"])))
    return out


def fit_run(result: dict, beta: float | None = None) -> dict | None:
    """This machine's α-β from the run's own messages (:func:`message_times`): least squares on
    T = α·steps + β·bytes per rank over every collective the run made — in absolute error, so that
    the fitted times add up to what its steps spent (a loaded machine's delays are heavy-tailed;
    lesson 01's relative-error fit would follow the luckiest); β only when the sizes span a factor
    of 100 and reach 1 KB — or ``beta`` given (an all-reduce sweep's, lesson 01: its fastest repeats
    measure the wire; the run's messages, on a loaded machine, mostly its delays).  Each collective
    also on its own (``per_op``: gloo's algorithms differ), its α the mean excess over β.  A point-to-point
    message's latency apart (``p2p_alpha``: the median of the messages a receiver waited for —
    gloo's are a rendezvous, unlike a collective's step).  None when nothing was sent."""
    import numpy as np

    from .costmodel import ring_steps, ring_volume
    groups, p2p = defaultdict(list), []
    for op, n, b, sec in message_times(result):
        if op == "send":
            p2p.append((b, sec))
        else:
            groups[(op, n, b)].append(sec)
    if not groups and not p2p:
        return None
    out: dict = {}

    def fit(rows):
        """(α, β or None) by least squares in absolute error; β only from sizes that tell."""
        A = np.array([[ring_steps(op, n), ring_volume(op, b, n)] for op, n, b, _ in rows], float)
        t = np.array([r[3] for r in rows], float)
        sizes = [b for _, _, b, _ in rows if b > 0]
        if sizes and max(sizes) >= 1024 and max(sizes) >= 100 * min(sizes):
            (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
            if beta > 0 and alpha >= 0:
                return float(alpha), float(beta)
        return float(np.sum(t * A[:, 0]) / max(np.sum(A[:, 0] ** 2), 1e-30)), None

    rows = [(op, n, b, sec) for (op, n, b), secs in groups.items() for sec in secs]
    if rows:
        if beta is None:
            alpha, beta = fit(rows)
        else:  # the sweep's β (its fastest repeats: the wire); the run's messages give α
            alpha = float(np.mean([(sec - ring_volume(o, by, n) * beta) / ring_steps(o, n)
                                   for o, n, by, sec in rows]))
        out["alpha"] = max(alpha, 0.0)
        if beta is not None:
            out["beta"] = beta
        per_op = {}
        for name in {r[0] for r in rows}:
            b = out.get("beta")
            a = float(np.mean([(sec - ring_volume(o, by, n) * (b or 0.0)) / ring_steps(o, n)
                               for o, n, by, sec in rows if o == name]))
            per_op[name] = (max(a, 0.0), b or 0.0)
        out["per_op"] = per_op
    if p2p:
        out["p2p_alpha"] = max(0.0, statistics.median(sec - by * out.get("beta", beta or 0.0)
                                                      for by, sec in p2p))
        out.setdefault("alpha", out["p2p_alpha"])
    elif "alpha" in out:
        out["p2p_alpha"] = None  # no message was seen arriving: the sweep's ping-pong, if any
    return out


# --------------------------------------------------------------------------------------------------
# The projection of a run
# --------------------------------------------------------------------------------------------------


def _itemsize(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _merge(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _step_programs(result: dict, step_index: int):
    """Programs of every rank for one step (by position in the recorded steps), and the events."""
    programs, events, window = {}, {}, {}
    for r, log in enumerate(result["events"]):
        steps = _windows(log["marks"])
        step, t0, t1, opts = steps[step_index]
        programs[r], events[r] = _program(r, log["events"], t0, t1, opts)
        window[r] = (t0, t1)
    return programs, events, window


def project(result: dict, cluster="dgx-h100", model=None, *, precision: str | None = None,
            compute: str | None = None, degrees: dict | None = None, steps=None,
            recompute: bool | None = None, even: bool = False) -> dict:
    """Re-time ``result`` (from ``train(..., record_events=True)`` or ``project=``) on ``cluster``
    (a preset name, a :class:`~minitrain.clusters.ClusterSpec`; "local"/"binder" need the run's
    calibration) for ``model`` (None: the run's own; "1.3b", "7b"..., or a GPTConfig).

    ``precision``: of the projected run (default: the run's, but an fp32 run on GPUs as bf16-mixed,
    the way such models are trained).  ``compute``: "measured" keeps each compute span's measured
    duration (this machine, same model: the self-consistency check; on "binder" stretched by the
    cores the ranks had here, as they would share one), "model" (default otherwise) prices it from
    its FLOPs.  ``degrees``: {axis: size} re-sizes the groups of an axis ("dp",
    "tp", "pp", "cp") — the run's ranks stand for a bigger mesh of the same shape (every replica
    alike), e.g. ``{"dp": 48}`` for 48 replicas where the run had 2.  ``steps``: which recorded
    steps (default: all but the first); the median step is drawn.  ``recompute``: count one more
    forward of the blocks (activation checkpointing) where the run did not recompute (a strategy
    that cannot) — its FLOPs only: the recomputed forward's communication is not in the run's log.
    ``even``: every forward (and every backward) a rank ran in the step does the same work — a
    pipeline's equal micro-batches — so each gets the same share of its phase's FLOPs, not a share
    in proportion to how long it happened to take here (:func:`_even`; for GPipe and 1F1B: a
    ZB-H1 backward is two passes of different work, an interleaved rank's chunks differ by the
    embedding or the head).

    Returns a dict: ``cluster``, ``model``, ``step_time_s`` (median over the steps), ``compute_s``,
    ``exposed_comm_s``, ``bubble_s``, ``idle_s`` (their mean over ranks: they add up to the step
    time), ``hidden_comm_share``, ``mfu``, ``memory`` (bytes per device), ``timeline`` (per rank,
    tracer-style events and compute spans, seconds from the step's start), ``measured_step_s``
    (the run's own median step, all ranks, beside it) and ``sources``."""
    summary = result["summary"]
    if "events" not in result:
        raise ValueError("this result has no recorded events: train with record_events=True (or "
                         "project=...) to project it")
    if summary["strategy"] in NOT_REPLAYED:
        raise ValueError(f"strategy {summary['strategy']!r}: {NOT_REPLAYED[summary['strategy']]}")
    spec = cluster if isinstance(cluster, ClusterSpec) else _cluster(cluster, result, compute,
                                                                      model)
    run_cfg = GPTConfig(**summary["model"]) if isinstance(summary.get("model"), dict) else \
        summary.get("model_config") or GPTConfig()
    target = target_model(model, run_cfg)
    run_precision = summary.get("precision", "fp32")
    precision = precision or (run_precision if not spec.accelerator or run_precision != "fp32"
                              else "bf16-mixed")
    items = (_itemsize(run_precision), _itemsize(precision))
    same = target == run_cfg and items[0] == items[1]
    mode = compute or ("measured" if (same and spec.key in ("local", "binder")) else "model")
    # Binder: the same spans on one core where this machine gave them min(ranks, cores)
    stretch = (min(summary["world_size"], spec.calibration.get("cores", 1))
               if spec.key == "binder" and mode == "measured" else 1.0)
    world = summary["world_size"]
    lay = _layout(summary)
    axes = _axes(summary)
    degrees = {k: v for k, v in (degrees or {}).items() if v}
    if set(degrees) - {"dp", "tp"}:
        raise ValueError(f"degrees re-size data and tensor parallelism only, got {sorted(degrees)}")
    sizes = {a: degrees.get(a, lay[a]) for a in _ORDER}
    if degrees and math.prod(sizes.values()) > spec.devices:
        raise ValueError(f"the mesh {sizes} needs {math.prod(sizes.values())} devices; "
                         f"{spec.title} has {spec.devices}")
    nodes = _placement(spec, world, lay, axes, degrees)
    ranks_on_node = defaultdict(int)
    for node in nodes.values():
        ranks_on_node[node] += 1
    work = {r: rank_work(summary, target, r, degrees, recompute) for r in range(world)}
    scale = Scaler(summary, run_cfg, target, items, degrees)
    recorded = len(_windows(result["events"][0]["marks"]))
    if recorded == 0:
        raise ValueError("no step was recorded")
    chosen = list(steps) if steps is not None else (list(range(1, recorded)) or [0])
    replays = []
    built = [_step_programs(result, i) for i in chosen]
    _smooth([b[0] for b in built])
    if even:
        for i, (programs, _, _) in zip(chosen, built):
            _even(result, i, programs)
    for programs, events, window in built:
        instances = {}
        for r, evs in events.items():
            for key, e in evs.items():
                nbytes, repeat = scale(e, r)
                members = (key[1], key[2]) if key[0] == "p" else key[1]
                old = instances.get(key)
                if old is None or nbytes > old.bytes:
                    instances[key] = Instance(e["op"], members, nbytes, repeat, e["group"], e["tag"])
        _drop_unmatched(programs, instances)

        def cost(inst, _spec=spec):
            n = len(inst.members) if inst.op in ("send", "recv") else degrees.get(
                _axis_of(inst, axes), len(inst.members))
            where = _member_nodes(inst, nodes, n, sizes, axes, spec, bool(degrees))
            return inst.repeat * _spec.seconds(inst.op, inst.bytes, where)

        timing = (lambda rank, op, k=stretch: op.seconds * k) if stretch != 1.0 else None
        if mode == "model":
            timing = _model_compute(programs, work, spec, precision, ranks_on_node, nodes)
        first = min(w[0] for w in window.values())
        offsets = {r: w[0] - first for r, w in window.items()} if mode == "measured" else None
        out = replay(programs, instances, cost, timing, issue_cost=not spec.accelerator,
                     start=offsets)
        out["instances"], out["window"] = instances, window
        out["measured"] = max(w[1] for w in window.values()) - min(w[0] for w in window.values())
        replays.append(out)
    order = sorted(range(len(replays)), key=lambda k: replays[k]["step_time"])
    median = replays[order[len(order) // 2]]
    T = median["step_time"]  # the median step (its parts and timeline are the ones shown)
    parts = breakdown(median, lay["pp"] > 1)
    peak = spec.device.flop_rate(precision) / spec.device.fraction
    if not spec.accelerator:
        peak = spec.device.flop_rate(precision, max(ranks_on_node.values()))
    total_model_flops = sum(w.model_flops for w in work.values())
    memory = _memory(summary, run_cfg, target, precision, work, {**lay, "dp": sizes["dp"]})
    out = {
        "cluster": spec.key, "cluster_title": spec.title,
        "model": _model_name(model, target), "params": target.num_params(),
        "precision": precision, "compute_mode": mode, "degrees": degrees or None,
        "step_time_s": T,
        "step_times_s": [r["step_time"] for r in replays],
        "measured_step_s": statistics.median(r["measured"] for r in replays),
        "mean_step_time_s": statistics.fmean(r["step_time"] for r in replays),
        "measured_mean_step_s": statistics.fmean(r["measured"] for r in replays),
        **parts,
        "mfu": total_model_flops / (T * world * peak) if T > 0 else None,
        "hfu": sum(w.flops for w in work.values()) / (T * world * peak) if T > 0 else None,
        "tokens_per_s": summary["batch_size"] * target.seq_len * sizes["dp"] / lay["dp"] / T
        if T > 0 else None,
        "memory": memory,
        "fits": all(m["total"] <= spec.device.memory_gb * GB for m in memory) if spec.accelerator
        else None,
        "timeline": _timelines(median),
        "sources": spec.row()["sources"],
    }
    out["step"] = chosen[order[len(order) // 2]]
    out["windows"] = {r: w[0] for r, w in median["window"].items()}  # each rank's step start
    out["_replay"] = median
    return out


def ddp_timeline(result: dict, projection: dict) -> list[dict]:
    """The DDP report's timeline of the projected step (``--timeline``: backward and each bucket's
    all-reduce, per rank) re-timed: the form :func:`minitrain.viz.timeline.timeline_rows` draws.
    Backward's edges are warped (:func:`warp`); a bucket runs when the replay ran it."""
    out = []
    for rank, rep in enumerate(result["summary"]["report"]):
        step = rep["timeline"][projection["step"] - result["summary"].get("start_step", 0)]
        comm = {e["tag"]: e for e in projection["timeline"][rank] if e["op"] != "compute"}
        buckets = []
        for b in step["buckets"]:
            e = comm.get(f"bucket{b['index']}")
            start, end = (e["issued"], e["end"]) if e else (warp(projection, rank, b["start"]),) * 2
            buckets.append({**b, "start": start, "end": end, "bytes": e["bytes"] if e else b["bytes"]})
        out.append({"timeline": [{"backward_start": warp(projection, rank, step["backward_start"]),
                                  "backward_end": warp(projection, rank, step["backward_end"]),
                                  "buckets": buckets}]})
    return out


def pipeline_timeline(result: dict, cluster="dgx-h100", model=None, **kw) -> tuple[list, dict]:
    """The pipeline's measured timeline (its report's, the last step's) re-timed on ``cluster`` at
    ``model``: ``(timeline, projection)`` — the timeline in the executor's own form (``rank``,
    ``action``, ``ready``, ``start``, ``end``; seconds from the step's start), what the lesson's
    Gantt charts draw."""
    steps = len(_windows(result["events"][0]["marks"]))
    p = project(result, cluster, model, steps=[steps - 1], **kw)
    # the executor's clock starts on rank 0 after its barrier, where it broadcast that reading
    window = _windows(result["events"][0]["marks"])[steps - 1]
    t0 = next(e["start"] for e in sorted(result["events"][0]["events"], key=lambda e: e["start"])
              if not e["traced"] and e["op"] == "broadcast" and e["start"] >= window[1])
    out = []
    for e in result["summary"]["report"][0]["timeline"]:
        r = e["rank"]
        out.append({**e, **{k: warp(p, r, t0 + e[k]) for k in ("ready", "start", "end")}})
    return out, p


def warp(projection: dict, rank: int, t: float) -> float:
    """The projected time (seconds from the drawn step's start) of the instant ``t`` (a
    ``time.perf_counter()`` reading on ``rank`` during that step, as the measured timelines of DDP,
    ZeRO-3 and the pipeline record them): inside a replayed span, at the same fraction of it — so a
    lesson draws its measured timeline re-timed with the same function that draws it measured."""
    rel = t - projection["windows"][rank]
    segs = projection["_replay"]["ranks"][rank]["segments"]
    for s in segs:
        a, b = s["measured"]
        if a <= rel <= b:
            frac = (rel - a) / (b - a) if b > a else 1.0
            return s["start"] + frac * (s["end"] - s["start"])
    if segs and rel > segs[-1]["measured"][1]:
        return segs[-1]["end"]
    return segs[0]["start"] if segs else 0.0


def _cluster(name: str, result: dict, compute, model) -> ClusterSpec:
    """A preset, or this machine: calibrated (``summary["calibration"]``), its α-β fitted on the
    run's own messages when they tell (:func:`fit_run`) — what the measured compute is replayed
    with."""
    key, _ = parse(name)
    if key not in ("local", "binder"):
        return get_cluster(name)
    cal = dict(result["summary"].get("calibration") or {})
    fitted = fit_run(result, cal.get("beta"))
    if fitted is not None:
        if fitted.get("p2p_alpha") is None:
            fitted.pop("p2p_alpha", None)
        cal.update(fitted, fit="α: the run's own messages; β: " + (
            "an all-reduce sweep after the run (lesson 01)" if "flop_rate" in cal
            else "the run's own messages"))
    elif cal:
        cal["fit"] = "an all-reduce sweep after the run (lesson 01)"
    if result["summary"]["world_size"] == 1:
        cal.setdefault("alpha", 0.0)  # one rank sends nothing
    cal.setdefault("beta", 0.0)
    if "flop_rate" not in cal:
        if compute == "model" or model is not None or key == "binder":
            raise ValueError(f"cluster {key!r} prices compute at this machine's calibrated FLOP "
                             "rate: train with project='local' (or 'binder') to calibrate")
        cal.update(ranks=result["summary"]["world_size"], cores=1, flop_rate=1.0, memory_rate=1.0)
    if "alpha" not in cal:
        raise ValueError("this machine's α-β cannot be fitted from the run's messages; train "
                         "with project='local' to calibrate it")
    return get_cluster(key, cal)


def _model_name(model, target: GPTConfig) -> str:
    if model is None:
        return f"the run's own ({target.num_params() / 1e6:,.2f}M parameters)"
    if isinstance(model, GPTConfig):
        return f"GPTConfig ({target.num_params() / 1e9:,.2f}B parameters)"
    return f"{model} ({target.num_params() / 1e9:,.2f}B parameters)"


def _drop_unmatched(programs: dict, instances: dict) -> None:
    """A communication some member never issued inside this step (a prefetch that crosses the
    step's edge) is left out of the step: its issue and wait are dropped."""
    issuers: dict = defaultdict(set)
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "issue":
                issuers[op.key].add(r)
    bad = {k for k, inst in instances.items() if set(inst.members) - issuers[k]}
    for r in programs:
        programs[r] = [op for op in programs[r] if op.key not in bad]
    for k in bad:
        instances.pop(k)


def _model_compute(programs, work, spec: ClusterSpec, precision, ranks_on_node, nodes):
    """compute(rank, op) pricing each span from the rank's FLOPs — its forwards' FLOPs over its
    forward spans, the rest (backward, recomputation) over the others — and its optimizer bytes
    over its optimizer spans, each shared out by measured durations."""
    measured = {r: defaultdict(float) for r in programs}
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "compute":
                measured[r][op.phase] += _weight(op)
    totals = {}
    for r in programs:
        rate = spec.device.flop_rate(precision, ranks_on_node[nodes[r]])
        mem = spec.device.memory_bw * (1.0 if spec.accelerator else
                                       min(1.0, (spec.device.cores or 1) / ranks_on_node[nodes[r]]))
        opt = work[r].opt_params * ADAM_BYTES / mem
        forward = work[r].model_flops / 3 / rate  # backward is twice the forward
        rest = work[r].flops / rate - forward       # backward, recomputation, weight gradients
        if not measured[r]["forward"]:
            forward, rest = 0.0, rest + forward
        if not measured[r]["optimizer"]:
            rest += opt
        totals[r] = {"forward": forward, "model": rest, "optimizer": opt}

    def price(rank, op):
        m = measured[rank][op.phase]
        return totals[rank][op.phase] * _weight(op) / m if m > 0 else 0.0

    return price


def _even(result: dict, step_index: int, programs: dict) -> None:
    """Give each forward (and each backward) interval of a rank's step the median weight of its
    kind's intervals on that rank, split over the interval's compute spans as measured — equal
    micro-batches do equal work, whatever this machine's noise made them take.  The backward's
    FLOPs go to the backward intervals only: the bookkeeping between actions (Python here; on a
    GPU it runs ahead of the kernels) takes none."""
    def overlap(op, a, b):
        return max(0.0, min(b, op.measured[1]) - max(a, op.measured[0]))

    for r, prog in programs.items():
        _, t0, _, spans = _windows(result["events"][r]["marks"])[step_index]
        kinds = {kind: [(a - t0, b - t0) for a, b in spans.get(kind, [])]
                 for kind in ("forward", "backward")}
        phase = {"forward": "forward", "backward": "model"}
        weights = {id(op): _weight(op) for op in prog if op.kind == "compute"}
        for kind, intervals in kinds.items():
            ops = [op for op in prog if op.kind == "compute" and op.phase == phase[kind]]
            share = {}  # op -> [(interval, its weight inside the interval)]
            for op in ops:
                d = op.measured[1] - op.measured[0]
                share[id(op)] = [(i, weights[id(op)] * overlap(op, a, b) / d) for i, (a, b)
                                 in enumerate(intervals) if d > 0 and overlap(op, a, b) > 0]
            totals = [sum(w for op in ops for j, w in share[id(op)] if j == i)
                      for i in range(len(intervals))]
            filled = [t for t in totals if t > 0]
            if len(filled) < 2:
                continue
            typical = statistics.median(filled)
            for op in ops:
                op.weight = sum(typical * w / totals[i] for i, w in share[id(op)] if totals[i] > 0)


def _weight(op: Op) -> float:
    return op.seconds if op.weight is None else op.weight


def _smooth(all_programs: list[dict]) -> None:
    """Give each compute span, as its share of its rank's FLOPs, the median of its measured
    durations over the steps and over the ranks that run the same program (tensor-parallel peers,
    data-parallel replicas: lockstep ranks doing the same work) — so that a span a busy machine
    stretched once takes no more of the FLOPs for it, and peers that split a layer's work evenly
    are not made to wait for each other by noise."""
    shape = {}
    for r in all_programs[0]:
        shapes = {tuple((op.kind, op.phase) for op in progs[r]) for progs in all_programs}
        if len(shapes) == 1:
            shape.setdefault(shapes.pop(), []).append(r)
    for ranks in shape.values():
        for i, op in enumerate(all_programs[0][ranks[0]]):
            if op.kind == "compute":
                w = statistics.median(progs[r][i].seconds for progs in all_programs for r in ranks)
                for progs in all_programs:
                    for r in ranks:
                        progs[r][i].weight = w


def _axes(summary: dict) -> dict:
    """{ranks tuple: axis name} for the run's groups (the world: its one axis)."""
    s, w = summary["strategy"], summary["world_size"]
    world = tuple(range(w))
    one = {"pipeline": "pp", "tensor": "tp", "3d": "world", "context": "world"}.get(s, "dp")
    out = {world: one}
    if s == "3d":
        for rep in summary.get("report") or []:
            for axis, ranks in (rep.get("groups") or {}).items():
                out[tuple(ranks)] = axis
    if s == "context":
        cp = _layout(summary)["cp"]
        for r in range(0, w, cp):
            out[tuple(range(r, r + cp))] = "cp"
    return out


def _axis_of(inst: Instance, axes: dict) -> str | None:
    if inst.members in axes:
        return axes[inst.members]
    if len(inst.members) == 2 and inst.op in ("send", "recv"):
        for ranks, axis in axes.items():
            if set(inst.members) <= set(ranks) and len(ranks) > 1:
                return axis
    return None


def _placement(spec: ClusterSpec, world: int, lay: dict, axes: dict, degrees: dict) -> dict:
    """{rank: node} for the run's ranks (no ``degrees``): as torchrun would place them."""
    if not degrees:
        return dict(enumerate(spec.placement(world)))
    return {r: 0 for r in range(world)}


_ORDER = ("tp", "cp", "dp", "pp")  # innermost first: Megatron's order, as the chooser lays it out


def _member_nodes(inst: Instance, nodes: dict, n: int, sizes: dict, axes: dict,
                  spec: ClusterSpec, resized: bool) -> list[int]:
    """The nodes of the ``n`` members of ``inst``: as placed, or — in a mesh re-sized to ``sizes``
    — where a group of that axis sits in it (TP innermost, then CP, DP, PP)."""
    if not resized:
        return [nodes[m] for m in inst.members]
    axis = _axis_of(inst, axes)
    inner = 1
    for a in _ORDER:
        if a == axis:
            break
        inner *= sizes[a]
    per_node = spec.devices_per_node
    stride_nodes = [(i * inner) // per_node for i in range(n)]
    return stride_nodes


def breakdown(rep: dict, pipeline: bool = False) -> dict:
    """Mean over ranks of compute, exposed communication, bubble and idle (they add up to the step
    time: a rank's waiting is exposed communication while its communication is in flight, else
    idle — bubble in a ``pipeline`` on point-to-point waits and at the end), ``comm_s`` (the time
    a rank has communication in flight), and the share of that hidden behind compute."""
    T = rep["step_time"]
    sums = defaultdict(float)
    busy_total = exposed_total = 0.0
    n = len(rep["ranks"])
    for r, info in rep["ranks"].items():
        busy = []
        exposed = 0.0
        for s in info["segments"]:
            d = s["end"] - s["start"]
            if s["kind"] == "compute":
                sums["compute_s"] += d
            elif s["kind"] == "issue":
                exposed += d
                busy.append((s["start"], s["end"]))
            else:
                a, b = rep["comm"][s["key"]]
                busy.append((a, b))
                overlap = max(0.0, min(b, s["end"]) - max(a, s["start"]))
                exposed += overlap
                sums["bubble_s" if pipeline and s["key"][0] == "p" else "idle_s"] += d - overlap
        sums["exposed_comm_s"] += exposed
        sums["bubble_s" if pipeline else "idle_s"] += T - (info["end"] - info.get("start", 0.0))
        busy_total += _merge(busy)
        exposed_total += min(exposed, _merge(busy)) if busy else 0.0
    out = {k: sums[k] / n for k in ("compute_s", "exposed_comm_s", "bubble_s", "idle_s")}
    out["comm_s"] = busy_total / n
    out["hidden_comm_share"] = 1 - exposed_total / busy_total if busy_total > 0 else None
    return out


def _timelines(rep: dict) -> list[list[dict]]:
    """Per rank, in the tracer's form (seconds from the step's start): its communications
    (``op``, ``bytes``, ``start``, ``end``, ``group``, ``tag``) and its compute spans (``op``
    "compute", ``phase``), and the measured interval each segment replays (``measured``)."""
    out = []
    for r in sorted(rep["ranks"]):
        rows = []
        seen = set()
        for s in rep["ranks"][r]["segments"]:
            if s["kind"] == "compute":
                rows.append({"op": "compute", "phase": s["phase"], "start": s["start"],
                             "end": s["end"], "measured": s["measured"]})
                continue
            key = s["key"]
            if key in seen:
                continue
            seen.add(key)
            inst = rep["instances"][key]
            a, b = rep["comm"][key]
            rows.append({"op": inst.op, "bytes": inst.bytes * inst.repeat, "start": a, "end": b,
                         "group": inst.group, "tag": inst.tag, "issued": s["start"],
                         "measured": s["measured"]})
        out.append(sorted(rows, key=lambda e: e["start"]))
    return out


def _memory(summary, run: GPTConfig, target: GPTConfig, precision, work, lay) -> list[dict]:
    """Bytes per device: the model states of the rank's share at the projected precision (ZeRO's
    formulas: :func:`minitrain.memory.model_state_bytes`), and the ledger's measured activation
    peak scaled by micro-batch × sequence × hidden × layers held."""
    recipe = "fp32-adam" if precision == "fp32" else "mixed-adam"
    out = []
    mems = summary.get("memory") or []
    for r, w in sorted(work.items()):
        states = model_state_bytes(w.params, lay["dp"], lay["zero"], recipe)
        measured = (mems[r]["bytes"]["activations_peak"] if r < len(mems) else 0)
        own = rank_work(summary, run, r)
        scale = (target.seq_len * target.d_model * max(w.blocks, 1)) / (
            run.seq_len * run.d_model * max(own.blocks, 1))
        item = _itemsize(precision) / _itemsize(summary.get("precision", "fp32"))
        acts = measured * scale * item if (target != run or item != 1) else measured
        row = {"parameters": states["parameters"], "gradients": states["gradients"],
               "optimizer_states": states["optimizer_states"], "activations": acts}
        offload = (summary.get("options") or {}).get("offload")
        if offload:  # ZeRO-Offload: Adam's states (and the fp32 masters) live in host memory
            row["optimizer_states"] = 0.0
        row["total"] = sum(row.values())
        if offload:
            row["host"] = states["optimizer_states"]
        out.append(row)
    return out


def format_projection(p: dict) -> str:
    """One line for the readable summary."""
    hidden = p.get("hidden_comm_share")
    mem = (max(m["total"] for m in p["memory"]) / GB if p.get("memory")
           else max(p.get("memory_per_device_gb") or [0.0]))
    return (f"projected on {p['cluster']} as {p['model']}: {p['step_time_s'] * 1e3:,.2f} ms per step "
            f"(compute {p['compute_s'] * 1e3:,.2f}, exposed comm {p['exposed_comm_s'] * 1e3:,.2f}, "
            f"bubble {p['bubble_s'] * 1e3:,.2f}, idle {p['idle_s'] * 1e3:,.2f} ms; "
            f"{'n/a' if hidden is None else f'{hidden:.0%}'} of comm hidden), MFU "
            f"{p['mfu']:.1%}, {mem:,.1f} GB per device"
            + ("" if p.get("fits") in (None, True) else " — does not fit") +
            f"; measured here {p['measured_step_s'] * 1e3:,.2f} ms")
