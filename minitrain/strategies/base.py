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

Also here: :class:`TrainConfig` (a run's configuration, the same object on every rank),
:class:`Seams` (a learner's functions inside a real strategy) and the registry.  Beside it:
:mod:`.options` (typed :class:`Options` made with :func:`option`, :class:`ConfigError`),
:mod:`.checks` (the checks every strategy gets before its own) and :mod:`.fit` (what fits the
machine).
"""

from __future__ import annotations

import abc
import functools
import importlib
import os
import pkgutil
import typing
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn

from ..comm import Comm
from ..memory import ActivationMeter, ledger
from ..model import GPT, GPTConfig, PRESETS
from ..precision import PRECISIONS, DynamicLossScaler, MixedPrecisionOptimizer, cast_model_
from ..record import Layout
from .options import ConfigError, NoOptions, Options, did_you_mean, flag

__all__ = ["TrainConfig", "Seams", "Strategy", "Lockstep", "FreeRunning", "Checkpointer",
           "register", "get_strategy", "strategy_names"]


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
    profile: str | None = _cli("profile one step (the second) with torch.profiler and write each "
                               "rank's trace to DIR/rank<r>.json: Chrome trace JSON, opened by "
                               "Perfetto and chrome://tracing (lesson 02)", metavar="DIR")

    def __post_init__(self):
        cls = _REGISTRY.get(self.strategy) or _find(self.strategy)
        if cls is None or type(self.options) is cls.options:
            return  # an unknown strategy is refused by check_config
        given = self.options.given() if isinstance(self.options, Options) else dict(self.options)
        names = {f.name for f in fields(cls.options)}
        for key in given:  # a name this record does not have: refused, naming who takes it
            if key not in names:
                raise ConfigError(_not_taken(key, self.strategy))
        object.__setattr__(self, "options", cls.options(**given))

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
    # why it cannot run on NCCL ("": it can); refused before any process starts, and it runs on
    # gloo when no backend is named
    nccl_refusal: str = ""
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
                    recompute_block=self.seams.recompute_block).to(self.device)
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
                                             loss_scale_update=self.seams.loss_scale_update) \
            if scale else None
        params = list(params)
        masters = {p: self.master_weights.pop(p) for p in params if p in self.master_weights}
        return MixedPrecisionOptimizer(params, torch.optim.Adam, master_weights=masters,
                                       loss_scaler=self.loss_scaler, lr=self.cfg.lr,
                                       mixed_precision_step=self.seams.mixed_precision_step)

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
