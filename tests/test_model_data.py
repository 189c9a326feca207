"""The tiny GPT and the generated arithmetic data."""

import pytest
import torch

from minitrain import GPT, PRESETS, ArithmeticData, GPTConfig
from minitrain.data import decode, encode, shard


def test_initialisation_is_deterministic_from_the_seed():
    a, b, c = GPT(PRESETS["nano"], seed=3), GPT(PRESETS["nano"], seed=3), GPT(PRESETS["nano"], seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))
    torch.manual_seed(123)  # the global RNG plays no part
    assert all(torch.equal(p, q) for p, q in zip(GPT(PRESETS["nano"], seed=3).parameters(), a.parameters()))


@pytest.mark.parametrize("cfg", [PRESETS["nano"], PRESETS["tiny"], PRESETS["small"],
                                 GPTConfig(n_layer=3, n_head=3, d_model=48, d_ff=100, tie_weights=True)])
def test_parameter_count_formula_matches_the_model(cfg):
    assert cfg.num_params() == GPT(cfg).num_params() == sum(p.numel() for p in GPT(cfg).parameters())


def test_forward_shapes_loss_and_causality():
    cfg = PRESETS["nano"]
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(x)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    loss = model(x, x)
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.3
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % cfg.vocab_size  # changing the last token changes no earlier logit
    assert torch.allclose(model(x2)[:, :-1], logits[:, :-1])


def test_bad_shapes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="not divisible by n_head=3.*multiple of n_head"):
        GPTConfig(n_head=3, d_model=64)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPTConfig(n_layer=0)


def test_data_is_a_pure_function_of_seed_and_step():
    d = ArithmeticData(seq_len=32, seed=0)
    x1, y1 = d.batch(5, 8)
    x2, y2 = ArithmeticData(seq_len=32, seed=0).batch(5, 8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, d.batch(6, 8)[0])
    assert not torch.equal(x1, ArithmeticData(seq_len=32, seed=1).batch(5, 8)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    text = decode(torch.cat([x1[0], y1[0, -1:]]))
    for problem in text.split(";")[:-1]:
        a, rest = problem.split("+")
        b, c = rest.split("=")
        if a and c:  # the first/last problem may be cut; the middle ones are whole
            assert int(a) + int(b) == int(c)


def test_shards_are_contiguous_slices_and_must_divide():
    x = torch.arange(12).reshape(6, 2)
    assert torch.equal(torch.cat([shard(x, r, 3) for r in range(3)]), x)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard(x, 0, 4)


def test_encode_decode_round_trip_and_errors():
    assert decode(encode("12+34=46;")) == "12+34=46;"
    with pytest.raises(ValueError, match="'x' is not in the vocabulary"):
        encode("1x2")


def test_samples_show_what_was_learned():
    torch.manual_seed(0)
    cfg = PRESETS["nano"]
    data = ArithmeticData(cfg.seq_len, seed=0)
    model = GPT(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):
        x, y = data.batch(step, 16)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    prompts = [p for p, _ in data.prompts(8)]
    completions = data.complete(model, prompts)
    # after a few seconds of training the model writes well-formed answers: digits, then ';'
    assert all(c.endswith(";") and c[:-1].isdigit() for c in completions), completions
    assert 0.0 <= data.accuracy(model, n=20) <= 1.0
