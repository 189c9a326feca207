"""Lesson 07: the fp32-master mixed-precision step, a block recomputed in backward, and the dynamic
loss-scale update — each checked alone, then inside the real strategy through its seam (``ddp``'s
``mixed_precision_step`` and ``recompute_block``; the loss-scale rule driving a real fp16-mixed run
of ``single``, its scale at every step against the package's rule's)."""

from __future__ import annotations

import math
import traceback

import torch

from .core import exercise, raised, ranks
from .inside import RUNS, Row, inside

_MODEL = dict(n_layer=2, n_head=2, d_model=32, seq_len=16)  # small: the checks run in seconds


def _where(exc: BaseException, fn) -> str:
    """`` (in your NAME: line)`` for the last frame of the learner's file (their autograd.Function's
    methods sit beside ``fn``, so a line number counted from ``fn`` would mislead)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == code.co_filename]
    return f" (in your {mine[-1].name}: {(mine[-1].line or '').strip()})" if mine else ""


# --------------------------------------------------------------------------------------------------
# The fp32-master step
# --------------------------------------------------------------------------------------------------


def _weights(dtype, seed: int, centre: float, spread: float):
    """16-bit parameters and their fp32 masters (the exact weights, taken before the cast)."""
    g = torch.Generator().manual_seed(seed)
    masters = [torch.randn(shape, generator=g) * spread + centre for shape in ((6, 8), (8,))]
    return [torch.nn.Parameter(m.to(dtype)) for m in masters], [m.clone() for m in masters]


#: the cases: (what, dtype, optimizer, lr, loss scale, centre and spread of the weights, the
#: steps' gradients: "normal", "tiny" (underflow fp16 once unscaled in 16 bits), "inf", "nan")
_CASES = [
    ("bf16 weights near 1, Adam (lr 1e-3), no loss scale", torch.bfloat16, torch.optim.Adam, 1e-3,
     None, 1.0, 0.25, ("normal", "normal", "normal")),
    ("fp16 weights, SGD (lr 1), loss scale 2^16", torch.float16, torch.optim.SGD, 1.0,
     2.0 ** 16, 0.0, 0.01, ("normal", "inf", "tiny", "nan", "normal")),
]


def _grads(kind: str, shapes, scale, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    size = 1e-8 if kind == "tiny" else 1e-2 if scale else 1.0
    out = [(torch.randn(s, generator=g) * size * (scale or 1)).to(dtype) for s in shapes]
    if kind in ("inf", "nan"):
        out[1][3] = float(kind)  # fp16 overflowed (inf), or inf - inf somewhere (NaN)
    return out


def _vanished(before, ref, dtype) -> str:
    """An element whose fp32 update rounds away in ``dtype``, in words."""
    for b, r in zip(before, ref):
        moved = (r != b) & (r.to(dtype) == b.to(dtype))
        if moved.any():
            i = int(moved.flatten().nonzero()[0])
            w, new = float(b.flatten()[i]), float(r.flatten()[i])
            w16 = float(b.flatten()[i].to(dtype))
            ulp = float(torch.finfo(dtype).eps) * 2 ** torch.tensor(abs(w16)).log2().floor().item()
            return (f" — e.g. the fp32 step moves a weight from {w:.6f} to {new:.6f}, but in "
                    f"{str(dtype).replace('torch.', '')} both are {w16:.4f} (neighbours there are "
                    f"{ulp:.1e} apart), so an update that small vanishes")
    return ""


def _step_problem(fn) -> str | None:
    from ...precision import mixed_precision_step

    for what, dtype, opt_class, lr, scale, centre, spread, kinds in _CASES:
        params, masters = _weights(dtype, 1, centre, spread)
        ref_params, ref_masters = _weights(dtype, 1, centre, spread)
        opt, ref_opt = opt_class(masters, lr=lr), opt_class(ref_masters, lr=lr)
        low = str(dtype).replace("torch.", "")
        for step, kind in enumerate(kinds):
            grads = _grads(kind, [p.shape for p in params], scale, dtype, 10 + step)
            for p, q, g in zip(params, ref_params, grads):
                p.grad, q.grad = g.clone(), g.clone()
            before = [m.clone() for m in masters]
            before16 = [p.detach().clone() for p in params]
            case = f"{what}, step {step}" + (f" (a gradient holds {kind})" if kind in ("inf", "nan")
                                               else "")
            try:
                with torch.no_grad():
                    took = fn(params, masters, opt, scale)
            except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
                return raised(f"{case}: your step", exc, fn)
            want = mixed_precision_step(ref_params, ref_masters, ref_opt, scale)
            for m in masters + ref_masters:
                m.grad = None  # as MixedPrecisionOptimizer does after the step
            if torch.is_tensor(took) and took.numel() == 1:
                took = bool(took)  # e.g. torch.isfinite(...).all()
            if took is None or not isinstance(took, (bool, int)):
                return (f"{case}: returned {took!r}: return True when you took the step, False when "
                        "you skipped it (the loss scaler halves its scale on False)")
            if any(p.dtype != dtype for p in params):
                return (f"{case}: a parameter is now {params[0].dtype}, not {low}: copy the masters' "
                        "values into the 16-bit parameters in place (they keep their dtype: "
                        "forward and backward stay in 16 bits)")
            if not want:
                if any(not torch.isfinite(m).all() for m in masters):
                    return (f"{case}: the step was taken and the masters now hold inf/NaN — with a "
                            "loss scale, check every unscaled gradient for inf and NaN "
                            "(torch.isfinite) and skip the step when there is one")
                if any(not torch.equal(m, b) for m, b in zip(masters, before)) or any(
                        not torch.equal(p.detach(), b) for p, b in zip(params, before16)):
                    return (f"{case}: the weights changed on a step that overflowed: a skipped "
                            "step leaves masters, parameters and the optimizer untouched")
                if took:
                    return (f"{case}: nothing changed but you returned True: return False for a "
                            "skipped step (the loss scaler halves its scale on False)")
                continue
            if not took:
                return (f"{case}: returned False (skipped) though every gradient is finite — skip "
                        "only on inf or NaN")
            moved = any(not torch.equal(m, b) for m, b in zip(masters, before))
            ref_moved = [r - b for r, b in zip(ref_masters, before)]
            only16 = all(torch.equal(m, m.to(dtype).float()) for m in masters)
            if (moved and only16 and not all(torch.equal(r, r.to(dtype).float())
                                            for r in ref_masters)) or (
                    not moved and any(not torch.equal(p.detach(), b)
                                      for p, b in zip(params, before16))):
                return (f"{case}: your update was computed in {low}, not on the fp32 masters"
                        f"{_vanished(before, ref_masters, dtype)}. Step the optimizer (it holds the "
                        "masters), then copy the masters into the parameters")
            mine = torch.cat([(m - b).flatten() for m, b in zip(masters, before)])
            ref = torch.cat([d.flatten() for d in ref_moved])
            nz = ref != 0
            if kind == "tiny" and bool((mine[nz] == 0).any()):
                return (f"{case}: tiny gradients became 0 — divided by loss_scale in fp16 they "
                        "fall below its smallest number (2⁻²⁴ ≈ 6e-8): convert to fp32 first, then "
                        "divide by loss_scale")
            if not moved:
                return (f"{case}: the fp32 masters did not move: give each master its parameter's "
                        "gradient in fp32 (master.grad) and call optimizer.step()")
            if not all(torch.allclose(m, r, rtol=1e-6, atol=1e-12)
                       for m, r in zip(masters, ref_masters)):
                off = [(m - r) for m, r in zip(masters, ref_masters)]
                rounding = [b16.float() - b for b16, b in zip(before16, before)]
                if any(x.abs().max() > 0 for x in rounding) and all(
                        torch.allclose(o, x, rtol=1e-3, atol=1e-7) for o, x in zip(off, rounding)):
                    worst = max(float(x.abs().max()) for x in rounding)
                    return (f"{case}: each master ends the step off the fp32-master step by exactly "
                            f"its own rounding to {low} (up to {worst:.2e}): the masters were "
                            f"overwritten with the {low} weights' values, so their fp32 digits are "
                            "lost at every step. The masters are the fp32 truth: copy masters into "
                            "the parameters after the step, never the parameters into the masters")
                ratio = (mine[nz] / ref[nz]).median().item() if nz.any() else float("nan")
                if scale and abs(ratio / scale - 1) < 0.01:
                    return (f"{case}: the step is {ratio:,.0f}× too large — the gradients still "
                            f"carry the loss scale {scale:g}: divide them by loss_scale before "
                            "stepping (Adam hides most of it, as it divides by the gradient's own "
                            "size; SGD, weight decay and gradient clipping do not)")
                worst = max(float((m - r).abs().max()) for m, r in zip(masters, ref_masters))
                return (f"{case}: the masters differ from the fp32-master step by up to {worst:.2e}"
                        " — each master's gradient is its parameter's gradient in fp32, divided by "
                        "loss_scale (when there is one)")
            if not all(torch.equal(p.detach(), m.to(dtype)) for p, m in zip(params, masters)):
                if all(torch.equal(p.detach(), b) for p, b in zip(params, before16)):
                    return (f"{case}: the masters moved but the model's {low} parameters did not: "
                            "copy the masters back into them — forward and backward use the 16-bit "
                            "parameters, never the masters")
                return (f"{case}: the parameters are not the masters rounded to {low}: after the "
                        "step, copy each master into its parameter")
    return None


def _mp_cfg(precision: str, **more):
    from ...model import GPTConfig
    from ...strategies import TrainConfig
    return TrainConfig(strategy="ddp", world_size=2, steps=4, batch_size=8, precision=precision,
                       model=GPTConfig(**_MODEL), **more)


def _model_states(summary, cfg, package) -> list:
    """Rank 0's model states from the ledger beside the ZeRO paper's 2Ψ + 2Ψ + 4Ψ + 8Ψ = 16Ψ."""
    mem, psi = summary.memory[0], summary.params
    b, state = mem["bytes"], mem["by_state"]
    adam = state.get("exp_avg", 0) + state.get("exp_avg_sq", 0)
    low = next(iter(mem["by_dtype"]["parameters"]))
    return [Row(f"parameters ({low})", b["parameters"], "2Ψ", 2 * psi),
            Row(f"gradients ({low})", b["gradients"], "2Ψ", 2 * psi),
            Row("fp32 master weights", state.get("master", 0), "4Ψ", 4 * psi),
            Row("Adam momentum + variance (fp32)", adam, "8Ψ", 8 * psi),
            Row("model states on this rank", b["parameters"] + b["gradients"] + state.get("master", 0)
                + adam, "16Ψ (ZeRO)", 16 * psi)]


def _skips(summary, cfg, package) -> list:
    return [Row("fp16-mixed: steps skipped (overflow)", summary.loss_scaler["skipped_steps"],
                unit=" steps")]


@exercise("mixed_precision_step",
          "steps the fp32 masters (unscaled, skipping inf/NaN) and rounds them into the 16-bit "
          "weights, and strategy 'ddp' with it trains in fp16-mixed and bf16-mixed as the package's")
def _check_mixed_precision_step(fn) -> str | None:
    found = _step_problem(fn)
    if found:
        return found
    # fp16 first, from a loss scale that overflows at first, so the real run skips steps too
    found = inside("mixed_precision_step", fn, _mp_cfg("fp16-mixed", loss_scale=2.0 ** 20),
                   reference="package", measure=_skips)
    if found:
        return found
    fp16 = RUNS["mixed_precision_step"]
    skipped = fp16.package.loss_scaler["skipped_steps"]
    found = inside("mixed_precision_step", fn, _mp_cfg("bf16-mixed"), reference="package",
                   measure=_model_states)
    if found:
        return found
    row = fp16.rows[0]
    RUNS["mixed_precision_step"].rows.append(
        Row(row.what, row.measured, "the package's", skipped, row.unit))
    return None


# --------------------------------------------------------------------------------------------------
# Recomputation
# --------------------------------------------------------------------------------------------------


def _blocks():
    """A transformer block of the tiny GPT, and a block with dropout (the RNG must be replayed)."""
    from ...model import Block, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8))
        dropout = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5),
                                      torch.nn.GELU(), torch.nn.Linear(32, 16))
    return [("a transformer block", block), ("a block with dropout", dropout)]


def _run_block(block, call, rng_seed: int):
    """Forward ``call(block, x)`` (x made from a leaf ``w``) with the activations measured, then
    backward; returns (output, bytes saved for backward, grad of w, grads of the block's params)."""
    from ...memory import ActivationMeter

    g = torch.Generator().manual_seed(5)
    w = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    upstream = torch.randn(2, 8, 16, generator=g)
    block.zero_grad(set_to_none=True)
    meter = ActivationMeter(block)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        x = w * 1.5  # an activation of the layer before, so gradients must flow on through x
        with meter.measure():
            y = call(block, x)
        after_forward = torch.get_rng_state()
        torch.manual_seed(rng_seed + 1)  # the RNG has moved on by the time backward runs
        if torch.is_tensor(y) and y.requires_grad:
            (y * upstream).sum().backward()
        after_backward = torch.get_rng_state()  # what the next layer's dropout draws from
    rng = (after_forward, after_backward)
    return (y, meter.last, w.grad, [p.grad for p in block.parameters()],
            x.numel() * x.element_size(), rng)


def _recompute_problem(fn) -> str | None:
    for what, block in _blocks():
        want, plain_bytes, want_w, want_p, x_bytes, want_rng = _run_block(
            block, lambda b, x: b(x), 7)
        try:
            got, kept, got_w, got_p, _, got_rng = _run_block(block, fn, 7)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            msg = f"on {what}: {type(exc).__name__}: {str(exc).splitlines()[0]}{_where(exc, fn)}"
            if "does not require grad" in str(exc):
                msg += (" — autograd is switched off while backward runs: recompute the block "
                        "under torch.enable_grad()")
            if "backward through the graph a second time" in str(exc):
                msg += (" — your recomputed graph runs on into the layers before the block: "
                        "recompute from a detached copy of x (x.detach().requires_grad_())")
            return msg
        if not torch.is_tensor(got) or got.shape != want.shape:
            return f"on {what}: returned {getattr(got, 'shape', got)!r}, expected block(x), shape {tuple(want.shape)}"
        if not torch.allclose(got, want, atol=1e-6):
            return f"on {what}: the output differs from block(x): return the block's output"
        if kept > x_bytes:
            if kept >= 0.9 * plain_bytes:
                return (f"on {what}: autograd kept {kept:,} bytes for backward, as the plain block "
                        f"does ({plain_bytes:,}): a recomputed block keeps only its input "
                        f"({x_bytes:,} bytes) — run the forward without recording (torch.no_grad(),"
                        " or inside a torch.autograd.Function's forward) and save only x")
            extra = kept - x_bytes
            same = (" — exactly the size of one more tensor like x (the block's output is one)"
                    if extra % x_bytes == 0 else "")
            return (f"on {what}: autograd kept {kept:,} bytes for backward, {kept / x_bytes:.2g}× "
                    f"the {x_bytes:,} bytes of the block's input (the plain block keeps "
                    f"{plain_bytes:,}): {extra:,} bytes more than x{same}. A recomputed block keeps "
                    "only x; whatever else backward needs, it recomputes from x")
        if not got.requires_grad:
            return (f"on {what}: the output does not require grad, so backward never reaches the "
                    "block: make it the output of a torch.autograd.Function whose backward "
                    "recomputes the block")
        if not isinstance(got.grad_fn, torch.autograd.function.BackwardCFunction):
            return ("write the recomputation yourself, as a torch.autograd.Function (not "
                    "torch.utils.checkpoint: that is the package's own)")
        if any(g is None for g in got_p):
            return (f"on {what}: the block's parameters got no gradient: in backward, backpropagate "
                    "through the recomputed block to its parameters too, not only to x")
        if got_w is None or not got_w.abs().sum():
            return (f"on {what}: no gradient reached the layer before the block: backward must "
                    "return the gradient of the block's input x")
        if torch.allclose(got_w, 2 * want_w, atol=1e-6):
            return (f"on {what}: the layer before the block got its gradient twice: recompute from "
                    "a detached copy of x (x.detach().requires_grad_()), so the recomputed graph "
                    "stops at the block's input")
        same = torch.allclose(got_w, want_w, atol=1e-6) and all(
            torch.allclose(g, h, atol=1e-6) for g, h in zip(got_p, want_p))
        if not same:
            if "dropout" in what:
                return (f"on {what}: the gradients differ from the plain block's: the recomputation "
                        "drew a different dropout mask — save the RNG state in forward "
                        "(torch.get_rng_state()) and replay it around the recomputation "
                        "(torch.random.fork_rng(), torch.set_rng_state)")
            return (f"on {what}: the gradients differ from the plain block's (of x or of the "
                    "parameters): backpropagate the incoming gradient through the recomputed block")
        if not torch.equal(got_rng[1], want_rng[1]):
            at = ("the state right after the block's forward, so the random numbers drawn after "
                  "backward repeat those drawn after the forward (the next dropout masks repeat)"
                  if torch.equal(got_rng[1], want_rng[0]) else
                  "a state the plain block's backward does not leave")
            return (f"on {what}: the gradients are right, but after backward the random-number "
                    f"generator is at {at} — your backward changed the generator's state and left "
                    "it so: replay the saved state inside torch.random.fork_rng(devices=[]), which "
                    "puts the generator back when it ends")
    return None


def _recompute_cfg():
    from ...model import GPTConfig
    from ...strategies import TrainConfig
    return TrainConfig(strategy="ddp", world_size=2, steps=4, batch_size=8,
                       checkpoint_activations=True, model=GPTConfig(**_MODEL))


def _block_saves(cfg) -> int:
    """Bytes one plain transformer block of ``cfg``'s model saves for backward on one rank's
    micro-batch, measured alone by the ledger's meter."""
    from ...memory import ActivationMeter
    from ...model import Block

    m = cfg.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(m)
        x = torch.randn(cfg.batch_size // cfg.world_size, m.seq_len, m.d_model, requires_grad=True)
    meter = ActivationMeter(block)
    with meter.measure():
        block(x * 1.0)
    return meter.last


def _activations(summary, cfg, package) -> list:
    """Activation peaks with and without recomputation (an extra run), what recomputation saved
    beside one block's saved tensors, and the step-time cost beside one more forward."""
    from ...train import train

    plain = train(cfg.with_(checkpoint_activations=False), cluster=ranks(cfg.world_size)).summary
    m = cfg.model
    sbh = m.seq_len * (cfg.batch_size // cfg.world_size) * m.d_model
    peak0 = plain.memory[0]["bytes"]["activations_peak"]
    peak1 = summary.memory[0]["bytes"]["activations_peak"]
    t0, t1 = plain.step_time_s, summary.step_time_s
    block = _block_saves(cfg)

    def spread(s):  # the steps after the first: (lowest, highest) in ms
        times = (s.step_times_s or [s.step_time_s])[1:] or [s.step_time_s]
        return f"{min(times) * 1e3:.0f}–{max(times) * 1e3:.0f} ms over {len(times)} steps"
    return [Row("activation peak, no recomputation", peak0),
            Row("activation peak, your recomputation", peak1),
            Row("saved by recomputing", peak0 - peak1, f"L·(A_block − 4sbh), A_block {block:,} B",
                m.n_layer * (block - 4 * sbh)),
            Row(f"step time, plain ({spread(plain)})", t0, unit="s"),
            Row(f"step time, your recomputation ({spread(summary)})", t1,
                "4/3 × plain (one more forward)", 4 / 3 * t0, "s")]


@exercise("recompute_block",
          "keeps only the block's input, recomputes in backward with the same gradients (dropout "
          "too), and strategy 'ddp' with it equals one process")
def _check_recompute_block(fn) -> str | None:
    return _recompute_problem(fn) or inside("recompute_block", fn, _recompute_cfg(),
                                            measure=_activations)


# --------------------------------------------------------------------------------------------------
# The loss-scale rule
# --------------------------------------------------------------------------------------------------


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) or (
        torch.is_tensor(x) and x.numel() == 1)


def _rule_alone(fn) -> str | None:
    """The learner's rule, step by step, against DynamicLossScaler on an overflow pattern."""
    from ...precision import DynamicLossScaler

    ref = DynamicLossScaler(init_scale=2.0 ** 16, growth_interval=3)
    scale, good = ref.scale, 0
    pattern = [True, True, False, False, False, False, True, False, False, False, False]
    for step, found_inf in enumerate(pattern):
        ref.update(found_inf)
        call = f"step {step}: {getattr(fn, '__name__', 'your rule')}({scale:g}, {good}, {found_inf}, 3)"
        try:
            out = fn(scale, good, found_inf, 3)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(call, exc, fn)
        if not isinstance(out, tuple) or len(out) != 3:
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else repr(out)[:60]
            return f"{call} returned {got}: return a tuple (new_scale, new_good_steps, take_step)"
        new_scale, new_good, take = out
        if not _number(new_scale) or not _number(new_good):
            return (f"{call} returned {out!r}: new_scale and new_good_steps must be numbers "
                    "(take_step True or False)")
        new_scale, new_good = float(new_scale), int(new_good)
        if bool(take) == found_inf:
            return (f"{call}: found_inf={found_inf} but take_step={take}: skip the optimizer "
                    "step exactly when a gradient overflowed")
        if new_scale != ref.scale:
            return (f"{call}: scale {new_scale:g}, expected {ref.scale:g} "
                    "(halve on overflow; double after growth_interval good steps in a row)")
        if new_good != ref.good_steps:
            return (f"{call}: good_steps {new_good}, expected {ref.good_steps} (reset it to 0 on "
                    "overflow and whenever the scale grows)")
        scale, good = new_scale, new_good
    return None


#: the real fp16 run the rule drives: from a scale that overflows, growing every 3 good steps
_FP16_START, _FP16_GROWTH, _FP16_STEPS = 2.0 ** 24, 3, 12


def _fp16_cfg():
    from ...model import GPTConfig
    from ...strategies import TrainConfig
    return TrainConfig(strategy="single", world_size=1, steps=_FP16_STEPS, batch_size=8,
                       precision="fp16-mixed", loss_scale=_FP16_START,
                       loss_scale_growth=_FP16_GROWTH, model=GPTConfig(**_MODEL))


def _scales(summary, cfg, package) -> list:
    """The scale the run used at each step (and the steps skipped) beside the package's rule's."""
    mine, ref = summary.loss_scaler, package.loss_scaler
    log2 = lambda h: "·".join(f"{math.log2(s):g}" for s, _ in h["history"])  # noqa: E731
    return [Row("steps skipped (overflow)", mine["skipped_steps"], "the package's rule",
                ref["skipped_steps"], unit=" steps"),
            Row("scale at the end", mine["scale"], "the package's rule", ref["scale"], unit=""),
            Row(f"scale per step, log2: {log2(mine)}", len(mine["history"]), unit=" steps")]


@exercise('loss_scale_update',
          "halves on overflow and skips the step, doubles after a run of good steps, and drives a "
          "real fp16-mixed run (from 2^24, growing every 3 good steps) as the package's rule does")
def _check_loss_scale_update(fn) -> str | None:
    """Alone against DynamicLossScaler, then driving the loss scale of a real fp16-mixed run."""
    found = _rule_alone(fn)
    if found:
        return found
    cfg = _fp16_cfg()
    found = inside("loss_scale_update", fn, cfg, reference="package", measure=_scales)
    if found:
        return found
    run = RUNS["loss_scale_update"]
    mine, ref = run.summary.loss_scaler["history"], run.package.loss_scaler["history"]
    for step, ((s, skipped), (t, ref_skipped)) in enumerate(zip(mine, ref)):
        if s != t or skipped != ref_skipped:
            RUNS.pop("loss_scale_update")
            return (f"inside strategy 'single' (fp16-mixed from 2^{math.log2(_FP16_START):g}, "
                    f"growing every {_FP16_GROWTH} good steps) step {step} ran with scale {s:g}"
                    f"{' and was skipped' if skipped else ''} where the package's rule gives "
                    f"{t:g}{' (skipped)' if ref_skipped else ''}")
    return None
