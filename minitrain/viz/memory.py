"""The memory calculator of lesson 00: what one device must hold to train a model.

Weights, gradients and Adam states take 16 bytes per parameter in mixed precision (Rajbhandari et
al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"), so a 7B model
needs 112 GB before a single activation — more than an 80 GB H100.  The calculator puts the formulas
of :mod:`minitrain.memory` behind controls (model, recipe, devices, ZeRO stage, activation
checkpointing) and draws one device's memory as a stacked bar against its capacity.
``per_device`` and ``bar_html`` are pure (unit-tested); ``MemoryCalculator`` wires ipywidgets to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import GB, RECIPES, activation_bytes_per_layer, model_state_bytes
from . import beside

__all__ = ["ModelShape", "MODELS", "DEVICES", "per_device", "bar_html", "zero_hint",
           "MemoryCalculator"]


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need to know about a model."""

    params: float
    layers: int
    hidden: int
    heads: int


#: Public model shapes (parameter counts as published).
MODELS = {
    "GPT-2 XL (1.5B)": ModelShape(1.5e9, 48, 1600, 25),
    "LLaMA 7B": ModelShape(7e9, 32, 4096, 32),
    "ZeRO paper 7.5B": ModelShape(7.5e9, 32, 4096, 32),
    "LLaMA 13B": ModelShape(13e9, 40, 5120, 40),
    "LLaMA 70B": ModelShape(70e9, 80, 8192, 64),
    "GPT-3 (175B)": ModelShape(175e9, 96, 12288, 96),
}

#: Device memory in GB (decimal, as vendors quote it).
DEVICES = {"H100 80GB": 80, "A100 40GB": 40, "RTX 4090 24GB": 24, "T4 16GB": 16}

KINDS = ("parameters", "gradients", "optimizer_states", "activations")
#: the controls' labels: one width, so that the controls line up
STYLE = {"description_width": "90px"}
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868",
          "activations": "#c44e52"}


def per_device(model: ModelShape, recipe: str = "mixed-adam", devices: int = 1, zero_stage: int = 0,
               seq: int = 2048, micro_batch: int = 1, recompute: bool = False) -> dict:
    """Bytes one data-parallel device holds: model states (ZeRO-sharded) plus activations.

    Activations are per device and not sharded by ZeRO: ``layers`` × the per-layer formula for
    ``micro_batch`` sequences of ``seq`` tokens (16-bit; only layer inputs kept when ``recompute``).
    """
    states = model_state_bytes(model.params, devices, zero_stage, recipe)
    acts = model.layers * activation_bytes_per_layer(seq, micro_batch, model.hidden, model.heads,
                                                     recompute)
    out = {k: states[k] for k in KINDS[:3]}
    out["activations"] = acts
    out["total"] = sum(out[k] for k in KINDS)
    return out


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:,.1f} MB"


def bar_html(breakdown: dict, capacity_gb: float, label: str = "") -> str:
    """One device's memory as a stacked bar, scaled so the capacity line is always visible."""
    capacity = capacity_gb * GB
    scale = max(breakdown["total"], capacity) * 1.05
    segments = "".join(
        f'<div class="mt-seg mt-seg-{k}" title="{k}: {_gb(breakdown[k])}" style="width:'
        f'{100 * breakdown[k] / scale:.3f}%;background:{COLORS[k]};height:100%"></div>'
        for k in KINDS if breakdown[k] > 0)
    fits = breakdown["total"] <= capacity
    verdict = "fits" if fits else "does not fit"
    legend = " · ".join(f'<span style="color:{COLORS[k]}">■</span> {k.replace("_", " ")} '
                        f'{_gb(breakdown[k])}' for k in KINDS)
    return (
        f'<div class="mt-memory-bar" style="font-family:sans-serif;max-width:720px">'
        f'<div><b class="mt-per-device">{_gb(breakdown["total"])} per device</b> of '
        f'{capacity_gb:g} GB: <span class="mt-verdict" style="color:{"green" if fits else "red"}">'
        f'{verdict}</span> {label}</div>'
        f'<div style="position:relative;height:28px;background:#eee;display:flex;margin:6px 0">'
        f'{segments}<div class="mt-capacity" style="position:absolute;left:'
        f'{100 * capacity / scale:.3f}%;top:-4px;bottom:-4px;border-left:3px dashed black"></div>'
        f'</div><div style="font-size:90%">{legend}</div></div>')


def zero_hint(devices: int, zero_stage: int) -> str | None:
    """Why the device count changes nothing (or ZeRO does nothing) for this setting; else None."""
    if zero_stage == 0 and devices > 1:
        return (f"At ZeRO stage 0 every device holds all the weights, gradients and optimizer "
                f"states (plain data parallelism), so {devices} devices need as much each as one: "
                "more devices split the batch, not the memory. Stages 1, 2 and 3 shard them.")
    if zero_stage > 0 and devices == 1:
        return ("With one device ZeRO has nothing to shard over: it divides the model states "
                "among devices. Add devices to see the stage act.")
    return None


class MemoryCalculator:
    """ipywidgets front end: ``MemoryCalculator().widget`` is what the notebook displays."""

    def __init__(self, model: str = "LLaMA 7B", device: str = "H100 80GB"):
        import ipywidgets as w

        self.model = w.Dropdown(options=list(MODELS), value=model, description="model",
                                style=STYLE)
        self.recipe = w.Dropdown(options=list(RECIPES), value="mixed-adam", description="recipe",
                                 style=STYLE)
        self.devices = w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], value=1,
                                  description="devices", style=STYLE)
        self.zero = w.ToggleButtons(options=["0", "1", "2", "3"], value="0",
                                    description="ZeRO stage",
                                    style=dict(STYLE, button_width="48px"), layout=beside())
        self.zero.add_class("mt-zero-stage")
        self.device = w.Dropdown(options=list(DEVICES), value=device, description="device",
                                 style=STYLE)
        self.seq = w.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=2048,
                              description="sequence", style=STYLE)
        self.micro_batch = w.IntSlider(value=1, min=1, max=32, description="micro-batch",
                                       style=STYLE)
        self.recompute = w.Checkbox(value=False, description="activation checkpointing",
                                    style=STYLE)
        self.out = w.HTML()
        controls = [self.model, self.recipe, self.devices, self.zero, self.device, self.seq,
                    self.micro_batch, self.recompute]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox(controls + [self.out])
        self.widget.add_class("mt-memory-calculator")
        self.update()

    def breakdown(self) -> dict:
        return per_device(MODELS[self.model.value], self.recipe.value, self.devices.value,
                          int(self.zero.value), self.seq.value, self.micro_batch.value,
                          self.recompute.value)

    def update(self) -> None:
        hint = zero_hint(self.devices.value, int(self.zero.value))
        self.out.value = bar_html(self.breakdown(), DEVICES[self.device.value]) + (
            "" if hint is None else f'<div class="mt-hint" style="font-family:sans-serif;'
            f'font-size:90%;color:#555;max-width:720px;line-height:1.4">{hint}</div>')

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
