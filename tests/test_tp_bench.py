"""Smoke test of benchmarks/tp_bench.py: on 2 ranks, a few steps of ours and of PyTorch's DTensor
tensor parallelism, both equal to one process (the race is between equal computations)."""

import importlib.util
import pathlib
import sys

import cloudpickle
import pytest

pytest.importorskip("torch.distributed.tensor.parallel")

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "tp_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tp_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_bench"] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the ranks were forked before it was imported
    yield module
    cloudpickle.unregister_pickle_by_value(module)
    sys.modules.pop("tp_bench", None)


def test_ours_and_dtensor_both_equal_one_process(bench, clusters):
    res = bench.compare(clusters(2), "nano", batch=4, steps=2, rounds=1, warmup=1)
    assert set(res["median_s"]) == {"minitrain", "torch"}
    assert all(t > 0 for t in res["median_s"].values())
    for kind, err in res["loss_error"].items():
        assert err < 1e-5, kind
