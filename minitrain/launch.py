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
import faulthandler
import importlib
import io
import linecache
import multiprocessing as mp
import os
import re
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

from . import shipping

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
    "Deadlock",
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
        self.priority = 0  # which failure is reported first: 0 cause, 1 timeout, 2 peer gone
        self.others: list = []  # the other ranks' errors of the same run
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


class Deadlock(RankError):
    """Some ranks returned while the others wait in a collective that can never complete (a
    learner's skipped collective, a wrong peer, mismatched calls): found within seconds."""


#: a rank reports where its main thread is every HEARTBEAT_S while a task has run REPORT_AFTER_S
HEARTBEAT_S, REPORT_AFTER_S = 0.5, 1.0
#: a rank whose stack has not moved for STUCK_S while using under IDLE_CPU of a core is waiting
STUCK_S, IDLE_CPU = 2.0, 0.05
#: when every rank waits (recv against recv), their lines are shown after this long
ALL_WAITING_S = 6.0


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


def _where(frame) -> tuple[str, str]:
    """(the torch.distributed call a stack is in, or "", the user's line) of a rank's main thread."""
    op, user, inner = "", "", ""
    for fs in reversed(traceback.extract_stack(frame)):
        path = fs.filename.replace(os.sep, "/")
        if not op and "torch/distributed/" in path and not fs.name.startswith(("_", "wrapper")):
            op = fs.name
        if "/torch/" in path or path.endswith("minitrain/launch.py"):
            continue
        if not inner:
            inner = _line(fs)
            if not op and ".wait(" in (fs.line or ""):
                op = "wait"  # an asynchronous op's wait(): the innermost Python frame is ours
        if not user and "/minitrain/" not in path:
            user = _line(fs)
    return op, user or inner


def _line(fs) -> str:
    """``cell line 3: dist.all_reduce(t)`` for a notebook cell, ``file.py:12: ...`` otherwise."""
    name = os.path.basename(fs.filename)
    cell = "ipykernel" in fs.filename or fs.filename.startswith("<ipython-input")
    head = f"cell line {fs.lineno}" if cell else f"{name}:{fs.lineno}"
    return f"{head}: {fs.line}" if fs.line else head


def _heartbeat(send, task: dict) -> None:
    """In each rank: while a task runs, tell the parent where the main thread is (when it moves)."""
    main = threading.main_thread().ident
    last = None
    while True:
        time.sleep(HEARTBEAT_S)
        started, number = task.get("since"), task.get("number")
        if started is None or time.monotonic() - started < REPORT_AFTER_S:
            last = None
            continue
        frame = sys._current_frames().get(main)
        if frame is None:
            continue
        frames = traceback.extract_stack(frame)
        mine = [i for i, fs in enumerate(frames) if fs.name == "_worker_main"]
        stack = "".join(traceback.format_list(frames[mine[-1] + 1:] if mine else frames))
        if (number, stack) != last:
            last = (number, stack)
            send(("status", number, _where(frame), stack))


def _stderr_file(port: int, rank: int) -> str:
    """Where a rank's native stderr (gloo's and the C++ runtime's messages) is kept."""
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"minitrain-{port}-rank{rank}.stderr")


def _worker_main(rank: int, world_size: int, conn, opts: dict) -> None:
    """Entry point of every rank: join the group, then run what the parent sends until told to stop."""
    _die_with_parent()
    for fd in opts.get("close_fds", ()):  # other clusters' rendezvous sockets: not ours to hold
        try:
            os.close(fd)
        except OSError:
            pass
    try:  # native messages (a C++ abort's reason) land in a file the parent reads if we die
        err = os.open(_stderr_file(opts["port"], rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(err, 2)
        os.close(err)
        faulthandler.enable(file=2, all_threads=False)  # a crash's Python stack goes there too
    except OSError:
        pass
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
    task: dict = {"number": 0, "since": None}
    threading.Thread(target=_heartbeat, args=(send, task), daemon=True,
                     name="minitrain-heartbeat").start()

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
        task["number"] += 1
        task["since"] = time.monotonic()
        try:
            fn, args, kwargs = shipping.loads(payload)
            result = fn(*args, **kwargs)
            task["since"] = None
            _flush()
            if not dist.is_initialized():
                raise RuntimeError(
                    "your code called dist.destroy_process_group(): a Cluster's ranks keep their "
                    "group between runs; remove that call (Cluster.close() ends the group). The "
                    "ranks are restarted for the next run")
            send(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            task["since"] = None
            _flush()
            send(("error", type(exc).__name__, str(exc), traceback.format_exc(), _is_timeout(exc)))
            if not dist.is_initialized():
                break
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
def _preload_for_fork() -> None:
    """Import in the parent, once, what each forked rank would otherwise import by itself: a
    process's first ``optimizer.step()`` imports ``torch._dynamo`` (2-3 s of CPU, and on one core
    the ranks pay it one after the other); imported before the fork, every rank shares it."""
    importlib.import_module("torch._dynamo")


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
        self._task = 0  # runs sent to the current ranks (their heartbeats carry the number)
        self._watching = None
        self._listen_fd: int | None = None

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
        self._store = dist.TCPStore(self.host, port, self.world_size + 1, is_master=True,
                                    wait_for_workers=False, master_listen_fd=self._listen_fd,
                                    timeout=datetime.timedelta(seconds=self.timeout))
        self._task = 0
        others = [c._listen_fd for c in _LIVE if c is not self and c._listen_fd is not None]
        opts = dict(host=self.host, port=port, backend=self.backend,
                    timeout=self.timeout, threads=self.threads, forward_output=self.forward_output,
                    tty=(_isatty(sys.stdout), _isatty(sys.stderr)),
                    close_fds=others + [self._listen_fd])
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
        """Stop every rank (politely, then by force), and whatever it started; free the port."""
        stragglers = [pid for proc in self._procs for pid in descendants(proc.pid)]
        try:  # politely: an empty message ends a rank's loop
            for conn in self._conns:
                try:
                    conn.send_bytes(b"")
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 1.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        finally:  # then by force, even when interrupted
            self._stop(stragglers)

    def _stop(self, stragglers: list) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for pid in stragglers:  # what a rank started (a subprocess) goes with it
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        if self.port is not None and self._procs:
            for rank in range(self.world_size):
                try:
                    os.unlink(_stderr_file(self.port, rank))
                except OSError:
                    pass
        self._procs, self._conns, self.pids = [], [], []
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
        watch = _Watch(self.world_size, [p.pid for p in self._procs])
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
                                   + watch.describe(replies, stacks=True))
        if failures:
            failures.sort(key=lambda e: e.priority)
            first = failures[0]
            first.others = failures[1:]
            extra = "".join(f"\n\nrank {e.rank} also failed: {str(e).splitlines()[0].split(': ', 1)[-1]}"
                            for e in failures[1:])
            first.args = (first.args[0] + extra + watch.describe(replies, stacks=True,
                                                                  only_waiting=True),)
            raise first
        return replies

    def _watch(self, watch: "_Watch", replies: list) -> None:
        """Raise :class:`Deadlock` when ranks have returned and every other one waits; show each
        rank's line once when all of them have waited for :data:`ALL_WAITING_S`."""
        watch.sample()
        pending = [r for r, rep in enumerate(replies) if rep is None]
        stuck = [r for r in pending if watch.where.get(r, ("",))[0] and watch.stuck_for(r) >= STUCK_S]
        if len(stuck) < len(pending) or not pending:
            return
        if len(pending) < self.world_size:
            rank = stuck[0]
            raise Deadlock(rank, "the ranks wait for each other and never will:"
                           + watch.describe(replies, stacks=True)
                           + "\nEvery rank must make the same collective calls in the same order "
                           "(a send needs its recv on the peer; a rank that returns early leaves "
                           "the others waiting).")
        if not watch.announced and min(watch.stuck_for(r) for r in pending) >= ALL_WAITING_S:
            watch.announced = True
            print("minitrain: every rank is waiting for another (a deadlock?); still waiting until "
                  f"the group's timeout of {self.timeout:g} s:" + watch.describe(replies),
                  file=sys.stderr, flush=True)

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
                self._watching.status(rank, msg[2], msg[3])
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
        hint = ""
        if code == -signal.SIGABRT:
            hint = ("\nSignal 6 (abort) in a rank is most often a collective mismatch: the ranks "
                    "called different collectives, or the same one with different shapes or dtypes.")
        elif code == -signal.SIGKILL:
            rss = self._watching.rss.get(rank) if getattr(self, "_watching", None) else None
            hint = ("\nSignal 9 usually means the kernel's out-of-memory killer stopped it"
                    + (f" (its last resident memory: {rss / 2**20:,.0f} MiB)" if rss else "")
                    + ": use a smaller model or batch, or fewer ranks.")
        native = _tail(_stderr_file(self.port, rank))
        if native:
            hint += f"\n--- what rank {rank} printed last (native stderr) ---\n{native}"
        err = RankError(rank, f"the process {how} (pid {proc.pid}){hint}")
        err.priority = 0
        return err

    def _error(self, rank: int, name: str, text: str, tb: str, timed_out: bool) -> RankError:
        tb = _with_source(tb)
        if timed_out:
            err = CollectiveTimeout(
                rank, f"{name}: {text}\n(a collective did not complete within the group's timeout "
                f"of {self.timeout:g} s: probably another rank never called it, or called a "
                "different one; raise Cluster(timeout=...) if the work is just slow)", tb, name)
        else:
            err = RankError(rank, f"{name}: {text}", tb, name)
        # a rank whose peer vanished is a symptom, not the cause; a timeout comes before it
        err.priority = 2 if any(k in text for k in _PEER_LOST) else 1 if timed_out else 0
        err.secondary = err.priority > 0
        return err


_FRAME = re.compile(r'(\s*)File "([^"]+)", line (\d+), in ')


def _with_source(text: str) -> str:
    """A stack or traceback from a rank, with the source lines the rank could not show filled in
    from the parent's: a rank forked before a notebook cell ran has no copy of that cell's code
    (its linecache predates the cell), the notebook's kernel has."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        out.append(line)
        m = _FRAME.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m is None or (nxt.startswith(m.group(1) + "  ") and not _FRAME.match(nxt)):
            continue
        code = linecache.getline(m.group(2), int(m.group(3))).strip()
        if code:
            out.append(f"{m.group(1)}    {code}")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _where_with_source(where: tuple, stack: str) -> tuple:
    """``(op, "cell line 5")`` -> ``(op, "cell line 5: dist.all_reduce(x)")`` from the parent's
    copy of the source, when the rank had none (see :func:`_with_source`)."""
    op, user = where
    m = re.fullmatch(r"cell line (\d+)|(\S+):(\d+)", user or "")
    if m is None:
        return where
    lineno = int(m.group(1) or m.group(3))
    for frame in reversed(list(_FRAME.finditer(stack))):
        path = frame.group(2)
        cell = "ipykernel" in path or path.startswith("<ipython-input")
        if int(frame.group(3)) == lineno and (cell if m.group(1) else
                                               os.path.basename(path) == m.group(2)):
            code = linecache.getline(path, lineno).strip()
            return (op, f"{user}: {code}") if code else where
    return where


def _tail(path: str, lines: int = 40) -> str:
    """The last lines a dead rank wrote to its native stderr (the list of loaded extension modules
    a crash report ends with left out)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept, in_stack = [], False
    for line in text.splitlines():
        if line.startswith("Extension modules:"):
            continue
        if line.startswith(("Stack (most recent call first)", "Current thread")):
            in_stack = True
        elif in_stack and "in _worker_main" in line:
            in_stack = None  # the launcher's frames below the learner's: left out
        elif not line.strip():
            in_stack = False if in_stack is None else in_stack
        if in_stack is not None:
            kept.append(line)
    return "\n".join(kept[-lines:]).strip()


def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Watch:
    """The parent's view of a run: where each rank's main thread is (from its heartbeat), since
    when it has not moved, how much CPU it used since then (from /proc), and its memory."""

    def __init__(self, world_size: int, pids: list[int]):
        self.pids = pids
        self.where: dict[int, tuple] = {}   # rank -> (op, user line)
        self.stack: dict[int, str] = {}
        self.since: dict[int, tuple] = {}   # rank -> (time, cpu ticks) when its stack last moved
        self.rss: dict[int, int] = {}
        self.announced = False
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.sample()

    def status(self, rank: int, where: tuple, stack: str) -> None:
        stack = _with_source(stack)
        self.where[rank], self.stack[rank] = _where_with_source(where, stack), stack
        self.since[rank] = (time.monotonic(), _cpu_ticks(self.pids[rank]))

    def sample(self) -> None:
        for rank, pid in enumerate(self.pids):
            rss = _rss(pid)
            if rss:
                self.rss[rank] = rss

    def stuck_for(self, rank: int) -> float:
        """Seconds rank has not moved while (nearly) idle; 0 when it is computing or unknown."""
        if rank not in self.since:
            return 0.0
        t0, ticks0 = self.since[rank]
        elapsed = time.monotonic() - t0
        ticks = _cpu_ticks(self.pids[rank])
        if ticks is not None and ticks0 is not None and elapsed > 0:
            if (ticks - ticks0) / self._tick > IDLE_CPU * elapsed + 0.05:
                return 0.0  # it is computing (or moving data): not stuck
        return elapsed

    def describe(self, replies: list, stacks: bool = False, only_waiting: bool = False) -> str:
        """A line per rank (returned, or where it waits), then the waiting ranks' stacks.  With
        ``only_waiting`` (for a failure): only the ranks that were waiting when it happened."""
        lines, stack_text = [], []
        for rank, reply in enumerate(replies):
            finished = reply is not None and not (only_waiting and rank in self.where)
            if finished:
                if not only_waiting:
                    lines.append(f"  rank {rank} {'returned' if reply[0] == 'ok' else 'failed'}")
                continue
            if rank not in self.where:
                lines.append(f"  rank {rank} still running (no report yet)")
                continue
            op, user = self.where[rank]
            state = f"waiting in {op}" if op else "waiting"
            lines.append(f"  rank {rank} {'was ' if reply else ''}{state} at {user or '?'}")
            if stacks:
                stack_text.append(f"\n--- stack of rank {rank} ---\n{self.stack[rank].rstrip()}")
        if not lines:
            return ""
        head = "\n\nwhere the ranks were:" if only_waiting else ""
        return head + "\n" + "\n".join(lines) + "".join(stack_text)


def launch(fn, world_size: int, *args, backend: str | None = None, timeout: float = 60.0,
           **kwargs) -> list:
    """Start ``world_size`` ranks, run ``fn(*args, **kwargs)`` on each, stop them, return results."""
    with Cluster(world_size, backend, timeout=timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)
