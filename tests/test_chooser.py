"""The strategy chooser (lesson 08): the scenario table of the Hugging Face guide "Efficient Training
on Multiple GPUs", row by row, from the memory and cost models — not looked up — plus the formulas it
prices with, its rules, and the widget's pure parts."""

from dataclasses import replace

import pytest

from minitrain.planning.chooser import (ETHERNET, GPT2_XL, GPT3, LLAMA_7B, LLAMA_13B, LONG, NODE,
                               ONE_H100, SCENARIO_TABLE, SCENARIOS, Layout, ModelSpec,
                               Workload, choose, evaluate, h100_nodes, layouts, links_fast,
                               microbatch_seconds, optimizer_seconds, scenario)
from minitrain.planning.kernels import ADAM_BYTES, STACKS, rank_compute
from minitrain.memory import GB, activation_bytes_per_layer, model_state_bytes
from minitrain.viz.chooser import candidate_rows, recommendation_html


@pytest.mark.parametrize("row", SCENARIO_TABLE, ids=[r[0] for r in SCENARIO_TABLE])
def test_the_hugging_face_scenario_table(row):
    _, model, hw, job, key, allowed = row
    rec = choose(model, hw, job)
    assert rec.scenario == key and rec.advice == SCENARIOS[key][1]
    assert rec.layout is not None and rec.best.feasible
    assert rec.layout.dp * rec.layout.pp * rec.layout.tp == hw.devices
    assert rec.layout.techniques() - {"checkpointing"} in allowed, str(rec.layout)
    assert rec.reasons[0].startswith(f"Hugging Face guide's table: {SCENARIOS[key][0]}")


def test_one_machine_that_fits_prefers_ddp_and_names_zero_as_an_alternative():
    rec = choose(GPT2_XL, NODE)
    assert rec.layout == Layout(dp=8) and rec.layout.strategy() == "ddp"
    assert {c.layout.zero for c in rec.alternatives} >= {1, 2}  # ZeRO "may help": as fast


def test_the_same_model_crosses_nodes_with_zero_on_fast_links_and_with_pp_on_slow_ones():
    fast = choose(LLAMA_13B, h100_nodes(4), LONG)
    slow = choose(LLAMA_13B, h100_nodes(4, ETHERNET), LONG)
    assert fast.layout.pp == fast.layout.tp == 1 and fast.layout.zero >= 1
    assert slow.layout.pp > 1 and slow.layout.zero <= 1
    links = slow.best.comm["links"]
    assert links["pp"] == "inter-node" and links["dp"] == "intra-node"  # only PP crosses
    assert slow.best.comm["dp"] < fast.best.comm["dp"]


def test_slow_links_put_pipeline_stages_across_nodes_and_tensor_parallel_inside():
    rec = choose(GPT3, h100_nodes(16, ETHERNET))
    assert rec.best.comm["links"] == {"dp": "intra-node", "pp": "inter-node", "tp": "intra-node"}
    assert rec.layout.tp <= 8 and rec.layout.zero == 1


def test_links_are_fast_when_zero3_traffic_hides_behind_a_micro_batch():
    hw = h100_nodes(2)  # 48 GB/s per GPU between nodes
    job = Workload(2048, 512, 8)
    fast, need = links_fast(hw, job, LLAMA_13B)
    whole = microbatch_seconds(LLAMA_13B, hw, job, Layout(dp=16, zero=3))  # all layers, one device
    assert need == pytest.approx(3 * 2 * 13e9 / whole) and fast  # 3·2Ψ bytes per micro-batch
    # the rate the kernel model achieves is below the device's matmul maximum, whose F/(s·b)
    # would exceed the 48 GB/s these links give
    assert need < hw.inter.busbw < hw.device.flop_rate() / (2048 * 8)
    slow, need_half = links_fast(hw, Workload(2048, 512, 4), LLAMA_13B)
    assert not slow and need_half > hw.inter.busbw  # half the tokens, about half the time
    assert need_half == pytest.approx(2 * need, rel=0.05)


# --------------------------------------------------------------------------------------------------
# The formulas it prices with
# --------------------------------------------------------------------------------------------------


def test_memory_is_the_course_formulas():
    job = Workload(seq_len=2048, global_batch=64, micro_batch=1)
    c = evaluate(LLAMA_7B, NODE, job, Layout(dp=8, zero=2))
    states = model_state_bytes(7e9, 8, 2)  # 2Ψ + 14Ψ/N
    assert c.memory["parameters"] + c.memory["gradients"] + c.memory["optimizer_states"] == \
        pytest.approx(states["total"]) == pytest.approx(2 * 7e9 + 14 * 7e9 / 8)
    assert c.memory["activations"] == pytest.approx(32 * activation_bytes_per_layer(2048, 1, 4096, 32))
    z3 = evaluate(LLAMA_7B, NODE, job, Layout(dp=8, zero=3))
    assert z3.memory["zero3_gathered"] == pytest.approx(4 * 12 * 4096 ** 2)  # one layer, gathered


def test_pipeline_first_stage_holds_min_p_m_micro_batches_and_tp_splits_activations():
    job = Workload(seq_len=2048, global_batch=8, micro_batch=1)
    pp = evaluate(LLAMA_7B, NODE, job, Layout(pp=4, dp=2))  # m = 4 micro-batches, 8 layers each
    assert pp.memory["activations"] == pytest.approx(4 * 8 * activation_bytes_per_layer(2048, 1, 4096, 32))
    tp = evaluate(LLAMA_7B, NODE, job, Layout(tp=8))
    per = 2048 * 4096 * (10 + 24 / 8 + 5 * 32 * 2048 / (4096 * 8))  # Korthikanti, t = 8
    assert tp.memory["activations"] == pytest.approx(32 * per)


def test_communication_per_step_is_the_ring_model():
    psi, n = 1.5e9, 8
    once = Workload(seq_len=1024, global_batch=64, micro_batch=8)  # one micro-batch per replica
    dp = evaluate(GPT2_XL, NODE, once, Layout(dp=n))
    assert dp.comm["dp"] == pytest.approx(2 * (n - 1) / n * 2 * psi)  # bf16 gradients
    z3 = evaluate(GPT2_XL, NODE, once, Layout(dp=n, zero=3))
    assert z3.comm["dp"] == pytest.approx(1.5 * dp.comm["dp"])  # m = 1: 3Ψ vs 2Ψ
    heads16 = ModelSpec(1.5e9, 48, 1600, 16)  # GPT-2 XL's 25 heads do not split over 8
    tp = evaluate(heads16, NODE, Workload(seq_len=1024, global_batch=8, micro_batch=8), Layout(tp=n))
    act = 2 * 1024 * 8 * 1600
    assert tp.comm["tp"] == pytest.approx(48 * 4 * 2 * (n - 1) / n * act)  # 2 fwd + 2 bwd per layer
    pp = evaluate(GPT2_XL, NODE, Workload(1024, 64, 8), Layout(pp=8))
    assert pp.comm["pp"] == pytest.approx(8 * 2 * act)  # 8 micro-batches, activation + gradient


def test_zero2_and_zero3_pay_per_micro_batch_dp_once_per_step():
    job = Workload(seq_len=1024, global_batch=64, micro_batch=1)  # 8 micro-batches per replica
    dp, z2, z3 = (evaluate(GPT2_XL, NODE, job, Layout(dp=8, zero=z)).comm["dp"] for z in (0, 2, 3))
    assert z2 == pytest.approx(dp / 2 * 9) and z3 == pytest.approx(dp / 2 * 3 * 8)


# --------------------------------------------------------------------------------------------------
# Rules, refusals, the widget
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, rule", [
    (Layout(tp=16), "TP across nodes"),
    (Layout(pp=2, dp=8, zero=2), "ZeRO-2 with TP/PP: strategy 3d shards only"),
    (Layout(tp=2, dp=8, zero=3), "ZeRO-3 with TP/PP: strategy 3d shards only"),
    (Layout(pp=16), "more stages than layers"),
    (Layout(dp=16), "batch does not split"),
])
def test_rules_reject_with_the_reason(layout, rule):
    model = ModelSpec(1.5e9, 12, 1600, 16)  # 16 heads, 12 layers
    c = evaluate(model, h100_nodes(2), Workload(global_batch=24), layout)
    assert not c.feasible and c.rejected.startswith(rule), c.rejected


def test_without_the_runnable_rule_zero_beside_tp_and_pp_is_priced_not_refused():
    """only_runnable=False: ZeRO-2/3 beside TP or PP is weighed by the memory and time model,
    which charges ZeRO-2 a reduce-scatter and ZeRO-3 three collectives every micro-batch."""
    model = ModelSpec(1.5e9, 12, 1600, 16)
    job = Workload(global_batch=24)
    for layout in (Layout(pp=2, dp=8, zero=2), Layout(tp=2, dp=8, zero=3)):
        c = evaluate(model, h100_nodes(2), job, layout, only_runnable=False)
        assert c.rejected is None and c.time["total"] > 0
    one = evaluate(model, h100_nodes(2), job, Layout(pp=2, dp=8, zero=1), only_runnable=False)
    three = evaluate(model, h100_nodes(2), job, Layout(pp=2, dp=8, zero=3), only_runnable=False)
    assert three.comm["dp"] > one.comm["dp"]  # the weights gathered again for every micro-batch
    # the GPT-3 row on fast links: with the rule, PP × TP × DP; without it the model's own pick
    _, gpt3, hw, job3, _, _ = next(r for r in SCENARIO_TABLE if r[0].endswith("PP+TP+DP"))
    assert choose(gpt3, hw, job3).layout.zero <= 1
    free = choose(gpt3, hw, job3, only_runnable=False)
    assert free.layout is not None and free.best.rejected is None


def test_heads_that_do_not_split_are_rejected():
    c = evaluate(GPT2_XL, NODE, Workload(), Layout(tp=2))  # 25 heads
    assert c.rejected.startswith("heads do not split")


def test_offload_only_when_nothing_else_fits():
    rec = choose(LLAMA_13B, NODE)
    assert not rec.layout.offload
    assert all(not c.feasible for c in rec.candidates if c.layout.offload)
    assert "offload not needed" in rec.rejected()


def test_nothing_fits_says_what_the_smallest_needs():
    rec = choose(GPT3, ONE_H100)
    assert rec.layout is None and rec.reasons[0].startswith("no layout fits")
    assert "add devices" in rec.reasons[0]


def test_every_layout_is_enumerated_once():
    lays = layouts(replace(h100_nodes(2), devices_per_node=4))
    assert len(lays) == len(set(lays))
    assert all(lay.dp * lay.pp * lay.tp == 8 for lay in lays)


@pytest.mark.parametrize("bad, message", [
    (dict(model=ModelSpec(1e9, 0, 1024, 8)), "layers must be positive"),
    (dict(model=ModelSpec(1e9, 8, 1000, 16)), "not divisible by heads=16"),
    (dict(job=Workload(global_batch=0)), "global_batch must be positive"),
    (dict(hw=replace(NODE, nodes=0)), "nodes must be positive"),
])
def test_bad_inputs_are_refused_naming_the_fix(bad, message):
    args = {"model": GPT2_XL, "hw": NODE, "job": Workload(), **bad}
    with pytest.raises(ValueError, match=message):
        choose(args["model"], args["hw"], args["job"])


def test_scenario_alone_matches_choose():
    for _, model, hw, job, key, _ in SCENARIO_TABLE:
        assert scenario(model, hw, job) == key


def test_widget_rows_and_html():
    rec = choose(LLAMA_13B, NODE)
    rows = candidate_rows(rec)
    assert rows[0]["verdict"] == "recommended" and rows[0]["layout"] == str(rec.layout)
    verdicts = [r["verdict"] for r in rows]
    assert any(v.startswith("rejected — out of memory") for v in verdicts)
    assert any(v.startswith("rejected — offload not needed") for v in verdicts)
    assert rows[0]["memory_gb"] == pytest.approx(rec.best.memory["total"] / GB)
    page = recommendation_html(rec)
    assert 'class="mt-recommended"' in page and str(rec.layout) in page
    assert SCENARIOS[rec.scenario][1] in page and "--strategy" in page
    assert page.count("<tr") == len(rows) + 1
    nothing = recommendation_html(choose(GPT3, ONE_H100))
    assert "nothing fits" in nothing


def test_widget_builds_and_reacts():
    pytest.importorskip("ipywidgets")
    from minitrain.viz.chooser import ChooserWidget

    w = ChooserWidget()
    first = w.out.value
    w.nodes.value = 4
    assert w.out.value != first and "several machines" in w.out.value


# Beyond 3D (lesson 09): long sequences call for context parallelism, MoE models for expert parallelism

def test_a_long_sequence_gets_context_parallelism_with_the_reasons():
    short = choose(GPT2_XL, NODE, Workload(seq_len=2048, global_batch=64))
    assert short.cp == 1 and not any("context parallel" in r for r in short.reasons)
    for seq, cp in ((32768, 2), (65536, 4)):
        rec = choose(GPT2_XL, NODE, Workload(seq_len=seq, global_batch=64))
        assert rec.cp == cp and rec.layout is not None, (seq, rec.reasons)
        assert rec.layout.dp * rec.layout.pp * rec.layout.tp * rec.cp == NODE.devices
        assert rec.strategy() == "context" and rec.to_dict()["cp"] == cp
        text = " ".join(rec.reasons)
        assert "long sequence" in text and f"--cp {cp}" in text and f"{seq // cp:,} tokens" in text
        assert rec.reasons[0].startswith("Hugging Face guide's table")
        # the layout is the one that fits a sequence of seq/cp tokens on nodes of 8/cp devices
        sub = choose(GPT2_XL, replace(NODE, devices_per_node=8 // cp), Workload(seq_len=seq // cp, global_batch=64))
        assert sub.layout == rec.layout and sub.cp == 1


def test_states_that_do_not_fit_are_not_helped_by_context_parallelism():
    rec = choose(GPT3, NODE)
    assert rec.layout is None and rec.cp == 1


MOE_47B = ModelSpec(47e9, 32, 4096, 32, experts=8, top_k=2, expert_params=45e9)


def test_a_mixture_of_experts_gets_expert_parallelism_inside_a_node():
    hw = h100_nodes(4)
    rec = choose(MOE_47B, hw, Workload(seq_len=4096, global_batch=512))
    lay = rec.layout
    assert rec.ep > 1 and MOE_47B.experts % rec.ep == 0 and lay.dp % rec.ep == 0
    assert lay.tp * rec.ep <= hw.devices_per_node  # the all-to-all stays inside a node
    text = " ".join(rec.reasons)
    assert f"--ep {rec.ep}" in text and "all-to-all" in text and "13.25B active" in text
    assert MOE_47B.active_params == pytest.approx(47e9 - 45e9 * 6 / 8)
    dense = choose(LLAMA_13B, hw, Workload(seq_len=4096, global_batch=512))
    assert dense.ep == 1 and "expert" not in " ".join(dense.reasons)


def test_moe_compute_is_priced_on_the_experts_a_token_goes_through():
    dense = ModelSpec(47e9, 32, 4096, 32)
    lay = Layout(dp=1, pp=4, tp=8)
    hw = h100_nodes(4)
    cfg = MOE_47B.gpt_config(LONG.seq_len)  # 8 experts of the width 45B parameters give, top 2
    assert (cfg.n_expert, cfg.top_k) == (8, 2)
    assert cfg.n_layer * cfg.n_expert * cfg.mlp_params() == pytest.approx(45e9, rel=0.01)
    a = evaluate(MOE_47B, hw, LONG, lay).time["compute"]
    b = evaluate(dense, hw, LONG, lay).time["compute"]
    m = LONG.global_batch // LONG.micro_batch
    assert a == pytest.approx(m * microbatch_seconds(MOE_47B, hw, LONG, lay))
    # 13.25B active of 47B: far less than the dense model's compute, more than its 28 % (the router,
    # the tokens' trips to their experts and back, smaller GEMMs)
    assert MOE_47B.active_params / 47e9 < a / b < 0.5


@pytest.mark.parametrize("bad", [dict(experts=1), dict(experts=8, top_k=9, expert_params=1e9),
                                 dict(experts=8, top_k=2, expert_params=0)])
def test_bad_moe_specs_are_refused(bad):
    with pytest.raises(ValueError, match="mixture of experts needs"):
        choose(ModelSpec(2e9, 8, 1024, 8, **bad), NODE)


def test_the_widget_shows_cp_and_ep():
    rec = choose(GPT2_XL, NODE, Workload(seq_len=32768, global_batch=64))
    page = recommendation_html(rec)
    assert "CP 2" in page and "--strategy context" in page and "long sequence" in page
    moe = choose(MOE_47B, h100_nodes(4), Workload(seq_len=4096, global_batch=512))
    assert f"EP {moe.ep}" in recommendation_html(moe)


def test_when_not_even_a_layer_fits_whole_layers_are_not_kept_on_every_device():
    """The source's row: the largest layer does not fit one GPU -> TP (or ZeRO-3's gather of one
    layer at a time); a layout that keeps every whole layer on every device is rejected, saying why."""
    from minitrain.planning.chooser import NODE_24GB, WIDE, scenario

    hw = NODE_24GB
    assert scenario(WIDE, hw) == "one-node-layer-too-big"
    rec = choose(WIDE, hw)
    assert rec.layout.tp > 1 or rec.layout.zero == 3
    zero2 = [c for c in rec.candidates if c.layout.tp == 1 and c.layout.zero == 2]
    assert any(c.rejected and "split each layer with TP" in c.rejected for c in zero2)
    assert not [c for c in rec.candidates if c.feasible and c.layout.tp == 1 and c.layout.zero < 3]


def test_links_and_layout_memory_are_what_evaluate_prices_with():
    """Lesson 08's exercise prices layouts with ``links`` and keeps those ``layout_memory``
    lets fit: the same numbers ``evaluate`` uses (one cost model)."""
    from minitrain.planning.chooser import USABLE, layout_memory, links

    hw = h100_nodes(4)
    inside, across = (hw.intra.busbw, hw.intra.alpha), (hw.inter.busbw, hw.inter.alpha)
    assert links(Layout(4, 8, 1), hw) == {"tp": inside, "dp": inside, "pp": across}
    assert links(Layout(4, 8, 1, outer="dp"), hw) == {"tp": inside, "dp": across, "pp": inside}
    assert links(Layout(32, 1, 1), hw)["dp"] == across
    for layout in (Layout(32, 1, 1, 1), Layout(4, 4, 2, 1), Layout(8, 4, 1)):
        cand = evaluate(LLAMA_13B, hw, Workload(), layout)
        assert layout_memory(LLAMA_13B, hw, Workload(), layout) == cand.memory["total"]
        assert (cand.memory["total"] <= USABLE * hw.device.memory_gb * GB) == cand.feasible
    assert layout_memory(LLAMA_13B, hw, Workload(global_batch=30), Layout(32, 1, 1)) == float("inf")


def test_the_lesson_08_exercise_checks_every_term_of_the_step_time_somewhere():
    """The pick_layout check compares compute, bubble, tp, pp and dp with the chooser's: each is
    non-zero on some case (so a wrong one is seen) and nothing else of the step is priced there."""
    from minitrain.course.exercises.lesson08 import TERMS, _jobs, step_time_cases

    jobs = _jobs()
    seen = set()
    for key, layout in step_time_cases():
        _, model, hw, job = jobs[key]
        time = evaluate(model, hw, job, layout).time
        assert time["offload"] == 0 and time["total"] == pytest.approx(
            sum(time[t] for t in TERMS[:-1]) + time["optimizer"])
        assert time["optimizer"] < 1e-2 * time["total"]  # the one term the exercise leaves out
        seen |= {t for t in TERMS[:-1] if time[t] > 0}
    assert seen == set(TERMS[:-1])


def test_the_chooser_prices_on_the_clusters_presets():
    """One hardware model: the compute from the preset device's kernels, the memory against its
    memory, offload against its node's host (and refused where the cluster names none)."""
    from minitrain.planning.clusters import get_cluster

    job, layout = Workload(seq_len=2048, global_batch=64, micro_batch=1), Layout(dp=8)
    seconds = {}
    for name in ("dgx-a100", "dgx-h100"):
        spec = get_cluster(name)
        c = evaluate(GPT2_XL, spec, job, layout)
        one = rank_compute(GPT2_XL.gpt_config(2048), spec.device.kernels, tokens_per_microbatch=2048,
                           microbatches=1, opt_params=0)
        assert c.time["compute"] == pytest.approx(8 * microbatch_seconds(GPT2_XL, spec, job, layout))
        assert c.time["compute"] == pytest.approx(8 * (one.total_s - one.optimizer_s))  # m = 8
        # slower than 6Ψ FLOPs per token at the device's matmul maximum: not every kernel is a
        # large GEMM
        assert c.time["compute"] > 8 * 6 * 1.5e9 * 2048 / spec.device.flop_rate()
        assert c.time["optimizer"] == pytest.approx(  # ZeRO-free DP: Adam over all of Ψ, once
            ADAM_BYTES * 1.5e9 / spec.device.kernels.achievable_bandwidth)
        seconds[name] = c.time["compute"]
    assert seconds["dgx-h100"] < seconds["dgx-a100"]
    off = evaluate(LLAMA_7B, ONE_H100, Workload(), Layout(offload=True))
    assert off.feasible and off.memory["host_per_node"] == pytest.approx(12 * 7e9)
    assert off.time["offload"] == pytest.approx(2 * 2 * 7e9 / ONE_H100.host.pcie
                                                + 7e9 / ONE_H100.host.adam_params_per_s)
    eth = get_cluster("eth-25g")  # commodity nodes: no host named
    assert evaluate(GPT2_XL, eth, Workload(global_batch=64), Layout(dp=16, zero=2, offload=True)
                    ).rejected.startswith("no host to offload to")


def test_a_model_description_from_a_gpt_config():
    from minitrain.model import GPTConfig
    from minitrain.planning.scaling import MODEL_SIZES

    cfg = MODEL_SIZES["1.3b"]
    spec = ModelSpec.from_config(cfg)
    assert (spec.params, spec.layers, spec.hidden, spec.heads) == (
        cfg.num_params(), 24, 2048, 16) and spec.experts == 0
    moe = GPTConfig(n_layer=4, n_head=4, d_model=256, n_expert=8, top_k=2)
    m = ModelSpec.from_config(moe)
    assert m.experts == 8 and m.top_k == 2
    assert m.expert_params == 4 * 8 * moe.mlp_params()
    assert m.active_params == pytest.approx(moe.num_params() - 4 * 6 * moe.mlp_params())


def test_a_micro_batch_is_one_stage_of_the_kernel_model():
    """microbatch_seconds: one micro-batch through a stage's ⌈L/PP⌉ layers split TP ways, with the
    output layer (the last, slowest stage), the embedding only on a single stage; recomputation
    runs each block's forward again; the optimizer step is its own term."""
    hw, job = NODE, Workload(seq_len=2048, global_batch=64, micro_batch=2)
    cfg = LLAMA_13B.gpt_config(2048)
    device = hw.device.kernels

    def kernels(**kw):
        c = rank_compute(cfg, device, tokens_per_microbatch=4096, micro_batch=2, microbatches=1,
                         opt_params=0, **kw)
        return c.forward_s + c.backward_s + c.recompute_s

    assert microbatch_seconds(LLAMA_13B, hw, job, Layout(dp=8)) == pytest.approx(kernels())
    assert microbatch_seconds(LLAMA_13B, hw, job, Layout(pp=3, tp=2)) == pytest.approx(
        kernels(blocks=14, embed=False, tp=2))  # ⌈40/3⌉ layers, the last stage's head
    plain, again = (microbatch_seconds(LLAMA_13B, hw, job, Layout(pp=4, dp=2, recompute=r))
                    for r in (False, True))
    assert plain < again < 4 / 3 * plain  # the blocks' forward again, not the head's
    m = 64 // (2 * 2)
    cand = evaluate(LLAMA_13B, hw, job, Layout(pp=4, dp=2, recompute=True))
    assert cand.time["compute"] == pytest.approx(m * again)
    assert cand.time["optimizer"] == pytest.approx(optimizer_seconds(LLAMA_13B, hw, job, cand.layout))
    assert cand.time["total"] == pytest.approx(sum(v for k, v in cand.time.items() if k != "total"))
    z1 = optimizer_seconds(LLAMA_13B, hw, job, Layout(pp=4, dp=2, zero=1))
    assert z1 == pytest.approx(optimizer_seconds(LLAMA_13B, hw, job, Layout(pp=4, dp=2)) / 2, rel=1e-3)
    assert optimizer_seconds(LLAMA_7B, ONE_H100, Workload(), Layout(offload=True)) == 0


def test_the_stack_is_chosen_and_threaded_through():
    job, layout = Workload(seq_len=2048, global_batch=64, micro_batch=1), Layout(dp=8)
    flash = evaluate(GPT2_XL, NODE, job, layout).time["compute"]
    assert evaluate(GPT2_XL, NODE, job, layout, "flash").time["compute"] == flash  # the H100's default
    megatron = evaluate(GPT2_XL, NODE, job, layout, STACKS["megatron-2021"]).time["compute"]
    eager = evaluate(GPT2_XL, NODE, job, layout, stack="eager").time["compute"]
    assert flash < megatron < eager  # fused kernels, then FlashAttention
    rec = choose(GPT2_XL, NODE, job, stack="eager")
    assert rec.best.time["compute"] == pytest.approx(eager) and "eager stack" in rec.reasons[3]
    with pytest.raises(ValueError, match="unknown stack 'jax'"):
        choose(GPT2_XL, NODE, job, stack="jax")


def test_a_model_described_by_numbers_gets_a_gpt_shaped_config():
    llama70 = ModelSpec(70e9, 80, 8192, 64)
    cfg = llama70.gpt_config(4096)
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len) == (80, 8192, 64, 4096)
    assert cfg.vocab_size % 128 == 0 and cfg.ff % 256 == 0
    assert cfg.num_params() == pytest.approx(70e9, rel=0.01)  # the MLP takes what is left
    from minitrain.model import GPTConfig

    kept = GPTConfig(n_layer=4, n_head=4, d_model=256, vocab_size=1000)
    assert ModelSpec.from_config(kept).gpt_config(512) == GPTConfig(
        n_layer=4, n_head=4, d_model=256, vocab_size=1000, seq_len=512)
    assert hash(ModelSpec.from_config(kept)) == hash(ModelSpec.from_config(kept))
