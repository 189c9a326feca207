"""What a training step's kernels cost on a device (lessons 07 and 08: MFU, where the time goes).

A step is a list of kernels — the matrix products of each linear layer (one forward, two backward),
the attention core, the memory-bound passes (norms, activations, residual adds, softmax, the loss)
and the optimizer — and each is priced on its own: a GEMM by the roofline with tile and wave
quantization over the SMs (NVIDIA, "Matrix Multiplication Background User's Guide"), at the
measured maximum achievable matmul FLOP/s (Bekman, "Machine Learning Engineering Open Book",
MAMF); FlashAttention at its published throughput (Dao, 2023, "FlashAttention-2"; Shah et al.,
2024, "FlashAttention-3"); a memory-bound pass at a measured memory bandwidth; and every kernel at
least the time the CPU takes to issue it (NVIDIA, 2019, "Getting Started with CUDA Graphs").  A
:class:`Stack` says which kernels a software stack runs: PyTorch eager, Megatron-LM's fused kernels
(Narayanan et al., 2021), or a current FlashAttention stack.  No number here is fitted to a
published training throughput: each comes from a datasheet or a microbenchmark, cited where it is
defined.  The CPU is priced by the same rules from a calibration measured on the spot.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace

from ..model import GPTConfig, training_flops
from ..device import now

__all__ = ["DeviceKernels", "DEVICES", "GEMM_TILES", "Stack", "STACKS", "stack_named",
           "default_stack", "Kernel",
           "Compute", "ADAM_BYTES", "gemm_seconds", "gemm_quantization", "kernel_seconds",
           "block_kernels", "head_kernels", "embed_kernels", "rank_compute", "format_kernels",
           "cpu_kernels", "calibrate_kernels", "for_working_set", "state_bytes", "RECOMPUTE"]

#: Adam's update reads the fp32 weight, gradient and two moments and writes the weight and the two
#: moments: 7 fp32 words per parameter (the same count as the projection's ``ADAM_BYTES``).
ADAM_BYTES = 28

#: The output tiles cuBLAS chooses among for a GEMM (NVIDIA, "Matrix Multiplication Background
#: User's Guide", section "Dimension Quantization Effects": 256×128, 128×256, 128×128, 256×64,
#: 64×256, 128×64, 64×128, 64×64).
GEMM_TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128),
              (64, 64))


# --------------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceKernels:
    """What a device's kernels run at.  GPU: ``sms`` streaming multiprocessors, the datasheet
    peaks, the measured matmul rate ``mamf`` (bf16), the measured memory bandwidth, the launch
    floor (no kernel takes less: the CPU issues one at a time) and FlashAttention's throughput by
    sequence length (``flash``: phase → ((seq, FLOP/s), ...), head dimension 128, BF16).  CPU
    (``per_op``): GEMM rates measured at a few sizes (``gemm_curve``: ((FLOPs, FLOP/s), ...)) and
    a per-op dispatch overhead that every kernel pays on top of its work."""

    name: str
    sms: int
    peak_bf16: float
    peak_tf32: float
    mamf: float
    bandwidth: float          # the datasheet's
    achievable_bandwidth: float
    launch_s: float
    flash: dict = field(default_factory=dict)
    tiles: tuple = GEMM_TILES
    per_op: bool = False
    dispatch: dict = field(default_factory=dict)  # CPU: seconds of dispatch per launch, by kind
    gemm_curve: tuple = ()
    gemm_grid: tuple = ()  # CPU: ((m, n, k, FLOP/s), ...) measured on a grid of shapes
    # CPU: the same grid with its operands read from memory, not the cache; and the cache's size
    gemm_grid_cold: tuple = ()
    cache_bytes: float = 0.0
    # CPU: ((op, phase, bytes, bytes/s), ...): an elementwise op's rate at a size, in the bytes the
    # model counts for it (a GeLU computes an erf per element: far below a copy's bandwidth)
    op_rates: tuple = ()
    # CPU: ((phase, seq, head_dim, FLOP/s), ...): scaled_dot_product_attention's rate
    attention_grid: tuple = ()
    source: str = ""

    def peak(self, precision: str = "bf16-mixed") -> float:
        return self.peak_tf32 if precision == "fp32" else self.peak_bf16

    def matmul_rate(self, precision: str = "bf16-mixed") -> float:
        """MAMF; fp32 runs on TF32 tensor cores at MAMF × the TF32/BF16 peak ratio (assumed: the
        same achievable fraction of a peak half as high)."""
        return self.mamf * (self.peak_tf32 / self.peak_bf16 if precision == "fp32" else 1.0)


_DATASHEETS = ("NVIDIA A100 Tensor Core GPU datasheet (2021): 108 SMs, BF16 dense 312 TFLOP/s, TF32 "
               "156 TFLOP/s, HBM2e 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe); NVIDIA H100 "
               "Tensor Core GPU datasheet (2023): H100 SXM 132 SMs, BF16 dense 989 TFLOP/s, TF32 "
               "494.7 TFLOP/s, HBM3 3.35 TB/s")
_MAMF = ("MAMF, bf16, measured by Bekman, 'Machine Learning Engineering Open Book' (2024), "
         "chapter 'Maximum Achievable Matmul FLOPS': A100 SXM 271.2, H100 SXM 794.5, A100 PCIe "
         "252.9 TFLOP/s")
# A read kernel reached 1.80 TB/s on an A100 80GB SXM, 88 % of the datasheet's 2,039 GB/s (NVIDIA
# Developer Forums, 2025, "Trouble to Reach Peak Bandwidth of A100", measured with Nsight Compute;
# the thread cites a GTC 2025 talk in which no kernel exceeded about 90 %).  The other devices get
# the same measured fraction of their datasheet bandwidth.
_BW_FRACTION = 1.80e12 / 2.039e12
_BANDWIDTH = ("achievable bandwidth: 1.80 TB/s measured on an A100 80GB SXM (88 % of the datasheet; "
              "NVIDIA Developer Forums, 2025, 'Trouble to Reach Peak Bandwidth of A100'), the same "
              "fraction of the datasheet on the other devices")
#: A kernel issued by the CPU after another completes no sooner than 3.8 µs after it: the time
#: per kernel of a stream of short kernels launched back to back (NVIDIA Technical Blog, Gray,
#: 2019, "Getting Started with CUDA Graphs": 3.8 µs per 2.9 µs kernel without CUDA Graphs).
LAUNCH_S = 3.8e-6
_LAUNCH = "launch floor 3.8 µs per kernel (Gray, 2019, NVIDIA blog 'Getting Started with CUDA Graphs')"

# FlashAttention throughput (FLOP/s) by sequence length, BF16, head dimension 128, on an H100 SXM5:
# Shah et al., 2024, "FlashAttention-3", Figure 5 (forward, causal mask, its FLOPs halved) and
# Figure 6 (backward, shown without the mask, used for the causal backward too), which measure
# FlashAttention-2 beside FlashAttention-3 on the same GPU.
_FA3_H100 = {"forward": ((512, 292e12), (1024, 423e12), (2048, 521e12), (4096, 579e12),
                         (8192, 602e12), (16384, 616e12)),
             "backward": ((512, 316e12), (1024, 424e12), (2048, 501e12), (4096, 542e12),
                          (8192, 559e12), (16384, 561e12))}
_FA2_H100 = {"forward": ((512, 191e12), (1024, 260e12), (2048, 298e12), (4096, 319e12),
                         (8192, 333e12), (16384, 335e12)),
             "backward": ((512, 214e12), (1024, 260e12), (2048, 291e12), (4096, 310e12),
                          (8192, 318e12), (16384, 322e12))}
# A100: FlashAttention-2 reaches 50-73 % of the A100's 312 TFLOP/s (Dao, 2023, "FlashAttention-2",
# abstract); the table puts the low end at 512 positions and the high end at 16k, forward and
# backward alike (the paper's per-length figures are not transcribed here).  FlashAttention-3 is
# for Hopper GPUs: an A100 runs FlashAttention-2 under any stack.
_FA2_A100 = {phase: ((512, 0.50 * 312e12), (16384, 0.73 * 312e12))
             for phase in ("forward", "backward")}

DEVICES = {
    "A100 SXM": DeviceKernels("NVIDIA A100 SXM 80GB", 108, 312e12, 156e12, 271.2e12, 2.039e12,
                              1.80e12, LAUNCH_S, {"flash2": _FA2_A100},
                              source="; ".join((_DATASHEETS, _MAMF, _BANDWIDTH, _LAUNCH,
                                                "FlashAttention-2: Dao, 2023"))),
    "H100 SXM": DeviceKernels("NVIDIA H100 SXM 80GB", 132, 989e12, 494.7e12, 794.5e12, 3.35e12,
                              3.35e12 * _BW_FRACTION, LAUNCH_S,
                              {"flash2": _FA2_H100, "flash3": _FA3_H100},
                              source="; ".join((_DATASHEETS, _MAMF, _BANDWIDTH, _LAUNCH,
                                                "FlashAttention-2 and -3 on it: Shah et al., 2024, "
                                                "'FlashAttention-3', Figs. 5-6"))),
    "A100 PCIe": DeviceKernels("NVIDIA A100 PCIe 80GB", 108, 312e12, 156e12, 252.9e12, 1.935e12,
                               1.935e12 * _BW_FRACTION, LAUNCH_S, {"flash2": _FA2_A100},
                               source="; ".join((_DATASHEETS, _MAMF, _BANDWIDTH, _LAUNCH,
                                                 "FlashAttention-2: Dao, 2023"))),
}


# --------------------------------------------------------------------------------------------------
# Software stacks
# --------------------------------------------------------------------------------------------------

#: The elementwise groups a stack may run as one kernel each: norms, GeLU (with its bias),
#: SwiGLU's SiLU-and-multiply, dropout with the residual add, scale-mask-softmax, the rotary
#: embedding, the loss (cross-entropy over the vocabulary).
FUSIONS = ("norm", "gelu", "swiglu", "dropout-add", "softmax", "rope", "loss")


@dataclass(frozen=True)
class Stack:
    """A software stack: ``attention`` "materialized" (the s×s scores go through memory),
    "flash2" or "flash3" (one fused kernel: FlashAttention-2, or -3 where the GPU has it — a
    Hopper; elsewhere -2), the elementwise groups it ``fuses`` (of :data:`FUSIONS`), whether
    it trains with ``dropout``, its activation ``recompute`` ("none" | "selective": the attention
    core again in backward, Korthikanti et al., 2022 | "op": torchtitan's per-op selective
    checkpointing, every other matrix product and the elementwise ops again | "full": each
    block's forward again),
    ``tp_overlap`` (tensor-parallel communication hidden under GEMMs) and the SMs an overlapped
    NCCL kernel takes from the compute it overlaps (``comm_sms``)."""

    name: str
    attention: str
    fuses: frozenset
    dropout: bool
    recompute: str
    tp_overlap: bool
    comm_sms: int
    source: str

    @property
    def fused_attention(self) -> bool:
        return self.attention != "materialized"

    def overlap_slowdown(self, device: DeviceKernels) -> float:
        """How much slower compute runs while a collective overlaps it: its kernels hold
        ``comm_sms`` of the SMs (1 on a CPU, whose collectives this model does not price)."""
        if device.per_op or not device.sms:
            return 1.0
        return device.sms / (device.sms - self.comm_sms)


#: 20 SMs of an H800's 132 suffice to drive its NVLink and InfiniBand all-to-all (DeepSeek-AI,
#: 2024, "DeepSeek-V3 Technical Report", section 3.2.2); the same count is taken on every GPU.
COMM_SMS = 20

STACKS = {
    "eager": Stack("eager", "materialized", frozenset(), True, "none", False, COMM_SMS,
                   "plain PyTorch eager: attention as QKᵀ, scale, mask, softmax, dropout and AV, "
                   "each its own kernel (the GPT-2 recipe trains with dropout: Radford et al., "
                   "2019); every elementwise op its own kernel (GeLU as GPT-2's tanh formula); "
                   "no communication overlap"),
    "megatron-2021": Stack("megatron-2021", "materialized",
                           frozenset({"norm", "gelu", "dropout-add", "softmax"}), True, "full",
                           False, COMM_SMS,
                           "Narayanan et al., 2021, 'Efficient Large-Scale Language Model "
                           "Training on GPU Clusters Using Megatron-LM', section 4.2: fused "
                           "bias+GeLU, bias+dropout+add and scale-mask-softmax kernels, apex's "
                           "fused LayerNorm, full activation recomputation; attention scores still "
                           "materialized; tensor-parallel all-reduces not overlapped"),
    "sdpa": Stack("sdpa", "flash2", frozenset({"gelu"}), False, "none", False, COMM_SMS,
                  "plain PyTorch eager with torch.nn.functional.scaled_dot_product_attention, "
                  "whose CUDA kernel is FlashAttention-2 (Dao, 2023; PyTorch 2.2 release notes), "
                  "GeLU one kernel (F.gelu), every other elementwise op its own kernel (RMSNorm, "
                  "SiLU and the multiply, rotary, residual adds, the loss), no dropout, no "
                  "recomputation, no communication overlap: torchtitan's and llm-foundry's "
                  "models without torch.compile, and minitrain's own GPT"),
    "flash": Stack("flash", "flash3", frozenset(FUSIONS), False, "selective", True, COMM_SMS,
                   "a current stack: FlashAttention-3 on Hopper, -2 elsewhere (Shah et al., 2024; "
                   "Dao, 2023), fused "
                   "RMSNorm/LayerNorm, SwiGLU, rotary and cross-entropy kernels, selective "
                   "recomputation and sequence parallelism (Korthikanti et al., 2022, 'Reducing "
                   "Activation Recomputation in Large Transformer Models'), tensor-parallel "
                   "communication overlapped with GEMMs (NVIDIA Transformer Engine, "
                   "'tp_comm_overlap'); no dropout (Llama 3's recipe: Grattafiori et al., 2024)"),
}


def stack_named(stack: Stack | str | None, device: DeviceKernels | None = None) -> Stack:
    """The :class:`Stack` ``stack`` names (a key of :data:`STACKS`, any case), ``stack`` itself
    if it is one, or with None the device's :func:`default_stack` ("sdpa" where there is no
    device); an unknown name is a ValueError naming the choices."""
    if isinstance(stack, Stack):
        return stack
    if stack is None:
        return default_stack(device) if device is not None else STACKS["sdpa"]
    key = str(stack).lower()
    if key not in STACKS:
        close = difflib.get_close_matches(key, STACKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown stack {stack!r}{hint}; choose one of: {', '.join(STACKS)}")
    return STACKS[key]


def default_stack(device: DeviceKernels) -> Stack:
    """"flash" on a GPU; on a CPU, "sdpa" (PyTorch's kernels op by op, attention fused: the
    course's own GPT as it runs here)."""
    return STACKS["sdpa" if device.per_op else "flash"]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One kernel (or a few of one kind, ``launches``): ``kind`` "gemm" | "attention" (a fused
    attention kernel) | "memory" | "optimizer", ``phase`` "forward" | "backward" | "step", its
    FLOPs and bytes read + written; a GEMM's ``shape`` (m, n, k) times ``batch``; a fused
    attention kernel's ``seq`` (the key length of one launch, its throughput table's x)."""

    name: str
    kind: str
    phase: str
    flops: float = 0.0
    bytes: float = 0.0
    shape: tuple | None = None
    batch: int = 1
    launches: int = 1
    seq: int = 0
    impl: str = ""  # a fused attention kernel's implementation: "flash2" or "flash3"
    head_dim: int = 0  # a fused attention kernel's
    op: str = ""  # a memory-bound kernel's op where a CPU measures it: "norm", "gelu" or "add"


def _gemm(name: str, phase: str, m: int, n: int, k: int, item: int, batch: int = 1) -> Kernel:
    """C (m×n) = A (m×k) · B (k×n): 2mnk FLOPs, reading A and B and writing C once."""
    return Kernel(name, "gemm", phase, 2.0 * m * n * k * batch, item * batch * (m * k + k * n + m * n),
                  (m, n, k), batch)


def _linear(name: str, tokens: int, n_in: int, n_out: int, item: int) -> list[Kernel]:
    """A linear layer on ``tokens`` rows: forward Y = XW; backward dX = dY·Wᵀ and dW = Xᵀ·dY."""
    return [_gemm(name, "forward", tokens, n_out, n_in, item),
            _gemm(name + " dX", "backward", tokens, n_in, n_out, item),
            _gemm(name + " dW", "backward", n_in, n_out, tokens, item)]


def _memory(name: str, nbytes: float, launches: int = 1, op: str = "") -> list[Kernel]:
    """A memory-bound op, forward and backward; its backward reads the output gradient and the
    saved input(s) and writes the input gradient(s): taken as twice the forward's traffic.
    ``op``: which of a CPU's measured elementwise ops it is (:data:`CPU_OPS`)."""
    return [Kernel(name, "memory", "forward", bytes=nbytes, launches=launches, op=op),
            Kernel(name, "memory", "backward", bytes=2 * nbytes, launches=launches, op=op)]


def _norm(cfg: GPTConfig, stack: Stack, name: str, elems: float, item: int) -> list[Kernel]:
    """LayerNorm is one PyTorch kernel (read x, write y) even in eager; RMSNorm unfused is its
    ops: square, mean, multiply by the reciprocal root, multiply by the weight (7 passes' worth
    of traffic over 4 kernels); fused, one pass."""
    if cfg.norm == "layernorm":
        return _memory(name, 2 * elems * item, op="norm")
    if "norm" in stack.fuses:
        return _memory(name, 2 * elems * item)
    return _memory(name + " (4 ops)", 7 * elems * item, launches=4)


def _residual(stack: Stack, name: str, elems: float, item: int) -> list[Kernel]:
    """Dropout (when the stack trains with it: a 1-byte mask written) and the residual add
    (read two, write one); fused into one pass or two kernels."""
    mask = elems if stack.dropout else 0
    if not stack.dropout:
        return _memory(name, 3 * elems * item, op="add")
    if "dropout-add" in stack.fuses:
        return _memory(name, 3 * elems * item + mask)
    return _memory("dropout + " + name, (2 + 3) * elems * item + mask, launches=2)


def _activation(cfg: GPTConfig, stack: Stack, elems: float, item: int) -> list[Kernel]:
    """GeLU over the MLP's hidden activations: fused, one pass; unfused, GPT-2's tanh formula
    op by op (x³, ·0.044715, +x, ·√(2/π), tanh, +1, ·x, ·0.5: 8 kernels reading and writing
    each).  SwiGLU: SiLU(gate)·up, fused one pass (read two, write one), unfused two kernels."""
    if cfg.mlp == "swiglu":
        if "swiglu" in stack.fuses:
            return _memory("silu * up", 3 * elems * item)
        return _memory("silu, * up", (2 + 3) * elems * item, launches=2)
    if "gelu" in stack.fuses:
        return _memory("gelu", 2 * elems * item, op="gelu")
    return _memory("gelu (8 ops)", 8 * 2 * elems * item, launches=8)


def _rope(stack: Stack, elems: float, item: int) -> list[Kernel]:
    """Rotary embedding of Q and K: x·cos + rotate_half(x)·sin — unfused four kernels (rotate,
    two multiplies, add), fused one pass."""
    if "rope" in stack.fuses:
        return _memory("rope", 2 * elems * item)
    return _memory("rope (4 ops)", 4 * 2 * elems * item, launches=4)


def _attention_core(cfg: GPTConfig, stack: Stack, b: int, heads: int, kv_heads: int, s_q: int,
                    s_k: int, item: int, cp: int) -> list[Kernel]:
    """softmax(QKᵀ/√h)V for ``heads`` heads of ``s_q`` queries against ``s_k`` keys (causal).

    flash: one kernel forward, one backward at 2.5× its FLOPs (it recomputes the scores), the
    causal mask halving the work; ``cp`` ring steps of ``s_q`` keys each.  Materialized: the
    scores QKᵀ and AV as batched GEMMs over all s_q×s_k positions (the mask applied after), and
    passes over the b·heads·s_q·s_k scores: scale, mask, softmax, dropout (megatron fuses the
    first three); backward: four GEMMs (dV, dP, dQ, dK) and the passes' gradients."""
    hd = cfg.head_dim
    if stack.fused_attention:
        flops = 4.0 * b * heads * s_q * s_k * hd / 2
        io = item * b * (2 * s_q * heads * hd + 2 * s_k * kv_heads * hd)
        name = f"attention ({stack.attention})"
        return [Kernel(name, "attention", "forward", flops, io, launches=cp, seq=s_q,
                       impl=stack.attention, head_dim=hd),
                Kernel(name + " bwd", "attention", "backward", 2.5 * flops, 2 * io,
                       launches=cp, seq=s_q, impl=stack.attention, head_dim=hd)]
    scores, bh = b * heads * s_q * s_k, b * heads
    out: list[Kernel] = []
    if kv_heads < heads:  # grouped-query attention: K and V repeated to every query head
        out += _memory("attention repeat_kv", item * 2 * b * s_k * hd * (kv_heads + heads))
    out += [_gemm("attention QKᵀ", "forward", s_q, s_k, hd, item, bh)]
    if "softmax" in stack.fuses:
        out += _memory("attention scale-mask-softmax", 2 * scores * item)
    else:
        out += _memory("attention scale, mask, softmax", 3 * 2 * scores * item, launches=3)
    if stack.dropout:
        out += _memory("attention dropout", 2 * scores * item + scores)
    out += [_gemm("attention AV", "forward", s_q, hd, s_k, item, bh),
            _gemm("attention dP = dO·Vᵀ", "backward", s_q, s_k, hd, item, bh),
            _gemm("attention dV = Pᵀ·dO", "backward", s_k, hd, s_q, item, bh),
            _gemm("attention dQ = dS·K", "backward", s_q, hd, s_k, item, bh),
            _gemm("attention dK = dSᵀ·Q", "backward", s_k, hd, s_q, item, bh)]
    return out


def block_kernels(cfg: GPTConfig, stack: Stack, *, micro_batch: int = 1, seq: int | None = None,
                  tp: int = 1, cp: int = 1, sp: bool = False, ep: int = 1,
                  precision: str = "bf16-mixed") -> list[Kernel]:
    """The kernels of one micro-batch (``micro_batch`` sequences of ``seq`` positions) through
    one transformer block, forward and backward, on one rank: tensor parallelism splits the
    heads and the MLP's columns by ``tp`` (the norms and residuals too with sequence parallelism,
    ``sp``), context parallelism the sequence by ``cp`` (each rank's queries attend to all the
    keys, in a ring), expert parallelism the experts by ``ep``."""
    item = 4 if precision == "fp32" else 2
    seq = cfg.seq_len if seq is None else seq
    d, hd, s_q = cfg.d_model, cfg.head_dim, seq // cp
    tokens = micro_batch * s_q                      # rows through the rank's GEMMs
    row_tokens = tokens // tp if sp else tokens     # rows through its norms and residuals
    heads, kv_heads = cfg.n_head // tp, max(1, cfg.kv_heads // tp)
    q_w, kv_w, ff = heads * hd, kv_heads * hd, cfg.ff // tp
    out = _norm(cfg, stack, "norm 1", row_tokens * d, item)
    if cfg.llama_fields():  # Llama's wq, wk, wv: three products
        out += (_linear("Q", tokens, d, q_w, item) + _linear("K", tokens, d, kv_w, item)
                + _linear("V", tokens, d, kv_w, item))
    else:  # GPT's one fused product
        out += _linear("QKV", tokens, d, q_w + 2 * kv_w, item)
    if cfg.positions == "rope":
        out += _rope(stack, tokens * (q_w + kv_w), item)
    out += _attention_core(cfg, stack, micro_batch, heads, kv_heads, s_q, seq, item, cp)
    out += _linear("attention out", tokens, q_w, d, item)
    out += _residual(stack, "residual add 1", row_tokens * d, item)
    out += _norm(cfg, stack, "norm 2", row_tokens * d, item)
    out += _mlp(cfg, stack, tokens, ff, ep, item)
    out += _residual(stack, "residual add 2", row_tokens * d, item)
    return out


def _mlp(cfg: GPTConfig, stack: Stack, tokens: int, ff: int, ep: int, item: int) -> list[Kernel]:
    """The MLP's GEMMs and activation; a mixture of experts adds the router and moves each token
    to its experts and back (a copy each way), its experts' GEMMs batched over the rank's
    n_expert/ep experts, each taking tokens·top_k·ep/n_expert rows on average."""
    d, out = cfg.d_model, []
    rows, experts = tokens, 1
    if cfg.n_expert:
        experts = cfg.n_expert // ep
        rows = max(1, tokens * cfg.top_k * ep // cfg.n_expert)
        out += _linear("router", tokens, d, cfg.n_expert, item)
        out += _memory("dispatch + combine", 2 * 2 * tokens * cfg.top_k * d * item, launches=2)
    ups = ("gate", "up") if cfg.mlp == "swiglu" else ("up",)
    for name in ups:
        out += [_batched(k, experts) for k in _linear("MLP " + name, rows, d, ff, item)]
    out += _activation(cfg, stack, experts * rows * ff, item)
    out += [_batched(k, experts) for k in _linear("MLP down", rows, ff, d, item)]
    return out


def _batched(k: Kernel, batch: int) -> Kernel:
    """The same GEMM run for ``batch`` experts in one grouped launch."""
    if batch == 1:
        return k
    return Kernel(k.name, k.kind, k.phase, k.flops * batch, k.bytes * batch, k.shape, batch)


def head_kernels(cfg: GPTConfig, stack: Stack, *, micro_batch: int = 1, seq: int | None = None,
                 tp: int = 1, cp: int = 1, sp: bool = False,
                 precision: str = "bf16-mixed") -> list[Kernel]:
    """The final norm, the output layer (vocabulary-parallel: V/tp columns) and the loss over the
    logits: unfused, a cast to fp32, log-softmax and the pick of the target (forward), their
    gradients and a cast back (backward); fused, one read of the logits forward, one read and one
    write backward."""
    item = 4 if precision == "fp32" else 2
    seq = cfg.seq_len if seq is None else seq
    tokens = micro_batch * seq // cp
    logits = tokens * cfg.vocab_size / tp
    out = _norm(cfg, stack, "final norm", (tokens // tp if sp else tokens) * cfg.d_model, item)
    out += _linear("output layer", tokens, cfg.d_model, cfg.vocab_size // tp, item)
    if "loss" in stack.fuses:
        out += [Kernel("cross-entropy", "memory", "forward", bytes=logits * item),
                Kernel("cross-entropy", "memory", "backward", bytes=2 * logits * item)]
    else:
        out += [Kernel("cast, log-softmax, nll", "memory", "forward",
                       bytes=logits * (item + 4 + 8), launches=3),
                Kernel("cast, log-softmax, nll", "memory", "backward",
                       bytes=logits * (4 + 12 + 4 + item), launches=3)]
    return out


def embed_kernels(cfg: GPTConfig, stack: Stack, *, micro_batch: int = 1, seq: int | None = None,
                  tp: int = 1, cp: int = 1, precision: str = "bf16-mixed") -> list[Kernel]:
    """The token lookup (read the rows, write the activations), the learned positions' add, and
    backward: zeroing the rank's V/tp × d gradient table and adding each row's gradient into it."""
    item = 4 if precision == "fp32" else 2
    seq = cfg.seq_len if seq is None else seq
    act = micro_batch * seq // cp * cfg.d_model
    out = [Kernel("embedding lookup", "memory", "forward", bytes=2 * act * item),
           Kernel("embedding grad", "memory", "backward",
                  bytes=(cfg.vocab_size // tp * cfg.d_model + 2 * act) * item, launches=2)]
    if cfg.positions == "learned":
        out += _memory("+ positions", 3 * act * item, op="add")
    return out


# --------------------------------------------------------------------------------------------------
# Pricing
# --------------------------------------------------------------------------------------------------


def _reuse(tile: tuple) -> float:
    """FLOPs per operand element a tile loads: tm·tn/(tm + tn)."""
    tm, tn = tile
    return tm * tn / (tm + tn)


def gemm_quantization(device: DeviceKernels, m: int, n: int, batch: int = 1,
                      tiles: tuple | None = None) -> tuple[tuple, float]:
    """The tile cuBLAS would pick for an m×n output (×batch) and the fraction of the SMs' work
    that is useful with it.  Tile quantization: ceil(m/tm)·ceil(n/tn) tiles, the edge ones
    partly empty; wave quantization: the tiles run in ceil(tiles/SMs) waves, the last one partly
    idle (NVIDIA, "Matrix Multiplication Background User's Guide").  A smaller tile wastes less
    but reuses each operand less; the model assumes the largest tile's reuse is what MAMF was
    measured with and a smaller one runs at its reuse relative to it (no constant is fitted).
    The pick is the fastest tile: the least (waves · tile work) / reuse.  ``tiles`` (default the
    device's) are the candidates; the best of them is taken as the one MAMF was measured with, so
    ``tiles=((128, 128),)`` prices every product with that one tile, a full wave of it at MAMF
    (lesson 07's exercise)."""
    tiles = tiles or device.tiles
    best_reuse = max(_reuse(t) for t in tiles)
    choice, cost, useful = None, math.inf, 1.0
    for tm, tn in tiles:
        count = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / device.sms)
        work = waves * device.sms * tm * tn                     # output elements the SMs could do
        c = work / (_reuse((tm, tn)) / best_reuse)
        if c < cost:
            choice, cost, useful = (tm, tn), c, batch * m * n / work
    return choice, useful * _reuse(choice) / best_reuse


def gemm_seconds(device: DeviceKernels, m: int, n: int, k: int, batch: int = 1,
                 precision: str = "bf16-mixed", tiles: tuple | None = None) -> float:
    """Time of one GEMM (×batch): the roofline, max(FLOPs / (MAMF × quantization efficiency),
    bytes / achievable bandwidth).  On a CPU: FLOPs at the calibrated rate for a product of this
    size, or bytes at the calibrated bandwidth, whichever is longer."""
    item = 4 if precision == "fp32" else 2
    flops, nbytes = 2.0 * m * n * k * batch, item * batch * (m * k + k * n + m * n)
    if device.per_op:
        rate = _grid_rate(device.gemm_grid, m, n, k) if device.gemm_grid else \
            _cpu_rate(device, flops / batch)
        return max(flops / rate, nbytes / device.achievable_bandwidth)
    _, efficiency = gemm_quantization(device, m, n, batch, tiles)
    compute = flops / (device.matmul_rate(precision) * efficiency)
    return max(compute, nbytes / device.achievable_bandwidth)


def _cpu_rate(device: DeviceKernels, flops: float) -> float:
    """The measured GEMM rate interpolated in log(FLOPs) (held flat outside the measured sizes)."""
    curve = sorted(device.gemm_curve)
    return _interpolate(curve, flops)


def _grid_rate(grid: tuple, m: int, n: int, k: int) -> float:
    """The GEMM rate measured on a grid of shapes, interpolated linearly in log(m), log(n) and
    log(k) between the grid's points (held flat beyond them): a CPU's product is as fast as its
    shape lets it be — a thin one is slower than a square one of the same FLOPs."""
    axes = [sorted({p[i] for p in grid}) for i in range(3)]
    rate = {tuple(p[:3]): p[3] for p in grid}
    out = 0.0
    for a, wa in _log_weights(axes[0], m):
        for b, wb in _log_weights(axes[1], n):
            for c, wc in _log_weights(axes[2], k):
                out += wa * wb * wc * math.log(rate[a, b, c])
    return math.exp(out)


def _attention_rate(grid: tuple, phase: str, seq: int, head_dim: int) -> float:
    """The CPU's measured attention rate for ``phase`` at (``seq``, ``head_dim``), interpolated
    in log(seq) and log(head_dim) between the measured points (flat beyond them)."""
    points = {(s, h): r for p, s, h, r in grid if p == phase}
    seqs, dims = sorted({s for s, _ in points}), sorted({h for _, h in points})
    out = 0.0
    for s, ws in _log_weights(seqs, seq):
        for h, wh in _log_weights(dims, head_dim):
            out += ws * wh * math.log(points[s, h])
    return math.exp(out)


def _log_weights(values: list, x: float) -> list:
    """((value, weight), ...): the two measured values around x and their weights, linear in
    log(x); the end one alone beyond the ends."""
    x = min(max(x, values[0]), values[-1])
    hi = next(i for i, v in enumerate(values) if v >= x)
    if values[hi] == x or hi == 0:
        return [(values[hi], 1.0)]
    w = math.log(x / values[hi - 1]) / math.log(values[hi] / values[hi - 1])
    return [(values[hi - 1], 1 - w), (values[hi], w)]


def _run_as(k: Kernel) -> str:
    """The phase whose measured rate a kernel runs at: a recomputed kernel is a forward again."""
    return "forward" if k.phase == "recompute" else k.phase


def _op_bandwidth(device: DeviceKernels, k: Kernel) -> float:
    """A memory-bound kernel's bytes/s: on a CPU that measured its op, that op's rate at its
    size (bytes per launch, interpolated in log(bytes)); else the achievable bandwidth."""
    if k.op and device.op_rates:
        curve = sorted((b, r) for op, phase, b, r in device.op_rates
                       if op == k.op and phase == _run_as(k))
        if curve:
            return _interpolate(curve, k.bytes / k.launches)
    return device.achievable_bandwidth


def _interpolate(table, x: float) -> float:
    """y at x from (x, y) points, linear in log(x), flat beyond the ends."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return y0 + w * (y1 - y0)
    return table[-1][1]


def _flash_table(device: DeviceKernels, impl: str) -> dict:
    """The device's throughput table for FlashAttention ``impl`` ("flash3" falls back to
    "flash2" on a GPU that has no FlashAttention-3: it is written for Hopper)."""
    return device.flash.get(impl) or device.flash["flash2"]


def _flash_rate(device: DeviceKernels, impl: str, phase: str, seq: int, precision: str) -> float:
    """FlashAttention's published throughput at this sequence length (a fp32 run: scaled by the
    TF32/BF16 peak ratio, as GEMMs are)."""
    rate = _interpolate(_flash_table(device, impl)[phase], seq)
    return rate * (device.peak_tf32 / device.peak_bf16 if precision == "fp32" else 1.0)


def kernel_seconds(k: Kernel, device: DeviceKernels, precision: str = "bf16-mixed",
                   gemm=gemm_seconds) -> tuple[float, float]:
    """(seconds of work, seconds of launch) for one kernel.  GPU: the work, but no less than the
    launch floor per launch — the shortfall is "launch" (the GPU waits for the CPU).  CPU: the
    work plus PyTorch's per-op dispatch overhead for every launch (the CPU that dispatches is the
    one that computes, so the two do not overlap).  ``gemm`` prices a matrix product: a function
    shaped like :func:`gemm_seconds`, ``gemm(device, m, n, k, batch, precision) -> seconds`` (the
    seam lesson 07's exercise fills)."""
    if k.kind == "gemm":
        m, n, kk = k.shape
        work = gemm(device, m, n, kk, k.batch, precision)
    elif k.kind == "attention" and device.flash:
        work = max(k.flops / _flash_rate(device, k.impl or "flash2", _run_as(k), k.seq, precision),
                   k.bytes / device.achievable_bandwidth)
    elif k.kind == "attention" and device.attention_grid and k.head_dim:
        work = k.flops / _attention_rate(device.attention_grid, _run_as(k), k.seq, k.head_dim)
    elif k.kind == "attention":  # a CPU not measured so: the fused kernel at its size's GEMM rate
        work = k.flops / _cpu_rate(device, k.flops / k.launches)
    else:
        work = k.bytes / _op_bandwidth(device, k)
    floor = k.launches * device.dispatch.get(k.kind, device.launch_s)
    if device.per_op:
        return work, floor
    return work, max(0.0, floor - work)


@dataclass
class Compute:
    """One rank's compute for one step, in seconds: ``forward_s``, ``backward_s``,
    ``recompute_s`` (forwards run again in backward), ``optimizer_s``; ``by_kind`` the same total
    split into "gemm", "attention", "memory", "optimizer" and "launch"; ``kernels`` one block's
    kernels and the head's, embedding's and optimizer's (a lesson prints them);
    ``model_flops`` the step's FLOPs without recomputation (MFU's numerator)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    optimizer_s: float
    by_kind: dict
    kernels: list
    model_flops: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.optimizer_s

    def mfu(self, peak: float) -> float:
        """Model FLOPs utilization: model FLOPs / (time × peak FLOP/s)."""
        return self.model_flops / (self.total_s * peak)


#: What backward may run again of a block's forward (:func:`_recomputed`)
RECOMPUTE = ("none", "selective", "op", "full")


def _recomputed(kernels: list[Kernel], stack: Stack, recompute: str) -> list[Kernel]:
    """The forward kernels backward runs again: all of a block's ("full"); its attention core's
    ("selective", Korthikanti et al., 2022; nothing with FlashAttention, whose backward
    recomputes the scores already); every other matrix product of the block (the second, the
    fourth, ...) and every memory-bound kernel, the attention kernel's output saved ("op":
    torchtitan's per-op selective checkpointing, torchtitan/distributed/activation_checkpoint.py,
    which saves the output of every odd mm and of attention and recomputes the rest)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    forward = [k for k in kernels if k.phase == "forward"]
    if recompute == "full":
        return forward
    if recompute == "op":
        gemms = [k for k in forward if k.kind == "gemm"]
        again = {id(k) for k in gemms[1::2]}
        return [k for k in forward if id(k) in again or k.kind == "memory"]
    if recompute == "selective" and not stack.fused_attention:
        return [k for k in forward if k.name.startswith("attention") and k.name != "attention out"]
    return []


def rank_compute(cfg: GPTConfig, device: DeviceKernels, stack: Stack | None = None, *,
                 tokens_per_microbatch: int | None = None, micro_batch: int = 1,
                 microbatches: int = 1, blocks: int | None = None, head: bool = True,
                 embed: bool = True, tp: int = 1, cp: int = 1, sp: bool = False, ep: int = 1,
                 opt_params: float | None = None, precision: str = "bf16-mixed",
                 recompute: str | None = None, gemm=gemm_seconds) -> Compute:
    """One rank's compute for a step: ``microbatches`` micro-batches of ``micro_batch``
    sequences (``tokens_per_microbatch`` / ``micro_batch`` positions each; default the model's
    ``seq_len``) through its ``blocks`` blocks (default all), the head and embedding if it holds
    them, and the optimizer step over ``opt_params`` parameters (default: the rank's share of
    what it holds).  ``recompute`` (default the stack's): one of :data:`RECOMPUTE`.
    ``gemm``: what prices each matrix product (:func:`kernel_seconds`)."""
    stack = stack or default_stack(device)
    recompute = stack.recompute if recompute is None else recompute
    blocks = cfg.n_layer if blocks is None else blocks
    seq = tokens_per_microbatch // micro_batch if tokens_per_microbatch else cfg.seq_len
    shape = dict(micro_batch=micro_batch, seq=seq, tp=tp, cp=cp, precision=precision)
    block = block_kernels(cfg, stack, sp=sp, ep=ep, **shape)
    counted = [(k, blocks * microbatches) for k in block]
    counted += [(_as_recompute(k), blocks * microbatches)
                for k in _recomputed(block, stack, recompute)]
    extra = (head_kernels(cfg, stack, sp=sp, **shape) if head else []) + \
            (embed_kernels(cfg, stack, **shape) if embed else [])
    counted += [(k, microbatches) for k in extra]
    if opt_params is None:
        opt_params = _held_params(cfg, blocks, head, embed, tp, ep)
    step = Kernel("Adam", "optimizer", "step", bytes=ADAM_BYTES * opt_params,
                  launches=_held_tensors(cfg, blocks, head, embed, ep))
    counted.append((step, 1))
    phases = {"forward": 0.0, "backward": 0.0, "recompute": 0.0, "step": 0.0}
    by_kind = dict.fromkeys(("gemm", "attention", "memory", "optimizer", "launch"), 0.0)
    for k, times in counted:
        work, launch = kernel_seconds(k, device, precision, gemm)
        phases[k.phase] += times * (work + launch)
        by_kind[k.kind] += times * work
        by_kind["launch"] += times * launch
    tokens = microbatches * micro_batch * seq // cp
    flops = training_flops(cfg, tokens, blocks, head, keys=seq, tp=tp)
    return Compute(phases["forward"], phases["backward"], phases["recompute"], phases["step"],
                   by_kind, block + extra + [step], flops)


def _as_recompute(k: Kernel) -> Kernel:
    return replace(k, phase="recompute")


def _held_params(cfg: GPTConfig, blocks: int, head: bool, embed: bool, tp: int, ep: int) -> float:
    """Parameters a rank holds: its blocks' share under tensor parallelism (its n_expert/ep
    experts), the head and embedding when it has them."""
    block = cfg.block_params()
    if cfg.n_expert:
        block -= cfg.n_expert * cfg.mlp_params() * (1 - 1 / ep)
    return (blocks * block + (cfg.head_params() if head else 0)
            + (cfg.embed_params() if embed else 0)) / tp


def state_bytes(cfg: GPTConfig, blocks: int, head: bool, embed: bool, tp: int, ep: int) -> float:
    """Bytes of model states a rank keeps for its parameters: the weight, its gradient and
    Adam's two moments, fp32 each (16 bytes a parameter)."""
    return 16 * _held_params(cfg, blocks, head, embed, tp, ep)


def _held_tensors(cfg: GPTConfig, blocks: int, head: bool, embed: bool, ep: int) -> int:
    """Parameter tensors a rank holds — what PyTorch's Adam steps one at a time (its for-loop
    implementation, the CPU's default): per block two norms, attention's projections and the
    MLP's linears, with their biases where the model has them; the embedding (and learned
    positions), the final norm and the output layer."""
    norm = 2 if cfg.norm == "layernorm" else 1
    per_linear = 2 if cfg.bias else 1
    mlp = (3 if cfg.mlp == "swiglu" else 2) * per_linear
    if cfg.n_expert:
        mlp = mlp * cfg.n_expert // ep + 1  # the rank's experts and the router (no bias)
    # GPT's fused QKV has no bias, its output projection one; Llama's Q, K, V, O have none
    attention = 4 if cfg.llama_fields() else 1 + per_linear
    block = 2 * norm + attention + mlp
    return (blocks * block + (norm + (0 if cfg.tie_weights else 1) if head else 0)
            + ((2 if cfg.positions == "learned" else 1) if embed else 0))


def format_kernels(kernels: list[Kernel], device: DeviceKernels,
                   precision: str = "bf16-mixed") -> str:
    """A table of kernels, one a line: phase, name, kind, GEMM shape, GFLOPs, MB moved, µs of work
    and of launch, and the rate it runs at."""
    lines = [f"{'phase':<9} {'kernel':<30} {'kind':<9} {'m×n×k (×batch)':<22} {'GFLOP':>8} "
             f"{'MB':>9} {'µs':>9} {'launch':>7} {'TFLOP/s':>8}"]
    for k in kernels:
        work, launch = kernel_seconds(k, device, precision)
        shape = "×".join(map(str, k.shape)) + (f" ×{k.batch}" if k.batch > 1 else "") if k.shape else ""
        rate = f"{k.flops / work / 1e12:8.1f}" if k.flops and work else f"{'':>8}"
        lines.append(f"{k.phase:<9} {k.name[:30]:<30} {k.kind:<9} {shape:<22} {k.flops / 1e9:8.2f} "
                     f"{k.bytes / 1e6:9.2f} {work * 1e6:9.1f} {launch * 1e6:7.1f} {rate}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The CPU: the same model from a calibration measured here
# --------------------------------------------------------------------------------------------------


def cpu_kernels(calibration: dict, name: str = "this machine's CPU") -> DeviceKernels:
    """A CPU priced from measured numbers (:func:`calibrate_kernels`): ``gemm_shapes`` ((m, n,
    k, FLOP/s), ...) on a grid of shapes, interpolated by a GEMM's shape (without it, ``gemm``:
    ((FLOPs, FLOP/s), ...) at a few square sizes, by its FLOPs); ``bandwidth`` (bytes/s
    of a large copy); ``op_overhead_s`` (PyTorch's dispatch time of one op, paid by every
    kernel on top of its work: on a CPU the dispatch and the work run on the same cores) and,
    where measured, ``dispatch`` — that time per kernel of each kind, from the ops PyTorch's
    eager autograd really dispatches around one (a linear layer's transposes and gradient
    accumulation, attention's head reshapes)."""
    rates: dict = {}
    for f, r in calibration["gemm"]:  # one rate per size: the best measured at it
        rates[float(f)] = max(float(r), rates.get(float(f), 0.0))
    curve = tuple(sorted(rates.items()))
    rate = max(r for _, r in curve)
    bw = float(calibration["bandwidth"])
    return DeviceKernels(name, 0, rate, rate, rate, bw, bw, float(calibration["op_overhead_s"]),
                         per_op=True, gemm_curve=curve, tiles=(),
                         gemm_grid=tuple(tuple(p) for p in calibration.get("gemm_shapes") or ()),
                         gemm_grid_cold=tuple(tuple(p) for p in
                                              calibration.get("gemm_shapes_cold") or ()),
                         cache_bytes=float(calibration.get("cache_bytes") or 0.0),
                         op_rates=tuple(tuple(p) for p in calibration.get("ops") or ()),
                         attention_grid=tuple(tuple(p) for p in calibration.get("attention") or ()),
                         dispatch={k: float(v) for k, v in
                                   (calibration.get("dispatch") or {}).items()},
                         source="measured here by calibrate_kernels(): GEMM rates by size, an "
                                "8 MB copy, the dispatch time of a linear layer, an elementwise "
                                "op and attention on tiny tensors, forward and backward")


def for_working_set(device: DeviceKernels, state_bytes: float) -> DeviceKernels:
    """The CPU ``device`` for a rank that keeps ``state_bytes`` of model states (weights,
    gradients, Adam's moments): past the size of its largest cache, each GEMM reads operands the
    rest of the step has pushed out of it, and runs at the rates measured with operands in
    memory (``gemm_grid_cold``); within it, at the cached rates.  A GPU is returned as it is."""
    if not device.per_op or not device.gemm_grid_cold or not device.cache_bytes:
        return device
    if state_bytes <= device.cache_bytes:
        return device
    return replace(device, gemm_grid=device.gemm_grid_cold)


def cache_bytes() -> float:
    """The size of this CPU's largest cache (Linux's /sys; 0 where it cannot be read)."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return float(max(sizes, default=0))


def _typical_time(fn, repeats: int, budget_s: float = 2e-3) -> float:
    """The median of ``repeats`` timings of ``fn``, each the mean over as many calls as fill about
    ``budget_s`` (a single short call is mostly the clock's and the scheduler's noise).  The
    median, not the best: a training step's kernels run at the machine's typical speed, and on a
    shared machine the best of a few timings is the moment nothing else ran."""
    t0 = now()
    fn()  # warm-up, and the size of one call
    calls = max(1, min(1000, int(budget_s / max(now() - t0, 1e-7))))
    times = []
    for _ in range(repeats):
        t0 = now()
        for _ in range(calls):
            fn()
        times.append((now() - t0) / calls)
    times.sort()
    return times[len(times) // 2]


#: The sizes of each dimension of the CPU's grid of measured GEMM shapes (m, n, k)
GRID = (16, 128, 512)


def calibrate_kernels(repeats: int = 3) -> dict:
    """Measure this CPU in under a second: fp32 matrix products (square 32…512 and two skinny
    shapes; every m×n×k of :data:`GRID`), an 8 MB copy, and on tensors too small to take any time but their dispatch,
    forward and backward: a trivial op (two dispatched ops, so half is one op's overhead), and
    the time per modelled kernel of a linear layer (its three GEMMs, with what PyTorch dispatches
    around them: the weight's transpose, the bias's sum, gradient accumulation), of an
    elementwise op (GeLU: one kernel each way) and of attention (scaled_dot_product_attention
    with the heads' reshapes, one kernel each way) — each less a bare sum's forward and backward,
    the loss every measurement ends in; and Adam's step of one tiny tensor (its time per
    parameter tensor)."""
    import torch
    import torch.nn.functional as F

    gemm = []
    for m, n, k in [(s, s, s) for s in (32, 64, 128, 256, 512)] + [(1, 512, 512), (2048, 64, 64)]:
        a, b = torch.randn(m, k, device="cpu"), torch.randn(k, n, device="cpu")
        gemm.append((2.0 * m * n * k, 2.0 * m * n * k / _typical_time(lambda: a @ b, repeats)))
    def cached(m, n, k):
        a, b = torch.randn(m, k, device="cpu"), torch.randn(k, n, device="cpu")
        return lambda: a @ b

    shapes = _shape_grid(cached, repeats)
    cache = cache_bytes()
    cold = _cold_grid(repeats, cache) if cache else []
    src = torch.randn(2 << 20, device="cpu")  # 8 MB of fp32
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _typical_time(lambda: dst.copy_(src), repeats)
    x = torch.ones(1, requires_grad=True, device="cpu")

    def tiny():
        (x * 2).backward()

    overhead = _typical_time(tiny, repeats) / 2
    h = torch.randn(2, 4, 8, requires_grad=True, device="cpu")
    linear = torch.nn.Linear(8, 8)

    def bare():
        h.sum().backward()

    def attention():
        q, k, v = (h.view(2, 4, 2, 4).transpose(1, 2) for _ in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.transpose(1, 2).reshape(2, 4, 8).sum().backward()

    base = _typical_time(bare, repeats)
    per_kernel = {"gemm": (lambda: linear(h).sum().backward(), 3),
                  "memory": (lambda: F.gelu(h).sum().backward(), 2),
                  "attention": (attention, 2)}
    dispatch = {kind: max(overhead, (_typical_time(fn, repeats) - base) / kernels)
                for kind, (fn, kernels) in per_kernel.items()}
    weight = torch.nn.Parameter(torch.randn(8, device="cpu"))
    weight.grad = torch.randn(8, device="cpu")
    adam = torch.optim.Adam([weight])
    dispatch["optimizer"] = max(overhead, _typical_time(adam.step, repeats))  # per tensor
    return {"gemm": [list(p) for p in gemm], "gemm_shapes": [list(p) for p in shapes],
            "gemm_shapes_cold": [list(p) for p in cold], "cache_bytes": cache,
            "bandwidth": bandwidth, "op_overhead_s": overhead, "dispatch": dispatch,
            "ops": _calibrate_ops(repeats, overhead),
            "attention": _calibrate_attention(repeats, overhead)}


def _shape_grid(product, repeats: int) -> list:
    """[(m, n, k, FLOP/s), ...] for every m×n×k of :data:`GRID`; ``product(m, n, k)`` returns the
    call that multiplies an m×k by a k×n matrix."""
    return [(m, n, k, 2.0 * m * n * k / _typical_time(product(m, n, k), repeats))
            for m in GRID for n in GRID for k in GRID]


def _cold_grid(repeats: int, cache: float) -> list:
    """:func:`_shape_grid` with every product's operands taken in turn from a buffer twice the
    cache's size (at most 128 MB), so each call reads them from memory."""
    import torch

    pool = torch.full((int(min(max(2 * cache, 16 << 20), 128 << 20)) // 4,), 0.5, device="cpu")

    def rotating(m, n, k):
        size = m * k + k * n
        slots, turn = max(1, pool.numel() // size), [0]

        def product():
            at = (turn[0] % slots) * size
            turn[0] += 1
            return pool[at:at + m * k].view(m, k) @ pool[at + m * k:at + size].view(k, n)
        return product

    return _shape_grid(rotating, repeats)


#: The elementwise ops a CPU calibration times (:func:`_calibrate_ops`), by the name a memory-bound
#: :class:`Kernel`'s ``op`` gives, with the bytes per element the model counts for one forward
#: (the backward twice that): LayerNorm reads and writes, GeLU too, an add reads two and writes one
CPU_OPS = {"norm": 2, "gelu": 2, "add": 3}
#: The sizes (fp32 elements) each op is timed at: the course's smallest activations and its
#: largest MLP activations
OP_SIZES = (1 << 14, 1 << 19)
#: The (sequence, head dimension) grid a CPU's attention is timed on
ATTENTION_GRID = ((32, 128), (16, 64))


def _calibrate_ops(repeats: int, overhead: float) -> list:
    """[(op, phase, bytes, bytes/s), ...] for each op of :data:`CPU_OPS` at each of
    :data:`OP_SIZES`: forward the op, backward its autograd gradient (an add's backward is the
    gradients' sum where the residual stream forks: an add), each less one op's dispatch, in the
    bytes the model counts for it."""
    import torch
    import torch.nn.functional as F

    out = []
    for elems in OP_SIZES:
        x = torch.randn(elems // 256, 256, requires_grad=True, device="cpu")
        g = torch.randn(elems // 256, 256, device="cpu")
        w = torch.ones(256, requires_grad=True, device="cpu")
        b = torch.zeros(256, requires_grad=True, device="cpu")
        forwards = {"norm": (lambda: F.layer_norm(x, (256,), w, b), (x, w, b)),
                    "gelu": (lambda: F.gelu(x), (x,)),
                    "add": (lambda: x + g, None)}
        for op, (fn, inputs) in forwards.items():
            nbytes = CPU_OPS[op] * elems * 4
            forward = max(_typical_time(fn, repeats) - overhead, overhead)
            if inputs is None:
                backward = forward
            else:
                y = fn()
                backward = max(_typical_time(lambda: torch.autograd.grad(
                    y, inputs, g, retain_graph=True), repeats) - overhead, overhead)
            out += [[op, "forward", nbytes, nbytes / forward],
                    [op, "backward", 2 * nbytes, 2 * nbytes / backward]]
    return out


def _calibrate_attention(repeats: int, overhead: float) -> list:
    """[(phase, seq, head_dim, FLOP/s), ...]: causal scaled_dot_product_attention (4 sequences,
    4 heads) on :data:`ATTENTION_GRID`, forward and backward, at the FLOPs the model counts
    (:func:`_attention_core`), each less one op's dispatch."""
    import torch
    import torch.nn.functional as F

    out = []
    for seq in ATTENTION_GRID[0]:
        for hd in ATTENTION_GRID[1]:
            q, k, v = (torch.randn(4, 4, seq, hd, requires_grad=True, device="cpu") for _ in range(3))
            g = torch.randn(4, 4, seq, hd, device="cpu")

            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            flops = 4.0 * 4 * 4 * seq * seq * hd / 2
            y = forward()
            fwd = max(_typical_time(forward, repeats) - overhead, overhead)
            bwd = max(_typical_time(lambda: torch.autograd.grad(y, (q, k, v), g, retain_graph=True),
                                 repeats) - overhead, overhead)
            out += [["forward", seq, hd, flops / fwd], ["backward", seq, hd, 2.5 * flops / bwd]]
    return out
