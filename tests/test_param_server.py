"""Parameter server: sync equals a single process; SSP bounds staleness (s = 0 is sync); async logs
every update; delay compensation; a dead worker is reported, never hangs; bytes on the wire."""

import time

import pytest
import torch

from minitrain import PRESETS, GPT, TrainConfig, train
from minitrain.runtime.launch import RankError
from minitrain.parallel.param_server import delay_compensated, partition
from minitrain.strategies.param_server import parse_slow_workers
from minitrain.strategies import ConfigError
from minitrain.train import check_config

CFG = TrainConfig(steps=20, batch_size=12, seed=0)


@pytest.fixture(scope="module")
def single(clusters):
    return train(CFG, cluster=clusters(1), return_state=True)


def ps(clusters, strategy="ps-sync", workers=2, servers=1, steps=20, state=False, **options):
    cfg = CFG.with_(strategy=strategy, world_size=servers + workers, steps=steps,
                    options=dict(servers=servers, **options))
    return train(cfg, cluster=clusters(servers + workers), return_state=state)


def server_log(run, server=0):
    return run.summary.report[server]["log"]


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_sync_equals_a_single_process(clusters, single, servers, workers):
    run = ps(clusters, workers=workers, servers=servers, state=True)
    for a, b in zip(run.losses, single.losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
    for name, ref in single.state.items():
        torch.testing.assert_close(run.state[name], ref, rtol=1e-4, atol=5e-5, msg=name)


def test_bounded_staleness_zero_is_sync(clusters):
    sync = ps(clusters, workers=3, servers=2, steps=8)
    ssp0 = ps(clusters, "ps-async", workers=3, servers=2, steps=8, staleness=0,
              slow_worker="0:0.02")
    assert ssp0.losses == sync.losses  # same sums in the same order: bit-identical
    assert {e["staleness"] for e in server_log(ssp0)} == {0}


@pytest.mark.parametrize("bound", [1, 3])
def test_recorded_staleness_never_exceeds_the_bound(clusters, bound):
    run = ps(clusters, "ps-async", workers=3, steps=12, staleness=bound, slow_worker="0:0.03")
    for server in (0,):
        stale = [e["staleness"] for e in server_log(run, server)]
        assert len(stale) == 3 * 12
        assert max(stale) <= bound
        assert max(stale) > 0  # the fast workers did run ahead of the slow one


def test_async_applies_every_gradient_once_in_a_recorded_order(clusters):
    run = ps(clusters, "ps-async", workers=3, steps=10, slow_worker="0:0.03")
    log = server_log(run)
    assert [e["version"] for e in log] == list(range(30))
    for w in range(3):
        worker_rank = 1 + w
        assert [e["clock"] for e in log if e["worker"] == worker_rank] == list(range(10))
    for w in range(3):
        mine = [e for e in log if e["worker"] == 1 + w]
        assert mine[0]["version_used"] == 0  # every worker starts from the server's weights
        for before, after in zip(mine, mine[1:]):  # pulled at once after its own push was applied
            assert after["version_used"] == before["version"] + 1
        for e in mine:  # what it missed in between were the other workers' gradients
            assert e["version_used"] <= e["version"]
            assert all(o["worker"] != 1 + w for o in log[e["version_used"]:e["version"]])
    slow = [e["staleness"] for e in log if e["worker"] == 1]
    fast = [e["staleness"] for e in log if e["worker"] != 1]
    assert sum(slow) / len(slow) > sum(fast) / len(fast)  # the straggler computes on old weights
    assert run.losses[-1] < run.losses[0]


def test_delay_compensation_formula_and_run(clusters):
    g, now, used = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 2.0]), torch.zeros(3)
    torch.testing.assert_close(delay_compensated(g, now, used, 0.5),
                               g + 0.5 * g * g * (now - used))
    torch.testing.assert_close(delay_compensated(g, used, used, 0.5), g)  # fresh: unchanged
    plain = ps(clusters, "ps-async", workers=3, steps=6, staleness=2, slow_worker="0:0.02")
    comp = ps(clusters, "ps-async", workers=3, steps=6, staleness=2, slow_worker="0:0.02",
              delay_comp=2.0)
    assert comp.losses[-1] < comp.losses[0]
    assert comp.losses != plain.losses


def test_a_dead_worker_is_reported_and_the_cluster_recovers(clusters):
    cluster = clusters(4)
    t0 = time.perf_counter()
    with pytest.raises(RankError) as err:
        ps(clusters, "ps-async", workers=3, steps=10, crash_worker=(1, 3))
    assert err.value.rank == 2 and "exited with code 3" in str(err.value)
    assert time.perf_counter() - t0 < 15
    again = ps(clusters, "ps-async", workers=3, steps=3)  # the next run on the same cluster works
    assert len(again.losses) == 3 and cluster.world_size == 4


def test_bytes_on_the_wire_are_the_gradients_and_the_weights(clusters):
    run = ps(clusters, workers=2, servers=2, steps=3)
    numel = PRESETS["tiny"].num_params()
    comm = run.summary.comm
    servers_sent = sum(comm[s]["send"]["bytes"] for s in (0, 1))
    workers_sent = sum(comm[w]["send"]["bytes"] for w in (2, 3))
    # every step, each worker pushes its gradient (header: 3 float64 per server) ...
    assert workers_sent == 2 * 3 * (4 * numel + 2 * 24)
    # ... and pulls the weights (version: 1 float64 per server): initial pull + 2 more
    assert servers_sent == 2 * 3 * (4 * numel + 2 * 8)


def test_compressed_push_sends_the_payload(clusters):
    plain = ps(clusters, workers=2, steps=5)
    keep_all = ps(clusters, workers=2, steps=5, compress="topk:1.0")
    for a, b in zip(keep_all.losses, plain.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    int8 = ps(clusters, workers=2, steps=5, compress="int8")
    numel = PRESETS["tiny"].num_params()
    pushed = int8.summary.comm[1]["send"]["bytes"]
    assert pushed == 5 * (numel + 4 + 24)  # int8 values + one fp32 scale + the header
    assert int8.losses[-1] < int8.losses[0]


def test_partition_balances_keys_and_keeps_model_order():
    params = list(GPT(PRESETS["small"]).parameters())
    for servers in (1, 2, 3):
        keys = partition(params, servers)
        assert sorted(k for ks in keys for k in ks) == list(range(len(params)))
        assert all(ks == sorted(ks) for ks in keys)
        loads = [sum(params[k].numel() for k in ks) for ks in keys]
        assert max(loads) - min(loads) <= max(p.numel() for p in params)
    with pytest.raises(ValueError, match="at least one server"):
        partition(params, 0)


@pytest.mark.parametrize("strategy, world, options, message", [
    ("ps-sync", 2, {"servers": 2}, "at least one server and one worker"),
    ("ps-sync", 4, {"servers": 1}, "does not split over 3 workers"),
    ("ps-sync", 3, {"staleness": 1}, "use --strategy ps-async"),
    ("ps-async", 3, {"staleness": -1}, "--staleness must be >= 0"),
    ("ps-async", 3, {"slow_worker": "5:0.1"}, "workers are numbered 0..1"),
    ("ps-async", 3, {"slow_worker": "1-0.1"}, "use WORKER:SECONDS"),
    ("ps-async", 3, {"compress": "zip"}, "topk:RATIO"),
])
def test_bad_configurations_are_refused_before_spawning(strategy, world, options, message):
    cfg = CFG.with_(strategy=strategy, world_size=world, batch_size=16,
                    options=options)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_config(cfg)


def test_slow_worker_spec():
    assert parse_slow_workers("1:0.05,2:0.2") == {1: 0.05, 2: 0.2}
    assert parse_slow_workers(None) == {}


def test_staleness_aware_learning_rate_scales_one_step_and_restores_the_rate():
    """Zhang et al., 2016: a gradient τ versions stale steps with lr/τ.  Adam's first step moves
    each weight by lr·sign(g), so the move is the scaled rate exactly; the rate is restored after."""
    from minitrain.parallel.param_server import Consistency, ParameterServer

    server = ParameterServer(None, [torch.zeros(4)], [1], lr=0.1,
                             consistency=Consistency("async", staleness_lr=True))
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    server.apply(g, lr_scale=1 / 4)
    torch.testing.assert_close(server.params[0].detach(), -0.025 * g.sign())
    assert server.optimizer.param_groups[0]["lr"] == 0.1 and server.version == 1
    with pytest.raises(ValueError, match="mode 'async' only"):
        ParameterServer(None, [torch.zeros(4)], [1], lr=0.1,
                        consistency=Consistency("sync", staleness_lr=True))


def test_a_staleness_aware_async_run_trains(clusters):
    run = ps(clusters, "ps-async", workers=3, steps=6, slow_worker="0:0.02", staleness_lr=True)
    assert run.losses[-1] < run.losses[0]
    log = run.summary.report[0]["log"]
    assert len(log) == 18 and max(e["staleness"] for e in log) >= 1
