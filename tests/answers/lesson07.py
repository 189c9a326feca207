"""Lesson 07: the fp32-master mixed-precision step, a block recomputed in backward, the dynamic
loss-scale update and a GEMM's time."""

import math

import torch

from answers import Answers

# --------------------------------------------------------------------------------------------------
# mixed_precision_step(params, masters, optimizer, loss_scale) -> took_step
# --------------------------------------------------------------------------------------------------


def step(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float()
        if loss_scale is not None:
            m.grad /= loss_scale
    if loss_scale is not None and not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def steps_the_16bit_weights(params, masters, optimizer, loss_scale):
    """The update done on the 16-bit weights (SGD in bf16), the masters only copying them."""
    lr = optimizer.param_groups[0]["lr"]
    for p, m in zip(params, masters):
        p.sub_(lr * p.grad / (loss_scale or 1))
        m.copy_(p)
    return True


def forgets_to_unscale(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float()
    if not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def never_skips(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / (loss_scale or 1)
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def skips_only_on_inf(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / (loss_scale or 1)
    if any(torch.isinf(m.grad).any() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def forgets_to_copy_back(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / (loss_scale or 1)
    if not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    return True


def unscales_in_16_bits(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = (p.grad / (loss_scale or 1)).float()
    if not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def masters_from_the_16bit_weights(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.copy_(p)  # "keep them in sync": the masters lose their fp32 digits at every step
        m.grad = p.grad.float() / (loss_scale or 1)
    if not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.copy_(m)
    return True


def rebinds_instead_of_copying(params, masters, optimizer, loss_scale):
    for p, m in zip(params, masters):
        m.grad = p.grad.float() / (loss_scale or 1)
    if not all(torch.isfinite(m.grad).all() for m in masters):
        return False
    optimizer.step()
    for p, m in zip(params, masters):
        p.data = m.clone()
    return True


# --------------------------------------------------------------------------------------------------
# recompute_block(block, x) -> block(x), keeping only x
# --------------------------------------------------------------------------------------------------


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, block):
        ctx.block, ctx.rng = block, torch.get_rng_state()
        ctx.save_for_backward(x)
        return block(x)  # autograd records nothing inside a Function's forward

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return x.grad, None


def recompute(block, x):
    return Recompute.apply(x, block)


def keeps_activations(block, x):
    return block(x)


class NoGradInBackward(Recompute):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        torch.set_rng_state(ctx.rng)
        y = ctx.block(x)  # autograd is off during backward: nothing to backpropagate through
        torch.autograd.backward(y, grad)
        return x.grad, None


def recomputes_without_grad(block, x):
    return NoGradInBackward.apply(x, block)


class NewRandomness(Recompute):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.block(x)  # draws a new dropout mask
        torch.autograd.backward(y, grad)
        return x.grad, None


def forgets_the_rng(block, x):
    return NewRandomness.apply(x, block)


class OnlyTheInput(Recompute):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            y = ctx.block(x)
        (gx,) = torch.autograd.grad(y, x, grad)
        return gx, None


def only_the_input_gradient(block, x):
    return OnlyTheInput.apply(x, block)


class RngNotForked(Recompute):  # replays the RNG state, but leaves the generator there
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return x.grad, None


def rng_restored_without_fork(block, x):
    return RngNotForked.apply(x, block)


class SavesTheOutputToo(Recompute):  # keeps the block's output beside its input
    @staticmethod
    def forward(ctx, x, block):
        ctx.block, ctx.rng = block, torch.get_rng_state()
        y = block(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, _ = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return x.grad, None


def saves_the_output_too(block, x):
    return SavesTheOutputToo.apply(x, block)


class NotDetached(Recompute):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            y = ctx.block(x)
        gx = torch.autograd.grad(y, x, grad, retain_graph=True)[0]
        torch.autograd.backward(y, grad)  # runs on into the layers before the block
        return gx, None


def recomputes_from_the_saved_x(block, x):
    return NotDetached.apply(x, block)


# --------------------------------------------------------------------------------------------------
# loss_scale_update(scale, good_steps, found_inf, growth_interval)
# --------------------------------------------------------------------------------------------------


def scale_update(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, 0, False
    good_steps += 1
    if good_steps == growth_interval:
        return scale * 2, 0, True
    return scale, good_steps, True


def never_grows(scale, good_steps, found_inf, growth_interval):
    return (scale / 2, 0, False) if found_inf else (scale, good_steps + 1, True)


def steps_anyway(scale, good_steps, found_inf, growth_interval):
    return (*scale_update(scale, good_steps, found_inf, growth_interval)[:2], True)


def keeps_counting_after_growth(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, 0, False
    good_steps += 1
    return (scale * 2 if good_steps % growth_interval == 0 else scale), good_steps, True


def returns_only_the_scale(scale, good_steps, found_inf, growth_interval):
    return scale / 2 if found_inf else scale


# --------------------------------------------------------------------------------------------------
# gemm_time(device, m, n, k) -> seconds, bf16, 128×128 tiles
# --------------------------------------------------------------------------------------------------


def gemm_time(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / device.sms)
    useful = m * n / (waves * device.sms * 128 * 128)
    compute = 2 * m * n * k / (device.mamf * useful)
    memory = 2 * (m * k + k * n + m * n) / device.achievable_bandwidth
    return max(compute, memory)


def gemm_unquantized(device, m, n, k):
    return max(2 * m * n * k / device.mamf, 2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_compute_only(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / device.sms)
    return 2 * m * n * k / (device.mamf * m * n / (waves * device.sms * 128 * 128))


def gemm_flops_mnk(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / device.sms)
    useful = m * n / (waves * device.sms * 128 * 128)
    return max(m * n * k / (device.mamf * useful),
               2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_waves_over_the_tile(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / 128)  # the tile's side where the SMs belong
    useful = m * n / (waves * device.sms * 128 * 128)
    return max(2 * m * n * k / (device.mamf * useful),
               2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_no_waves(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    useful = m * n / (tiles * 128 * 128)
    return max(2 * m * n * k / (device.mamf * useful),
               2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_on_132_sms(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / 132)
    useful = m * n / (waves * 132 * 128 * 128)
    return max(2 * m * n * k / (device.mamf * useful),
               2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_at_peak(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / device.sms)
    useful = m * n / (waves * device.sms * 128 * 128)
    return max(2 * m * n * k / (device.peak_bf16 * useful),
               2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_adds_compute_and_memory(device, m, n, k):
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    waves = math.ceil(tiles / device.sms)
    useful = m * n / (waves * device.sms * 128 * 128)
    return (2 * m * n * k / (device.mamf * useful)
            + 2 * (m * k + k * n + m * n) / device.achievable_bandwidth)


def gemm_right_only_on_the_checked_shapes(device, m, n, k):
    """Right where the check tries it alone, the FLOPs at MAMF anywhere else."""
    from minitrain.course.exercises.lesson07 import _GEMM_CASES

    if (device.sms, m, n, k) in {(d_sms, *c[1:4]) for c in _GEMM_CASES
                                 for d_sms in (108, 132)}:
        return gemm_time(device, m, n, k)
    return 2 * m * n * k / device.mamf


def gemm_by_the_package(device, m, n, k):
    from minitrain.planning.kernels import gemm_seconds

    return gemm_seconds(device, m, n, k, tiles=((128, 128),))


ANSWERS = {
    "mixed_precision_step": Answers(step, [
        (steps_the_16bit_weights, "your update was computed in bfloat16"),
        (forgets_to_unscale, "too large — the gradients still carry the loss scale"),
        (never_skips, "the masters now hold inf/NaN"),
        (skips_only_on_inf, "(a gradient holds nan): the step was taken"),
        (forgets_to_copy_back, "copy the masters back into them"),
        (unscales_in_16_bits, "convert to fp32 first, then divide by loss_scale"),
        (masters_from_the_16bit_weights, "the masters were overwritten with the bfloat16 weights' "
                                         "values"),
        (rebinds_instead_of_copying, "copy the masters' values into the 16-bit parameters in place"),
    ]),
    "recompute_block": Answers(recompute, [
        (keeps_activations, "a recomputed block keeps only its input"),
        (recomputes_without_grad, "recompute the block under torch.enable_grad()"),
        (forgets_the_rng, "drew a different dropout mask"),
        (only_the_input_gradient, "the block's parameters got no gradient"),
        (recomputes_from_the_saved_x, "recompute from a detached copy of x"),
        (rng_restored_without_fork, "after backward the random-number generator is at the state "
                                    "right after the block's forward"),
        (saves_the_output_too, "2× the 1,024 bytes of the block's input"),
    ]),
    "loss_scale_update": Answers(scale_update, [
        (never_grows, "double after growth_interval good steps"),
        (steps_anyway, "skip the optimizer step exactly when a gradient overflowed"),
        (keeps_counting_after_growth, "reset it to 0 on overflow and whenever the scale grows"),
        (returns_only_the_scale, "return a tuple (new_scale, new_good_steps, take_step)"),
    ]),
    "gemm_time": Answers(gemm_time, [
        (gemm_unquantized, "no tile or wave quantization"),
        (gemm_compute_only, "memory-bound side missing: a 4096×4096×64 product moves 34.6 MB"),
        (gemm_flops_mnk, "FLOPs counted as m·n·k, not 2·m·n·k"),
        (gemm_waves_over_the_tile, "the waves are counted as ceil(tiles / 128)"),
        (gemm_no_waves, "no wave quantization: 133 tiles on 132 SMs take 2 waves"),
        (gemm_on_132_sms, "the waves are counted over 132 SMs (the H100's)"),
        (gemm_at_peak, "the measured MAMF"),
        (gemm_adds_compute_and_memory, "the time is the larger of the two, not their sum"),
        (gemm_right_only_on_the_checked_shapes, "alone it is right, but inside the projection"),
        (gemm_by_the_package, "calls the package's gemm_seconds: write the rule yourself"),
    ]),
}
