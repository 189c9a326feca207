"""The rules that keep the GPU path right, checked on CPU (minitrain/device.py says why each holds).

1. No tensor factory without a device in the techniques, the strategies, the communicator or the
   calibration; module-level tensors are host tables that reach kernels through ``on_device``.
2. Collectives go through ``Comm`` (an allow-list of the package's raw ``torch.distributed``
   calls, each with its reason), which refuses a tensor on another device or made without one;
   the taint mode finds such tensors in a run.
3. Point-to-point: every exchange of the package posts its sends and receives together, and runs
   with every tag 0 (matched per pair in posting order, as NCCL matches them).
4. One clock: no timer but ``minitrain.device.now`` in those places.
"""

from __future__ import annotations

import ast
import contextlib
import os
from pathlib import Path

import pytest
import torch

from minitrain.device import FACTORIES, HostTaint, HostTensorError, taint_of
from minitrain.model import PRESETS

ROOT = Path(__file__).resolve().parents[1] / "minitrain"

#: where every tensor must be made on a device: the techniques, the strategies, the communicator,
#: the core's vocabulary, the one loop, the widgets' and the exercise checkers' rank functions
#: (``comm.device`` in a rank, ``device="cpu"`` for what stays on the host) and the calibration
#: of this machine
DEVICE_SCOPE = ["parallel", "strategies", "comm.py", "device.py", "train.py", "model.py", "data.py",
                "memory.py", "precision.py", "viz", "course/exercises",
                "planning/costmodel.py", "planning/clusters.py", "planning/kernels.py"]


def _files(scope) -> list[Path]:
    out = []
    for part in scope:
        p = ROOT / part
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _where(path: Path, node: ast.AST) -> str:
    try:
        return f"{path.relative_to(ROOT.parent)}:{node.lineno}"
    except ValueError:
        return f"{path}:{node.lineno}"


def bare_factories(paths) -> list[str]:
    """``torch.<factory>(...)`` calls without ``device=``, as file:line."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"
                    and not any(k.arg in ("device", None) for k in node.keywords)):
                found.append(_where(path, node))  # (``**factory``: the caller's device= passed on)
    return found


def test_every_tensor_factory_names_its_device():
    found = bare_factories(_files(DEVICE_SCOPE))
    assert not found, (
        f"{len(found)} tensor factories without device= (on a GPU they make CPU tensors): "
        f"{', '.join(found)}; pass device= (comm.device, x.device), derive from a tensor "
        "(x.new_zeros, torch.zeros_like), or mark a host table device=\"cpu\"")


def test_the_factory_scan_finds_a_bare_factory(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch\nx = torch.zeros(3)\ny = torch.ones(2, device='cpu')\n"
                 "z = torch.empty_like(y)\nw = torch.ones(2, **kw)\n")
    assert bare_factories([p]) == [f"{p}:2"]
    p.write_text("import torch\n"
                 "a = torch.zeros(3)\n"
                 "b = torch.ones(3, device=comm.device)\n"
                 "c = torch.zeros_like(b)\n"
                 "d = b.new_zeros(2)\n"
                 "e = torch.tensor([1.0], dtype=torch.float64)\n"
                 "f = torch.randn(2, generator=g, device='cpu')\n")
    assert bare_factories([p]) == [f"{p}:2", f"{p}:6"]


def module_tables(path: Path) -> tuple[set, list[str]]:
    """Module-level names bound to a tensor factory's result, and every use of one inside a
    function that is not ``on_device(name, ...)``."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                and c.func.attr in FACTORIES for c in ast.walk(node.value)):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    allowed, bad = set(), []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "on_device" and node.args
                and isinstance(node.args[0], ast.Name)):
            allowed.add(id(node.args[0]))
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Name) and node.id in names
                        and isinstance(node.ctx, ast.Load) and id(node) not in allowed):
                    bad.append(f"{_where(path, node)} ({node.id})")
    return names, bad


def test_module_level_tensors_reach_kernels_through_on_device():
    tables, bad = set(), []
    for path in _files(DEVICE_SCOPE):
        names, b = module_tables(path)
        tables |= names
        bad += b
    assert "_SIGNS" in tables and "_BITS" in tables  # the scan sees compression's tables
    assert not bad, (f"module-level tensors used without on_device(t, device): {', '.join(bad)}; "
                     "a GPU kernel cannot read a host table")


# -- 2. collectives only through Comm ---------------------------------------------------------------

_COLLECTIVES = {"send", "recv", "isend", "irecv", "all_reduce", "broadcast", "reduce", "barrier",
                "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                "all_to_all_single", "gather", "scatter", "batch_isend_irecv", "gather_object",
                "all_gather_object", "broadcast_object_list", "scatter_object_list",
                "monitored_barrier"}

#: (file, function) -> why a raw ``torch.distributed`` call is right there
_OBJECTS = ("object collectives: torch pickles the objects into tensors on the current device "
            "itself (under NCCL, the rank's GPU set at start)")
_CALIBRATION = ("this machine's CPU calibration, on gloo only (a run on GPUs cannot be projected "
                "on 'local': minitrain.train refuses it)")
ALLOWED_RAW = {
    ("planning/clusters.py", "calibrate_rank"): _CALIBRATION,
    ("planning/clusters.py", "_beside_communication"): _CALIBRATION,
    ("planning/clusters.py", "_ranks_mean"): _CALIBRATION,
    ("planning/clusters.py", "_ping_pong"): _CALIBRATION,
    ("planning/costmodel.py", "time_all_reduce"): _CALIBRATION,
    ("runtime/benchmarking.py", "alternate"): "a barrier between timed steps",
    ("cli.py", "_run"): "torchrun's ranks leave together (a barrier on the default group)",
    ("train.py", "run_rank"): _OBJECTS,
    ("strategies/expert.py", "final_state"): _OBJECTS,
    ("strategies/threed.py", "final_state"): _OBJECTS,
    ("strategies/pipeline.py", "final_state"): _OBJECTS,
    ("checkpoint/core.py", "save_checkpoint"): _OBJECTS,
}


def raw_calls(scope_root: Path = ROOT) -> dict:
    """(file, enclosing function) -> [line] of every ``dist.<collective>(...)`` outside
    ``comm.py`` and the course machinery (whose checkers call the library as a reference, on
    gloo)."""
    found: dict = {}
    for path in sorted(scope_root.rglob("*.py")):
        rel = str(path.relative_to(scope_root))
        if rel == "comm.py" or rel.startswith("course/"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        inner: dict = {}  # line -> the innermost function around it (the one that starts last)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    line = getattr(node, "lineno", None)
                    if line is not None and fn.lineno >= inner.get(line, (0, ""))[0]:
                        inner[line] = (fn.lineno, fn.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _COLLECTIVES and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "dist"):
                key = (rel, inner.get(node.lineno, (0, "<module>"))[1])
                found.setdefault(key, []).append(node.lineno)
    out = found
    return out


def test_collectives_go_through_comm():
    calls = raw_calls()
    stray = {k: v for k, v in calls.items() if k not in ALLOWED_RAW}
    assert not stray, (
        "raw torch.distributed calls outside Comm (it checks each tensor is on the group's "
        "device and traces it): " + "; ".join(f"{f}:{min(v)} in {fn}" for (f, fn), v in
                                             sorted(stray.items()))
        + " — call the Comm's method (comm.all_reduce, comm.exchange...), or add the call to "
        "ALLOWED_RAW with its reason")
    unused = set(ALLOWED_RAW) - set(calls)
    assert not unused, f"ALLOWED_RAW names calls that are gone: {sorted(unused)}"


def _rank_meets_wrong_tensors(comm):
    from minitrain.device import HostTaint, HostTensorError
    out = []
    try:
        comm.all_reduce(torch.zeros(3, device="meta"))
    except ValueError as exc:
        out.append(str(exc))
    with HostTaint():
        bare = _made_in_package()
        try:
            comm.all_reduce(bare)
        except HostTensorError as exc:
            out.append(str(exc))
    comm.all_reduce(torch.ones(2, device=comm.device))  # the group still works
    return out


def _made_in_package():
    """``torch.zeros(4)`` as a line of the package makes it (the taint follows the package's own
    factories, not a test's or torch's)."""
    scope = {"__name__": "minitrain.example", "torch": torch}
    exec(compile("def make():\n    return torch.zeros(4)\n", "example.py", "exec"), scope)
    return scope["make"]()


def test_comm_refuses_a_tensor_on_another_device_or_made_without_one(clusters):
    from minitrain.comm import Comm

    def rank(_):
        return _rank_meets_wrong_tensors(Comm())

    for msgs in clusters(2).run(rank, None):
        assert len(msgs) == 2, msgs
        assert "a tensor on meta" in msgs[0] and "device=comm.device" in msgs[0]
        assert "made without a device (example.py:2 in make)" in msgs[1]


def test_the_taint_follows_a_package_tensor_to_a_parameter_and_stops_at_a_move():
    w = torch.nn.Parameter(torch.ones(4))
    with HostTaint():
        mine = torch.zeros(4)  # a test's own tensor: not the package's, not tainted
        assert taint_of(mine) is None and taint_of(mine * w) is None
        bare = _made_in_package()
        assert taint_of(bare) == "example.py:2 in make"
        doubled = bare * 2
        assert taint_of(doubled) == "example.py:2 in make"  # computed from it: tainted too
        with pytest.raises(HostTensorError, match=r"\(example.py:2 in make\) meets a parameter in add"):
            doubled + w
        assert taint_of(doubled.to("cpu")) is None  # moved to a device: clean
        assert taint_of(_made_in_package().to(torch.float64)) is not None  # a dtype is no move
        clean = torch.zeros(4, device="cpu")
        clean.copy_(_made_in_package())
        assert taint_of(clean) is None
        assert taint_of(w * torch.tensor(2.0)) is None  # a 0-dim scalar may meet a GPU tensor


# -- the taint mode over every strategy --------------------------------------------------------------

STRATEGIES = ["single", "ddp", "ddp-naive", "zero1", "zero2", "zero3", "pipeline", "tensor",
              "context", "expert", "3d", "ps-sync", "ps-async"]


def _tainted_run(cfg):
    from minitrain.device import HostTaint
    from minitrain.train import run_rank
    with HostTaint():
        result = run_rank(cfg)
    return None if result is None else result.losses


def test_every_strategy_runs_under_the_taint(clusters):
    """A step of each strategy with every tensor the package makes without a device tainted: none
    reaches a collective or meets a parameter (each would have stopped a GPU run)."""
    from minitrain.strategies import strategy_names
    from minitrain.train import TrainConfig, check_config
    names = [n for n in STRATEGIES if n in strategy_names()]
    missing = sorted(set(strategy_names()) - set(names))
    assert not missing, f"strategies this test does not run: {missing}"
    runs = [(n, {}) for n in names] + [("zero2", {"offload": True}), ("zero3", {"offload": True}),
                                       ("3d", {"tp": 2, "pp": 2})]
    for name, options in runs:
        size = {"single": 1, "3d": 4}.get(name, 2)
        model = {"expert": PRESETS["tiny-moe"]}.get(name, PRESETS["tiny"])
        cfg = TrainConfig(strategy=name, world_size=size, steps=2, batch_size=8, backend="gloo",
                          options=options, model=model)
        check_config(cfg)
        losses = clusters(cfg.world_size).run(_tainted_run, cfg)[0]
        assert losses and all(loss == loss for loss in losses), (name, options, losses)


# -- 3. point to point ---------------------------------------------------------------------------------

def test_the_package_exchanges_messages_only_through_comm_exchange():
    """Outside comm.py, the techniques and strategies never call send/recv/isend/irecv: a pair
    that posts them apart can wait on each other under NCCL.  (The parameter server, which NCCL
    cannot run, is the exception: its strategies refuse NCCL.)"""
    found = []
    for path in _files(["parallel", "strategies"]):
        if path.name == "param_server.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("send", "recv", "isend", "irecv")):
                found.append(_where(path, node))
    assert not found, f"point-to-point calls outside Comm.exchange: {', '.join(found)}"


@contextlib.contextmanager
def _every_tag_zero(on: bool = True):
    """On a rank: every message of the block sent with tag 0 (Comm.wire_tag)."""
    from minitrain.comm import P2P_TAG0_ENV
    if on:
        os.environ[P2P_TAG0_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(P2P_TAG0_ENV, None)


def _runs(cfgs, tag0: bool):
    from minitrain.train import run_rank
    with _every_tag_zero(tag0):
        return [getattr(run_rank(cfg), "losses", None) for cfg in cfgs]


@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point_runs_with_every_tag_zero(clusters, n):
    """Every tag 0: gloo then matches a pair's messages in the order they were posted, as NCCL
    does; every pipeline schedule, context and expert parallelism train as they do with tags."""
    from minitrain.train import TrainConfig, check_config
    base = dict(world_size=n, steps=2, batch_size=12, backend="gloo")
    cfgs = [TrainConfig(strategy="pipeline", options={"schedule": s, "microbatches": 4}, **base)
            for s in ("gpipe", "1f1b", "zb-h1")]
    cfgs.append(TrainConfig(strategy="context", **base))
    if n == 2:  # the tiny MoE's 4 experts over 2 ranks; interleaved's 2 chunks per rank
        cfgs.append(TrainConfig(strategy="expert", model=PRESETS["tiny-moe"], **base))
        cfgs.append(TrainConfig(strategy="pipeline", options={
            "schedule": "interleaved", "microbatches": 4, "chunks": 2}, **base))
    for cfg in cfgs:
        check_config(cfg)
    tagged = clusters(n).run(_runs, cfgs, False)[0]
    zero = clusters(n).run(_runs, cfgs, True)[0]
    assert zero == tagged


def _ring_tag0(sizes):
    from minitrain.comm import Comm, ring_all_reduce
    comm = Comm()
    out = []
    with _every_tag_zero():
        for size, pieces in sizes:
            g = torch.Generator().manual_seed(comm.rank)
            x = torch.randn(size, generator=g, device="cpu")
            want = x.clone()
            comm.all_reduce(want)
            out.append(torch.allclose(ring_all_reduce(x, comm, pieces=pieces), want, atol=1e-5))
    return out


def test_the_ring_all_reduce_runs_with_every_tag_zero(clusters):
    for ok in clusters(3).run(_ring_tag0, [(7, None), (1000, 4), (64, 16)]):
        assert all(ok)


# -- 4. one clock ---------------------------------------------------------------------------------------

#: where a time is a measurement (the widgets' timers pace their redrawing and the checkers' bound
#: a check's time: not measured work)
CLOCK_SCOPE = [p for p in DEVICE_SCOPE if p not in ("viz", "course/exercises")] + [
    "runtime/benchmarking.py"]


def test_one_clock():
    found = []
    for path in _files(CLOCK_SCOPE):
        if path.name == "device.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in (
                    "perf_counter", "time", "monotonic", "perf_counter_ns") and isinstance(
                    node.value, ast.Name) and node.value.id == "time":
                found.append(f"{_where(path, node)} time.{node.attr}")
    assert not found, (f"timers other than minitrain.device.now: {', '.join(found)}; on a GPU "
                       "they read when the work was queued, not when it was done")


# -- what refuses NCCL, and memory as the GPU sees it ------------------------------------------------

@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
def test_the_parameter_server_refuses_nccl_with_its_reason(strategy):
    from minitrain.strategies.options import ConfigError
    from minitrain.train import TrainConfig, check_config
    cfg = TrainConfig(strategy=strategy, world_size=3, backend="nccl")
    with pytest.raises(ConfigError, match="cannot run on NCCL: a server receives from whichever "
                                          "worker sends first.*use --backend gloo"):
        check_config(cfg)


def test_a_local_projection_of_a_gpu_run_is_refused():
    from minitrain.strategies.options import ConfigError
    from minitrain.train import TrainConfig, check_projection_config
    cfg = TrainConfig(strategy="ddp", world_size=2, backend="nccl")
    with pytest.raises(ConfigError, match="not that machine"):
        check_projection_config(cfg, "local")
    check_projection_config(cfg.with_(backend="gloo"), "local")


def test_the_ledger_has_no_allocator_peak_on_a_cpu():
    from minitrain.memory import allocator_peak, ledger
    model = torch.nn.Linear(4, 4)
    assert ledger(model)["allocator_peak"] is None
    assert allocator_peak(list(model.parameters())) is None
    if torch.cuda.is_available():
        model.cuda()
        assert ledger(model)["allocator_peak"] == torch.cuda.max_memory_allocated()
