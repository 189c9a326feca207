"""Gradient compression with error feedback, for DDP and the parameter server (lesson 03).

Seed 002 §3.4: when the network is the bottleneck, send fewer bytes — sparsify or quantise the
gradients.  What goes on the wire here is the compressed payload itself, so the tracer's byte counts
are the real saving:

* ``topk:RATIO`` — the k = RATIO·n largest-magnitude entries, as int32 indices + fp32 values
  (Lin et al., 2018, "Deep Gradient Compression");
* ``int8`` — entries scaled by max|x|/127 and rounded to int8, plus one fp32 scale;
* ``sign`` — one bit per entry, packed 8 to a byte, times one fp32 scale mean|x|
  (Seide et al., 2014, "1-bit SGD"; Bernstein et al., 2018, "signSGD");
* ``powersgd:RANK`` — a rank-r factorisation M ≈ P Qᵀ by one step of power iteration, warm-started
  from the previous step's Q (Vogels et al., 2019, "PowerSGD").

**Error feedback** (Karimireddy et al., 2019, "Error Feedback Fixes SignSGD"): what compression
dropped is kept in a residual and added to the next gradient, so nothing is lost for good — the sum
of everything sent plus the current residual equals the sum of the raw gradients.

``Compressor.compress`` returns a list of tensors (the payload); ``decompress`` rebuilds a dense
tensor.  ``ErrorFeedback`` wraps one compressor with per-tensor residuals.  ``compressed_all_reduce``
averages a tensor over a communicator by all-gathering the payloads (sparse and quantised payloads
cannot be summed on the wire), or, for PowerSGD, by all-reducing P and Q.
"""

from __future__ import annotations

import abc
import math

import torch

from ..comm import Comm

__all__ = ["Compressor", "TopK", "Int8", "Sign", "PowerSGD", "ErrorFeedback", "parse_compressor",
           "compressed_all_reduce", "payload_bytes"]


def payload_bytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


class Compressor(abc.ABC):
    """Turns a flat fp32 tensor into a payload (list of tensors) and back."""

    name = ""

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, key=None) -> list[torch.Tensor]:
        """The payload for flat tensor ``x`` (``key`` names the tensor, for stateful compressors)."""

    @abc.abstractmethod
    def decompress(self, payload: list[torch.Tensor], n: int) -> torch.Tensor:
        """A dense flat tensor of ``n`` entries from a payload."""

    @abc.abstractmethod
    def layout(self, n: int) -> list[tuple[tuple, torch.dtype]]:
        """Shapes and dtypes of the payload for ``n`` entries (receivers allocate from this)."""

    def __repr__(self) -> str:
        return self.name


class TopK(Compressor):
    def __init__(self, ratio: float):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.name = f"topk:{ratio:g}"

    def k(self, n: int) -> int:
        return max(1, math.ceil(self.ratio * n))

    def compress(self, x, key=None):
        idx = x.abs().topk(self.k(x.numel()), sorted=False).indices
        return [idx.to(torch.int32), x[idx]]

    def decompress(self, payload, n):
        idx, values = payload
        return torch.zeros(n, dtype=values.dtype).index_put_((idx.long(),), values, accumulate=True)

    def layout(self, n):
        return [((self.k(n),), torch.int32), ((self.k(n),), torch.float32)]


class Int8(Compressor):
    name = "int8"

    def compress(self, x, key=None):
        scale = x.abs().max() / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return [torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale.reshape(1)]

    def decompress(self, payload, n):
        q, scale = payload
        return q.to(torch.float32) * scale

    def layout(self, n):
        return [((n,), torch.int8), ((1,), torch.float32)]


_BITS = 2 ** torch.arange(8, dtype=torch.uint8)


class Sign(Compressor):
    name = "sign"

    def compress(self, x, key=None):
        n = x.numel()
        bits = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8)
        bits[:n] = (x >= 0).to(torch.uint8)
        packed = (bits.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)
        return [packed, x.abs().mean().reshape(1)]

    def decompress(self, payload, n):
        packed, scale = payload
        bits = (packed.unsqueeze(1) & _BITS).ne(0).view(-1)[:n]
        return (bits.to(torch.float32) * 2 - 1) * scale

    def layout(self, n):
        return [((math.ceil(n / 8),), torch.uint8), ((1,), torch.float32)]


class PowerSGD(Compressor):
    """Rank-r approximation of the tensor seen as a near-square matrix (padded with zeros)."""

    def __init__(self, rank: int, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.seed = rank, seed
        self.name = f"powersgd:{rank}"
        self._q: dict = {}

    @staticmethod
    def shape(n: int) -> tuple[int, int]:
        rows = math.ceil(math.sqrt(n))
        return rows, math.ceil(n / rows)

    def matrix(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.shape(x.numel())
        m = torch.zeros(rows * cols, dtype=x.dtype)
        m[: x.numel()] = x
        return m.view(rows, cols)

    def initial_q(self, key, cols: int) -> torch.Tensor:
        if key not in self._q:
            gen = torch.Generator().manual_seed(self.seed)
            self._q[key] = torch.randn(cols, min(self.rank, cols), generator=gen)
        return self._q[key]

    def compress(self, x, key=None):
        m = self.matrix(x)
        p = m @ self.initial_q(key, m.shape[1])
        p = torch.linalg.qr(p).Q
        q = m.t() @ p
        self._q[key] = q
        return [p, q]

    def decompress(self, payload, n):
        p, q = payload
        return (p @ q.t()).reshape(-1)[:n]

    def layout(self, n):
        rows, cols = self.shape(n)
        r = min(self.rank, cols)
        return [((rows, r), torch.float32), ((cols, r), torch.float32)]


def parse_compressor(spec: str | None) -> Compressor | None:
    """``"topk:0.01"``, ``"int8"``, ``"sign"``, ``"powersgd:4"`` (or None/"none") → a Compressor."""
    if spec in (None, "", "none"):
        return None
    name, _, arg = spec.partition(":")
    try:
        if name == "topk":
            return TopK(float(arg))
        if name == "int8" and not arg:
            return Int8()
        if name == "sign" and not arg:
            return Sign()
        if name == "powersgd":
            return PowerSGD(int(arg))
    except ValueError as exc:
        raise ValueError(f"bad --compress {spec!r}: {exc}") from None
    raise ValueError(f"unknown --compress {spec!r}; use topk:RATIO (e.g. topk:0.01), int8, sign or "
                     "powersgd:RANK (e.g. powersgd:4)")


class ErrorFeedback:
    """A compressor plus per-tensor residuals: send C(g + e), keep e ← (g + e) − D(C(g + e))."""

    def __init__(self, compressor: Compressor, enabled: bool = True):
        self.compressor, self.enabled = compressor, enabled
        self.residual: dict = {}

    def compress(self, x: torch.Tensor, key) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Payload for ``x`` and what the receiver will rebuild from it."""
        corrected = x + self.residual[key] if self.enabled and key in self.residual else x
        payload = self.compressor.compress(corrected, key)
        sent = self.compressor.decompress(payload, x.numel())
        if self.enabled:
            self.residual[key] = corrected - sent
        return payload, sent


def compressed_all_reduce(x: torch.Tensor, comm: Comm, ef: ErrorFeedback, key) -> torch.Tensor:
    """Average flat ``x`` over ``comm``'s ranks, sending only compressed payloads; in place."""
    n = comm.size
    if isinstance(ef.compressor, PowerSGD):
        return _powersgd_all_reduce(x, comm, ef, key)
    payload, _ = ef.compress(x, key)
    total = torch.zeros_like(x)
    gathered = []
    for part in payload:
        out = torch.empty((n,) + tuple(part.shape), dtype=part.dtype)
        comm.all_gather(out, part.contiguous(), tag=f"compressed:{ef.compressor.name}")
        gathered.append(out)
    for r in range(n):
        total += ef.compressor.decompress([g[r] for g in gathered], x.numel())
    return x.copy_(total / n)


def _powersgd_all_reduce(x, comm: Comm, ef: ErrorFeedback, key):
    """PowerSGD's two all-reduces: P = mean(M Q), orthogonalised; Q = mean(Mᵀ P); M ≈ P Qᵀ."""
    ps: PowerSGD = ef.compressor
    corrected = x + ef.residual[key] if ef.enabled and key in ef.residual else x.clone()
    m = ps.matrix(corrected)
    p = m @ ps.initial_q(key, m.shape[1])
    comm.all_reduce(p, tag="compressed:powersgd-P")
    p = torch.linalg.qr(p / comm.size).Q
    q = m.t() @ p
    comm.all_reduce(q, tag="compressed:powersgd-Q")
    q /= comm.size
    ps._q[key] = q
    mean = (p @ q.t()).reshape(-1)[: x.numel()]
    if ef.enabled:
        # this rank's share of what was sent: its own projection onto the common P
        ef.residual[key] = corrected - (p @ (m.t() @ p).t()).reshape(-1)[: x.numel()]
    return x.copy_(mean)
