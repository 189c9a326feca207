"""Smoke test of benchmarks/tp_bench.py: on 2 ranks, a few steps of ours and of PyTorch's DTensor
tensor parallelism, both equal to one process (the race is between equal computations)."""

import pytest

from conftest import benchmark_module

pytest.importorskip("torch.distributed.tensor.parallel")


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("tp_bench") as module:
        yield module


def test_ours_and_dtensor_both_equal_one_process(bench, clusters):
    res = bench.compare(clusters(2), "nano", batch=4, steps=2, rounds=1, warmup=1)
    assert set(res["median_s"]) == {"minitrain", "torch"}
    assert all(t > 0 for t in res["median_s"].values())
    for kind, err in res["loss_error"].items():
        assert err < 1e-5, kind
