"""The harness's base: the :class:`Strategy` every ``--strategy NAME`` is, and what it is built from.

The contract (``single.py`` is the worked example).  A strategy is a ``@register``-ed subclass of
:class:`Lockstep`, whose ranks step together, or of :class:`FreeRunning` (``run(data, on_step)`` in
place of ``train_step``):

    name, help        its --strategy NAME and its line in 'minitrain strategies'          required
    __init__          super().__init__(cfg, comm, seams), then set self.model and
                      self.optimizer (helpers: build_model, make_optimizer)               required
    train_step(x, y)  one step on the global batch -> the global mean loss (optimizer_step) required
    check(cfg)        refuse what only it cannot run: a ConfigError naming the fix         optional
    checkpointer      a Checkpointer (save, load, consolidate; reshard where it can), or
                      the sentence saying why it cannot save                              optional
    declarations      options (an Options record: one flag per field), precisions, seams (the
                      names it honours), recomputes; by default none, fp32, none, True
    layout(cfg)       how it lays the run over its ranks (a Layout: dp, pp, tp, cp, ep,
                      ZeRO stage, schedule...), read by whatever reads the run; default: a
                      replica per rank                                                     optional
    report(), memory(), final_state(), close(), check_seams(cfg, seams): defaults serve a
                      replica; override where its facts or its state lie elsewhere

Also here: :class:`TrainConfig` (a run's configuration, the same object on every rank), typed
:class:`Options` made with :func:`option`, :class:`Seams` (a learner's functions inside a real
strategy), the registry, and the checks every strategy gets (:func:`check_common`).
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import functools
import importlib
import math
import os
import pkgutil
import typing
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn

from ..comm import Comm
from ..memory import ActivationMeter, ledger
from ..model import GPT, GPTConfig, PRESETS, training_flops
from ..parallel.errors import ParameterError
from ..precision import PRECISIONS, DynamicLossScaler, MixedPrecisionOptimizer, cast_model_
from ..record import Layout

__all__ = ["ConfigError", "TrainConfig", "Options", "NoOptions", "Replicas", "option", "positive",
           "at_least", "Seams", "Strategy", "Lockstep", "FreeRunning", "Checkpointer", "register",
           "get_strategy", "strategy_names", "check_common", "check_strategy", "option_fields",
           "closest", "did_you_mean", "check_fits_machine", "machine_memory", "Machine",
           "flag", "in_cli_words", "CLI_FORMS"]


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process starts, with the fix in it."""


def closest(given, choices) -> str | None:
    """The choice a mistyped ``given`` most likely meant (``difflib``; else the same word in another
    case, or the one choice it begins), or None."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(given), choices, n=1, cutoff=0.6)
    if not close:  # "ZERO3", "pipe"
        low = str(given).lower()
        close = [c for c in choices if c.lower() == low] or \
                ([c for c in choices if c.lower().startswith(low)] if len(low) >= 2 else [])
    return close[0] if close else None


def did_you_mean(given, choices) -> str:
    """``" (did you mean 'zero3'?)"`` for a mistyped ``given``, else ``""``."""
    close = closest(given, choices)
    return f" (did you mean {close!r}?)" if close else ""


# --------------------------------------------------------------------------------------------------
# Typed options
# --------------------------------------------------------------------------------------------------


def positive(value) -> str | None:
    """A check for :func:`option`: None (unset) or a positive finite number."""
    if value is None or (math.isfinite(value) and value > 0):
        return None
    return "must be a positive number"


def at_least(low: int):
    """A check for :func:`option`: None (unset) or an integer >= ``low``."""
    def check(value) -> str | None:
        return None if value is None or value >= low else f"must be at least {low}"
    return check


def option(default, help: str, *, check=None, choices=None, metavar: str | None = None):
    """One field of an :class:`Options` record: its default, its ``--help`` text, and optionally a
    ``check(value) -> problem or None`` and the allowed ``choices``."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices,
                                            "metavar": metavar})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: how the CLI says a technique's parameter where it is not simply its flag: ``{name: form}``,
#: ``form`` with ``{}`` for the value
CLI_FORMS = {"batch": "--batch-size {}"}


def in_cli_words(refusal: ParameterError, forms: dict | None = None) -> ConfigError:
    """A technique's refusal (a :class:`~minitrain.parallel.errors.ParameterError`) in the CLI's
    words, from its fields: each parameter it mentions as its flag and value (``--chunks 1``), or as
    :data:`CLI_FORMS` and ``forms`` word it (3d says ``stages`` as ``{"stages": "--pp {}"}``)."""
    forms = {**CLI_FORMS, **(forms or {})}
    return ConfigError(refusal.worded(
        lambda name, shown: forms.get(name, flag(name) + " {}").format(shown)))


@dataclass(frozen=True)
class Options:
    """Base of a strategy's typed options.  Combine shared fields by inheritance, so each is
    defined once (``class Zero2Options(Buckets, Offload)``)."""

    @classmethod
    def from_mapping(cls, values, strategy: str) -> "Options":
        """The record from a ``{name: value}`` mapping; a name this record does not have is refused,
        naming the strategies that take it."""
        names = {f.name for f in fields(cls)}
        for key in values:
            if key not in names:
                raise ConfigError(_not_taken(key, strategy))
        return cls(**values)

    def validate(self) -> None:
        """Each field's own check and choices; a :class:`ConfigError` naming the flag."""
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ConfigError(f"{flag(f.name)} must be one of {', '.join(map(str, choices))}, "
                                  f"got {value!r}{did_you_mean(value, choices)}")
            check = f.metadata.get("check")
            problem = check(value) if check is not None else None
            if problem:
                raise ConfigError(f"{flag(f.name)} {problem}, got {value!r}")

    def given(self) -> dict:
        """The fields that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class NoOptions(Options):
    """A strategy without options of its own."""


@dataclass(frozen=True)
class Replicas(Options):
    """The data-parallel axis beside a model-parallel one (3d, context)."""

    dp: int | None = option(None, "data-parallel replicas beside the other axes (default: the "
                            "world size divided by the other axes)", check=at_least(1))


def option_fields(cls: type[Options]) -> list[tuple[dataclasses.Field, type]]:
    """``(field, its resolved type)`` for every field of an options record (for the CLI)."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]


def _not_taken(name: str, strategy: str) -> str:
    takers = [n for n in strategy_names()
              if name in {f.name for f in fields(_REGISTRY[n].options)}]
    where = (f"strategies that take it: {', '.join(takers)}; leave it out or use one of those"
             if takers else "no strategy takes it; see 'minitrain train --help'")
    return f"{flag(name)} is not an option of strategy {strategy!r} ({where})"


# --------------------------------------------------------------------------------------------------
# The run's configuration
# --------------------------------------------------------------------------------------------------


def _cli(help: str, default=None, **more):
    return field(default=default, metadata={"help": help, **more})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the same object reaches every rank.  ``options`` is the strategy's
    typed :class:`Options` record (a plain dict is turned into it)."""

    strategy: str = _cli("a name from 'minitrain strategies'", "single")
    world_size: int = _cli("number of ranks to start", 1, shown="1; under torchrun: its WORLD_SIZE")
    steps: int = _cli("optimizer steps (counted from the start of the original run when resuming)", 20)
    seed: int = _cli("decides the initial weights and the data stream", 0)
    batch_size: int = _cli("global batch, split across data-parallel ranks", 16)
    lr: float = _cli("Adam's learning rate", 1e-3)
    model: GPTConfig = field(default_factory=lambda: PRESETS["tiny"])
    backend: str | None = _cli("gloo or nccl (default: nccl with enough GPUs, else gloo)",
                               choices=("gloo", "nccl"))
    timeout: float = _cli("seconds a collective may wait before the run fails", 120.0)
    options: typing.Any = field(default_factory=dict)
    precision: str = _cli("fp32, bf16-mixed or fp16-mixed: 16-bit weights and gradients, fp32 master "
                          "weights and Adam states (lesson 07)", "fp32", choices=tuple(PRECISIONS),
                          metavar="PRECISION")
    checkpoint_activations: bool = _cli("recompute each transformer block's activations in "
                                        "backward (lesson 07)", False)
    loss_scale: float | None = _cli("initial dynamic loss scale (default: 65536 with fp16-mixed, "
                                    "off otherwise; 0: off)")
    loss_scale_growth: int = _cli("good steps in a row after which the dynamic loss scale "
                                  "doubles (lesson 07)", 2000)
    save_dir: str | None = _cli("save sharded checkpoints under DIR/step-NNNNNN/ (one file per "
                                "rank, then meta.json) after the last step", group="checkpoints")
    save_every: int | None = _cli("... and every K steps (needs --save-dir)", group="checkpoints")
    resume: str | None = _cli("resume from a checkpoint directory, or a --save-dir's latest",
                              group="checkpoints")
    overwrite: bool = _cli("with --save-dir: delete the checkpoints an earlier run left there",
                           False, group="checkpoints")
    allow_nonfinite: bool = _cli("keep training when the loss is NaN or infinite (by default the "
                                 "run stops there)", False)

    def __post_init__(self):
        cls = _REGISTRY.get(self.strategy) or _find(self.strategy)
        if cls is None or type(self.options) is cls.options:
            return  # an unknown strategy is refused by check_config
        given = self.options.given() if isinstance(self.options, Options) else dict(self.options)
        object.__setattr__(self, "options", cls.options.from_mapping(given, self.strategy))

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Seams: the learner's functions inside the real strategies
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seams:
    """Functions that replace the package's own inside a strategy (None: the package's).  Each
    has the signature of its lesson's exercise; a strategy lists in ``seams`` the ones it honours."""

    ring_all_reduce: typing.Callable | None = None         # (tensor, comm) -> tensor: lesson 01
    sync_gradients: typing.Callable | None = None          # (model, comm): lesson 02, naive DP
    mean_loss: typing.Callable | None = None               # (loss) -> the mean over the ranks,
    #                                                         every rank: lesson 01b's lab fix
    bucket_hooks: tuple | None = None                      # DDP's (grad_ready, end_of_backward): 02
    topk_error_feedback: typing.Callable | None = None     # lesson 03
    zero1_step: typing.Callable | None = None              # (flat_params, flat_grads (this rank's
    #                                                         own), shard, optimizer, comm): 04
    zero2_hooks: tuple | None = None                       # ZeRO-2's (grad_ready,
    #                                                         end_of_backward): each bucket
    #                                                         reduce-scattered when full: 04
    zero3_hook: typing.Callable | None = None              # (unit, comm, moment): ZeRO-3's gather
    #                                                         before / free after a unit's compute,
    #                                                         reduce-scatter after backward: 04
    one_f_one_b: typing.Callable | None = None             # (rank, P, M) -> ["F0", "B0", ...]: 05
    stage_step: typing.Callable | None = None              # a pipeline stage's send/recv step: 05
    column_parallel_linear: typing.Callable | None = None  # lesson 06
    row_parallel_linear: typing.Callable | None = None     # lesson 06
    vocab_parallel_cross_entropy: typing.Callable | None = None  # autograd Function: apply(logits,
    #                                                         target, vocab_start, vocab_size, comm)
    #                                                         -> loss per position: lesson 06
    loss_scale_update: typing.Callable | None = None       # lesson 07
    mixed_precision_step: typing.Callable | None = None    # (params, masters, optimizer,
    #                                                         loss_scale) -> took_step: lesson 07
    recompute_block: typing.Callable | None = None         # (block, x) -> block(x), recomputed
    #                                                         in backward: lesson 07
    mesh_groups: typing.Callable | None = None             # (dp, pp, tp, axis) -> groups: lesson 08
    online_softmax_merge: typing.Callable | None = None    # (out_a, lse_a, out_b, lse_b): lesson 09
    all_to_all_dispatch: typing.Callable | None = None     # (output, input, out_splits, in_splits,
    #                                                         comm): MoE token dispatch, lesson 09
    moe_router: typing.Callable | None = None              # (logits (G, S, E), k, capacity) ->
    #                                                         (experts, gates, keep, aux_loss): 09

    @classmethod
    def of(cls, seams) -> "Seams":
        if seams is None or isinstance(seams, Seams):
            return seams or cls()
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(seams) - names)
        if unknown:
            raise ConfigError(f"no seam called {unknown[0]!r}; the seams are: {', '.join(sorted(names))}")
        return cls(**seams)

    def given(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


# --------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------

_REGISTRY: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty 'name'")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    """Import every module of this folder so that their ``@register`` decorators run."""
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        importlib.import_module(f"{__package__}.{mod.name}")


def _find(name: str):
    _load()
    return _REGISTRY.get(name)


def strategy_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["Strategy"]:
    """The class registered as ``name``; a :class:`ConfigError` listing the choices otherwise."""
    cls = _find(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}{did_you_mean(name, strategy_names())}; "
                          f"choose one of: {', '.join(strategy_names())}")
    return cls


# --------------------------------------------------------------------------------------------------
# Checks every strategy gets (before its own)
# --------------------------------------------------------------------------------------------------


def check_common(cls: type["Strategy"], cfg: TrainConfig, seams: Seams | None = None) -> None:
    """Sizes (at least 1, and what fits the machine: :func:`check_fits_machine`), seed, learning
    rate, timeout, precision, backend, the options' own checks and the seams."""
    for name in ("world_size", "steps", "batch_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if not SEED_RANGE[0] <= cfg.seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed must be from {SEED_RANGE[0]} to {SEED_RANGE[1]} (2**64 - 1: torch's "
                          f"random generators take a 64-bit unsigned seed), got {cfg.seed}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if not (math.isfinite(cfg.timeout) and cfg.timeout > 0):
        raise ConfigError(f"--timeout must be a positive number of seconds, got {cfg.timeout}")
    if not MIN_TIMEOUT_S <= cfg.timeout <= MAX_TIMEOUT_S:
        raise ConfigError(f"--timeout must be from {MIN_TIMEOUT_S:g} s (starting the ranks and one "
                          "step's collectives take longer than that on a busy machine: a shorter "
                          f"timeout fails runs that are fine) to {MAX_TIMEOUT_S:g} s (a week: a "
                          f"collective that waits longer is stuck), got {cfg.timeout:g}")
    _check_precision(cls, cfg)
    if cfg.backend == "nccl" and torch.cuda.device_count() < cfg.world_size:
        raise ConfigError(f"--backend nccl needs {cfg.world_size} GPUs, found "
                          f"{torch.cuda.device_count()}; use --backend gloo")
    if isinstance(cfg.options, Options):
        cfg.options.validate()
    for name in (seams.given() if seams else []):
        if name not in cls.seams:
            takers = [n for n in strategy_names() if name in _REGISTRY[n].seams]
            raise ConfigError(f"strategy {cls.name!r} has no seam {name!r}; strategies that take it: "
                              f"{', '.join(takers) or 'none'}")
    if seams is not None and seams.given():
        cls.check_seams(cfg, seams)
    check_fits_machine(cfg)


# --------------------------------------------------------------------------------------------------
# What fits the machine: an upper bound on every size, checked before any process starts
# --------------------------------------------------------------------------------------------------

#: a forked rank's own memory (its unique set size) after a run of the tiny model: 23-24 MiB,
#: measured with 2 to 32 ranks (issue 28); the parent's imported torch is shared, not counted
RANK_BYTES = 24 * 2**20
#: file descriptors per rank: the parent holds ~4 (pipe, sentinel, rendezvous connection), each
#: rank ~24 of its own plus one per peer (gloo's full mesh); measured with 2 to 32 ranks
PARENT_FDS_PER_RANK, RANK_FDS = 4, 24
#: a CPU core's fp32 rate, optimistically: two AVX-512 FMA units at 3 GHz give 192 GFLOP/s, and
#: this course's small matrices run at a tenth of that; a GPU (nccl): ~1 PFLOP/s, H100's dense bf16
CORE_FLOPS, GPU_FLOPS = 2e11, 1e15
#: the longest step a run may ask for, at those rates (the course's steps take milliseconds)
MAX_STEP_S = 600.0
#: per parameter: fp32 weight and gradient, Adam's two moments (mixed precision: 16-bit weight and
#: gradient plus fp32 master and moments, as many); a checkpoint keeps the weight and the moments
STATE_BYTES, SAVED_BYTES = 16, 12
#: what a run keeps per step: its loss and time on rank 0 (Python floats in lists) and in the result
STEP_RECORD_BYTES = 128
#: every rank builds the global batch of each step: int64 token ids
TOKEN_BYTES = 8
#: numbers a layer keeps for backward, per token: at least 12·d_model (the activation meter
#: measures ~17·d_model for the tiny model: layer norms' inputs, Q/K/V, attention's output, the
#: MLP's 4·d_model twice); with --checkpoint-activations each layer keeps its input, d_model, and
#: one layer's 12·d_model exist at a time
ACTIVATION_NUMBERS = 12
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400.0
SEED_RANGE = (0, 2**64 - 1)


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total or int(text), int(text))
    return total or 2**40


@dataclass(frozen=True)
class Machine:
    """What one machine offers a run: memory, CPU cores (or GPUs), open files."""

    memory: int
    cores: int
    open_files: int
    gpu: bool = False

    @classmethod
    def here(cls, backend: str | None = None) -> "Machine":
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        try:
            import resource
            files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            files = files if files > 0 else 2**20
        except (ImportError, OSError, ValueError):
            files = 2**20
        gpu = backend == "nccl"
        return cls(machine_memory(), torch.cuda.device_count() if gpu else cores, files, gpu)

    def describe_memory(self) -> str:
        return f"{_bytes(self.memory)} of memory"


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} bytes"


def _seconds(s: float) -> str:
    return f"{s / 3600:,.1f} h" if s >= 3600 else f"{s / 60:,.1f} min" if s >= 60 else f"{s:.1f} s"


def _ranks_here(cfg: TrainConfig) -> int:
    """The ranks this machine runs: all of them, or under torchrun its LOCAL_WORLD_SIZE."""
    try:
        return min(cfg.world_size, int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.world_size))
    except ValueError:
        return cfg.world_size


def _activation_bytes(cfg: TrainConfig) -> float:
    """A lower bound on the activations kept for backward at once, over all ranks: the global
    batch's (one micro-batch's, where a pipeline splits it), :data:`ACTIVATION_NUMBERS` per token
    and layer."""
    m = cfg.model
    per_token = (m.n_layer * m.d_model + ACTIVATION_NUMBERS * m.d_model) if \
        cfg.checkpoint_activations else m.n_layer * ACTIVATION_NUMBERS * m.d_model
    takes = hasattr(cfg.options, "microbatches")
    microbatches = (getattr(cfg.options, "microbatches", None) or cfg.world_size) if takes else 1
    element = 4 if cfg.precision == "fp32" else 2
    return cfg.batch_size * m.seq_len / max(1, microbatches) * per_token * element


def _memory_terms(cfg: TrainConfig, gpu: bool = False) -> dict[str, float]:
    """A lower bound on the (host) memory the run takes on this machine, by what takes it (on GPUs
    the model and its activations are in the GPUs' memory: torch says so if they do not fit)."""
    ranks, share = _ranks_here(cfg), _ranks_here(cfg) / cfg.world_size
    return {"ranks": ranks * RANK_BYTES,
            "model": 0.0 if gpu else cfg.model.num_params() * STATE_BYTES * share,
            "batches": ranks * cfg.batch_size * (cfg.model.seq_len + 1) * TOKEN_BYTES,
            "activations": 0.0 if gpu else _activation_bytes(cfg) * share,
            "steps": cfg.steps * STEP_RECORD_BYTES}


def _max_ranks(m: "Machine") -> tuple[int, int]:
    """The most ranks machine ``m`` holds: by their own memory, by open files."""
    return (m.memory // RANK_BYTES,
            min((m.open_files - 64) // PARENT_FDS_PER_RANK, m.open_files - RANK_FDS - 64))


def _step_seconds(cfg: TrainConfig, machine: Machine) -> float:
    """A lower bound on one step's time on this machine: its FLOPs at the optimistic rate."""
    flops = training_flops(cfg.model, cfg.batch_size * cfg.model.seq_len,
                           recompute=cfg.checkpoint_activations)
    rate = machine.cores * (GPU_FLOPS if machine.gpu else CORE_FLOPS)
    return flops * _ranks_here(cfg) / cfg.world_size / max(rate, 1.0)


def _largest(fits, given: int, step: int = 1) -> int:
    """The largest multiple of ``step`` up to ``given`` for which ``fits(value)``, 0 if none."""
    lo, hi = 0, given // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _problem(cfg: TrainConfig, m: Machine) -> tuple[str, str] | None:
    """The first way ``cfg`` does not fit machine ``m``: (the flag to change, why), or None."""
    here, mem, ranks = "this machine", m.describe_memory(), _ranks_here(cfg)
    # the ranks: their own memory, and open files (the parent's, and each rank's)
    by_memory, by_files = _max_ranks(m)
    if ranks > min(by_memory, by_files):
        if by_files < by_memory:
            return "world_size", (f"each rank takes about {PARENT_FDS_PER_RANK} of the parent's open "
                                  f"files and {RANK_FDS} plus one per peer of its own, and the limit "
                                  f"is {m.open_files} (ulimit -n)")
        return "world_size", (f"each rank takes at least {_bytes(RANK_BYTES)} of memory of its own, "
                              f"and {here} has {mem}")
    terms = _memory_terms(cfg, m.gpu)
    if terms["model"] > m.memory:
        return "model", (f"{cfg.model.num_params():,} parameters of {STATE_BYTES} bytes each (weight, "
                         f"gradient, Adam's two moments) take {_bytes(terms['model'])}, more than "
                         f"{here}'s {mem}")
    if sum(terms.values()) > m.memory:
        if terms["steps"] >= terms["batches"] + terms["activations"]:
            return "steps", (f"a run keeps each step's loss and time (about {STEP_RECORD_BYTES} "
                             f"bytes a step: {_bytes(terms['steps'])}), more than {here}'s {mem}")
        name = "seq_len" if cfg.model.seq_len / 32 > cfg.batch_size / 16 else "batch_size"
        return name, (f"the activations kept for backward (at least {ACTIVATION_NUMBERS}·d_model "
                      f"numbers per token and layer: {_bytes(terms['activations'])}) and the token "
                      f"ids every rank builds ({_bytes(terms['batches'])}) need, with the rest, "
                      f"{_bytes(sum(terms.values()))}: more than {here}'s {mem}")
    seconds = _step_seconds(cfg, m)
    if seconds > MAX_STEP_S:
        rate = (f"{m.cores} GPU(s) at {GPU_FLOPS / 1e12:,.0f} TFLOP/s each" if m.gpu else
                f"{m.cores} core(s) at an optimistic {CORE_FLOPS / 1e9:,.0f} GFLOP/s each")
        why = (f"one step would take at least {_seconds(seconds)} on {here} ({rate}), and a step "
               f"may take at most {_seconds(MAX_STEP_S)}")
        if cfg.model.seq_len > 4 * cfg.model.d_model:  # attention's s^2 is most of the work
            return "seq_len", why + " (attention grows with the square of the sequence)"
        return "batch_size", why
    return None


def _fits(cfg: TrainConfig, m: Machine) -> bool:
    return _problem(cfg, m) is None


def check_fits_machine(cfg: TrainConfig, machine: Machine | None = None) -> None:
    """Refuse, naming the flag, its bound and the reason, a run that cannot fit this machine: more
    ranks than its memory and open files allow, a model or a batch whose bytes exceed its memory,
    more steps than it can keep a record of, a step that would take more than :data:`MAX_STEP_S`
    even at an optimistic rate (:data:`CORE_FLOPS` per core).  Each need is a lower bound on what
    the run takes, so a run refused here could not have run."""
    m = machine or Machine.here(cfg.backend)
    found = _problem(cfg, m)
    if found is None:
        return
    name, why = found
    if name == "model":
        grown = [f"{flag(k)} {getattr(cfg.model, k)}" for k in ("d_model", "n_layer", "seq_len",
                                                               "n_expert", "d_ff", "vocab_size")
                 if getattr(cfg.model, k) and getattr(cfg.model, k) > (getattr(PRESETS["tiny"], k) or 0)]
        raise ConfigError(f"the model ({', '.join(grown) or 'as given'}) does not fit this machine: "
                          f"{why}; use a smaller {' or '.join(g.split()[0] for g in grown) or '--model'}")
    if name == "world_size":
        given, most = cfg.world_size, max(1, min(_max_ranks(m)))
    elif name == "seq_len":
        given = cfg.model.seq_len
        most = _largest(lambda n: _fits(replace(cfg, model=replace(cfg.model, seq_len=n)), m), given)
    else:
        given = getattr(cfg, name)
        most = _largest(lambda n: _fits(replace(cfg, **{name: n}), m), given)
    if name == "world_size":
        bound = f"at most --world-size {most} fit it"
    else:
        bound = (f"at most {flag(name)} {most} fits (with the other flags as given)" if most >= 1
                 else f"even {flag(name)} 1 does not fit with the other flags as given")
    raise ConfigError(f"{flag(name)} {given} does not fit this machine: {why}; {bound}")


def check_strategy(cfg: TrainConfig, seams=None) -> type["Strategy"]:
    """Everything about the strategy that can be refused before spawning: :func:`check_common`,
    then the strategy's own ``check``.  Returns its class."""
    cls = get_strategy(cfg.strategy)
    check_common(cls, cfg, Seams.of(seams))
    cls.check(cfg)
    return cls


def _check_precision(cls: type["Strategy"], cfg: TrainConfig) -> None:
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {cfg.precision!r}"
                          f"{did_you_mean(cfg.precision, PRECISIONS)}; choose one of: "
                          f"{', '.join(PRECISIONS)}")
    if cfg.precision not in cls.precisions:
        able = [n for n in strategy_names() if cfg.precision in _REGISTRY[n].precisions]
        raise ConfigError(f"strategy {cls.name!r} supports --precision "
                          f"{' or '.join(cls.precisions)} only, got {cfg.precision}; use "
                          f"--precision fp32, or a strategy that supports {cfg.precision} "
                          f"({', '.join(able) or 'none'})")
    if cfg.loss_scale is not None:
        if not (cfg.loss_scale >= 0 and math.isfinite(cfg.loss_scale)):
            raise ConfigError(f"--loss-scale must be >= 0 (0 turns loss scaling off), "
                              f"got {cfg.loss_scale}")
        if cfg.loss_scale > 0 and cfg.precision == "fp32":
            raise ConfigError("--loss-scale applies to mixed precision; add --precision "
                              "fp16-mixed (or bf16-mixed)")
    if cfg.loss_scale_growth < 1:
        raise ConfigError(f"--loss-scale-growth must be >= 1 (good steps before the scale "
                          f"doubles), got {cfg.loss_scale_growth}")
    if cfg.checkpoint_activations and not cls.recomputes:
        raise ConfigError(f"strategy {cls.name!r} cannot checkpoint activations; leave out "
                          "--checkpoint-activations")


# --------------------------------------------------------------------------------------------------
# Checkpointers: how a strategy's training state lies in the files of minitrain.checkpoint.core
# --------------------------------------------------------------------------------------------------


class Checkpointer(abc.ABC):
    """How one strategy's training state lies in checkpoint files: a strategy's ``checkpointer``
    is one of these, complete (save, load, consolidate), or a sentence saying why it has none.
    :mod:`minitrain.checkpoint.core` writes, verifies and reads the files; ``read(r)`` is rank r's saved
    part.  ``reshards``: it also resumes the checkpoints of other layouts through the portable form
    (:mod:`minitrain.strategies.portable`), with :meth:`portable_optimizer` and
    :meth:`load_portable`.  One stateless object per strategy class; ``strategy`` is the live one.
    """

    reshards: bool = False

    def layout(self, cfg: TrainConfig) -> dict:
        """The options that decide how the state is cut (JSON values; compared on resume)."""
        return {}

    @abc.abstractmethod
    def save(self, strategy: "Strategy") -> dict:
        """This rank's part of the training state: tensors and plain containers."""

    @abc.abstractmethod
    def load(self, strategy: "Strategy", read) -> None:
        """Restore what :meth:`save` saved, on the same layout."""

    @abc.abstractmethod
    def consolidate(self, cfg: TrainConfig, read) -> dict:
        """The full model as a single-process state_dict, offline."""

    def portable_optimizer(self, cfg: TrainConfig, read) -> dict:
        """Where it reshards: the portable optimizer state from the saved parts, offline."""
        raise NotImplementedError(f"{type(self).__name__} does not reshard")

    def load_portable(self, strategy: "Strategy", weights: dict, optim: dict) -> None:
        """Where it reshards: take this rank's cut of a portable state (the weights as a
        single-process state_dict, the optimizer's as :meth:`portable_optimizer` gives)."""
        raise NotImplementedError(f"{type(self).__name__} does not reshard")


# --------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------


class Strategy(abc.ABC):
    """One rank's part of a run: the model, the technique wrappers around it, the optimizer.
    The contract is at the top of this module; every attribute is declared here once."""

    # -- what a strategy declares (class attributes, inherited as usual) ----------------------------
    name: str = ""
    help: str = ""
    options: type[Options] = NoOptions
    precisions: tuple[str, ...] = ("fp32",)
    recomputes: bool = True  # honours --checkpoint-activations (recomputation, lesson 07)
    seams: tuple[str, ...] = ()  # the names of the seams it honours (an instance's: its Seams)
    checkpointer: Checkpointer | str = ("it has no checkpointer yet (see Checkpointer in "
                                        "minitrain/strategies/base.py)")

    # -- what __init__ builds ----------------------------------------------------------------------
    model: nn.Module  # this rank's part of the model
    optimizer: torch.optim.Optimizer | None  # what steps it (None where nothing does)

    # -- what the harness sets ---------------------------------------------------------------------
    start_step: int = 0  # where the loop starts (set by minitrain.checkpoint.core when resuming)
    resumed_from: str | None = None  # the checkpoint directory resumed
    resharded_from: str | None = None  # "zero3 on 4 ranks": the layout it was resharded from

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        """Raise :class:`ConfigError` if this strategy cannot run ``cfg`` (its own rules only: the
        harness has already done :func:`check_common`)."""

    @classmethod
    def check_seams(cls, cfg: TrainConfig, seams: Seams) -> None:
        """Raise :class:`ConfigError` if the seams given (all among ``cls.seams``) cannot serve
        ``cfg`` (e.g. a function written for fewer axes than the run has)."""

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        """How this strategy lays a run of ``cfg`` over its ranks (a checked ``cfg``: the same
        before spawning and in the run's summary).  Default: a replica per rank."""
        return Layout(dp=cfg.world_size, groups={"dp": (tuple(range(cfg.world_size)),)})

    def __init__(self, cfg: TrainConfig, comm: Comm, seams: Seams | None = None):
        self.cfg: TrainConfig = cfg
        self.comm: Comm = comm
        self.seams = seams or Seams()  # the functions given (the class's ``seams``: their names)
        self.device: torch.device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.distributed.get_backend() == "nccl") else torch.device("cpu")
        self.master_weights: dict = {}  # {16-bit parameter: fp32 copy}, filled by build_model
        self.loss_scaler: DynamicLossScaler | None = None  # set by make_optimizer (fp16-mixed)
        self.saved_checkpoints: list[str] = []  # set by minitrain.checkpoint.core

    @functools.cached_property
    def meter(self) -> ActivationMeter:
        """Measures the activations each forward saves (:meth:`Lockstep.optimizer_step`): those of
        ``self.model``, made on first use; a strategy that needs another sets ``self.meter``."""
        return ActivationMeter(self.model)

    # -- helpers: the model and the optimizer, with precision and recomputation (lesson 07) --------

    def build_model(self) -> GPT:
        """The tiny GPT, bit-equal on every rank (deterministic init from the seed); recomputed
        blocks with ``cfg.checkpoint_activations``; under mixed precision cast to 16 bits, the fp32
        weights from before the cast kept in ``self.master_weights`` for :meth:`make_optimizer`."""
        model = GPT(self.cfg.model, seed=self.cfg.seed,
                    checkpoint_activations=self.cfg.checkpoint_activations,
                    recompute=self.seams.recompute_block).to(self.device)
        if self.cfg.precision != "fp32":
            self.master_weights.update(cast_model_(model, PRECISIONS[self.cfg.precision]))
        return model

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """Adam; under mixed precision, Adam on fp32 masters (plus a loss scaler for fp16)."""
        if self.cfg.precision == "fp32":
            return torch.optim.Adam(params, lr=self.cfg.lr)
        scale = self.cfg.loss_scale
        if scale is None and self.cfg.precision == "fp16-mixed":
            scale = 2.0 ** 16
        self.loss_scaler = DynamicLossScaler(scale, growth_interval=self.cfg.loss_scale_growth,
                                             update=self.seams.loss_scale_update) \
            if scale else None
        params = list(params)
        masters = {p: self.master_weights.pop(p) for p in params if p in self.master_weights}
        return MixedPrecisionOptimizer(params, torch.optim.Adam, master_weights=masters,
                                       loss_scaler=self.loss_scaler,
                                       step=self.seams.mixed_precision_step, lr=self.cfg.lr)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss multiplied by the loss scale when there is one."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        loss.backward()

    # -- after training: optional, with defaults for ranks that hold a replica ---------------------

    def final_state(self) -> dict | None:
        """Called once on every rank after the last step (it may be a collective): the full model
        as a single-process state_dict on rank 0, None elsewhere.  Default: rank 0's replica."""
        return self.model.state_dict() if self.comm.rank == 0 else None

    def report(self) -> dict:
        """Strategy-specific facts for the summary (bucket sizes, timelines, bubbles...)."""
        return {}

    def memory(self) -> dict:
        """This rank's memory ledger (:func:`minitrain.memory.ledger`)."""
        return ledger(self.model, self.optimizer, self.meter.peak)

    def close(self) -> None:
        """Free what the strategy built (process groups); called once after the run."""


class Lockstep(Strategy):
    """Every rank steps together: the loop gives each step the *global* batch."""

    @abc.abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch ``(x, y)`` (each rank takes the slice it needs);
        returns the global mean loss."""

    def optimizer_step(self, forward, x, y, after_backward=None) -> torch.Tensor:
        """A step's shared mechanics: clear the gradients, ``forward(x, y)`` with its activations
        measured, backward (scaled under fp16), ``after_backward()`` if given, the optimizer's
        step.  Returns this rank's loss."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.meter.measure():
            loss = forward(x, y)
        self.backward(loss)
        if after_backward is not None:
            after_backward()
        self.optimizer.step()
        return loss


class FreeRunning(Strategy):
    """Ranks that do not step together (an asynchronous parameter server) run their own loop."""

    apart = "its ranks run their own loops"  # why they never step together, for the layout

    @classmethod
    def layout(cls, cfg: TrainConfig) -> Layout:
        return Layout(free_running=cls.apart)

    @abc.abstractmethod
    def run(self, data, on_step=None) -> tuple[list[float], list[float]]:
        """Train ``cfg.steps`` steps from ``data``; return (losses, seconds per step) on rank 0."""
