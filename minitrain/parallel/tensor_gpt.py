"""The tiny GPT split Megatron-style over a tensor-parallel group (lessons 06 and 08): attention by
heads, the MLP by columns then rows, the vocabulary for the embedding, the head and the loss.

Papers: Shoeybi et al., 2019, "Megatron-LM" (the split transformer layer); Korthikanti et al.,
2022, "Reducing Activation Recomputation in Large Transformer Models" (sequence parallelism).
:class:`TensorParallelGPT` is the whole model (strategy ``tensor``); :class:`TensorParallelParts`
gives a pipeline stage the same pieces (strategy ``3d``) — and, given an ``attention`` function and
the tokens' ``positions``, each rank's heads attend over a sequence held in pieces by other ranks
(context parallelism's ring, :mod:`minitrain.parallel.context`: the 4D mesh).  The layers are
:mod:`minitrain.parallel.tensor`'s.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm, all_reduce_coalesced
from ..model import GPT, Attention, Block, Embedding, GPTConfig, Head
from .errors import ParameterError
from .tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     VocabParallelLinear, _replicated_param, padded_size, sequence_shard,
                     vocab_parallel_cross_entropy, vocab_parallel_loss)

__all__ = ["causal_attention", "ParallelAttention", "ParallelMLP", "ParallelBlock",
           "ParallelEmbedding",
           "ParallelHead", "TensorParallelGPT", "TensorParallelParts", "tag_collectives",
           "all_reduce_sequence_parallel_grads"]


def _layer_norm(ln: nn.LayerNorm, sequence_parallel: bool) -> nn.LayerNorm:
    """A copy of ``ln`` whose parameters are marked for the sequence-parallel gradient sum."""
    out = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    out.weight = _replicated_param(ln.weight, sequence_parallel)
    out.bias = _replicated_param(ln.bias, sequence_parallel)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (b, heads, t, head_dim) queries over the same t keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's ``n_head / N`` heads: Q, K, V column-parallel (its
    heads' rows of q, k and v of the fused ``qkv``), the output projection row-parallel.
    ``attention(q, k, v)`` computes the heads' causal attention on (b, heads, t, head_dim)
    (default :func:`causal_attention`; the 4D mesh: ring attention over the context group)."""

    def __init__(self, attn: Attention, comm: Comm, sequence_parallel: bool, *,
                 column_parallel_linear=None, row_parallel_linear=None, attention=None):
        super().__init__()
        if attn.n_head % comm.size:
            raise ValueError(f"{attn.n_head} heads do not split over {comm.size} ranks")
        self.attention = attention or causal_attention
        self.heads = attn.n_head // comm.size
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, comm, parts=3,
                                                    column_parallel_linear=column_parallel_linear,
                                                    sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(attn.proj, comm,
                                                  row_parallel_linear=row_parallel_linear,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (t, b, heads · head_dim)
        t, b, width = q.shape
        q, k, v = (z.reshape(t, b, self.heads, width // self.heads).permute(1, 2, 0, 3)
                   for z in (q, k, v))
        y = self.attention(q, k, v)  # (b, heads, t, head_dim)
        return self.proj(y.permute(2, 0, 1, 3).reshape(t, b, width))


class ParallelMLP(nn.Module):
    """GeLU(XA)B with A column-parallel and B row-parallel: one sum, at the end."""

    def __init__(self, mlp: nn.Module, comm: Comm, sequence_parallel: bool, *,
                 column_parallel_linear=None, row_parallel_linear=None):
        super().__init__()
        self.fc = ColumnParallelLinear.from_linear(mlp.fc, comm,
                                                   column_parallel_linear=column_parallel_linear,
                                                   sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(mlp.proj, comm,
                                                  row_parallel_linear=row_parallel_linear,
                                                  sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    """The pre-LayerNorm block; LayerNorms and residuals run on whole or sequence-sharded input.
    ``column_parallel_linear``/``row_parallel_linear``: the linears' own (see
    :class:`ColumnParallelLinear`); ``attention``: the heads' (see :class:`ParallelAttention`)."""

    def __init__(self, block: Block, comm: Comm, sequence_parallel: bool, *,
                 column_parallel_linear=None, row_parallel_linear=None, attention=None):
        super().__init__()
        linears = dict(column_parallel_linear=column_parallel_linear,
                       row_parallel_linear=row_parallel_linear)
        self.ln1 = _layer_norm(block.ln1, sequence_parallel)
        self.attn = ParallelAttention(block.attn, comm, sequence_parallel, **linears,
                                      attention=attention)
        self.ln2 = _layer_norm(block.ln2, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, comm, sequence_parallel, **linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel token embedding plus the (replicated) position embedding; (b, t) ids in,
    (t, b, d) out — or, sequence parallel, this rank's t/N positions (padded).  ``positions``: the
    global positions of the t tokens (default 0 … t-1; context parallel: this rank's pieces of the
    sequence, padding clamped to the last position)."""

    def __init__(self, embed: Embedding, comm: Comm, sequence_parallel: bool, *,
                 positions: torch.Tensor | None = None):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.positions = (None if positions is None
                          else positions.clamp(max=embed.pos.num_embeddings - 1))
        self.tok = VocabParallelEmbedding.from_embedding(embed.tok, comm,
                                                         sequence_parallel=sequence_parallel)
        self.pos = nn.Embedding(embed.pos.num_embeddings, embed.pos.embedding_dim)
        self.pos.weight = _replicated_param(embed.pos.weight, sequence_parallel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.positions is None:
            pos = self.pos.weight[:idx.shape[1]].unsqueeze(1)  # (t, 1, d)
        else:
            pos = self.pos.weight[self.positions.to(idx.device)].unsqueeze(1)
        if self.sequence_parallel:
            pos = sequence_shard(pos, self.comm)  # my positions only: a partial gradient
        return self.tok(idx.t()) + pos


class ParallelHead(nn.Module):
    """Final LayerNorm, then the output layer column-parallel over the padded vocabulary; the
    output keeps the first ``seq_len`` positions (given here or to forward): sequence parallelism's
    padding dropped."""

    def __init__(self, head: Head, comm: Comm, sequence_parallel: bool, *, seq_len=None,
                 column_parallel_linear=None):
        super().__init__()
        self.seq_len = seq_len
        self.ln = _layer_norm(head.ln, sequence_parallel)
        self.out = VocabParallelLinear.from_linear(head.out, comm,
                                                   column_parallel_linear=column_parallel_linear,
                                                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return self.out(self.ln(x))[:seq_len or self.seq_len]


def tag_collectives(module: nn.Module) -> nn.Module:
    """Tag each layer's collectives with its name in ``module`` ("blocks.0.mlp.proj forward"),
    so that a tracer's events say which layer made them."""
    for name, m in module.named_modules():
        if hasattr(m, "tag"):
            m.tag = name
    return module


class TensorParallelGPT(nn.Module):
    """This rank's shard of ``model`` (a :class:`~minitrain.model.GPT`) over ``comm``'s ranks.

    Parameter names are the single-process ones (``blocks.0.attn.qkv.weight`` …), holding shards.
    ``forward(idx, targets)`` returns the mean loss — the same number on every rank; without
    targets, this rank's slice of the logits, (t, b, V/N).  Collectives are tagged by layer
    (:func:`tag_collectives`).  ``column_parallel_linear``/``row_parallel_linear``: the linears'
    own (see :class:`ColumnParallelLinear`); ``vocab_parallel_cross_entropy``: the loss's (see
    :func:`~minitrain.parallel.tensor.vocab_parallel_loss`).
    """

    def __init__(self, model: GPT, comm: Comm, sequence_parallel: bool = False, *,
                 column_parallel_linear=None, row_parallel_linear=None,
                 vocab_parallel_cross_entropy=None):
        super().__init__()
        self.cfg, self.comm, self.sequence_parallel = model.cfg, comm, sequence_parallel
        self.vocab_parallel_cross_entropy = vocab_parallel_cross_entropy
        self.embed = ParallelEmbedding(model.embed, comm, sequence_parallel)
        self.blocks = nn.ModuleList(
            ParallelBlock(b, comm, sequence_parallel, column_parallel_linear=column_parallel_linear,
                          row_parallel_linear=row_parallel_linear) for b in model.blocks)
        self.head = ParallelHead(model.head, comm, sequence_parallel,
                                 column_parallel_linear=column_parallel_linear)
        if model.cfg.tie_weights:  # both split the vocabulary the same way: share the shard
            self.head.out.weight = self.embed.tok.weight
        tag_collectives(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x, idx.shape[1])
        if targets is None:
            return logits
        return vocab_parallel_loss(logits, targets, self.cfg.vocab_size, self.comm,
                                   self.vocab_parallel_cross_entropy)

    def all_reduce_sequence_parallel_grads(self) -> None:
        all_reduce_sequence_parallel_grads(self, self.comm)


class TensorParallelParts:
    """The tensor-parallel pieces of a GPT over ``comm``, for a pipeline stage:
    ``PipelineStage(model, s, n, parts=TensorParallelParts(...))`` holds a vocabulary-parallel
    embedding, parallel blocks and a parallel head (the 3D mesh, lesson 08).  It also says what
    the pipeline needs around them: :meth:`activation_shape` (what travels between stages:
    (t, b, d), or a sequence shard) and :meth:`loss` (the vocabulary-parallel cross-entropy).

    A rank that holds only some tokens of each sequence (context parallel, the 4D mesh) gives
    their global ``positions`` (1-D), the heads' ``attention(q, k, v)`` that reaches the other
    ranks' tokens (ring attention), and ``sequence_tokens``, the real tokens of a whole sequence:
    :meth:`loss` is then this rank's sum over its real tokens (targets < 0 are padding) divided by
    batch × sequence_tokens, so that the ranks' losses add up to the mean.
    """

    def __init__(self, model: GPTConfig, comm: Comm, sequence_parallel: bool = False, *,
                 column_parallel_linear=None, row_parallel_linear=None, attention=None,
                 positions: torch.Tensor | None = None, sequence_tokens: int | None = None):
        self.cfg, self.comm, self.sequence_parallel = model, comm, sequence_parallel
        self.column_parallel_linear = column_parallel_linear
        self.row_parallel_linear, self.attention = row_parallel_linear, attention
        self.positions, self.sequence_tokens = positions, sequence_tokens

    def __call__(self, kind: str, module: nn.Module) -> nn.Module:
        sp = self.sequence_parallel
        if kind == "embed":
            return ParallelEmbedding(module, self.comm, sp, positions=self.positions)
        if kind == "block":
            return ParallelBlock(module, self.comm, sp,
                                 column_parallel_linear=self.column_parallel_linear,
                                 row_parallel_linear=self.row_parallel_linear,
                                 attention=self.attention)
        if kind == "head":
            tokens = self.cfg.seq_len if self.positions is None else len(self.positions)
            return ParallelHead(module, self.comm, sp, seq_len=tokens,
                                column_parallel_linear=self.column_parallel_linear)
        raise ParameterError("unknown {}: embed, block or head", ("kind", kind))

    def activation_shape(self, batch: int, seq: int) -> tuple:
        n = self.comm.size
        t = padded_size(seq, n) // n if self.sequence_parallel else seq
        return (t, batch, self.cfg.d_model)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.sequence_tokens is None:
            return vocab_parallel_loss(logits, targets, self.cfg.vocab_size, self.comm)
        targets = targets.t()  # (t, b), as the logits
        per = vocab_parallel_cross_entropy(logits, targets, logits.shape[-1] * self.comm.rank,
                                           self.cfg.vocab_size, self.comm)
        real = (targets >= 0).to(per.dtype)  # padding: no loss
        return (per * real).sum() / (targets.shape[1] * self.sequence_tokens)


def all_reduce_sequence_parallel_grads(module: nn.Module, comm: Comm) -> None:
    """Sequence parallel: sum, over the TP ranks of ``comm``, the gradients of ``module``'s
    replicated parameters that saw only this rank's positions (LayerNorms, row-parallel biases,
    positions) — one all-reduce of them all, after backward and before the optimizer step."""
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    all_reduce_coalesced(grads, comm, tag="sequence-parallel-grads backward")
