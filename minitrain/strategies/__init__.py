"""The harness: ``--strategy NAME`` → a :class:`Strategy` that composes technique wrappers from
:mod:`minitrain.parallel`, with its typed options, its checks, its report and its checkpointer.

One module per family (``single``, ``data_parallel``, ``param_server``, ``zero``, ``pipeline``,
``tensor``, ``threed``, ``context``, ``expert``); each registers its strategies when imported.
:mod:`.base` holds the contract (at its top), the configuration, the seams record and the base
classes; :mod:`.options` the typed options; :mod:`.checks` and :mod:`.fit` what is refused before
spawning; ``single`` is the worked example; :mod:`.portable` is resharding.
"""

from .base import (Checkpointer, FreeRunning, Lockstep, Seams, Strategy, TrainConfig, get_strategy,
                   register, strategy_names)
from .checks import check_common, check_strategy
from .options import ConfigError, NoOptions, Options, at_least, option, positive
from .single import Single

__all__ = ["ConfigError", "TrainConfig", "Options", "NoOptions", "option", "positive", "at_least",
           "Seams", "Strategy", "Lockstep", "FreeRunning", "Checkpointer", "register",
           "get_strategy", "strategy_names", "check_common", "check_strategy", "Single"]
