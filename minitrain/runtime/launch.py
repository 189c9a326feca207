"""Start N ranks and run a function on each of them (lesson 01).

``Cluster(n)`` is a persistent group of forked ranks for notebooks (``cluster.run(fn, *args)`` runs
``fn`` on every rank, shipped with cloudpickle, and returns the results by rank); ``launch(fn, n,
*args)`` is a one-shot ``Cluster``.  Our own small pool rather than ipyparallel: forked ranks start
in ~0.05 s, share the kernel's imported torch pages (Binder's 2 GB) and need no extra server.

This file is the parent's side.  What each rank runs is :mod:`minitrain.runtime.worker`; how a function
travels, :mod:`minitrain.runtime.shipping`; how a waiting rank is told from a working one,
:mod:`minitrain.runtime.watch`; what a failure carries, :mod:`minitrain.runtime.diagnostics`; joining a group that
``torchrun`` started (multi-GPU, multi-node), :mod:`minitrain.runtime.torchrun`.  How failures surface: see
:class:`Cluster`.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import weakref
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

from . import shipping
from .rankfolder import new_folder, reap_stale_folders, remove_folder
from .diagnostics import CollectiveTimeout, Deadlock, LaunchError, RankError, format_states
from .torchrun import TORCHRUN_VARS, choose_backend, init_from_env, launched_by_torchrun
from .watch import (ALL_WAITING_S, HEARTBEAT_S, REPORT_AFTER_S, STUCK_S, Watch, descendants,
                    died, native_end, native_tail, raised)
from .worker import stderr_file, worker_main

__all__ = ["descendants", "threads_per_rank", "Cluster", "launch", "init_from_env",
           "launched_by_torchrun", "choose_backend", "RankError", "CollectiveTimeout", "Deadlock",
           "LaunchError", "HEARTBEAT_S", "REPORT_AFTER_S", "STUCK_S", "TORCHRUN_VARS",
           "reap_stale_folders"]


_OLD_STORE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6)
#: seconds the other ranks get to report after the first failure, before the group is stopped
GRACE_S = 0.3
#: forked ranks join their group in well under a second; one that has not after this long is stuck
#: (seen once in CI: a rank forked while a thread of the parent held a lock never got going), so
#: the ranks are stopped and forked once more
FORK_STARTUP_S = 20.0
#: the process group's timeout, in seconds: torch counts it in whole milliseconds (less is 0: a
#: C++ error), and a collective that may wait longer than a week is a hang
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 7 * 86400.0



def threads_per_rank(world_size: int, start_method: str, threads: int | None = None) -> int:
    """Intra-op threads for each rank: ``threads`` if given, else 1 when forking, else the cores
    shared out.  More than one thread in a forked rank is refused: it can hang (see Cluster)."""
    if threads is None:
        return 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if threads > 1 and start_method == "fork":
        raise ValueError(f"threads={threads} with forked ranks can hang: torch's OpenMP thread "
                         "pool does not survive a fork once the parent has used it; use "
                         "threads=1, or start_method='spawn' for more threads per rank")
    return threads


def _listen(host: str) -> socket.socket:
    """A listening socket on ``host`` and a free port picked by the OS, for the rendezvous store.

    TCPStore on its own listens on every interface; handing it this socket keeps it on ``host``.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(addr)
    sock.listen(128)
    return sock


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


def _preload_for_fork() -> None:
    """Import in the parent, once, what each forked rank would otherwise import by itself: a
    process's first ``optimizer.step()`` imports ``torch._dynamo`` (2-3 s of CPU, and on one core
    the ranks pay it one after the other); imported before the fork, every rank shares it."""
    importlib.import_module("torch._dynamo")


@atexit.register
def _close_all() -> None:
    """At exit, close every Cluster still open (a script, a notebook kernel, a check that forgot
    to): its ranks stop and its temporary folder goes."""
    for cluster in list(_LIVE):
        try:
            cluster.close()
        except Exception:  # noqa: BLE001 - the next cluster's start reaps what is left
            pass


class Cluster:
    """A persistent group of ``world_size`` ranks, each a process in one torch.distributed group.

    >>> with Cluster(2, backend="gloo") as c:      # doctest: +SKIP
    ...     c.run(lambda: dist.get_rank())
    [0, 1]

    Arguments:
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``; default: NCCL if there are ``world_size`` GPUs, else gloo.
        timeout: seconds a collective may wait for the other ranks before it fails.
        host: address the rendezvous listens on (loopback unless you ask otherwise).
        threads: torch intra-op threads per rank (default: 1 for forked ranks, cores //
            world_size for spawned ones).  Forked ranks run one thread: GNU OpenMP (torch's CPU
            thread pool) does not survive a fork — a forked child that runs a parallel region hangs
            if the parent had already used its pool, which a notebook kernel usually has.  For
            more threads per rank use ``start_method="spawn"``.
        start_method: ``"fork"`` (default on Linux without CUDA) or ``"spawn"``.
        forward_output: print what the ranks print, prefixed with ``[rank r]`` (``prefix=False``
            prints it as it is).

    Failure rules (what the lessons rely on):

    * a rank that raises → :class:`RankError` naming the rank, with its traceback; the group is torn
      down (the other ranks may be stuck in a collective) and restarted on the next ``run``;
    * a rank that dies (e.g. SIGKILL) → :class:`RankError` within the poll interval;
    * a collective that never completes → the process group's ``timeout`` fires inside the rank and
      comes back as :class:`CollectiveTimeout` (under NCCL the watchdog ends the rank, and its
      stderr, which says why, makes it the same :class:`CollectiveTimeout`); a ``run(...,
      timeout=s)`` wall-clock limit is a second guard;
    * the ranks die with the parent (``PR_SET_PDEATHSIG`` on Linux), so no orphan is left behind —
      strictly, with the parent *thread* that started them, so start a Cluster from the main thread;
    * each rank leads a process group of its own: what it starts (a subprocess) is stopped with it
      when the rank fails or dies, and at :meth:`close` — even after the rank itself is gone;
    * a Cluster left open is closed when the process exits; its ranks' native stderr files live in
      a temporary folder of its own (:attr:`folder`), removed by :meth:`close`, and a parent
      killed before closing (SIGKILL) leaves one that the next start on the machine removes;
    * the rendezvous store is created by the parent on a free port chosen by the OS, on loopback
      unless another ``host`` is given, so the next launch never sees "address already in use".
    """

    def __init__(self, world_size: int, backend: str | None = None, *, timeout: float = 60.0,
                 host: str = "127.0.0.1", threads: int | None = None,
                 start_method: str | None = None, forward_output: bool = True, prefix: bool = True):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not (isinstance(timeout, (int, float)) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout must be > 0 seconds: from {MIN_TIMEOUT_S:g} (the process "
                             f"group counts in whole milliseconds) to {MAX_TIMEOUT_S:g} (a week), "
                             f"got {timeout!r}")
        self.world_size = world_size
        self.backend = choose_backend(world_size, backend)
        self.timeout = float(timeout)
        self.host = host
        if start_method is None:
            fork_ok = "fork" in mp.get_all_start_methods() and self.backend == "gloo"
            start_method = "fork" if fork_ok else "spawn"
        self.start_method = start_method
        self.threads = threads_per_rank(world_size, start_method, threads)
        self.forward_output, self.prefix = forward_output, prefix
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self.port: int | None = None
        self.pids: list[int] = []
        self.started_in_s: float | None = None
        self._task = 0  # runs sent to the current ranks (their heartbeats carry the number)
        self._watching = None
        self._listen_fd: int | None = None
        self.folder: str | None = None  # this start's temporary folder (the ranks' stderr files)
        self._folder_fd: int | None = None
        self._groups_stopped: set[int] = set()  # ranks whose process group was killed

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Every rank runs (asked without reaping a rank that ended: see :meth:`_stop_group`)."""
        return bool(self._procs) and not wait([p.sentinel for p in self._procs], timeout=0)

    def start(self) -> "Cluster":
        """Start the ranks (a no-op when they are already running).  Forked ranks that have not
        all joined the group within :data:`FORK_STARTUP_S` are stopped and forked once more."""
        if self.alive:
            return self
        if self.start_method != "fork":
            return self._start(self.timeout + 30)
        # torch.optim imports torch._dynamo (about 1 s of CPU) the first time an optimizer is made:
        # import it once here, so that every forked rank shares it instead of importing its own
        importlib.import_module("torch._dynamo")
        try:
            return self._start(min(FORK_STARTUP_S, self.timeout + 30))
        except (TimeoutError, RankError) as exc:
            print(f"minitrain: the ranks did not start ({str(exc).splitlines()[0]}); starting them "
                  "again", file=sys.stderr, flush=True)
            return self._start(self.timeout + 30)

    def _start(self, limit_s: float) -> "Cluster":
        self.close()
        t0 = time.perf_counter()
        if self.start_method == "fork":
            _preload_for_fork()
        ctx = mp.get_context(self.start_method)
        sock = _listen(self.host)
        self.port = port = sock.getsockname()[1]
        self._listen_fd = sock.detach()
        store = dict(is_master=True, wait_for_workers=False, master_listen_fd=self._listen_fd,
                     timeout=datetime.timedelta(seconds=self.timeout))
        if _OLD_STORE:  # torch < 2.6: only the older store takes a listening socket
            store["use_libuv"] = False
        self._store = dist.TCPStore(self.host, port, self.world_size + 1, **store)
        self._task = 0
        try:
            self.folder, self._folder_fd = new_folder()
        except OSError:  # no writable temporary directory: the ranks run without stderr files
            self.folder, self._folder_fd = None, None
        others = [c._listen_fd for c in _LIVE if c is not self and c._listen_fd is not None]
        opts = dict(host=self.host, port=port, backend=self.backend, folder=self.folder,
                    timeout=self.timeout, threads=self.threads, forward_output=self.forward_output,
                    tty=(_isatty(sys.stdout), _isatty(sys.stderr)),
                    close_fds=others + [self._listen_fd])
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, self.world_size, child_end, opts),
                               daemon=True, name=f"minitrain-rank{rank}")
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        _LIVE.add(self)
        try:
            replies = self._collect(deadline=time.monotonic() + limit_s)
        except BaseException:
            self.close()
            raise
        self.pids = [r[1] for r in replies]
        self.started_in_s = time.perf_counter() - t0
        return self

    def close(self) -> None:
        """Stop every rank (politely, then by force) and whatever it started (its process group,
        and processes below it); free the port; remove the temporary folder."""
        stragglers = [pid for proc in self._procs for pid in descendants(proc.pid)]
        try:  # politely: an empty message ends a rank's loop
            for conn in self._conns:
                try:
                    conn.send_bytes(b"")
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 1.0
            waiting = {p.sentinel for p in self._procs}
            while waiting and time.monotonic() < deadline:  # (waited on, not reaped: see below)
                waiting -= set(wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())))
        finally:  # then by force, even when interrupted
            self._stop(stragglers)

    def _stop_group(self, proc) -> None:
        """Kill rank ``proc``'s process group: the rank (a group leader: ``os.setpgid`` in
        :func:`~minitrain.runtime.worker.worker_main`) and every process it started that is still in it,
        even one whose rank died.  Only while the rank is not yet reaped: until then its pid, the
        group's id, cannot be given to another process (a rank that ended is reaped only after)."""
        popen = getattr(proc, "_popen", None)
        if proc.pid is None or proc.pid in self._groups_stopped or popen is None \
                or popen.returncode is not None:
            return
        self._groups_stopped.add(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # no such group (the rank had not made its group yet, or it is empty)
            pass

    def _stop(self, stragglers: list) -> None:
        for proc in self._procs:
            self._stop_group(proc)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for pid in stragglers:  # what a rank started and moved out of its group goes too
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        remove_folder(self.folder, self._folder_fd)
        self.folder, self._folder_fd = None, None
        self._procs, self._conns, self.pids = [], [], []
        self._groups_stopped = set()
        self._store = None  # the store owns the listening socket and closes it
        self._listen_fd = None
        _LIVE.discard(self)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"start_method={self.start_method!r}, {state})")

    # -- running work -------------------------------------------------------------------------------

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results as a list indexed by rank.

        ``timeout`` (seconds, default none) bounds the whole call; the process group's own timeout
        already bounds every collective.  If a rank fails the group is stopped and the error raised;
        the next ``run`` starts fresh ranks.
        """
        self.start()
        payload = shipping.dumps((fn, args, kwargs))  # a function that cannot be sent: no harm
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._task += 1
            for conn in self._conns:
                conn.send_bytes(payload)
            replies = self._collect(deadline)
        except BaseException:  # a failure, an interrupt, anything: never leave the ranks half-fed
            self.close()
            raise
        finally:
            self._watching = None
        return [r[1] for r in replies]

    def _print(self, rank: int, stream: str, text: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        if self.prefix:
            lines = text.splitlines(keepends=True)
            text = "".join(f"[rank {rank}] {line}" if line.strip() else line for line in lines)
        out.write(text)
        out.flush()

    def _collect(self, deadline: float | None) -> list:
        """Wait for one final reply per rank, printing forwarded output as it arrives.

        When a rank fails, the others get :data:`GRACE_S` to report too; then the most likely root
        cause is raised (a rank that died or raised an ordinary exception, then a timeout, then a
        rank whose peer vanished), carrying the other ranks' errors, and the caller stops the group.
        While waiting, the watchdog (:meth:`_watch`) turns a deadlock into an error within seconds.
        """
        replies: list = [None] * self.world_size
        failures: list[RankError] = []
        grace_end = None
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        watch = Watch(self.world_size, [p.pid for p in self._procs])
        self._watching = watch
        while any(r is None for r in replies):
            until = grace_end if grace_end is not None else deadline
            wait_s = 0.5 if until is None else min(0.5, max(0.0, until - time.monotonic()))
            pending = [c for r, c in enumerate(self._conns) if replies[r] is None]
            for obj in wait(pending + list(sentinels), timeout=wait_s):
                if obj in sentinels:  # a process ended: read what it sent last, then judge
                    rank = sentinels.pop(obj)
                    while replies[rank] is None and self._receive(rank, replies, failures):
                        pass
                    if replies[rank] is None:
                        replies[rank] = ("dead",)
                        failures.append(self._death(rank))
                else:
                    self._receive(conn_rank[id(obj)], replies, failures)
            now = time.monotonic()
            if failures and grace_end is None:
                grace_end = now + GRACE_S
            if grace_end is not None and now >= grace_end:
                break
            if not failures:
                self._watch(watch, replies)
            if not failures and deadline is not None and now >= deadline:
                waiting = [r for r, rep in enumerate(replies) if rep is None]
                raise TimeoutError(f"ranks {waiting} did not finish within the call's timeout; "
                                   "the group was stopped (pass a larger timeout= to run())"
                                   + "\n" + format_states(watch.states(replies).values(),
                                                           stacks=True))
        if failures:
            failures.sort(key=lambda e: e.priority)
            first = failures[0]
            first.others = failures[1:]
            first.where = watch.states(replies, failures)
            raise first
        return replies

    def _watch(self, watch: Watch, replies: list) -> None:
        """Raise :class:`Deadlock` when ranks have returned and every other one waits; show each
        rank's line once when all of them have waited for :data:`ALL_WAITING_S`."""
        watch.sample()
        pending = [r for r, rep in enumerate(replies) if rep is None]
        stuck = watch.stuck(pending)
        if len(stuck) < len(pending) or not pending:
            return
        if len(pending) < self.world_size:
            err = Deadlock(stuck[0], "the ranks wait for each other and never will")
            err.where = watch.states(replies)
            raise err
        if not watch.announced and len(watch.stuck(pending, ALL_WAITING_S)) == len(pending):
            watch.announced = True
            print("minitrain: every rank is waiting for another (a deadlock?); still waiting until "
                  f"the group's timeout of {self.timeout:g} s:\n"
                  + format_states(watch.states(replies).values()), file=sys.stderr, flush=True)

    def _receive(self, rank: int, replies: list, failures: list) -> bool:
        """Handle one message from ``rank``; False when there is nothing (more) to read."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return False
            msg = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return False  # the sentinel will tell how it ended
        except Exception as exc:  # noqa: BLE001 - a result the parent cannot unpickle
            replies[rank] = ("error",)
            failures.append(RankError(rank, f"its result could not be unpickled here: "
                                            f"{type(exc).__name__}: {exc}; return plain values "
                                            "(numbers, lists, tensors) from the function"))
            return True
        if msg[0] == "print":
            self._print(rank, msg[1], msg[2])
        elif msg[0] == "status":
            if msg[1] == self._task and getattr(self, "_watching", None) is not None:
                self._watching.status(rank, msg[2])
        else:
            replies[rank] = msg
            if msg[0] == "error":
                failures.append(self._error(rank, *msg[1:]))
        return True

    def _death(self, rank: int) -> RankError:
        proc = self._procs[rank]
        self._stop_group(proc)  # what it started goes with it (before it is reaped)
        proc.join(1.0)  # reap it, so the exit code is known
        watching = getattr(self, "_watching", None)
        rss = watching.rss.get(rank) if watching else None
        path = stderr_file(self.folder, rank) if self.folder else None
        native = native_tail(path) if path else ""
        # NCCL's watchdog ends a rank whose collective timed out (worker.py): its stderr says so,
        # and it comes back as a CollectiveTimeout, as gloo's timeout does
        return died(rank, proc.exitcode, proc.pid, native, rss, timeout_s=self.timeout,
                    frames=watching.frames.get(rank, ()) if watching else (),
                    stderr=native_end(path) if path else "")

    def _error(self, rank: int, name: str, text: str, tb: str, timed_out: bool,
               frames: tuple = (), args: tuple = ()) -> RankError:
        err = raised(rank, name, text, tb, frames, self.timeout if timed_out else None)
        err.exc_args = args
        return err


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = 60.0,
           **kwargs) -> list:
    """Start ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each, stop them, return results."""
    with Cluster(world_size, backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)
