"""minitrain: how large language models are trained across many devices, built from scratch.

The package behind the lesson notebooks in ``lessons/``.  Start with :class:`minitrain.Cluster`
(ranks for a notebook), :class:`minitrain.Comm` (traced collectives), :class:`minitrain.GPT` (the
tiny model), :func:`minitrain.train` (a whole training run) and :mod:`minitrain.memory`.
"""

from .comm import Comm, Tracer, ring_all_reduce
from .data import ArithmeticData
from .runtime.launch import Cluster, CollectiveTimeout, RankError, launch
from .model import GPT, GPTConfig, PRESETS
from .strategies import ConfigError, TrainConfig
from .train import train

__version__ = "0.1.0"

__all__ = [
    "ArithmeticData", "Cluster", "CollectiveTimeout", "Comm", "ConfigError", "GPT", "GPTConfig",
    "PRESETS", "RankError", "TrainConfig", "Tracer", "launch", "ring_all_reduce", "train",
]
