"""Recording a run for the projection (minitrain.planning.recording): hooks on the strategy's own
modules and optimizer, nothing of torch replaced; untraced calls seen by the replay, not counted."""

from types import SimpleNamespace

import torch

from minitrain.strategies import TrainConfig

CFG = TrainConfig(strategy="ddp", world_size=2, steps=2, batch_size=8, seed=0)


def _torch_functions() -> dict:
    """Every public function of torch.distributed, and torch.autograd.backward, by name."""
    import torch.distributed as dist

    out = {f"dist.{n}": getattr(dist, n) for n in dir(dist)
           if not n.startswith("_") and callable(getattr(dist, n))}
    out["torch.autograd.backward"] = torch.autograd.backward
    out["torch.Tensor.backward"] = torch.Tensor.backward
    return out


def _global_hooks() -> int:
    """How many process-wide module and optimizer hooks are registered."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)
            + len(optimizer._global_optimizer_pre_hooks)
            + len(optimizer._global_optimizer_post_hooks))


def record_a_step(cfg):
    """On each rank: one DDP step recorded; what changed in torch before, during and after, the
    marks, the exported log and the tracer's summary."""
    from minitrain.comm import Comm, Tracer
    from minitrain.data import ArithmeticData
    from minitrain.planning.recording import recording
    from minitrain.strategies import Seams, get_strategy

    comm = Comm(None, Tracer(), "world")
    strategy = get_strategy(cfg.strategy)(cfg, comm, Seams.of(None))
    x, y = ArithmeticData(cfg.model.seq_len, cfg.seed).batch(0, cfg.batch_size)
    comm.tracer.clear()  # the replicas' first broadcast is not the step's
    before, hooks = _torch_functions(), _global_hooks()
    changed = []
    with recording(strategy):
        during = _torch_functions()
        changed += [n for n, f in during.items() if before.get(n) is not f]
        comm.tracer.mark("step", 0)
        loss = strategy.train_step(x, y)
        comm.tracer.mark("step_end", 0)
        changed += [n for n, f in _torch_functions().items() if before.get(n) is not f]
        global_hooks = _global_hooks() - hooks
    changed += [n for n, f in _torch_functions().items() if before.get(n) is not f]
    strategy.close()
    return {"changed": changed, "global_hooks": global_hooks, "loss": loss,
            "log": comm.tracer.export(), "summary": comm.tracer.summary()}


def test_recording_replaces_nothing_in_torch_and_marks_the_step(clusters):
    """torch.distributed's functions and torch.autograd.backward are the same objects before,
    during and after recording, and no process-wide hook is added; the step's forward, backward
    and optimizer step are marked all the same, in that order."""
    for r, out in enumerate(clusters(2).run(record_a_step, CFG)):
        assert out["changed"] == [], f"rank {r}: recording replaced {out['changed']}"
        assert out["global_hooks"] == 0, f"rank {r}: recording added process-wide hooks"
        kinds = [k for _, k, _ in out["log"]["marks"]]
        assert kinds == ["step", "forward", "forward_end", "backward", "backward_end",
                         "optimizer", "optimizer_end", "step_end"], f"rank {r}: {kinds}"


def test_an_untraced_metric_is_seen_by_the_replay_but_not_in_the_byte_summary(clusters):
    """The loss's mean (``comm.untraced.all_reduce``) is in the recorded log, untraced, and in each
    rank's program for the replay (it synchronises the ranks), keyed alike on both; the tracer's
    summary — the training traffic the lessons compare with the cost model — counts only the
    gradient buckets."""
    from minitrain.planning.recorded import step_programs

    outs = clusters(2).run(record_a_step, CFG)
    result = SimpleNamespace(events=[o["log"] for o in outs])  # what step_programs reads of a run
    programs, events, _ = step_programs(result, 0)
    for r, out in enumerate(outs):
        untraced = [e for e in out["log"]["events"] if not e["traced"]]
        assert [(e["op"], e["group"], e["ranks"]) for e in untraced] == \
            [("all_reduce", "untraced", (0, 1))], f"rank {r}: {untraced}"
        traced = [e for e in out["log"]["events"] if e["traced"]]
        assert traced and all(e["tag"].startswith("bucket") for e in traced)
        assert out["summary"]["total"]["calls"] == len(traced)
        assert out["summary"]["total"]["bytes"] == sum(e["bytes"] for e in traced)
        seen = [k for k, e in events[r].items() if not e["traced"]]
        assert len(seen) == 1, f"rank {r}: the replay does not see the metric: {events[r]}"
        assert any(op.key == seen[0] for op in programs[r] if op.kind == "issue")
    assert {k for k, e in events[0].items() if not e["traced"]} == \
        {k for k, e in events[1].items() if not e["traced"]}
