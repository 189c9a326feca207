"""``--profile DIR``: one step per rank under torch.profiler, saved as Chrome trace JSON and read back
(minitrain/runtime/profiling.py, lesson 02)."""

from __future__ import annotations

import json

import pytest

from minitrain import TrainConfig, train
from minitrain.runtime.profiling import ALL_REDUCE, BACKWARD, profiled_step, trace_path, trace_spans
from minitrain.strategies import ConfigError
from minitrain.viz.timeline import trace_rows


def test_a_ddp_steps_trace_shows_the_all_reduces_running_beside_backward(clusters, tmp_path):
    cfg = TrainConfig(strategy="ddp", world_size=2, steps=3, batch_size=8, backend="gloo",
                      options={"bucket_mb": 0.1, "timeline": True}, profile=str(tmp_path))
    run = train(cfg, cluster=clusters(2))
    for rank in (0, 1):
        path = trace_path(str(tmp_path), rank)
        with open(path) as f:
            events = json.load(f)["traceEvents"]  # Chrome trace JSON, as Perfetto reads it
        assert any(e.get("ph") == "X" and "dur" in e for e in events)
        backward = trace_spans(path, BACKWARD)
        work = [s for s in trace_spans(path, ALL_REDUCE) if s["name"] == "gloo:all_reduce"]
        assert backward and work
        main = {s["tid"] for s in backward}
        assert not main & {s["tid"] for s in work}  # gloo's own threads run the all-reduces
        end = max(s["end"] for s in backward)
        during = [s for s in work if s["start"] < end]
        assert during, f"rank {rank}: no all-reduce began before backward ended"
    # the package's timeline of the same step names as many buckets as the trace has all-reduce
    # calls during backward, or more (the last bucket may leave after backward's last operator)
    rows = trace_rows(trace_path(str(tmp_path), 0))
    step = run.summary.report[0]["timeline"][profiled_step(cfg.steps)]
    assert len(step["buckets"]) >= len([a for a, _ in rows["launches"]
                                        if a < rows["backward_span"][1]]) > 0


def test_only_the_second_step_is_profiled():
    assert profiled_step(5) == 1 and profiled_step(1) == 0 and profiled_step(6, start=4) == 5


def test_profile_refusals(tmp_path):
    from minitrain.train import check_config
    with pytest.raises(ConfigError, match="run free"):
        check_config(TrainConfig(strategy="ps-async", world_size=3, profile=str(tmp_path)))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="a file, not a folder"):
        check_config(TrainConfig(strategy="ddp", world_size=2, profile=str(f)))
