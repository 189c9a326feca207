"""Tensor parallelism (Megatron-style) and sequence parallelism, from scratch (lesson 06).

Papers: Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" — column/row-parallel linears, the conjugate operators f and g, attention split by
heads, the vocabulary-parallel embedding and cross-entropy; Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models" — sequence parallelism (f and g become an
all-gather and a reduce-scatter along the sequence).

Hidden states are (sequence, batch, hidden), as in Megatron.  Every layer talks through a
:class:`~minitrain.comm.Comm` passed in (the tensor-parallel group) and is cut from a full
single-process layer, so a tensor-parallel run equals one process; parameter names are the
single-process ones and each shard carries its :class:`Split`.  The GPT assembled from these layers
is :mod:`minitrain.parallel.tensor_gpt`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from .errors import ParameterError

__all__ = ["Split", "padded_size", "shard_tensor", "merge_shards", "f", "g",
           "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel", "sequence_shard",
           "ColumnParallelLinear", "VocabParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "vocab_parallel_loss"]


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
    The output stays split (Megatron's ``gather_output=False``): the next layer is row-parallel,
    or the vocabulary-parallel loss.  The weights start at zero; :meth:`from_linear` cuts them
    from a full layer.

    ``column_parallel_linear``: an autograd Function whose ``apply(x, weight, bias, comm)`` is
    this layer with its f (lesson 06's exercise).  None: the package's, :meth:`linear` — ``f``
    (or, sequence parallel, the all-gather) then ``F.linear``; a function of one's own not with
    sequence parallelism (its f is an all-gather).
    """

    pad = False  # round out_features up to a multiple of N with zero rows: VocabParallelLinear

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True, *,
                 parts: int = 1, sequence_parallel: bool = False, column_parallel_linear=None,
                 device=None, dtype=None):
        super().__init__()
        if column_parallel_linear is not None and sequence_parallel:
            raise ValueError("column_parallel_linear= replaces f and the linear; sequence "
                             "parallelism gathers the sequence instead: use one or the other")
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, "column"
        self.column_parallel_linear = column_parallel_linear  # None: self.linear
        self.in_features, self.out_features = in_features, out_features
        self.split = Split(0, parts, out_features if self.pad else None)
        padded = padded_size(out_features, comm.size) if self.pad else out_features
        if padded % (parts * comm.size):
            raise ParameterError(f"{{}} does not split into {parts} part(s) over {comm.size} ranks",
                                 ("out_features", out_features))
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
        if self.column_parallel_linear is not None:
            return self.column_parallel_linear.apply(x, self.weight, self.bias, self.comm)
        return self.linear(x, self.weight, self.bias, self.comm)

    def linear(self, x, weight, bias, comm: Comm) -> torch.Tensor:
        """The package's column-parallel linear, in the shape of ``column_parallel_linear.apply``:
        f (the input whole on every rank; its gradient summed in backward), then X·A_iᵀ + b_i."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, comm, self.tag)
        else:
            x = f(x, comm, self.tag)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"per rank={self.output_size_per_partition}, tp={self.comm.size}")


class VocabParallelLinear(ColumnParallelLinear):
    """The output layer over the vocabulary: a :class:`ColumnParallelLinear` whose
    ``out_features`` (the vocabulary) is rounded up to a multiple of N with zero rows, as
    :class:`VocabParallelEmbedding`'s table is, so that the two can share a shard (tied weights).
    The padding's logits are left out of the softmax (:func:`vocab_parallel_cross_entropy`)."""

    pad = True


class RowParallelLinear(nn.Module):
    """Z = Σ_i X_i B_i: this rank keeps ``in_features / N`` inputs (columns of the torch weight) and
    takes its slice of X as it comes out of a column-parallel layer; ``g`` (or, sequence parallel, a
    reduce-scatter) sums the partial products.  The bias is replicated and added once, after the
    sum (added before, it would be counted N times).

    ``row_parallel_linear``: an autograd Function whose ``apply(x, weight, bias, comm)`` is this
    layer with its g — X_r B_rᵀ all-reduced forward, plus the bias; identity on dL/dZ backward
    (lesson 06's exercise).  None: the package's, :meth:`linear`; a function of one's own not with
    sequence parallelism.
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, bias: bool = True, *,
                 sequence_parallel: bool = False, row_parallel_linear=None, device=None,
                 dtype=None):
        super().__init__()
        if row_parallel_linear is not None and sequence_parallel:
            raise ValueError("row_parallel_linear= replaces the linear and g; sequence parallelism "
                             "reduce-scatters instead: use one or the other")
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, "row"
        self.row_parallel_linear = row_parallel_linear  # None: self.linear
        self.in_features, self.out_features = in_features, out_features
        if in_features % comm.size:
            raise ParameterError(f"{{}} does not split over {comm.size} ranks",
                                 ("in_features", in_features))
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
        if self.row_parallel_linear is not None:
            return self.row_parallel_linear.apply(x, self.weight, self.bias, self.comm)
        return self.linear(x, self.weight, self.bias, self.comm)

    def linear(self, x, weight, bias, comm: Comm) -> torch.Tensor:
        """The package's row-parallel linear, in the shape of ``row_parallel_linear.apply``:
        X_r·B_rᵀ, g (or, sequence parallel, the reduce-scatter) sums the ranks' partial products,
        then the bias."""
        partial = F.linear(x, weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel(partial, comm, self.tag)
        else:
            out = g(partial, comm, self.tag)
        return out if bias is None else out + bias

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


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                        comm: Comm, vocab_parallel_cross_entropy=None) -> torch.Tensor:
    """Mean cross-entropy of (t, b, V/N) logits, this rank's slice of the vocabulary, against
    (b, t) targets.  ``vocab_parallel_cross_entropy``: an autograd Function whose
    ``apply(logits, target, vocab_start, vocab_size, comm)`` is the per-position loss (lesson 06's
    exercise; None: the package's, :func:`vocab_parallel_cross_entropy`)."""
    start, targets = logits.shape[-1] * comm.rank, targets.t()
    if vocab_parallel_cross_entropy is not None:
        return vocab_parallel_cross_entropy.apply(logits, targets, start, vocab_size, comm).mean()
    return _VocabParallelCrossEntropy.apply(logits, targets, start, vocab_size, comm, "loss").mean()
