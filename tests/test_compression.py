"""Gradient compression: round trips, payload bytes, error feedback, all-reduce and DDP."""

import math

import pytest
import torch
import torch.distributed as dist

from minitrain import Comm, TrainConfig, train
from minitrain.cli import main
from minitrain.parallel.compression import (FORMS, ErrorFeedback, Int8, PowerSGD, Sign, TopK,
                                            _pack, _unpack, as_error_feedback,
                                            compressed_all_reduce, parse_compressor, payload_bytes)
from minitrain.strategies.data_parallel import check_compression
from minitrain.strategies import ConfigError

SPECS = ["topk:1.0", "topk:0.1", "int8", "sign", "powersgd:2"]
CFG = TrainConfig(steps=6, batch_size=12, seed=0)


def randn(n, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_keep_everything_is_exact(n):
    x = randn(n)
    c = TopK(1.0)
    assert torch.equal(c.decompress(c.compress(x), n), x)


def test_topk_keeps_the_largest_entries():
    x = randn(1000)
    out = TopK(0.05).decompress(TopK(0.05).compress(x), 1000)
    kept = out.ne(0)
    assert kept.sum() == 50
    assert torch.equal(out[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_int8_error_is_at_most_half_a_step():
    x = randn(1001, scale=3.0)
    q, scale = Int8().compress(x)
    assert scale.item() == pytest.approx(x.abs().max().item() / 127)
    assert q.abs().max() == 127
    err = (Int8().decompress([q, scale], 1001) - x).abs().max()
    assert err <= scale.item() / 2 * (1 + 1e-6)
    zeros = torch.zeros(5)
    assert torch.equal(Int8().decompress(Int8().compress(zeros), 5), zeros)


def test_sign_reproduces_signs_and_scale():
    x = randn(1001)
    x[3] = 0.0  # zero counts as +
    out = Sign().decompress(Sign().compress(x), 1001)
    scale = x.abs().mean()
    assert torch.allclose(out.abs(), scale.expand(1001))
    assert torch.equal(out > 0, x >= 0)


def test_powersgd_is_exact_on_a_low_rank_matrix():
    rows, cols = PowerSGD.shape(400)
    assert (rows, cols) == (20, 20)
    m = randn(rows * 2, 1).view(rows, 2) @ randn(cols * 2, 2).view(2, cols)  # rank 2
    c = PowerSGD(2)
    out = c.decompress(c.compress(m.reshape(-1), key="w"), 400)
    torch.testing.assert_close(out, m.reshape(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_powersgd_on_tensors_smaller_than_its_rank(n):
    c, x = PowerSGD(4), randn(n, seed=n)
    payload = c.compress(x, key=n)
    assert [(tuple(t.shape), t.dtype) for t in payload] == c.layout(n)
    assert c.r(n) < 4  # r = min(rank, cols)
    torch.testing.assert_close(c.decompress(payload, n), x)  # full rank: exact


# -- payloads --------------------------------------------------------------------------------------


def expected_bytes(spec, n):
    if spec.startswith("topk"):
        return 8 * max(1, math.ceil(float(spec.split(":")[1]) * n))
    if spec == "int8":
        return n + 4
    if spec == "sign":
        return math.ceil(n / 8) + 4
    rows = math.ceil(math.sqrt(n))
    cols = math.ceil(n / rows)
    return (rows + cols) * min(int(spec.split(":")[1]), cols) * 4


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 13, 1000])
def test_payload_layout_and_bytes(spec, n):
    c = parse_compressor(spec)
    payload = c.compress(randn(n), key=0)
    assert [(tuple(t.shape), t.dtype) for t in payload] == c.layout(n)
    assert all(t.is_contiguous() for t in payload)
    assert payload_bytes(payload) == c.nbytes(n) == expected_bytes(spec, n)


@pytest.mark.parametrize("spec", SPECS)
def test_decompress_works_on_gathered_slices(spec):
    """What a receiver holds after an all-gather: rows of one buffer, or of stacked parts."""
    n, c = 1001, parse_compressor(spec)
    payloads = [c.compress(randn(n, seed=r), key=r) for r in range(3)]
    direct = [c.decompress(p, n) for p in payloads]
    gathered = torch.cat([_pack(p) for p in payloads]).view(3, -1)
    stacked = [torch.stack(parts) for parts in zip(*payloads)]
    for r in range(3):
        assert torch.equal(c.decompress(_unpack(gathered[r], c.layout(n)), n), direct[r])
        assert torch.equal(c.decompress([s[r] for s in stacked], n), direct[r])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_compressed_in_fp32(dtype):
    x = randn(100).to(dtype)
    for spec in SPECS:
        c = parse_compressor(spec)
        payload = c.compress(x, key=0)
        assert [(tuple(t.shape), t.dtype) for t in payload] == c.layout(100)
        assert c.decompress(payload, 100).dtype == torch.float32
    assert torch.equal(TopK(1.0).decompress(TopK(1.0).compress(x), 100), x.float())


# -- error feedback --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_sent_plus_residual_is_the_sum_of_the_raw_gradients(spec):
    ef = ErrorFeedback(parse_compressor(spec))
    raw_sum, sent_sum = torch.zeros(500), torch.zeros(500)
    for step in range(6):
        g = randn(500, seed=step, scale=10.0 ** (step % 3 - 1))
        payload, sent = ef.compress(g, key="b0")
        assert torch.equal(sent, ef.compressor.decompress(payload, 500))
        raw_sum += g
        sent_sum += sent
        torch.testing.assert_close(sent_sum + ef.residual["b0"], raw_sum, rtol=0, atol=1e-5)


def test_without_error_feedback_nothing_is_kept():
    ef = ErrorFeedback(TopK(0.1), enabled=False)
    g = randn(100)
    _, first = ef.compress(g, key=0)
    _, second = ef.compress(g, key=0)
    assert ef.residual == {} and torch.equal(first, second)
    assert as_error_feedback("sign", False).enabled is False
    assert as_error_feedback(None) is None and as_error_feedback(ef) is ef


# -- over ranks ------------------------------------------------------------------------------------


def entries(spec):
    """1001: payload rows of odd sizes (unaligned scales); PowerSGD: a square, unpadded matrix."""
    return 32 * 32 if spec.startswith("powersgd") else 1001


def all_reduce_steps(specs, steps=4):
    """On each rank: average rank-dependent tensors with each compressor for a few steps; keep
    each step's input corrected by the residual, the result and the residual left after it."""
    rank, out = dist.get_rank(), {}
    for spec in specs:
        comm, n_entries = Comm(), entries(spec)
        ef = ErrorFeedback(parse_compressor(spec))
        raw, log = torch.zeros(n_entries), []
        for step in range(steps):
            x = randn(n_entries, seed=100 * rank + step, scale=rank + 1.0)
            raw += x
            corrected = x + ef.residual.get(0, 0.0)
            result = compressed_all_reduce(x.clone(), comm, ef, key=0).clone()
            log.append(dict(corrected=corrected, result=result, residual=ef.residual[0].clone()))
        events = [(e.op, e.bytes, e.sent_bytes) for e in comm.tracer.events]
        out[spec] = dict(raw=raw, log=log, events=events)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_compressed_all_reduce_averages_and_sends_the_payload(clusters, n):
    ranks = clusters(n).run(all_reduce_steps, SPECS)
    for spec in SPECS:
        c, runs = parse_compressor(spec), [r[spec] for r in ranks]
        for step in range(4):
            steps = [run["log"][step] for run in runs]
            mean = steps[0]["result"]
            for s in steps[1:]:  # every rank gets the same average ...
                torch.testing.assert_close(s["result"], mean)
            # ... the mean of what the ranks sent, and what a rank sent is its own payload
            sent = [s["corrected"] - s["residual"] for s in steps]
            torch.testing.assert_close(sum(sent), n * mean, rtol=0, atol=1e-4)
            for s, mine in zip(steps, sent):
                if isinstance(c, PowerSGD):  # P Pᵀ M_r: the residual is orthogonal to span(P)
                    overlap = c.matrix(mean).t() @ c.matrix(s["residual"])
                    assert overlap.abs().max() <= 1e-4 * mean.norm() * s["residual"].norm()
                else:
                    torch.testing.assert_close(mine, c.decompress(c.compress(s["corrected"]),
                                                                  entries(spec)))
        # over all steps: what all ranks sent plus their residuals is all they were given
        total_sent = n * sum(s["result"] for s in runs[0]["log"])
        torch.testing.assert_close(total_sent + sum(r["log"][-1]["residual"] for r in runs),
                                   sum(r["raw"] for r in runs), rtol=0, atol=1e-4)
        if spec == "topk:1.0":
            torch.testing.assert_close(total_sent, sum(r["raw"] for r in runs), rtol=0, atol=1e-5)
        payload = c.nbytes(entries(spec))
        for run in runs:
            if isinstance(c, PowerSGD):  # P and Q are all-reduced: payload bytes per step
                assert {op for op, _, _ in run["events"]} == {"all_reduce"}
                assert len(run["events"]) == 8
                assert sum(b for _, b, _ in run["events"]) == 4 * payload
            else:  # one all-gather per step: N payloads out, N-1 of them sent
                assert run["events"] == [("all_gather", n * payload, (n - 1) * payload)] * 4


# -- DDP -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(clusters):
    return train(CFG, cluster=clusters(1), return_state=True)


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_keeping_everything_equals_a_single_process(clusters, single, n):
    options = {"compress": "topk:1.0", "bucket_mb": 0.1, "timeline": True}
    run = train(CFG.with_(strategy="ddp", world_size=n, options=options), cluster=clusters(n),
                return_state=True)
    for a, b in zip(run.losses, single.losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    for name, ref in single.state.items():
        torch.testing.assert_close(run.state[name], ref, rtol=1e-4, atol=5e-5, msg=name)
    report = run.summary.report[0]
    assert report["compression"] == "topk:1" and len(report["bucket_bytes"]) > 1
    assert len(report["overlap"]) == CFG.steps and all(0 <= o <= 1 for o in report["overlap"])


@pytest.mark.parametrize("spec, n", [("topk:0.01", 2), ("int8", 2), ("sign", 3), ("powersgd:4", 3)])
def test_ddp_with_each_compressor_trains_and_sends_its_payload(clusters, spec, n):
    cfg = CFG.with_(strategy="ddp", world_size=n, steps=8, options={"compress": spec,
                                                                     "bucket_mb": 0.25})
    run = train(cfg, cluster=clusters(n))
    losses = run.losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    buckets = [b // 4 for b in run.summary.report[0]["bucket_bytes"]]
    payload = sum(parse_compressor(spec).nbytes(b) for b in buckets)  # one step, all buckets
    for comm in run.summary.comm:
        if spec.startswith("powersgd"):
            assert set(comm) == {"all_reduce", "total"}
            assert comm["all_reduce"]["calls"] == 2 * len(buckets) * cfg.steps
            assert comm["all_reduce"]["bytes"] == payload * cfg.steps
        else:
            assert set(comm) == {"all_gather", "total"}
            assert comm["all_gather"]["bytes"] == n * payload * cfg.steps
            assert comm["all_gather"]["sent_bytes"] == (n - 1) * payload * cfg.steps


# -- configuration ---------------------------------------------------------------------------------


def test_parse_compressor():
    assert parse_compressor(None) is None and parse_compressor("none") is None
    assert [repr(parse_compressor(s)) for s in ("topk:0.01", "int8", "sign", "powersgd:4")] == \
        ["topk:0.01", "int8", "sign", "powersgd:4"]
    for bad in ("zip", "topk", "topk:0", "topk:1.5", "int8:2", "powersgd:0", "powersgd:x"):
        with pytest.raises(ValueError, match="use topk:RATIO") as info:
            parse_compressor(bad)
        # the technique names its parameter and value; the CLI's check says --compress
        assert f"compress={bad!r}" in str(info.value) and "--" not in str(info.value)


def test_compression_flags_are_shared_by_the_strategies_that_compress():
    from minitrain.cli import config_from_args, build_parser
    for strategy in ("ddp", "ps-sync", "ps-async"):
        args = build_parser().parse_args(["train", "--strategy", strategy, "--world-size", "3"])
        o = config_from_args(args).options
        assert o.compress is None and o.error_feedback is True
        args = build_parser().parse_args(["train", "--strategy", strategy, "--world-size", "3",
                                          "--compress", "int8", "--no-error-feedback"])
        o = config_from_args(args).options
        assert o.compress == "int8" and o.error_feedback is False


@pytest.mark.parametrize("options, message", [
    ({"compress": "zip"}, FORMS),
    ({"compress": "topk:2"}, "top-k ratio must be in (0, 1]"),
    ({"error_feedback": False}, "add --compress SPEC"),
])
def test_check_compression_names_the_fix(options, message):
    with pytest.raises(ConfigError) as info:
        check_compression(CFG.with_(strategy="ddp", world_size=2, options=options))
    assert message in str(info.value)
    check_compression(CFG.with_(strategy="ddp", options={"compress": "sign", "error_feedback": False}))


@pytest.mark.parametrize("args, message", [
    (["--compress", "zip"], "bad --compress 'zip'"),
    (["--compress", "powersgd:0"], "PowerSGD rank must be >= 1"),
    (["--no-error-feedback"], "only applies to compressed gradients"),
])
def test_a_bad_compress_is_refused_before_any_process_starts(no_spawn, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["train", "--strategy", "ddp", "--world-size", "2", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
