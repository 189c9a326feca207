"""The harness: ``--strategy NAME`` → a :class:`Strategy` that composes technique wrappers from
:mod:`minitrain.parallel`, with its typed options, its checks, its report and its checkpointer.

One module per family (``single``, ``data_parallel``, ``param_server``, ``zero``, ``pipeline``,
``tensor``, ``threed``, ``context``, ``expert``); each registers its strategies when imported.
:mod:`.base` holds the contract (at its top), the configuration, the options and seams records and
the base classes; ``single`` is the worked example; :mod:`.portable` is resharding.
"""

from .base import (Checkpointer, ConfigError, FreeRunning, Lockstep, NoOptions, Options, Seams,
                   Strategy, TrainConfig, at_least, check_common, check_strategy, get_strategy,
                   option, positive, register, strategy_names)
from .single import Single

__all__ = ["ConfigError", "TrainConfig", "Options", "NoOptions", "option", "positive", "at_least",
           "Seams", "Strategy", "Lockstep", "FreeRunning", "Checkpointer", "register",
           "get_strategy", "strategy_names", "check_common", "check_strategy", "Single"]
