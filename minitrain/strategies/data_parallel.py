"""``ddp-naive`` and ``ddp``: replicas on every rank, the global batch split over them (lesson 02; the
compression options of lesson 03).

Mixed precision (lesson 07): the replicas are bf16/fp16, so are the gradients and the buckets (gloo
all-reduces 16-bit tensors on CPU), so the averaged gradient differs from one process's by a few
16-bit roundings; with fp16 an overflow becomes inf on every rank alike, so all skip the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.analysis import overlap_fraction
from ..data import shard
from ..parallel.compression import FORMS, as_error_feedback, parse_compressor
from ..parallel.data_parallel import DistributedDataParallel, NaiveDataParallel, mean_over_ranks
from ..parallel.errors import ParameterError
from .base import Lockstep, TrainConfig, register
from .options import ConfigError, NoOptions, Options, in_cli_words, option, positive
from .single import Replica

__all__ = ["Buckets", "Compression", "Timeline", "DDPOptions", "NaiveDDP", "DDP", "DataParallel",
           "check_batch_split", "check_compression"]


@dataclass(frozen=True)
class Buckets(Options):
    bucket_mb: float | None = option(
        None, "gradient bucket size in MiB (default: 25, the first bucket 1 MiB, as PyTorch)",
        check=positive)


@dataclass(frozen=True)
class Compression(Options):
    compress: str | None = option(None, f"compress gradients with {FORMS} (default: none)",
                                  metavar="SPEC")
    error_feedback: bool = option(True, "keep what compression leaves out and add it to the next "
                                        "gradient (--no-error-feedback: drop it)")


@dataclass(frozen=True)
class Timeline(Options):
    timeline: bool = option(False, "record each step's backward and each bucket's collective, "
                                   "launched and completed (lessons 02, 04)")


@dataclass(frozen=True)
class DDPOptions(Buckets, Compression, Timeline):
    """ddp's: buckets, compression, the timeline."""


def check_batch_split(cfg: TrainConfig, parts: int, what: str = "ranks") -> None:
    """The global batch must split evenly over ``parts`` replicas."""
    if cfg.batch_size % parts:
        fix = parts * max(1, round(cfg.batch_size / parts))
        raise ConfigError(f"--batch-size {cfg.batch_size} does not split over {parts} {what}; "
                          f"use a multiple of {parts} (e.g. {fix})")


def check_compression(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError`, naming the fix, for a bad ``compress`` / ``error_feedback``."""
    try:
        compressor = parse_compressor(cfg.options.compress)
    except ParameterError as exc:
        raise in_cli_words(exc) from None
    if compressor is None and not cfg.options.error_feedback:
        raise ConfigError("--no-error-feedback only applies to compressed gradients; add "
                          "--compress SPEC (e.g. --compress topk:0.01) or leave it out")


def local_batch(x, y, comm, device):
    """This rank's slice of the global batch (inputs and targets), on its device: every
    data-parallel strategy's replicas each take 1/N of it."""
    r, n = comm.rank, comm.size
    return shard(x, r, n).to(device), shard(y, r, n).to(device)


class DataParallel(Lockstep):
    """A replica per rank, each on its slice of the global batch; the mean loss over the ranks."""

    precisions = ("fp32", "bf16-mixed", "fp16-mixed")
    checkpointer = Replica(reshards=True)  # identical replicas: rank 0 writes the replica

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        check_batch_split(cfg, cfg.world_size)

    def local(self, x, y):
        return local_batch(x, y, self.comm, self.device)

    def wrap(self, model):
        """The data-parallel wrapper around the replica (ddp-naive and ddp wrap it; ZeRO's stages
        shard it instead, in their own setup)."""
        return model

    def after_backward(self) -> None:
        """Anything left before the optimizer step (DDP: nothing, its hooks did it)."""

    def __init__(self, cfg, comm, seams=None):
        super().__init__(cfg, comm, seams)
        self.setup()

    def setup(self) -> None:
        """Build the replica, its wrapper and the optimizer (ZeRO: the sharded ones)."""
        self.model = self.build_model()
        self.wrapper = self.wrap(self.model)
        self.optimizer = self.make_optimizer(self.model.parameters())

    def train_step(self, x, y) -> float:
        loss = self.optimizer_step(self.wrapper, *self.local(x, y), self.after_backward)
        if getattr(self.seams, "mean_loss", None) is not None:  # lesson 01b's fix, every rank
            return float(self.seams.mean_loss(loss.detach().clone()))
        return mean_over_ranks(loss, self.comm)


@register
class NaiveDDP(DataParallel):
    name = "ddp-naive"
    help = "data parallel: one all-reduce per gradient after backward"
    options = NoOptions
    seams = ("sync_gradients", "mixed_precision_step", "recompute_block", "mean_loss")

    def wrap(self, model):
        return NaiveDataParallel(model, self.comm, sync_gradients=self.seams.sync_gradients)

    def after_backward(self) -> None:
        self.wrapper.sync_gradients()


@register
class DDP(DataParallel):
    name = "ddp"
    help = ("distributed data parallel: bucketed all-reduce overlapped with backward "
            "(--bucket-mb, --compress)")
    options = DDPOptions
    seams = ("ring_all_reduce", "bucket_hooks", "topk_error_feedback", "mixed_precision_step",
             "recompute_block", "mean_loss")

    @classmethod
    def check(cls, cfg: TrainConfig) -> None:
        check_batch_split(cfg, cfg.world_size)
        check_compression(cfg)
        if cfg.options.compress and cfg.precision == "fp16-mixed" and cfg.loss_scale != 0:
            raise ConfigError("--compress cannot be combined with loss scaling (--precision "
                              "fp16-mixed): the error-feedback residuals would hold gradients "
                              "scaled by a changing loss scale, and an overflow's inf; use "
                              "--precision bf16-mixed, or --loss-scale 0")
        if cfg.options.compress and (cfg.save_dir or cfg.resume):
            raise ConfigError("--compress cannot be checkpointed yet: each rank's error-feedback "
                              "residuals would be lost, so a resumed run would differ; leave out "
                              "--compress, or --save-dir/--resume")

    def wrap(self, model):
        o, s = self.cfg.options, self.seams
        ddp = DistributedDataParallel(
            model, self.comm, bucket_cap_mb=o.bucket_mb,
            compression=as_error_feedback(o.compress, o.error_feedback,
                                          topk_error_feedback=s.topk_error_feedback),
            ring_all_reduce=s.ring_all_reduce, bucket_hooks=s.bucket_hooks)
        if o.timeline:
            ddp.timeline = []
        return ddp

    def report(self) -> dict:
        """Bucket sizes, and (with the ``timeline`` option) each step's backward/all-reduce times."""
        out = {"bucket_bytes": [b.nbytes for b in self.wrapper.buckets]}
        if self.wrapper.ef is not None:
            out["compression"] = self.wrapper.ef.compressor.name
        if self.wrapper.timeline:
            out["timeline"] = self.wrapper.timeline
            out["overlap"] = [overlap_fraction(s) for s in self.wrapper.timeline]
        return out

