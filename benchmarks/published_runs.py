"""Published LLM training throughput measurements, to judge the step-time projection against.

Each row is one measurement that someone other than this project ran and published: the model's
shape, the cluster, the parallel layout, the software stack, and the result exactly as the source
states it (TFLOP/s per GPU, MFU, tokens/s per GPU or step time), with the place it was read —
table, figure, repository path and commit, or URL — in ``source``.  Fields a source does not
publish are ``None``, and ``note`` says so where it matters; values derived here by arithmetic
from published ones (a data-parallel degree from GPUs / (tp * pp), a global batch in sequences
from tokens per batch / sequence length) are named as derived in the note.

These rows are evidence, not inputs: nothing in minitrain reads this file, and no row may be used
to set a constant of the model.  ``benchmarks/projection_bench.py`` (b) projects every row a
strategy can run and judges the projection against it.  ``used_as_anchor`` marks a row that sets a
number of the model, whose check would be circular; no row is marked: the kernel model
(``minitrain/planning/kernels.py``) prices a step from matmul, attention and bandwidth
measurements, none of them a training run's throughput.  Rows of one table come from the same team,
code and cluster, which is why ``independent_group`` is recorded: count sources by it, not by
rows.

Throughput figures do not all count the same FLOPs:

* ``tflops_per_gpu`` with ``tflops_counts_recompute=True`` (Megatron-LM 2021, BLOOM) counts the
  forward pass that full activation recomputation repeats: Narayanan et al.'s
  96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, 4 passes' worth.  For the GPT-3 175B README row
  (1536 × 2048 tokens, 32 s, 1024 GPUs) that formula gives 137.7 TFLOP/s, the published 138.
* ``mfu`` is model FLOPs only (no recompute) over the GPU's dense peak — 312 TFLOP/s for A100
  bf16/fp16, 989 for H100 SXM bf16 — except where ``mfu_formula`` says otherwise; the sources
  differ on whether attention's s² term is counted.

``rows(gpu=None)`` returns the rows, optionally only those whose ``gpu`` starts with a prefix
("A100", "H100").
"""

from __future__ import annotations

#: Every row has exactly these keys; ``_row`` fills the ones a source leaves out with None.
FIELDS = (
    # identity and provenance
    "key", "source", "independent_group", "used_as_anchor",
    # hardware
    "gpu", "gpus", "nodes", "interconnect",
    # model shape
    "arch", "vocab", "seq_len", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "params",
    # layout
    "dp", "tp", "pp", "cp", "virtual_stages", "zero_stage", "fsdp", "sequence_parallel",
    "micro_batch", "global_batch", "recompute", "precision",
    # stack
    "attention", "fused_kernels", "tp_comm_overlap", "framework",
    # result, as published
    "tflops_per_gpu", "tflops_counts_recompute", "mfu", "mfu_formula",
    "tokens_per_s_per_gpu", "step_time_s",
    "note",
)


def _row(**kw) -> dict:
    unknown = set(kw) - set(FIELDS)
    if unknown:
        raise KeyError(f"unknown fields {sorted(unknown)}")
    row = dict.fromkeys(FIELDS)
    row["used_as_anchor"] = False
    row.update(kw)
    return row


# --------------------------------------------------------------------------------------------
# NVIDIA Megatron-LM, 2021: Narayanan et al., "Efficient Large-Scale Language Model Training on
# GPU Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1 (weak scaling, 1.7B-1T).
# The numbers are the ones in NVIDIA/Megatron-LM's README image images/cases_april2021.png
# (commit 50a4b5fa02, 2021-04-08); the exact layouts are the paper's reproduction script
# examples/sc21/run_table_1.sh (added 6985e58938, 2021-08-18): TP, PP, micro batch, layers,
# hidden, heads, DDP impl, nodes, and --activations-checkpoint-method uniform (full recompute)
# for every size; examples/sc21/CONFIG.sh adds --seq-length 2048, --fp16.  The README (commit
# 2e90a342f5's parent text) gives vocab 51,200 and "Each cluster node has 8 NVIDIA 80GB A100
# GPUs" (Selene).  Per-GPU TFLOP/s count the recompute forward (see module docstring).
# --------------------------------------------------------------------------------------------
_MEG21_SRC = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
              "Clusters Using Megatron-LM', Table 1; numbers as in github NVIDIA/Megatron-LM "
              "images/cases_april2021.png @50a4b5fa02, layout from examples/sc21/run_table_1.sh "
              "@2e90a342f5")
_MEG21 = dict(
    independent_group="NVIDIA Megatron-LM (ADLR), Selene",
    gpu="A100-SXM-80GB", interconnect="Selene: 8x200Gb/s HDR InfiniBand per node (as described "
    "for the same cluster in Korthikanti et al. 2022 §6)",
    arch="gpt", vocab=51200, seq_len=2048, cp=1, zero_stage=0, fsdp=False,
    sequence_parallel=False, recompute="full", precision="fp16",
    attention="eager/materialized (Megatron fused scale-mask-softmax)",
    fused_kernels="Megatron 2021 fused softmax, fused bias-GeLU, apex fused LayerNorm/Adam",
    tp_comm_overlap=False, framework="Megatron-LM (2021), nvcr.io pytorch:20.12-py3",
    tflops_counts_recompute=True,
    mfu_formula="'percentage of theoretical peak' = tflops_per_gpu / 312, i.e. HFU-like: counts "
    "the recomputed forward",
)

MEGATRON_2021 = [
    _row(key="meg21_1.7b_32gpu", source=_MEG21_SRC + ", row 1.7B", **_MEG21,
         gpus=32, nodes=4, n_layer=24, d_model=2304, n_head=24,
         d_ff=4 * 2304, params="1.7B", dp=32, tp=1, pp=1, virtual_stages=1,
         micro_batch=16, global_batch=512, tflops_per_gpu=137, mfu=0.44,
         note="DDP-impl torch. n_head 24 from run_table_1.sh (the README image has no heads "
              "column)."),
    _row(key="meg21_7.5b_128gpu", source=_MEG21_SRC + ", row 7.5B", **_MEG21,
         gpus=128, nodes=16, n_layer=36, d_model=4096, n_head=32, d_ff=4 * 4096, params="7.5B",
         dp=32, tp=4, pp=1, virtual_stages=1, micro_batch=16, global_batch=512,
         tflops_per_gpu=142, mfu=0.46,
         note="dp derived = 128/(4*1). DDP-impl torch. Same team/code/cluster as the 1.7B row."),
    _row(key="meg21_39b_512gpu", source=_MEG21_SRC + ", row 39B", **_MEG21,
         gpus=512, nodes=64, n_layer=48, d_model=8192, n_head=64, d_ff=4 * 8192, params="39.1B",
         dp=32, tp=8, pp=2, virtual_stages=1, micro_batch=4, global_batch=1536,
         tflops_per_gpu=138, mfu=0.44,
         note="dp derived = 512/(8*2). DDP-impl local (no overlap of grad all-reduce)."),
    _row(key="meg21_145b_1536gpu", source=_MEG21_SRC + ", row 145B", **_MEG21,
         gpus=1536, nodes=192, n_layer=80, d_model=12288, n_head=96, d_ff=4 * 12288,
         params="145.6B", dp=24, tp=8, pp=8, virtual_stages=2, micro_batch=2,
         global_batch=2304, tflops_per_gpu=148, mfu=0.47,
         note="Interleaved 1F1B: --num-layers-per-virtual-pipeline-stage 5 with 80/8 = 10 layers "
              "per stage, so 2 virtual stages (derived). dp derived = 1536/64. DDP-impl local."),
    _row(key="meg21_530b_2520gpu", source=_MEG21_SRC + ", row 530B", **_MEG21,
         gpus=2520, nodes=315, n_layer=105, d_model=20480, n_head=128, d_ff=4 * 20480,
         params="529.6B", dp=9, tp=8, pp=35, virtual_stages=3, micro_batch=1,
         global_batch=2520, tflops_per_gpu=163, mfu=0.52,
         note="--num-layers-per-virtual-pipeline-stage 1 with 105/35 = 3 layers per stage: 3 "
              "virtual stages (derived). dp derived = 2520/280."),
    _row(key="meg21_1t_3072gpu", source=_MEG21_SRC + ", row 1T", **_MEG21,
         gpus=3072, nodes=384, n_layer=128, d_model=25600, n_head=160, d_ff=4 * 25600,
         params="1008.0B", dp=6, tp=8, pp=64, virtual_stages=1, micro_batch=1,
         global_batch=3072, tflops_per_gpu=163, mfu=0.52,
         note="No interleaving in run_table_1.sh for 1T. dp derived = 3072/512."),
    _row(key="meg21_gpt3_175b_1024gpu",
         source="NVIDIA/Megatron-LM README @50a4b5fa02 (2021-04-08), GPT-3 175B section: 'With "
                "full global batch size of 1536 on 1024 A100 GPUs, each iteration takes around 32 "
                "seconds resulting in 138 teraFLOPs per GPU which is 44% of the theoretical peak'; "
                "layout from examples/pretrain_gpt3_175B.sh at the same commit",
         **_MEG21,
         gpus=1024, nodes=128, n_layer=96, d_model=12288, n_head=96, d_ff=4 * 12288,
         params="175B", dp=8, tp=8, pp=16, virtual_stages=1, micro_batch=1,
         global_batch=1536, tflops_per_gpu=138, mfu=0.44, step_time_s=32,
         note="'around 32 seconds'. Script: --tensor-model-parallel-size 8 "
              "--pipeline-model-parallel-size 16 --micro-batch-size 1 --fp16 "
              "--checkpoint-activations. dp derived = 1024/128. The README does not say the "
              "GPUs are 80GB for this example; 80GB is Selene's node spec in the 2022 README. "
              "Not part of Table 1, but same team and cluster."),
]

# --------------------------------------------------------------------------------------------
# NVIDIA Megatron-LM, 2022: Korthikanti et al., "Reducing Activation Recomputation in Large
# Transformer Models" (arXiv 2205.05198).  Table 3 (configs), Table 5 (end-to-end iteration
# time, MFU, HFU), §6.3 text (530B at 8-way data parallel).  §6: sequence 2048, vocab 51,200,
# TP 8 everywhere, interleaving with 3 stages for 175B and 530B, mixed precision, Selene with 8
# 80GB A100 and 8x200Gb/s HDR IB per node.  No data parallelism in Table 5.  Read from a copy of
# the paper's text in the search index (find_string "Model FLOPs Utilization of 54.2%").  The
# same MFU/HFU table is in NVIDIA/Megatron-LM README @2e90a342f5 (2022-05-19).
# --------------------------------------------------------------------------------------------
_K22_SRC = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer "
            "Models', arXiv 2205.05198")
_K22 = dict(
    independent_group="NVIDIA Megatron-LM (ADLR), Selene",
    gpu="A100-SXM-80GB", interconnect="8x200Gb/s HDR InfiniBand per node (paper §6)",
    arch="gpt", vocab=51200, seq_len=2048, cp=1, zero_stage=0, fsdp=False,
    sequence_parallel=True, recompute="selective", precision="mixed (fp16/bf16 not stated)",
    attention="eager/materialized (Megatron fused scale-mask-softmax); the attention core is what "
    "selective recompute recomputes",
    tp_comm_overlap=False, framework="Megatron-LM (2022)", tflops_counts_recompute=False,
    mfu_formula="model FLOPs per Korthikanti App. A (no recompute); HFU adds the recompute; "
                "HFU/MFU ~ 1 + s/6h for selective recompute",
)

KORTHIKANTI_2022 = [
    _row(key="k22_22b_8gpu", source=_K22_SRC + ", Table 3 row 22B + Table 5 row 22B", **_K22,
         gpus=8, nodes=1, n_layer=48, d_model=6144, n_head=64, d_ff=4 * 6144, params="22B",
         dp=1, tp=8, pp=1, virtual_stages=1, micro_batch=4, global_batch=4,
         step_time_s=1.10, mfu=0.415,
         note="HFU 43.7%. Full recompute without sequence parallelism, same config: 1.42 s. "
              "Single node: all communication is NVLink."),
    _row(key="k22_175b_64gpu", source=_K22_SRC + ", Table 3 row 175B + Table 5 row 175B", **_K22,
         gpus=64, nodes=8, n_layer=96, d_model=12288, n_head=96, d_ff=4 * 12288,
         params="175B", dp=1, tp=8, pp=8, virtual_stages=3, micro_batch=1, global_batch=64,
         step_time_s=13.75, mfu=0.514,
         note="HFU 52.8%. Full recompute without sequence parallelism: 18.13 s. 64 micro-batches "
              "over 8 stages with 3 virtual stages."),
    _row(key="k22_530b_2240gpu", source=_K22_SRC + ", Table 3 row 530B + §6.3 text (8-way DP)",
         **_K22, gpus=2240, nodes=280, n_layer=105, d_model=20480, n_head=128, d_ff=4 * 20480,
         params="530B", dp=8, tp=8, pp=35, virtual_stages=3, micro_batch=1, global_batch=2240,
         step_time_s=39.15, mfu=0.542,
         note="§6.3: 530B scaled to 8-way data parallel (2240 GPUs) keeping batch per model "
              "instance (280) constant: 37.83 s -> 39.15 s, MFU 56.0% -> 54.2%; gradient "
              "all-reduce NOT overlapped with backprop. global_batch derived = 280*8."),
]

# --------------------------------------------------------------------------------------------
# NVIDIA Megatron-Core r0.8.0 on H100, 2024: NVIDIA/Megatron-LM README "Performance
# Benchmarking", images/model_table.png (added f2e5db402c, 2024-07-15; the strong-scaling figure
# is labelled "Megatron-Core r0.8.0").  README text: vocab 131,072, sequence 4,096, DP/TP/PP
# overlap on (--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap), throughput
# end-to-end.  Not published: precision, micro batch, recompute, interleaving, GPU memory/power.
# --------------------------------------------------------------------------------------------
_MC_SRC = ("NVIDIA/Megatron-LM README (Performance Benchmarking) and images/model_table.png "
           "@f2e5db402c (2024-07-15), Megatron-Core r0.8.0")
_MC = dict(
    independent_group="NVIDIA Megatron-Core (2024)",
    gpu="H100 (SXM presumed; variant not stated)", interconnect=None,
    arch="gpt", vocab=131072, seq_len=4096, cp=1, zero_stage=1, fsdp=False,
    sequence_parallel=None, recompute=None, precision=None, attention=None,
    fused_kernels=None, tp_comm_overlap=True, framework="Megatron-Core r0.8.0",
    tflops_counts_recompute=None,
    mfu_formula="not stated in the README; 'MFU' column; per-GPU teraFLOP/s / MFU ~ 990 "
                "(H100 SXM dense bf16 peak)",
)
_MC_NOTE = ("Precision, micro batch, recompute, interleaving and attention kernel are not "
            "published. zero_stage=1 is inferred from --overlap-param-gather (Megatron's "
            "distributed optimizer), not stated as such.")

MEGATRON_CORE_2024 = [
    _row(key="mcore_1.7b_48gpu", source=_MC_SRC + ", row 1.7B", **_MC,
         gpus=48, n_layer=24, d_model=2048, n_head=16, params="1.7B", dp=48, tp=1, pp=1,
         global_batch=192, tflops_per_gpu=408.8, mfu=0.41, note=_MC_NOTE),
    _row(key="mcore_7.1b_96gpu", source=_MC_SRC + ", row 7.1B", **_MC,
         gpus=96, n_layer=30, d_model=4096, n_head=32, params="7.1B", dp=48, tp=2, pp=1,
         global_batch=192, tflops_per_gpu=465.9, mfu=0.47, note=_MC_NOTE),
    _row(key="mcore_70b_768gpu", source=_MC_SRC + ", row 70B", **_MC,
         gpus=768, n_layer=84, d_model=8192, n_head=64, params="70B", dp=48, tp=8, pp=2,
         global_batch=384, tflops_per_gpu=419.7, mfu=0.42, note=_MC_NOTE),
    _row(key="mcore_177b_2304gpu", source=_MC_SRC + ", row 177B", **_MC,
         gpus=2304, n_layer=96, d_model=12288, n_head=96, params="177B", dp=48, tp=8, pp=6,
         global_batch=1152, tflops_per_gpu=432.8, mfu=0.44,
         note=_MC_NOTE + " The README's strong-scaling figure runs this GPT-3 175B-class model "
              "from 96 to 4,608 GPUs at batch 1,152 (MFU 47% -> 42%), numbers only as a plot."),
    _row(key="mcore_462b_6144gpu", source=_MC_SRC + ", row 462B", **_MC,
         gpus=6144, n_layer=112, d_model=18432, n_head=144, params="462B", dp=48, tp=8, pp=16,
         global_batch=3072, tflops_per_gpu=459.9, mfu=0.47, note=_MC_NOTE),
]

# --------------------------------------------------------------------------------------------
# Microsoft + NVIDIA, MT-NLG 530B: Smith et al. 2022, "Using DeepSpeed and Megatron to Train
# Megatron-Turing NLG 530B" (arXiv 2201.11990), §2.4 throughput: batch 1920 on 280/350/420 DGX
# A100 servers, 60.1/50.2/44.4 s per iteration, 126/121/113 TFLOP/s per GPU.  Read through
# cli99/llm-analysis examples/megatron-turing-nlg/README.md, which quotes the paper's §2.4; the
# paper itself was not opened here.
# --------------------------------------------------------------------------------------------
MTNLG_2022 = [
    _row(key="mtnlg_530b_2240gpu",
         source="Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG "
                "530B', arXiv 2201.11990, §2.4 (as quoted in github cli99/llm-analysis "
                "examples/megatron-turing-nlg/README.md)",
         independent_group="Microsoft DeepSpeed + NVIDIA (MT-NLG)",
         gpu="A100-SXM (memory disputed: see note)", gpus=2240, nodes=280,
         interconnect="Selene: HDR InfiniBand full fat tree (NVIDIA/Microsoft blog)",
         arch="gpt", vocab=None, seq_len=2048, n_layer=105, d_model=20480, n_head=128,
         d_ff=81920, params="530B", dp=8, tp=8, pp=35, cp=1, virtual_stages=None,
         zero_stage=None, fsdp=False, sequence_parallel=False, micro_batch=None,
         global_batch=1920, recompute=None, precision="mixed (fp16/bf16 not read)",
         framework="Megatron-DeepSpeed (DeepSpeed pipeline + Megatron tensor slicing)",
         tflops_per_gpu=126, tflops_counts_recompute=None, step_time_s=60.1,
         note="Same paper: 350 servers (2800 GPUs) 50.2 s / 121 TFLOP/s, 420 servers (3360) "
              "44.4 s / 113. tp8/pp35 as in llm-analysis's run_train.sh and MT-NLG's published "
              "8-way tensor x 35-way pipeline; dp derived = 2240/280. Recompute, and whether the "
              "TFLOP/s count it, were not read from the MT-NLG paper (Korthikanti 2022 says MT-NLG "
              "has three layers per device, which limits layer-granular checkpointing); but 126 is what Narayanan's recompute-counting "
              "formula gives (125.7 with V=51,200 at 60.1 s), consistent with full recompute. GPU memory: llm-analysis "
              "says 40GB, the Microsoft/NVIDIA blog says 80GB (Selene) — unresolved. vocab and "
              "micro batch not read."),
]

# --------------------------------------------------------------------------------------------
# BigScience BLOOM 176B, 2022.  bigscience-workshop/bigscience train/tr11-176B-ml/README.md
# (hardware, replica setup, throughput formula), tr11-176B-ml.slurm (exact flags), and
# chronicles.md (measured log lines), repository snapshot fetched here (chronicles @b43180abc0).
# --------------------------------------------------------------------------------------------
BLOOM_2022 = [
    _row(key="bloom_176b_384gpu",
         source="BigScience BLOOM tr11-176B-ml: github bigscience-workshop/bigscience "
                "train/tr11-176B-ml/chronicles.md (log line at iteration 12695, GBS 2048: 105.22 "
                "s/iteration, 'TFLOPs: 149.02'; text: 'at 149-150 TFLOPs per GPU'), README.md "
                "(Hardware, Replica setup, Throughput), tr11-176B-ml.slurm",
         independent_group="BigScience (BLOOM), Jean Zay",
         gpu="A100-SXM-80GB", gpus=384, nodes=48,
         interconnect="Omni-Path Architecture, 4 OPA links per node (README; link speed not "
                      "stated there)",
         arch="gpt", vocab=250880, seq_len=2048, n_layer=70, d_model=14336, n_head=112,
         d_ff=4 * 14336, params="176B", dp=8, tp=4, pp=12, cp=1, virtual_stages=1,
         zero_stage=1, fsdp=False, sequence_parallel=False, micro_batch=2, global_batch=2048,
         recompute="full", precision="bf16",
         attention="eager/materialized (Megatron-DeepSpeed fused softmax, ALiBi)",
         fused_kernels="--abort-on-unmet-fused-kernel-constraints (Megatron fused kernels "
                       "required)",
         tp_comm_overlap=False,
         framework="Megatron-DeepSpeed (ds_ckpt_reshape branch) + DeepSpeed, PyTorch 1.11, "
                   "CUDA 11.5",
         tflops_per_gpu=149.02, tflops_counts_recompute=True, step_time_s=105.22,
         mfu_formula="README 'Throughput': hardware TFLOPs with the 4*2 coefficient (counts "
                     "recompute), per bigscience math/README.md",
         note="vocab 250,880 is the padded size (--pad-vocab-size-to 250880; real vocabulary "
              "250,680). zero_stage=1: ZERO_STAGE=0 in DeepSpeed but the BF16_Optimizer "
              "'implements its own zero stage 1 equivalent'. --embed-layernorm adds a "
              "LayerNorm after the embedding. Later in training a bad node dropped throughput "
              "to ~140 TFLOPs (chronicles), so 149 is the healthy figure."),
]

# --------------------------------------------------------------------------------------------
# Meta OPT-175B, 2022: Zhang et al., "OPT: Open Pre-trained Transformer Language Models" (arXiv
# 2205.01068 v4), §2.4 Training Efficiency and Table 1; read from a copy of the paper text in the
# search index.  Layout detail from facebookresearch/metaseq projects/OPT/download_opt175b.md.
# --------------------------------------------------------------------------------------------
OPT_2022 = [
    _row(key="opt_175b_992gpu",
         source="Zhang et al. 2022, 'OPT: Open Pre-trained Transformer Language Models', "
                "arXiv 2205.01068v4, §2.4 ('utilization of up to 147 TFLOP/s per GPU') and "
                "Table 1; github facebookresearch/metaseq projects/OPT/download_opt175b.md "
                "('trained OPT-175B on 124 hosts ... 8x tensor parallelism')",
         independent_group="Meta AI (OPT, metaseq)",
         gpu="A100-SXM-80GB", gpus=992, nodes=124, interconnect=None,
         arch="gpt", vocab=None, seq_len=2048, n_layer=96, d_model=12288, n_head=96,
         d_ff=4 * 12288, params="175B", dp=124, tp=8, pp=1, cp=1, virtual_stages=None,
         zero_stage=None, fsdp="FSDP (FairScale); the paper says Adam state is sharded across "
         "all hosts, sharding mode otherwise not stated", sequence_parallel=False,
         micro_batch=None, global_batch=None, recompute=None, precision="fp16 (Adam state fp32)",
         framework="metaseq (FSDP + Megatron-LM tensor parallel)", tflops_per_gpu=147,
         tflops_counts_recompute=None,
         note="'up to' 147: a peak, not a sustained average. Global batch published as 2M tokens "
              "(Table 1), i.e. ~1024 sequences of 2048 (derived). dp derived = 992/8. Which FLOP "
              "formula and whether recompute is counted are not published; recompute not stated. "
              "Interconnect not stated in the paper text read."),
]

# --------------------------------------------------------------------------------------------
# Meta Llama 3 405B, 2024: "The Llama 3 Herd of Models" (arXiv 2407.21783), §3.3.2 and Table 4
# "Scaling configurations and MFU for each stage of Llama 3 405B pre-training"; read from copies
# of the paper text in the search index (find_string on the caption).  Hardware per §3.3.1:
# H100 700W TDP, 80GB HBM3, Grand Teton, RoCE 400 Gb/s between GPUs.  Model shape from the
# paper's Table 3 (126 layers, d 16,384, FFN 53,248, 128 heads, 8 KV heads, vocab 128,256).
# --------------------------------------------------------------------------------------------
_L3_SRC = ("Llama Team, Meta 2024, 'The Llama 3 Herd of Models', arXiv 2407.21783, Table 4 "
           "(scaling configurations and MFU), §3.3.2")
_L3 = dict(
    independent_group="Meta Llama 3 (4D parallelism, RoCE cluster)",
    gpu="H100-SXM5-80GB (700W, HBM3)",
    interconnect="RoCE, 400 Gb/s per GPU (Arista 7800 / Minipack2)",
    arch="llama", vocab=128256, n_layer=126, d_model=16384, n_head=128, n_kv_head=8,
    d_ff=53248, params="405B", tp=8, pp=16, zero_stage=None,
    fsdp="FSDP over DP (optimizer states and gradients sharded; parameters not resharded "
         "after forward, §3.3.2)",
    sequence_parallel=None, micro_batch=None, recompute=None, precision="bf16",
    framework="Meta internal (PyTorch-based)", tflops_counts_recompute=False,
    mfu_formula="BF16 MFU as in Chowdhery et al. 2023 (PaLM): model FLOPs incl. attention, "
                "over H100 bf16 dense peak",
)
LLAMA3_2024 = [
    _row(key="llama3_405b_8192gpu", source=_L3_SRC + ", row 1", **_L3,
         gpus=8192, nodes=1024, seq_len=8192, cp=1, dp=64, global_batch=2048,
         tflops_per_gpu=430, mfu=0.43,
         note="Batch size/DP 32, tokens/batch 16M; global_batch derived = 32*64 sequences of "
              "8192. Pipeline schedule is Meta's modified interleaved 1F1B with tunable "
              "micro-batches (§3.3.2), virtual-stage count not published."),
    _row(key="llama3_405b_16384gpu", source=_L3_SRC + ", row 2", **_L3,
         gpus=16384, nodes=2048, seq_len=8192, cp=1, dp=128, global_batch=2048,
         tflops_per_gpu=400, mfu=0.41,
         note="Batch size/DP 16, tokens/batch 16M. The paper attributes the drop from 43% to the "
              "smaller batch per DP group. The third row (CP 16, seq 131,072, 380 TFLOP/s, 38%) "
              "is left out: copies of the table disagree on its DP (8 vs 4; 16384/(8*16*16) = 8)."),
]

# --------------------------------------------------------------------------------------------
# PyTorch torchtitan, end of 2024: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md
# (torch 1963fc8, torchao eab345c, torchtitan 9dec370).  Grand Teton hosts, 8 H100 per host over
# NVLink, 96GB HBM2e at 500W (not SXM5 700W), RDMA 400 Gb/s per GPU.  TPS/GPU read at step 90.
# The md does not give seq_len; 8192 is the default in train_configs/llama3_*.toml at 9dec370.
# Attention: F.scaled_dot_product_attention(is_causal=True) in torchtitan/models/llama/model.py
# at 9dec370 (PyTorch picks the flash backend; the md does not say).
# --------------------------------------------------------------------------------------------
_TT_SRC = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, "
           "2024-12-26)")
_TT = dict(
    independent_group="PyTorch torchtitan (Meta PyTorch team)",
    gpu="H100 (96GB HBM2e, 500W power limit; between SXM and NVL)",
    interconnect="NVLink within host; RDMA 400 Gb/s per GPU between hosts",
    arch="llama", vocab=128256, seq_len=8192, n_kv_head=8,
    attention="sdpa (torch F.scaled_dot_product_attention, causal)",
    framework="torchtitan 9dec370, torch 1963fc8 (2024-12-23), torchao eab345c",
    tflops_counts_recompute=False,
)
_TT_HW = ("torchtitan's H100s are 96GB HBM2e at 500W, slower than H100 SXM5 at 700W; the md says "
          "their peak is between SXM and NVL and unknown. seq_len 8192 from the default config, "
          "not stated in the md; so is the activation checkpointing, recompute='op': "
          "train_configs/llama3_8b.toml, mode 'selective', selective_ac_option 'op' (torchtitan's "
          "per-op policy: every other mm recomputed, attention saved).")
TORCHTITAN_2024 = [
    _row(key="tt_llama3_8b_fsdp_8gpu", source=_TT_SRC + ", Table 1 row 'FSDP'", **_TT,
         gpus=8, nodes=1, n_layer=32, d_model=4096, n_head=32, d_ff=14336, params="8B",
         dp=8, tp=1, pp=1, cp=1, fsdp="FSDP2 full shard", zero_stage=3,
         micro_batch=2, global_batch=16, recompute="op", precision="bf16",
         tokens_per_s_per_gpu=5762,
         note="Eager. Same table: + torch.compile 6,667, + compile + Float8 8,532. " + _TT_HW),
    _row(key="tt_llama3_8b_fsdp_128gpu", source=_TT_SRC + ", Table 3 row 'FSDP'", **_TT,
         gpus=128, nodes=16, n_layer=32, d_model=4096, n_head=32, d_ff=14336, params="8B",
         dp=128, tp=1, pp=1, cp=1, fsdp="FSDP2 full shard", zero_stage=3,
         micro_batch=2, global_batch=256, recompute="op", precision="bf16",
         tokens_per_s_per_gpu=5605,
         note="Eager. Same table: + compile 6,514, + compile + Float8 8,380. The md says 1D 8B "
              "without Float8 reaches 33-39% MFU on 8 or 128 GPUs (computed with the SXM peak). "
              + _TT_HW),
    _row(key="tt_llama3_70b_2d_256gpu", source=_TT_SRC + ", Table 4 row '2D'", **_TT,
         gpus=256, nodes=32, n_layer=80, d_model=8192, n_head=64, d_ff=28672, params="70B",
         dp=32, tp=8, pp=1, cp=1, fsdp="FSDP2 full shard", zero_stage=3, sequence_parallel=True,
         micro_batch=16, global_batch=512, recompute="full", precision="fp8 (Float8 nn.Linear)",
         tp_comm_overlap=False, tokens_per_s_per_gpu=829,
         note="torch.compile + Float8. Async TP: 876. 'Local batch size 16' with FSDP 32 gives "
              "global 512, as published. sequence_parallel=True is torchtitan's TP plan default "
              "(norms sequence-sharded), not stated in the md. " + _TT_HW),
    _row(key="tt_llama3_405b_3d_512gpu", source=_TT_SRC + ", Table 5 row 'Interleaved 1F1B'",
         **_TT, gpus=512, nodes=64, n_layer=126, d_model=16384, n_head=128, d_ff=53248,
         params="405B", dp=8, tp=8, pp=8, cp=1, virtual_stages=None,
         fsdp="FSDP2 full shard", zero_stage=3, sequence_parallel=True, micro_batch=None,
         global_batch=256, recompute="full", precision="fp8 (Float8 nn.Linear)",
         tp_comm_overlap="async TP", tokens_per_s_per_gpu=128,
         note="torch.compile + Float8 + AsyncTP. 1F1B: 100. 'Local batch size 32, global batch "
              "size 256' as published; micro-batch count and virtual stages per rank not "
              "published. " + _TT_HW),
]

# --------------------------------------------------------------------------------------------
# MosaicML / Databricks llm-foundry, 2023-2024: mosaicml/llm-foundry
# scripts/train/benchmarking/README.md (H100 tables added 5e85bd62d, 2024-01-06; A100 tables
# older).  Model shapes from scripts/train/yamls/pretrain/mpt-*.yaml (vocab 50,368, expansion 4,
# attn_config.attn_impl: flash).  MFU formula in the README: 3*(2N*s + 4*n_layer*d*s^2) FLOPs per
# sequence, over 989 (h100-sxm) or 312 (a100) TFLOP/s; HFU uses
# 4x for activation-checkpointed runs.  Parallelism is PyTorch FSDP only (no TP/PP).
# --------------------------------------------------------------------------------------------
_MPT_SRC = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
_MPT = dict(
    independent_group="MosaicML / Databricks llm-foundry",
    arch="gpt", vocab=50368, tp=1, pp=1, cp=1, sequence_parallel=False,
    attention="flash (attn_impl flash or triton; see note)",
    framework="llm-foundry + Composer, PyTorch FSDP",
    tflops_counts_recompute=False,
    mfu_formula="(3*2*N*s + 3*4*n_layer*d*s^2) * seq/s / (gpus * peak); peak 989e12 (h100-sxm "
                "bf16) or 312e12 (a100); HFU uses 4 instead of 3 when activation checkpointing",
)
_MPT_NOTE = ("Attention: the yamls say attn_impl: flash, but submit_benchmarks.py's --attn_impl "
             "default was 'triton' when the H100 tables were added (5e85bd62d) and sweep.sh does "
             "not pass it, so the kernel is flash-attn 2 or the Triton flash kernel — not "
             "certain. 'Model TFLOP' column is per GPU.")
MOSAICML = [
    _row(key="mpt_7b_h100_128gpu",
         source=_MPT_SRC + ", table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)', row 7b/2048/128",
         **_MPT, gpu="H100-80GB (h100_80gb; SXM per the MFU peak used)", gpus=128, nodes=16,
         interconnect=None, seq_len=2048, n_layer=32, d_model=4096, n_head=32, d_ff=16384,
         params=6658859008, dp=128, fsdp="FULL_SHARD", zero_stage=3, micro_batch=6,
         global_batch=768, recompute="none", precision="amp_bf16", mfu=0.4571,
         tflops_per_gpu=452, tokens_per_s_per_gpu=10475,
         note="HFU = MFU (no activation checkpointing). Image mosaicml/pytorch:2.1.0_cu121 "
              "(sweep.sh at 5e85bd62d). Interconnect of the H100 cluster not stated. " + _MPT_NOTE),
    _row(key="mpt_70b_h100_512gpu",
         source=_MPT_SRC + ", table 'H100 80GB BF16 (Large Scale, >= 128 GPUs)', row 70b/2048/512",
         **_MPT, gpu="H100-80GB (h100_80gb)", gpus=512, nodes=64, interconnect=None,
         seq_len=2048, n_layer=80, d_model=8192, n_head=64, d_ff=32768, params=64862437376,
         dp=512, fsdp="FULL_SHARD", zero_stage=3, micro_batch=8, global_batch=4096,
         recompute="full", precision="amp_bf16", mfu=0.4125, tflops_per_gpu=408,
         tokens_per_s_per_gpu=1007,
         note="HFU 55.0%. 'activation checkpointing True' = every block (full). MPT-70B here is "
              "64.9B parameters, MHA (no GQA). " + _MPT_NOTE),
    _row(key="mpt_1b_h100_8gpu",
         source=_MPT_SRC + ", table 'H100 80GB BF16', row 1b/2048/8",
         **_MPT, gpu="H100-80GB (h100_80gb)", gpus=8, nodes=1, interconnect="NVLink (one node)",
         seq_len=2048, n_layer=24, d_model=2048, n_head=16, d_ff=8192, params=1315950592,
         dp=8, fsdp="FULL_SHARD", zero_stage=3, micro_batch=14, global_batch=112,
         recompute="none", precision="amp_bf16", mfu=0.4182, tflops_per_gpu=413,
         tokens_per_s_per_gpu=45455, note=_MPT_NOTE),
    _row(key="mpt_7b_a100_40gb_128gpu",
         source=_MPT_SRC + ", table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)', "
                           "row 7b/2048/128",
         **_MPT, gpu="A100-40GB (a100_40gb)", gpus=128, nodes=16,
         interconnect="1600 Gbps node-node RoCE", seq_len=2048, n_layer=32, d_model=4096,
         n_head=32, d_ff=16384, params=6658859008, dp=128, fsdp="FULL_SHARD", zero_stage=3,
         micro_batch=18, global_batch=2304, recompute="full", precision="bf16 (PURE)",
         mfu=0.5014, tflops_per_gpu=156, tokens_per_s_per_gpu=3623,
         note="HFU 66.85%. A100 tables predate the H100 ones (older torch/Composer; the README "
              "still carries 'TODO: Update tables with torch 2.0'). MP mode PURE = bf16 params. "
              + _MPT_NOTE),
    _row(key="mpt_70b_a100_80gb_64gpu",
         source=_MPT_SRC + ", table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', "
                           "row 70b/2048/64",
         **_MPT, gpu="A100-80GB (a100_80gb)", gpus=64, nodes=8,
         interconnect="1600 Gbps node-node RoCE", seq_len=2048, n_layer=80, d_model=8192,
         n_head=64, d_ff=32768, params=64862437376, dp=64, fsdp="FULL_SHARD", zero_stage=3,
         micro_batch=8, global_batch=2048, recompute="full", precision="bf16 (PURE)",
         mfu=0.5333, tflops_per_gpu=166, tokens_per_s_per_gpu=410,
         note="HFU 71.1%. Grad accumulation 4. " + _MPT_NOTE),
]

# --------------------------------------------------------------------------------------------
# ByteDance MegaScale, 2024: Jiang et al., "MegaScale: Scaling Large Language Model Training to
# More Than 10,000 GPUs" (NSDI 2024, arXiv 2402.15627), Table 1 (model configs), Table 2
# (strong scaling of the 175B model, Megatron-LM vs MegaScale), §6.1 text; read from a copy of the
# paper text in the search index.  §6.1: Megatron-LM commit 285068c8, interleaved schedule with 6
# virtual stages for 175B, sequence 2048, vocab 64,000.  §6: clusters of "NVIDIA Ampere GPUs".
# --------------------------------------------------------------------------------------------
_MS_SRC = ("Jiang et al. 2024, 'MegaScale: Scaling Large Language Model Training to More Than "
           "10,000 GPUs', NSDI 2024, Table 2")
_MS = dict(
    independent_group="ByteDance MegaScale",
    gpu="NVIDIA Ampere (A100 class; exact SKU not in the text read)", interconnect=None,
    arch="gpt", vocab=64000, seq_len=2048, n_layer=96, d_model=12288, n_head=128,
    params="175B", tp=8, pp=8, cp=1, virtual_stages=6, micro_batch=None, recompute=None,
    precision=None,
    mfu_formula="MFU as in the paper; Korthikanti's model-FLOPs formula over 312e12 reproduces "
                "the Megatron-LM rows (41.26% and 48.74% computed here), so A100-class peak",
)
MEGASCALE_2024 = [
    _row(key="megascale_megatronlm_175b_3072gpu",
         source=_MS_SRC + ", row batch 6144 / Megatron-LM / 3072 GPUs", **_MS,
         gpus=3072, dp=48, global_batch=6144, zero_stage=None,
         framework="Megatron-LM commit 285068c8 (baseline run by ByteDance, with their network "
                   "optimizations on)",
         step_time_s=29.02, mfu=0.487, tokens_per_s_per_gpu=433.6e3 / 3072,
         note="Published throughput 433.6k tokens/s (aggregate); per-GPU derived. dp derived = "
              "3072/64. n_head 128 for 175B is as printed in the paper's Table 1 (GPT-3 uses 96)."),
    _row(key="megascale_megatronlm_175b_12288gpu",
         source=_MS_SRC + ", row batch 6144 / Megatron-LM / 12288 GPUs", **_MS,
         gpus=12288, dp=192, global_batch=6144, zero_stage=None,
         framework="Megatron-LM commit 285068c8 (baseline run by ByteDance)",
         step_time_s=8.57, mfu=0.412, tokens_per_s_per_gpu=1466.8e3 / 12288,
         note="Aggregate 1466.8k tokens/s; per-GPU derived. dp derived = 12288/64."),
    _row(key="megascale_175b_12288gpu",
         source=_MS_SRC + ", row batch 6144 / MegaScale / 12288 GPUs (the abstract's 55.2%)",
         **_MS, gpus=12288, dp=192, global_batch=6144, zero_stage=None,
         framework="MegaScale (Megatron-LM based)", tp_comm_overlap=True,
         step_time_s=6.34, mfu=0.552, tokens_per_s_per_gpu=1984.0e3 / 12288,
         note="NOT a standard transformer step: parallel transformer block, sliding-window "
              "attention, LAMB, TP/PP/DP overlap and fused operators (paper Table 3). A projection "
              "of a sequential-block GPT with full attention should not be expected to match it; "
              "use the Megatron-LM rows of the same table instead. Aggregate 1984.0k tokens/s."),
]

#: All rows, grouped by source.
ROWS = (MEGATRON_2021 + KORTHIKANTI_2022 + MEGATRON_CORE_2024 + MTNLG_2022 + BLOOM_2022
        + OPT_2022 + LLAMA3_2024 + TORCHTITAN_2024 + MOSAICML + MEGASCALE_2024)


def rows(gpu: str | None = None) -> list[dict]:
    """The published rows (copies), or only those whose ``gpu`` starts with ``gpu``
    (case-insensitive), e.g. ``rows("H100")``."""
    selected = ROWS if gpu is None else [r for r in ROWS if r["gpu"].lower().startswith(gpu.lower())]
    return [dict(r) for r in selected]


def _check() -> None:
    keys = [r["key"] for r in ROWS]
    assert len(keys) == len(set(keys)), "duplicate keys"
    for r in ROWS:
        assert set(r) == set(FIELDS), r["key"]


_check()
