"""Lesson 08: the groups of a 3D mesh; the step-time model of a layout, and a layout picked with
it."""

import math

from answers import Answers

from minitrain.planning.chooser import USABLE, Layout, layout_memory, links, microbatch_seconds
from minitrain.planning.costmodel import collective_seconds


def mesh_groups(dp, pp, tp, axis):
    groups = {}
    for rank in range(dp * pp * tp):
        rest, t = divmod(rank, tp)
        p, d = divmod(rest, dp)
        key = tuple(v for k, v in (("dp", d), ("pp", p), ("tp", t)) if k != axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def everyone_in_one_group(dp, pp, tp, axis):
    return [list(range(dp * pp * tp))]


def data_index_fastest(dp, pp, tp, axis):
    """Groups of the right sizes, from the wrong numbering: the data index varies fastest."""
    groups = {}
    for rank in range(dp * pp * tp):
        rest, d = divmod(rank, dp)
        p, t = divmod(rest, tp)
        key = tuple(v for k, v in (("dp", d), ("pp", p), ("tp", t)) if k != axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def forgot_to_return(dp, pp, tp, axis):
    mesh_groups(dp, pp, tp, axis)


def each_group_twice(dp, pp, tp, axis):
    return mesh_groups(dp, pp, tp, axis) * 2


def axis_swapped(dp, pp, tp, axis):
    """The tp groups given for dp and the other way round."""
    return mesh_groups(dp, pp, tp, {"dp": "tp", "tp": "dp"}.get(axis, axis))


# -- pick_layout = (step_time(model, hw, job, layout), pick_layout(model, hw, job)) -------------


def step_time(model, hw, job, layout):
    m = job.global_batch // (layout.dp * job.micro_batch)
    tokens = job.seq_len * job.micro_batch
    compute_mb = microbatch_seconds(model, hw, job, layout)
    compute = m * compute_mb
    bubble = compute * (layout.pp - 1) / m
    link = links(layout, hw)
    bandwidth, alpha = link["tp"]
    activation = 2 * tokens * model.hidden
    one = collective_seconds("all_reduce", activation, layout.tp, alpha, 1 / bandwidth)
    tp = m * math.ceil(model.layers / layout.pp) * 4 * one
    bandwidth, alpha = link["pp"]
    message = collective_seconds("send", activation, 2, alpha, 1 / bandwidth)
    pp = m * max(0.0, 2 * message - compute_mb) if layout.pp > 1 else 0.0
    bandwidth, alpha = link["dp"]
    grads = 2 * model.params / (layout.tp * layout.pp)
    sync = collective_seconds("all_reduce", grads, layout.dp, alpha, 1 / bandwidth)
    dp = max(0.0, sync - 2 / 3 * compute_mb)
    return {"compute": compute, "bubble": bubble, "tp": tp, "pp": pp, "dp": dp,
            "total": compute + bubble + tp + pp + dp}


def _layouts(model, hw, job, fits=True, heads=True, usable=USABLE):
    for tp in range(1, hw.devices_per_node + 1):
        if hw.devices_per_node % tp or (heads and model.heads % tp):
            continue
        for pp in range(1, min(model.layers, hw.devices // tp) + 1):
            if (hw.devices // tp) % pp:
                continue
            dp = hw.devices // (tp * pp)
            if job.global_batch % (dp * job.micro_batch):
                continue
            layout = Layout(dp, pp, tp, zero=1 if dp > 1 else 0)
            if not fits or layout_memory(model, hw, job, layout) <= usable * hw.device.memory_gb * 1e9:
                yield layout


def pick_layout(model, hw, job):
    return min(_layouts(model, hw, job), key=lambda lay: step_time(model, hw, job, lay)["total"])


def step_time_no_overlap(model, hw, job, layout):
    """DP's all-reduce counted whole: none of it hidden behind the last backward."""
    out = step_time(model, hw, job, layout)
    link = links(layout, hw)["dp"]
    out["dp"] = collective_seconds("all_reduce", 2 * model.params / (layout.tp * layout.pp),
                                   layout.dp, link[1], 1 / link[0])
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_forward_flops(model, hw, job, layout):
    """A third of the micro-batch's time: as if only its forward ran."""
    out = step_time(model, hw, job, layout)
    out["compute"] /= 3
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_flops_at_matmul_rate(model, hw, job, layout):
    """6Ψ/(TP·PP) FLOPs per token at the device's matmul maximum, not the kernel model's time."""
    out = step_time(model, hw, job, layout)
    m = job.global_batch // (layout.dp * job.micro_batch)
    tokens = job.seq_len * job.micro_batch
    out["compute"] = m * 6 * model.params / (layout.tp * layout.pp) * tokens / hw.device.flop_rate()
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_bubble_fraction(model, hw, job, layout):
    """The bubble fraction of the whole step, taken of the compute."""
    out = step_time(model, hw, job, layout)
    m = job.global_batch // (layout.dp * job.micro_batch)
    out["bubble"] = out["compute"] * (layout.pp - 1) / (m + layout.pp - 1)
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_two_all_reduces(model, hw, job, layout):
    """Two all-reduces per layer: the forward's only."""
    out = step_time(model, hw, job, layout)
    out["tp"] /= 2
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_pipeline_exposed(model, hw, job, layout):
    """The pipeline's messages counted whole: none hidden behind the next micro-batch."""
    out = step_time(model, hw, job, layout)
    if layout.pp > 1:
        bandwidth, alpha = links(layout, hw)["pp"]
        m = job.global_batch // (layout.dp * job.micro_batch)
        message = collective_seconds("send", 2 * job.seq_len * job.micro_batch * model.hidden, 2,
                                     alpha, 1 / bandwidth)
        out["pp"] = m * 2 * message
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_one_sequence_per_microbatch(model, hw, job, layout):
    """The micro-batch size forgotten: one sequence per micro-batch, global / DP of them."""
    out = step_time(model, hw, job, layout)
    m_true = job.global_batch // (layout.dp * job.micro_batch)
    m = job.global_batch // layout.dp
    link = links(layout, hw)
    bandwidth, alpha = link["tp"]
    one = collective_seconds("all_reduce", 2 * job.seq_len * model.hidden, layout.tp, alpha,
                             1 / bandwidth)
    out["tp"] = m * math.ceil(model.layers / layout.pp) * 4 * one
    out["compute"] = out["compute"] / m_true * m
    out["bubble"] = out["compute"] * (layout.pp - 1) / m
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_layers_rounded_down(model, hw, job, layout):
    """L // PP layers per stage: the stage with the extra layers forgotten."""
    out = step_time(model, hw, job, layout)
    if model.layers % layout.pp:
        out["tp"] *= (model.layers // layout.pp) / math.ceil(model.layers / layout.pp)
    out["total"] = sum(out[k] for k in ("compute", "bubble", "tp", "pp", "dp"))
    return out


def step_time_only_total(model, hw, job, layout):
    return step_time(model, hw, job, layout)["total"]


def step_time_strings(model, hw, job, layout):
    return {k: f"{v:.3f} s" for k, v in step_time(model, hw, job, layout).items()}


class _Hostile(dict):
    def __getitem__(self, key):
        raise RuntimeError("a value that cannot be read")


def step_time_hostile(model, hw, job, layout):
    """A dict that raises when read: the check must say so, not raise."""
    return _Hostile(step_time(model, hw, job, layout))


def pick_words(model, hw, job):
    return "DP 2 x PP 8 x TP 4"


def pick_ignoring_memory(model, hw, job):
    return min(_layouts(model, hw, job, fits=False),
               key=lambda lay: step_time(model, hw, job, lay)["total"])


def pick_ignoring_heads(model, hw, job):
    """Every TP degree that divides the node, whether or not it splits the heads."""
    return min(_layouts(model, hw, job, heads=False),
               key=lambda lay: step_time(model, hw, job, lay)["total"])


def pick_without_margin(model, hw, job):
    """Layouts that fill the whole device count as fitting (no room for fragmentation)."""
    return min(_layouts(model, hw, job, usable=1.0),
               key=lambda lay: step_time(model, hw, job, lay)["total"])


def pick_least_communication(model, hw, job):
    """The layout that communicates least (the bubble left out of the price)."""
    return min(_layouts(model, hw, job),
               key=lambda lay: step_time(model, hw, job, lay)["total"]
               - step_time(model, hw, job, lay)["bubble"])


def pick_the_lessons_answer(model, hw, job):
    """The 70B job's answer, whatever the job."""
    return Layout(2, 8, 4, zero=1)


def pick_most_data_parallel(model, hw, job):
    """The layout with the most data parallelism that fits (DP is the simplest), unpriced."""
    return max(_layouts(model, hw, job), key=lambda lay: lay.dp)


def pick_raises(model, hw, job):
    return sorted(_layouts(model, hw, job))[0]  # Layouts do not compare


ANSWERS = {"mesh_groups": Answers(mesh_groups, [
    (everyone_in_one_group, "is not a dp group"),
    (data_index_fastest, "tensor index fastest"),
    (forgot_to_return, "returned None"),
    (each_group_twice, "exactly one group"),
    (axis_swapped, "is not a dp group"),
]),
    "pick_layout": Answers((step_time, pick_layout), [
        ((step_time_no_overlap, pick_layout), "your dp term is"),
        ((step_time_forward_flops, pick_layout), "your compute term is"),
        ((step_time_flops_at_matmul_rate, pick_layout), "microbatch_seconds(model, hw, job, layout)"),
        ((step_time_bubble_fraction, pick_layout), "your bubble term is"),
        ((step_time_two_all_reduces, pick_layout), "your tp term is"),
        ((step_time_pipeline_exposed, pick_layout), "your pp term is"),
        ((step_time_one_sequence_per_microbatch, pick_layout), "micro-batches of 2"),
        ((step_time_layers_rounded_down, pick_layout), "60 layers, 52 heads"),
        ((step_time, pick_ignoring_heads), "heads do not split"),
        ((step_time, pick_without_margin), "which cannot run: out of memory"),
        ((step_time, pick_least_communication), "Yours loses most on bubble"),
        ((step_time_only_total, pick_layout), "return a dict of seconds"),
        ((step_time_strings, pick_layout), "not a number of seconds"),
        ((step_time, pick_ignoring_memory), "which cannot run: out of memory"),
        ((step_time, pick_the_lessons_answer), "the job has 16"),
        ((step_time, pick_most_data_parallel), "within 5 % counts"),
        ((step_time, pick_raises), "raised TypeError"),
        ((step_time_hostile, pick_layout), "the check could not read your answer"),
        ((step_time, pick_words), "return a Layout(dp, pp, tp, zero)"),
    ]),
}
