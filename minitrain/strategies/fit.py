"""What fits the machine: an upper bound on every size of a run, checked before any process starts.

:func:`check_fits_machine` refuses, naming the flag, its largest value that fits and the reason, a
run that needs more than this :class:`Machine` has: ranks (their memory and open files), the
model's states, the activations and token ids, the record of its steps, or a step's time at an
optimistic rate.  Every need is a lower bound, so a run refused here could not have run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..model import PRESETS, training_flops
from .base import TrainConfig
from .options import ConfigError, flag

__all__ = ["Machine", "machine_memory", "check_fits_machine", "SAVED_BYTES"]


#: a forked rank's own memory (its unique set size) after a run of the tiny model: 23-24 MiB,
#: measured with 2 to 32 ranks; the parent's imported torch is shared, not counted
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
            return "world_size", (f"each rank takes about {PARENT_FDS_PER_RANK} of the parent's "
                                  f"open files and {RANK_FDS} plus one per peer of its own, and the "
                                  f"limit is {m.open_files} (ulimit -n)")
        return "world_size", (f"each rank takes at least {_bytes(RANK_BYTES)} of memory of its "
                              f"own, and {here} has {mem}")
    terms = _memory_terms(cfg, m.gpu)
    if terms["model"] > m.memory:
        return "model", (f"{cfg.model.num_params():,} parameters of {STATE_BYTES} bytes each "
                         f"(weight, gradient, Adam's two moments) take {_bytes(terms['model'])}, "
                         f"more than {here}'s {mem}")
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
        tiny = PRESETS["tiny"]
        grown = [f"{flag(k)} {getattr(cfg.model, k)}" for k in ("d_model", "n_layer", "seq_len",
                                                               "n_expert", "d_ff", "vocab_size")
                 if getattr(cfg.model, k) and getattr(cfg.model, k) > (getattr(tiny, k) or 0)]
        smaller = " or ".join(g.split()[0] for g in grown) or "--model"
        raise ConfigError(f"the model ({', '.join(grown) or 'as given'}) does not fit this machine: "
                          f"{why}; use a smaller {smaller}")
    if name == "world_size":
        given, most = cfg.world_size, max(1, min(_max_ranks(m)))
    elif name == "seq_len":
        given = cfg.model.seq_len
        most = _largest(lambda n: _fits(replace(cfg, model=replace(cfg.model, seq_len=n)), m),
                        given)
    else:
        given = getattr(cfg, name)
        most = _largest(lambda n: _fits(replace(cfg, **{name: n}), m), given)
    if name == "world_size":
        bound = f"at most --world-size {most} fit it"
    else:
        bound = (f"at most {flag(name)} {most} fits (with the other flags as given)" if most >= 1
                 else f"even {flag(name)} 1 does not fit with the other flags as given")
    raise ConfigError(f"{flag(name)} {given} does not fit this machine: {why}; {bound}")
