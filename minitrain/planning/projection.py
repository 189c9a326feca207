"""A real run re-timed on a cluster: every timing the course teaches, shown where it holds.

On a laptop the ranks share two cores over loopback, so a run's own times say little about a real
cluster.  But the run *recorded* what it did — every collective with its bytes and group, when each
rank issued it and waited for it (:mod:`minitrain.comm`), each step's optimizer step — and
:func:`project` replays that record on a cluster model (:mod:`minitrain.planning.clusters`), discrete-event:

* each rank has one compute stream and, per process group, one communication stream (NCCL gives
  every process group its own stream);
* a compute span (the time between two calls into the communicator) takes its share of the rank's
  compute for the step — its kernels priced on the device under a software stack
  (:mod:`minitrain.planning.kernels`: the GEMMs of its shapes and layout, the attention core, the
  memory-bound passes, launches; forward, backward, recomputation; the optimizer's bytes) and split
  over the spans of each phase by their measured durations;
* a collective starts when every member of its group has issued it (and its stream is free), and
  takes its α-β time on the link its group spans — inside a node or across nodes, from the rank
  placement (:meth:`~minitrain.planning.clusters.ClusterSpec.seconds`);
* a point-to-point message arrives one transfer after both its send and its receive are posted;
* a wait blocks the compute stream until its communication is done.

``project(result, "dgx-h100", model="7b")`` re-times the same layout for a bigger model of the
same family: each message scaled by what it carries — gradients and weights by the parameters of
the layers they stand for, activations by micro-batch × sequence × hidden — and each per-layer
message repeated for the target's layers.  ``project(result, "local")`` replays the run with its own
measured compute on this machine's α-β: it must give the measured step time back (the
self-consistency of ``benchmarks/projection_bench.py``).

Output: each rank's projected timeline (tracer-style events), the step time and its parts
(compute, exposed communication, bubble, idle), the same time by kind (GEMM, attention,
memory-bound, optimizer, launch, exposed communication, bubble, idle), the share of communication
hidden, MFU, and the memory per device from the ledger, scaled.

The pieces, one module each: :mod:`minitrain.planning.replay` (the discrete-event engine and the step's
parts), :mod:`minitrain.planning.recorded` (a run's recorded events read back as per-rank programs; this
machine's α-β fitted on them), :mod:`minitrain.planning.scaling` (the run's layout, each rank's work, each
message and the memory at the target size), and here what joins them: the cluster's prices for a
compute span (its FLOPs) and a message (the links its group spans), :func:`project`, and the
views lessons draw (:func:`ddp_timeline`, :func:`pipeline_timeline`, :func:`warp`).
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from .clusters import ClusterSpec, get_cluster, parse
from .kernels import Stack, for_working_set, gemm_seconds, rank_compute, stack_named, state_bytes
from ..memory import GB
from ..model import GPTConfig
from ..record import Layout
from .recorded import drop_unmatched, fit_run, message_times, smooth, step_programs, windows
from .recorded import even as even_out
from .analysis import OTHER_COMPUTE, merge_intervals
from .replay import Instance, Op, ReplayError, breakdown, replay, timelines
from .scaling import MODEL_SIZES, RankWork, Scaler, itemsize, rank_memory, rank_work, target_model

__all__ = ["MODEL_SIZES", "target_model", "check_projection", "project", "Projection", "replay",
           "Op", "Instance", "ReplayError", "rank_work", "RankWork", "Scaler", "format_projection",
           "breakdown", "warp", "ddp_timeline", "pipeline_timeline", "fsdp_timeline",
           "fit_run", "message_times", "even_work", "checked_degrees", "check_axes", "check_layout",
           "mesh_sizes", "KINDS", "Band", "published_band", "BAND_FILE", "BAND_COMMAND"]

#: The kinds a projected step's time is told in (they add up to the step time)
KINDS = ("gemm", "attention", "memory", "optimizer", "launch", "exposed_comm", "bubble", "idle")


def _refuse_free_running(layout: Layout, strategy: str, fix: str = "") -> None:
    if layout.free_running:
        raise ValueError(f"strategy {strategy!r} cannot be projected: {layout.free_running}, so "
                         f"there is no shared step to re-time{fix}")


def check_projection(project: str | None, as_model=None, layout: Layout | None = None, *,
                     strategy: str = "", world_size: int = 1,
                     model: GPTConfig | None = None) -> None:
    """Raise ValueError, naming the choices, for a projection that cannot be made: an unknown
    cluster or model size, a free-running strategy, more ranks than the cluster has, or a
    ``layout`` (the strategy's: ``Strategy.layout(cfg)``; ``strategy`` names it) the target model
    cannot take (heads or layers that do not split)."""
    if project is None:
        if as_model is not None:
            raise ValueError("--as-model needs --project CLUSTER (the model is projected on a "
                             "cluster); e.g. --project dgx-h100 --as-model 7b")
        return
    name, _ = parse(project)
    lay = layout or Layout()
    _refuse_free_running(lay, strategy, "; project a lockstep strategy (ddp, zero1-3, pipeline, "
                                        "tensor, 3d, ...)")
    cluster = get_cluster(project) if name not in ("local", "binder") else None
    if cluster is not None and world_size > cluster.devices:
        raise ValueError(f"{world_size} ranks do not fit {cluster.title}: it has {cluster.devices} "
                         f"devices; use {name}xN with N >= {math.ceil(world_size / 8)} nodes or "
                         "fewer ranks")
    check_layout(target_model(as_model, model or GPTConfig()), lay, f"--as-model {as_model}")


def check_layout(cfg: GPTConfig, lay: Layout, what: str) -> None:
    """Raise ValueError when model ``cfg`` cannot be laid out as ``lay`` (``what`` names the
    model in the message): heads or the MLP's width that do not split over tensor parallelism,
    fewer layers than pipeline stages × chunks, positions that do not split into 2·cp chunks.
    The CLI's check before any process starts and :func:`project` both use it."""
    if cfg.n_head % lay.tp or cfg.ff % lay.tp:
        raise ValueError(f"{what}: its {cfg.n_head} heads (d_ff {cfg.ff}) do not split over "
                         f"tensor parallelism {lay.tp}")
    if lay.pp * lay.virtual_stages > cfg.n_layer:
        raise ValueError(f"{what}: {cfg.n_layer} layers cannot fill {lay.pp} stages "
                         f"x {lay.virtual_stages} chunks")
    cp = lay.cp
    if cfg.seq_len % (2 * cp if cp > 1 else 1):
        raise ValueError(f"{what}: its {cfg.seq_len} positions do not split over "
                         f"context parallelism {cp} (2·cp chunks)")


def check_axes(lay: Layout, degrees: dict) -> None:
    """Raise ValueError when ``degrees`` re-size an axis the run does not have: its ranks can
    stand for more replicas or wider tensor-parallel groups, not for an axis it never split
    over (no strategy runs that layout, and none of its traffic was recorded)."""
    has = {a: getattr(lay, a) for a in ("dp", "tp", "pp", "cp", "ep") if getattr(lay, a) > 1}
    extra = sorted(a for a, size in degrees.items() if a not in has and size != getattr(lay, a))
    if extra:
        axes = " x ".join(f"{a} {n}" for a, n in has.items()) or "none (one rank)"
        raise ValueError(f"degrees re-size only an axis the run has; it has no {', '.join(extra)} "
                         f"axis (its axes: {axes}); record a run that splits over "
                         f"{' and '.join(extra)} to project that layout")


def even_work(summary) -> bool:
    """Whether :func:`project`'s ``even`` holds for this run (a :class:`~minitrain.record.RunSummary`)
    — its micro-batches do equal work: a pipeline (alone or inside a mesh: ``3d``) of GPipe or
    1F1B (what ``even`` is for) whose replica's batch splits into equal micro-batches
    (``torch.tensor_split``: otherwise their sizes differ by one sample).  The CLI and
    ``train(project=...)`` project with it, as lesson 05 does."""
    lay = summary.layout
    m = lay.microbatches
    local, rest = divmod(summary.batch_size, lay.dp)
    return (lay.pp > 1 and lay.schedule in ("gpipe", "1f1b") and m > 1 and not rest
            and local % m == 0)


# --------------------------------------------------------------------------------------------------
# The uncertainty a projected number carries
# --------------------------------------------------------------------------------------------------

#: published runs re-timed by the projection, with their measured step times
#: (``benchmarks/projection_bench.py`` part (b)); the band is read from here
BAND_FILE = Path(__file__).parent / "data" / "published_check.json"
#: the command that writes :data:`BAND_FILE`, run from the repository's root
BAND_COMMAND = "OMP_NUM_THREADS=1 python benchmarks/projection_bench.py --only b --write"


@dataclass(frozen=True)
class Band:
    """How far published step times fell from their projections: each published run's
    ``published / projected`` step time; ``low`` and ``high`` are the smallest and largest of
    those ratios (what a projected step time is multiplied by to give the range the published
    runs spanned), ``median`` their median, ``median_error`` the median ``|ratio - 1|``;
    ``rows`` published runs from ``groups`` independent groups.  Measured, never fitted: it
    changes no projected value."""

    low: float
    high: float
    median: float
    median_error: float
    rows: int
    groups: int
    date: str
    source: str

    def words(self, what: str = "step time") -> str:
        """The spread in words: "14 published runs from 4 groups took 1.04–1.65× their projected
        step time"."""
        return (f"{self.rows} published runs from {self.groups} groups took "
                f"{self.low:.2f}–{self.high:.2f}× their projected {what}")


def published_band() -> Band:
    """The spread :data:`BAND_FILE` records (read once); a FileNotFoundError naming
    :data:`BAND_COMMAND` when the file is not there."""
    return _read_band(BAND_FILE)


@functools.cache
def _read_band(path: Path) -> Band:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the projection's uncertainty band is read from {path}, which is missing; make it "
            f"from the repository's root with: {BAND_COMMAND}") from None
    s = doc["summary"]
    return Band(low=s["min_ratio"], high=s["max_ratio"], median=s["median_ratio"],
                median_error=s["median_abs_error"], rows=s["rows"], groups=s["groups"],
                date=s["date"],
                source=(f"benchmarks/projection_bench.py (b): {s['rows']} published runs from "
                        f"{s['groups']} independent groups, {s['date']}"))


def _figure(x: float) -> str:
    """``x`` to about three significant figures, without an exponent."""
    digits = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:,.{digits}f}"


# --------------------------------------------------------------------------------------------------
# The projection of a run
# --------------------------------------------------------------------------------------------------


@dataclass
class Projection:
    """A run re-timed on a cluster (:func:`project`).

    ``step_time_s`` is the median step's (``step_times_s`` step by step); its parts ``compute_s``,
    ``exposed_comm_s``, ``bubble_s``, ``idle_s`` (means over ranks: they add up to the step time),
    ``comm_s`` (the time communication is in flight) and ``hidden_comm_share``; ``mfu`` (model
    FLOPs) and ``hfu`` (with recomputation) against the devices' peak; ``memory``: bytes per
    device; ``timeline``: per rank, tracer-style events and compute spans, seconds from the drawn
    step's start; ``measured_step_s``: the run's own median step, all ranks, beside it.  ``step``
    (which recorded step is drawn), ``windows`` (each rank's start of it) and ``replay`` (its
    replay) are what :func:`warp` redraws a measured timeline with."""

    cluster: str
    cluster_title: str
    model: str
    params: int
    precision: str
    compute_mode: str  # "measured" (each compute span as measured) or "model" (from its kernels)
    degrees: dict | None
    step_time_s: float
    step_times_s: list[float]
    measured_step_s: float
    measured_step_times_s: list[float]
    mean_step_time_s: float
    measured_mean_step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    idle_s: float
    comm_s: float
    hidden_comm_share: float | None  # None where nothing is communicated
    mfu: float | None
    hfu: float | None
    tokens_per_s: float | None
    memory: list[dict]
    fits: bool | None  # None off accelerators
    timeline: list[list[dict]]
    sources: list[str]
    step: int
    windows: dict
    replay: dict
    even: bool = False  # each micro-batch given equal work (project's ``even``)
    stack: str = ""  # the software stack the kernels were priced under
    time_by_kind: dict = None  # seconds of the step by kind (KINDS): they add up to the step time
    devices: int = 0  # the devices the projection stands for (the mesh's)
    global_batch: int = 0  # sequences per step over all replicas
    accelerator: bool = False  # projected on an accelerator preset (the band applies)

    @property
    def memory_per_device_gb(self) -> list[float]:
        return [m["total"] / 1e9 for m in self.memory]

    @property
    def band(self) -> Band | None:
        """The published runs' spread (:func:`published_band`) where it applies, else None."""
        return published_band() if self.accelerator else None

    @property
    def step_time_range_s(self) -> tuple[float, float] | None:
        """(low, high) seconds: the step time times the smallest and the largest published /
        projected ratio of the published runs; None off accelerators."""
        band = self.band
        return None if band is None else (self.step_time_s * band.low,
                                          self.step_time_s * band.high)

    @property
    def mfu_range(self) -> tuple[float, float] | None:
        """(low, high) MFU over the same range of step times; None off accelerators or without
        an MFU."""
        band = self.band
        if band is None or self.mfu is None:
            return None
        return self.mfu / band.high, self.mfu / band.low

    def range_text(self, unit: str = "ms") -> str:
        """The step time and its uncertainty in words, in ``unit`` ("ms" or "s"), e.g. "382 ms
        (uncertainty 398–629 ms: 14 published runs from 4 groups took 1.04–1.65× their projected
        step time)"; the step time alone off accelerators.  The range need not contain the
        projected value: it is where the published runs fell, on whichever side that was."""
        scale = {"ms": 1e3, "s": 1.0}.get(unit)
        if scale is None:
            raise ValueError(f"unit is 'ms' or 's', got {unit!r}")
        text = f"{_figure(self.step_time_s * scale)} {unit}"
        band, span = self.band, self.step_time_range_s
        if band is None:
            return text
        return (f"{text} (uncertainty {_figure(span[0] * scale)}–{_figure(span[1] * scale)} "
                f"{unit}: {band.words()})")

    def to_dict(self) -> dict:
        """The fields a run's JSON summary carries (``minitrain train --project ... --json``): no
        timelines, no replay."""
        out = {k: getattr(self, k) for k in _SUMMARY_FIELDS}
        out["even"] = self.even
        out["memory_per_device_gb"] = self.memory_per_device_gb
        out.update(stack=self.stack, time_by_kind=self.time_by_kind, devices=self.devices,
                   global_batch=self.global_batch)
        span = self.step_time_range_s
        out["step_time_range_s"] = list(span) if span else None
        return out


_SUMMARY_FIELDS = ("cluster", "cluster_title", "model", "params", "precision", "compute_mode",
                   "step_time_s", "measured_step_s", "compute_s", "exposed_comm_s", "bubble_s",
                   "idle_s", "comm_s", "hidden_comm_share", "mfu", "tokens_per_s", "fits",
                   "sources")


def checked_degrees(degrees: dict | None) -> dict:
    """``degrees`` as :func:`project` takes them ({"dp": 8}: an axis, "dp" or "tp", and a whole
    number of devices; None leaves an axis as the run had it), or a ValueError saying what is
    wrong."""
    if degrees is not None and not isinstance(degrees, dict):
        raise ValueError(f"degrees is a dict of axis and devices, e.g. {{'dp': 8}}, got {degrees!r}")
    out = {}
    for axis, size in (degrees or {}).items():
        if size is None:
            continue
        if axis not in ("dp", "tp"):
            raise ValueError(f"degrees re-size data and tensor parallelism only ('dp', 'tp'), "
                             f"got {axis!r}")
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"degrees[{axis!r}] must be a whole number of devices, at least 1, "
                             f"got {size!r}")
        out[axis] = int(size)
    return out


def mesh_sizes(lay: Layout, degrees: dict) -> dict:
    """{axis: size} of the mesh a projection stands for: the run's layout, each axis ``degrees``
    names (checked: :func:`checked_degrees`) re-sized; their product is its devices."""
    return {a: degrees.get(a, getattr(lay, a)) for a in _ORDER}


def project(result, cluster="dgx-h100", model=None, *, precision: str | None = None,
            compute: str | None = None, degrees: dict | None = None, steps=None,
            recompute: bool | None = None, even: bool = False,
            stack: str | Stack | None = None, gemm=gemm_seconds) -> Projection:
    """Re-time ``result`` (a :class:`~minitrain.record.RunResult` from
    ``train(..., record_events=True)`` or ``project=``) on ``cluster`` (a preset name, a
    :class:`~minitrain.planning.clusters.ClusterSpec`; "local"/"binder" need the run's
    calibration) for ``model`` (None: the run's own; "1.3b", "7b"..., or a GPTConfig).

    ``precision``: of the projected run (default: the run's, but an fp32 run on GPUs as bf16-mixed,
    the way such models are trained).  ``compute``: "measured" keeps each compute span's measured
    duration (this machine, same model: the self-consistency check; on "binder" stretched by the
    cores the ranks had here, as they would share one), "model" (default otherwise) prices it from
    its FLOPs.  ``degrees``: {axis: size} re-sizes the groups of an axis ("dp" or "tp"; a whole
    number of devices) — the run's ranks stand for a bigger mesh of the same shape (every replica
    alike), e.g. ``{"dp": 48}`` for 48 replicas where the run had 2.  ``steps``: which recorded
    steps (default: all but the first); the median step is drawn.  ``recompute``: count one more
    forward of the blocks (activation checkpointing) where the run did not recompute (a strategy
    that cannot) — its FLOPs only: the recomputed forward's communication is not in the run's log.
    ``even``: every forward (and every backward) a rank ran in the step does the same work — a
    pipeline's equal micro-batches — so each gets the same share of its phase's FLOPs, not a share
    in proportion to how long it happened to take here (:func:`minitrain.planning.recorded.even`;
    for GPipe and 1F1B only).  ``stack``: the software stack the kernels are priced under (a name
    of :data:`minitrain.planning.kernels.STACKS` or a Stack; default: "flash" on GPUs, "sdpa" on
    a CPU).  ``gemm``: what prices each matrix product of the kernel model, shaped like
    :func:`~minitrain.planning.kernels.gemm_seconds` (``gemm(device, m, n, k, batch, precision)
    -> seconds``; lesson 07's exercise puts the learner's there).  Returns a :class:`Projection`."""
    summary = result.summary
    if result.events is None:
        raise ValueError("this result has no recorded events: train with record_events=True (or "
                         "project=...) to project it")
    _refuse_free_running(summary.layout, summary.strategy)
    spec = cluster if isinstance(cluster, ClusterSpec) else _cluster(cluster, result, compute,
                                                                      model)
    target = target_model(model, summary.model)
    precision = precision or (summary.precision if not spec.accelerator or
                              summary.precision != "fp32" else "bf16-mixed")
    items = (itemsize(summary.precision), itemsize(precision))
    same = target == summary.model and items[0] == items[1]
    mode = compute or ("measured" if (same and spec.key in ("local", "binder")) else "model")
    degrees = checked_degrees(degrees)
    check_axes(summary.layout, degrees)
    check_layout(target, replace(summary.layout, **degrees), _model_name(model, target))
    sizes = mesh_sizes(summary.layout, degrees)
    if degrees and math.prod(sizes.values()) > spec.devices:
        raise ValueError(f"the mesh {sizes} needs {math.prod(sizes.values())} devices; "
                         f"{spec.title} has {spec.devices}")
    work = {r: rank_work(summary, target, r, degrees, recompute)
            for r in range(summary.world_size)}
    recorded = len(windows(result.events[0]["marks"]))
    if recorded == 0:
        raise ValueError("no step was recorded")
    chosen = list(steps) if steps is not None else (list(range(1, recorded)) or [0])
    pricing = _Pricing(summary, spec, precision, mode, degrees, sizes, work, target,
                       stack_named(stack, spec.device.kernels), recompute, gemm)
    scale = Scaler(summary, summary.model, target, items, degrees)
    built = [step_programs(result, i) for i in chosen]
    smooth([b[0] for b in built])
    if even:
        for i, (programs, _, _) in zip(chosen, built):
            even_out(result, i, programs)
    replays = [_replay_step(programs, events, window, scale, pricing)
               for programs, events, window in built]
    order = sorted(range(len(replays)), key=lambda k: replays[k]["step_time"])
    median = replays[order[len(order) // 2]]  # the median step: its parts and timeline are shown
    return _projection(summary, pricing, model, target, replays, median,
                       chosen[order[len(order) // 2]], even)


class _Pricing:
    """What a step's replay is priced with on ``spec``: each rank's node, each collective's
    seconds on the links its group spans, each compute span's seconds."""

    def __init__(self, summary, spec: ClusterSpec, precision: str, mode: str, degrees: dict,
                 sizes: dict, work: dict, target: GPTConfig, stack: Stack,
                 recompute: bool | None, gemm=gemm_seconds):
        self.spec, self.precision, self.mode, self.work = spec, precision, mode, work
        self.stack, self.recompute = stack, recompute
        self.degrees, self.sizes = degrees, sizes
        self.axes = _axes(summary.layout, summary.world_size)
        self.nodes = _placement(spec, summary.world_size, degrees)
        self.ranks_on_node = defaultdict(int)
        for node in self.nodes.values():
            self.ranks_on_node[node] += 1
        # Binder: the same spans on one core where this machine gave them min(ranks, cores)
        self.stretch = (min(summary.world_size, spec.calibration.get("cores", 1))
                        if spec.key == "binder" and mode == "measured" else 1.0)
        # {rank: Compute}: each rank's step as kernels (None: no kernel model here)
        self.kernels = _kernel_compute(summary, spec, target, work, precision, stack, recompute,
                                       self.cpu_stretch, gemm)

    def cpu_stretch(self, rank: int) -> float:
        """How much longer a CPU rank's kernels take here than where they were calibrated: the
        calibration ran R ranks at once on C cores (each a share min(1, C/R) of one); here the
        ranks on this rank's node share the device's cores."""
        cal, device = self.spec.calibration, self.spec.device
        if self.spec.accelerator or not cal:
            return 1.0
        measured = min(1.0, cal.get("cores", 1) / max(1, cal.get("ranks", 1)))
        here = min(1.0, (device.cores or 1) / self.ranks_on_node[self.nodes[rank]])
        return measured / here

    def overlap_slowdown(self) -> float:
        """How much slower modelled compute runs while communication overlaps it: on a GPU the
        stack's ``comm_sms`` taken from the device's SMs; on this machine's CPU as measured
        beside its collectives (the calibration's ``overlap_slowdown``); 1 for measured compute,
        whose spans already took it."""
        if self.mode != "model" or not self.kernels:
            return 1.0
        if not self.spec.accelerator:
            return float(self.spec.calibration.get("overlap_slowdown") or 1.0)
        return self.stack.overlap_slowdown(self.spec.device.kernels)

    def tp_overlap(self) -> bool:
        """Whether the tensor-parallel collectives run beside the compute that follows them (a
        stack with ``tp_overlap``, its compute modelled on GPUs)."""
        return (self.mode == "model" and bool(self.kernels) and self.spec.accelerator
                and self.stack.tp_overlap and "tp" in self.axes.values())

    def bytes_share(self, inst: Instance) -> float:
        """The share of ``inst``'s time that grows with its bytes (its β part, not its α)."""
        full = self.cost(inst)
        return 1.0 - self.cost(replace(inst, bytes=0.0)) / full if full > 0 else 0.0

    def cost(self, inst: Instance) -> float:
        n = len(inst.members) if inst.op in ("send", "recv") else self.degrees.get(
            _axis_of(inst, self.axes), len(inst.members))
        where = _member_nodes(inst, self.nodes, n, self.sizes, self.axes, self.spec,
                              bool(self.degrees))
        return inst.repeat * self.spec.seconds(inst.op, inst.bytes, where)

    def compute(self, programs):
        """compute(rank, op) for :func:`replay`: as measured (stretched on Binder), or None (each
        span's own seconds), or from its FLOPs (:func:`_model_compute`)."""
        if self.mode == "model":
            if self.kernels is None:
                raise ValueError(f"cluster {self.spec.key!r} has no kernel model to price compute "
                                 "with: train with project='local' (or 'binder') to calibrate it")
            return _model_compute(programs, self.kernels)
        return (lambda rank, op, k=self.stretch: op.seconds * k) if self.stretch != 1.0 else None


def _replay_step(programs, events, window, scale: Scaler, pricing: _Pricing) -> dict:
    """One recorded step replayed on the cluster: each message at the target size, the compute
    priced, each rank started where it started here (measured) or together."""
    instances = {}
    for r, evs in events.items():
        for key, e in evs.items():
            nbytes, repeat = scale(e, r)
            members = (key[1], key[2]) if key[0] == "p" else key[1]
            old = instances.get(key)
            if old is None or nbytes > old.bytes:
                instances[key] = Instance(e["op"], members, nbytes, repeat, e["group"], e["tag"])
    drop_unmatched(programs, instances)
    if pricing.tp_overlap():
        programs = _tp_overlapped(programs, instances, pricing.axes)
    first = min(w[0] for w in window.values())
    offsets = ({r: w[0] - first for r, w in window.items()} if pricing.mode == "measured"
               else None)
    compute = pricing.compute(programs)
    out = replay(programs, instances, pricing.cost, compute,
                 issue_cost=not pricing.spec.accelerator, start=offsets)
    slowdown = pricing.overlap_slowdown()
    if slowdown > 1.0:  # the compute that overlapped communication, on the SMs NCCL left it
        busy = None if pricing.spec.accelerator else {
            key: pricing.bytes_share(inst) for key, inst in instances.items()}
        stretch = _overlap_stretch(programs, instances, out, slowdown,
                                   messages=not pricing.spec.accelerator, busy=busy)
        out = replay(programs, instances, pricing.cost,
                     lambda r, op: compute(r, op) * stretch.get(id(op), 1.0),
                     issue_cost=not pricing.spec.accelerator, start=offsets)
    out["instances"], out["window"] = instances, window
    out["measured"] = max(w[1] for w in window.values()) - first
    return out


def _tp_overlapped(programs: dict, instances: dict, axes: dict) -> dict:
    """``programs`` with each tensor-parallel collective that the rank waited for at once waited
    for only after the compute span that follows it: the collective runs beside that compute,
    as Megatron-LM's --tp-comm-overlap and PyTorch's asynchronous tensor parallelism run it
    (the GEMM split into chunks, each chunk's communication beside the next chunk's product)."""
    out = {}
    for r, prog in programs.items():
        ops, i = [], 0
        while i < len(prog):
            op = prog[i]
            if (op.kind == "issue" and op.key[0] == "c" and i + 2 < len(prog)
                    and prog[i + 1].kind == "wait" and prog[i + 1].key == op.key
                    and prog[i + 2].kind == "compute"
                    and _axis_of(instances[op.key], axes) == "tp"):
                ops += [op, prog[i + 2], prog[i + 1]]
                i += 3
                continue
            ops.append(op)
            i += 1
        out[r] = ops
    return out


def _overlap_stretch(programs, instances: dict, replayed: dict, slowdown: float,
                     messages: bool = False, busy=None) -> dict:
    """{id(compute op): factor}: each compute span of a replay lengthened by ``slowdown`` for the
    share of it that ran while one of its rank's collectives was in flight (their kernels hold SMs
    the compute then lacks; a pipeline's point-to-point messages, on a channel or two, are not
    counted on a GPU — ``messages`` counts them: on a CPU every message takes the cores' time).
    ``busy``: {key: the share of a communication's time that takes the compute's resources} (on a
    CPU, the part of its time that grows with its bytes: the copies, not the latency; default
    all).  One pass: the spans are moved by the lengthening, which a second replay with these
    factors takes in."""
    out = {}
    for r, prog in programs.items():
        spans = [(a, b, busy[key] if busy else 1.0) for key, (a, b) in replayed["comm"].items()
                 if (messages or key[0] == "c") and r in instances[key].members and b > a]
        segments = (s for s in replayed["ranks"][r]["segments"] if s["kind"] == "compute")
        for op in (op for op in prog if op.kind == "compute"):
            seg = next(segments)
            length = seg["end"] - seg["start"]
            if length <= 0 or not spans:
                continue
            shared = sum(w * max(0.0, min(b, seg["end"]) - max(a, seg["start"]))
                         for a, b, w in spans)
            out[id(op)] = 1.0 + (slowdown - 1.0) * min(shared, length) / length
    return out


def _projection(summary, pricing: _Pricing, model, target: GPTConfig, replays: list,
                median: dict, step: int, even: bool) -> Projection:
    """The :class:`Projection` of the replayed steps: the median step's time, parts, timeline,
    MFU, and the memory per device."""
    T, world, lay = median["step_time"], summary.world_size, summary.layout
    spec, precision, work, sizes = pricing.spec, pricing.precision, pricing.work, pricing.sizes
    peak = spec.device.peak(precision)
    if not spec.accelerator:
        peak = spec.device.flop_rate(precision, max(pricing.ranks_on_node.values()))
    memory = rank_memory(summary, summary.model, target, precision, work, sizes["dp"],
                         pricing.recompute)
    parts = breakdown(median, lay.pp > 1)
    return Projection(
        cluster=spec.key, cluster_title=spec.title, model=_model_name(model, target),
        params=target.num_params(), precision=precision, compute_mode=pricing.mode,
        degrees=pricing.degrees or None, step_time_s=T,
        step_times_s=[r["step_time"] for r in replays],
        measured_step_s=statistics.median(r["measured"] for r in replays),
        measured_step_times_s=[r["measured"] for r in replays],
        mean_step_time_s=statistics.fmean(r["step_time"] for r in replays),
        measured_mean_step_s=statistics.fmean(r["measured"] for r in replays),
        **parts,
        mfu=sum(w.model_flops for w in work.values()) / (T * world * peak) if T > 0 else None,
        hfu=sum(w.flops for w in work.values()) / (T * world * peak) if T > 0 else None,
        tokens_per_s=(summary.batch_size * target.seq_len * sizes["dp"] / lay.dp / T
                      if T > 0 else None),
        memory=memory,
        fits=(all(m["total"] <= spec.device.memory_gb * GB for m in memory) if spec.accelerator
              else None),
        timeline=timelines(median), sources=spec.row()["sources"], step=step,
        windows={r: w[0] for r, w in median["window"].items()},  # each rank's step start
        replay=median, even=even, stack=pricing.stack.name if pricing.kernels else "",
        time_by_kind=_time_by_kind(parts, pricing.kernels),
        devices=math.prod(sizes.values()),
        global_batch=round(summary.batch_size * sizes["dp"] / lay.dp),
        accelerator=spec.accelerator)


def _time_by_kind(parts: dict, kernels: dict | None) -> dict:
    """The step's time by kind (:data:`KINDS`): its compute split as the kernel model splits the
    ranks' compute (their mean), then exposed communication, bubble and idle — they add up to
    the step time.  Without a kernel model, compute is one part."""
    out = {}
    compute = parts["compute_s"]
    if kernels:
        mean = {k: statistics.fmean(c.by_kind[k] for c in kernels.values())
                for k in KINDS[:5]}
        total = sum(mean.values())
        out = {k: compute * t / total if total > 0 else 0.0 for k, t in mean.items()}
    else:
        out["compute"] = compute
    out.update(exposed_comm=parts["exposed_comm_s"], bubble=parts["bubble_s"], idle=parts["idle_s"])
    return out


def ddp_timeline(result, projection: Projection) -> list[dict]:
    """The DDP report's timeline of the projected step (``--timeline``: backward and each bucket's
    all-reduce, per rank) re-timed: the form :func:`minitrain.viz.timeline.timeline_rows` draws.
    Backward's edges are warped (:func:`warp`); a bucket runs when the replay ran it."""
    out = []
    for rank, rep in enumerate(result.summary.report):
        step = rep["timeline"][projection.step - result.summary.start_step]
        comm = {e["tag"]: e for e in projection.timeline[rank] if e["op"] != "compute"}
        buckets = []
        for b in step["buckets"]:
            e = comm.get(f"bucket{b['index']}")
            start, end = (e["issued"], e["end"]) if e else (warp(projection, rank, b["start"]),) * 2
            buckets.append({**b, "start": start, "end": end, "bytes": e["bytes"] if e else b["bytes"]})
        out.append({"timeline": [{"backward_start": warp(projection, rank, step["backward_start"]),
                                  "backward_end": warp(projection, rank, step["backward_end"]),
                                  "buckets": buckets}]})
    return out


def fsdp_timeline(result, projection: Projection) -> list[list[dict]]:
    """ZeRO-3's report timeline (``zero3 --timeline``: each unit's gather, compute, free and
    reduce-scatter, per rank) of the projected step, re-timed: the form
    :func:`minitrain.viz.fsdp.plot_fsdp_timeline` draws.  A unit's k-th gather (reduce-scatter)
    runs from when the replay issued its k-th ``params-unitK`` all-gather (``grad-unitK``
    reduce-scatter) to when that completed; compute spans and frees are warped (:func:`warp`).
    The replay's compute outside every unit's (hooks, the loss, the optimizer) is added as unit
    ``OTHER_COMPUTE``, so the drawn step computes what the replay does and a gather's hidden
    share in it is the replay's."""
    out = []
    start_step = result.summary.start_step
    for rank, rep in enumerate(result.summary.report):
        events = rep["timeline"][projection.step - start_step]
        comm: dict = defaultdict(list)
        for e in projection.timeline[rank]:
            if e["op"] != "compute":
                comm[e["tag"]].append(e)
        used: dict = defaultdict(int)
        rows = []
        for e in sorted(events, key=lambda e: e["start"]):
            tag = {"gather": f"params-unit{e['unit']}",
                   "reduce_scatter": f"grad-unit{e['unit']}"}.get(e["kind"])
            if tag is not None and used[tag] < len(comm[tag]):
                c = comm[tag][used[tag]]
                used[tag] += 1
                rows.append({**e, "start": c["issued"], "end": c["end"]})
            else:
                rows.append({**e, "start": warp(projection, rank, e["start"]),
                             "end": warp(projection, rank, e["end"])})
        units = merge_intervals((e["start"], e["end"]) for e in rows if e["kind"] == "compute")
        replayed = merge_intervals((e["start"], e["end"]) for e in projection.timeline[rank]
                                   if e["op"] == "compute")
        for a, b in replayed:  # each replayed compute span, less the units' spans inside it
            for x, y in units:
                if a < min(b, x) - 1e-12:
                    rows.append({"unit": OTHER_COMPUTE, "kind": "compute", "start": a,
                                 "end": min(b, x), "backward": False})
                a = max(a, y)
            if a < b - 1e-12:
                rows.append({"unit": OTHER_COMPUTE, "kind": "compute", "start": a, "end": b,
                             "backward": False})
        out.append(rows)
    return out


def pipeline_timeline(result, cluster="dgx-h100", model=None, **kw) -> tuple[list, Projection]:
    """The pipeline's measured timeline (its report's, the last step's) re-timed on ``cluster`` at
    ``model``: ``(timeline, projection)`` — the timeline in the executor's own form (``rank``,
    ``action``, ``ready``, ``start``, ``end``; seconds from the step's start), what the lesson's
    Gantt charts draw."""
    steps = len(windows(result.events[0]["marks"]))
    p = project(result, cluster, model, steps=[steps - 1], **kw)
    # the executor's clock starts on rank 0 after its barrier, where it broadcast that reading
    window = windows(result.events[0]["marks"])[steps - 1]
    t0 = next(e["start"] for e in sorted(result.events[0]["events"], key=lambda e: e["start"])
              if not e["traced"] and e["op"] == "broadcast" and e["start"] >= window[1])
    out = []
    for e in result.summary.report[0]["timeline"]:
        r = e["rank"]
        out.append({**e, **{k: warp(p, r, t0 + e[k]) for k in ("ready", "start", "end")}})
    return out, p


def warp(projection: Projection, rank: int, t: float) -> float:
    """The projected time (seconds from the drawn step's start) of the instant ``t`` (a
    ``time.perf_counter()`` reading on ``rank`` during that step, as the measured timelines of DDP,
    ZeRO-3 and the pipeline record them): inside a replayed span, at the same fraction of it — so a
    lesson draws its measured timeline re-timed with the same function that draws it measured."""
    rel = t - projection.windows[rank]
    segs = projection.replay["ranks"][rank]["segments"]
    for s in segs:
        a, b = s["measured"]
        if a <= rel <= b:
            frac = (rel - a) / (b - a) if b > a else 1.0
            return s["start"] + frac * (s["end"] - s["start"])
    if segs and rel > segs[-1]["measured"][1]:
        return segs[-1]["end"]
    return segs[0]["start"] if segs else 0.0


def format_projection(p: Projection) -> str:
    """The readable summary's lines: the step and its parts, where the time goes by kind, and what
    a reader needs to check it — the devices, the global batch, the precision and stack, and the
    memory's make-up."""
    hidden = p.hidden_comm_share
    worst = max(p.memory, key=lambda m: m["total"]) if p.memory else None
    mem = worst["total"] / GB if worst else 0.0
    lines = [f"projected on {p.cluster} as {p.model}: {p.step_time_s * 1e3:,.2f} ms per step "
             f"(compute {p.compute_s * 1e3:,.2f}, exposed comm {p.exposed_comm_s * 1e3:,.2f}, "
             f"bubble {p.bubble_s * 1e3:,.2f}, idle {p.idle_s * 1e3:,.2f} ms; "
             f"{'n/a' if hidden is None else f'{hidden:.0%}'} of comm hidden), MFU "
             f"{p.mfu:.1%}, {mem:,.1f} GB per device"
             + ("" if p.fits in (None, True) else " — does not fit") +
             f"; measured here {p.measured_step_s * 1e3:,.2f} ms"]
    if p.band is not None:
        lines.append(f"  step time with its uncertainty: {p.range_text()}")
    if p.time_by_kind:
        kinds = ", ".join(f"{k.replace('_', ' ')} {t * 1e3:,.2f}" for k, t in p.time_by_kind.items())
        lines.append(f"  where the step's time goes (ms): {kinds}")
    if worst:
        states = worst["parameters"] + worst["gradients"] + worst["optimizer_states"]
        host = f", {worst['host'] / GB:,.1f} GB of optimizer states on the host" \
            if worst.get("host") else ""
        lines.append(f"  {p.devices} devices of {p.cluster} ({p.cluster_title}), {p.global_batch} "
                     f"sequences per step, {p.precision}" + (f", stack {p.stack!r}" if p.stack
                                                              else "")
                     + f"; per device {states / GB:,.1f} GB model states + "
                     f"{worst['activations'] / GB:,.1f} GB activations"
                     + (f" + {worst['zero3_gathered'] / GB:,.1f} GB gathered layer"
                        if worst.get("zero3_gathered") else "") + host)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Pricing on a cluster: this machine's spec, compute from FLOPs, links from the placement
# --------------------------------------------------------------------------------------------------


def _cluster(name: str, result, compute, model) -> ClusterSpec:
    """A preset, or this machine: calibrated (``summary.calibration``), its α-β fitted on the
    run's own messages when they tell (:func:`fit_run`) — what the measured compute is replayed
    with."""
    key, _ = parse(name)
    if key not in ("local", "binder"):
        return get_cluster(name)
    cal = dict(result.summary.calibration or {})
    fitted = fit_run(result, cal.get("beta"))
    if fitted is not None:
        if fitted.get("p2p_alpha") is None:
            fitted.pop("p2p_alpha", None)
        cal.update(fitted, fit="α: the run's own messages; β: " + (
            "an all-reduce sweep after the run (lesson 01)" if "flop_rate" in cal
            else "the run's own messages"))
    elif cal:
        cal["fit"] = "an all-reduce sweep after the run (lesson 01)"
    if result.summary.world_size == 1:
        cal.setdefault("alpha", 0.0)  # one rank sends nothing
    cal.setdefault("beta", 0.0)
    if "flop_rate" not in cal:
        if compute == "model" or model is not None or key == "binder":
            raise ValueError(f"cluster {key!r} prices compute at this machine's calibrated FLOP "
                             "rate: train with project='local' (or 'binder') to calibrate")
        cal.update(ranks=result.summary.world_size, cores=1, flop_rate=1.0, memory_rate=1.0)
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


def _recompute_policy(summary, recompute: bool | None, stack: Stack) -> str:
    """What backward runs again: the whole block's forward where the run (or ``recompute``)
    checkpoints activations, nothing where ``recompute`` is False, else the stack's policy."""
    if recompute is None:
        return "full" if summary.checkpoint_activations else stack.recompute
    return "full" if recompute else "none"


def _kernel_compute(summary, spec: ClusterSpec, target: GPTConfig, work: dict, precision: str,
                    stack: Stack, recompute: bool | None, stretch,
                    gemm=gemm_seconds) -> dict | None:
    """{rank: :class:`~minitrain.planning.kernels.Compute`}: each rank's step as kernels on the
    device (None where the device has no kernel model: an uncalibrated CPU).  Each rank runs the
    run's micro-batches of batch / (dp · micro-batches) sequences through its blocks;
    ``stretch(rank)`` is how much slower a CPU rank's kernels run here than calibrated."""
    device = spec.device.kernels
    if device is None:
        return None
    lay = summary.layout
    per_mb = summary.batch_size / (lay.dp * lay.microbatches)
    micro_batch = max(1, int(per_mb))
    microbatches = lay.microbatches * per_mb / micro_batch
    policy = _recompute_policy(summary, recompute, stack)
    sp = bool((summary.options or {}).get("sequence_parallel"))
    out = {}
    for r, w in work.items():
        state = state_bytes(target, w.blocks, w.head, w.embed, w.tp, lay.ep)
        c = rank_compute(target, for_working_set(device, state), stack, tokens_per_microbatch=micro_batch * target.seq_len,
                         micro_batch=micro_batch, microbatches=microbatches, blocks=w.blocks,
                         head=w.head, embed=w.embed, tp=w.tp, cp=lay.cp, sp=sp, ep=lay.ep,
                         opt_params=w.opt_params, precision=precision, recompute=policy,
                         gemm=gemm)
        out[r] = _stretched(c, stretch(r))
    return out


def _stretched(c, k: float):
    if k == 1.0:
        return c
    return replace(c, forward_s=c.forward_s * k, backward_s=c.backward_s * k,
                   recompute_s=c.recompute_s * k, optimizer_s=c.optimizer_s * k,
                   by_kind={kind: t * k for kind, t in c.by_kind.items()})


def _model_compute(programs, kernels: dict):
    """compute(rank, op) pricing each span from the rank's kernels — its forward kernels over its
    forward spans, the rest (backward, recomputation) over the others — and its optimizer step
    over its optimizer spans, each shared out by measured durations."""
    measured = {r: defaultdict(float) for r in programs}
    for r, prog in programs.items():
        for op in prog:
            if op.kind == "compute":
                measured[r][op.phase] += op.share
    totals = {}
    for r in programs:
        c = kernels[r]
        forward, rest, opt = c.forward_s, c.backward_s + c.recompute_s, c.optimizer_s
        if not measured[r]["forward"]:
            forward, rest = 0.0, rest + forward
        if not measured[r]["optimizer"]:
            rest += opt
        totals[r] = {"forward": forward, "model": rest, "optimizer": opt}

    def price(rank, op):
        m = measured[rank][op.phase]
        return totals[rank][op.phase] * op.share / m if m > 0 else 0.0

    return price


def _axes(layout: Layout, world_size: int) -> dict:
    """{ranks tuple: axis name} for the run's groups (the world: "world", unless it is the one
    group of an axis)."""
    out = {tuple(range(world_size)): "world"}
    for axis, groups in layout.groups.items():
        for ranks in groups:
            out[tuple(ranks)] = axis
    return out


def _axis_of(inst: Instance, axes: dict) -> str | None:
    if inst.members in axes:
        return axes[inst.members]
    if len(inst.members) == 2 and inst.op in ("send", "recv"):
        for ranks, axis in axes.items():
            if set(inst.members) <= set(ranks) and len(ranks) > 1:
                return axis
    return None


def _placement(spec: ClusterSpec, world: int, degrees: dict) -> dict:
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
