"""Context parallelism: each rank holds 1/N of the sequence; attention by ring (lesson 09).

Ring attention (Liu, Zaharia and Abbeel, 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; Brandon et al., 2023, "Striped Attention" for causal load balance): the
queries stay put, the key/value blocks travel around the ring of ranks, and each rank merges the
partial attention of its queries over each block it sees with the online-softmax rescale (Milakov
and Gimelshein, 2018, "Online normalizer calculation for softmax"; Dao et al., 2022,
"FlashAttention").  The next block's transfer is posted before the current block is computed, so
the two overlap.  Backward runs the same ring: the key/value blocks travel again, each carrying the
dK/dV its visitors added, and one last hop takes the sums home.

Causal load balance: the (padded) sequence is cut into 2N chunks and rank r holds chunk r and its
mirror 2N-1-r, so every rank does the same amount of unmasked work at every ring step.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm

__all__ = ["merge_attention", "block_attention", "RingAttention", "ring_attention",
           "balanced_layout", "contiguous_layout", "sequence_piece", "ring_work",
           "RingSelfAttention", "context_parallel_", "local_forward", "ring_bytes_per_layer"]


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over disjoint key sets (the online-softmax rescale).

    ``out_x`` (…, L, D) is softmax-weighted over its own keys only, ``lse_x`` (…, L) the
    log-sum-exp of its scores.  The merged result is each part re-weighted by its share of the
    total mass, exp(lse_x - lse); a row one part never saw (lse = -inf) gets weight 0.
    Returns ``(out, lse)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def _mask(pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
    return pos_q.unsqueeze(-1) >= pos_k.unsqueeze(-2)  # causal: a query sees keys at or before it


def block_attention(q, k, v, pos_q, pos_k):
    """Causal attention of queries ``q`` over one key/value block: ``(out, lse)``; rows that see
    none of the block get out = 0 and lse = -inf."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~_mask(pos_q, pos_k), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe.unsqueeze(-1))
    return p @ v, lse


def _exchange(comm: Comm, tensor: torch.Tensor, channel: int, tag: str):
    """Post, in one exchange: send ``tensor`` to the right neighbour, receive the left one's into a
    new buffer (each rank sends and receives at once: posted apart, two neighbours that both sent
    first would wait for each other on NCCL)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = torch.empty_like(tensor)
    works = comm.exchange([(tensor, right, channel)], [(incoming, left, channel)], tag=tag)
    return incoming, works


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys/values, by ring.

    ``positions`` is an (N, L) tensor: row j holds the global positions of rank j's tokens.
    ``online_softmax_merge(out_a, lse_a, out_b, lse_b)`` merges two blocks' partial attention
    (lesson 09's exercise; None: :func:`merge_attention`).  Saves only q, k, v, out and lse (O(L)
    per rank, never an L x T score matrix).
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, comm, online_softmax_merge):
        n, r = comm.size, comm.rank
        merge = online_softmax_merge or merge_attention
        positions = positions.to(q.device)  # the masks are built beside the scores
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for s in range(n):
            src = (r - s) % n
            if s < n - 1:  # post the next block's transfer before computing on this one
                nxt, works = _exchange(comm, kv, 1, "cp kv forward")
            o, l = block_attention(q, kv[0], kv[1], positions[r], positions[src])
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
            if s < n - 1:
                for w in works:
                    w.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.comm = positions, comm
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        comm, positions = ctx.comm, ctx.positions
        n, r = comm.size, comm.rank
        scale = 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)  # the dK/dV travelling with the block we hold
        for s in range(n):
            src = (r - s) % n
            if s < n - 1:
                nxt, works = _exchange(comm, kv, 2, "cp kv backward")
            kb, vb = kv[0], kv[1]
            scores = (q @ kb.transpose(-2, -1)) * scale
            scores = scores.masked_fill(~_mask(positions[r], positions[src]), float("-inf"))
            p = torch.exp(scores - safe)
            dp = dout @ vb.transpose(-2, -1)
            ds = p * (dp - delta)
            dq += (ds @ kb) * scale
            dkv[0] += (ds.transpose(-2, -1) @ q) * scale
            dkv[1] += p.transpose(-2, -1) @ dout
            if n > 1:  # the block's dK/dV goes on with it (after the last step: home to its owner)
                dkv, dworks = _exchange(comm, dkv.contiguous(), 3, "cp dkv backward")
                for w in dworks:
                    w.wait()
            if s < n - 1:
                for w in works:
                    w.wait()
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(q, k, v, positions, comm: Comm, online_softmax_merge=None):
    """Causal ring attention, differentiable (:class:`RingAttention`); returns the output only.
    With one rank it is plain causal attention over the rank's own tokens."""
    return RingAttention.apply(q, k, v, positions, comm, online_softmax_merge)[0]


def balanced_layout(seq_len: int, n: int) -> tuple[int, torch.Tensor]:
    """The load-balanced split of a sequence of ``seq_len`` over ``n`` ranks.

    The sequence is padded to the next multiple of 2n and cut into 2n chunks; rank r holds chunks
    r and 2n-1-r.  Returns ``(padded_len, positions)`` with positions an (n, padded_len/n) tensor of
    the global positions each rank holds.  Padding sits at the end: causal attention keeps every
    real token from seeing it, and its loss is masked out.
    """
    padded = 2 * n * math.ceil(seq_len / (2 * n))
    c = padded // (2 * n)
    rows = [torch.cat([torch.arange(r * c, (r + 1) * c, device="cpu"),  # a host table
                       torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c, device="cpu")])
            for r in range(n)]
    return padded, torch.stack(rows)


def sequence_piece(x: torch.Tensor, y: torch.Tensor, padded: int, positions: torch.Tensor):
    """This rank's tokens of a batch of (b, t) ids ``x`` and targets ``y``: both padded at the end
    to ``padded`` (ids 0; targets -100, which no loss counts), then the columns at ``positions``
    (this rank's row of a layout)."""
    pad = padded - x.shape[1]
    x, y = F.pad(x, (0, pad), value=0), F.pad(y, (0, pad), value=-100)
    return x[:, positions], y[:, positions]


class RingSelfAttention(nn.Module):
    """The model's :class:`~minitrain.model.Attention` with ring attention inside: the same ``qkv``
    and ``proj`` parameters (so the same state_dict names), this rank's tokens in and out."""

    def __init__(self, attn: nn.Module, comm: Comm, online_softmax_merge=None):
        super().__init__()
        self.n_head, self.qkv, self.proj = attn.n_head, attn.qkv, attn.proj
        self.comm, self.online_softmax_merge = comm, online_softmax_merge
        self.positions: torch.Tensor | None = None  # set by local_forward for each batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2).contiguous()
                   for z in (q, k, v))
        y = ring_attention(q, k, v, self.positions, self.comm, self.online_softmax_merge)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def context_parallel_(model: nn.Module, comm: Comm, online_softmax_merge=None) -> nn.Module:
    """Swap every block's attention for :class:`RingSelfAttention` in place (state_dict names
    unchanged); returns the model."""
    for block in model.blocks:
        block.attn = RingSelfAttention(block.attn, comm, online_softmax_merge)
    return model


def local_forward(model: nn.Module, idx: torch.Tensor, positions: torch.Tensor,
                  rank: int) -> torch.Tensor:
    """Logits for this rank's tokens ``idx`` (b, L) of a context-parallel GPT: position embeddings
    at the tokens' global positions (padding clamped to the last real position)."""
    pos = positions[rank].clamp(max=model.embed.pos.num_embeddings - 1).to(idx.device)
    x = model.embed.tok(idx) + model.embed.pos(pos)
    for block in model.blocks:
        block.attn.positions = positions
        x = block(x)
    return model.head(x)


def ring_work(positions: torch.Tensor) -> list[list[int]]:
    """Unmasked (query, key) pairs rank r computes at ring step s (it holds rank r-s's block):
    equal along each row and column for the balanced layout, lopsided for a contiguous one."""
    n = positions.shape[0]
    return [[int(_mask(positions[r], positions[(r - s) % n]).sum()) for s in range(n)]
            for r in range(n)]


def contiguous_layout(seq_len: int, n: int) -> tuple[int, torch.Tensor]:
    """The naive split (rank r holds the r-th 1/N of the sequence), for comparison."""
    padded = n * math.ceil(seq_len / n)
    return padded, torch.arange(padded, device="cpu").view(n, -1)  # a host table


def ring_bytes_per_layer(batch: int, local_tokens: int, d_model: int, n: int,
                         itemsize: int = 4) -> dict:
    """Bytes one rank sends per layer per step: forward N-1 key/value blocks, backward N-1 again
    plus N dK/dV blocks (the last hop takes them home).  A block is 2·b·L·d values."""
    block = 2 * batch * local_tokens * d_model * itemsize
    return {"forward": (n - 1) * block, "backward": (2 * n - 1) * block,
            "total": (3 * n - 2) * block} if n > 1 else {"forward": 0, "backward": 0, "total": 0}
