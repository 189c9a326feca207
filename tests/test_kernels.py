"""The kernel model of a training step (minitrain/planning/kernels.py) and the Llama shapes of
GPTConfig: the GEMM rule (wave and tile quantization, the roofline's two sides), fused and unfused
traffic, materialized and flash attention, the stacks, the Llama counts against Meta's published
ones, and a sanity range for a large model's MFU."""

from __future__ import annotations

import pytest

from minitrain.model import GPT, GPTConfig, block_flops, training_flops
from minitrain.planning.kernels import (DEVICES, STACKS, Kernel, block_kernels, calibrate_kernels,
                                        cpu_kernels, default_stack, format_kernels,
                                        gemm_quantization, gemm_seconds, kernel_seconds,
                                        rank_compute)
from minitrain.planning.scaling import MODEL_SIZES

H100, A100 = DEVICES["H100 SXM"], DEVICES["A100 SXM"]
SMALL = GPTConfig(vocab_size=13, seq_len=32, n_layer=1, n_head=4, d_model=64)


# --- the GEMM rule -------------------------------------------------------------------------------


def test_a_gemm_one_tile_past_a_full_wave_takes_a_second_wave():
    """1536×2816 with 256×128 tiles is 6×22 = 132 tiles, one wave on the H100's 132 SMs; one
    more column makes 6×23 = 138: no tile shape does that in one wave, and the time doubles."""
    one = gemm_seconds(H100, 1536, 2816, 16384)
    two = gemm_seconds(H100, 1536, 2817, 16384)
    assert two / one == pytest.approx(2.0, rel=0.02)


def test_tile_quantization_pads_the_edge_tiles():
    """With 128×128 tiles and 132 column tiles, m = 513 runs 5 row tiles (5 waves), as m = 640
    does: the same time, 5/4 of m = 512's 4 waves."""
    tiles = ((128, 128),)
    t513 = gemm_seconds(H100, 513, 16896, 4096, tiles=tiles)
    t640 = gemm_seconds(H100, 640, 16896, 4096, tiles=tiles)
    t512 = gemm_seconds(H100, 512, 16896, 4096, tiles=tiles)
    assert t513 == pytest.approx(t640)
    assert t513 == pytest.approx(5 / 4 * t512)
    _, useful = gemm_quantization(H100, 129, 8448, tiles=tiles)
    _, full = gemm_quantization(H100, 256, 8448, tiles=tiles)
    assert useful == pytest.approx(full * 129 / 256)


def test_one_named_tile_fills_a_wave_at_mamf_and_quantizes_by_its_own_waves():
    """tiles=((128, 128),): that tile is what MAMF was measured with, so 132 full tiles (one wave)
    run at MAMF, and 133 take two waves (lesson 07's exercise is priced by this rule)."""
    one, k = ((128, 128),), 8192
    full = gemm_seconds(H100, 12 * 128, 11 * 128, k, tiles=one)  # 132 tiles
    assert 2 * 12 * 128 * 11 * 128 * k / full == pytest.approx(H100.mamf)
    assert gemm_seconds(H100, 7 * 128, 19 * 128, k, tiles=one) == pytest.approx(
        2 * 7 * 128 * 19 * 128 * k / (H100.mamf * 133 / 264))


def test_a_gemm_pricer_threads_through_the_step_and_only_its_gemms_change():
    """rank_compute(gemm=...) prices every GEMM with the function given, nothing else."""
    cfg = MODEL_SIZES["7b"]
    base = rank_compute(cfg, H100, STACKS["flash"])
    same = rank_compute(cfg, H100, STACKS["flash"], gemm=gemm_seconds)
    twice = rank_compute(cfg, H100, STACKS["flash"],
                         gemm=lambda *a, **kw: 2 * gemm_seconds(*a, **kw))
    assert same.total_s == base.total_s
    assert twice.by_kind["gemm"] == pytest.approx(2 * base.by_kind["gemm"])
    for kind in ("attention", "memory", "optimizer"):
        assert twice.by_kind[kind] == base.by_kind[kind]


def test_a_skinny_gemm_is_priced_by_its_bytes():
    m, n, k = 1, 8192, 8192
    nbytes = 2 * (m * k + k * n + m * n)
    assert gemm_seconds(H100, m, n, k) == pytest.approx(nbytes / H100.achievable_bandwidth)


def test_a_large_square_gemm_runs_near_mamf():
    n = 16384
    rate = 2 * n ** 3 / gemm_seconds(H100, n, n, n)
    assert 0.95 * H100.mamf < rate <= H100.mamf
    fp32 = 2 * n ** 3 / gemm_seconds(H100, n, n, n, precision="fp32")
    assert fp32 == pytest.approx(rate * 494.7 / 989)


def test_a_short_kernel_takes_the_launch_floor_on_a_gpu_and_pays_dispatch_on_a_cpu():
    tiny = Kernel("add", "memory", "forward", bytes=1e3)
    work, launch = kernel_seconds(tiny, H100)
    assert work + launch == pytest.approx(H100.launch_s)
    cpu = cpu_kernels({"gemm": [[1e6, 1e10], [1e8, 5e10]], "bandwidth": 1e10,
                       "op_overhead_s": 5e-6})
    work, launch = kernel_seconds(tiny, cpu)
    assert (work, launch) == pytest.approx((1e3 / 1e10, 5e-6))


# --- what a stack runs ---------------------------------------------------------------------------


def _bytes(kernels, prefix=""):
    return sum(k.bytes for k in kernels if k.kind == "memory" and k.name.startswith(prefix))


def test_fused_kernels_move_fewer_bytes_than_unfused_exact_counts():
    eager = block_kernels(SMALL, STACKS["eager"], micro_batch=2)
    flash = block_kernels(SMALL, STACKS["flash"], micro_batch=2)
    rows, ff = 2 * 32, 4 * 64
    gelu = [k for k in eager if k.name.startswith("gelu") and k.phase == "forward"]
    assert [(k.bytes, k.launches) for k in gelu] == [(8 * 2 * rows * ff * 2, 8)]
    fused = [k for k in flash if k.name == "gelu" and k.phase == "forward"]
    assert [k.bytes for k in fused] == [2 * rows * ff * 2]
    add = [k for k in flash if k.name == "residual add 1" and k.phase == "forward"]
    assert [k.bytes for k in add] == [3 * rows * 64 * 2]  # read two, write one; no dropout
    assert _bytes(flash) < _bytes(eager)


def test_flash_reads_no_score_matrix_and_eager_grows_with_its_square():
    cfg = MODEL_SIZES["7b"]

    def attention_bytes(stack, seq):
        return sum(k.bytes for k in block_kernels(cfg, STACKS[stack], seq=seq)
                   if k.name.startswith("attention") and k.kind != "gemm")

    assert attention_bytes("flash", 4096) == pytest.approx(2 * attention_bytes("flash", 2048))
    assert attention_bytes("eager", 4096) == pytest.approx(4 * attention_bytes("eager", 2048))
    assert attention_bytes("flash", 2048) < attention_bytes("eager", 2048) / 20


def test_the_stacks_presets():
    assert set(STACKS) == {"eager", "sdpa", "megatron-2021", "flash"}
    for name, stack in STACKS.items():
        assert stack.name == name and len(stack.source) > 40
        assert stack.attention in ("materialized", "flash2", "flash3")
        assert stack.recompute in ("none", "selective", "full")
    assert STACKS["eager"].fuses == frozenset() and not STACKS["eager"].tp_overlap
    assert "softmax" in STACKS["megatron-2021"].fuses and STACKS["megatron-2021"].attention == "materialized"
    assert STACKS["flash"].attention == "flash3" and STACKS["flash"].tp_overlap
    assert STACKS["sdpa"].attention == "flash2" and STACKS["sdpa"].fuses == {"gelu"}
    for device in DEVICES.values():
        assert default_stack(device) is STACKS["flash"]
        assert device.source and device.sms in (108, 132)
        assert STACKS["flash"].overlap_slowdown(device) > 1
    assert H100.sms / (H100.sms - 20) == STACKS["flash"].overlap_slowdown(H100)


# --- Llama shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, published", [("llama3-8b", 8_030_261_248),
                                              ("llama3-70b", 70_553_706_496)])
def test_llama_counts_equal_the_published_ones(name, published):
    """Meta's safetensors hold 8,030,261,248 and 70,553,706,496 parameters (Llama 3 8B, 70B)."""
    cfg = MODEL_SIZES[name]
    assert cfg.num_params() == published
    d, kv, ff, s, V, L = cfg.d_model, cfg.kv_dim, cfg.ff, cfg.seq_len, cfg.vocab_size, cfg.n_layer
    assert kv == 8 * 128
    per_token = 2 * (2 * d * d + 2 * d * kv) + 2 * 2 * s * d + 2 * 3 * d * ff
    assert block_flops(cfg) == per_token
    assert training_flops(cfg, 1) == 3 * (L * per_token + 2 * d * V)


def test_gpt_refuses_llama_shapes_and_the_config_refuses_bad_fields():
    with pytest.raises(ValueError, match="projection targets only"):
        GPT(MODEL_SIZES["llama3-8b"])
    with pytest.raises(ValueError, match="projection targets only"):
        GPT(GPTConfig(norm="rmsnorm"))
    GPT(GPTConfig(n_kv_head=4))  # as many K/V heads as heads: GPT-2's attention
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="'gelu', 'swiglu'"):
        GPTConfig(mlp="relu")
    with pytest.raises(ValueError, match="positions"):
        GPTConfig(positions="alibi")


# --- a whole step --------------------------------------------------------------------------------


def test_a_large_models_mfu_is_plausible_and_eager_is_below_flash():
    """Llama 3 70B, tensor parallel 8 with sequence parallelism, 8 micro-batches of one 8k
    sequence: the compute alone lands between a third of peak and the matmul ceiling
    (MAMF / peak); eager PyTorch, with its materialized scores and op-by-op elementwise
    kernels, lower; the parts add up."""
    cfg = MODEL_SIZES["llama3-70b"]
    shape = dict(micro_batch=1, microbatches=8, blocks=cfg.n_layer // 4, tp=8, sp=True)
    flash = rank_compute(cfg, H100, STACKS["flash"], **shape)
    eager = rank_compute(cfg, H100, STACKS["eager"], **shape)
    assert 0.35 < flash.mfu(H100.peak_bf16) < H100.mamf / H100.peak_bf16
    assert eager.mfu(H100.peak_bf16) < flash.mfu(H100.peak_bf16)
    for c in (flash, eager):
        assert sum(c.by_kind.values()) == pytest.approx(c.total_s)
    gpt = rank_compute(MODEL_SIZES["7b"], A100, STACKS["megatron-2021"], microbatches=4)
    assert gpt.recompute_s > 0.2 * gpt.forward_s  # full recomputation runs the blocks again
    assert "QKV" in format_kernels(gpt.kernels, A100) and "K dW" in format_kernels(flash.kernels, H100)


def test_the_cpu_is_calibrated_and_prices_a_step():
    cal = calibrate_kernels()
    cpu = cpu_kernels(cal)
    assert cal["bandwidth"] > 1e8 and 0 < cal["op_overhead_s"] < 1e-3
    step = rank_compute(SMALL, cpu, micro_batch=8, precision="fp32")
    assert step.by_kind["launch"] > 0 and step.total_s > 0
    assert default_stack(cpu) is STACKS["sdpa"]


def test_full_recomputation_with_flash_runs_the_flash_forward_again():
    cfg, device = MODEL_SIZES["7b"], DEVICES["H100 SXM"]
    full = rank_compute(cfg, device, STACKS["flash"], recompute="full")
    blocks = rank_compute(cfg, device, STACKS["flash"], recompute="none", head=False, embed=False)
    assert full.recompute_s == pytest.approx(blocks.forward_s, rel=1e-9)  # the blocks' forward
    assert full.by_kind["attention"] > blocks.by_kind["attention"]


def test_flash_attention_2_and_3_at_their_published_rates():
    """On an H100, FlashAttention-3 runs at its own published throughput and -2 at its (Shah et
    al., 2024, Figs. 5-6: 602 and 333 TFLOP/s forward at 8k positions); an A100 has only -2."""
    cfg = GPTConfig(vocab_size=1000, seq_len=8192, n_layer=1, n_head=32, d_model=4096)
    h100, a100 = DEVICES["H100 SXM"], DEVICES["A100 SXM"]

    def forward(stack, device):
        k = next(k for k in block_kernels(cfg, STACKS[stack]) if k.kind == "attention")
        return k.flops / kernel_seconds(k, device)[0]
    assert forward("flash", h100) == pytest.approx(602e12)
    assert forward("sdpa", h100) == pytest.approx(333e12)
    assert forward("flash", a100) == forward("sdpa", a100)


def test_the_optimizer_steps_every_parameter_tensor_the_rank_holds():
    """Adam's for-loop steps each parameter tensor with its own ops: the count of tensors is the
    model's, whatever its shape (GPT's bias-free fused QKV, a mixture of experts, Llama's)."""
    from minitrain.model import PRESETS
    from minitrain.planning.kernels import _held_tensors

    for cfg in (PRESETS["tiny"], PRESETS["small"], PRESETS["tiny-moe"], GPTConfig(tie_weights=True)):
        assert _held_tensors(cfg, cfg.n_layer, True, True, 1) == len(list(GPT(cfg).parameters()))
    llama = MODEL_SIZES["llama3-8b"]  # per block 2 norms, q, k, v, o, gate, up, down: 9
    assert _held_tensors(llama, 32, True, True, 1) == 32 * 9 + 1 + 2  # embedding; norm, output
    step = rank_compute(PRESETS["tiny"], DEVICES["H100 SXM"]).kernels[-1]
    assert step.kind == "optimizer" and step.launches == 49


def test_torchtitans_per_op_checkpointing_runs_every_other_product_and_the_elementwise_again():
    """recompute="op": backward runs again the block's 2nd, 4th, 6th… matrix products (Llama's
    Q, K, V, O, gate, up, down: K, O and up) and all its memory-bound kernels, not attention;
    Llama's Q, K and V are three products whose FLOPs add up to the fused one's."""
    cfg = MODEL_SIZES["llama3-8b"]
    block = block_kernels(cfg, STACKS["sdpa"])
    gemms = [k.name for k in block if k.kind == "gemm" and k.phase == "forward"]
    assert gemms == ["Q", "K", "V", "attention out", "MLP gate", "MLP up", "MLP down"]
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    assert sum(k.flops for k in block if k.name in ("Q", "K", "V") and k.phase == "forward") \
        == pytest.approx(2 * cfg.seq_len * d * (d + 2 * kv))
    none = rank_compute(cfg, H100, STACKS["sdpa"], recompute="none", head=False, embed=False)
    op = rank_compute(cfg, H100, STACKS["sdpa"], recompute="op", head=False, embed=False)
    again = {k.name: k for k in op.kernels if k.phase == "forward"}
    expected = sum(kernel_seconds(again[name], H100)[0] + kernel_seconds(again[name], H100)[1]
                   for name in ("K", "attention out", "MLP up"))
    expected += sum(sum(kernel_seconds(k, H100)) for k in block
                    if k.phase == "forward" and k.kind == "memory")
    assert op.recompute_s == pytest.approx(cfg.n_layer * expected, rel=1e-9)
    assert op.forward_s == pytest.approx(none.forward_s) and none.recompute_s == 0
    with pytest.raises(ValueError, match="unknown recompute 'half'; choose one of: none, "
                                         "selective, op, full"):
        rank_compute(cfg, H100, STACKS["sdpa"], recompute="half")


def test_a_cpu_prices_attention_and_elementwise_ops_at_their_measured_rates():
    """A CPU calibration's own rates: scaled_dot_product_attention's FLOP/s by (sequence, head
    dimension), interpolated in their logs; a GeLU's and a LayerNorm's bytes/s at their size —
    not the copy bandwidth nor the GEMM rate."""
    cal = {"gemm": [[1e6, 1e10], [1e8, 5e10]], "bandwidth": 4e10, "op_overhead_s": 1e-6,
           "ops": [["gelu", "forward", 1e5, 2e9], ["gelu", "forward", 1e7, 8e9],
                   ["gelu", "backward", 1e5, 1e9], ["gelu", "backward", 1e7, 1e9]],
           "attention": [[phase, s, h, rate] for phase in ("forward", "backward")
                         for s, h, rate in ((32, 16, 1e9), (32, 64, 4e9), (128, 16, 4e9),
                                            (128, 64, 16e9))]}
    cpu = cpu_kernels(cal)
    gelu = Kernel("gelu", "memory", "forward", bytes=1e6, op="gelu")
    assert kernel_seconds(gelu, cpu)[0] == pytest.approx(1e6 / 5e9)  # halfway in log(bytes)
    norm = Kernel("norm", "memory", "forward", bytes=1e6, op="norm")  # not measured: bandwidth
    assert kernel_seconds(norm, cpu)[0] == pytest.approx(1e6 / 4e10)
    attention = Kernel("attention", "attention", "backward", flops=1e9, seq=64, head_dim=32,
                       impl="flash2")
    assert kernel_seconds(attention, cpu)[0] == pytest.approx(1e9 / 4e9)  # the grid's middle
    at_point = Kernel("attention", "attention", "forward", flops=1e9, seq=128, head_dim=16)
    assert kernel_seconds(at_point, cpu)[0] == pytest.approx(1e9 / 4e9)
    cfg = GPTConfig(vocab_size=13, seq_len=64, n_layer=1, n_head=4, d_model=128)
    ops = {k.op for k in block_kernels(cfg, STACKS["sdpa"], precision="fp32")}
    assert ops == {"", "norm", "gelu", "add"}
