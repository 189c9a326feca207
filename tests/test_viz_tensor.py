"""The split widget of lesson 06: the plan's blocks of A and B are the real shards and compute the
MLP; the drawing and the widget follow the controls."""

import pytest
import torch
import torch.nn.functional as F

from minitrain import GPT, PRESETS
from minitrain.viz.tensor import TensorSplitWidget, split_html, split_plan

MLP = GPT(PRESETS["tiny"], seed=0).blocks[0].mlp


def block(m: torch.Tensor, ranges) -> torch.Tensor:
    (a, b), (c, e) = ranges
    return m[a:b, c:e]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_columns_then_rows_blocks_compute_the_mlp_and_one_sum(n):
    plan = split_plan(MLP, n, "columns")
    d, ff = 64, 256
    assert plan["problem"] is None and len(plan["ranks"]) == n
    A, B = MLP.fc.weight.T.detach(), MLP.proj.weight.T.detach()
    x = torch.randn(5, d)
    with torch.no_grad():
        full = MLP(x) - MLP.proj.bias
        partial = [F.gelu(x @ block(A, r["A"]) + MLP.fc.bias[slice(*r["A"][1])]) @ block(B, r["B"])
                   for r in plan["ranks"]]
    torch.testing.assert_close(sum(partial), full, rtol=1e-5, atol=1e-6)
    for r in plan["ranks"]:
        assert r["A_shape"] == (d, ff // n) == tuple(block(A, r["A"]).shape)
        assert r["B_shape"] == (ff // n, d) == tuple(block(B, r["B"]).shape)
        assert r["X_columns"] == (0, d)  # every rank needs all of X
    assert [(c["pass"], c["op"]) for c in plan["collectives"]] == [
        ("forward", "all-reduce"), ("backward", "all-reduce")]


def test_rows_first_needs_a_sum_before_gelu_and_a_gather():
    plan = split_plan(MLP, 2, "rows")
    A, B = MLP.fc.weight.T.detach(), MLP.proj.weight.T.detach()
    x = torch.randn(5, 64)
    with torch.no_grad():
        hidden = sum(x[:, slice(*r["X_columns"])] @ block(A, r["A"]) for r in plan["ranks"])
        y = F.gelu(hidden + MLP.fc.bias)
        out = torch.cat([y @ block(B, r["B"]) for r in plan["ranks"]], dim=1)
        torch.testing.assert_close(out + MLP.proj.bias, MLP(x), rtol=1e-5, atol=1e-6)
        # summing after GeLU instead is wrong: that is why A is split by columns
        wrong = sum(F.gelu(x[:, slice(*r["X_columns"])] @ block(A, r["A"]) + MLP.fc.bias)
                    for r in plan["ranks"])
        assert not torch.allclose(wrong, y, atol=1e-3)
    ops = [(c["op"], c["width"]) for c in plan["collectives"] if c["pass"] == "forward"]
    assert ops == [("all-reduce", 256), ("all-gather", 64)]


def test_a_split_that_does_not_divide_says_so():
    assert "cuts the hidden width d_ff, 256, into 3 equal parts" in split_plan(MLP, 3)["problem"]
    assert "the model width d_model, 64" in split_plan(MLP, 3, "rows")["problem"]
    assert "mt-tp-problem" in split_html(split_plan(MLP, 3))
    with pytest.raises(ValueError, match="'columns' or 'rows'"):
        split_plan(MLP, 2, "diagonal")


def test_html_and_widget_follow_the_controls():
    html = split_html(split_plan(MLP, 4))
    assert html.count("mt-tp-rank") == 4 and html.count("mt-tp-collective") == 2
    assert "A (64 × 256)" in html and "Megatron" in html
    widget = TensorSplitWidget(GPT(PRESETS["tiny"]), n=2)
    assert list(widget.n.options) == [1, 2, 4, 8]  # only sizes that split 64 and 256
    assert widget.out.value.count("mt-tp-rank") == 2
    widget.n.value, widget.split.value = 8, "rows"
    assert widget.out.value.count("mt-tp-rank") == 8 and "A by rows" in widget.out.value
    assert widget.out.value.count("mt-tp-collective") == 4
