"""Does the projection tell the truth?  Three checks, printed as ratios.

(a) Self-consistency: each run replayed with its own measured compute and this machine's α-β
    (fitted on the run's own messages, β from lesson 01's sweep) gives back its measured step time
    within 15 %: each recorded step but the first replayed and divided by its own measured time
    (all ranks), the median of those ratios judged (at least MIN_STEPS steps are run, so that one
    step that stalled on a shared machine does not decide), the mean step's ratio printed beside.
    What it took for ZeRO-3 (zero3 on 4 ranks, 0.76-0.90 in three of six runs before; on 2
    ranks, 0.84-0.95): pricing its collectives by what this machine does.  The α fitted on the run
    was timed on blocking collectives only (the forward's and backward's first gathers, the loss
    all-reduce: 11 a step, 1.24 ms each on 4 ranks sharing 2 cores, where lesson 01's sweep gives
    0.16 ms), so every prefetched gather was priced by the scheduler's delays.  Now every
    collective whose completion every member saw is timed (minitrain.planning.recorded.message_times),
    prefetched ones included, from when the replay would start it — its last issue, or the
    previous collective on its group done — to its last member's completion; gloo's reduce-scatter
    has no future in torch 2.13, so its completion is seen only by ranks already waiting, and
    timing just those (the slow ones) replayed zero3 on 2 ranks at 1.12-1.38: it is left untimed
    and takes the α of all.  α is the typical step's (the median over the steps of a step's mean),
    not the mean over all (a stalled step moved every gather's price: zero3 on 2 ranks, 1.26).
    Over 51 recorded runs replayed under these rules (every row three times, ddp, zero3 and tensor
    six): worst 12.9 % off (zero3 on 4 ranks 0.99-1.13, on 2 ranks 0.98-1.10).
(b) Published results: the same code path — a small run of the layout, projected on a preset at the
    published model size with the published degrees — against published measurements, within 25 %.
    Partly circular for the A100: the presets' sustained fraction of peak is Narayanan et al., 2021,
    Table 1, row 1 (1.7B GPT, 137 TFLOP/s per A100 = 44 %), and the 39.1B check below is a row of
    the same table (138 TFLOP/s) — the same team, code and cluster — so it tests the bubble and the
    communication the projection adds more than the compute rate.  minitrain/planning/clusters.py cites no
    independent source for a training step's A100 fraction: its only other A100 number, Bekman's
    Maximum Achievable Matmul FLOPS (86.9 % of peak), is a matmul ceiling, used to carry the anchor
    to the H100.  The H100 checks (Megatron-LM's table, torchtitan) are measurements not used to set
    any number, but their fraction is that same A100 anchor carried over.
(c) One model, not two: the projection of a small run scaled to a layout the chooser prices
    (:func:`minitrain.planning.chooser.evaluate` on the same preset) against the chooser's step
    time, within 20 %.

    python benchmarks/projection_bench.py [--steps 10] [--only a|b|c]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from minitrain import Cluster  # noqa: E402
from minitrain.planning.chooser import Layout, ModelSpec, Workload, evaluate  # noqa: E402
from minitrain.planning.clusters import get_cluster  # noqa: E402
from minitrain.model import PRESETS, GPTConfig  # noqa: E402
from minitrain.planning.projection import MODEL_SIZES, project  # noqa: E402
from minitrain.train import train  # noqa: E402

#: (a): (label, strategy, world size, options, batch, model)
SELF = [
    ("ddp, 2 ranks", "ddp", 2, {}, 8, "tiny"),
    ("ddp, 4 ranks", "ddp", 4, {}, 8, "tiny"),
    ("zero3, 2 ranks", "zero3", 2, {}, 8, "tiny"),
    ("zero3, 4 ranks", "zero3", 4, {}, 8, "tiny"),
    ("pipeline gpipe, 2 stages, m=4", "pipeline", 2, {"schedule": "gpipe", "microbatches": 4}, 8, "tiny"),
    ("pipeline gpipe, 2 stages, m=8", "pipeline", 2, {"schedule": "gpipe", "microbatches": 8}, 8, "tiny"),
    ("pipeline 1f1b, 2 stages, m=4", "pipeline", 2, {"schedule": "1f1b", "microbatches": 4}, 8, "tiny"),
    ("pipeline 1f1b, 2 stages, m=8", "pipeline", 2, {"schedule": "1f1b", "microbatches": 8}, 8, "tiny"),
    ("tensor, 2 ranks", "tensor", 2, {}, 8, "tiny"),
    ("3d, 2x2x2", "3d", 8, {"dp": 2, "pp": 2, "tp": 2}, 8, "tiny"),
    ("context, 2 ranks", "context", 2, {"cp": 2}, 8, "tiny"),
    ("expert, 2 ranks", "expert", 2, {}, 8, "tiny-moe"),
]


def _clusters():
    live: dict[int, Cluster] = {}

    def get(n: int) -> Cluster:
        if n not in live:
            live[n] = Cluster(n, timeout=60, threads=1)
        return live[n].start()
    return get, live


#: (a) runs at least this many steps: five replayed (the first is warm-up), an odd count whose
#: median is one step's ratio
MIN_STEPS = 6


def self_consistency(get, steps: int) -> list[float]:
    if steps < MIN_STEPS:
        print(f"(a) runs {MIN_STEPS} steps, not {steps}: a median of fewer replayed steps is "
              "one loaded machine's outlier away from its mean")
        steps = MIN_STEPS
    print("(a) self-consistency: each run replayed with its measured compute and this machine's "
          "α-β: replayed / measured, step by step (all ranks); the median judged, the mean step's "
          "shown")
    print(f"    {'run':34s} {'measured':>10s} {'replayed':>10s} {'median':>7s} {'mean':>7s}")
    ratios = []
    for label, strategy, world, options, batch, model in SELF:
        run = train(strategy=strategy, world_size=world, steps=steps, batch_size=batch,
                    options=options, model=PRESETS[model], cluster=get(world), project="local")
        p = project(run, "local")
        ratio = statistics.median(s / m for s, m in zip(p.step_times_s,
                                                        p.measured_step_times_s))
        mean = p.mean_step_time_s / p.measured_mean_step_s
        ratios.append(ratio)
        print(f"    {label:34s} {p.measured_step_s * 1e3:8.1f}ms {p.step_time_s * 1e3:8.1f}ms "
              f"{ratio:7.3f} {mean:7.3f} {'ok' if abs(ratio - 1) <= 0.15 else 'OUT OF 15%'}",
              flush=True)
    return ratios


# --------------------------------------------------------------------------------------------------
# (b) published configurations
# --------------------------------------------------------------------------------------------------

# NVIDIA/Megatron-LM README, "Performance Benchmarking", images/model_table.png (H100 clusters,
# vocabulary 131,072, sequence 4,096, overlapped DP/TP/PP communication): per-GPU model TFLOP/s
MEGATRON_1_7B = dict(cfg=GPTConfig(vocab_size=131072, seq_len=4096, n_layer=24, n_head=16,
                                   d_model=2048),
                     dp=48, tp=1, pp=1, batch=192, tflops=408.8, gpus=48)
MEGATRON_70B = dict(cfg=GPTConfig(vocab_size=131072, seq_len=4096, n_layer=84, n_head=64,
                                  d_model=8192),
                    dp=48, tp=8, pp=2, batch=384, tflops=419.7, gpus=768)
# Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", Table 1 (also NVIDIA/Megatron-LM's README, images/cases_april2021.png): 39.1B GPT,
# hidden 8192, 48 layers, vocabulary 51,200, sequence 2048, model-parallel size 16 = TP 8 x PP 2 on
# 512 A100s (DP 32), batch 1536, 138 TFLOP/s per GPU, activation recomputation (counted, as ours)
NARAYANAN_39B = dict(cfg=GPTConfig(vocab_size=51200, seq_len=2048, n_layer=48, n_head=64,
                                   d_model=8192),
                     dp=32, tp=8, pp=2, batch=1536, tflops=138, gpus=512, device="dgx-a100",
                     counts_recompute=True)
# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, FSDP on 8
# H100, local batch 2, sequence 8192, bf16: 5,762 tokens/s per GPU.  Llama's shape as a GPT of the
# same parameter count: d 4096, 32 layers, 32 heads, vocabulary 128,256, MLP width chosen so that the
# 8.03B parameters (and so 6N FLOPs per token) match (SwiGLU's 3·d·14336 and GQA's smaller K/V)
LLAMA3_8B = GPTConfig(vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, d_model=4096,
                      d_ff=18432)


def published(get, steps: int) -> list[float]:
    print("\n(b) published configurations, projected (throughput, projected / published)")
    ratios = []
    # data parallel: the 1.7B row — DDP buckets overlapped with backward, as Megatron's
    # --overlap-grad-reduce; 4 sequences per replica
    m = MEGATRON_1_7B
    run = train(strategy="ddp", world_size=2, steps=steps, batch_size=8, cluster=get(2),
                options={"bucket_mb": 0.2}, record_events=True)
    p = project(run, f"ib-h100x{m['gpus'] // 8}", m["cfg"], degrees={"dp": m["dp"]})
    ratios.append(_row("Megatron-LM H100 table, 1.7B GPT, DP 48 (48 GPUs)", p, m))
    # tensor + pipeline: the 39.1B row of Narayanan et al. — TP 8 x PP 2 x DP 32, 48 sequences
    # (partly circular: the A100's sustained fraction is row 1 of the same table; see the docstring)
    # per replica in micro-batches of 1 (1F1B), activation recomputation (its FLOPs: the 3d
    # strategy does not recompute, so the recomputed forward's TP all-reduces are missing)
    m = NARAYANAN_39B
    run = train(strategy="3d", world_size=8, steps=max(3, steps // 2), batch_size=96,
                cluster=get(8), options={"dp": 2, "pp": 2, "tp": 2, "microbatches": 48},
                record_events=True)
    p = project(run, f"ib-a100x{m['gpus'] // 8}", m["cfg"], degrees={"dp": m["dp"], "tp": m["tp"]},
                recompute=True)
    ratios.append(_row("Narayanan et al. 2021 Table 1, 39.1B GPT, TP 8 x PP 2 x DP 32 (512 A100)",
                       p, m))
    # ZeRO-3: torchtitan's FSDP on one node of 8 H100, local batch 2
    run = train(strategy="zero3", world_size=2, steps=steps, batch_size=4, cluster=get(2),
                record_events=True)
    p = project(run, "dgx-h100", LLAMA3_8B, degrees={"dp": 8})
    measured = 2 * 8192 / 5762  # seconds per step: local batch 2 x 8192 tokens at 5,762 tokens/s
    ratio = measured / p.step_time_s
    ratios.append(ratio)
    print(f"    {'torchtitan Llama 3.1 8B, FSDP (ZeRO-3) on 8 H100':64s} published "
          f"{2 * 8192 / measured:8.0f} tok/s/GPU, projected {2 * 8192 / p.step_time_s:8.0f}: "
          f"{ratio:6.3f} {'ok' if abs(ratio - 1) <= 0.25 else 'OUT OF 25%'}")
    print("    (torchtitan's H100s were HBM2e parts at 500 W, slower than the preset's SXM at 700 W: "
          "their footnote 2)")
    # not a check: Megatron-Core 2024 hides TP communication behind compute (--tp-comm-overlap) and
    # its ZeRO-1 traffic behind backward, which minitrain's 3d layout does not; shown for scale
    m = MEGATRON_70B
    run = train(strategy="3d", world_size=8, steps=3, batch_size=16, cluster=get(8),
                options={"dp": 2, "pp": 2, "tp": 2, "microbatches": 8, "sequence_parallel": True},
                record_events=True)
    p = project(run, f"ib-h100x{m['gpus'] // 8}", m["cfg"], degrees={"dp": m["dp"], "tp": m["tp"]})
    per_gpu = p.mfu * get_cluster("dgx-h100").device.peak_flops / 1e12
    print(f"    [not a check] Megatron-LM H100 table, 70B, TP 8 x PP 2 x DP 48 with TP/DP overlap: "
          f"published {m['tflops']:.1f} TFLOP/s/GPU, minitrain's 3d layout projected {per_gpu:.1f} "
          f"(exposed comm {p.exposed_comm_s:.2f} s, bubble {p.bubble_s:.2f} s of "
          f"{p.step_time_s:.2f} s)")
    return ratios


def _row(label: str, p: dict, m: dict) -> float:
    """Projected per-GPU TFLOP/s against the published one (the same FLOP count: Narayanan et
    al.'s, which the projection's MFU uses; with recomputation counted where they count it)."""
    peak = get_cluster(m.get("device", "dgx-h100")).device.peak_flops
    per_gpu = (p.hfu if m.get("counts_recompute") else p.mfu) * peak / 1e12
    ratio = per_gpu / m["tflops"]
    print(f"    {label:64s} published {m['tflops']:8.1f} TFLOP/s/GPU, projected {per_gpu:8.1f}: "
          f"{ratio:6.3f} {'ok' if abs(ratio - 1) <= 0.25 else 'OUT OF 25%'}", flush=True)
    return ratio


# --------------------------------------------------------------------------------------------------
# (c) the chooser and the projection: one model
# --------------------------------------------------------------------------------------------------


def one_model(get, steps: int) -> list[float]:
    print("\n(c) one model: the chooser's step time and the projection of a small run of the "
          "same layout (dgx-h100, GPT 1.3B, sequence 2048)")
    spec = get_cluster("dgx-h100")
    cfg = MODEL_SIZES["1.3b"]
    model = ModelSpec.from_config(cfg)
    ratios = []
    cases = [
        ("DP 8 (ddp), 8 sequences per replica", Layout(dp=8), Workload(2048, 64, 8),
         dict(strategy="ddp", world_size=2, batch_size=16, options={"bucket_mb": 0.2}),
         {"dp": 8}),
        ("DP 2 x PP 2 x TP 2, ZeRO-1, m = 8", Layout(dp=2, pp=2, tp=2, zero=1),
         Workload(2048, 16, 1),
         dict(strategy="3d", world_size=8, batch_size=16,
              options={"dp": 2, "pp": 2, "tp": 2, "microbatches": 8}), None),
    ]
    for label, layout, job, kw, degrees in cases:
        chosen = evaluate(model, spec, job, layout)
        run = train(steps=max(3, steps // 2), cluster=get(kw["world_size"]), record_events=True,
                    **kw)
        p = project(run, spec, cfg, degrees=degrees)
        ratio = p.step_time_s / chosen.time["total"]
        ratios.append(ratio)
        print(f"    {label:40s} chooser {chosen.time['total'] * 1e3:8.1f} ms, projection "
              f"{p.step_time_s * 1e3:8.1f} ms: {ratio:6.3f} "
              f"{'ok' if abs(ratio - 1) <= 0.2 else 'OUT OF 20%'}", flush=True)
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", choices=["a", "b", "c"], default=None)
    args = parser.parse_args(argv)
    get, live = _clusters()
    out = {}
    try:
        if args.only in (None, "a"):
            out["a"] = self_consistency(get, args.steps)
        if args.only in (None, "b"):
            out["b"] = published(get, args.steps)
        if args.only in (None, "c"):
            out["c"] = one_model(get, args.steps)
    finally:
        for c in live.values():
            c.close()
    limits = {"a": 0.15, "b": 0.25, "c": 0.20}
    print()
    ok = True
    for key, ratios in out.items():
        worst = max(abs(r - 1) for r in ratios)
        ok &= worst <= limits[key]
        print(f"({key}) {len(ratios)} ratios, median {statistics.median(ratios):.3f}, worst "
              f"{worst:.1%} off (limit {limits[key]:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
