"""Joining a group that ``torchrun`` started (lesson 08): how the same entry point goes multi-GPU and
multi-node.  ``torchrun`` (or any env:// launcher) sets :data:`TORCHRUN_VARS` in each process;
:func:`launched_by_torchrun` says whether this is such a process (refusing half an environment), and
:func:`init_from_env` joins its group, on NCCL when each process has a GPU, else gloo
(:func:`choose_backend`, which :class:`minitrain.runtime.launch.Cluster` uses too).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .diagnostics import LaunchError

__all__ = ["choose_backend", "TORCHRUN_VARS", "launched_by_torchrun", "init_from_env"]


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """``nccl`` when there are at least ``world_size`` GPUs, else ``gloo`` (CPU)."""
    if backend is not None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend 'nccl' needs {world_size} GPUs, found {torch.cuda.device_count()}; "
                "use backend='gloo' (CPU) or fewer ranks"
            )
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


#: what torchrun (and any env:// launcher) sets for each process
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (or any env:// launcher): all of
    :data:`TORCHRUN_VARS` set and consistent.  A partial or inconsistent set (variables left over
    in a shell or a notebook) raises :class:`LaunchError` naming them and the fix."""
    present = [k for k in TORCHRUN_VARS if k in os.environ]
    if not present:
        return False
    shown = ", ".join(f"{k}={os.environ[k]}" for k in present)
    fix = (f"if this is not a torchrun process, unset them (unset {' '.join(present)}); else "
           "start it with torchrun")
    missing = [k for k in TORCHRUN_VARS if k not in os.environ]
    if missing:
        raise LaunchError(f"the environment has {shown} but not {', '.join(missing)}: half a "
                          f"torchrun environment; {fix}")
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        int(os.environ["MASTER_PORT"])
    except ValueError:
        raise LaunchError(f"the torchrun variables are not numbers where they must be ({shown}); "
                          f"{fix}") from None
    if not (0 <= rank < world and 0 <= local <= rank):
        raise LaunchError(f"the torchrun variables disagree ({shown}: need 0 <= LOCAL_RANK <= RANK "
                          f"< WORLD_SIZE); {fix}")
    return True


def init_from_env(backend: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; return ``(rank, world_size)``."""
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = choose_backend(local_world, backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout)
        )
    return dist.get_rank(), dist.get_world_size()
