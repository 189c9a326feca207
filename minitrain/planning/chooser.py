"""Which layout for which cluster: the strategy chooser of lesson 08.

The Hugging Face Transformers guide "Efficient Training on Multiple GPUs" (perf_train_gpu_many)
ends with a table of situations and what to use in each — the scenario table:

======================================  ===================================================
situation                               what to use
======================================  ===================================================
one device, the model fits              train normally
one device, the model does not fit      ZeRO-Offload: the CPU holds part of the states
one machine, the model fits on one      DDP (recommended); ZeRO may help
one machine, the model does not fit     PP, ZeRO or TP — and if even its largest layer does
                                        not fit on one device, TP or ZeRO only
several machines, fast links            ZeRO, or PP+TP+DP
several machines, slow links            DP+TP+PP+ZeRO-1
======================================  ===================================================

:func:`choose` does not look the answer up in that table: it enumerates every layout (DP × PP × TP
degrees, ZeRO stage, offload, activation checkpointing, which dimension crosses the nodes),
prices each with the course's models, and rejects or ranks it — and the table falls out, which
``tests/test_chooser.py`` checks row by row.  The pricing:

* **memory per device** — :func:`minitrain.memory.memory_per_device`, as the projection's: the
  model states (16 bytes per parameter in mixed-precision Adam; ZeRO's 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
  over the DP group) of the Ψ/(TP·PP) parameters a model-parallel rank holds, plus
  :func:`~minitrain.memory.activation_bytes_per_layer` (Korthikanti et al., 2022) for the
  micro-batches 1F1B keeps in flight on the first stage (min(PP, m) of them: as many layers'
  worth as the whole model), plus ZeRO-3's gathered layer;
  10 % of the device is kept free for temporary buffers and fragmentation;
* **communication per step** — the ring model of lesson 01 (:mod:`minitrain.planning.costmodel`, α-β):
  DP's all-reduce moves 2(N−1)/N·Ψ once per step (gradients accumulate locally over the m
  micro-batches), ZeRO-2 reduce-scatters each micro-batch's gradients and ZeRO-3 also gathers
  the weights twice per micro-batch (3Ψ·m: 1.5× DP at m = 1); TP all-reduces the activations
  twice per layer forward and twice backward (Megatron; Shoeybi et al., 2019), per micro-batch;
  PP sends each micro-batch's activation forward and its gradient back, point to point;
* **time per step** — compute from the kernel model (:mod:`minitrain.planning.kernels`, the
  projection's): :func:`microbatch_seconds` prices one micro-batch's forward and backward (and
  the forward again with activation checkpointing) through the slowest pipeline stage's kernels
  on one device — GEMMs at the device's measured matmul rate with tile and wave quantization,
  attention and the memory-bound passes as the software stack runs them (``stack``, default the
  device's :func:`~minitrain.planning.kernels.default_stack`) —, m of them per step, stretched by
  the pipeline bubble (p−1)/(m+p−1); the optimizer step once (Adam's reads and writes of the
  device's shard of the states); plus the communication that cannot hide behind compute: TP's
  all-reduces are on the critical path; DP's gradient sync hides behind the last micro-batch's
  backward, ZeRO-2/3's per-micro-batch traffic behind each micro-batch's compute (prefetch),
  PP's sends behind the next micro-batch's compute.

The rules, and why (each rejected layout says which one it broke):

* TP only inside a node: its four all-reduces per layer and micro-batch sit on the critical path;
* ZeRO-2/3 only without TP and PP — what this package runs (strategy ``3d`` shards only the
  optimizer states, ZeRO-1), which is also the Hugging Face guide's advice; since a rule cannot be
  evidence for itself, ``choose(..., only_runnable=False)`` drops it and lets the memory and time
  model (ZeRO-2/3 re-sharding every micro-batch) decide, so one can see which picks rest on it;
* a layout must fit in the device's memory (and, for offload, the optimizer states in the host's);
* when not even the largest layer's training state fits one device, only TP (each layer split) or
  ZeRO-3 (one layer's weights gathered at a time) will do: layouts that keep every whole layer on
  every device are rejected;
* of the layouts that fit, the fastest wins; layouts within 5 % of it count as equally fast, and
  among those the simplest wins — the least model parallelism (TP·PP), then the lowest ZeRO stage,
  no offload, no recomputation — since DP is the simplest and scales (Narayanan et al., 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM").

The hardware is a :class:`~minitrain.planning.clusters.ClusterSpec` — a preset of
:mod:`minitrain.planning.clusters` (``get_cluster("ib-h100x4")``), the numbers the projection
re-times runs with: the device's kernel numbers (``hw.device.kernels``) and memory, each link's bus
bandwidth and α per ring step, and the host a node offloads to.

Links between nodes are "fast" when ZeRO-3's traffic — two all-gathers of the weights and a
reduce-scatter of the gradients per micro-batch, 3·2Ψ bytes — can hide behind a micro-batch's
compute on one device (:func:`microbatch_seconds` of the whole model): each device then needs
3·2Ψ bytes per micro-batch time, F/(s·b) bytes per second with F = 6Ψ·s·b / that time, the rate
the kernel model achieves (s·b the tokens per micro-batch).  Slower links are "slow".

Beyond DP × PP × TP (lesson 09): a long sequence whose activations fit no layout gets context
parallelism (ring attention) inside a node — the same search on nodes of devices_per_node/cp devices
with sequences of seq_len/cp tokens —, and a mixture-of-experts model (``ModelSpec.experts``) is priced
through the experts each token goes to (its active parameters) and gets an expert-parallel degree;
both add their reasons.

Everything here is arithmetic on the inputs; nothing runs.  ``minitrain.viz.chooser`` puts it
behind controls.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .clusters import ETH25, NDR, ClusterSpec, Link, get_cluster
from .costmodel import collective_seconds
from .kernels import ADAM_BYTES, Kernel, Stack, kernel_seconds, rank_compute, stack_named
from ..memory import GB, activation_bytes_per_layer, memory_per_device, model_state_bytes
from ..model import GPTConfig

__all__ = ["ModelSpec", "Workload", "Layout", "Candidate", "Recommendation", "SCENARIOS",
           "SCENARIO_TABLE",
           "choose", "evaluate", "layouts", "scenario", "links_fast", "links", "layout_memory",
           "microbatch_seconds", "optimizer_seconds", "h100_nodes", "TOLERANCE", "USABLE",
           "VOCAB", "FF_MULTIPLE"]

#: layouts within this fraction of the fastest count as equally fast (the simplest of them wins)
TOLERANCE = 0.05
#: fraction of device memory a layout may use; the rest is temporary buffers and fragmentation
USABLE = 0.9
BYTES_16 = 2  # bf16 weights, gradients and activations on the wire
#: the vocabulary of a model described by numbers alone: GPT-2's 50,257 tokens (Radford et al.,
#: 2019) padded to a multiple of 128, as Megatron-LM pads it (``--make-vocab-size-divisible-by``,
#: default 128) so that it splits over the tensor-parallel ranks
VOCAB = 50304
#: the MLP width of a model described by numbers alone is rounded to a multiple of this (Meta's
#: Llama reference code rounds its MLP width to ``multiple_of=256``)
FF_MULTIPLE = 256

#: the rows of the Hugging Face guide's scenario table: key → (situation, what the guide says to use)
SCENARIOS = {
    "one-device-fits": ("one device; the model fits", "train normally"),
    "one-device-too-big": ("one device; the model does not fit",
                           "ZeRO-Offload: the CPU holds part of the states"),
    "one-node-fits": ("one machine with several devices; the model fits on one",
                      "DDP (recommended); ZeRO may help"),
    "one-node-too-big": ("one machine with several devices; the model does not fit on one",
                         "PP, ZeRO or TP"),
    "one-node-layer-too-big": ("one machine with several devices; not even its largest layer "
                               "fits on one", "TP or ZeRO (PP cannot split a layer)"),
    "nodes-fast": ("several machines, fast links between them", "ZeRO, or PP+TP+DP"),
    "nodes-slow": ("several machines, slow links between them", "DP+TP+PP+ZeRO-1"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's size: parameters Ψ, layers, hidden size h, attention heads a; for a
    mixture of experts, ``experts`` per MoE layer, ``top_k`` of them per token, and
    ``expert_params``, the parameters inside all the experts (part of Ψ).  :meth:`from_config`
    reads them off a :class:`~minitrain.model.GPTConfig` and keeps it (``config``) for the kernel
    model; the published models below give their published parameter counts (LLaMA's gated MLPs
    are not a GPTConfig's) and get a GPT-shaped config from :meth:`gpt_config`."""

    params: float
    layers: int
    hidden: int
    heads: int
    experts: int = 0
    top_k: int = 1
    expert_params: float = 0.0
    config: GPTConfig | None = field(default=None, hash=False)

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> ModelSpec:
        """The description of ``cfg`` (e.g. one of :data:`minitrain.planning.scaling.MODEL_SIZES`):
        its parameters counted from its shapes; ``cfg`` itself is kept for the kernel model."""
        if not cfg.n_expert:
            return cls(cfg.num_params(), cfg.n_layer, cfg.d_model, cfg.n_head, config=cfg)
        return cls(cfg.num_params(), cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_expert, cfg.top_k,
                   cfg.n_layer * cfg.n_expert * cfg.mlp_params(), config=cfg)

    def gpt_config(self, seq_len: int) -> GPTConfig:
        """The :class:`~minitrain.model.GPTConfig` the kernel model prices, for sequences of
        ``seq_len`` tokens: the kept ``config`` where there is one.  Otherwise a GPT-2-shaped one
        (LayerNorm, GeLU MLP, learned positions, biases, untied output layer) with these layers,
        hidden size and heads, the vocabulary :data:`VOCAB`, and the MLP as wide as the parameters
        left after the embedding, the output layer and the attention make it (rounded to
        :data:`FF_MULTIPLE`, at least one multiple) — so that the blocks' FLOPs per token are about
        6Ψ, as the published count says.  An approximation: a Llama-shaped model (SwiGLU's three
        matrices, grouped-query attention, a 32k vocabulary) spends its parameters differently; its
        GEMMs have other shapes, not other FLOPs.  A mixture of experts gets ``experts`` experts of
        the width ``expert_params`` gives, ``top_k`` per token."""
        if self.config is not None:
            return replace(self.config, seq_len=seq_len)
        d = self.hidden
        base = GPTConfig(vocab_size=VOCAB, seq_len=seq_len, n_layer=self.layers, n_head=self.heads,
                         d_model=d, d_ff=FF_MULTIPLE)
        if self.experts > 1:  # one expert's d→ff→d with biases: 2·d·ff + ff + d parameters
            per_mlp = self.expert_params / (self.layers * self.experts)
            ff = _round_ff((per_mlp - d) / (2 * d + 1))
            return replace(base, d_ff=ff, n_expert=self.experts, top_k=self.top_k)
        outside = base.embed_params() + base.head_params()
        per_layer = (self.params - outside) / self.layers
        rest = 2 * base.norm_params() + base.attention_params() + d  # + the MLP's output bias
        return replace(base, d_ff=_round_ff((per_layer - rest) / (2 * d + 1)))

    @property
    def active_params(self) -> float:
        """Parameters a token passes through (6 × this FLOPs per token): Ψ, less the experts it
        is not routed to."""
        if self.experts <= 1:
            return self.params
        return self.params - self.expert_params * (1 - self.top_k / self.experts)

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer layer: 12h² (QKV, output, and the 4h MLP), at most Ψ/L."""
        return min(12 * self.hidden ** 2, self.params / self.layers)


def _round_ff(ff: float) -> int:
    return max(FF_MULTIPLE, FF_MULTIPLE * round(ff / FF_MULTIPLE))


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: ``global_batch`` sequences of ``seq_len`` tokens, in
    micro-batches of ``micro_batch`` sequences; ``recipe`` as in :data:`minitrain.memory.RECIPES`."""

    seq_len: int = 2048
    global_batch: int = 512
    micro_batch: int = 1
    recipe: str = "mixed-adam"


@dataclass(frozen=True)
class Layout:
    """A way to lay the training out: DP × PP × TP devices, ZeRO stage over the DP group,
    optimizer offload, activation checkpointing; ``outer`` says which of DP and PP is laid out
    across the nodes — "pp" or "dp", "" where there is no choice (TP is always innermost, inside
    a node; then DP, then PP, unless ``outer`` is "dp")."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    offload: bool = False
    recompute: bool = False
    outer: str = ""

    def techniques(self) -> set[str]:
        """The scenario table's vocabulary: {"DP", "PP", "TP", "ZeRO-k", "offload", "checkpointing"}."""
        out = {name for name, k in (("DP", self.dp), ("PP", self.pp), ("TP", self.tp)) if k > 1}
        if self.zero:
            out.add(f"ZeRO-{self.zero}")
        if self.offload:
            out.add("offload")
        if self.recompute:
            out.add("checkpointing")
        return out

    def strategy(self) -> str:
        """The ``minitrain train --strategy`` that runs it ("3d": the mesh of lesson 08)."""
        if self.tp > 1 or (self.pp > 1 and (self.dp > 1 or self.zero)):
            return "tensor" if self.dp == self.pp == 1 else "3d"
        if self.pp > 1:
            return "pipeline"
        if self.zero or self.offload:
            return f"zero{max(self.zero, 2 if self.offload else 0)}"
        return "ddp" if self.dp > 1 else "single"

    def __str__(self) -> str:
        parts = [f"{name} {k}" for name, k in (("DP", self.dp), ("PP", self.pp), ("TP", self.tp))
                 if k > 1] or ["one device"]
        text = " × ".join(parts)
        if self.outer:
            text += f" ({self.outer.upper()} across nodes)"
        extras = ([f"ZeRO-{self.zero}"] if self.zero else []) + (
            ["offload"] if self.offload else []) + (["activation checkpointing"] if self.recompute else [])
        return text + (", " + ", ".join(extras) if extras else "")


@dataclass
class Candidate:
    """One layout, priced: ``memory`` (bytes per device by kind, ``host`` per node), ``comm``
    (bytes each device sends per step, by dimension, and the link each uses), ``time`` (seconds
    per step by part) and ``rejected`` (why it cannot or should not run; None if it can)."""

    layout: Layout
    memory: dict = field(default_factory=dict)
    comm: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    rejected: str | None = None

    @property
    def feasible(self) -> bool:
        return self.rejected is None

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "text": str(self.layout), "memory": self.memory,
                "comm": self.comm, "time": self.time, "rejected": self.rejected}


@dataclass
class Recommendation:
    """What :func:`choose` returns: the ``layout`` (None if nothing fits), the scenario
    table's ``scenario`` key and its ``advice``, ``reasons`` in words, the ``best`` :class:`Candidate`,
    equally fast ``alternatives``, and every candidate (feasible ones first, fastest first)."""

    layout: Layout | None
    scenario: str
    advice: str
    reasons: list[str]
    best: Candidate | None
    alternatives: list[Candidate]
    candidates: list[Candidate]
    cp: int = 1  # context-parallel degree (lesson 09): > 1 when a sequence's activations fit no device
    ep: int = 1  # expert-parallel degree (lesson 09): > 1 for a mixture of experts

    def strategy(self) -> str | None:
        """The ``--strategy`` that runs it: ``context`` when CP is needed on a DP-only layout,
        ``expert`` for a mixture of experts on one; otherwise the layout's."""
        if self.layout is None:
            return None
        plain = self.layout.strategy()
        if plain in ("single", "ddp") and self.cp > 1:
            return "context"
        if plain in ("single", "ddp") and self.ep > 1:
            return "expert"
        return plain

    def rejected(self) -> dict[str, int]:
        """How many layouts each rule rejected (the reason's first clause)."""
        out: dict[str, int] = {}
        for c in self.candidates:
            if c.rejected:
                key = c.rejected.split(":")[0]
                out[key] = out.get(key, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout) if self.layout else None,
                "text": str(self.layout) if self.layout else None,
                "strategy": self.strategy(),
                "cp": self.cp, "ep": self.ep,
                "scenario": self.scenario, "situation": SCENARIOS[self.scenario][0],
                "advice": self.advice, "reasons": self.reasons,
                "best": self.best.to_dict() if self.best else None,
                "alternatives": [c.to_dict() for c in self.alternatives],
                "rejected": self.rejected()}


# --------------------------------------------------------------------------------------------------
# Pricing one layout
# --------------------------------------------------------------------------------------------------


def _inter(hw: ClusterSpec) -> Link:
    """The link between nodes (a one-node cluster may name none: its own link stands in)."""
    return hw.inter or hw.intra


def _check_inputs(model: ModelSpec, hw: ClusterSpec, job: Workload) -> None:
    for name, value in (("params", model.params), ("layers", model.layers),
                        ("hidden", model.hidden), ("heads", model.heads),
                        ("seq_len", job.seq_len), ("global_batch", job.global_batch),
                        ("micro_batch", job.micro_batch), ("device memory_gb", hw.device.memory_gb),
                        ("devices_per_node", hw.devices_per_node), ("nodes", hw.nodes),
                        ("intra busbw", hw.intra.busbw), ("inter busbw", _inter(hw).busbw)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}; give the real size")
    _device_kernels(hw)
    if model.experts < 0 or model.experts == 1 or (model.experts and not (
            1 <= model.top_k <= model.experts and 0 < model.expert_params < model.params)):
        raise ValueError(f"a mixture of experts needs experts >= 2, 1 <= top_k <= experts and "
                         f"0 < expert_params < params; got experts={model.experts}, "
                         f"top_k={model.top_k}, expert_params={model.expert_params:g}")
    if model.hidden % model.heads:
        raise ValueError(f"hidden={model.hidden} is not divisible by heads={model.heads}; use a "
                         f"hidden size that is a multiple of the heads (e.g. {model.heads * 128})")


def _micro_batches(layout: Layout, job: Workload) -> int | None:
    """m, the micro-batches each pipeline runs per step; None when the batch does not split."""
    per_replica, rest = divmod(job.global_batch, layout.dp)
    if rest or per_replica % job.micro_batch:
        return None
    return per_replica // job.micro_batch


def _spans_nodes(layout: Layout, hw: ClusterSpec) -> dict[str, bool]:
    """Which groups cross a node boundary: TP innermost, then the inner of DP/PP, then the outer."""
    inner, outer = ("pp", "dp") if layout.outer == "dp" else ("dp", "pp")
    size = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    node = hw.devices_per_node
    return {"tp": layout.tp > node,
            inner: size[inner] > 1 and layout.tp * size[inner] > node,
            outer: size[outer] > 1 and layout.tp * size[inner] * size[outer] > node}


def _memory(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout, m: int) -> dict:
    """Bytes per device by kind (:func:`minitrain.memory.memory_per_device`), and the host bytes
    per node (offload: the fp32 masters and Adam's moments live in host memory)."""
    layers_here = math.ceil(model.layers / layout.pp)
    in_flight = min(layout.pp, m)  # 1F1B: the first stage holds min(p, m) micro-batches
    per_layer = activation_bytes_per_layer(job.seq_len, job.micro_batch, model.hidden,
                                           model.heads, layout.recompute, layout.tp)
    activations = in_flight * layers_here * per_layer
    if layout.recompute:  # the layer being recomputed holds its full activations meanwhile
        activations += activation_bytes_per_layer(job.seq_len, job.micro_batch, model.hidden,
                                                  model.heads, False, layout.tp)
    gathered = 2 * BYTES_16 * model.layer_params if layout.zero == 3 else 0.0  # one whole layer
    out = memory_per_device(model.params / (layout.tp * layout.pp), layout.dp, layout.zero,
                            job.recipe, activations, gathered, layout.offload)
    out["host_per_node"] = out.pop("host") * hw.devices_per_node
    return out


def _collective_time(nbytes: float, n: int, bw: float, alpha: float, fraction: float = 1.0) -> float:
    """Ring time of one collective on n ranks: all-reduce (fraction 1), or reduce-scatter /
    all-gather (fraction 0.5) — :func:`minitrain.planning.costmodel.collective_seconds` with β =
    1/bandwidth, the α-β the projection (:mod:`minitrain.planning.projection`) prices with too."""
    op = "all_reduce" if fraction == 1.0 else "reduce_scatter"
    return collective_seconds(op, nbytes, n, alpha, 1 / bw) if n > 1 else 0.0


def links(layout: Layout, hw: ClusterSpec) -> dict[str, tuple[float, float]]:
    """``{"dp" | "pp" | "tp": (bytes per second, α)}``: the link each of the layout's groups uses —
    the network's per-device share (and its latency) where the group crosses nodes, else the
    link inside a node.  TP is innermost, then DP, then PP (unless ``layout.outer`` is "dp")."""
    spans = _spans_nodes(layout, hw)
    inter = _inter(hw)
    return {k: (inter.busbw, inter.alpha) if spans[k] else (hw.intra.busbw, hw.intra.alpha)
            for k in spans}


def layout_memory(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout) -> float:
    """Bytes per device of ``layout`` for ``job`` — the model states of its Ψ/(TP·PP) parameters by
    ZeRO's formulas, 1F1B's in-flight activations, ZeRO-3's gathered layer
    (:func:`minitrain.memory.memory_per_device`) — what :func:`evaluate` holds against ``USABLE``
    of the device's memory; ``inf`` when the batch does not split."""
    m = _micro_batches(layout, job)
    return math.inf if m is None else _memory(model, hw, job, layout, m)["total"]


def _device_kernels(hw: ClusterSpec):
    """The device's kernel numbers, or why there are none."""
    if hw.device.kernels is None:
        raise ValueError(f"{hw.device.name} has no kernel model to price compute with: use a "
                         "preset's device (minitrain.planning.clusters), or calibrate this "
                         "machine's kernels (kernels.calibrate_kernels)")
    return hw.device.kernels


def _stack(stack: Stack | str | None, hw: ClusterSpec) -> Stack:
    """A :class:`~minitrain.planning.kernels.Stack`, by name (of ``kernels.STACKS``) or given; by
    default the device's :func:`~minitrain.planning.kernels.default_stack`."""
    return stack_named(stack, _device_kernels(hw) if stack is None else None)


def _precision(job: Workload) -> str:
    """The kernels' precision: fp32 (TF32 tensor cores) for the fp32 recipes, else bf16 (the
    kernel model has no fp8 GEMMs: fp8-adam's compute is priced in bf16)."""
    return "fp32" if job.recipe.startswith("fp32") else "bf16-mixed"


def _microbatch_compute(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout,
                        stack: Stack | str | None = None):
    """The :class:`~minitrain.planning.kernels.Compute` of :func:`microbatch_seconds` (its
    optimizer step is empty: the chooser prices it once per step, :func:`optimizer_seconds`)."""
    device, stack = _device_kernels(hw), _stack(stack, hw)
    # the layout decides whether whole blocks run forward again; a stack's selective
    # recomputation (the attention core's) is part of how it runs attention and stays
    recompute = "full" if layout.recompute else ("none" if stack.recompute == "full"
                                                 else stack.recompute)
    return rank_compute(model.gpt_config(job.seq_len), device, stack,
                        tokens_per_microbatch=job.seq_len * job.micro_batch,
                        micro_batch=job.micro_batch, microbatches=1,
                        blocks=math.ceil(model.layers / layout.pp), head=True,
                        embed=layout.pp == 1, tp=layout.tp, opt_params=0.0,
                        precision=_precision(job), recompute=recompute)


def microbatch_seconds(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout,
                       stack: Stack | str | None = None) -> float:
    """Seconds of one micro-batch (``job.micro_batch`` sequences of ``job.seq_len`` tokens) on one
    device of ``layout``: its forward and backward — and, with ``layout.recompute``, each block's
    forward again — through the ⌈L/PP⌉ layers of a stage, split ``layout.tp`` ways (Megatron's
    tensor parallelism, without sequence parallelism: the chooser's TP all-reduces), priced
    kernel by kernel by :func:`minitrain.planning.kernels.rank_compute` on ``hw.device.kernels``
    under ``stack`` (a :class:`~minitrain.planning.kernels.Stack` or a name of
    ``kernels.STACKS``; default the device's).

    The stage priced is the slowest one, which sets a pipeline's pace: ⌈L/PP⌉ layers and the
    output layer with its loss (the last stage's: its vocabulary-wide GEMM outweighs the first
    stage's embedding lookup); with one stage, the embedding too.  The model is
    :meth:`ModelSpec.gpt_config`'s.  The optimizer step is not in it (:func:`optimizer_seconds`),
    nor any communication."""
    c = _microbatch_compute(model, hw, job, layout, stack)
    return c.forward_s + c.backward_s + c.recompute_s


def optimizer_seconds(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout) -> float:
    """Seconds of one device's optimizer step: Adam reads and writes ``kernels.ADAM_BYTES`` per
    parameter of the device's Ψ/(TP·PP) (÷ DP with ZeRO, which shards the optimizer states), at
    the device's measured memory bandwidth (one kernel, at least its launch); 0 with offload,
    whose step runs on the host (the ``offload`` term)."""
    if layout.offload:
        return 0.0
    shard = model.params / (layout.tp * layout.pp) / (layout.dp if layout.zero else 1)
    work, launch = kernel_seconds(Kernel("Adam", "optimizer", "step", bytes=ADAM_BYTES * shard),
                                  _device_kernels(hw), _precision(job))
    return work + launch


def _comm_and_time(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout,
                   m: int, stack: Stack | str | None = None) -> tuple:
    """(bytes each device sends per step by dimension, seconds per step by part)."""
    spans = _spans_nodes(layout, hw)
    link = links(layout, hw)
    dp, pp, tp = layout.dp, layout.pp, layout.tp
    tokens_mb = job.seq_len * job.micro_batch
    compute_mb = microbatch_seconds(model, hw, job, layout, stack)
    compute = compute_mb * m
    bubble = (pp - 1) / (m + pp - 1)

    act = BYTES_16 * tokens_mb * model.hidden
    tp_calls = m * math.ceil(model.layers / pp) * (6 if layout.recompute else 4)
    tp_bytes = tp_calls * 2 * (tp - 1) / tp * act
    tp_time = tp_calls * _collective_time(act, tp, link["tp"][0], link["tp"][1])

    pp_bytes = m * 2 * act if pp > 1 else 0.0  # activation forward, its gradient back
    pp_mb = 2 * (link["pp"][1] + act / link["pp"][0]) if pp > 1 else 0.0
    pp_time = m * max(0.0, pp_mb - compute_mb)  # hidden behind the next micro-batch's compute

    grads = BYTES_16 * model.params / (tp * pp)
    ring = 2 * (dp - 1) / dp * grads if dp > 1 else 0.0
    bw, alpha = link["dp"]
    if layout.zero <= 1:  # one all-reduce (or reduce-scatter + all-gather) per step
        dp_bytes = ring
        dp_time = max(0.0, _collective_time(grads, dp, bw, alpha) - 2 / 3 * compute_mb)
    elif layout.zero == 2:  # reduce-scatter every micro-batch, all-gather the weights once
        dp_bytes = ring / 2 * (m + 1)
        rs = _collective_time(grads, dp, bw, alpha, 0.5)
        dp_time = m * max(0.0, rs - 2 / 3 * compute_mb) + rs
    else:  # gather the weights for forward and for backward, reduce-scatter, every micro-batch
        dp_bytes = ring / 2 * 3 * m
        dp_time = m * max(0.0, 3 * _collective_time(grads, dp, bw, alpha, 0.5) - compute_mb)

    offload_time = 0.0
    if layout.offload:
        shard = model.params / (tp * pp) / (dp if layout.zero else 1)
        offload_time = 2 * BYTES_16 * shard / hw.host.pcie + shard / hw.host.adam_params_per_s
    comm = {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes,
            "links": {k: ("inter-node" if spans[k] else "intra-node") for k in ("dp", "pp", "tp")}}
    time = {"compute": compute, "bubble": compute * bubble / (1 - bubble), "tp": tp_time,
            "pp": pp_time, "dp": dp_time, "offload": offload_time,
            "optimizer": optimizer_seconds(model, hw, job, layout)}
    time["total"] = sum(time.values())
    return comm, time


def _rule_broken(model: ModelSpec, hw: ClusterSpec, layout: Layout,
                 only_runnable: bool = True) -> str | None:
    """The first placement rule ``layout`` breaks, or None; ``only_runnable``: also what no
    strategy of this package runs (ZeRO-2/3 beside TP or PP)."""
    if layout.offload and hw.host is None:
        return f"no host to offload to: {hw.title} names no host memory"
    if layout.tp > 1 and hw.devices_per_node % layout.tp:
        return (f"TP across nodes: TP {layout.tp} does not fit inside a node of "
                f"{hw.devices_per_node} devices, and its all-reduces per layer would cross the "
                "slower link")
    if model.heads % layout.tp:
        return f"heads do not split: {model.heads} heads over TP {layout.tp}"
    if layout.pp > model.layers:
        return f"more stages than layers: PP {layout.pp} > {model.layers} layers"
    if only_runnable and layout.zero >= 2 and (layout.tp > 1 or layout.pp > 1):
        return (f"ZeRO-{layout.zero} with TP/PP: strategy 3d shards only the optimizer states "
                "over its data-parallel ranks (ZeRO-1); ZeRO-2/3 beside TP or PP (FSDP with TP, "
                "as torchtitan runs it) is not built in this package")
    return None


def evaluate(model: ModelSpec, hw: ClusterSpec, job: Workload, layout: Layout,
             stack: Stack | str | None = None, only_runnable: bool = True) -> Candidate:
    """Price one layout: memory, communication and time per step, or why it is rejected; the
    compute under ``stack`` (:func:`microbatch_seconds`; default the device's stack);
    ``only_runnable=False`` prices layouts no strategy here runs too (ZeRO-2/3 beside TP/PP)."""
    cand = Candidate(layout)
    broken = _rule_broken(model, hw, layout, only_runnable)
    m = _micro_batches(layout, job)
    if broken is None and m is None:
        broken = (f"batch does not split: global batch {job.global_batch} over DP {layout.dp} in "
                  f"micro-batches of {job.micro_batch}")
    if broken is not None:
        cand.rejected = broken
        return cand
    cand.memory = _memory(model, hw, job, layout, m)
    cand.comm, cand.time = _comm_and_time(model, hw, job, layout, m, stack)
    cand.comm["microbatches"] = m
    usable = USABLE * hw.device.memory_gb * GB
    if cand.memory["total"] > usable:
        cand.rejected = (f"out of memory: {cand.memory['total'] / GB:,.1f} GB per device > "
                         f"{usable / GB:,.1f} GB usable")
    elif layout.offload and cand.memory["host_per_node"] > hw.host.memory_gb * GB:
        cand.rejected = (f"out of host memory: offload needs {cand.memory['host_per_node'] / GB:,.0f}"
                         f" GB per node > {hw.host.memory_gb:g} GB")
    return cand


# --------------------------------------------------------------------------------------------------
# Every layout, and the choice
# --------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(hw: ClusterSpec) -> list[Layout]:
    """Every DP × PP × TP factorisation of the devices, with each ZeRO stage (with DP), offload
    (with ZeRO, or on one replica), recomputation, and both node placements where they differ."""
    out = []
    for tp in _divisors(hw.devices):
        for pp in _divisors(hw.devices // tp):
            dp = hw.devices // (tp * pp)
            outers = ("pp", "dp") if dp > 1 and pp > 1 and hw.nodes > 1 else ("",)
            for zero in (range(4) if dp > 1 else (0,)):
                for offload in (False, True):
                    if offload and dp > 1 and not zero:
                        continue  # offloading full replicas of the states: ZeRO first
                    for recompute in (False, True):
                        out += [Layout(dp, pp, tp, zero, offload, recompute, o) for o in outers]
    return out


def _simplicity(layout: Layout) -> tuple:
    return (layout.tp * layout.pp, layout.zero, layout.offload, layout.recompute, layout.tp,
            layout.outer == "dp")


def links_fast(hw: ClusterSpec, job: Workload, model: ModelSpec,
               stack: Stack | str | None = None) -> tuple[bool, float]:
    """(are the links between nodes fast?, the per-device bandwidth in bytes/s ZeRO-3 needs to
    hide its traffic behind compute): 3·2Ψ bytes per micro-batch — two all-gathers of the bf16
    weights, a reduce-scatter of the gradients — over the :func:`microbatch_seconds` of a
    micro-batch through the whole model on one device (ZeRO-3's layout: no TP, no PP).  That is
    F/(s·b) with F = 6Ψ·s·b / those seconds, the FLOP rate the kernel model achieves on the
    micro-batch (below the device's matmul maximum: small GEMMs, attention, memory-bound passes)."""
    seconds = microbatch_seconds(model, hw, job, Layout(dp=hw.devices, zero=3), stack)
    need = 3 * BYTES_16 * model.params / seconds
    return _inter(hw).busbw >= need, need


def _one_device_fits(model: ModelSpec, hw: ClusterSpec, job: Workload, stack=None) -> bool:
    one = replace(hw, nodes=1, devices_per_node=1)
    return any(evaluate(model, one, job, Layout(recompute=r), stack).feasible for r in (False, True))


def _layer_fits(model: ModelSpec, hw: ClusterSpec, job: Workload) -> bool:
    """Does one layer's training state (16 B/param) and its activations fit on one device?"""
    per_layer = model_state_bytes(model.layer_params, 1, 0, job.recipe)["total"]
    act = activation_bytes_per_layer(job.seq_len, job.micro_batch, model.hidden, model.heads)
    return per_layer + act <= USABLE * hw.device.memory_gb * GB


def scenario(model: ModelSpec, hw: ClusterSpec, job: Workload = Workload(),
             stack: Stack | str | None = None) -> str:
    """Which row of the scenario table the inputs fall in (a key of :data:`SCENARIOS`)."""
    if hw.nodes > 1:
        return "nodes-fast" if links_fast(hw, job, model, stack)[0] else "nodes-slow"
    fits = _one_device_fits(model, hw, job, stack)
    if hw.devices_per_node == 1:
        return "one-device-fits" if fits else "one-device-too-big"
    if fits:
        return "one-node-fits"
    return "one-node-too-big" if _layer_fits(model, hw, job) else "one-node-layer-too-big"


def _offload_last(cands: list[Candidate]) -> None:
    """Offload is for states the devices cannot hold (Ren et al., 2021): when any layout fits
    without it, the offload layouts are rejected — they would put the optimizer step on the CPU
    and the PCIe bus for nothing the devices need."""
    fit = sum(c.feasible and not c.layout.offload for c in cands)
    if fit:
        for c in cands:
            if c.feasible and c.layout.offload:
                c.rejected = (f"offload not needed: {fit} layouts fit on the devices alone, without "
                              "the CPU step and the PCIe traffic")


def choose(model: ModelSpec, hw: ClusterSpec, job: Workload = Workload(),
           stack: Stack | str | None = None, only_runnable: bool = True) -> Recommendation:
    """Recommend a layout for training ``model`` on ``hw`` with ``job``, and say why; compute is
    priced with the kernels of ``stack`` (a :class:`~minitrain.planning.kernels.Stack` or a name
    of ``kernels.STACKS``; default the device's).

    Beyond DP × PP × TP (lesson 09): when no layout fits because one micro-batch's activations
    are too large — a long sequence — context parallelism over ``cp`` devices of a node is tried
    (each holds seq_len/cp tokens: the problem becomes the same one on nodes of
    devices_per_node/cp devices, with sequences of seq_len/cp); a mixture of experts gets an
    expert-parallel degree ``ep``.  Both say why in ``reasons``.

    ``only_runnable`` (default): only layouts this package's strategies run; False also weighs
    ZeRO-2/3 beside TP or PP, priced by the same memory and time model (re-sharding every
    micro-batch), to see whether a pick rests on what the package cannot run."""
    rec = _choose(model, hw, job, stack, only_runnable)
    if rec.layout is None:
        rec = _with_context_parallel(model, hw, job, rec, stack, only_runnable)
    if model.experts > 1 and rec.layout is not None:
        _with_expert_parallel(model, hw, job, rec)
    return rec


def _with_context_parallel(model, hw, job, rec: Recommendation, stack=None,
                           only_runnable: bool = True) -> Recommendation:
    """The smallest cp (dividing the node and the sequence) with which a layout fits, or ``rec``."""
    smallest = min((c for c in rec.candidates if c.memory), key=lambda c: c.memory["total"],
                   default=None)
    if smallest is None or smallest.memory["activations"] <= smallest.memory["total"] / 2:
        return rec  # not the sequence's fault: the states do not fit
    for cp in _divisors(hw.devices_per_node)[1:]:
        if job.seq_len % cp:
            continue
        sub_hw = replace(hw, devices_per_node=hw.devices_per_node // cp)
        sub_job = Workload(job.seq_len // cp, job.global_batch, job.micro_batch, job.recipe)
        sub = _choose(model, sub_hw, sub_job, stack, only_runnable)
        if sub.layout is None:
            continue
        lay, m = sub.layout, sub.best.comm["microbatches"]
        local = job.seq_len // cp
        ring = (3 * cp - 2) * 2 * local * job.micro_batch * model.hidden * BYTES_16
        ring_step = ring * math.ceil(model.layers / lay.pp) * m
        why = [f"long sequence: with {job.seq_len:,} tokens per sequence no DP × PP × TP layout "
               f"fits — the smallest needs {_gb(smallest.memory['total'])} per device, "
               f"{_gb(smallest.memory['activations'])} of it activations ({smallest.layout})",
               f"context parallelism (ring attention, --cp {cp}): each of {cp} devices of a node "
               f"holds {local:,} tokens of every sequence, so its activations are those of a "
               f"{local:,}-token sequence; the layout below runs on each of the "
               f"{hw.devices // cp} groups of {cp}",
               f"the ring sends (3·cp−2) key/value blocks of 2·{local:,}·b·h values per layer and "
               f"micro-batch: {_gb(ring_step)} per device per step, inside the node, overlapped "
               "with each block's attention"]
        sub.cp, sub.scenario, sub.advice = cp, rec.scenario, rec.advice
        sub.reasons = ([f"Hugging Face guide's table: {SCENARIOS[rec.scenario][0]} → "
                        f"{SCENARIOS[rec.scenario][1]}"] + why + sub.reasons[1:])
        return sub
    rec.reasons.append("context parallelism inside a node does not make it fit either")
    return rec


def _with_expert_parallel(model, hw, job, rec: Recommendation) -> None:
    """Pick ep: the largest divisor of the experts that divides the DP degree and fits in a node
    (the all-to-all is on the critical path, like TP's all-reduces); say what it saves and costs."""
    lay = rec.layout
    inner = lay.tp * (lay.pp if lay.outer == "dp" else 1)  # what sits inside a DP group's stride
    ep = max(d for d in _divisors(model.experts)
             if lay.dp % d == 0 and inner * d <= hw.devices_per_node)
    rec.ep = ep
    states = model_state_bytes(model.expert_params / (lay.tp * lay.pp), 1, 0, job.recipe)["total"]
    tokens_mb = job.seq_len // rec.cp * job.micro_batch
    a2a = 4 * tokens_mb * model.top_k * model.hidden * BYTES_16 * (ep - 1) / ep
    m = rec.best.comm["microbatches"]
    rec.reasons.append(
        f"mixture of experts: {model.experts} experts, top {model.top_k} per token — "
        f"{model.params / 1e9:,.2f}B parameters, {model.active_params / 1e9:,.2f}B active per "
        f"token (the compute runs each token through its top {model.top_k} experts)")
    if ep > 1:
        rec.reasons.append(
            f"expert parallelism (--ep {ep}) over the DP group: each device keeps "
            f"{model.experts // ep} of the {model.experts} experts, their states "
            f"{_gb(states)} → {_gb(states / ep)} per device; tokens go to their experts and back "
            f"by all-to-all, 4·tokens·k·h·(ep−1)/ep values per MoE layer and micro-batch: "
            f"{_gb(a2a * math.ceil(model.layers / lay.pp) * m)} per device per step, inside a node")
    else:
        rec.reasons.append(f"expert parallelism: no degree > 1 divides both the {model.experts} "
                           f"experts and DP {lay.dp} inside a node; every device keeps every expert")


def _whole_layers_rejected(cands: list[Candidate]) -> None:
    """When not even the largest layer's training state fits one device, only splitting each layer
    (TP) or keeping no whole layer between uses (ZeRO-3 gathers one layer's weights at a time) will
    do: a layout that keeps every whole layer on every device is rejected."""
    for c in cands:
        if c.feasible and c.layout.tp == 1 and c.layout.zero < 3:
            c.rejected = ("the largest layer's state does not fit one device: keeping whole layers "
                          "on every device (no TP, ZeRO below 3) is the wrong cut; split each layer "
                          "with TP, or gather one layer at a time with ZeRO-3")


def _choose(model: ModelSpec, hw: ClusterSpec, job: Workload, stack=None,
            only_runnable: bool = True) -> Recommendation:
    _check_inputs(model, hw, job)
    stack = _stack(stack, hw)
    cands = [evaluate(model, hw, job, lay, stack, only_runnable) for lay in layouts(hw)]
    _offload_last(cands)
    key = scenario(model, hw, job, stack)
    if key == "one-node-layer-too-big":
        _whole_layers_rejected(cands)
    feasible = sorted((c for c in cands if c.feasible), key=lambda c: c.time["total"])
    rejected = [c for c in cands if not c.feasible]
    if not feasible:
        smallest = min((c for c in rejected if c.memory), key=lambda c: c.memory["total"],
                       default=None)
        reasons = [f"no layout fits: the smallest needs {smallest.memory['total'] / GB:,.1f} GB per "
                   f"device ({smallest.layout}); add devices, memory, or a smaller micro-batch"
                   if smallest else "no layout is possible; check the batch and the device counts"]
        return Recommendation(None, key, SCENARIOS[key][1], reasons, None, [], rejected)
    fastest = feasible[0].time["total"]
    tied = [c for c in feasible if c.time["total"] <= fastest * (1 + TOLERANCE)]
    best = min(tied, key=lambda c: _simplicity(c.layout))
    others = [c for c in tied if c is not best]
    return Recommendation(best.layout, key, SCENARIOS[key][1],
                          _reasons(model, hw, job, key, best, feasible, stack), best, others,
                          feasible + rejected)


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def _reasons(model, hw, job, key, best: Candidate, feasible: list[Candidate],
             stack: Stack) -> list[str]:
    """The recommendation in sentences: the table's row, memory, the time, what crosses nodes."""
    lay, mem, t = best.layout, best.memory, best.time
    out = [f"Hugging Face guide's table: {SCENARIOS[key][0]} → {SCENARIOS[key][1]}"]
    single = model_state_bytes(model.params, 1, 0, job.recipe)["total"]
    out.append(f"model states: 16 B/param × {model.params / 1e9:,.2f}B = {_gb(single)}; one device "
               f"has {hw.device.memory_gb:g} GB ({USABLE:.0%} usable)")
    out.append(f"{lay}: {_gb(mem['total'])} per device (states "
               f"{_gb(mem['parameters'] + mem['gradients'] + mem['optimizer_states'])}, "
               f"activations {_gb(mem['activations'])}"
               + (f", host {_gb(mem['host_per_node'])} per node" if lay.offload else "") + ")")
    comm = ", ".join(f"{k.upper()} {_gb(best.comm[k])} ({best.comm['links'][k]})"
                     for k in ("dp", "pp", "tp") if best.comm[k])
    out.append(f"per step each device sends {comm or 'nothing'}; estimated {t['total']:.3g} s per "
               f"step ({t['compute']:.3g} s compute, {best.comm['microbatches']} micro-batches, "
               f"priced kernel by kernel on the {stack.name} stack)")
    if hw.nodes > 1:
        fast, need = links_fast(hw, job, model, stack)
        out.append(f"between nodes each device gets {_inter(hw).busbw / 1e9:,.1f} GB/s; "
                   f"ZeRO-3 needs {need / 1e9:,.1f} GB/s to hide behind compute: "
                   f"{'fast' if fast else 'slow'} links")
    if feasible[0] is not best:
        out.append(f"the fastest, {feasible[0].layout}, is within {TOLERANCE:.0%}: the simpler "
                   "layout wins (less model parallelism, lower ZeRO stage)")
    return out


# --------------------------------------------------------------------------------------------------
# The scenario table as cases: lesson 08 shows them, tests/test_chooser.py checks every row
# --------------------------------------------------------------------------------------------------

# public shapes (parameters, layers, hidden, heads)
GPT2_XL = ModelSpec(1.5e9, 48, 1600, 25)
LLAMA_7B = ModelSpec(7e9, 32, 4096, 32)
LLAMA_13B = ModelSpec(13e9, 40, 5120, 40)
GPT3 = ModelSpec(175e9, 96, 12288, 96)
# two huge layers: one layer's 16 B/param (29 GB) exceeds a 24 GB device, the model fits 8 of them
WIDE = ModelSpec(3.6e9, 2, 12288, 96)

NODE = get_cluster("dgx-h100")  # 8 H100 80 GB on NVLink 4
ONE_H100 = replace(NODE, key="h100", title="one H100 80GB", devices_per_node=1)
# 8 devices of 24 GB on NVLink 4, each computing as an H100
NODE_24GB = replace(NODE, key="24gb", title="8 devices of 24 GB (an H100's compute) on NVLink 4",
                    device=replace(NODE.device, name="24 GB device", memory_gb=24))
IB, ETHERNET = NDR, ETH25  # per GPU between nodes: 400 Gb/s InfiniBand; 25 Gb/s Ethernet over TCP


def h100_nodes(nodes: int, inter: Link = IB) -> ClusterSpec:
    """``nodes`` DGX H100 nodes whose GPUs each reach the network over ``inter``."""
    return replace(NODE, key=f"h100x{nodes}", title=f"{nodes} DGX H100 nodes on {inter.name}",
                   nodes=nodes, inter=inter)

LONG = Workload(seq_len=4096, global_batch=512, micro_batch=4)  # 16k tokens per micro-batch
# GPT-3 175B's batch: 1,536 sequences of 2,048 tokens (Brown et al., 2020, Table 2.1: 3.2M tokens)
GPT3_BATCH = Workload(seq_len=2048, global_batch=1536, micro_batch=8)

#: The scenario table of the Hugging Face guide "Efficient Training on Multiple GPUs", row by row
#: (the Chinese comments quote the article that retells it): (situation, model, hardware, workload,
#: the scenario key, and the sets of techniques the guide allows — a recommendation must use one of
#: them, activation checkpointing (lesson 07) aside).
SCENARIO_TABLE = [
    # 单GPU: 模型可以存储在单GPU上 → 正常训练
    ("one GPU, the model fits: train normally", GPT2_XL, ONE_H100, Workload(),
     "one-device-fits", [set()]),
    # 单GPU: 模型不能存储在单GPU上 → ZeRO-Offload, the CPU holds part of the states
    ("one GPU, the model does not fit: ZeRO-Offload", LLAMA_7B, ONE_H100, Workload(),
     "one-device-too-big", [{"offload"}]),
    # 单机多卡: 模型可以存储在单GPU上 → DDP (recommended), ZeRO (may help)
    ("one machine, fits on one GPU: DDP", GPT2_XL, NODE, Workload(), "one-node-fits", [{"DP"}]),
    # 单机多卡: 模型不能存储在单GPU上 → PP, ZeRO, TP
    ("one machine, does not fit on one GPU: PP, ZeRO or TP", LLAMA_13B, NODE, Workload(),
     "one-node-too-big",
     [{"PP", "DP"}, {"TP", "DP"}, {"PP", "TP", "DP"}, {"DP", "ZeRO-1"}, {"DP", "ZeRO-2"},
      {"DP", "ZeRO-3"}, {"PP"}, {"TP"}, {"PP", "TP"}, {"TP", "DP", "ZeRO-1"},
      {"PP", "DP", "ZeRO-1"}, {"PP", "TP", "DP", "ZeRO-1"}]),
    # 单机多卡: 最大层无法放在单GPU上 → only TP, ZeRO
    ("one machine, even the largest layer does not fit on one GPU: TP or ZeRO", WIDE,
     NODE_24GB, Workload(), "one-node-layer-too-big",
     [{"TP"}, {"TP", "DP"}, {"TP", "DP", "ZeRO-1"}, {"DP", "ZeRO-3"}, {"PP", "TP"},
      {"PP", "TP", "DP"}, {"PP", "TP", "DP", "ZeRO-1"}]),
    # 多机多卡: 节点间通讯比较快 → ZeRO, PP+TP+DP
    ("several machines, fast links: ZeRO", LLAMA_13B, h100_nodes(4), LONG,
     "nodes-fast", [{"DP", "ZeRO-1"}, {"DP", "ZeRO-2"}, {"DP", "ZeRO-3"}]),
    # GPT-3's 2.8 TB of states: on 32 nodes a replica takes half the devices, leaving DP room
    ("several machines, fast links: PP+TP+DP", GPT3, h100_nodes(32), GPT3_BATCH, "nodes-fast",
     [{"PP", "TP", "DP"}, {"PP", "TP", "DP", "ZeRO-1"}]),
    # 多机多卡: 节点间通讯比较慢 → DP+TP+PP+ZeRO-1
    ("several machines, slow links: DP+TP+PP+ZeRO-1", GPT3, h100_nodes(32, ETHERNET), GPT3_BATCH,
     "nodes-slow", [{"DP", "TP", "PP", "ZeRO-1"}]),
]
