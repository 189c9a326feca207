"""How a function defined in a notebook reaches the ranks (lesson 01): cloudpickle's bytes, plus what
a rank needs to show the learner's line when something goes wrong there.

cloudpickle sends a notebook cell's function by value.  Since cloudpickle 3.1.3 it also renames every
shipped code object's file to ``<dynamic-code>`` (so that payloads are deterministic), and a rank
forked before the cell ran never had the cell's source anyway.  So :func:`dumps` keeps each code
object's real file name, and ships the source of every such file that exists only in this process's
``linecache`` (a notebook cell, an ``exec``'d string); :func:`loads` puts it into the receiver's
``linecache``.  Tracebacks and stacks taken in a rank then name the cell line and show its code, with
any cloudpickle the project allows.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import types

import cloudpickle

__all__ = ["dumps", "loads"]

_RENAMED = "<dynamic-code>"  # what cloudpickle >= 3.1.3 calls every shipped code object's file
_CODE_REDUCE = cloudpickle.Pickler.dispatch_table[types.CodeType]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, noting the file of every code object it sends and keeping its name."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.files: set[str] = set()

    def reducer_override(self, obj):
        if type(obj) is types.CodeType:
            self.files.add(obj.co_filename)
            rebuild, args = _CODE_REDUCE(obj)
            return rebuild, tuple(obj.co_filename if isinstance(a, str) and a == _RENAMED else a
                                  for a in args)
        return super().reducer_override(obj)


def _only_in_memory(path: str) -> list[str]:
    """The source lines of ``path`` when this process has them but no file holds them."""
    if os.path.isfile(path):
        return []
    return linecache.getlines(path)


def dumps(obj) -> bytes:
    """``obj`` as bytes for another process: cloudpickle's, with real file names and the sources
    that exist only here (see the module's docstring)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    sources = {path: lines for path in sorted(pickler.files) if (lines := _only_in_memory(path))}
    return pickle.dumps((sources, buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    """The object :func:`dumps` sent; its sources go into this process's ``linecache`` first."""
    sources, payload = pickle.loads(data)
    for path, lines in sources.items():
        linecache.cache[path] = (sum(map(len, lines)), None, list(lines), path)
    return pickle.loads(payload)
