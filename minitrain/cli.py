"""``minitrain train`` (also ``python -m minitrain train``): the command-line face of ``train.run_rank``.

Contract every strategy keeps (``--json``): one JSON object per line, ``{"step": i, "loss": x}`` per
step, then ``{"summary": {...}}`` with at least ``final_loss``, ``step_time_s`` (median), ``params``,
per-rank ``comm`` and per-rank ``memory``.  Without ``--json``: a progress bar and a readable summary.

Started by ``torchrun`` the command joins the env:// process group and runs as one rank; otherwise it
starts ``--world-size`` ranks itself.  Bad configurations are refused before any process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch.distributed as dist

from .launch import Cluster, init_from_env, launched_by_torchrun
from .model import PRESETS
from .strategies import ConfigError, TrainConfig, get_strategy, strategy_names
from .train import check_config, run_rank

__all__ = ["main", "build_parser", "config_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minitrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the tiny GPT with a strategy",
                       description="Train the tiny GPT with one strategy; see 'minitrain strategies'.")
    t.add_argument("--strategy", default="single", help="a name from 'minitrain strategies'")
    t.add_argument("--world-size", type=int, default=None,
                   help="number of ranks to start (default 1; under torchrun: its WORLD_SIZE)")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch-size", type=int, default=16,
                   help="global batch, split across data-parallel ranks")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="model size preset")
    for name in ("n_layer", "n_head", "d_model", "seq_len"):
        t.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"override the preset's {name}")
    t.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with enough GPUs, else gloo")
    t.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective may wait before the run fails")
    t.add_argument("--precision", default="fp32",
                   help="fp32 (default), bf16-mixed or fp16-mixed: 16-bit weights and gradients, "
                        "fp32 master weights and Adam states (lesson 07)")
    t.add_argument("--loss-scale", type=float, default=None,
                   help="initial dynamic loss scale (default 65536 with fp16-mixed, off otherwise; "
                        "0: off)")
    t.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each transformer block's activations in backward (lesson 07)")
    t.add_argument("--json", action="store_true", help="JSON lines on stdout")
    ck = t.add_argument_group("checkpoints (lesson 08)")
    ck.add_argument("--save-dir", default=None,
                    help="save sharded checkpoints under DIR/step-NNNNNN/ (one file per rank, then "
                         "meta.json) after the last step")
    ck.add_argument("--save-every", type=int, default=None,
                    help="... and every K steps (needs --save-dir)")
    ck.add_argument("--resume", default=None,
                    help="resume from a checkpoint directory, or a --save-dir's latest; --steps "
                         "counts from the start of the original run")
    for name in strategy_names():
        get_strategy(name).add_arguments(t.add_argument_group(f"strategy {name}"))
    sub.add_parser("strategies", help="list the strategies")
    c = sub.add_parser("consolidate", help="a checkpoint as one plain state_dict file",
                       description="Put a sharded checkpoint back together as the single-process "
                                   "state_dict of GPT(cfg), saved with torch.save.")
    c.add_argument("checkpoint", help="a checkpoint directory, or a --save-dir (its latest)")
    c.add_argument("out", help="the .pt file to write")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    get_strategy(args.strategy)  # ConfigError naming the choices
    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "d_model", "seq_len")
             if getattr(args, k) is not None}
    try:
        model = replace(PRESETS[args.model], **shape)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    base = {"strategy", "world_size", "steps", "seed", "batch_size", "lr", "model", "backend",
            "timeout", "json", "command", "n_layer", "n_head", "d_model", "seq_len",
            "precision", "loss_scale", "checkpoint_activations", "save_dir", "save_every",
            "resume"}
    options = {k: v for k, v in vars(args).items() if k not in base}
    world = args.world_size
    if launched_by_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if world not in (None, env_world):
            raise ConfigError(f"--world-size {world} disagrees with torchrun's WORLD_SIZE={env_world}; "
                              "leave --world-size out under torchrun")
        world = env_world
    return TrainConfig(strategy=args.strategy, world_size=world or 1, steps=args.steps,
                       seed=args.seed, batch_size=args.batch_size, lr=args.lr, model=model,
                       backend=args.backend, timeout=args.timeout, options=options,
                       precision=args.precision, loss_scale=args.loss_scale,
                       checkpoint_activations=args.checkpoint_activations,
                       save_dir=_absolute(args.save_dir), save_every=args.save_every,
                       resume=_absolute(args.resume))


def _absolute(path: str | None) -> str | None:
    """Ranks under torchrun may start elsewhere: pass them absolute paths."""
    return os.path.abspath(path) if path else None


class _Reporter:
    """Runs on rank 0: JSON lines, or a tqdm bar."""

    def __init__(self, as_json: bool, steps: int):
        self.as_json, self.steps, self.bar = as_json, steps, None

    def __call__(self, step: int, loss: float) -> None:
        if self.as_json:
            print(json.dumps({"step": step, "loss": loss}), flush=True)
            return
        if self.bar is None:  # a resumed run starts past 0
            from tqdm.auto import tqdm
            self.bar = tqdm(total=self.steps, initial=step, desc="train", unit="step",
                            file=sys.stderr)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        if step + 1 == self.steps:
            self.bar.close()


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1024 ** 2 else f"{n / 1024 ** 2:,.1f} MiB"


def format_summary(result: dict) -> str:
    s, losses = result["summary"], result["losses"]
    lines = [f"strategy {s['strategy']} on {s['world_size']} rank(s) ({s['backend']}), "
             f"{s['steps']} steps, global batch {s['batch_size']}, {s['params']:,} parameters",
             f"loss {losses[0]:.4f} -> {s['final_loss']:.4f}; median step {s['step_time_s'] * 1e3:.1f} ms"]
    if s.get("resumed_from"):
        lines.append(f"resumed at step {s['start_step']} from {s['resumed_from']}")
    if s.get("checkpoints"):
        lines.append(f"checkpoints saved: {', '.join(s['checkpoints'])}")
    if s.get("precision", "fp32") != "fp32" or s.get("checkpoint_activations"):
        scaler = s.get("loss_scaler")
        lines.append(f"precision {s['precision']}"
                     + (f", loss scale {scaler['scale']:g}, {scaler['skipped_steps']} step(s) skipped"
                        if scaler else "")
                     + (", activation checkpointing" if s.get("checkpoint_activations") else ""))
    pipe = (s.get("report") or [{}])[0]
    if "bubble_measured" in pipe:
        lines.append(f"pipeline {pipe['schedule']}: {pipe['stages']} stages, {pipe['microbatches']} "
                     f"micro-batches, {pipe['chunks']} chunk(s); bubble measured "
                     f"{pipe['bubble_measured']:.1%}, ideal table {pipe['bubble_ideal']:.1%}, "
                     f"(p-1)/(v*m+p-1) = {pipe['bubble_formula']:.1%}")
    for rank, (comm, mem) in enumerate(zip(s["comm"], s["memory"])):
        b = mem["bytes"]
        sent = comm.get("total", {}).get("sent_bytes", 0)
        lines.append(f"rank {rank}: params {_kb(b['parameters'])}, grads {_kb(b['gradients'])}, "
                     f"optimizer {_kb(b['optimizer_states'])}, activations peak "
                     f"{_kb(b['activations_peak'])}; sent {_kb(sent)} in "
                     f"{comm.get('total', {}).get('calls', 0)} calls")
    return "\n".join(lines)


def _train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    check_config(cfg)  # everything that can be refused is refused here, before any process starts
    report = _Reporter(args.json, cfg.steps)
    if launched_by_torchrun():
        init_from_env(cfg.backend, cfg.timeout)
        try:
            result = run_rank(cfg, report)
            # every rank leaves together: a rank that tears its connections down while a peer
            # still finishes the last collective made that peer abort at exit (gloo, 2 nodes)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if "summary" not in result:
            return 0
    else:
        with Cluster(cfg.world_size, cfg.backend, timeout=cfg.timeout, prefix=False) as cluster:
            result = cluster.run(run_rank, cfg, report)[0]
    if args.json:
        print(json.dumps({"summary": result["summary"]}), flush=True)
    else:
        print(format_summary(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "strategies":
        from .strategies import get_strategy as get
        for name in strategy_names():
            print(f"{name:14s} {get(name).help}")
        return 0
    if args.command == "consolidate":
        from .checkpoint import consolidate_to
        try:
            out = consolidate_to(args.checkpoint, args.out)
        except ConfigError as exc:
            parser.exit(2, f"minitrain consolidate: error: {exc}\n")
        print(f"wrote {out}: the single-process state_dict of {args.checkpoint}")
        return 0
    try:
        return _train(args)
    except ConfigError as exc:
        parser.exit(2, f"minitrain train: error: {exc}\n")
    return 0
