"""A checkpoint read offline, in one process (lesson 08): ``minitrain consolidate ck full.pt`` writes the
full model as a plain single-process state_dict; :func:`portable_state` gives the layout-free form
(:mod:`minitrain.strategies.portable`) that resharding loads.  PyTorch's counterpart is
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .core import (RankFiles, check_files, checkpoint_support, not_as_described, read_meta,
                         saved_config, serialized, write_whole)
from .format import (META, STEP_DIR, UNFINISHED_DIR, CheckpointError, disk_full,
                                find_checkpoint, size_text)
from ..strategies import TrainConfig, get_strategy, portable

__all__ = ["consolidate", "consolidate_to", "check_output", "portable_state"]


def _open(where) -> tuple[Path, TrainConfig, RankFiles]:
    """Checkpoint ``where`` for offline use: its path, the config it was saved under (as far as
    its layout goes) and its verified rank files."""
    path = find_checkpoint(where)
    meta = read_meta(path)
    check_files(path, meta)
    return path, saved_config(meta), RankFiles(path, meta)



def consolidate(where) -> dict:
    """The full model of checkpoint ``where`` as a plain single-process state_dict (the keys and
    shapes of ``GPT(cfg).state_dict()``): what the run's ``final_state()`` was at that step."""
    path, cfg, read = _open(where)
    why = checkpoint_support(get_strategy(cfg.strategy))
    if why:
        raise CheckpointError(f"cannot consolidate {path}: {why}")
    try:
        return get_strategy(cfg.strategy).checkpointer.consolidate(cfg, read)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise not_as_described(path, exc) from None


def _inside_a_checkpoint(path: Path) -> Path | None:
    """The checkpoint directory (``meta.json``, or a ``step-N``/``step-N.tmp`` name) that ``path``
    would be written inside, or None."""
    for folder in path.parents:
        if (folder / META).exists() or STEP_DIR.match(folder.name) or UNFINISHED_DIR.match(folder.name):
            return folder
    return None


def check_output(out) -> Path:
    """Where :func:`consolidate_to` may write ``out`` (resolved), or a :class:`CheckpointError`:
    a path is needed; it may not lie inside a checkpoint (its files are the checkpoint); an
    existing ``out`` must be a regular file (never a directory, a device or a pipe)."""
    if out is None or not str(out).strip():
        raise CheckpointError("no output file given: name the .pt file to write, e.g. "
                              "minitrain consolidate ck full.pt")
    given = Path(out).expanduser()
    path = given.resolve()  # through symbolic links: where the bytes would really go
    inside = _inside_a_checkpoint(path)
    if inside is not None:
        raise CheckpointError(f"cannot write {given}: it is inside the checkpoint {inside}, whose "
                              "files are the checkpoint (writing there would damage it); write "
                              f"it outside, e.g. {inside.parent / 'full.pt'}")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise CheckpointError(f"cannot write {given}: {exc.strerror or exc}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise CheckpointError(f"cannot write {given}: it is a directory; name a file in it, e.g. "
                              f"{given / 'full.pt'}")
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device"
                if stat.S_ISBLK(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a socket"
                if stat.S_ISSOCK(mode) else "not a regular file")
        raise CheckpointError(f"cannot write {given}: it is {kind}, not a regular file; name a "
                              "file to write")
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot write {given}: {given.parent} does not exist")
    return path


def consolidate_to(where, out) -> Path:
    """:func:`consolidate` and ``torch.save`` the state_dict to ``out``; returns its path.

    ``out`` is checked first (:func:`check_output`); it is written whole or not at all (no
    temporary left behind), and a full disk is said as such."""
    path = check_output(out)
    state = consolidate(where)
    data = serialized(state)
    try:
        write_whole(path, data)
    except OSError as exc:
        if disk_full(exc):
            raise CheckpointError(f"no space left on {path.parent}: the consolidated state_dict "
                                  f"needs {size_text(len(data))}; nothing was written ({out} is as it "
                                  "was); free space there, or write it elsewhere") from None
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}") from None
    return Path(out)


def portable_state(where) -> tuple[dict, dict]:
    """(weights, optimizer state) of checkpoint ``where`` in the layout-free form any reshardable
    strategy loads (:mod:`minitrain.strategies.portable`), offline."""
    path, cfg, read = _open(where)
    if not portable.reshardable(get_strategy(cfg.strategy)):
        raise CheckpointError(f"{path} was saved by {cfg.strategy!r}, which does not reshard; "
                              f"resharding covers {', '.join(portable.reshardable_names())}")
    return portable.portable_form(cfg, read)
