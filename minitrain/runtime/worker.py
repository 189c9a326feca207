"""What each rank runs (lesson 01): join the group, then run what the parent sends until told to stop.

A rank of a :class:`minitrain.runtime.launch.Cluster` is a process started with :func:`worker_main` and one end
of a pipe.  It joins the ``torch.distributed`` group through the parent's rendezvous store, forwards
what it prints to the parent line by line, runs each function it is sent (:mod:`minitrain.runtime.shipping`)
and sends back ``("ok", result)`` or ``("error", type, message, traceback, timed out, frames)``; a
heartbeat thread (:mod:`minitrain.runtime.watch`) reports where it is while a task runs.  It dies with its
parent, keeps the native stderr (a C++ abort's reason) in a file the parent reads if it dies (in
the cluster's own temporary folder: :func:`stderr_file`), and leads a process group of its own
(``os.setpgid``), so that whatever it starts goes with it when the parent stops the group.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import os
import signal
import sys
import threading
import time
import traceback

import cloudpickle
import torch
import torch.distributed as dist

from . import shipping
from ..device import taint_from_env
from .diagnostics import frames_of, is_timeout
from .watch import heartbeat

__all__ = ["worker_main", "stderr_file", "LOOPBACK"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


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


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or is_timeout(str(exc))


def stderr_file(folder: str, rank: int) -> str:
    """Where a rank's native stderr (gloo's and the C++ runtime's messages) is kept: in the
    cluster's temporary ``folder``, removed with the cluster (:class:`minitrain.runtime.launch.Cluster`)."""
    return os.path.join(folder, f"rank{rank}.stderr")


def _plain_args(exc: BaseException) -> tuple:
    """The exception's arguments, when they travel (plain values): a checker's own exception can
    carry facts, not only a sentence."""
    try:
        cloudpickle.dumps(exc.args)
        return exc.args
    except Exception:  # noqa: BLE001 - anything that does not pickle stays behind
        return ()


def worker_main(rank: int, world_size: int, conn, opts: dict) -> None:
    """Entry point of every rank: join the group, then run what the parent sends until told to stop."""
    _die_with_parent()
    try:  # a process group of its own: the parent stops the group, what the rank started included.
        # (Not a session of its own: the kernel schedules each session as a group of its own, and
        # ranks scheduled apart report a shared timeout further apart.)  In a background group a
        # write to the terminal could stop the rank (stty tostop): it goes on instead.
        os.setpgid(0, 0)
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    except (OSError, AttributeError, ValueError):
        pass
    for fd in opts.get("close_fds", ()):  # other clusters' rendezvous sockets: not ours to hold
        try:
            os.close(fd)
        except OSError:
            pass
    try:  # native messages (a C++ abort's reason) land in a file the parent reads if we die
        if opts.get("folder"):
            err = os.open(stderr_file(opts["folder"], rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                          0o600)
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
        taint_from_env()  # MINITRAIN_TAINT=1: the CPU test mode that finds device-less tensors
        if opts["backend"] == "nccl":
            # A collective that outlives the group's timeout is ended by NCCL's watchdog, which
            # ends this process (TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3 in torch >= 2.5; 1
            # would abort the communicator first, which can itself hang).  Its "Watchdog caught
            # collective operation timeout" stays in this rank's stderr file, from which the
            # parent reports a CollectiveTimeout, as for gloo (watch.died).
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore(opts["host"], opts["port"], world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=opts["timeout"]))
        dist.init_process_group(opts["backend"], store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=opts["timeout"]))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        send(("error", type(exc).__name__, str(exc), traceback.format_exc(), False, ()))
        os._exit(1)
    send(("ready", os.getpid()))
    task: dict = {"number": 0, "since": None}
    threading.Thread(target=heartbeat, args=(send, task), daemon=True,
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
            frames = frames_of(traceback.extract_tb(exc.__traceback__)[1:])  # below this loop
            send(("error", type(exc).__name__, str(exc), traceback.format_exc(), _is_timeout(exc),
                  frames, _plain_args(exc)))
            if not dist.is_initialized():
                break
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)
