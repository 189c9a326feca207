"""Lesson 06: the column-parallel linear (f) and the row-parallel linear (g), as autograd
Functions ``apply(x, weight, bias, comm)``."""

import torch
import torch.nn.functional as F

from answers import Answers


def _tokens(t):
    return t.reshape(-1, t.shape[-1])


# -- column_parallel_linear: Y_r = X·A_rᵀ + b_r forward; dL/dX summed over the ranks backward ---------


class ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        grad_bias = _tokens(grad_out).sum(0) if ctx.has_bias else None
        return grad_x, _tokens(grad_out).T @ _tokens(x), grad_bias, None


class ColumnBiasAlways(ColumnParallel):  # a bias gradient also where the layer has no bias
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        return grad_x, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class ColumnWithoutTheSum(ColumnParallel):  # dL/dX is only this rank's part
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        return grad_out @ weight, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class ColumnAveraged(ColumnParallel):  # the all-reduce's sum divided by N, as for DP gradients
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        grad_x /= ctx.comm.size
        return grad_x, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class ColumnBiasAveraged(ColumnParallel):  # the bias gradient averaged over the ranks, as in DP
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        grad_bias = _tokens(grad_out).sum(0) / ctx.comm.size if ctx.has_bias else None
        return grad_x, _tokens(grad_out).T @ _tokens(x), grad_bias, None


class ColumnAllReduceForward(ColumnParallel):  # sums the ranks' (different) columns in forward
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        out = F.linear(x, weight, bias)
        comm.all_reduce(out)
        return out


class ColumnWeightGradOfOneSample(ColumnParallel):  # dL/dA from the first sample only
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        return grad_x, grad_out[0].T @ x[0], _tokens(grad_out).sum(0), None


class ColumnNone(torch.autograd.Function):  # written, but forward returns nothing
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad_out):
        return None, None, None, None


# -- row_parallel_linear: Z = Σ_r X_r·B_rᵀ (g: all-reduce) + b forward; identity on dL/dZ backward ----


class RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        out = F.linear(x, weight)
        comm.all_reduce(out)
        return out + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        return grad_out @ weight, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class RowWithoutTheSum(RowParallel):  # each rank keeps its partial product
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)


class RowBiasBeforeTheSum(RowParallel):  # every rank's b goes into the all-reduce
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        out = F.linear(x, weight, bias)
        comm.all_reduce(out)
        return out


class RowAllReduceBackward(RowParallel):  # all-reduces dL/dZ, which every rank has whole
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.clone()
        ctx.comm.all_reduce(grad_out)
        return grad_out @ weight, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class RowGradXSummed(RowParallel):  # the column-parallel habit: all-reduce of dL/dX_r
    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        ctx.comm.all_reduce(grad_x)
        return grad_x, _tokens(grad_out).T @ _tokens(x), _tokens(grad_out).sum(0), None


class RowSlicesXAgain(RowParallel):  # takes x for the whole X and cuts its own slice
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        per = x.shape[-1] // comm.size
        x = x[..., comm.rank * per:(comm.rank + 1) * per]
        ctx.save_for_backward(x, weight)
        out = F.linear(x, weight)
        comm.all_reduce(out)
        return out + bias


ANSWERS = {
    "column_parallel_linear": Answers(ColumnParallel, [
        (ColumnWithoutTheSum, "sum it over the ranks with comm.all_reduce"),
        (ColumnAveraged, "the mean of the ranks' parts"),
        (ColumnAllReduceForward, "forward communicated (all_reduce)"),
        (ColumnWeightGradOfOneSample, "the weight gradient differs"),
        (ColumnBiasAveraged, "the bias gradient is 1/2 of rows 0:4 of the full layer's bias "
                             "gradient — divided by N = 2"),
        (ColumnNone, "forward returned NoneType"),
        (ColumnBiasAlways, "with bias=None"),
    ]),
    "row_parallel_linear": Answers(RowParallel, [
        (RowWithoutTheSum, "the output is this rank's partial sum"),
        (RowBiasBeforeTheSum, "the bias is counted 2 times"),
        (RowAllReduceBackward, "every gradient is 2× the full layer's"),
        (RowGradXSummed, "dL/dX_r was summed over the ranks"),
        (RowSlicesXAgain, "x is this rank's slice X_r"),
    ]),
}


# -- vocab_parallel_cross_entropy: the loss from each rank's slice of the logits ---------------------


class VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        logits = logits.float().masked_fill(columns >= vocab_size, float("-inf"))
        peak = logits.max(-1).values
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        softmax = exp / both[1].unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return both[1].log() - both[0]

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None, None


class CEGathersTheLogits(VocabParallelCE):  # right numbers, but the whole vocabulary travels
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        parts = logits.new_empty(comm.size * logits.shape[0], *logits.shape[1:])
        comm.all_gather(parts, logits.contiguous())
        full = torch.cat(parts.chunk(comm.size), -1)[..., :vocab_size]
        ctx.save_for_backward(full.softmax(-1), target)
        ctx.start, ctx.width = vocab_start, logits.shape[-1]
        return torch.logsumexp(full, -1) - full.gather(-1, target.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        g = softmax - torch.nn.functional.one_hot(target, softmax.shape[-1]).to(softmax.dtype)
        g = torch.nn.functional.pad(g, (0, ctx.start + ctx.width - softmax.shape[-1]))
        return (g * grad.unsqueeze(-1))[..., ctx.start:ctx.start + ctx.width], None, None, None, None


class CEPaddingCounted(VocabParallelCE):  # the padded columns go into the softmax
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        logits = logits.float()
        peak = logits.max(-1).values
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        ctx.save_for_backward(exp / both[1].unsqueeze(-1), local, mine)
        return both[1].log() - both[0]


class CEWithoutTheMax(VocabParallelCE):  # exp(z) straight: overflows for large logits
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        exp = logits.float().exp().masked_fill(columns >= vocab_size, 0.0)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        ctx.save_for_backward(exp / both[1].unsqueeze(-1), local, mine)
        return both[1].log() - both[0]


class CEOwnMax(VocabParallelCE):  # each rank shifts by its own max: the sums do not add up
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        logits = logits.float().masked_fill(columns >= vocab_size, float("-inf"))
        shifted = logits - logits.max(-1).values.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        ctx.save_for_backward(exp / both[1].unsqueeze(-1), local, mine)
        return both[1].log() - both[0]


class CEGradientWithoutOneHot(VocabParallelCE):
    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        return softmax * grad.unsqueeze(-1), None, None, None, None


class CEMeanNotPerPosition(VocabParallelCE):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        return VocabParallelCE.forward(ctx, logits, target, vocab_start, vocab_size, comm).mean()


class CEMaxInFloat64(VocabParallelCE):  # the max travels in float64: 3 numbers, 16 bytes
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        logits = logits.float().masked_fill(columns >= vocab_size, float("-inf"))
        peak = logits.double().max(-1).values
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - peak.float().unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        softmax = exp / both[1].unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return both[1].log() - both[0]


class CEAllInFloat64(VocabParallelCE):  # everything in float64: 3 numbers, 24 bytes
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        logits = logits.double().masked_fill(columns >= vocab_size, float("-inf"))
        peak = logits.max(-1).values
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        softmax = exp / both[1].unsqueeze(-1)
        ctx.save_for_backward(softmax.float(), local, mine)
        return (both[1].log() - both[0]).float()


class CEMaxSummed(VocabParallelCE):  # the max all-reduced with the default op, SUM
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, comm):
        columns = torch.arange(vocab_start, vocab_start + logits.shape[-1])
        logits = logits.float().masked_fill(columns >= vocab_size, float("-inf"))
        peak = logits.max(-1).values
        comm.all_reduce(peak)
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        local = (target - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        both = torch.stack([target_logit, exp.sum(-1)])
        comm.all_reduce(both)
        softmax = exp / both[1].unsqueeze(-1)
        ctx.save_for_backward(softmax, local, mine)
        return both[1].log() - both[0]


ANSWERS["vocab_parallel_cross_entropy"] = Answers(VocabParallelCE, [
    (CEGathersTheLogits, "forward made all_gather"),
    (CEPaddingCounted, "padding column(s) (ids 13..13, holding a logit of 10000 here) included"),
    (CEWithoutTheMax, "overflows float32"),
    (CEOwnMax, "matches sums of exponentials each shifted by its own rank's max"),
    (CEGradientWithoutOneHot, "the target's column also gets −1"),
    (CEMeanNotPerPosition, "the loss at every position (no mean"),
    (CEMaxInFloat64, "forward all-reduced 3 numbers per position, 1 of them in float64: 16 bytes"),
    (CEAllInFloat64, "forward all-reduced 3 numbers per position, all 3 of them in float64: "
                     "24 bytes"),
    (CEMaxSummed, "with op=SUM, so every rank shifts by the sum of the ranks' maxes"),
])
