"""Gradient compression with error feedback, for DDP and the parameter server (lesson 03).

Papers: Lin et al., 2018, "Deep Gradient Compression" (top-k); Alistarh et al., 2017, "QSGD"
(quantisation; ``int8`` here is its deterministic cousin); Seide et al., 2014, "1-Bit Stochastic
Gradient Descent" and Bernstein et al., 2018, "signSGD" (``sign``); Vogels et al., 2019, "PowerSGD";
Karimireddy et al., 2019, "Error Feedback Fixes SignSGD" (error feedback).  The compressed payload
itself goes on the wire, so the tracer's bytes are the real saving.  Sparse and quantised payloads
cannot be summed on the wire: :func:`compressed_all_reduce` all-gathers them and every rank adds
them up; PowerSGD's factors are all-reduced (its residual is M_r − P Pᵀ M_r, Vogels et al., Alg. 2).
"""

from __future__ import annotations

import abc
import math

import torch

from ..comm import Comm
from ..device import on_device
from .errors import ParameterError

__all__ = ["Compressor", "TopK", "Int8", "Sign", "PowerSGD", "ErrorFeedback", "parse_compressor",
           "as_error_feedback", "topk_error_feedback", "compressed_all_reduce", "payload_bytes",
           "FORMS"]

FORMS = "topk:RATIO (e.g. topk:0.01), int8, sign or powersgd:RANK (e.g. powersgd:4)"


def payload_bytes(payload: list[torch.Tensor]) -> int:
    """Bytes of a payload (what it costs on the wire)."""
    return sum(t.numel() * t.element_size() for t in payload)


def _flat32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).to(torch.float32)


class Compressor(abc.ABC):
    """Turns a flat tensor of n ≥ 1 entries into a payload (list of tensors) and back."""

    name = ""

    @abc.abstractmethod
    def compress(self, x: torch.Tensor, key=None) -> list[torch.Tensor]:
        """The payload for flat tensor ``x`` (``key`` names the tensor for stateful ones)."""

    @abc.abstractmethod
    def decompress(self, payload: list[torch.Tensor], n: int) -> torch.Tensor:
        """A dense flat fp32 tensor of ``n`` entries from a payload."""

    @abc.abstractmethod
    def layout(self, n: int) -> list[tuple[tuple, torch.dtype]]:
        """Shapes and dtypes of the payload for ``n`` entries (receivers allocate from this)."""

    def add_to(self, out: torch.Tensor, payload: list[torch.Tensor]) -> None:
        """``out += decompress(payload)`` (a receiver summing the ranks' payloads)."""
        out += self.decompress(payload, out.numel())

    def nbytes(self, n: int) -> int:
        """Bytes of the payload for ``n`` entries."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.layout(n))

    def __repr__(self) -> str:
        return self.name


class TopK(Compressor):
    def __init__(self, ratio: float):
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.name = f"topk:{ratio:g}"

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(round(self.ratio * n, 6))))  # round: 0.07·100 is 7.000…01

    def compress(self, x, key=None):
        x = _flat32(x)
        idx = x.abs().topk(self.k(x.numel()), sorted=False).indices
        return [idx.to(torch.int32), x[idx]]

    def decompress(self, payload, n):
        out = torch.zeros(n, dtype=torch.float32, device=payload[1].device)
        self.add_to(out, payload)
        return out

    def add_to(self, out, payload):
        idx, values = payload
        out.index_put_((idx.long(),), values.float(), accumulate=True)  # O(k), not O(n)

    def layout(self, n):
        return [((self.k(n),), torch.int32), ((self.k(n),), torch.float32)]


class Int8(Compressor):
    name = "int8"

    def compress(self, x, key=None):
        x = _flat32(x)
        scale = x.abs().max() / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zeros: any scale works
        return [x.div(scale).round_().clamp_(-127, 127).to(torch.int8), scale.reshape(1)]

    def decompress(self, payload, n):
        q, scale = payload
        return q * scale.float()  # int8 × fp32 → fp32, in one pass

    def layout(self, n):
        return [((n,), torch.int8), ((1,), torch.float32)]


_BITS = 2 ** torch.arange(8, dtype=torch.uint8, device="cpu")  # bit i of byte j holds the sign of entry 8j + i
_SIGNS = ((torch.arange(256, device="cpu").unsqueeze(1) & _BITS).ne(0).float() * 2 - 1)  # byte → its 8 signs ±1


class Sign(Compressor):
    name = "sign"

    def compress(self, x, key=None):
        x = _flat32(x)
        n = x.numel()
        bits = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=x.device)
        bits[:n] = x >= 0
        packed = (bits.view(-1, 8) * on_device(_BITS, x.device)).sum(1, dtype=torch.uint8)
        return [packed, x.abs().mean().reshape(1)]

    def decompress(self, payload, n):
        packed, scale = payload
        signs = on_device(_SIGNS, packed.device).index_select(0, packed.int())  # a table look-up per byte
        return signs.reshape(-1)[:n] * scale.float()

    def layout(self, n):
        return [((math.ceil(n / 8),), torch.uint8), ((1,), torch.float32)]


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of P's columns (QR: stable; no NaN for a zero or rank-deficient P)."""
    return torch.linalg.qr(p).Q.contiguous()


class PowerSGD(Compressor):
    """Rank-r approximation of the tensor seen as a near-square matrix (padded with zeros).

    r = min(rank, cols): a tensor smaller than the rank gets a full-rank, exact-in-one-rank
    factorisation (which is no saving — such tensors are tiny).  Q is kept per key between steps.
    """

    def __init__(self, rank: int, seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank, self.seed = rank, seed
        self.name = f"powersgd:{rank}"
        self._q: dict = {}

    @staticmethod
    def shape(n: int) -> tuple[int, int]:
        rows = math.isqrt(n - 1) + 1  # ⌈√n⌉, so cols = ⌈n/rows⌉ <= rows
        return rows, math.ceil(n / rows)

    def r(self, n: int) -> int:
        return min(self.rank, self.shape(n)[1])

    def matrix(self, x: torch.Tensor) -> torch.Tensor:
        x = _flat32(x)
        rows, cols = self.shape(x.numel())
        m = x.new_zeros(rows * cols)
        m[: x.numel()] = x
        return m.view(rows, cols)

    def initial_q(self, key, m: torch.Tensor) -> torch.Tensor:
        """Last step's Q for ``key`` (the same on every rank), or a seeded random start."""
        cols, r = m.shape[1], min(self.rank, m.shape[1])
        q = self._q.get(key)
        if q is None or q.shape != (cols, r):
            gen = torch.Generator().manual_seed(self.seed)
            q = self._q[key] = torch.randn(cols, r, generator=gen, device="cpu").to(m.device)
        return q

    def compress(self, x, key=None):
        m = self.matrix(x)
        p = _orthonormal(m @ self.initial_q(key, m))
        q = self._q[key] = (m.t() @ p).contiguous()
        return [p, q]

    def decompress(self, payload, n):
        p, q = payload
        return (p.float() @ q.float().t()).reshape(-1)[:n]

    def layout(self, n):
        rows, cols = self.shape(n)
        return [((rows, self.r(n)), torch.float32), ((cols, self.r(n)), torch.float32)]


def parse_compressor(spec) -> Compressor | None:
    """``"topk:0.01"``, ``"int8"``, ``"sign"``, ``"powersgd:4"`` (or None/"none") → a Compressor.

    A Compressor passes through unchanged.  A bad spec is a :class:`.errors.ParameterError`
    (``compress``, the spec) naming the accepted forms.
    """
    if isinstance(spec, Compressor):
        return spec
    if spec in (None, "", "none"):
        return None
    name, _, arg = str(spec).partition(":")
    try:
        if name == "topk":
            return TopK(_number(arg, float, "RATIO, a number in (0, 1]"))
        if name == "powersgd":
            return PowerSGD(_number(arg, int, "RANK, an integer >= 1"))
        if name in ("int8", "sign") and not arg:
            return Int8() if name == "int8" else Sign()
        problem = "unknown compressor"
    except ValueError as exc:
        problem = str(exc)
    raise ParameterError(f"bad {{}} ({problem}); use {FORMS}", ("compress", spec))


def _number(arg: str, cast, what: str):
    try:
        return cast(arg)
    except ValueError:
        raise ValueError(f"expected {what} after the colon") from None


def topk_error_feedback(grad: torch.Tensor, residual: torch.Tensor, k: int):
    """Top-k with error feedback (the package's; the lesson-03 exercise writes it): of what is owed,
    ``grad + residual`` (flat fp32), send the ``k`` entries largest in magnitude and keep the rest
    for the next step.  Returns ``(indices, values, new_residual)``."""
    owed = grad + residual
    indices = owed.abs().topk(k, sorted=False).indices
    new_residual = owed.clone()
    new_residual[indices] = 0.0
    return indices, owed[indices], new_residual


class ErrorFeedback:
    """A compressor plus per-key residuals: send C(g + e), keep e ← (g + e) − D(C(g + e)).

    With a :class:`TopK` compressor, ``topk_error_feedback(grad, residual, k) -> (indices, values,
    new_residual)`` chooses what is sent and what is kept (default :func:`topk_error_feedback`; the lesson-03
    exercise writes one); ``grad`` and ``residual`` are flat fp32 (residual zeros at first).
    """

    def __init__(self, compressor: Compressor, enabled: bool = True, topk_error_feedback=None):
        if topk_error_feedback is not None and not isinstance(compressor, TopK):
            raise ValueError("topk_error_feedback= replaces top-k's selection; the compressor is "
                             f"{compressor}")
        self.compressor, self.enabled = compressor, enabled
        self.topk_error_feedback = topk_error_feedback  # None: the package's topk_error_feedback
        self.residual: dict = {}

    def corrected(self, x: torch.Tensor, key) -> torch.Tensor:
        """``x`` (flat) plus what was left unsent for ``key`` so far."""
        x = x.reshape(-1)
        return x + self.residual[key] if self.enabled and key in self.residual else x

    def remember(self, key, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        if self.enabled:
            self.residual[key] = corrected - sent

    def compress(self, x: torch.Tensor, key) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Payload for ``x`` and what the receiver will rebuild from it (dense, fp32)."""
        if isinstance(self.compressor, TopK):
            return self._compress_topk(_flat32(x), key)
        corrected = self.corrected(x, key)
        payload = self.compressor.compress(corrected, key)
        sent = self.compressor.decompress(payload, corrected.numel())
        self.remember(key, corrected, sent)
        return payload, sent

    def _compress_topk(self, x: torch.Tensor, key) -> tuple[list[torch.Tensor], torch.Tensor]:
        n = x.numel()
        residual = self.residual.get(key) if self.enabled else None
        select = self.topk_error_feedback or topk_error_feedback
        idx, values, new_residual = select(x, torch.zeros_like(x) if residual is None else residual,
                                           self.compressor.k(n))
        payload = [idx.to(torch.int32), values.float()]
        if self.enabled:
            self.residual[key] = new_residual.reshape(-1)
        return payload, self.compressor.decompress(payload, n)


def as_error_feedback(compression, error_feedback: bool = True,
                      topk_error_feedback=None) -> ErrorFeedback | None:
    """None, a spec, a Compressor or an ErrorFeedback (kept as is) → an ErrorFeedback or None;
    ``topk_error_feedback``: :class:`ErrorFeedback`'s."""
    if compression is None or isinstance(compression, ErrorFeedback):
        return compression
    compressor = parse_compressor(compression)
    return None if compressor is None else ErrorFeedback(compressor, error_feedback, topk_error_feedback)


def _pack(payload: list[torch.Tensor]) -> torch.Tensor:
    """The payload's bytes, concatenated: one message instead of one per part."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in payload])


def _unpack(buf: torch.Tensor, layout) -> list[torch.Tensor]:
    """Inverse of :func:`_pack` for a payload laid out as ``layout``."""
    parts, at = [], 0
    for shape, dtype in layout:
        size = math.prod(shape) * dtype.itemsize
        chunk = buf[at: at + size]
        if chunk.storage_offset() % dtype.itemsize:
            chunk = chunk.clone()  # a view as a wider dtype must start aligned
        parts.append(chunk.view(dtype).view(shape))
        at += size
    return parts


def compressed_all_reduce(x: torch.Tensor, comm: Comm, ef: ErrorFeedback, key,
                          average: bool = True) -> torch.Tensor:
    """Average (or with ``average=False`` sum) ``x`` over ``comm``'s ranks, in place, sending only
    compressed payloads; ``ef``'s residual for ``key`` takes what this rank's payload left out."""
    if isinstance(ef.compressor, PowerSGD):
        return _powersgd_all_reduce(x, comm, ef, key, average)
    n = x.numel()
    payload, _ = ef.compress(x, key)
    mine = _pack(payload)
    out = mine.new_empty(comm.size * mine.numel())
    comm.all_gather(out, mine, tag=f"compressed:{ef.compressor.name}")
    layout = ef.compressor.layout(n)
    total = torch.zeros(n, dtype=torch.float32, device=x.device)
    for row in out.view(comm.size, -1):
        ef.compressor.add_to(total, _unpack(row, layout))
    if average:
        total /= comm.size
    return x.copy_(total.view(x.shape))


def _powersgd_all_reduce(x, comm: Comm, ef: ErrorFeedback, key, average: bool):
    """PowerSGD's two all-reduces: P = Σ M_r Q, orthonormalised; Q = Σ M_rᵀ P; Σ M_r ≈ P Qᵀ."""
    ps: PowerSGD = ef.compressor
    n = x.numel()
    corrected = ef.corrected(x, key)
    m = ps.matrix(corrected)
    p = m @ ps.initial_q(key, m)
    comm.all_reduce(p, tag="compressed:powersgd-P")
    p = _orthonormal(p)  # the same on every rank (QR ignores the scale, so sum or mean alike)
    q_mine = (m.t() @ p).contiguous()
    q = q_mine.clone()
    comm.all_reduce(q, tag="compressed:powersgd-Q")
    if average:
        q /= comm.size
    ps._q[key] = q  # warm start for the next step, equal on every rank
    ef.remember(key, corrected, (p @ q_mine.t()).reshape(-1)[:n])  # this rank's share: P Pᵀ M_r
    return x.copy_((p @ q.t()).reshape(-1)[:n].view(x.shape))
