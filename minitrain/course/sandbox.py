"""Running one untrusted command sealed off, for ``minitrain grade`` (Linux): bubblewrap's namespaces,
a cgroup for memory and for stopping every process, and resource limits.

A :class:`Box` runs one command:

* **bubblewrap** (``bwrap``, Debian's ``bubblewrap`` package): new user, pid, network (loopback
  only), IPC and UTS namespaces; the whole file system read-only; a private ``/tmp`` (a tmpfs of
  bounded size) the only writable folder; ``/home``, ``/root``, ``/run``, the submissions folder and
  the gradebook hidden, the Python installation and the package bound back read-only.  Run by root,
  the sandbox's processes are ``nobody`` (``setpriv``), so they cannot read root's files either.
  When the command's first process ends, the kernel stops every other process of its pid namespace,
  double-forked ``setsid`` daemons included (``--die-with-parent`` covers the grader dying).
* **a cgroup** (v1 or v2, where this process may make one): the memory limit (its OOM kills are
  reported), a cap on the number of processes, and a last sweep that kills whatever is left.
  Without one, the memory limit is ``RLIMIT_AS`` per process.
* **rlimits** (``prlimit``): a file-size cap, so no file the command writes grows without bound.

:func:`unavailable` says why a sandbox cannot be made here (no bubblewrap, no user namespaces, a
package ``nobody`` cannot read), or None.  ``Box(sealed=False)`` runs the command directly, in its
own session and (if one can be made) its own cgroup: for teachers who choose to grade unsealed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from . import probe

__all__ = ["Box", "unavailable", "INSIDE_TMP"]

NOBODY = 65534
INSIDE_TMP = "/tmp"  # the sandbox's only writable folder (a private tmpfs)
HIDDEN = ("/home", "/root", "/run", "/var/tmp", "/mnt", "/media", "/srv")
FILE_CAP = 128 << 20  # RLIMIT_FSIZE: the largest file a sandboxed process may write
MAX_PROCESSES = 1024  # tasks (threads count) in the box


# --------------------------------------------------------------------------------------------------
# cgroups: memory, process count, and killing what is left
# --------------------------------------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str, set]]:
    """(mount point, hierarchy root, fs type, super options) of every cgroup file system."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], fields[3], tail[0], set(tail[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" for v2."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path
    except (OSError, ValueError):
        pass
    return own


def _under(mount: str, root: str, path: str) -> Path | None:
    if not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    return Path(mount) / path[len(root):].lstrip("/")


class _Cgroup:
    """A cgroup for one box: ``procs`` are the files the box's first process writes its pid to."""

    def __init__(self, dirs: list[Path], v2: bool):
        self.dirs, self.v2 = dirs, v2
        self.procs = [str(d / "cgroup.procs") for d in dirs]

    @classmethod
    def make(cls, memory: int | None) -> "_Cgroup | None":
        """A new cgroup below this process's own, limited to ``memory`` bytes, or None where none
        can be made (no controller mounted, no permission, a v2 tree without delegation)."""
        own, mounts, name = _own_paths(), _mounts(), f"minitrain-grade-{os.getpid()}-{time.monotonic_ns()}"
        made: list[Path] = []
        try:
            v1 = {}
            for mount, root, kind, opts in mounts:
                for c in ("memory", "pids"):
                    if kind == "cgroup" and c in opts and c in own and c not in v1:
                        base = _under(mount, root, own[c])
                        if base is not None and os.access(base, os.W_OK):
                            v1[c] = base
            if "memory" in v1:
                for c, base in v1.items():
                    (base / name).mkdir()
                    made.append(base / name)
                mem = v1["memory"] / name
                if memory:
                    (mem / "memory.limit_in_bytes").write_text(str(memory))
                    try:  # no swapping past the limit
                        (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
                    except OSError:
                        pass
                if "pids" in v1:
                    (v1["pids"] / name / "pids.max").write_text(str(MAX_PROCESSES))
                return cls(made, v2=False)
            for mount, root, kind, _ in mounts:
                if kind == "cgroup2" and "" in own:
                    base = _under(mount, root, own[""])
                    if base is None or "memory" not in (base / "cgroup.subtree_control").read_text():
                        continue
                    (base / name).mkdir()
                    made.append(base / name)
                    if memory:
                        (base / name / "memory.max").write_text(str(memory))
                        (base / name / "memory.swap.max").write_text("0")
                    if "pids" in (base / "cgroup.subtree_control").read_text():
                        (base / name / "pids.max").write_text(str(MAX_PROCESSES))
                    return cls(made, v2=True)
        except OSError:
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:
                    pass
        return None

    def pids(self) -> set[int]:
        found = set()
        for p in self.procs:
            try:
                found |= {int(x) for x in Path(p).read_text().split()}
            except (OSError, ValueError):
                pass
        return found

    def oom_kills(self) -> int:
        """How many processes the memory limit killed (``oom_kill`` in v1's memory.oom_control,
        v2's memory.events; 0 where the kernel does not count them)."""
        d = self.dirs[0]
        try:
            text = (d / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self, within: float = 5.0) -> bool:
        """SIGKILL every process in the cgroup until none is left; True when none is."""
        if self.v2:
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + within
        while True:
            left = self.pids()
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)

    def remove(self, within: float = 10.0) -> None:
        """Remove the cgroup (killing what is still in it; a killed process takes a moment to
        leave, longer on a busy machine)."""
        deadline = time.monotonic() + within
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy
                    if time.monotonic() > deadline:
                        break
                    self.kill(within=0.1)
                    time.sleep(0.02)


# --------------------------------------------------------------------------------------------------
# bubblewrap
# --------------------------------------------------------------------------------------------------


def _needed() -> list[Path]:
    """What a sandboxed Python needs to read: the interpreter, the environment, the packages on
    its path (this package among them)."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix),
             Path(os.path.realpath(sys.executable)).parent.parent,
             Path(__file__).resolve().parents[1]}  # this package
    # the path a sandboxed ``python -I`` has (site-packages, what .pth files add), not this
    # process's script folder, working folder or PYTHONPATH
    own = {os.path.realpath(p) for p in [os.getcwd(), *(sys.path[:1] or []),
                                         *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if p}
    paths |= {Path(p) for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)
              and os.path.realpath(p) not in own}
    paths = {Path(os.path.realpath(p)) for p in paths if p != Path("/")}
    # a path inside another is bound with it
    return sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))


def _bwrap_args(hide: list[Path], tmp_size: int, sources: dict[Path, str]) -> list[str]:
    """bubblewrap's options: namespaces, a read-only root, a private /tmp, the hidden folders, and
    what Python needs (:func:`_needed`) bound back read-only, from ``sources[path]`` where given
    (run by root, the sandbox is nobody's, who may have no way in through root's folders: each is
    first bound onto a folder nobody can reach, see :meth:`Box.start`)."""
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL"]
    # bubblewrap mounts in order and a later mount covers an earlier one: shallow rules first, and
    # at the same depth a mask after a bind
    rules = _rules(hide)
    for path, kind in rules:
        if kind == "mask":
            args += ["--size", str(tmp_size), "--tmpfs", str(path)]
        else:
            args += ["--ro-bind", sources.get(path, str(path)), str(path)]
    for path, kind in rules:  # a hidden folder is empty and read-only; /tmp and /dev/shm writable
        if kind == "mask" and str(path) not in (INSIDE_TMP, "/dev/shm"):
            args += ["--remount-ro", str(path)]
    for p in hide:  # a hidden file (the gradebook) reads as empty, where it is still in view
        p = p.resolve()
        if p.is_file() and _in_view(p, rules):
            args += ["--ro-bind", "/dev/null", str(p)]
    return args


def _rules(hide: list[Path]) -> list[tuple[Path, str]]:
    """(path, "mask" | "bind") in the order bubblewrap applies them."""
    rules = {(Path(p), "mask") for p in HIDDEN if os.path.isdir(p)}
    rules |= {(Path(INSIDE_TMP), "mask"), (Path("/dev/shm"), "mask")}
    rules |= {(p.resolve(), "mask") for p in hide if p.is_dir()}
    rules |= {(p, "bind") for p in _needed()}
    return sorted(rules, key=lambda r: (len(r[0].parts), r[1] == "mask", str(r[0])))


def _kill_descendants(pid: int) -> None:
    """SIGKILL ``pid``'s descendants still in its process tree (unsealed, without a cgroup: a
    process that left the tree, a double-forked daemon, is out of reach)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, seen = [pid], []
    while todo:
        for child in children.get(todo.pop(), []):
            seen.append(child)
            todo.append(child)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _in_view(path: Path, rules: list[tuple[Path, str]]) -> bool:
    deepest = max((r for r in rules if r[0] == path or r[0] in path.parents),
                  key=lambda r: (len(r[0].parts), r[1] == "mask"), default=None)
    return deepest is None or deepest[1] == "bind"


def _options_pipe(options: list[str]):
    """(the read end of a pipe for bubblewrap's ``--args``, an unstarted thread that writes
    ``options`` into it, NUL-separated, and closes its write end).  A thread: a pipe may hold less
    than the options, and bubblewrap reads them only once it has started."""
    import threading

    data = b"".join(o.encode() + b"\0" for o in options)
    read, write = os.pipe()

    def feed():
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
        except OSError:  # the box ended without reading them
            pass
        finally:
            os.close(write)
    return read, threading.Thread(target=feed, name="minitrain-bwrap-args", daemon=True)


# the box's first process joins its cgroup (a cgroup.procs file per controller, up to "--"), then
# runs the rest: everything it starts is in the cgroup from the start
_JOIN = ('while [ "$#" -gt 0 ] && [ "$1" != -- ]; do echo $$ > "$1" || exit 97; shift; done; '
         'shift; exec "$@"')


@contextmanager
def _uninterrupted():
    """Ctrl-C (SIGINT) and SIGTERM wait until the block is done, then arrive (main thread only).

    The signals are held by a handler of our own, not blocked: a signal the main thread blocks goes
    to another thread (tqdm's monitor, say), and CPython then may not notice it for as long as the
    main thread runs alone (it was lost for a whole notebook once)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    wanted = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in wanted}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if held:
            handler = old[held[0]]
            if callable(handler):
                handler(held[0], None)  # Python's SIGINT handler raises KeyboardInterrupt here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), held[0])


def _reachable_by_all(path: str) -> bool:
    """Whether any user can reach into ``path``: it and every folder above it let others pass
    (o+x)."""
    import stat

    path = os.path.abspath(path)
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def _stage_parent() -> str:
    """Where root stages the folders the sandbox user (nobody) reads: the temporary folder
    (``TMPDIR``) where nobody can reach it, else the first of /tmp, /var/tmp and /dev/shm that
    anyone can.  A TMPDIR inside a private folder (0700) would hide the staging from nobody."""
    for parent in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(parent) and os.access(parent, os.W_OK) and _reachable_by_all(parent):
            return parent
    raise RuntimeError(f"no folder to stage the sandbox's files in that its user can reach: "
                       f"TMPDIR ({tempfile.gettempdir()}) or a folder above it is private, and "
                       "so are /tmp, /var/tmp and /dev/shm; point TMPDIR at a folder every user "
                       "can enter (chmod o+x on it and the folders above it)")


# run by root, in a mount namespace of its own: bind each folder Python needs onto a folder that
# nobody can reach (pairs of source and target, up to "--"), then run the rest
_STAGE = ('while [ "$#" -gt 0 ] && [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 98; shift 2; '
          'done; shift; exec "$@"')


class Box:
    """One command sealed off (see the module's docstring): ``start`` it, ``wait`` for it, ``close``.

    ``memory``: bytes for the box as a whole (None: unlimited); ``hide``: folders and files it must
    not see (the submissions, the gradebook)."""

    def __init__(self, *, sealed: bool = True, memory: int | None = None, hide=(),
                 as_pid_1: bool = False):
        self.sealed, self.memory, self.hide = sealed, memory, [Path(p) for p in hide]
        self.as_pid_1 = as_pid_1  # the command is its pid namespace's init (it reaps, and its
        # namespace's processes cannot signal it)
        self.proc: subprocess.Popen | None = None
        self.cgroup: _Cgroup | None = None
        self.host_tmp = None if sealed else tempfile.mkdtemp(prefix=f"minitrain-grade-{os.getpid()}-")
        self.tmp = INSIDE_TMP if sealed else self.host_tmp  # where the command may write
        self.timed_out = False
        self.stage: str | None = None  # run by root: where the folders Python needs are bound

    def start(self, argv: list[str], *, env: dict, stdin, stdout, pass_fds=()) -> None:
        """Start ``argv`` with ``env`` (sealed: all of it, nothing else is passed in), ``stdin`` (a
        file or PIPE), ``stdout`` (a file, for stdout and stderr) and the open ``pass_fds``."""
        limits = [f"--fsize={FILE_CAP}"]
        with _uninterrupted():  # a cgroup made is a cgroup that close() removes
            self.cgroup = _Cgroup.make(self.memory)
        if self.memory and self.cgroup is None:  # no cgroup: a limit per process
            limits.append(f"--as={self.memory}")
        prlimit = shutil.which("prlimit")
        cmd = [prlimit, *limits, "--"] if prlimit else []
        feed = None
        try:
            if self.sealed:
                sources = {}
                if os.geteuid() == 0:  # bind what Python needs onto folders nobody can reach
                    self.stage = tempfile.mkdtemp(prefix=f"minitrain-stage-{os.getpid()}-",
                                                  dir=_stage_parent())
                    os.chmod(self.stage, 0o755)
                    mounts = []
                    for n, path in enumerate(_needed()):
                        os.mkdir(sources.setdefault(path, os.path.join(self.stage, str(n))), 0o755)
                        mounts += [str(path), sources[path]]
                    cmd += ["unshare", "--mount", "--propagation", "private", "--",
                            "sh", "-c", _STAGE, "minitrain-stage", *mounts, "--",
                            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            "--inh-caps=-all", "--"]  # ... and the sandbox runs as nobody
                options = [*_bwrap_args(self.hide, self.memory or (4 << 30), sources),
                           *(["--as-pid-1"] if self.as_pid_1 else []), "--chdir", INSIDE_TMP,
                           "--clearenv"]
                for k, v in env.items():
                    options += ["--setenv", k, v]
                # bubblewrap reads its options from a pipe, not its command line: the box's pid 1
                # is bubblewrap's, and its command line would name the hidden folders (the
                # submissions) and the gradebook to every process in the box
                options_fd, feed = _options_pipe(options)
                pass_fds = [*pass_fds, options_fd]
                cmd += ["bwrap", "--args", str(options_fd), "--", *argv]
                outer_env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
            else:
                cmd += argv
                outer_env = env
            if self.cgroup is not None:
                cmd = ["sh", "-c", _JOIN, "minitrain-box", *self.cgroup.procs, "--", *cmd]
            try:
                self.proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout,
                                             stderr=subprocess.STDOUT,
                                             cwd="/" if self.sealed else self.tmp, env=outer_env,
                                             pass_fds=pass_fds, start_new_session=True)
            finally:
                if feed is not None:
                    os.close(options_fd)  # the box's copy is the one bubblewrap reads
                    feed.start()  # (and closes its end, also when the box never read it)
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when ``timeout`` seconds passed first (it is then stopped)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.stop()
            return None

    def memory_kills(self) -> int:
        """How many of its processes the memory limit killed so far."""
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def memory_hit(self) -> bool:
        return self.memory_kills() > 0

    def stop(self) -> None:
        """Stop the command and every process it started."""
        if self.proc is not None:
            if not self.sealed and self.cgroup is None:
                _kill_descendants(self.proc.pid)  # unsealed, no cgroup: what is still in its tree
            if self.proc.poll() is None:
                for kill in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
                    try:  # bwrap: its sandbox dies with it (the pid namespace ends)
                        kill()
                    except OSError:
                        pass
            self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.kill()

    def close(self) -> None:
        """Stop everything, remove the cgroup and the temporary folders (Ctrl-C waits for this)."""
        with _uninterrupted():
            self.stop()
            if self.cgroup is not None:
                self.cgroup.remove()
            for folder in (self.host_tmp, self.stage):
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# run by path in a sandbox: what a sandboxed Python must reach, and which minitrain it imports
_PROBE = str(Path(__file__).resolve().with_name("probe.py"))
_unavailable: list = []


def unavailable() -> str | None:
    """Why notebooks cannot be sealed off on this machine (with the fix), or None when they can.
    Tried once per process: a sandboxed Python imports the grader's packages."""
    if _unavailable:
        return _unavailable[0]
    reason = None
    if not sys.platform.startswith("linux"):
        reason = f"sealing notebooks off needs Linux (bubblewrap's namespaces); this is {sys.platform}"
    elif shutil.which("bwrap") is None:
        reason = "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    elif os.geteuid() == 0 and shutil.which("setpriv") is None:
        reason = "setpriv is missing (Debian/Ubuntu: apt-get install util-linux)"
    else:
        with tempfile.TemporaryFile() as log, Box(sealed=True) as box:
            env = {"PATH": "/usr/bin:/bin", "HOME": INSIDE_TMP, "LANG": "C.UTF-8"}
            box.start([sys.executable, "-I", _PROBE], env=env, stdin=subprocess.DEVNULL, stdout=log)
            code = box.wait(180)
            log.seek(0)
            text = log.read(100_000).decode(errors="replace").strip()
        found = [line[len(probe.MARK):] for line in text.splitlines()
                 if line.startswith(probe.MARK)]
        if found and (mismatch := _not_this_minitrain(found[0])):
            reason = mismatch
        elif code != 0:
            last = text.splitlines()[-1] if text else f"exit status {code}"
            reason = f"a sandboxed Python could not start ({last})"
            if "namespace" in text or "uid map" in text or "Operation not permitted" in text:
                reason += ("; this machine does not let users make namespaces: allow unprivileged "
                           "user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
                           "user.max_user_namespaces > 0)")
            elif os.geteuid() == 0 and ("ermission denied" in text or "PermissionError" in text):
                reason += (f"; run by root, the sandbox runs as nobody, who must be able to read "
                           f"the Python environment and the package: chmod -R a+rX {sys.prefix} "
                           f"{Path(sys.executable).resolve().parent.parent}")
    _unavailable.append(reason)
    return reason


def _not_this_minitrain(found: str) -> str | None:
    """Why the grader cannot run when a sandboxed ``python -I`` finds ``found`` ("no minitrain", or
    the real path of the ``minitrain/__init__.py`` it imports) rather than this package (the one
    running), with the fix; None when it finds this one.  The sandbox sees what the environment
    installed, not this process's working folder or PYTHONPATH: an editable install of another
    checkout (in a folder the sandbox hides, or not) would judge with that checkout's checkers."""
    here = Path(__file__).resolve().parents[1]
    if found != probe.NONE and Path(found).parent == here:
        return None
    checkout = here.parent
    installed = _installed_minitrain()
    where = (f"this Python environment's minitrain is {installed}, not this one ({here})"
             if installed and Path(installed) != here else
             f"this Python environment has no minitrain installed (this one, {here}, is imported "
             "from the working folder or PYTHONPATH, which the sandbox does not see)")
    if found == probe.NONE:
        what = "minitrain is not importable inside the sandbox"
        if installed and Path(installed) != here:
            what += " (an editable install of another checkout, in a folder the sandbox hides)"
    else:
        what = (f"inside the sandbox, minitrain is {Path(found).parent}, not the one running "
                f"({here}): notebooks would be judged by another copy's checkers")
    return f"{what}; {where}: install this checkout into it (pip install -e {checkout})"


def _installed_minitrain() -> str | None:
    """The folder of the minitrain this environment's ``python -I`` imports (outside any sandbox;
    it may be hidden inside one), or None."""
    try:
        done = subprocess.run([sys.executable, "-I", _PROBE, "--installed"], capture_output=True,
                              text=True, timeout=60, cwd="/")
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None
