"""``minitrain train`` (also ``python -m minitrain train``): train the tiny GPT with any strategy, on N ranks.

Contract every strategy keeps (``--json``): one JSON object per line, ``{"step": i, "loss": x}`` per
step, then ``{"summary": {...}}`` (:meth:`minitrain.record.RunSummary.to_dict`) with at least
``final_loss``, ``step_time_s`` (median), ``params``, per-rank ``comm`` and per-rank ``memory``.  Without ``--json``: a progress bar and a readable summary.

Started by ``torchrun`` the command joins the env:// process group and runs as one rank; otherwise it
starts ``--world-size`` ranks itself.  Bad configurations are refused before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
from dataclasses import replace

import torch.distributed as dist

from .runtime.launch import Cluster, LaunchError, RankError, init_from_env, launched_by_torchrun
from .model import PRESETS
from .strategies import ConfigError, TrainConfig, get_strategy, strategy_names
from .strategies.fit import Machine
from .strategies.options import closest, did_you_mean, flag, option_fields
from .checkpoint.checks import SaveDirLock
from .train import add_projection, check_config, check_projection_config, run_rank

#: ``minitrain clusters --calibrate``: the most ranks a core measures at once
CALIBRATE_RANKS_PER_CORE = 4

__all__ = ["main", "build_parser", "config_from_args"]


_SHAPE = ("n_layer", "n_head", "d_model", "seq_len")
#: TrainConfig fields the CLI sets in its own way (the strategy's options, the model preset)
_SPECIAL = {"options", "model"}


def _arg_type(hint) -> type:
    """The argparse type of a field annotated ``int``, ``float | None``, ``str | None``..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def _add_field(group, name: str, hint, default, meta: dict, *, suppress: bool = False,
               used_by: str = "") -> None:
    """One flag for one dataclass field: its help, its type, its default shown."""
    kind = _arg_type(hint)
    text = meta.get("help", "")
    shown = "" if "(default" in text else \
        f" (default: {meta.get('shown') or ('none' if default is None else default)})"
    help = text + shown + (f" [{used_by}]" if used_by else "")
    kw = dict(help=help.replace("%", "%%"), dest=name)
    if suppress:
        kw["default"] = argparse.SUPPRESS
    else:
        kw["default"] = default
    if kind is bool:
        kw["action"] = "store_true" if not default else argparse.BooleanOptionalAction
    else:
        kw["type"] = kind
        if meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
    group.add_argument(flag(name), **kw)


def _strategy_options() -> dict:
    """``{option name: (field, type, [strategies that take it])}`` over every strategy."""
    out: dict = {}
    for name in strategy_names():
        record = get_strategy(name).options
        for f, hint in option_fields(record):
            if f.name in out:
                first = out[f.name][0]
                if (first.default, first.metadata.get("help")) != (f.default, f.metadata.get("help")):
                    raise TypeError(f"option {f.name!r} is defined twice with different defaults "
                                    "or help: define it once and share the record")
                out[f.name][2].append(name)
            else:
                out[f.name] = (f, hint, [name])
    return out


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped choice (a sub-command, --model, --schedule...)
    and for a mistyped flag (:meth:`refuse_unknown`)."""

    def _check_value(self, action, value):
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(c) for c in choices]
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{did_you_mean(value, names)}; choose from "
                        f"{', '.join(names)}")
        return super()._check_value(action, value)

    def refuse_unknown(self, extras: list[str], command: str | None = None) -> None:
        """Exit naming the arguments no flag took, and the flag each mistyped one most likely meant."""
        parser = self.commands.get(command, self)
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for arg in extras:
            name = arg.split("=", 1)[0]
            if name.startswith("-") and (close := closest(name, flags)):
                hints.append(f"{name}: did you mean {close}?")
        where = f"minitrain {command}" if command else "minitrain"
        parser.error(f"unrecognized arguments: {' '.join(extras)}"
                     + "".join(f"; {h}" for h in hints) + f" (see '{where} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minitrain", description="Train the tiny GPT with any strategy on N ranks "
                     "('minitrain train --help'), list the strategies and the clusters a run can be "
                     "projected on, grade a class's notebooks, consolidate a checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # name -> its parser
    t = sub.add_parser("train", help="train the tiny GPT with a strategy",
                       description="Train the tiny GPT with one strategy; see 'minitrain strategies'.")
    groups = {None: t, "checkpoints": t.add_argument_group("checkpoints (lesson 08)")}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in _SPECIAL:
            continue
        default = None if f.name == "world_size" else f.default  # None: 1, or torchrun's
        _add_field(groups[f.metadata.get("group")], f.name, hints[f.name], default, f.metadata)
        if f.name == "lr":
            t.add_argument("--model", choices=sorted(PRESETS), default="tiny",
                           help="model size preset (default: tiny)")
            for name in _SHAPE:
                t.add_argument(flag(name), type=int, default=None,
                               help=f"override the preset's {name}")
    t.add_argument("--json", action="store_true", help="JSON lines on stdout")
    proj = t.add_argument_group("projection: the run re-timed on a real cluster")
    proj.add_argument("--project", metavar="CLUSTER", default=None,
                      help="re-time this run on CLUSTER and add summary.projection "
                           "(see 'minitrain clusters'; e.g. dgx-h100, ib-h100x4, eth-25g, local) "
                           "(default: none)")
    proj.add_argument("--as-model", metavar="SIZE", default=None, dest="as_model",
                      help="with --project: the same layout for a bigger model of the family "
                           "(gpt2, 1.3b, 2.7b, 7b, 13b, llama3-8b, llama3-70b) (default: the "
                           "run's own)")
    proj.add_argument("--stack", default=None,
                      help="with --project: the software stack the projected kernels are priced "
                           "under (eager, sdpa, megatron-2021, flash) (default: flash on GPUs, sdpa "
                           "on a CPU)")
    opts = t.add_argument_group("strategy options (each refused by the strategies that do not "
                                "take it)")
    for name, (f, hint, users) in _strategy_options().items():
        _add_field(opts, name, hint, f.default, f.metadata, suppress=True,
                   used_by=", ".join(users))
    sub.add_parser("strategies", help="list the strategies")
    cl = sub.add_parser("clusters", help="list the clusters a run can be projected on, with their "
                                         "numbers and sources")
    cl.add_argument("--json", action="store_true", help="the numbers as JSON")
    cl.add_argument("--calibrate", action="store_true",
                    help="also measure this machine on the spot (FLOP rate per rank, lesson 01's "
                         "α-β; starts --ranks ranks for a few seconds): the local and binder rows' "
                         "numbers")
    cl.add_argument("--ranks", type=int, default=2,
                    help="with --calibrate: the ranks measured at once (default: 2)")
    sub.add_parser("grade", add_help=False,
                   help="check a folder of submitted lesson notebooks and write a gradebook CSV "
                        "('minitrain grade --help')")
    c = sub.add_parser("consolidate", help="a checkpoint as one plain state_dict file",
                       description="Put a sharded checkpoint back together as the single-process "
                                   "state_dict of GPT(cfg), saved with torch.save.")
    c.add_argument("checkpoint", help="a checkpoint directory, or a --save-dir (its latest)")
    c.add_argument("out", help="the .pt file to write")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    get_strategy(args.strategy)  # ConfigError naming the choices
    shape = {k: getattr(args, k) for k in _SHAPE if getattr(args, k) is not None}
    try:
        model = replace(PRESETS[args.model], **shape)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - _SPECIAL
    base = fields | set(_SHAPE) | {"json", "command", "model", "project", "as_model", "stack"}
    values = {k: v for k, v in vars(args).items() if k not in base}  # the options given
    world = args.world_size
    if launched_by_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if world not in (None, env_world):
            raise ConfigError(f"--world-size {world} disagrees with torchrun's WORLD_SIZE={env_world}; "
                              "leave --world-size out under torchrun")
        world = env_world
    config = {k: getattr(args, k) for k in fields}
    config.update(world_size=1 if world is None else world, model=model, options=values,
                  save_dir=_absolute(args.save_dir), resume=_absolute(args.resume))
    return TrainConfig(**config)


def _absolute(path: str | None) -> str | None:
    """Ranks under torchrun may start elsewhere: pass them absolute paths ('' stays '': refused)."""
    return os.path.abspath(path) if path and path.strip() else path


class _Reporter:
    """Runs on rank 0: JSON lines, or a tqdm bar."""

    def __init__(self, as_json: bool, steps: int):
        self.as_json, self.steps, self.bar = as_json, steps, None

    def __call__(self, step: int, loss: float) -> None:
        if self.as_json:
            print(dumps({"step": step, "loss": loss}), flush=True)
            return
        if self.bar is None:  # a resumed run starts past 0
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.steps, initial=step, desc="train", unit="step",
                            file=sys.stderr)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # drawn once, by update, with its step
        self.bar.update(1)
        if step + 1 == self.steps:
            self.bar.close()


def _finite(value):
    """``value`` with every NaN or infinity replaced by None (JSON's null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(value) -> str:
    """JSON that every parser reads: a non-finite number becomes ``null``, never ``NaN``."""
    return json.dumps(_finite(value), allow_nan=False)


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:,.1f} MiB"


def format_summary(result) -> str:
    s, losses = result.summary, result.losses
    lines = [f"strategy {s.strategy} on {s.world_size} rank(s) ({s.backend}), "
             f"{s.steps} steps, global batch {s.batch_size}, {s.params:,} parameters",
             f"loss {losses[0]:.4f} -> {s.final_loss:.4f}; median step {s.step_time_s * 1e3:.1f} ms"]
    if s.options:
        lines.append("options: " + ", ".join(
            flag(k) if v is True else f"{flag(k)} {v}" for k, v in s.options.items()))
    reports = s.report or [{}]
    if reports[0].get("dp") and "tp" in reports[0]:
        r = reports[0]
        lines.append(f"mesh: {r['dp']} replicas x {r['pp']} pipeline stages x {r['tp']} tensor ranks "
                     f"(rank = (p*dp + d)*tp + t), ZeRO stage {r['zero_stage']} over dp")
    roles = [r for r in reports if r.get("role")]
    if roles:
        servers = [r["rank"] for r in roles if r["role"] == "server"]
        workers = [r["rank"] for r in roles if r["role"] == "worker"]
        mode = next(r for r in roles if r["role"] == "server")
        lines.append(f"parameter server ({mode['mode']}"
                     + (f", staleness bound {mode['bound']}" if mode.get("bound") is not None else "")
                     + f"): servers {servers}, workers {workers}")
    if s.resumed_from:
        lines.append(f"resumed at step {s.start_step} from {s.resumed_from}")
    if s.checkpoints:
        lines.append(f"checkpoints saved: {', '.join(s.checkpoints)}")
    if s.precision != "fp32" or s.checkpoint_activations:
        scaler = s.loss_scaler
        lines.append(f"precision {s.precision}"
                     + (f", loss scale {scaler['scale']:g}, {scaler['skipped_steps']} step(s) skipped"
                        if scaler else "")
                     + (", activation checkpointing" if s.checkpoint_activations else ""))
    pipe = (s.report or [{}])[0]
    if "bubble_measured" in pipe:
        lines.append(f"pipeline {pipe['schedule']}: {pipe['stages']} stages, {pipe['microbatches']} "
                     f"micro-batches, {pipe['chunks']} chunk(s); bubble measured "
                     f"{pipe['bubble_measured']:.1%}, ideal table {pipe['bubble_ideal']:.1%}, "
                     f"(p-1)/(v*m+p-1) = {pipe['bubble_formula']:.1%}")
    if s.projection is not None:
        from .planning.projection import format_projection
        lines.append(format_projection(s.projection))
    offloaded = any(v for mem in s.memory for v in (mem.get("host") or {}).values())
    if offloaded:
        lines.append("offload (ZeRO-Offload): the optimizer states, fp32 master weights and the "
                     "optimizer step are in host memory; per rank, the device's bytes, then the host's")
    for rank, (comm, mem) in enumerate(zip(s.comm, s.memory)):
        b = mem["bytes"]
        sent = comm.get("total", {}).get("sent_bytes", 0)
        host = mem.get("host") or {}
        if offloaded and host:
            d = {**b, **(mem.get("device") or {})}
            where = (f"device: params {_kb(d['parameters'])}, grads {_kb(d['gradients'])}, "
                     f"optimizer {_kb(d['optimizer_states'])}, activations peak "
                     f"{_kb(d['activations_peak'])}; host: "
                     + (f"params {_kb(host['parameters'])}, " if host.get("parameters") else "")
                     + f"grads {_kb(host.get('gradients', 0))}, optimizer "
                     f"{_kb(host.get('optimizer_states', 0))}")
        else:
            where = (f"params {_kb(b['parameters'])}, grads {_kb(b['gradients'])}, "
                     f"optimizer {_kb(b['optimizer_states'])}, activations peak "
                     f"{_kb(b['activations_peak'])}")
        if mem.get("allocator_peak") is not None:  # a GPU: what its allocator held at most
            where += f"; the GPU allocator's peak {_kb(mem['allocator_peak'])}"
        lines.append(f"rank {rank}: {where}; sent {_kb(sent)} in "
                     f"{comm.get('total', {}).get('calls', 0)} calls")
    return "\n".join(lines)


def format_clusters(rows: list[dict]) -> str:
    """``minitrain clusters``: each preset's numbers, then where they come from; this machine and
    Binder with their calibrated numbers (``--calibrate``), else the command that measures them."""
    out = []
    for r in rows:
        if "calibrate" in r:  # this machine, not measured yet
            how = "measured on the spot" if r["cluster"] == "local" else "derived from this machine's"
            out.append(f"{r['cluster']:10s} {r['title']}\n{'':10s} numbers: {how}; see them with "
                       f"'{r['calibrate']}' (it starts 2 ranks here for a few seconds)")
            continue
        if "flop_rate_per_rank_gflops" in r:  # this machine (or Binder), calibrated
            out.append(f"{r['cluster']:10s} {r['title']}\n"
                       f"{'':10s} {r['flop_rate_per_rank_gflops']:,.1f} GFLOP/s per rank "
                       f"({r['ranks']} ranks on {r['cores']} core(s)), memory "
                       f"{r['memory_bw_per_rank_gbps']:,.1f} GB/s per rank, {r['memory_gb']:,.1f} GB; "
                       f"loopback all-reduce α {r['alpha_us']:,.1f} µs per ring step, β "
                       f"{r['beta_s_per_byte'] * 1e9:,.3f} ns/byte ({r['loopback_gbps']:,.2f} GB/s), "
                       f"a message {r['p2p_alpha_us']:,.1f} µs one way\n"
                       f"{'':10s}   how: {r['derived']}")
            continue
        if "devices" not in r:
            out.append(f"{r['cluster']:10s} {r['title']}")
            continue
        inter = (f"; between nodes {r['inter_busbw_gbps']:,.1f} GB/s per device, α "
                 f"{r['inter_alpha_us']:.1f} µs" if "inter_busbw_gbps" in r else "")
        out.append(f"{r['cluster']:10s} {r['title']}\n"
                   f"{'':10s} {r['device']}: {r['peak_tflops']:,.0f} TFLOP/s peak (bf16), "
                   f"{r['sms']} SMs, matmul at most {r['mamf_tflops']:,.1f} TFLOP/s (measured), "
                   f"{r['memory_gb']:g} GB at {r['memory_bw_gbps']:,.0f} GB/s "
                   f"({r['achievable_bw_gbps']:,.0f} achieved), a kernel launch "
                   f"{r['launch_us']:.1f} µs; in a node {r['intra_busbw_gbps']:,.1f} GB/s "
                   f"bus bandwidth, α {r['intra_alpha_us']:.1f} µs{inter}")
        for src in r["sources"]:
            out.append(f"{'':10s}   source: {src}")
    return "\n".join(out)


def _train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # under torchrun rank 0 holds the save dir for the job (the others leave its lock alone)
    holds = not launched_by_torchrun() or os.environ.get("RANK") == "0"
    with SaveDirLock() as lock:  # one run per save dir: held until the run ends
        # everything that can be refused is refused here, before any process starts
        check_config(cfg, lock=lock if holds else False)
        return _run(args, cfg)


def _run(args: argparse.Namespace, cfg) -> int:
    check_projection_config(cfg, args.project, args.as_model, args.stack)
    record = args.project is not None
    calibrate = record and args.project.lower() in ("local", "binder")
    report = _Reporter(args.json, cfg.steps)
    if launched_by_torchrun():
        init_from_env(cfg.backend, cfg.timeout)
        try:
            result = run_rank(cfg, report, record_events=record, calibrate=calibrate)
            # every rank leaves together: a rank that tears its connections down while a peer
            # still finishes the last collective made that peer abort at exit (gloo, 2 nodes)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if result is None:  # not rank 0
            return 0
    else:
        with Cluster(cfg.world_size, cfg.backend, timeout=cfg.timeout, prefix=False) as cluster:
            result = cluster.run(run_rank, cfg, report, record_events=record,
                                 calibrate=calibrate)[0]
    add_projection(result, args.project, args.as_model, args.stack)
    if args.json:
        print(dumps({"summary": result.summary.to_dict()}), flush=True)
    else:
        print(format_summary(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `minitrain strategies | head`: the reader left, nothing is wrong
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 0


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["grade"]:
        from .course.grade import main as grade
        return grade(argv[1:])
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.refuse_unknown(extras, args.command)
    if args.command == "clusters":
        from .planning.clusters import calibrate_here, describe
        if args.calibrate and args.ranks < 2:
            parser.exit(2, f"minitrain clusters: error: --ranks {args.ranks}: the α-β of lesson 01 "
                           "needs at least 2 ranks\n")
        cores = Machine.here().cores
        most = max(8, CALIBRATE_RANKS_PER_CORE * cores)
        if args.calibrate and args.ranks > most:
            parser.exit(2, f"minitrain clusters: error: --ranks {args.ranks}: at most {most} on this "
                           f"machine's {cores} core(s) (every rank is measured at once, and past "
                           f"{CALIBRATE_RANKS_PER_CORE} ranks a core the calibration would time the "
                           "scheduler's turns, not the machine); the lessons use up to 8\n")
        rows = describe(calibrate_here(args.ranks) if args.calibrate else None)
        print(dumps(rows) if args.json else format_clusters(rows))
        return 0
    if args.command == "strategies":
        from .strategies import get_strategy as get
        for name in strategy_names():
            print(f"{name:14s} {get(name).help}")
        return 0
    if args.command == "consolidate":
        from .checkpoint.core import find_checkpoint, read_meta
        from .checkpoint.consolidate import consolidate_to
        try:
            out = consolidate_to(args.checkpoint, args.out)
            path = find_checkpoint(args.checkpoint)
        except ConfigError as exc:
            parser.exit(2, f"minitrain consolidate: error: {exc}\n")
        print(f"wrote {out}: the single-process state_dict of {path} (step {read_meta(path)['step']}); "
              f"load it with GPT(cfg).load_state_dict(torch.load({str(out)!r}, weights_only=True))")
        return 0
    try:
        return _train(args)
    except (ConfigError, LaunchError) as exc:
        parser.exit(2, f"minitrain train: error: {exc}\n")
    except RankError as exc:  # the ranks' story, not the launcher's traceback
        text = str(exc)
        if exc.exc_type == "Diverged":  # the step and the fix are the whole story
            text = f"rank {exc.rank} failed: {exc.message}"
        elif exc.exc_type == "CheckpointError":  # the file, what was kept, the fix (every rank's)
            text = exc.message
        parser.exit(1, f"minitrain train: error: {text}\n")
    return 0
