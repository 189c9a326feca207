"""A run's layout at another model size.

``project(result, "dgx-h100", model="7b")`` re-times the tiny GPT's run for a bigger model of the
same family (:data:`MODEL_SIZES`, or any :class:`~minitrain.model.GPTConfig`) with the same
strategy, world size, batch and schedule.  What that takes:

* the layout of the run (``summary.layout``: dp, pp, tp, cp, ep, micro-batches, virtual stages,
  ZeRO stage), as its strategy declared it (:class:`minitrain.record.Layout`);
* each rank's work at the target size (:func:`rank_work`): the tokens through its blocks, its
  FLOPs from the shapes (:func:`minitrain.model.training_flops`: forward, backward, recomputation),
  the parameters it holds and steps;
* each message at the target size (:class:`Scaler`): gradients and weights with the parameters of
  the layers they carry, activations with micro-batch × sequence × hidden, and a per-layer message
  repeated for the target's layers;
* the memory per device at the target size (:func:`rank_memory`): ZeRO's formulas for the
  model states (:func:`minitrain.memory.memory_per_device`, as the chooser's), the ledger's
  measured activation peak scaled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..memory import activation_bytes_per_layer, memory_per_device
from ..model import GPTConfig, training_flops
from ..parallel.schedules import split_layers

__all__ = ["MODEL_SIZES", "target_model", "RankWork", "rank_work", "Scaler", "itemsize",
           "rank_memory"]

#: Bigger models: GPT-2 shaped ones (4h-wide GeLU MLPs, learned positions), by the
#: shapes of Brown et al., 2020, "Language Models are Few-Shot Learners", Table 2.1 (GPT-3 XL 1.3B,
#: 2.7B, 6.7B, 13B — its 13B's d_model 5140 is 5120 here, 40 heads of 128) and Radford et al., 2019
#: (GPT-2 124M); vocabulary 50,257, 2,048 positions.
MODEL_SIZES = {
    "gpt2": GPTConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "1.3b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "2.7b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=32, n_head=32, d_model=2560),
    "7b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=32, n_head=32, d_model=4096),
    "13b": GPTConfig(vocab_size=50257, seq_len=2048, n_layer=40, n_head=40, d_model=5120),
    # Llama 3 (Grattafiori et al., 2024, "The Llama 3 Herd of Models", Table 3, and Meta's
    # published config.json): vocabulary 128,256, 8 key/value heads, SwiGLU, RMSNorm, RoPE, no
    # biases, an untied output layer, 8,192 positions in pre-training.  8,030,261,248 and
    # 70,553,706,496 parameters.
    "llama3-8b": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, d_model=4096,
                           d_ff=14336, n_kv_head=8, mlp="swiglu", norm="rmsnorm", positions="rope",
                           bias=False),
    "llama3-70b": GPTConfig(vocab_size=128256, seq_len=8192, n_layer=80, n_head=64, d_model=8192,
                            d_ff=28672, n_kv_head=8, mlp="swiglu", norm="rmsnorm", positions="rope",
                            bias=False),
}

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


# --------------------------------------------------------------------------------------------------
# The layout: what each rank computes and holds
# --------------------------------------------------------------------------------------------------


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
    lay = summary.layout
    tp = (degrees or {}).get("tp") or lay.tp
    stages, virtual = lay.stages_of(rank), lay.pp * lay.virtual_stages
    split = split_layers(cfg.n_layer, virtual)
    blocks = sum(len(split[st]) for st in stages)
    embed, head = 0 in stages, virtual - 1 in stages
    tokens = summary.batch_size * cfg.seq_len / (lay.dp * lay.cp)
    if recompute is None:
        recompute = summary.checkpoint_activations
    flops = training_flops(cfg, tokens, blocks, head, tp=tp, recompute=recompute)
    model_flops = training_flops(cfg, tokens, blocks, head, tp=tp)
    block = cfg.block_params() / tp
    if cfg.n_expert and lay.ep > 1:
        block -= cfg.n_expert * cfg.mlp_params() * (1 - 1 / lay.ep)
    emb = cfg.embed_params() / (tp if tp > 1 else 1) if embed else 0.0
    hd = cfg.head_params() / tp if head else 0.0
    params = blocks * block + emb + hd
    dp = (degrees or {}).get("dp") or lay.dp
    opt = params / dp if lay.zero_stage >= 1 else params
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
        world = summary.world_size
        mine = [rank_work(summary, run, r) for r in range(world)]
        theirs = [rank_work(summary, target, r, degrees) for r in range(world)]
        self.param_ratio = [t.params / max(m.params, 1.0) for m, t in zip(mine, theirs)]
        self.block_ratio = [t.block_params / max(m.block_params, 1.0) for m, t in zip(mine, theirs)]
        lay = summary.layout
        self.tokens_mb = summary.batch_size / (lay.dp * lay.microbatches) * run.seq_len / lay.cp
        # expert parallelism: the gradient all-reduce ("grads") carries only the replicated
        # (dense) parameters — each expert has one owner — not the rank's own experts with them
        self.dense_ratio = (_replicated_params(target) / max(_replicated_params(run), 1.0)
                            if lay.ep > 1 else None)

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
            if self.dense_ratio is not None and event.get("tag") == "grads":
                return nbytes * self.dtype * self.dense_ratio, 1.0
            return nbytes * self.dtype * self.param_ratio[rank], 1.0
        per_token = nbytes / self.items[0] / max(self.tokens_mb, 1.0)
        width = target.d_model / run.d_model if per_token > 4 else 1.0
        return nbytes * self.dtype * target.seq_len / run.seq_len * width, repeat


def _replicated_params(cfg: GPTConfig) -> float:
    """The parameters every expert-parallel rank holds a copy of: all but the experts' MLPs
    (the router stays)."""
    return cfg.num_params() - cfg.n_layer * cfg.n_expert * cfg.mlp_params()


def itemsize(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def rank_memory(summary, run: GPTConfig, target: GPTConfig, precision, work,
                dp: int, recompute: bool | None = None) -> list[dict]:
    """Bytes per device of each rank, the run's replicas re-sized to ``dp``
    (:func:`minitrain.memory.memory_per_device`): the model states of the rank's share at the
    projected precision by ZeRO's formulas, and the ledger's measured activation peak scaled by
    micro-batch × sequence × hidden × layers held — and, where ``recompute`` asks for activation
    checkpointing the run did not do (or leaves out what it did), by what a layer keeps with and
    without it (:func:`minitrain.memory.activation_bytes_per_layer`: its input alone, 2·s·b·h,
    against s·b·h·(10 + 24/t + 5·a·s/(h·t))); with ZeRO-Offload, Adam's states (and the fp32
    masters) in host memory."""
    recipe = "fp32-adam" if precision == "fp32" else "mixed-adam"
    out = []
    mems = summary.memory or []
    lay = summary.layout
    for r, w in sorted(work.items()):
        measured = (mems[r]["bytes"]["activations_peak"] if r < len(mems) else 0)
        own = rank_work(summary, run, r)
        scale = (target.seq_len * target.d_model * max(w.blocks, 1)) / (
            run.seq_len * run.d_model * max(own.blocks, 1))
        item = itemsize(precision) / itemsize(summary.precision)
        acts = measured * scale * item if (target != run or item != 1) else measured
        ran = bool(summary.checkpoint_activations)
        if recompute is not None and recompute != ran:
            kept = [activation_bytes_per_layer(target.seq_len, 1, target.d_model, target.n_head,
                                               on, w.tp) for on in (ran, recompute)]
            acts *= kept[1] / kept[0]
        out.append(memory_per_device(w.params, dp, lay.zero_stage, recipe, acts,
                                     offload=lay.offload))
    return out
