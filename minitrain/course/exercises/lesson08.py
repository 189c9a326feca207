"""Lesson 08: the process groups of a 3D mesh; the step-time model of a layout, and a layout picked
with it for a real job (checked against the chooser's pricing: one cost model with the
projection)."""

from __future__ import annotations

import torch

from .core import exercise, raised, ranks
from .inside import Row, inside


#: (dp, pp, tp) meshes the mesh_groups checker tries, odd sizes and size-1 axes included
_MESH_SHAPES = [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 1), (1, 1, 1), (2, 1, 3)]


def _mesh_groups_of(fn, dp: int, pp: int, tp: int, axis: str):
    """The learner's groups, each sorted, or the sentence saying why they are not groups."""
    call = f"{getattr(fn, '__name__', 'your function')}({dp}, {pp}, {tp}, {axis!r})"
    try:
        got = fn(dp, pp, tp, axis)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(call, exc, fn)
    if got is None:
        return f"{call} returned None: return a list of groups, each a list of ranks"
    try:
        return sorted(sorted(int(r) for r in g) for g in got)
    except (TypeError, ValueError):
        return f"{call} returned {got!r}: return a list of lists of ranks, like [[0, 1], [2, 3]]"


def _mesh_groups_rank(groups: dict) -> dict:
    """On each rank: build the learner's groups (every rank creates every group, in order) and
    all-reduce the rank numbers over this rank's group of each axis."""
    import torch.distributed as dist

    from ...device import group_device

    out = {}
    for axis, axis_groups in groups.items():
        mine = None
        for g in axis_groups:
            group = dist.new_group(g)
            if dist.get_rank() in g:
                mine = group
        t = torch.tensor([float(dist.get_rank())], device=group_device(mine))
        dist.all_reduce(t, group=mine)
        out[axis] = t.item()
    return out


@exercise('mesh_groups',
          "the dp, pp and tp groups of six meshes, odd sizes included, all-reduces over "
          "them on 4 ranks, and a 2 × 1 × 2 mesh built from them trains like one process")
def _check_mesh_groups(fn) -> str | None:
    """The groups of every axis for several meshes, then used for real on 4 ranks (2 x 1 x 2)."""
    from ...runtime.launch import RankError
    from ...parallel.mesh import MeshShape

    for dp, pp, tp in _MESH_SHAPES:
        s = MeshShape(dp, pp, tp)
        for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
            groups = _mesh_groups_of(fn, dp, pp, tp, axis)
            if isinstance(groups, str):
                return groups
            where = f"dp={dp}, pp={pp}, tp={tp}, axis {axis!r}"
            if sorted(r for g in groups for r in g) != list(range(s.size)):
                return (f"{where}: every rank 0..{s.size - 1} must be in exactly one group; "
                        f"got {groups}")
            want = sorted(s.groups(axis))
            if groups != want:
                wrong = next(g for g in groups if g not in want)
                return (f"{where}: {wrong} is not a {axis} group — a group's ranks differ only in "
                        f"the {axis} coordinate, with rank = (p·dp + d)·tp + t (tensor index "
                        f"fastest, then data, then pipeline); expected {want} ({size} ranks each)")
    s = MeshShape(2, 1, 2)
    groups = {axis: _mesh_groups_of(fn, 2, 1, 2, axis) for axis in ("dp", "tp")}
    try:
        sums = ranks(4).run(_mesh_groups_rank, groups, timeout=60)
    except RankError as exc:
        return f"on 4 ranks: {str(exc).splitlines()[0]}"
    for r, got in enumerate(sums):
        for axis, total in got.items():
            if total != sum(s.group_of(r, axis)):
                return (f"on 4 ranks: rank {r}'s all-reduce over its {axis} group gave {total:g}, "
                        f"expected {sum(s.group_of(r, axis))}")
    return inside("mesh_groups", fn, _mesh_run_cfg(), measure=_mesh_bytes)


def _mesh_model():
    from ...model import GPTConfig
    return GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


def _mesh_bytes(summary, cfg, package) -> list:
    """Bytes rank 0 sent per step on each axis of the mesh, beside the lessons' formulas."""
    rep, dp = summary.report[0], cfg.options.dp
    sent = {axis: row["sent_bytes"] for axis, row in rep["comm_by_group"].items()}
    return [Row("dp: ZeRO-1 reduce-scatter + all-gather", sent.get("dp", 0.0),
                "2(dp−1)/dp·4Ψ_r", 2 * (dp - 1) / dp * 4 * rep["params_local"]),
            Row("tp: the tensor-parallel all-reduces", sent.get("tp", 0.0))]


def _mesh_run_cfg():
    from ...strategies import TrainConfig
    return TrainConfig(strategy="3d", world_size=4, steps=3, batch_size=8, model=_mesh_model(),
                       options={"dp": 2, "pp": 1, "tp": 2})


# --------------------------------------------------------------------------------------------------
# pick_layout: the step-time model of a layout, and a layout picked with it for a real job
# --------------------------------------------------------------------------------------------------

#: the step's parts the learner's step_time returns, in the order they are checked
TERMS = ("compute", "bubble", "tp", "pp", "dp", "total")
#: relative agreement asked of each part (the package's own formulas, not a measurement)
RTOL = 1e-3
#: what each part is, when the learner's differs
_MODEL = {
    "compute": "compute = m micro-batches × microbatch_seconds(model, hw, job, layout), the "
               "kernel model's seconds of one micro-batch's forward and backward through a "
               "stage's layers on one device (minitrain.planning.chooser.microbatch_seconds); m = "
               "global batch / (DP · micro-batch)",
    "bubble": "1F1B idles p−1 micro-batch times per step: bubble = compute · (PP−1)/m (the "
              "fraction (p−1)/(m+p−1) is of the whole step, bubble included)",
    "tp": "TP all-reduces one activation of s·b·h values (2 bytes each, bf16) 4 times per layer "
          "and micro-batch (2 forward, 2 backward), over the ⌈L/PP⌉ layers of a stage, each "
          "priced α-β on the tp link: collective_seconds('all_reduce', bytes, TP, α, 1/bandwidth) "
          "with (bandwidth, α) = links(layout, hw)['tp']",
    "pp": "PP sends each micro-batch's activation (s·b·h values, bf16) to the next stage and its "
          "gradient back, point to point on the pp link (α + bytes/bandwidth each: "
          "collective_seconds('send', bytes, 2, α, 1/bandwidth)); the next micro-batch's compute "
          "hides them, so only what exceeds it shows: pp = m · max(0, 2 · message time − "
          "compute / m), and 0 without PP",
    "dp": "DP all-reduces the device's bf16 gradients (2·Ψ/(TP·PP) bytes) once per step on the dp "
          "link; it starts during the last micro-batch's backward, which hides ⅔ of one "
          "micro-batch's compute of it: dp = max(0, all-reduce time − ⅔ · compute / m)",
    "total": "total = compute + bubble + tp + pp + dp (the package adds the optimizer step on top, "
             "a term the exercise leaves out)",
}


def _jobs() -> dict:
    """The jobs of the check (the first is the lesson's): (words, model, cluster, workload) — the
    cluster is a projection preset (:func:`~minitrain.planning.clusters.get_cluster`): one cost
    model."""
    from ...planning.chooser import ModelSpec, Workload
    from ...planning.clusters import get_cluster

    return {
        "70b": ("a 70B model (Llama 2 70B's shape) on 64 H100s (ib-h100x8: 8 DGX H100 nodes on "
                "InfiniBand), 1,024 sequences of 2,048 tokens per step",
                ModelSpec(70e9, 80, 8192, 64), get_cluster("ib-h100x8"),
                Workload(2048, 1024, 1)),
        "eth": ("a 1.3B model (GPT-3 XL's shape) on 16 nodes of one A100 over 25 Gb/s Ethernet "
                "(eth-25g), 256 sequences of 2,048 tokens per step",
                ModelSpec(1.3e9, 24, 2048, 16), get_cluster("eth-25g"),
                Workload(2048, 256, 1)),
        "a100": ("a 13B model (LLaMA 13B's shape) on one DGX A100 (dgx-a100), 64 sequences of "
                 "2,048 tokens per step in micro-batches of 2",
                 ModelSpec(13e9, 40, 5120, 40), get_cluster("dgx-a100"),
                 Workload(2048, 64, 2)),
        "760m": ("a 760M model (GPT-3 Large's shape) on 24 nodes of one A100 over 25 Gb/s Ethernet "
                 "(eth-25gx24), 240 sequences of 2,048 tokens per step",
                 ModelSpec(760e6, 24, 1536, 16), get_cluster("eth-25gx24"),
                 Workload(2048, 240, 1)),
        "33b": ("a 33B model (LLaMA 33B's shape: 60 layers, 52 heads) on 64 H100s (ib-h100x8), "
                "16 sequences of 2,048 tokens per step",
                ModelSpec(32.5e9, 60, 6656, 52), get_cluster("ib-h100x8"),
                Workload(2048, 16, 1)),
    }

#: The jobs whose pick is checked, and why each: the lesson's; a slow link; 52 heads (TP 8 does
#: not split them), 60 layers over 8 stages and so few micro-batches that the bubble decides; a
#: node whose fastest layouts nearly fill its memory (a pick must keep the margin).
PICK_JOBS = ("70b", "eth", "33b", "a100")


def step_time_cases() -> list[tuple]:
    """(job key, Layout) the learner's step_time is checked on: every term non-zero somewhere,
    TP and DP on NVLink and across nodes, DP and PP hidden and not (a pipeline's sends show only
    where a stage's compute is short and the link slow: one layer per stage over Ethernet), a
    micro-batch of 2 sequences, and stages that do not split the layers evenly (60 over 16)."""
    from ...planning.chooser import Layout

    return [("70b", Layout(2, 8, 4, 1)), ("70b", Layout(1, 8, 8)), ("70b", Layout(8, 8, 1, 1)),
            ("70b", Layout(2, 8, 4, 1, outer="dp")), ("eth", Layout(16, 1, 1, 1)),
            ("eth", Layout(2, 8, 1, 1)), ("eth", Layout(1, 16, 1)), ("a100", Layout(2, 2, 2, 1)),
            ("760m", Layout(1, 24, 1)), ("33b", Layout(2, 16, 2, 1))]


def _seconds(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if out == out and abs(out) != float("inf") else None


def _time(s: float) -> str:
    return f"{s * 1e3:,.4g} ms" if abs(s) < 1 else f"{s:,.4g} s"


def _step_time_problem(fn, job: tuple, layout) -> str | None:
    from ...planning.chooser import evaluate

    words, model, hw, work = job
    want = evaluate(model, hw, work, layout).time
    m = work.global_batch // (layout.dp * work.micro_batch)
    where = f"on {words}, layout {layout} (m = {m} micro-batches per replica)"
    degrees = (layout.dp, layout.pp, layout.tp)
    call = f"{getattr(fn, '__name__', 'step_time')}(model, hw, job, Layout{degrees})"
    try:
        got = fn(model, hw, work, layout)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return raised(call, exc, fn)
    if not hasattr(got, "get") or not hasattr(got, "keys"):
        return (f"{call} returned {got!r:.80}: return a dict of seconds with the keys "
                f"{', '.join(TERMS)}")
    for term in TERMS:
        if term not in got:
            return f"{call} returned no {term!r}: return a dict with the keys {', '.join(TERMS)}"
        mine = _seconds(got[term])
        if mine is None:
            return f"{call}[{term!r}] is {got[term]!r:.60}, not a number of seconds"
        theirs = want[term] if term != "total" else sum(want[t] for t in TERMS[:-1])
        if abs(mine - theirs) > RTOL * max(abs(theirs), 1e-4 * want["total"]):
            ratio = f" ({mine / theirs:.3g}× it)" if theirs else ""
            return (f"{where}: your {term} term is {_time(mine)}, the package's pricing gives "
                    f"{_time(theirs)}{ratio}. {_MODEL[term]}")
    return None


def _as_layout(got):
    """The learner's pick as a Layout, or the sentence saying why it is not one."""
    from ...planning.chooser import Layout

    if isinstance(got, Layout):
        return got
    try:
        if all(hasattr(got, k) for k in ("dp", "pp", "tp")):
            dp, pp, tp = (int(getattr(got, k)) for k in ("dp", "pp", "tp"))
        else:
            dp, pp, tp = (int(x) for x in got)
    except (TypeError, ValueError):
        return (f"returned {got!r:.80}: return a Layout(dp, pp, tp, zero) (or the degrees "
                "(dp, pp, tp))")
    if min(dp, pp, tp) < 1:
        return f"returned degrees dp={dp}, pp={pp}, tp={tp}: each must be at least 1"
    return Layout(dp, pp, tp, zero=1 if dp > 1 else 0)


def _pick_problem(pick, job: tuple) -> str | None:
    from ...planning.chooser import USABLE, choose, evaluate

    words, model, hw, work = job
    call = f"{getattr(pick, '__name__', 'pick_layout')}(model, hw, job) for {words}"
    try:
        got = pick(model, hw, work)
    except Exception as exc:  # noqa: BLE001
        return raised(call, exc, pick)
    if got is None:
        return f"{call} returned None: return the Layout you pick"
    layout = _as_layout(got)
    if isinstance(layout, str):
        return f"{call} {layout}"
    used = layout.dp * layout.pp * layout.tp
    if used != hw.devices:
        return (f"{call} returned {layout}: it uses {used} devices, the job has {hw.devices} "
                "(dp · pp · tp must be all of them)")
    cand = evaluate(model, hw, work, layout)
    if cand.rejected:
        extra = ""
        if cand.rejected.startswith("out of memory"):
            extra = (f" — a layout must fit before it is priced: keep those whose "
                     f"layout_memory(model, hw, job, layout) is at most USABLE · "
                     f"{hw.device.memory_gb:g} GB = {USABLE * hw.device.memory_gb:g} GB")
        return f"{call} picked {layout}, which cannot run: {cand.rejected}{extra}"
    rec = choose(model, hw, work)
    fastest = min((c for c in rec.candidates if c.feasible), key=lambda c: c.time["total"])
    best_t, mine_t = fastest.time["total"], cand.time["total"]
    if mine_t > best_t * 1.05:
        worse = max(TERMS[:-1], key=lambda t: cand.time[t] - fastest.time[t])
        return (f"{call} picked {layout}: {_time(mine_t)} per step by the package's pricing, "
                f"{mine_t / best_t:.2f}× the fastest layout that fits ({fastest.layout}: "
                f"{_time(best_t)}); within 5 % counts. Yours loses most on {worse}: "
                f"{_time(cand.time[worse])} against {_time(fastest.time[worse])}. "
                f"Price every layout that fits (dp · pp · tp = {hw.devices}, TP inside a node, "
                "heads and batch dividing) and keep the fastest")
    return None


@exercise('pick_layout',
          "your step-time model prices ten layouts as the package does (compute, bubble, TP, "
          "PP and DP communication), and your pick for a 70B model on 64 H100s, a 1.3B model over "
          "Ethernet, a 33B model with 52 heads on a small batch and a 13B model on one DGX A100 is "
          "within 5 % of the fastest layout that fits")
def _check_pick_layout(fns) -> str | None:
    """step_time on several layouts against the chooser's pricing, term by term; then the pick of
    pick_layout for each of PICK_JOBS against the fastest feasible layout of the chooser."""
    from .kept import parts

    both = parts(fns)
    if len(both) != 2:
        return ("check this exercise with both functions: check(\"pick_layout\", (step_time, "
                "pick_layout))")
    step_time, pick = both
    try:
        jobs = _jobs()
        for key, layout in step_time_cases():
            found = _step_time_problem(step_time, jobs[key], layout)
            if found:
                return found
        for key in PICK_JOBS:
            found = _pick_problem(pick, jobs[key])
            if found:
                return found
    except Exception as exc:  # noqa: BLE001 - whatever the learner returned, never raise
        return f"the check could not read your answer ({type(exc).__name__}: {exc})"
    return None
