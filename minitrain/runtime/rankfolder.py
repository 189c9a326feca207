"""Each cluster start's temporary folder (its ranks' native stderr, :mod:`minitrain.runtime.worker`): made by
:func:`new_folder`, removed by ``Cluster.close()``; the folder of a parent that died without closing
(SIGKILL) is reaped by the next start on this machine (:func:`reap_stale_folders`).  Part of the
launcher (:mod:`minitrain.runtime.launch`), which every lesson uses.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

try:
    import fcntl
except ImportError:  # not POSIX: no folder locks, no reaping
    fcntl = None

__all__ = ["new_folder", "remove_folder", "reap_stale_folders", "FOLDER_PREFIX", "OWNER"]


#: a live cluster's folder in the temporary directory: ``minitrain-ranks-<parent pid>-<random>``,
#: holding ``owner.lock``, locked (flock) by the parent while the cluster lives: the kernel releases
#: the lock when the parent dies, so a folder whose lock can be taken belongs to no one
FOLDER_PREFIX, OWNER = "minitrain-ranks-", "owner.lock"
#: a folder :func:`new_folder` made and had not yet renamed when its process was killed
#: (``.minitrain-new-<pid>-<random>``): reaped once that pid is gone (and its lock, if it has one,
#: is free); a minute's grace covers a pid seen from another pid namespace sharing this folder
_NEW = re.compile(r"^\.minitrain-new-(\d+)-")
_NEW_GRACE_S = 60.0
#: the locks this process holds (its rank folders', and a save dir's: checkpoint_checks adds those):
#: a forked rank closes its copies at once, so a lock is never held by a rank that outlives its parent
HELD_LOCK_FDS: set[int] = set()


def _drop_held_locks_in_child() -> None:
    for fd in list(HELD_LOCK_FDS):  # (closing a copy does not release the parent's lock)
        try:
            os.close(fd)
        except OSError:
            pass
    HELD_LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_held_locks_in_child)


def new_folder() -> tuple[str, int | None]:
    """A fresh temporary folder for one start's rank files, and the descriptor holding its lock
    (None where flock is missing).  Made under a hidden name, locked, then renamed: the reaper
    never sees it unlocked."""
    reap_stale_folders()
    tmp = tempfile.mkdtemp(prefix=f".minitrain-new-{os.getpid()}-")
    fd = None
    if fcntl is not None:
        fd = os.open(os.path.join(tmp, OWNER), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: the folder is still removed by close()
            os.close(fd)
            fd = None
    final = os.path.join(os.path.dirname(tmp),
                         FOLDER_PREFIX + os.path.basename(tmp)[len(".minitrain-new-"):])
    os.rename(tmp, final)
    if fd is not None:
        HELD_LOCK_FDS.add(fd)
    return final, fd


def remove_folder(folder: str | None, fd: int | None) -> None:
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    if fd is not None:
        HELD_LOCK_FDS.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


def reap_stale_folders(tmpdir: str | None = None) -> list[str]:
    """Remove the temporary folders of clusters whose parent died without closing them (their
    lock is free), the folders of starts killed before their folder was renamed (their process is
    gone), and rank files of older minitrains over a day old; returns what was removed."""
    tmpdir = tmpdir or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmpdir))
    except OSError:
        return removed
    for entry in entries:
        try:
            if entry.name.startswith(FOLDER_PREFIX) and entry.is_dir(follow_symlinks=False):
                lock = _free_lock(entry.path)  # no lock file: not one of ours; held: alive
                if lock is not None and lock is not False:
                    _remove(entry.path, lock, removed)
            elif (new := _NEW.match(entry.name)) and entry.is_dir(follow_symlinks=False):
                if (time.time() - entry.stat(follow_symlinks=False).st_mtime > _NEW_GRACE_S
                        and not _alive(int(new.group(1)))):
                    lock = _free_lock(entry.path)  # killed before it locked, or after: free
                    if lock is not False:
                        _remove(entry.path, lock, removed)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    """True if process ``pid`` exists (a zombie too; another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def _free_lock(folder: str):
    """``folder``'s owner lock, taken (an fd: close it when done) if it was free; None if the folder
    has no lock file (or locks are not to be had here); False if a process holds it."""
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(folder, OWNER), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _remove(folder: str, lock: int | None, removed: list) -> None:
    """Remove ``folder`` while holding its free ``lock`` (if it has one), and note it."""
    try:
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    finally:
        if lock is not None:
            os.close(lock)
