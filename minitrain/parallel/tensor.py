"""Tensor parallelism (Megatron-style) and sequence parallelism, from scratch (lesson 06).

Papers: Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" — column/row-parallel linears, the conjugate operators f and g, attention heads
split across ranks, the vocabulary-parallel embedding and cross-entropy; Korthikanti et al., 2022,
"Reducing Activation Recomputation in Large Transformer Models" — sequence parallelism.  Seed 003:
"GeLU(XA)B — split A by columns, B by rows".

**The MLP.**  Y = GeLU(XA) and Z = YB.  Split A by columns, A = [A_1 … A_N]: rank i computes
Y_i = GeLU(X A_i) on its own (GeLU works element by element, so no sum is needed before it).  Split B
by rows, B = [B_1; …; B_N]: rank i computes the partial product Y_i B_i, and Z = Σ_i Y_i B_i — one
all-reduce.  That is :class:`ColumnParallelLinear` (keeps out_features/N of the outputs) followed by
:class:`RowParallelLinear` (keeps in_features/N of the inputs; its bias is added once, after the
sum).

**f and g.**  The two places where ranks talk are the conjugate operators of the paper: *f* before a
column-parallel linear — identity forward (every rank already has X), all-reduce backward (each rank
holds only its part of dL/dX); *g* after a row-parallel linear — all-reduce forward, identity
backward.  So a transformer layer (attention, then MLP) costs 2 all-reduces forward and 2 backward.

**Attention** is split by heads: Q, K and V are column-parallel (the model's fused ``qkv`` is one
Linear(d, 3d) laid out [q; k; v], so a rank keeps its heads' rows of *each* of q, k and v — the
``parts=3`` of :func:`shard_tensor`), each rank runs softmax(QKᵀ/√d)V for its heads, and the output
projection is row-parallel.

**The vocabulary.**  :class:`VocabParallelEmbedding` keeps rows [start, end) of the table: ids
outside are masked to zero and an all-reduce sums the ranks' partial lookups (exactly one rank
contributed each token).  The head's output layer is column-parallel over the vocabulary and the
loss is computed without gathering the logits (:func:`vocab_parallel_cross_entropy`): the max, then
the target's logit and the sum of exponentials are all-reduced, a few numbers per token instead of
the vocabulary.  The vocabulary is padded to a multiple of N (13 → 14 on 2 ranks); padded logits
are masked out of the softmax, so they change nothing, and padded rows get zero gradients.

**Sequence parallelism** (``sequence_parallel=True``).  Outside the tensor-parallel regions —
LayerNorms and residual adds — plain TP repeats the same work on every rank and stores the same
activations N times.  Korthikanti et al. shard those regions along the *sequence*: each rank holds
t/N positions.  The all-reduce of g becomes a reduce-scatter (sum, and keep my positions), f becomes
an all-gather (collect every position before the column-parallel linear); their backwards swap.
A reduce-scatter plus an all-gather moves the bytes of one all-reduce, so the traffic is unchanged.
LayerNorm weights, row-parallel biases and the position embedding are replicated but each rank now
sees only its positions, so their gradients are partial: :meth:`TensorParallelGPT.
all_reduce_sequence_parallel_grads` sums them after backward (Megatron's
``allreduce_layernorm_grads``).  We keep the gathered input of a column-parallel linear for backward;
Megatron re-gathers it in backward instead (less memory, one more all-gather).

*Sequence length not divisible by N*: we pad.  The embedding's output is padded with zero rows to a
multiple of N before it is reduce-scattered, and the head drops them after its all-gather.  Padded
positions come last, attention is causal, and everything else works position by position, so they
never touch a real position; their loss is never computed, so every gradient they would produce is
exactly zero.

Layout: hidden states are (sequence, batch, hidden) inside the model, as in Megatron, so that a
sequence shard is a contiguous block for the collectives.

Everything talks through a :class:`~minitrain.comm.Comm` passed in (the tensor-parallel group), so
the tracer counts every call, and the layers work in any group — the 3D mesh builds them over its TP
sub-group.  The layers are built from a full single-process layer (each rank cuts its shard of the
deterministic init, as Megatron's ``_initialize_affine_weight_cpu`` does), so a TP run equals one
process, and :func:`full_state_dict` puts the shards back together under the single-process names.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm, all_reduce_coalesced
from ..model import GPT, Attention, Block, Embedding, GPTConfig, Head
from ..strategies import ConfigError, Single, TrainConfig, register

__all__ = ["Split", "padded_size", "shard_tensor", "merge_shards", "f", "g",
           "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel", "sequence_shard",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "TensorParallelGPT", "full_state_dict",
           "shard_checkpoint", "merge_checkpoints", "comm_per_layer", "check_tensor_parallel",
           "TensorParallel"]


# --------------------------------------------------------------------------------------------------
# Cutting a tensor into shards, and putting it back
# --------------------------------------------------------------------------------------------------


class Split(NamedTuple):
    """How a parameter is sharded: along ``dim``, as ``parts`` stacked blocks each cut in N (the
    fused q;k;v: 3), ``size`` entries of the full dimension real (the rest padding), or None."""

    dim: int
    parts: int = 1
    size: int | None = None


def padded_size(size: int, n: int) -> int:
    """``size`` rounded up to a multiple of ``n`` (the vocabulary over N ranks: 13 → 14 for 2)."""
    return math.ceil(size / n) * n


def shard_tensor(full: torch.Tensor, rank: int, n: int, dim: int = 0, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a copy).  With ``parts`` > 1 the dimension is
    ``parts`` stacked blocks (q; k; v) and the rank keeps its slice of each: a rank's heads' rows
    of q, of k and of v."""
    size = full.shape[dim]
    if size % (parts * n):
        raise ValueError(f"dimension {dim} of size {size} does not split into {parts} part(s) over "
                         f"{n} ranks; pad it to a multiple of {parts * n}")
    blocks = full.split(size // parts, dim)
    return torch.cat([b.split(size // parts // n, dim)[rank] for b in blocks], dim).clone()


def merge_shards(shards: list, split: Split) -> torch.Tensor:
    """The inverse of :func:`shard_tensor`: the full tensor from every rank's shard, by rank,
    without the padding."""
    dim, parts = split.dim, split.parts
    pieces = [s.split(s.shape[dim] // parts, dim) for s in shards]
    full = torch.cat([p[k] for k in range(parts) for p in pieces], dim)
    return full if split.size is None else full.narrow(dim, 0, split.size)


def _cut(full: torch.Tensor, comm: Comm, split: Split) -> torch.Tensor:
    """This rank's shard of ``full`` (zero-padded first to a multiple of N when ``split.size`` is
    set: the vocabulary)."""
    full = full.detach()
    if split.size is not None:
        pad = padded_size(full.shape[split.dim], comm.size) - full.shape[split.dim]
        full = torch.cat([full, full.new_zeros(*full.shape[:split.dim], pad,
                                                *full.shape[split.dim + 1:])], split.dim)
    return shard_tensor(full, comm.rank, comm.size, split.dim, split.parts)


def _sharded_param(shape: tuple, split: Split, **factory) -> nn.Parameter:
    """A zero parameter of this rank's shard ``shape``, labelled with ``split`` (how
    :func:`full_state_dict` puts it back together)."""
    p = nn.Parameter(torch.zeros(shape, **factory))
    p.tp_split = split
    return p


def _replicated_param(t: torch.Tensor, sequence_parallel: bool) -> nn.Parameter:
    """A copy of ``t`` on every rank; marked ``sequence_parallel`` when each rank's gradient is
    only its positions' share (summed by ``all_reduce_sequence_parallel_grads``)."""
    p = nn.Parameter(t.detach().clone())
    p.sequence_parallel = sequence_parallel
    return p


# --------------------------------------------------------------------------------------------------
# The communication operators: f and g, and their sequence-parallel versions
# --------------------------------------------------------------------------------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """The paper's **f**: identity forward; backward, all-reduce the gradient (each rank's
    column-parallel linear saw only its columns, so dL/dX is the sum of the ranks' parts)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # never reduce into a buffer autograd may share
        ctx.comm.all_reduce(grad, tag=f"{ctx.tag} backward")
        return grad, None, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """The paper's **g**: all-reduce forward (sum the row-parallel partial products); identity
    backward (every rank needs the whole dL/dZ, and already has it)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        out = x.contiguous().clone()
        comm.all_reduce(out, tag=f"{tag} forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallel's f: all-gather the sequence shards (dim 0) forward; reduce-scatter the
    gradient backward (sum the ranks' parts, keep my positions)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        out = x.new_empty((comm.size * x.shape[0], *x.shape[1:]))
        comm.all_gather(out, x.contiguous(), tag=f"{tag} forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        out = grad.new_empty((grad.shape[0] // comm.size, *grad.shape[1:]))
        comm.reduce_scatter(out, grad.contiguous(), tag=f"{ctx.tag} backward")
        return out, None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallel's g: reduce-scatter forward (sum the partial products, keep my
    positions); all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, tag: str):
        ctx.comm, ctx.tag = comm, tag
        if x.shape[0] % comm.size:
            raise ValueError(f"a sequence of {x.shape[0]} does not split over {comm.size} ranks; "
                             "pad it (see sequence_shard)")
        out = x.new_empty((x.shape[0] // comm.size, *x.shape[1:]))
        comm.reduce_scatter(out, x.contiguous(), tag=f"{tag} forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        out = grad.new_empty((comm.size * grad.shape[0], *grad.shape[1:]))
        comm.all_gather(out, grad.contiguous(), tag=f"{ctx.tag} backward")
        return out, None, None


def f(x: torch.Tensor, comm: Comm, tag: str = "f") -> torch.Tensor:
    """Identity forward, all-reduce backward (nothing to do on one rank)."""
    return x if comm.size == 1 else CopyToTensorParallel.apply(x, comm, tag)


def g(x: torch.Tensor, comm: Comm, tag: str = "g") -> torch.Tensor:
    """All-reduce forward, identity backward (nothing to do on one rank)."""
    return x if comm.size == 1 else ReduceFromTensorParallel.apply(x, comm, tag)


def gather_from_sequence_parallel(x: torch.Tensor, comm: Comm, tag: str = "sp") -> torch.Tensor:
    """All-gather along dim 0 forward, reduce-scatter backward."""
    return x if comm.size == 1 else GatherFromSequenceParallel.apply(x, comm, tag)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, comm: Comm, tag: str = "sp") -> torch.Tensor:
    """Reduce-scatter along dim 0 forward, all-gather backward."""
    return x if comm.size == 1 else ReduceScatterToSequenceParallel.apply(x, comm, tag)


def pad_sequence(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with zero rows appended along dim 0 up to a multiple of ``n``."""
    pad = padded_size(x.shape[0], n) - x.shape[0]
    return x if pad == 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


def sequence_shard(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's positions of a full sequence (dim 0, padded to a multiple of N): no traffic."""
    x = pad_sequence(x, comm.size)
    per = x.shape[0] // comm.size
    return x[comm.rank * per:(comm.rank + 1) * per]


# --------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank keeps ``out_features / N`` outputs (rows of the torch weight), and
    ``f`` (or, sequence parallel, an all-gather of the sequence) makes its input whole.

    ``parts``: the outputs are ``parts`` stacked blocks each split on its own (fused q;k;v: 3).
    ``pad``: round ``out_features`` up to a multiple of N with zero rows (the vocabulary).
    The output stays split (Megatron's ``gather_output=False``): the next layer is row-parallel,
    or the vocabulary-parallel loss.  The weights start at zero; :meth:`from_linear` cuts them
    from a full layer.
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True, *,
                 parts: int = 1, pad: bool = False, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, "column"
        self.in_features, self.out_features = in_features, out_features
        self.split = Split(0, parts, out_features if pad else None)
        padded = padded_size(out_features, comm.size) if pad else out_features
        if padded % (parts * comm.size):
            raise ValueError(f"out_features={out_features} does not split into {parts} part(s) "
                             f"over {comm.size} ranks")
        self.output_size_per_partition = padded // comm.size
        per, factory = self.output_size_per_partition, dict(device=device, dtype=dtype)
        self.weight = _sharded_param((per, in_features), self.split, **factory)
        self.bias = _sharded_param((per,), self.split, **factory) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kwargs) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (the same weights, cut by output)."""
        layer = cls(linear.in_features, linear.out_features, comm, linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            for mine, full in ((layer.weight, linear.weight), (layer.bias, linear.bias)):
                if full is not None:
                    mine.copy_(_cut(full, comm, layer.split))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.comm, self.tag)
        else:
            x = f(x, self.comm, self.tag)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"per rank={self.output_size_per_partition}, tp={self.comm.size}")


class RowParallelLinear(nn.Module):
    """Z = Σ_i X_i B_i: this rank keeps ``in_features / N`` inputs (columns of the torch weight) and
    takes its slice of X as it comes out of a column-parallel layer; ``g`` (or, sequence parallel, a
    reduce-scatter) sums the partial products.  The bias is replicated and added once, after the
    sum (added before, it would be counted N times)."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, "row"
        self.in_features, self.out_features = in_features, out_features
        if in_features % comm.size:
            raise ValueError(f"in_features={in_features} does not split over {comm.size} ranks")
        self.input_size_per_partition = in_features // comm.size
        factory = dict(device=device, dtype=dtype)
        self.weight = _sharded_param((out_features, self.input_size_per_partition), Split(1), **factory)
        self.bias = _replicated_param(torch.zeros(out_features, **factory),
                                      sequence_parallel) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kwargs) -> "RowParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (the same weights, cut by input)."""
        layer = cls(linear.in_features, linear.out_features, comm, linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_cut(linear.weight, comm, Split(1)))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel(partial, self.comm, self.tag)
        else:
            out = g(partial, self.comm, self.tag)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"per rank={self.input_size_per_partition}, tp={self.comm.size}")


class VocabParallelEmbedding(nn.Module):
    """This rank keeps rows [vocab_start, vocab_end) of the (padded) embedding table.  Ids outside
    are looked up as 0 and their vectors zeroed; the partial lookups are summed by ``g`` — or,
    sequence parallel, reduce-scattered along the sequence (padded to a multiple of N first)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, "vocab"
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.split = Split(0, 1, num_embeddings)
        per = padded_size(num_embeddings, comm.size) // comm.size
        self.vocab_start, self.vocab_end = comm.rank * per, (comm.rank + 1) * per
        self.weight = _sharded_param((per, embedding_dim), self.split, device=device, dtype=dtype)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Comm, **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of a full ``nn.Embedding`` (the table padded to a multiple of N)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, comm, device=emb.weight.device,
                    dtype=emb.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_cut(emb.weight, comm, layer.split))
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(pad_sequence(partial, self.comm.size),
                                                       self.comm, self.tag)
        return g(partial, self.comm, self.tag)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per position from this rank's slice of the logits (Megatron's)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, vocab_size: int, comm: Comm, tag: str):
        logits = logits.float()  # fp32 softmax, as loss_fn
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))  # vocabulary padding
        peak = logits.max(dim=-1).values
        if comm.size > 1:
            comm.all_reduce(peak, op=dist.ReduceOp.MAX, tag=f"{tag} forward")
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(dim=-1)])  # one all-reduce for the two sums
        if comm.size > 1:
            comm.all_reduce(both, tag=f"{tag} forward")
        target_logit, sum_exp = both
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax  # d loss / d logit_j = softmax_j - [j is the target]
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 vocab_size: int, comm: Comm, tag: str = "loss") -> torch.Tensor:
    """Per-position cross-entropy when each rank holds the logits of vocabulary ids
    [vocab_start, vocab_start + logits.shape[-1]) — the logits are never gathered.

    ``log Σ_j exp(z_j) - z_target``, stabilised by the max: three all-reduces' worth of numbers per
    position (the max, then the target's logit and the sum of exponentials, in one call).  Columns
    at or past ``vocab_size`` (padding) are left out of the softmax.  Backward needs no traffic:
    each rank's gradient is softmax − one-hot on its own columns.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, comm, tag)


# --------------------------------------------------------------------------------------------------
# The tiny GPT, Megatron-split
# --------------------------------------------------------------------------------------------------


def _layer_norm(ln: nn.LayerNorm, sequence_parallel: bool) -> nn.LayerNorm:
    """A copy of ``ln`` whose parameters are marked for the sequence-parallel gradient sum."""
    out = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    out.weight = _replicated_param(ln.weight, sequence_parallel)
    out.bias = _replicated_param(ln.bias, sequence_parallel)
    return out


class ParallelAttention(nn.Module):
    """Causal self-attention with this rank's ``n_head / N`` heads: Q, K, V column-parallel (its
    heads' rows of q, k and v of the fused ``qkv``), the output projection row-parallel."""

    def __init__(self, attn: Attention, comm: Comm, sequence_parallel: bool):
        super().__init__()
        self.heads = attn.n_head // comm.size
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, comm, parts=3,
                                                    sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(attn.proj, comm, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (t, b, heads · head_dim)
        t, b, width = q.shape
        q, k, v = (z.reshape(t, b, self.heads, width // self.heads).permute(1, 2, 0, 3)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.proj(y.permute(2, 0, 1, 3).reshape(t, b, width))


class ParallelMLP(nn.Module):
    """GeLU(XA)B with A column-parallel and B row-parallel: one sum, at the end."""

    def __init__(self, mlp: nn.Module, comm: Comm, sequence_parallel: bool):
        super().__init__()
        self.fc = ColumnParallelLinear.from_linear(mlp.fc, comm, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(mlp.proj, comm, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    """The pre-LayerNorm block; LayerNorms and residuals run on whole or sequence-sharded input."""

    def __init__(self, block: Block, comm: Comm, sequence_parallel: bool):
        super().__init__()
        self.ln1 = _layer_norm(block.ln1, sequence_parallel)
        self.attn = ParallelAttention(block.attn, comm, sequence_parallel)
        self.ln2 = _layer_norm(block.ln2, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, comm, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel token embedding plus the (replicated) position embedding; (b, t) ids in,
    (t, b, d) out — or, sequence parallel, this rank's t/N positions (padded)."""

    def __init__(self, embed: Embedding, comm: Comm, sequence_parallel: bool):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.tok = VocabParallelEmbedding.from_embedding(embed.tok, comm,
                                                         sequence_parallel=sequence_parallel)
        self.pos = nn.Embedding(embed.pos.num_embeddings, embed.pos.embedding_dim)
        self.pos.weight = _replicated_param(embed.pos.weight, sequence_parallel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.pos.weight[:idx.shape[1]].unsqueeze(1)  # (t, 1, d)
        if self.sequence_parallel:
            pos = sequence_shard(pos, self.comm)  # my positions only: a partial gradient
        return self.tok(idx.t()) + pos


class ParallelHead(nn.Module):
    """Final LayerNorm, then the output layer column-parallel over the padded vocabulary."""

    def __init__(self, head: Head, comm: Comm, sequence_parallel: bool):
        super().__init__()
        self.ln = _layer_norm(head.ln, sequence_parallel)
        self.out = ColumnParallelLinear.from_linear(head.out, comm, pad=True,
                                                    sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        return self.out(self.ln(x))[:seq_len]  # sequence parallel: drop the padded positions


class TensorParallelGPT(nn.Module):
    """This rank's shard of ``model`` (a :class:`~minitrain.model.GPT`) over ``comm``'s ranks.

    Parameter names are the single-process ones (``blocks.0.attn.qkv.weight`` …), holding shards;
    :func:`full_state_dict` gathers them.  ``forward(idx, targets)`` returns the mean loss — the
    same number on every rank; without targets, this rank's slice of the logits, (t, b, V/N).
    Every collective is tagged with the module that made it (``"blocks.0.mlp.proj forward"``), so
    :func:`comm_per_layer` can count them.
    """

    def __init__(self, model: GPT, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        check_tensor_parallel(model.cfg, comm.size)
        self.cfg, self.comm, self.sequence_parallel = model.cfg, comm, sequence_parallel
        self.embed = ParallelEmbedding(model.embed, comm, sequence_parallel)
        self.blocks = nn.ModuleList(ParallelBlock(b, comm, sequence_parallel) for b in model.blocks)
        self.head = ParallelHead(model.head, comm, sequence_parallel)
        if model.cfg.tie_weights:  # both split the vocabulary the same way: share the shard
            self.head.out.weight = self.embed.tok.weight
        for name, module in self.named_modules():
            if hasattr(module, "tag"):
                module.tag = name

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x, idx.shape[1])
        if targets is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, targets.t(), self.head.out.weight.shape[0]
                                            * self.comm.rank, self.cfg.vocab_size, self.comm)
        return loss.mean()

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if getattr(p, "sequence_parallel", False)]

    def all_reduce_sequence_parallel_grads(self) -> None:
        all_reduce_sequence_parallel_grads(self, self.comm)


def all_reduce_sequence_parallel_grads(module: nn.Module, comm: Comm) -> None:
    """Sequence parallel: sum, over the TP ranks of ``comm``, the gradients of ``module``'s
    replicated parameters that saw only this rank's positions (LayerNorms, row-parallel biases,
    positions) — one all-reduce of them all, after backward and before the optimizer step."""
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    all_reduce_coalesced(grads, comm, tag="sequence-parallel-grads backward")


@torch.no_grad()
def full_state_dict(model: nn.Module, comm: Comm) -> dict:
    """The single-process state_dict of a tensor-parallel model: every shard all-gathered and put
    back together (padding dropped), replicated tensors as they are.  A collective: every rank of
    ``comm`` must call it; untraced (it is not training traffic)."""
    out = {}
    with comm.tracer.paused():
        for name, t in model.state_dict(keep_vars=True).items():
            split = getattr(t, "tp_split", None)
            t = t.detach()
            if split is not None:
                gathered = t.new_empty((comm.size * t.shape[0], *t.shape[1:]))
                comm.all_gather(gathered, t.contiguous())
                t = merge_shards(list(gathered.chunk(comm.size)), split)
            out[name] = t.clone()
    return out


def shard_checkpoint(*modules: nn.Module) -> dict:
    """This rank's tensor-parallel shards of ``modules`` for a checkpoint file, under their
    state_dict names: ``{"model": {name: tensor}, "splits": {name: [dim, parts, size] or None}}``
    — how :func:`merge_checkpoints` puts the ranks' shards back together, offline (None:
    replicated, every rank holds it whole)."""
    model, splits = {}, {}
    for module in modules:
        for name, t in module.state_dict(keep_vars=True).items():
            model[name] = t.detach().clone()
            split = getattr(t, "tp_split", None)
            splits[name] = list(split) if split is not None else None
    return {"model": model, "splits": splits}


def merge_checkpoints(states: list[dict]) -> dict:
    """The single-process tensors from every tensor rank's :func:`shard_checkpoint`, in rank
    order: shards merged (padding dropped), replicated tensors from rank 0."""
    first = states[0]
    return {name: merge_shards([s["model"][name] for s in states], Split(*split)).clone()
            if (split := first["splits"][name]) is not None else t
            for name, t in first["model"].items()}


def comm_per_layer(events, steps: int = 1) -> dict:
    """Collectives per step, by where they were made and in which pass: ``{"blocks.0":
    {"all_reduce forward": {"calls", "bytes", "sent_bytes"}, ...}, "embed": ..., "head": ...,
    "loss": ..., "sequence-parallel-grads": ...}`` from a tracer's events (tags as the model's)."""
    rows: dict = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0, "sent_bytes": 0.0}))
    for e in events:
        where, _, direction = e.tag.rpartition(" ")
        parts = where.split(".")
        group = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        row = rows[group][f"{e.op} {direction}"]
        row["calls"] += 1
        row["bytes"] += e.bytes
        row["sent_bytes"] += e.sent_bytes
    return {group: {key: {k: v / steps for k, v in row.items()} for key, row in ops.items()}
            for group, ops in rows.items()}


# --------------------------------------------------------------------------------------------------
# The strategy for `minitrain train`
# --------------------------------------------------------------------------------------------------


def check_tensor_parallel(model: GPTConfig, tp: int) -> None:
    """Raise :class:`ConfigError`, naming the fix, if ``model`` cannot be split over ``tp`` ranks."""
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    h, d, ff = model.n_head, model.d_model, model.ff
    if h % tp:
        heads = tp * math.ceil(h / tp)
        able = [k for k in range(1, h + 1) if h % k == 0]
        raise ConfigError(f"n_head={h} does not split over --tp {tp}: each rank computes whole "
                          f"attention heads; use --tp {', '.join(map(str, able))}, or --n-head "
                          f"{heads} --d-model {heads * (d // h)} (a multiple of {tp} heads)")
    if ff % tp:
        raise ConfigError(f"d_ff={ff} does not split over --tp {tp}: the MLP's columns are divided "
                          f"among the ranks; use a d_ff that is a multiple of {tp} (e.g. "
                          f"{tp * math.ceil(ff / tp)})")


@register
class TensorParallel(Single):
    """The single-process loop on this rank's shard of the model: every rank holds 1/N of every
    layer and sees the whole batch; the loss is the same number on all of them."""

    name = "tensor"
    help = ("tensor parallel (Megatron): heads, MLP and vocabulary split over --tp ranks "
            "(--sequence-parallel)")
    precisions = ("fp32",)
    checkpointing = False  # recomputing a block would re-run its collectives; not supported

    @classmethod
    def add_arguments(cls, parser) -> None:
        parser.add_argument("--tp", type=int, default=None,
                            help="tensor: tensor-parallel size (default and only choice: world size)")
        parser.add_argument("--sequence-parallel", action="store_true",
                            help="tensor: shard LayerNorms and residuals along the sequence "
                                 "(reduce-scatter + all-gather instead of all-reduce)")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        super(Single, cls).check(cfg)  # Strategy's checks; Single's one-rank rule does not apply
        tp = cfg.options.get("tp") or cfg.world_size
        if tp != cfg.world_size:
            raise ConfigError(f"--tp {tp} must equal --world-size {cfg.world_size} (strategy "
                              f"'tensor' is tensor parallel only); use --world-size {tp} or leave "
                              "--tp out")
        check_tensor_parallel(cfg.model, tp)

    def __init__(self, cfg: TrainConfig, comm: Comm):
        self.sequence_parallel = bool(cfg.options.get("sequence_parallel", False))
        super().__init__(cfg, comm)  # Single's: model from build_model(), meter, Adam

    def build_model(self) -> TensorParallelGPT:
        """This rank's shard of the full, deterministically initialised GPT."""
        return TensorParallelGPT(super().build_model(), self.comm, self.sequence_parallel)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self.sequence_parallel:
            self.model.all_reduce_sequence_parallel_grads()

    def fit(self, data, on_step=None):
        out = super().fit(data, on_step)
        state = full_state_dict(self.model, self.comm)  # untraced
        self._state = state if self.comm.rank == 0 else None
        return out

    def state_dict(self) -> dict:
        """The full model, single-process names and shapes, gathered at the end of :meth:`fit`."""
        if getattr(self, "_state", None) is None:
            raise RuntimeError("tensor gathers the full state at the end of fit(), on rank 0 only")
        return self._state

    # -- checkpoints (lesson 08): each rank saves its shards and their Adam states ----------------
    checkpoint_refusal = None  # declared again: the state is in shards, not in Single's replica

    @classmethod
    def checkpoint_layout(cls, cfg: TrainConfig) -> dict:
        return {"tp": cfg.options.get("tp") or cfg.world_size}

    def checkpoint_state(self) -> dict:
        return {**shard_checkpoint(self.model), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, read) -> None:
        state = read(self.comm.rank)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def consolidate_checkpoint(cls, cfg: TrainConfig, read) -> dict:
        return merge_checkpoints([read(r) for r in range(cfg.world_size)])

    def report(self) -> dict:
        """Shard shapes and the collectives per step by layer and pass (:func:`comm_per_layer`)."""
        return {
            "tp": self.comm.size, "sequence_parallel": self.sequence_parallel,
            "heads_per_rank": self.model.blocks[0].attn.heads if len(self.model.blocks) else None,
            "vocab_padded": self.model.head.out.weight.shape[0] * self.comm.size,
            "shapes": {k: list(v.shape) for k, v in self.model.state_dict().items()},
            "comm_per_layer": comm_per_layer(self.comm.tracer.events, self.cfg.steps),
        }
