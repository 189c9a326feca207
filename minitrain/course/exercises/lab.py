"""Lesson 01b, the debugging lab: five broken distributed programs (a skipped collective, send/send,
collectives in a different order on each rank, a collective on the wrong group, a float16
overflow).  The learner runs each on real ranks, reads the launcher's diagnosis, and fixes it; each
fix is checked here on running ranks, and a failure reads like the launcher's diagnosis (which rank
waited in what, at which line of the learner's program) plus what to change.

:func:`diagnosis` turns a rank failure into that text; lesson 01's ring checker uses it too.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch

from ...runtime.diagnostics import CollectiveTimeout, Deadlock
from .core import exercise, ranks
from .inside import inside, rank_error, state_line

# --------------------------------------------------------------------------------------------------
# The launcher's diagnosis, in the learner's terms
# --------------------------------------------------------------------------------------------------


def waits(exc: BaseException, fn) -> list[str]:
    """Where each rank was when a run failed, from the launcher's report (its ``where``): ``"rank 0
    waited in all_reduce (line 3 of your mean_loss: dist.all_reduce(loss))"``, ``"rank 1 returned"``."""
    return [state_line(state, fn, was=True)
            for _, state in sorted(getattr(exc, "where", {}).items())]


def diagnosis(exc: BaseException, fn, where: str) -> str:
    """What the launcher found, in one paragraph: a deadlock (who waits in what, who returned),
    a collective timeout (who waited how long for what), a collective mismatch (a rank aborted by
    the backend), or an exception (the error and the learner's line)."""
    from ...runtime.launch import CollectiveTimeout, Deadlock

    if isinstance(exc, Deadlock):
        return (f"{where} the launcher found a deadlock: " + "; ".join(waits(exc, fn)) +
                " — the waiting ranks wait for ranks that will never call it")
    if isinstance(exc, CollectiveTimeout):
        return (f"{where} nothing moved until the collective timeout ({exc.timeout_s:g} s): " +
                "; ".join(waits(exc, fn)))
    if getattr(exc, "signal", None) == 6:
        reason = exc.abort_reason or "the ranks called mismatched collectives"
        return f"{where} rank {exc.rank} was aborted by the backend (signal 6): {reason}"
    return f"{where} rank {getattr(exc, 'rank', '?')} raised {rank_error(exc, fn)}"


def _on_handle(state) -> bool:
    """The rank waits in an asynchronous handle's ``wait()`` (its own line says ``.wait(``), not in
    a blocking call."""
    fr = state.frame
    return state.op == "wait" or (fr is not None and ".wait(" in (fr.code or ""))


def _all_waiting(exc, n: int, test) -> bool:
    """No rank returned, at least ``n - 1`` were seen waiting (the one whose timeout fired first
    may be reported failed), and every waiting rank passes ``test``."""
    states = list(getattr(exc, "where", {}).values())
    waiting = [s for s in states if s.state == "waiting"]
    return (len(waiting) >= max(n - 1, 1) and not any(s.state == "returned" for s in states)
            and all(test(s) for s in waiting))


def all_wait_in(exc, op: str, n: int) -> bool:
    """True when the launcher saw the ranks blocked in ``op`` itself (e.g. every rank in a
    blocking send; a rank waiting on an isend's handle is not)."""
    from ...runtime.diagnostics import op_of

    return _all_waiting(exc, n, lambda s: (op_of(s.frames) or s.op) == op and not _on_handle(s))


def all_wait_on_handles(exc, n: int) -> bool:
    """True when the ranks wait in a handle's ``wait()`` (asynchronous sends and receives that
    never complete)."""
    return _all_waiting(exc, n, _on_handle)


HANDLES_ADVICE = ("Every rank waits on the handle of an asynchronous send or receive that never "
                  "completes: a message completes only when its peer posts the matching call — "
                  "a send to rank + 1 is received by rank + 1's receive from its left, rank - 1")


# --------------------------------------------------------------------------------------------------
# Running a program on the checkers' ranks: every rank gets its own input, every call is seen
# --------------------------------------------------------------------------------------------------


# Each input is made on ``device``: the rank's (group_device()) when a rank's program gets it, the
# CPU when the checker works out on the host what the ranks should have returned.


def _loss(rank: int, device) -> torch.Tensor:
    return torch.tensor([2.0 + 0.25 * rank + 0.125 * rank * rank], device=device)


def _block(rank: int, device) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32, device=device) + 100.0 * rank


_NAMES = ("loss", "tokens", "histogram")
_ORDERS = {  # the order in which each rank's dict lists its statistics (case "differ")
    0: ("loss", "tokens", "histogram"), 1: ("tokens", "histogram", "loss"),
    2: ("histogram", "tokens", "loss"), 3: ("tokens", "loss", "histogram")}
#: each rank's string hashes of the names: separate processes hash strings differently (a random
#: PYTHONHASHSEED each), so a set of the same names iterates in a different order on each; forked
#: ranks share one seed, so the check sets the hashes itself — the same every run.  A set of these
#: three names iterates in the order of their hashes (slots of an 8-slot table): on ranks 0 and 2
#: loss, tokens, histogram; on ranks 1 and 3 tokens, loss, histogram.
_HASHES = {0: {"loss": 1, "tokens": 2, "histogram": 3}, 1: {"tokens": 1, "loss": 2, "histogram": 3}}


class _Name(str):
    """A statistic's name whose hash is this rank's (:data:`_HASHES`); equal to the plain string."""

    def __new__(cls, text: str, h: int):
        obj = super().__new__(cls, text)
        obj._h = h
        return obj

    def __hash__(self) -> int:
        return self._h

    __eq__ = str.__eq__
    __ne__ = str.__ne__

    def __reduce__(self):
        return (str, (str(self),))  # leaves the rank as a plain string


class _Stats(dict):
    """A rank's statistics: name -> tensor, the names hashed as on this rank (:class:`_Name`);
    looked up by plain strings too."""

    def __init__(self, items, hashes: dict):
        self._hashes = hashes
        super().__init__((_Name(k, hashes[k]), v) for k, v in items)

    def _key(self, k):
        if isinstance(k, str) and not isinstance(k, _Name) and k in self._hashes:
            return _Name(k, self._hashes[k])
        return k

    def __getitem__(self, k):
        return super().__getitem__(self._key(k))

    def __setitem__(self, k, v):
        super().__setitem__(self._key(k), v)

    def __contains__(self, k):
        return super().__contains__(self._key(k))

    def get(self, k, default=None):
        return super().get(self._key(k), default)

    def pop(self, k, *default):
        return super().pop(self._key(k), *default)

    def __reduce__(self):
        return (dict, (dict(self),))


def _values(rank: int, device) -> dict:
    return {"loss": torch.tensor([2.5 + rank], device=device),
            "tokens": torch.tensor([1000.0 * (rank + 1)], device=device),
            "histogram": torch.arange(8, dtype=torch.float32, device=device) * 10 ** (rank % 3)
            + 7.0}


def _stats(rank: int, case: str, device) -> dict:
    values = _values(rank, device)
    order = _ORDERS[rank % 4] if case == "differ" else _ORDERS[0]
    return _Stats([(k, values[k]) for k in order], _HASHES[rank % 2])


def _shard(rank: int, case: str, device) -> torch.Tensor:
    """A rank's float16 gradient shard.  "fits": every square and every rank's sum of squares fit
    in float16, their total over the ranks does not; "spike": one element's square overflows.
    Drawn on the CPU (the same numbers on the host and in the rank), then moved to ``device``."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(256, generator=g, device="cpu")
    x = x / x.norm() * 180.0  # this shard's sum of squares: 32,400 (< 65,504)
    if case == "spike":
        x[7 * rank + 3] = 300.0  # 300² = 90,000 > 65,504
    return x.half().to(device)


_PAIRS: dict = {}


def pairs():
    """This rank's list of the tensor-parallel pairs' groups, ``groups[i]`` = ranks 2i and 2i+1
    (made once per process; every rank must make them, in the same order)."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), dist.get_world_size())
    if key not in _PAIRS:
        _PAIRS.clear()
        size = dist.get_world_size()
        _PAIRS[key] = [dist.new_group([i, i + 1]) for i in range(0, size - size % 2, 2)]
    return _PAIRS[key]


def _input(kind: str, rank: int, case: str, device):
    return {"skipped": lambda: _loss(rank, device), "sendsend": lambda: _block(rank, device),
            "order": lambda: _stats(rank, case, device),
            "group": lambda: torch.full((3,), 2.0 ** rank, device=device),
            "fp16": lambda: _shard(rank, case, device)}[kind]()


def _plain(x):
    if torch.is_tensor(x):
        return x.detach().double().tolist() if x.dim() else float(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def _observed(calls, x) -> list[dict]:
    """What a rank's program did, as plain data: each torch.distributed call (op, group, whether
    this rank is in it, its peer, what a send sent, whether an asynchronous one was waited for,
    which of the rank's statistics it carried)."""
    names = {v.data_ptr(): str(k) for k, v in x.items()} if isinstance(x, dict) else {}
    return [dict(op=c.op, function=c.function, group=list(c.group), member=c.member,
                 numel=c.numel, peer=c.peer, waited=c.waited, name=names.get(c.ptr),
                 sent=c.sent.double().tolist() if c.sent is not None else None)
            for c in calls if c.op != "barrier"]


#: the torch.distributed functions that make process groups
_GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration")


class _NoGroupMade(Exception):
    """A group the check cannot stand in for was asked for (it makes none)."""


def _group_count() -> int | None:
    """How many process groups this process has made (torch's own count), where torch says."""
    from torch.distributed import distributed_c10d

    return getattr(getattr(distributed_c10d, "_world", None), "group_count", None)


@contextlib.contextmanager
def _no_new_groups(made: list, groups):
    """While the block runs, a call of ``torch.distributed.new_group`` (or ``new_subgroups...``)
    makes no group: it is noted in ``made`` (which function, the ranks asked for, the caller's
    line) and answered with a group that exists — ``groups``' pair of those ranks, or the whole
    world — so that no rank waits in it and no check leaves a group behind for the next.  Other
    ranks lists raise :class:`_NoGroupMade`."""
    import linecache
    import sys

    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in _GROUP_MAKERS if hasattr(dist, name)}

    def stand_in(name):
        def call(*args, **kwargs):
            ranks = kwargs.get("ranks", args[0] if args and name == "new_group" else None)
            try:
                asked = sorted(int(r) for r in ranks) if ranks is not None else None
            except TypeError:
                asked = None
            frame = sys._getframe(1)
            code = frame.f_code
            made.append(dict(function=name, ranks=asked, caller=code.co_name,
                             line=frame.f_lineno - code.co_firstlineno + 1,
                             code=linecache.getline(code.co_filename, frame.f_lineno).strip()))
            world = list(range(dist.get_world_size()))
            if name == "new_group":
                for g in groups or ():
                    try:
                        if dist.get_process_group_ranks(g) == (asked or world):
                            return g
                    except (RuntimeError, ValueError, KeyError, AttributeError):
                        continue  # a pair this rank is not in
                if asked is None or asked == world:
                    return dist.group.WORLD
            raise _NoGroupMade(name)
        return call

    for name in saved:
        setattr(dist, name, stand_in(name))
    try:
        yield made
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _on_rank(kind: str, fn, case: str = "", quiet: bool = True, observe: bool = False):
    """On each rank: the learner's program on this rank's input; what it returned (plain values)
    and, with ``observe`` (a check), what it did (:func:`_observed`) and which groups it asked to
    make (:func:`_no_new_groups`: none is made).  ``quiet``: what the program prints, and torch's
    warnings, are dropped (a check cell prints only its verdict)."""
    import io
    import warnings

    import torch.distributed as dist

    from ...device import group_device
    from .guards import dist_calls

    x = _input(kind, dist.get_rank(), case, group_device())
    groups = pairs() if kind == "group" else None
    made: list = []
    count = _group_count()
    out = None
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
        calls = stack.enter_context(dist_calls()) if observe else []
        if observe:
            stack.enter_context(_no_new_groups(made, groups))
        try:
            out = fn(x, groups) if kind == "group" else fn(x)
        except _NoGroupMade:
            pass
    if observe and count is not None and _group_count() != count:
        made.append(dict(function="new_group", ranks=None, caller=None, line=None, code="",
                         real=True))  # through a name bound before the check replaced it
    return (_plain(out), _observed(calls, x), made) if observe else _plain(out)


class MadeGroups:
    """What :func:`_run` gives as the failure when the learner's program asked torch.distributed
    to make process groups: ``made`` (rank -> the calls :func:`_no_new_groups` noted)."""

    def __init__(self, kind: str, made: dict):
        self.kind, self.made = kind, made

    def words(self, fn, where: str) -> str:
        first = next(m for calls in self.made.values() for m in calls)
        name = getattr(fn, "__name__", "your function")
        line = (f" (line {first['line']} of your {first['caller']}: {first['code']})"
                if first["line"] is not None and first["code"] else "")
        asked = "; ".join(
            f"rank {r} asked for {_ranks(m['ranks'])}" if m["ranks"] is not None else
            f"rank {r} made a group" for r, calls in sorted(self.made.items()) for m in calls[:1])
        use = ("the pairs' groups are made already: pass groups[rank // 2]" if self.kind == "group"
               else "this program needs no group of its own: call the collective without one")
        real = any(m.get("real") for calls in self.made.values() for m in calls)
        done = ("Its ranks are started afresh for the next check" if real else
                "The check made none")
        return (f"{where}, your {name} called dist.{first['function']} inside the function{line}: "
                f"{asked}. Making a group is a collective over the whole world — every rank must "
                "call new_group for every group, with the same ranks, in the same order — so "
                "ranks that ask for different groups wait for each other, or get a group that "
                "depends on which groups this process made before; groups are made once, before "
                f"the program runs, not at every call. {done}; {use}")


def _run(kind: str, fn, n: int, case: str = ""):
    """(results by rank, what each rank did, None) or (None, None, the rank failure, or
    :class:`MadeGroups` when the program asked to make process groups)."""
    from ...runtime.launch import RankError
    from .core import discard

    try:
        out = ranks(n).run(_on_rank, kind, fn, case, True, True, timeout=60)
    except (RankError, TimeoutError) as exc:
        return None, None, exc
    made = {rank: m for rank, (_, _, m) in enumerate(out) if m}
    if made:
        if any(c.get("real") for m in made.values() for c in m):  # a group was made: fresh ranks
            discard(n)                                            # for the next check
        return None, None, MadeGroups(kind, made)
    return [r for r, _, _ in out], [c for _, c, _ in out], None


def _wrong(exc, fn, where: str, advice: str) -> str:
    if isinstance(exc, MadeGroups):
        return exc.words(fn, where)
    if isinstance(exc, TimeoutError):
        return f"{where} it did not finish within 60 s (a rank waiting for a message?)"
    return f"{diagnosis(exc, fn, where)}. {advice}" if advice else diagnosis(exc, fn, where)


def _num(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, list) and len(x) == 1 and isinstance(x[0], (int, float)):
        return float(x[0])
    return None


def _ranks(rs) -> str:
    rs = list(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _a(word: str) -> str:
    """``word`` with its article: ``an all_gather``, ``a reduce``."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _ops(calls: list) -> str:
    """The calls a rank made, in words: ``all_reduce on all 4 ranks``, ``reduce to rank 0``."""
    out = []
    for c in calls:
        peer = f" to rank {c['peer']}" if c["op"] in ("send", "reduce") and c["peer"] is not None \
            else f" from rank {c['peer']}" if c["op"] in ("recv", "broadcast") and \
            c["peer"] is not None else ""
        out.append(f"{c['function']}{peer}")
    return ", ".join(out) if out else "no torch.distributed call"


def _unwaited(calls: list) -> str:
    """`` — it started {op} asynchronously and never waited for its handle``, when it did."""
    c = next((c for c in calls if c["waited"] is False and c["op"] != "send"), None)
    if c is None:
        return ""
    return (f" — it started {c['function']} with async_op=True and never waited for its handle, so "
            "what it returned may be read before the sum arrived: call .wait() on it first")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(b), 1e-12)


# --------------------------------------------------------------------------------------------------
# 1. A skipped collective
# --------------------------------------------------------------------------------------------------

N = 4  # the programs run on 4 ranks in the notebook; the checks also try 3


def _loss_story(v: float, losses: list, rank: int) -> str:
    """What a returned loss is, in terms of the ranks' losses (observed, never guessed)."""
    total, n = sum(losses), len(losses)
    if _close(v, losses[rank]):
        return f"its own loss {v:g}"
    if _close(v, total):
        return f"the sum of the losses, {v:g}"
    for k in range(2, 9):
        if k != n and _close(v * k, total):
            return f"{v:g} = the sum {total:g} divided by {k}"
        if _close(v * k, losses[rank]):
            return f"{v:g} = its own loss {losses[rank]:g} divided by {k}"
    for q, other in enumerate(losses):
        if q != rank and _close(v, other):
            return f"rank {q}'s loss {v:g}"
    return f"{v:g}"


@exercise("lab_skipped_collective", "every rank calls the all_reduce and returns the mean loss "
          "on 4 and 3 ranks, and strategy 'ddp' with it reports the losses of one process")
def _check_skipped(fn) -> str | None:
    for n in (N, 3):
        found = _skipped_on(fn, n)
        if found:
            return found
    return _skipped_inside(fn)


def _skipped_on(fn, n: int) -> str | None:
    results, calls, exc = _run("skipped", fn, n)
    where = f"On {n} ranks"
    if exc is not None:
        return _wrong(exc, fn, where, "A collective completes only when every rank of its group "
                      "calls it: take the all_reduce (and the division) out of the `if`, so every "
                      "rank runs them; only the print is rank 0's job")
    losses = [_loss(r, "cpu").item() for r in range(n)]
    mean, total = sum(losses) / n, sum(losses)
    values = {}
    for rank, got in enumerate(results):
        value = _num(got)
        if value is None:
            return (f"{where}, rank {rank} returned {got!r}: return the mean loss (a one-element "
                    "tensor)")
        values[rank] = value
    wrong = [r for r, v in values.items() if not _close(v, mean)]
    if not wrong:
        return None
    right = [r for r in values if r not in wrong]
    r = wrong[0]
    stories = {q: _loss_story(values[q], losses, q) for q in wrong}
    kinds = {q: stories[q].split(" ")[:2] for q in wrong}
    said = f"{where}, no deadlock, but "
    if len(set(stories.values())) == 1:
        said += f"{_ranks(wrong)} returned {stories[r]}"
    elif all(k == ["its", "own"] for k in kinds.values()):
        said += (f"{_ranks(wrong)} returned each its own loss ("
                 + ", ".join(f"{values[q]:g}" for q in wrong) + ")")
    else:
        said += "; ".join(f"rank {q} returned {stories[q]}" for q in wrong)
    said += f" where the mean of the {n} losses is {mean:g}"
    if right:
        said += f" ({_ranks(right)} returned it)"
    if _unwaited(calls[r]):
        return said + _unwaited(calls[r])
    made = [c["op"] for c in calls[r]]
    if "all_reduce" not in made and "reduce" in made:
        dst = next(c["peer"] for c in calls[r] if c["op"] == "reduce")
        return (said + f": rank {r} called {_ops(calls[r])} — a reduce leaves the sum on its "
                f"destination{f' (rank {dst})' if dst is not None else ''} only, and the others "
                "keep a scratch value; all_reduce gives the sum to every rank")
    if "all_reduce" not in made and not any(c["op"] != "all_reduce" for c in calls[r]):
        return (said + f": rank {r} made no collective call, so it never saw the other ranks' "
                "losses — every rank must call the all_reduce")
    if any("divided by" in s for s in stories.values()):
        return (said + f": divide by the world size, {n} here (dist.get_world_size()), not by a "
                "number written in")
    if all(_close(values[q], total) for q in wrong):
        if right:
            return (said + f": every rank must divide the sum by the world size, not only "
                    f"{_ranks(right)}")
        return (said + ": every rank all-reduced, but none returned the sum divided by the world "
                "size — divide, and keep the result (`loss / n` alone makes a new tensor and "
                "drops it: `loss = loss / n`)")
    return said


def _skipped_inside(fn) -> str | None:
    """The fix in its place: strategy 'ddp' reports each step's loss as the mean over the ranks
    with it (its ``mean_loss`` seam), on 3 ranks."""
    from ...model import GPTConfig
    from ...strategies import TrainConfig

    model = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=10)  # a small GPT: seconds
    cfg = TrainConfig(strategy="ddp", world_size=3, steps=4, batch_size=6, model=model)
    return inside("lab_skipped_collective", fn, cfg, seam="mean_loss")


# --------------------------------------------------------------------------------------------------
# 2. send/send
# --------------------------------------------------------------------------------------------------


def _whose(values, blocks: list) -> int | None:
    return blocks.index(values) if values in blocks else None


@exercise("lab_send_send", "every rank gets its left neighbour's tensor on 4 ranks, without a "
          "deadlock")
def _check_send_send(fn) -> str | None:
    results, calls, exc = _run("sendsend", fn, N)
    where = f"On {N} ranks"
    if exc is not None:
        if all_wait_in(exc, "send", N):
            advice = ("Every rank is in a blocking send, and a blocking send returns only once "
                      "its peer has received — but every peer is sending too. Start the send "
                      "without waiting (dist.isend, then .wait() after the recv), or let the even "
                      "ranks send first while the odd ones receive first")
        elif all_wait_in(exc, "recv", N):
            advice = ("Every rank is receiving and none is sending: receiving first on every "
                      "rank is the same deadlock the other way round. Start the send without "
                      "waiting for it (dist.isend), then receive")
        elif all_wait_on_handles(exc, N):
            advice = HANDLES_ADVICE
        elif isinstance(exc, (CollectiveTimeout, Deadlock)):
            advice = ("Each send needs the matching recv on its peer, posted so that someone "
                      "can always make progress")
        else:
            advice = ""
        return _wrong(exc, fn, where, advice)
    blocks = [_block(r, "cpu").tolist() for r in range(N)]
    for rank, got in enumerate(results):
        left, right = (rank - 1) % N, (rank + 1) % N
        sends = [c for c in calls[rank] if c["op"] == "send"]
        recvs = [c for c in calls[rank] if c["op"] == "recv"]
        for c in sends:
            if c["peer"] is not None and c["peer"] != right:
                return (f"{where}, rank {rank} sent to rank {c['peer']}; it should send to its "
                        f"right neighbour, rank {right}, and receive from its left one, rank "
                        f"{left} (mod the world size)")
            if c["sent"] is not None and c["sent"] != blocks[rank]:
                who = _whose(c["sent"], blocks)
                what = f"rank {who}'s tensor" if who is not None else \
                    f"{[round(v, 3) for v in c['sent'][:4]]}"
                return (f"{where}, rank {rank} sent {what} to rank {c['peer']}, not its own "
                        f"tensor {blocks[rank]}: send the tensor pass_right was given (`mine`), "
                        "not the one it receives into")
        if got == blocks[left]:
            continue
        if not sends:
            return (f"{where}, rank {rank} sent nothing ({_ops(calls[rank])}): every rank sends "
                    f"its tensor to rank + 1")
        for c in recvs:
            if c["peer"] is not None and c["peer"] != left:
                return (f"{where}, rank {rank} received from rank {c['peer']} and returned "
                        f"{'rank ' + str(_whose(got, blocks)) + chr(39) + 's tensor' if _whose(got, blocks) is not None else got}; "
                        f"it should get its left neighbour's, rank {left}'s: send to rank + 1 "
                        "and receive from rank - 1 (mod the world size)")
        if got == blocks[rank]:
            return (f"{where}, rank {rank} returned its own tensor, not the one it received: "
                    f"return the tensor your recv filled (rank {left}'s, its left neighbour's)")
        who = _whose(got, blocks)
        if who is not None:
            return (f"{where}, rank {rank} returned rank {who}'s tensor; it should get its left "
                    f"neighbour's, rank {left}'s: send to rank + 1 and receive from rank - 1 "
                    "(mod the world size)")
        unwaited = [c for c in recvs if c["waited"] is False]
        if unwaited:
            return (f"{where}, rank {rank} returned {got!r}, which is no rank's tensor: it "
                    f"called {unwaited[0]['function']} and never waited for it — irecv returns at "
                    "once; wait() on its handle before you return what it fills")
        return (f"{where}, rank {rank} returned {got!r}, which is no rank's tensor (rank {left}'s "
                f"is {blocks[left]}); it called {_ops(calls[rank])}")
    return None


# --------------------------------------------------------------------------------------------------
# 3. Collectives in a different order on each rank
# --------------------------------------------------------------------------------------------------


def _explain_sum(rank: int, name: str, value: float, case: str) -> str:
    """Which ranks' entries ``value`` (rank's wrong ``name``) is the sum of, if we can tell."""
    options = [[(q, k, _values(q, "cpu")[k].view(-1)[0].item()) for k in _NAMES]
               for q in range(N)]
    for combo in itertools.product(*options):
        if abs(sum(v for _, _, v in combo) - value) < 1e-3:
            return " + ".join(f"rank {q}'s '{k}'" for q, k, _ in combo)
    return ""


def _orders(calls: list) -> dict:
    """Per rank, the statistics it all-reduced, in the order it did."""
    return {r: [c["name"] or f"a tensor of {c['numel']}" for c in cs if c["op"] == "all_reduce"]
            for r, cs in enumerate(calls)}


@exercise("lab_mismatched_order", "every rank reduces the statistics in the same order, whatever "
          "order its dict lists them in and however its process hashes strings (4 ranks)")
def _check_order(fn) -> str | None:
    for case in ("same", "differ"):
        results, calls, exc = _run("order", fn, N, case)
        if case == "same":
            where = (f"On {N} ranks whose dicts all list the names in the same order "
                     f"({', '.join(_ORDERS[0])})")
            advice = ("Even with the same dicts, the ranks reduced the entries in different "
                      "orders: the order must not depend on anything that differs between "
                      "processes — not on the rank, nor on a set's iteration order (it follows "
                      "each process's string hashes, which differ between processes) — e.g. "
                      "sorted(stats) everywhere")
        else:
            orders = "; ".join(f"rank {r}: {', '.join(_ORDERS[r])}" for r in range(N))
            where = f"On {N} ranks whose dicts list the names in different orders ({orders})"
            advice = ("Your loop follows an order that differs from rank to rank, so the ranks "
                      "reduce different entries at the same time. Reduce them in one order every "
                      "rank agrees on, e.g. sorted by name")
        if exc is not None:
            return _wrong(exc, fn, where, advice)
        seen = _orders(calls)
        differ = len({tuple(o) for o in seen.values()}) > 1
        for rank, got in enumerate(results):
            if not isinstance(got, dict) or sorted(got) != sorted(_NAMES):
                return (f"{where}: rank {rank} returned {type(got).__name__}: return the dict of "
                        "statistics, each summed over the ranks")
            for name in _NAMES:
                want = sum(_values(q, "cpu")[name] for q in range(N)).tolist()
                have = got[name] if isinstance(got[name], list) else [got[name]]
                if len(have) == len(want) and all(abs(a - b) < 1e-3 for a, b in zip(have, want)):
                    continue
                mix = _explain_sum(rank, name, have[0], case) if len(have) == 1 else ""
                text = (f"{where}, nothing failed but rank {rank}'s '{name}' is {have[:3]}, not the "
                        f"sum over the ranks {want[:3]}" + (f": it is {mix}" if mix else ""))
                if differ:
                    shown = "; ".join(f"rank {r}: {', '.join(o)}" for r, o in seen.items())
                    text += (f". The ranks all-reduced in different orders ({shown}), and the "
                             "k-th collective of one rank meets the k-th of the others "
                             "(same shapes, so the backend could not notice). " + advice)
                else:
                    text += ". Every rank must all-reduce every entry once, in one order"
                return text
    return None


# --------------------------------------------------------------------------------------------------
# 4. A collective on the wrong group
# --------------------------------------------------------------------------------------------------


def _ranks_in(value: float) -> list[int]:
    k = int(round(value))
    return [r for r in range(N) if k >> r & 1] if abs(value - k) < 1e-6 else []


@exercise("lab_wrong_group", "every rank sums its partial result over its own tensor-parallel pair "
          "(4 ranks, pairs 0-1 and 2-3)")
def _check_group(fn) -> str | None:
    results, calls, exc = _run("group", fn, N)
    where = f"On {N} ranks in pairs (groups[0] = ranks 0 and 1, groups[1] = ranks 2 and 3)"
    if exc is not None:
        return _wrong(exc, fn, where, "A rank that calls a collective on a group it is not a "
                      "member of skips it (torch only warns), so its partner waits alone. Rank r "
                      "belongs to pair r // 2: pass groups[rank // 2]")
    for rank, got in enumerate(results):
        mine = [2 * (rank // 2), 2 * (rank // 2) + 1]
        value = got[0] if isinstance(got, list) and got and isinstance(got[0], (int, float)) \
            else _num(got)
        if not isinstance(value, (int, float)):
            return f"rank {rank} returned {got!r}: return the partial result summed over the pair"
        have = _ranks_in(value)
        if have == mine:
            continue
        named = (f"only its own partial back" if have == [rank] else
                 f"the sum over all {N} ranks (the whole world)" if have == list(range(N)) else
                 f"the partials of ranks {have}" if have else f"{value:g}")
        said = (f"{where}: rank {rank} got {named}, not the sum over its pair, ranks {mine[0]} and "
                f"{mine[1]}")
        made = calls[rank]
        if not made:
            return said + ": it made no torch.distributed call — all-reduce over groups[rank // 2]"
        if _unwaited(made):
            return said + _unwaited(made)
        outside = [c for c in made if not c["member"]]
        if outside:
            c = outside[0]
            return (said + f": it called {c['function']} on group {c['group']}, which it is not a "
                    "member of, and torch skips a collective on such a group with only a "
                    "warning. Rank r belongs to pair r // 2: pass groups[rank // 2]")
        c = made[0]
        if c["group"] == list(range(N)) and c["op"] == "all_reduce":
            return said + (f": it called all_reduce on the whole world (no group): pass the "
                           f"pair's group, groups[rank // 2]")
        if c["op"] != "all_reduce":
            return said + (f": it called {_ops(made)} on group {c['group']} — {_a(c['op'])} does "
                           "not sum the pair's partials into every rank; all_reduce does")
        return said + f": it called {_ops(made)} on group {c['group']}"
    return None


# --------------------------------------------------------------------------------------------------
# 5. Float16 overflow
# --------------------------------------------------------------------------------------------------

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@exercise("lab_fp16_overflow", "the global gradient norm of float16 shards is finite and right on 4 "
          "ranks, also when the squares' sum (or one square) exceeds float16's 65,504")
def _check_fp16(fn) -> str | None:
    for case in ("fits", "spike"):
        results, _, exc = _run("fp16", fn, N, case)
        where = f"On {N} ranks"
        if exc is not None:
            return _wrong(exc, fn, where, "")
        shards = [_shard(r, case, "cpu").double() for r in range(N)]
        squares = [float((s * s).sum()) for s in shards]
        norm = math.sqrt(sum(squares))
        biggest = max(float(s.abs().max()) for s in shards)
        for rank, got in enumerate(results):
            value = _num(got)
            if value is None:
                return f"rank {rank} returned {got!r}: return the norm as a float"
            if math.isfinite(value) and abs(value - norm) <= 2e-3 * norm:
                continue
            if not math.isfinite(value):
                if case == "fits":
                    return (f"rank {rank} returned {value}: every shard's sum of squares fits in "
                            f"float16 ({max(squares):,.0f} at most), but their sum over the ranks, "
                            f"{sum(squares):,.0f}, is above float16's largest value, "
                            f"{FP16_MAX:,.0f} — so the all_reduce's float16 sum overflowed. Square, "
                            "sum and all-reduce in float32 (grad.float()), or scale the values "
                            "down first")
                return (f"rank {rank} returned {value}: one element is {biggest:g}, and its square, "
                        f"{biggest * biggest:,.0f}, overflows float16 (largest {FP16_MAX:,.0f}) "
                        "before any sum — convert to float32 before you square, not after")
            local = sum(math.sqrt(q) for q in squares)
            if abs(value - local) <= 2e-3 * local:
                return (f"rank {rank} returned {value:,.1f}, the sum of the ranks' own norms; the "
                        f"norm of the whole gradient is {norm:,.1f}: norms do not add, their "
                        "squares do — all-reduce the sums of squares, then take the root")
            return f"rank {rank} returned {value:,.2f}, the norm of the whole gradient is {norm:,.2f}"
    return None


# --------------------------------------------------------------------------------------------------
# In the notebook: run a program on a Cluster and show what came back, or the diagnosis
# --------------------------------------------------------------------------------------------------

_KINDS = {"lab_skipped_collective": "skipped", "lab_send_send": "sendsend",
          "lab_mismatched_order": "order", "lab_wrong_group": "group", "lab_fp16_overflow": "fp16"}


def run_program(cluster, name: str, fn, case: str = "") -> list | None:
    """Run the lab program ``fn`` of exercise ``name`` on ``cluster`` (every rank with its own
    input, as the check does) and print what each rank returned — or, when the run fails, the
    launcher's error (a :class:`~minitrain.runtime.launch.RankError`), without the ranks' stacks.  Never
    raises for a rank's failure; returns the results or None."""
    from ...runtime.launch import RankError

    kind = _KINDS[name]
    case = case or {"order": "differ", "fp16": "fits"}.get(kind, "")
    try:
        results = cluster.run(_on_rank, kind, fn, case, False, False, timeout=60)
    except RankError as err:
        print(f"{type(err).__name__}: {short(err)}")
        return None
    for rank, got in enumerate(results):
        print(f"rank {rank} returned {got}")
    return results


def short(err: BaseException) -> str:
    """The launcher's error without the ranks' stacks and tracebacks (what to read first)."""
    from ...runtime.diagnostics import RankError, format_error

    return format_error(err, details=False) if isinstance(err, RankError) else str(err)
