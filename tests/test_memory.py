"""The memory ledger against the formulas (16 bytes per parameter; the ZeRO paper, Rajbhandari et al.,
2020)."""

import pytest
import torch

from minitrain import GPT, PRESETS, ArithmeticData, GPTConfig
from minitrain.memory import (GB, ActivationMeter, activation_bytes_per_layer, bytes_per_param,
                              ledger, memory_per_device, model_state_bytes)


def test_the_tiny_models_ledger_equals_the_formula_exactly():
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = ArithmeticData(cfg.seq_len).batch(0, 4)
    model(x, y).backward()
    opt.step()
    psi = cfg.num_params()
    measured = ledger(model, opt)["bytes"]
    formula = model_state_bytes(psi, recipe="fp32-adam")
    assert measured["parameters"] == formula["parameters"] == 4 * psi
    assert measured["gradients"] == formula["gradients"] == 4 * psi
    assert measured["optimizer_states"] == formula["optimizer_states"] == 8 * psi
    assert measured["parameters"] + measured["gradients"] + measured["optimizer_states"] == 16 * psi
    # Adam's per-parameter step counters are bookkeeping, reported apart
    assert measured["optimizer_other"] == 4 * len(list(model.parameters()))


def test_the_ledger_counts_tied_weights_once_and_reads_dtypes():
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=32, tie_weights=True)
    model = GPT(cfg).to(torch.bfloat16)
    out = ledger(model)
    assert out["bytes"]["parameters"] == 2 * cfg.num_params()
    assert out["by_dtype"]["parameters"] == {"bfloat16": 2 * cfg.num_params()}
    assert out["bytes"]["gradients"] == 0


def test_zero_formulas_reproduce_the_papers_7_5b_on_64_gpus():
    psi, n = 7.5e9, 64
    totals = [model_state_bytes(psi, n, stage)["total"] / GB for stage in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert model_state_bytes(psi, n, 1)["total"] == 4 * psi + 12 * psi / n
    assert model_state_bytes(psi, n, 2)["total"] == 2 * psi + 14 * psi / n
    assert model_state_bytes(psi, n, 3)["total"] == 16 * psi / n


def test_sixteen_bytes_per_parameter_arithmetic():
    assert 7e9 * bytes_per_param("bf16") / GB == 14
    assert model_state_bytes(7e9)["total"] / GB == 112 > 80  # more than an 80 GB H100
    # FP8 weights and gradients leave the fp32 optimizer states: 14 bytes, not 16
    fp8 = model_state_bytes(7e9, recipe="fp8-adam")
    assert fp8["total"] == 14 * 7e9 and fp8["optimizer_states"] == model_state_bytes(7e9)["optimizer_states"]


def test_memory_per_device_is_the_states_the_activations_and_the_gathered_layer():
    """One device's bytes: ZeRO's states of its share, what it keeps for backward, ZeRO-3's
    gathered layer; offload moves the optimizer states (12 of the 16 bytes) to the host."""
    psi, n = 7e9, 8
    mem = memory_per_device(psi, n, 3, activations=5 * GB, gathered=1 * GB)
    assert mem["total"] == pytest.approx(16 * psi / n + 6 * GB)
    assert mem["host"] == 0.0 and mem["zero3_gathered"] == 1 * GB
    off = memory_per_device(psi, n, 2, offload=True)
    assert off["optimizer_states"] == 0.0 and off["host"] == pytest.approx(12 * psi / n)
    assert off["total"] == pytest.approx(2 * psi + 2 * psi / n)  # the host's bytes not counted


def test_formula_inputs_are_checked():
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        model_state_bytes(1e9, 8, 4)
    with pytest.raises(ValueError, match="unknown precision 'fp12'"):
        bytes_per_param("fp12")
    with pytest.raises(ValueError, match="unknown recipe"):
        model_state_bytes(1e9, recipe="lion")


def test_activation_meter_measures_what_backward_keeps():
    cfg = PRESETS["nano"]
    model = GPT(cfg)
    meter = ActivationMeter(model)
    data = ArithmeticData(cfg.seq_len)
    sizes = []
    for batch in (4, 8):
        x, y = data.batch(0, batch)
        with meter.measure():
            loss = model(x, y)
        loss.backward()
        sizes.append(meter.last)
    assert sizes[0] > 0
    assert sizes[1] == pytest.approx(2 * sizes[0], rel=0.05)  # activations scale with the batch
    assert meter.peak == max(sizes)
    with torch.no_grad(), meter.measure():
        model(x, y)
    assert meter.last == 0  # nothing is saved without autograd


def test_activation_formula():
    assert activation_bytes_per_layer(2048, 1, 4096, 32) == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert activation_bytes_per_layer(2048, 1, 4096, 32, recompute=True) == 2 * 2048 * 4096
