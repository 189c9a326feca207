"""A tiny decoder-only transformer (GPT-2 shaped) that every lesson trains (lessons 00, 02–08).

Three parts, the lines along which the techniques cut it: ``embed`` (token + position embeddings:
the first pipeline stage, vocab-parallel in tensor parallelism), ``blocks`` (``n_layer`` transformer
blocks: split across pipeline stages, Megatron-split in tensor parallelism) and ``head`` (final
LayerNorm + output layer: the last stage, where the loss is computed).  Initialisation is GPT-2's
(Radford et al., 2019), deterministic from a seed and independent of the global RNG, so every rank
and every strategy builds bit-equal weights without a broadcast; no dropout, so strategies cannot
differ by RNG draws.  ``GPT(..., checkpoint_activations=True)`` recomputes each block during backward
(activation checkpointing, lesson 07; Chen et al., 2016, "Training Deep Nets with Sublinear Memory
Cost").

:class:`GPTConfig` also describes Llama-shaped models (grouped-query attention, SwiGLU MLPs, RMSNorm,
rotary positions, no biases: Touvron et al., 2023, "LLaMA"; Grattafiori et al., 2024, "The Llama 3
Herd of Models") so that the planning package can count their parameters and FLOPs; the ``GPT``
module trained here stays GPT-2 shaped and refuses them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTConfig", "GPT", "Block", "PRESETS", "loss_fn", "MoE", "moe_router", "expert_capacity",
           "recompute_block", "block_flops", "head_flops", "training_flops"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the tiny GPT.  ``d_ff`` defaults to 4·d_model."""

    vocab_size: int = 13  # the arithmetic language of minitrain.data
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    d_ff: int | None = None
    tie_weights: bool = False
    n_expert: int = 0  # > 0: every block's MLP is a mixture of this many experts (lesson 09)
    top_k: int = 2  # experts per token
    capacity_factor: float | None = None  # None: no token dropped; else, per sequence (a group),
    #                                       cap = ceil(cf·seq_len·k/E) assignments per expert
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the loss
    # Llama shapes (projection targets only; the defaults are GPT-2's):
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    mlp: str = "gelu"  # "gelu": GeLU(xA)B | "swiglu": (SiLU(xG) * xU)D, three d×ff matrices
    norm: str = "layernorm"  # "layernorm": weight and bias | "rmsnorm": weight only
    positions: str = "learned"  # "learned": a seq_len×d table | "rope": rotary, no parameters
    bias: bool = True  # biases in the output projection and the MLP (Llama: none)
    #: the fields above that only a Llama-shaped target sets (a GPT-2 shape may leave them out)
    SHAPE_FIELDS: ClassVar[tuple] = ("n_kv_head", "mlp", "norm", "positions", "bias")

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                             f"pick d_model as a multiple of n_head (e.g. {self.n_head * 16})")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_expert={self.n_expert}")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}: "
                             f"each key/value head serves a whole group of query heads; pick "
                             f"n_kv_head among the divisors of n_head (or None for n_head)")
        for name, known in (("mlp", ("gelu", "swiglu")), ("norm", ("layernorm", "rmsnorm")),
                            ("positions", ("learned", "rope"))):
            if getattr(self, name) not in known:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not known: "
                                 f"choose one of {', '.join(map(repr, known))}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: n_kv_head · head_dim."""
        return self.kv_heads * self.head_dim

    def llama_fields(self) -> list[str]:
        """The Llama-shape fields set away from GPT-2's (empty for a GPT-2 shaped config)."""
        gpt2 = {"mlp": "gelu", "norm": "layernorm", "positions": "learned", "bias": True}
        changed = [name for name, value in gpt2.items() if getattr(self, name) != value]
        return (["n_kv_head"] if self.kv_heads != self.n_head else []) + changed

    def norm_params(self) -> int:
        """Parameters of one normalization layer: LayerNorm's weight and bias, RMSNorm's weight."""
        return (2 if self.norm == "layernorm" else 1) * self.d_model

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    def num_params(self) -> int:
        """Parameter count from the shapes alone (equals ``GPT(cfg).num_params()``)."""
        return self.embed_params() + self.n_layer * self.block_params() + self.head_params()

    def to_dict(self) -> dict:
        return asdict(self)

    def mlp_params(self) -> int:
        """Parameters of one MLP (with ``n_expert``: one expert's): d→ff→d with biases (GeLU), or
        SwiGLU's gate, up and down matrices (3·d·ff; biases on gate and up and down if ``bias``)."""
        d, ff = self.d_model, self.ff
        if self.mlp == "swiglu":
            return 3 * d * ff + ((2 * ff + d) if self.bias else 0)
        return 2 * d * ff + ((ff + d) if self.bias else 0)

    def attention_params(self) -> int:
        """Q and output projections d×d, K and V d×kv_dim (no bias on Q/K/V; the output
        projection's bias if ``bias``)."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim + (d if self.bias else 0)

    def block_params(self) -> int:
        """Parameters of one transformer block (its share of :meth:`num_params`): two norms,
        attention, the MLP (or the experts and the router)."""
        d, mlp = self.d_model, self.mlp_params()
        if self.n_expert:
            mlp = self.n_expert * mlp + d * self.n_expert  # the experts and the router
        return 2 * self.norm_params() + self.attention_params() + mlp

    def embed_params(self) -> int:
        """The token table, and the position table when positions are learned (RoPE has none)."""
        positions = self.seq_len * self.d_model if self.positions == "learned" else 0
        return self.vocab_size * self.d_model + positions

    def head_params(self) -> int:
        """The final norm and the output matrix (none of its own when tied to the embedding)."""
        return self.norm_params() + (0 if self.tie_weights else self.vocab_size * self.d_model)


# --------------------------------------------------------------------------------------------------
# FLOPs from the shapes (the projection's and the chooser's compute term)
# --------------------------------------------------------------------------------------------------


def block_flops(cfg: GPTConfig, keys: int | None = None, tp: int = 1) -> float:
    """Forward FLOPs of one block for one token: its matrix products (2 FLOPs per multiply-add)
    — Q and output projections 2·2d², K and V 2·2·d·kv_dim (2·2d² without grouped-query
    attention), the MLP 2·2·d·ff (SwiGLU: 2·3·d·ff; a mixture of experts: the router
    2·d·E and top_k experts) — and attention's QKᵀ and AV, 2·2·keys·d (keys: the positions a token
    attends to, the sequence length; counted in full, not halved for the causal mask, as
    Narayanan et al., 2021, and PaLM's MFU do).  ``tp``: the share of one tensor-parallel rank
    (heads and MLP columns split; the router is not)."""
    d, keys = cfg.d_model, cfg.seq_len if keys is None else keys
    attention = 2 * (2 * d * d + 2 * d * cfg.kv_dim) + 2 * 2 * keys * d
    mlp = 2 * (3 if cfg.mlp == "swiglu" else 2) * d * cfg.ff
    if cfg.n_expert:
        return (attention + cfg.top_k * mlp) / tp + 2 * d * cfg.n_expert
    return (attention + mlp) / tp


def head_flops(cfg: GPTConfig, tp: int = 1) -> float:
    """Forward FLOPs of the output layer for one token, 2·d·V (vocabulary-parallel: / tp)."""
    return 2 * cfg.d_model * cfg.vocab_size / tp


def training_flops(cfg: GPTConfig, tokens: float, blocks: int | None = None, head: bool = True,
                   keys: int | None = None, tp: int = 1, recompute: bool = False) -> float:
    """FLOPs of forward and backward (backward = 2 × forward) of ``tokens`` tokens through
    ``blocks`` blocks (default all) and the head, plus one more forward of the blocks with
    ``recompute`` (activation checkpointing).  For the whole model and sequence length s this is
    72·L·h²·(1 + s/6h + V/12Lh) per token with 4h-wide MLPs (Narayanan et al., 2021, eq. 3; ×96/72
    on the blocks with recomputation)."""
    blocks = cfg.n_layer if blocks is None else blocks
    forward = blocks * block_flops(cfg, keys, tp) + (head_flops(cfg, tp) if head else 0.0)
    again = blocks * block_flops(cfg, keys, tp) if recompute else 0.0
    return tokens * (3 * forward + again)


#: Named sizes used by the lessons and the CLI (``--model``).
PRESETS = {
    "nano": GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16),
    "tiny": GPTConfig(),
    "small": GPTConfig(n_layer=6, n_head=6, d_model=192, seq_len=64),
    # 4 experts of half the dense MLP's width, 2 per token: the FLOPs per token of "tiny", twice its
    # MLP parameters
    "tiny-moe": GPTConfig(n_expert=4, top_k=2, d_ff=128),
}


class Attention(nn.Module):
    """Causal multi-head self-attention: Q, K, V projections, softmax(QKᵀ/√d)V, output projection.

    The Q/K/V projection has no bias (as in LLaMA): a key bias gets an exactly-zero gradient in exact
    arithmetic (softmax ignores a constant shift), so in floats its "gradient" is pure rounding noise
    that Adam would amplify into different weights for runs that should be equal.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """GeLU(XA)B — the product tensor parallelism splits by columns of A and rows of B (Megatron-LM)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff)
        self.proj = nn.Linear(cfg.ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def moe_router(logits: torch.Tensor, k: int, capacity: int | None):
    """Top-k routing with capacity and the load-balancing loss, for G groups of S tokens (GShard,
    Lepikhin et al., 2020; Switch Transformers, Fedus et al., 2021): ``logits`` (G, S, E), the
    router's scores.  Returns ``(experts, gates, keep, aux_loss)``:

    * ``experts`` (G, S, k): each token's k most probable experts (softmax over E), best first;
    * ``gates`` (G, S, k): their probabilities renormalised to sum to 1 per token;
    * ``keep`` (G, S, k): whether the assignment fits its expert's ``capacity`` in its group —
      the queue of an expert takes every token's first choice, in token order, before any
      second choice (GShard's rule); ``capacity`` None keeps every assignment;
    * ``aux_loss``: E·Σ_e f_e·P_e per group, averaged over the groups — f_e the fraction of the
      group's assignments routed to e (before capacity), P_e the mean router probability of e.
      Only P_e carries a gradient: it pushes probability away from over-used experts."""
    G, S, E = logits.shape
    probs = F.softmax(logits.float(), dim=-1)
    top, experts = probs.topk(k, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    chosen = F.one_hot(experts, E)                                 # (G, S, k, E)
    queue = chosen.transpose(1, 2).reshape(G, k * S, E)           # first choices, then second...
    position = ((queue.cumsum(1) - 1) * queue).sum(-1)            # place in its expert's queue
    position = position.view(G, k, S).transpose(1, 2)              # (G, S, k)
    keep = position < capacity if capacity is not None else torch.ones_like(position, dtype=torch.bool)
    f = chosen.sum((1, 2)).to(probs.dtype) / (S * k)               # (G, E)
    aux = (E * (f * probs.mean(1)).sum(-1)).mean()
    return experts, gates, keep, aux


def expert_capacity(cfg: GPTConfig, tokens: int) -> int | None:
    """How many assignments an expert takes from a group of ``tokens`` (one sequence: ``seq_len``)
    per step (None: all): ceil(capacity_factor · tokens · top_k / n_expert)."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_expert)


class MoE(nn.Module):
    """A mixture of ``n_expert`` MLPs replacing the block's MLP: a router sends each token to its
    top-k experts (Shazeer et al., 2017, "Outrageously Large Neural Networks"), whose outputs are
    summed weighted by the gates; with a capacity factor an expert takes only so many assignments
    of each group of tokens — here a group is one sequence, so that a rank holding whole
    sequences decides alone, before any token moves (Lepikhin et al., 2020, "GShard": capacity
    per group).  ``moe_router``: the routing rule (None: the package's :func:`moe_router`).  After
    each forward: ``aux_loss`` (load balance), ``tokens_per_expert`` (assignments routed) and
    ``dropped``."""

    def __init__(self, cfg: GPTConfig, moe_router=None):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_expert))
        self.moe_router = moe_router  # None: the package's moe_router
        self.aux_loss = self.tokens_per_expert = None
        self.dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, d = self.cfg, x.shape[-1]
        groups = x.reshape(-1, x.shape[-2], d)  # (sequences, tokens, d): one group per sequence
        route = self.moe_router or moe_router
        experts, gates, keep, self.aux_loss = route(self.router(groups), cfg.top_k,
                                                    expert_capacity(cfg, groups.shape[1]))
        flat = groups.reshape(-1, d)
        tokens = torch.arange(flat.shape[0], device=x.device).repeat_interleave(cfg.top_k)
        experts, gates, keep = experts.reshape(-1), gates.reshape(-1), keep.reshape(-1)
        self.tokens_per_expert = torch.bincount(experts, minlength=cfg.n_expert).tolist()
        self.dropped = int((~keep).sum())
        tokens, experts, gates = tokens[keep], experts[keep], gates[keep]
        order = torch.argsort(experts, stable=True)  # grouped by expert, token order within
        counts = torch.bincount(experts, minlength=cfg.n_expert)
        ys = [self.experts[e](rows) for e, rows in enumerate(flat[tokens[order]].split(counts.tolist()))]
        out = torch.zeros_like(flat).index_add_(
            0, tokens[order], torch.cat(ys) * gates[order].unsqueeze(-1).to(flat.dtype))
        return out.view_as(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (a :class:`MoE`
    when ``n_expert`` > 0)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), (MoE(cfg) if cfg.n_expert else MLP(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embedding plus learned position embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch, computed in fp32 (16-bit
    logits are upcast: a softmax over the vocabulary and a mean over the batch need the precision)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def recompute_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)``, keeping only ``x`` for backward, which runs the block again (non-reentrant
    ``torch.utils.checkpoint``; lesson 07's exercise writes one as a ``torch.autograd.Function``)."""
    return checkpoint(block, x, use_reentrant=False)


class GPT(nn.Module):
    """The tiny GPT.  ``GPT(cfg, seed)`` gives the same weights on every rank and every run.

    ``checkpoint_activations=True`` (an attribute, can be switched at any time) runs each block
    through ``recompute_block(block, x)`` (None: the package's :func:`recompute_block`; lesson 07's
    exercise writes one) while gradients are being recorded.
    """

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0,
                 checkpoint_activations: bool = False, recompute_block=None):
        super().__init__()
        if cfg.llama_fields():
            raise ValueError(f"GPT(cfg) builds the course's GPT-2 shaped model; {', '.join(cfg.llama_fields())} "
                             f"describe Llama shapes, which are projection targets only (count and price "
                             f"them with minitrain.planning); train with GPT-2 defaults for those fields")
        self.cfg = cfg
        self.checkpoint_activations = checkpoint_activations
        self.recompute_block = recompute_block  # None: the package's recompute_block
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_weights:
            self.head.out.weight = self.embed.tok.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name:  # LayerNorm gains
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith("proj.weight") else 0.02
                # drawn on the host from one seeded generator: the same weights on any device
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * std)

    def num_params(self) -> int:
        """Parameters counted once (a tied weight is one parameter)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab), or the mean loss when ``targets`` are given."""
        x = self.embed(idx)
        again = self.checkpoint_activations and torch.is_grad_enabled()
        recompute = self.recompute_block or recompute_block
        for block in self.blocks:
            x = recompute(block, x) if again else block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        loss = loss_fn(logits, targets)
        return loss + self.aux_loss() if self.cfg.n_expert else loss

    def aux_loss(self):
        """The MoE blocks' load-balancing losses times ``aux_loss_coef`` (0 for a dense model)."""
        if not self.cfg.n_expert:
            return 0.0
        return self.cfg.aux_loss_coef * sum(b.mlp.aux_loss for b in self.blocks)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, stop: int | None = None) -> torch.Tensor:
        """Greedy continuation of ``idx`` (batch, t) by ``new_tokens`` tokens."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len:])
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
            if stop is not None and bool((nxt == stop).all()):
                break
        return idx
