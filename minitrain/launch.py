"""Start N ranks and run a function on each of them (lesson 01).

``Cluster(n)`` is a persistent group of forked ranks for notebooks (``cluster.run(fn, *args)`` runs
``fn`` on every rank, shipped with cloudpickle, and returns the results by rank); ``launch(fn, n,
*args)`` is a one-shot ``Cluster``; ``init_from_env()`` joins a group started by ``torchrun``, which is
how the same entry point goes multi-GPU and multi-node.  Our own small pool rather than ipyparallel:
forked ranks start in ~0.05 s, share the kernel's imported torch pages (Binder's 2 GB), need no extra
server, and the mechanism fits in this one file.  How failures surface: see :class:`Cluster`.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

__all__ = [
    "descendants",
    "threads_per_rank",
    "Cluster",
    "launch",
    "init_from_env",
    "launched_by_torchrun",
    "choose_backend",
    "RankError",
    "CollectiveTimeout",
    "LaunchError",
]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchError(RuntimeError):
    """The ranks could not be started or were lost."""


class RankError(RuntimeError):
    """A rank raised (or died).  ``.rank`` names it, ``.remote_traceback`` is its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", exc_type: str = ""):
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.secondary = False  # True when it only reports that another rank went away
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


#: seconds the other ranks get to report after the first failure, before the group is stopped
GRACE_S = 0.3
#: forked ranks join their group in well under a second; one that has not after this long is stuck
#: (seen once in CI: a rank forked while a thread of the parent held a lock never got going), so
#: the ranks are stopped and forked once more
FORK_STARTUP_S = 20.0
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class CollectiveTimeout(RankError):
    """A collective or point-to-point op did not complete within the process group's timeout."""


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


def launched_by_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (or any env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


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


# --------------------------------------------------------------------------------------------------
# The rank side
# --------------------------------------------------------------------------------------------------


class _Forward(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr in a rank: whole lines go to the parent, which prints them."""

    def __init__(self, send, stream: str, tty: bool = False):
        self._send, self._stream, self._tty = send, stream, tty
        self._buf = ""

    def writable(self):
        return True

    def isatty(self):
        return self._tty

    def write(self, text):
        self._buf += text
        if "\n" in self._buf:
            head, _, self._buf = self._buf.rpartition("\n")
            self._send(("print", self._stream, head + "\n"))
        return len(text)

    def flush(self):
        if self._buf:
            text, self._buf = self._buf, ""
            self._send(("print", self._stream, text))


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc (Linux; empty elsewhere).  Used to check that no
    rank outlives its kernel, and to measure a lesson's memory (a kernel's ranks are its children)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()


def _worker_main(rank: int, world_size: int, conn, opts: dict) -> None:
    """Entry point of every rank: join the group, then run what the parent sends until told to stop."""
    _die_with_parent()
    lock = threading.Lock()

    def send(msg):
        with lock:
            conn.send_bytes(cloudpickle.dumps(msg))

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=opts["host"], MASTER_PORT=str(opts["port"]),
    )
    if opts["host"] in LOOPBACK:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if opts["forward_output"]:
        sys.stdout = _Forward(send, "stdout", opts["tty"][0])
        sys.stderr = _Forward(send, "stderr", opts["tty"][1])
    try:
        torch.set_num_threads(opts["threads"])
        if opts["backend"] == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(opts["host"], opts["port"], world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=opts["timeout"]))
        dist.init_process_group(opts["backend"], store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=opts["timeout"]))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        send(("error", type(exc).__name__, str(exc), traceback.format_exc(), False))
        os._exit(1)
    send(("ready", os.getpid()))

    def _flush():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not payload:
            break
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            result = fn(*args, **kwargs)
            _flush()
            send(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            _flush()
            send(("error", type(exc).__name__, str(exc), traceback.format_exc(), _is_timeout(exc)))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


# --------------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------------

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


@atexit.register
def _close_all() -> None:
    for cluster in list(_LIVE):
        cluster.close()


class Cluster:
    """A persistent group of ``world_size`` ranks, each a process in one torch.distributed group.

    >>> with Cluster(2) as c:                      # doctest: +SKIP
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
      comes back as :class:`CollectiveTimeout`; a ``run(..., timeout=s)`` wall-clock limit is a
      second guard;
    * the ranks die with the parent (``PR_SET_PDEATHSIG`` on Linux), so no orphan is left behind —
      strictly, with the parent *thread* that started them, so start a Cluster from the main thread;
    * the rendezvous store is created by the parent on a free port chosen by the OS, on loopback
      unless another ``host`` is given, so the next launch never sees "address already in use".
    """

    def __init__(self, world_size: int, backend: str | None = None, *, timeout: float = 60.0,
                 host: str = "127.0.0.1", threads: int | None = None,
                 start_method: str | None = None, forward_output: bool = True, prefix: bool = True):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
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

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "Cluster":
        """Start the ranks (a no-op when they are already running).  Forked ranks that have not
        all joined the group within :data:`FORK_STARTUP_S` are stopped and forked once more."""
        if self.alive:
            return self
        if self.start_method != "fork":
            return self._start(self.timeout + 30)
        try:
            return self._start(min(FORK_STARTUP_S, self.timeout + 30))
        except (TimeoutError, RankError) as exc:
            print(f"minitrain: the ranks did not start ({str(exc).splitlines()[0]}); starting them "
                  "again", file=sys.stderr, flush=True)
            return self._start(self.timeout + 30)

    def _start(self, limit_s: float) -> "Cluster":
        self.close()
        t0 = time.perf_counter()
        ctx = mp.get_context(self.start_method)
        sock = _listen(self.host)
        self.port = port = sock.getsockname()[1]
        self._store = dist.TCPStore(self.host, port, self.world_size + 1, is_master=True,
                                    wait_for_workers=False, master_listen_fd=sock.detach(),
                                    timeout=datetime.timedelta(seconds=self.timeout))
        opts = dict(host=self.host, port=port, backend=self.backend,
                    timeout=self.timeout, threads=self.threads, forward_output=self.forward_output,
                    tty=(_isatty(sys.stdout), _isatty(sys.stderr)))
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, self.world_size, child_end, opts),
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
        """Stop every rank (politely, then by force) and free the rendezvous port."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 1.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self.pids = [], [], []
        self._store = None  # the store owns the listening socket and closes it
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
        payload = cloudpickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            replies = self._collect(deadline)
        except BaseException:
            self.close()
            raise
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

        When a rank fails, the others get :data:`GRACE_S` to report too (a rank blocked in a
        collective with the failed one usually errors a moment later); then the most likely root
        cause — a rank that died or raised an ordinary exception, before one whose peer vanished —
        is raised, and the caller stops the group.
        """
        replies: list = [None] * self.world_size
        failures: list[RankError] = []
        grace_end = None
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
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
            if not failures and deadline is not None and now >= deadline:
                waiting = [r for r, rep in enumerate(replies) if rep is None]
                raise TimeoutError(f"ranks {waiting} did not finish within the call's timeout; "
                                   "the group was stopped (pass a larger timeout= to run())")
        if failures:
            raise min(failures, key=lambda e: e.secondary)
        return replies

    def _receive(self, rank: int, replies: list, failures: list) -> bool:
        """Handle one message from ``rank``; False when there is nothing (more) to read."""
        conn = self._conns[rank]
        try:
            if not conn.poll():
                return False
            msg = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return False  # the sentinel will tell how it ended
        if msg[0] == "print":
            self._print(rank, msg[1], msg[2])
        else:
            replies[rank] = msg
            if msg[0] == "error":
                failures.append(self._error(rank, *msg[1:]))
        return True

    def _death(self, rank: int) -> RankError:
        proc = self._procs[rank]
        proc.join(1.0)  # reap it, so the exit code is known
        code = proc.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}")
        return RankError(rank, f"the process {how} (pid {proc.pid})")

    def _error(self, rank: int, name: str, text: str, tb: str, timed_out: bool) -> RankError:
        if timed_out:
            err = CollectiveTimeout(
                rank, f"{name}: {text}\n(a collective did not complete within the group's timeout "
                f"of {self.timeout:g} s: probably another rank never called it, or called a "
                "different one; raise Cluster(timeout=...) if the work is just slow)", tb, name)
        else:
            err = RankError(rank, f"{name}: {text}", tb, name)
        # a rank whose peer vanished is a symptom, not the cause
        err.secondary = timed_out or any(k in text for k in _PEER_LOST)
        return err


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = 60.0,
           **kwargs) -> list:
    """Start ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each, stop them, return results."""
    with Cluster(world_size, backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)
