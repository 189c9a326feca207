"""The memory ledger: bytes per rank by kind and dtype, read from real tensors, beside the formulas.

Lessons 00, 04 and 07.  Formulas (Ψ parameters, N data-parallel ranks): 16 bytes per parameter for
mixed-precision Adam (2 + 2 + 12); ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N (Rajbhandari et
al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"); one transformer
layer's 16-bit activations s·b·h·(34 + 5·a·s/h) bytes (Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models").  :func:`ledger` reads what the tensors really hold, so a
test can put the two side by side.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch

__all__ = [
    "DTYPE_BYTES", "RECIPES", "bytes_per_param", "model_state_bytes", "activation_bytes_per_layer",
    "memory_per_device", "ledger", "allocator_peak", "ActivationMeter", "rss_bytes", "GB",
]

GB = 1e9  # the ZeRO paper and the lessons use decimal gigabytes

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}

#: bytes per parameter for (weights, gradients, optimizer states) under common training recipes
RECIPES = {
    "mixed-adam": (2, 2, 12),   # bf16/fp16 weights+grads; fp32 master weights, momentum, variance
    "fp32-adam": (4, 4, 8),     # fp32 weights+grads; fp32 momentum, variance
    "fp8-adam": (1, 1, 12),     # at best: fp8 weights+grads; the optimizer stays fp32 (as mixed-adam)
    "fp32-sgd": (4, 4, 0),
    "fp32-momentum": (4, 4, 4),
}


def bytes_per_param(precision: str) -> float:
    """Bytes one parameter takes when stored in ``precision`` ('fp32', 'bf16', 'fp8', ...)."""
    try:
        return DTYPE_BYTES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(DTYPE_BYTES)}") from None


def model_state_bytes(psi: float, n: int = 1, zero_stage: int = 0,
                      recipe: str = "mixed-adam") -> dict:
    """Per-device bytes of weights, gradients and optimizer states under ZeRO stage 0–3.

    Stage 1 shards the optimizer states over ``n`` ranks, stage 2 the gradients too, stage 3 the
    weights too.  Returns ``{"parameters", "gradients", "optimizer_states", "total"}``.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if n < 1:
        raise ValueError(f"the number of devices must be >= 1, got {n}")
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    p, g, k = RECIPES[recipe]
    out = {
        "parameters": psi * p / (n if zero_stage >= 3 else 1),
        "gradients": psi * g / (n if zero_stage >= 2 else 1),
        "optimizer_states": psi * k / (n if zero_stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def memory_per_device(params: float, dp: int = 1, zero_stage: int = 0, recipe: str = "mixed-adam",
                      activations: float = 0.0, gathered: float = 0.0,
                      offload: bool = False) -> dict:
    """Bytes one device holds: the model states of the ``params`` parameters it keeps, sharded by
    ZeRO stage ``zero_stage`` over ``dp`` data-parallel ranks (:func:`model_state_bytes`), its
    ``activations``, and ``gathered``, the weights ZeRO-3 gathers for the layer computing.  With
    ``offload`` (ZeRO-Offload) the optimizer states — fp32 master weights and Adam's moments — live
    in host memory instead.  Returns ``{"parameters", "gradients", "optimizer_states",
    "activations", "zero3_gathered", "total", "host"}``; ``host`` is not part of ``total``.
    """
    states = model_state_bytes(params, dp, zero_stage, recipe)
    host = states["optimizer_states"] if offload else 0.0
    out = {"parameters": states["parameters"], "gradients": states["gradients"],
           "optimizer_states": 0.0 if offload else states["optimizer_states"],
           "activations": activations, "zero3_gathered": gathered}
    out["total"] = sum(out.values())
    out["host"] = host
    return out


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int,
                               recompute: bool = False, tp: int = 1) -> float:
    """Activation bytes one transformer layer keeps for backward (16-bit, Korthikanti et al.).

    Without recomputation: s·b·h·(34 + 5·a·s/h); split over ``tp`` tensor-parallel ranks (no
    sequence parallelism) each keeps s·b·h·(10 + 24/t + 5·a·s/(h·t)) — the LayerNorm and dropout
    inputs stay whole.  With full activation checkpointing only the layer's input is kept: 2·s·b·h.
    """
    sbh = seq * batch * hidden
    return 2 * sbh if recompute else sbh * (10 + 24 / tp + 5 * heads * seq / (hidden * tp))


# --------------------------------------------------------------------------------------------------
# Measured: what the tensors really hold
# --------------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device)


class _Tally:
    """Adds up tensor bytes by kind and dtype, counting each storage once (tied weights, views).

    ``host`` holds the storage keys of tensors that live in host memory (offloaded); they are also
    added up apart, by kind, so the ledger can say what sits on the device and what on the host.
    """

    def __init__(self, host: set | None = None):
        self.seen: set = set()
        self.rows: dict = defaultdict(lambda: defaultdict(int))
        self.host_keys = host or set()
        self.host_rows: dict = defaultdict(int)

    def add(self, kind: str, t: torch.Tensor | None) -> int:
        """Count ``t`` under ``kind``; the bytes it added (0: None, or a storage already seen)."""
        if t is None:
            return 0
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in self.seen:
            return 0
        self.seen.add(key)
        self.rows[kind][_dtype_name(t.dtype)] += storage.nbytes()
        if key in self.host_keys:
            self.host_rows[kind] += storage.nbytes()
        return storage.nbytes()


def ledger(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
           activations_peak: int = 0, params=None, extra: dict | None = None,
           host=()) -> dict:
    """Bytes held on this rank, by kind, measured from the tensors.

    Kinds: ``parameters``, ``gradients`` (``.grad`` of those parameters), ``optimizer_states``
    (per-parameter optimizer tensors such as Adam's momentum and variance, and master weights),
    ``optimizer_other`` (scalar bookkeeping such as Adam's step counters) and
    ``activations_peak`` (from :class:`ActivationMeter`).  Returns
    ``{"bytes": {kind: total}, "by_dtype": {kind: {dtype: bytes}}, "total": ...,
    "device": {kind: bytes}, "host": {kind: bytes}, "by_state": {state key: bytes}}`` —
    ``by_state`` splits the optimizer's tensors by their key in ``optimizer.state[p]`` (``master``,
    ``exp_avg``, ``exp_avg_sq``, ...: lesson 07 shows the 4 + 4 + 4 bytes apart).
    ``"allocator_peak"`` is, where the parameters are on a GPU, the most the CUDA caching
    allocator has held for this process's tensors (``torch.cuda.max_memory_allocated``: the ledger
    counts what the tensors hold now; the allocator's peak adds temporaries and fragmentation);
    ``None`` on a CPU.

    ``extra`` (``{kind: [tensors]}``) counts tensors held outside ``.grad`` and ``optimizer.state``
    — ZeRO's gradient shards, parameter shards, offloaded master weights.  ``host`` names the
    tensors that live in host memory (ZeRO-Offload): ``"bytes"`` still counts everything, and
    ``"device"`` / ``"host"`` split it, so a lesson can show what moved off the device — even on a
    CPU run, where "device" is the CPU the model computes on.
    """
    tally = _Tally({_storage_key(t) for t in host if t is not None})
    params = list(params) if params is not None else (
        list(model.parameters()) if model is not None else [])
    for p in params:
        tally.add("parameters", p)
    for p in params:
        tally.add("gradients", p.grad)
    by_state: dict = defaultdict(int)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    by_state[str(key)] += tally.add(
                        "optimizer_states" if value.dim() > 0 else "optimizer_other", value)
    for kind, tensors in (extra or {}).items():
        for t in tensors:
            tally.add(kind, t)
    kinds = ["parameters", "gradients", "optimizer_states", "optimizer_other"]
    out = {k: sum(tally.rows[k].values()) for k in kinds}
    out["activations_peak"] = int(activations_peak)
    on_host = {k: tally.host_rows.get(k, 0) for k in kinds}
    return {
        "bytes": out,
        "by_dtype": {k: dict(tally.rows[k]) for k in kinds if tally.rows[k]},
        "total": sum(out.values()),
        "device": {k: out[k] - on_host.get(k, 0) for k in out},
        "host": on_host,
        "by_state": dict(by_state),
        "allocator_peak": allocator_peak(params),
    }


def allocator_peak(tensors=()) -> int | None:
    """``torch.cuda.max_memory_allocated`` of the GPU the first CUDA tensor of ``tensors`` is on;
    ``None`` when none is on a GPU."""
    cuda = next((t.device for t in tensors if t is not None and t.is_cuda), None)
    return None if cuda is None else int(torch.cuda.max_memory_allocated(cuda))


class ActivationMeter:
    """Measures the bytes autograd saves for backward during a forward pass.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for backward passes through
    the pack hook, and we add up the distinct storages that are not parameters.  ``peak`` is the most
    seen in any one measured forward (the activations are all alive at the end of the forward).
    """

    def __init__(self, model: torch.nn.Module | None = None, ignore=None):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self._ignore = ignore  # optional predicate: tensors that are not activations (ZeRO-3's
        self.peak = 0          # gathered parameters, whose storage comes and goes)
        self.last = 0

    @contextmanager
    def measure(self):
        seen: set = set()
        total = [0]

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in self._param_ptrs and not (
                    self._ignore is not None and self._ignore(t)):
                seen.add(ptr)
                total[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self
        self.last = total[0]
        self.peak = max(self.peak, self.last)


def rss_bytes(peak: bool = False) -> int:
    """Resident memory of this process (``peak=True``: the high-water mark), from /proc (Linux)."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
