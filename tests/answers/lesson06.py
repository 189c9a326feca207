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
