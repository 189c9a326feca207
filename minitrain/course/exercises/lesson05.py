"""Lesson 05: the 1F1B order of one pipeline rank, and one stage's step with its messages — each
checked alone (the order against the validator, 1F1B's memory bound and makespan; the step on real
ranks against the unsplit model), then inside strategy ``pipeline`` (seams ``one_f_one_b`` and
``stage_step``) against one process, with the bytes each rank sent, the micro-batches in flight,
the activation peak and the bubble beside the lesson's formulas."""

from __future__ import annotations

import torch

from .core import exercise, raised, ranks


#: (P, M) the 1F1B checker tries: fewer, as many and more micro-batches than stages, an odd P, and
#: fewer micro-batches than a rank's P − rank − 1 warm-up forwards (P = 4, M = 2 and 1)
_PIPE_CASES = [(2, 1), (2, 4), (3, 2), (3, 3), (3, 5), (4, 4), (4, 7), (4, 2), (4, 1)]


#: inside strategy 'pipeline' (1F1B with your order): P ranks -> (M, batch)
_PIPE_RUNS = {2: (4, 8), 3: (6, 12)}


def _pipe_model():
    from ...model import GPTConfig
    return GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16)


def _one_f_one_b_table(fn, P: int, M: int):
    """The learner's rows as a table of Actions (stage = rank), or the sentence saying what is wrong."""
    import re

    from ...parallel.schedules import Action

    table = []
    for r in range(P):
        call = f"{getattr(fn, '__name__', 'your function')}({r}, {P}, {M})"
        try:
            row = fn(r, P, M)
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            return raised(call, exc, fn)
        if row is None:
            return f"{call} returned None: return a list of strings like ['F0', 'F1', 'B0', ...]"
        if isinstance(row, str) or not isinstance(row, (list, tuple)):
            return f"{call} returned {type(row).__name__}: return a list of strings like ['F0', 'B0']"
        actions = []
        for item in row:
            match = re.fullmatch(r"([FB])(-?\d+)", item.strip()) if isinstance(item, str) else None
            if match is None:
                return (f"{call}: {item!r} is not an action; write 'F3' for the forward of "
                        "micro-batch 3 and 'B3' for its backward")
            actions.append(Action(match.group(1), int(match.group(2)), r))
        outside = sorted({a.microbatch for a in actions if not 0 <= a.microbatch < M})
        if outside:
            shown = [f"{a.kind}{a.microbatch}" for a in actions]
            names = ", ".join(map(str, outside))
            message = (f"{call} returned {shown}: micro-batch{'es' if len(outside) > 1 else ''} "
                       f"{names} do{'' if len(outside) > 1 else 'es'} not exist — with M = {M} they "
                       f"are 0 to {M - 1}")
            forwards = [a.microbatch for a in actions if a.kind == "F"]
            first_b = next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))
            if first_b > M and P - r - 1 > M:
                message += (f"; it ran {first_b} forwards before its first backward, where rank "
                            f"{r}'s warm-up of P − rank − 1 = {P - r - 1} is more than the M = {M} "
                            "micro-batches there are: warm up with at most M forwards")
            elif len(forwards) != M:
                message += f"; it runs {len(forwards)} forwards, one per micro-batch would be {M}"
            return message
        table.append(actions)
    return table


@exercise("one_f_one_b",
          "a valid order for P = 2, 3, 4 with M below, equal to and above P, at most P − rank "
          "micro-batches in flight, as fast as 1F1B; strategy 'pipeline' with it trains like one "
          "process on 2 and 3 ranks")
def _check_one_f_one_b(fn) -> str | None:
    """Valid (the validator), 1F1B's memory bound, 1F1B's order or makespan, then run for real."""
    from ...planning.analysis import peak_in_flight
    from ...parallel.schedules import ScheduleError, orders, simulate, validate
    from .inside import inside

    for P, M in _PIPE_CASES:
        where = f"P={P}, M={M}"
        table = _one_f_one_b_table(fn, P, M)
        if isinstance(table, str):
            return table
        try:
            validate(table, P, M)
        except ScheduleError as exc:
            return f"{where}: {exc}  (the validator writes 'F3' of rank 1 as F3@s1: stage 1 = rank 1)"
        peaks = peak_in_flight(table)
        for r in range(P):
            bound = min(P - r, M)
            if peaks[r] > bound:
                gpipe = " — that is GPipe, which keeps all M in flight" if peaks[r] == M else ""
                return (f"{where}: rank {r} holds {peaks[r]} micro-batches' activations at once"
                        f"{gpipe}; 1F1B holds at most P − rank = {bound}: after {P - r - 1} warm-up "
                        "forwards, alternate one forward and one backward")
        reference = orders("1f1b", P, M)
        if table != reference:
            span = max(e["end"] for e in simulate(table))
            best = max(e["end"] for e in simulate(reference))
            if span > best:
                r = next(r for r in range(P) if table[r] != reference[r])
                return (f"{where}: valid, but it takes {span:g} time units where 1F1B takes "
                        f"{best:g} (F = 1, B = 2); rank {r} runs "
                        f"{[f'{a.kind}{a.microbatch}' for a in table[r]]}")
    for P, (M, batch) in _PIPE_RUNS.items():
        problem = inside("one_f_one_b", fn, _pipe_config(P, "1f1b", M, batch),
                         measure=_pipeline_rows)
        if problem:
            return problem
    return None


# --------------------------------------------------------------------------------------------------
# One stage's step: its forward or backward of one micro-batch, with its messages
# --------------------------------------------------------------------------------------------------


#: alone: P stages on P ranks run M micro-batches of a batch by 1F1B (uneven micro-batches)
_STEP_ALONE = {2: (3, 5), 3: (4, 6)}  # P -> (M, batch)
#: inside the real strategy: (world size, schedule, M, batch)
_STEP_RUNS = [(2, "gpipe", 4, 8), (3, "1f1b", 6, 12)]


def _step_model():
    from ...model import GPTConfig
    return GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8)


class _Wrong(Exception):
    """What a rank found wrong with the learner's stage_step: the sentence, and (as data, for
    :func:`_wrong_of`) ``wait`` — ``(rank, at action, waits for rank, its action)`` — or
    ``sender=True`` for the rank that found it never sent what its peer waits for."""

    def __init__(self, message: str, wait: tuple | None = None, sender: bool = False):
        super().__init__(message, wait, sender)

    def __str__(self) -> str:
        return self.args[0]


_HINTS = {
    "implicitly created only for scalar outputs":
        " — only the last stage's output is a number (the loss); elsewhere backpropagate the "
        "gradient the next stage sent: backward(inp)",
    "does not require grad and does not have a grad_fn":
        " — the output you saved has no graph: keep the output the stage computed in saved, and "
        "send a detached copy",
    "backward through the graph a second time":
        " — each micro-batch is backwarded once: take its tensors out of saved when you use them",
}


def _call(fn, what: str, *args):
    """The learner's stage_step(*args); an exception becomes a _Wrong naming their line."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        message = raised(what, exc, fn)
        message += next((hint for key, hint in _HINTS.items() if key in str(exc)), "")
        raise _Wrong(message) from None


def _reference(model, P: int, xs, ys, batch: int):
    """The unsplit model, stage by stage in one process: per micro-batch, what each stage must
    send (its output forward, the gradient of its input backward) and the loss; the parameters'
    gradients accumulate in ``model``."""
    from ...model import loss_fn
    from ...parallel.pipeline import PipelineStage

    stages = [PipelineStage(model, s, P) for s in range(P)]
    acts, grads, losses = {}, {}, []
    for m, (x, y) in enumerate(zip(xs, ys)):
        inputs, outs, h = {}, {}, x
        for s, stage in enumerate(stages):
            if s > 0:
                h = inputs[s] = h.detach().requires_grad_()
            h = outs[s] = stage(h)
            if s < P - 1:
                acts[(m, s)] = h.detach()
        loss = loss_fn(h, y) * (y.shape[0] / batch)
        losses.append(float(loss))
        loss.backward()
        for s in range(P - 1, 0, -1):  # the gradient of stage s's input flows into stage s - 1
            grads[(m, s)] = inputs[s].grad
            outs[s - 1].backward(inputs[s].grad)
    return acts, grads, losses


def _stage_step_alone(fn, timeout: float):
    """On each rank: stage ``rank`` of a tiny GPT runs 1F1B over M micro-batches with the learner's
    stage_step and real messages; what it sends, its loss and its gradients against the unsplit
    model.  A problem raises :class:`_Wrong` (a rank that waits for a message that never comes
    says so after the group's timeout)."""
    import torch.distributed as dist

    from ...comm import Comm
    from ...data import ArithmeticData
    from ...model import GPT, loss_fn
    from ...parallel.pipeline import PipelineStage
    from ...planning.analysis import peak_in_flight
    from ...parallel.schedules import Action, orders

    comm = Comm()
    r, P = comm.rank, comm.size
    M, batch = _STEP_ALONE[P]
    cfg = _step_model()
    x, y = ArithmeticData(cfg.seq_len, 0).batch(0, batch)
    xs, ys = torch.tensor_split(x, M), torch.tensor_split(y, M)
    reference = GPT(cfg, seed=0)
    acts, grads, want_losses = _reference(reference, P, xs, ys, batch)
    stage = PipelineStage(GPT(cfg, seed=0), r, P)
    name = getattr(fn, "__name__", "stage_step")
    table = orders("1f1b", P, M)
    saved, works, most = {}, [], 0

    def channel(grad: bool, m: int) -> int:
        return 1 + 2 * m + grad

    def receive(grad: bool, m: int, src: int, at: str) -> torch.Tensor:
        buf = torch.empty(xs[m].shape[0], cfg.seq_len, cfg.d_model, device=comm.device)
        work = comm.irecv(buf, src, tag="stage_step check", channel=channel(grad, m))
        try:
            work.wait()
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            what = (f"the gradient of its output for micro-batch {m} (stage {src}'s B{m})" if grad
                    else f"the activation of micro-batch {m} (stage {src}'s F{m})")
            why = ("after backpropagating, a stage sends the gradient of its input to the "
                   "previous stage" if grad else "after its forward, a stage sends its output to the "
                   "next stage")
            raise _Wrong(f"rank {r} waited {timeout:g} s in recv for {what} from rank {src}, "
                         f"which never sent it: {why} (send(...))",
                         wait=(r, at, src, ("B" if grad else "F") + str(m))) from None
        return buf

    for a in table[r]:
        m, sent = a.microbatch, []
        if a.kind == "F":
            inp = xs[m] if r == 0 else receive(False, m, r - 1, f"F{m}").requires_grad_()
            loss = lambda out, y=ys[m]: loss_fn(out, y) * (y.shape[0] / batch)  # noqa: E731
            out = _call(fn, f"rank {r}: your {name}(F{m} on stage {r}, …)", Action("F", m, r),
                        stage, inp, saved, sent.append, loss)
            if stage.last:
                _check_loss(m, out, want_losses[m])
            want = None if stage.last else acts[(m, r)]
        else:
            inp = None if stage.last else receive(True, m, r + 1, f"B{m}")
            _call(fn, f"rank {r}: your {name}(B{m} on stage {r}, …)", Action("B", m, r), stage,
                  inp, saved, sent.append, None)
            want = None if stage.first else grads[(m, r)]
        most = max(most, len(saved))
        t = _check_message(r, a.kind, m, sent, want, inp) if want is not None else None
        if t is not None:  # none sent: the peer waits for it, and says so after the timeout
            works.append(comm.isend(t, r + 1 if a.kind == "F" else r - 1, tag="stage_step check",
                                    channel=channel(a.kind == "B", m)))
    for work in works:
        work.wait()
    _check_after_step(r, stage, saved, most, peak_in_flight(table)[r], reference)
    dist.barrier(group=comm.group)
    return None


def _check_loss(m: int, out, want: float) -> None:
    """The last stage's F returns the micro-batch's share of the loss."""
    if out is None:
        raise _Wrong(f"F{m} on the last stage returned None: return the micro-batch's loss, "
                     "loss(out) of the stage's output")
    if not torch.is_tensor(out) or out.dim() != 0:
        shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise _Wrong(f"F{m} on the last stage returned {shape}, the stage's output, not its loss: "
                     "turn the output into the micro-batch's loss with loss(out) and return that")
    if abs(out.item() - want) > 1e-4 * abs(want):
        raise _Wrong(f"F{m} on the last stage returned {out.item():.6f}, not the micro-batch's "
                     f"loss {want:.6f}: return loss(out) of the stage's output")


def _check_message(r: int, kind: str, m: int, sent: list, want, inp):
    """What the learner passed to ``send`` in action ``kind``/``m`` on rank ``r``, against the
    unsplit model's ``want``: the tensor to send on, or None when nothing was sent."""
    what = "output" if kind == "F" else "input's gradient"
    if not sent:  # the peer would wait for it forever: say so now, from the rank that forgot
        peer = r + 1 if kind == "F" else r - 1
        awaited = (f"the activation of micro-batch {m} (stage {r}'s F{m})" if kind == "F" else
                   f"the gradient of its output for micro-batch {m} (stage {r}'s B{m})")
        why = ("after its forward, a stage sends its output to the next stage" if kind == "F" else
               "after backpropagating, a stage sends the gradient of its input to the previous "
               "stage")
        raise _Wrong(f"rank {peer} waits in recv for {awaited} from rank {r}, which never sent "
                     f"it: {why} (send(...))", sender=True)
    t = sent[0]
    if len(sent) > 1:
        raise _Wrong(f"rank {r}: {kind}{m} called send {len(sent)} times: send the {what} once")
    if not torch.is_tensor(t):
        raise _Wrong(f"rank {r}: {kind}{m} sent {type(t).__name__}, not a tensor: send the stage's "
                     f"{what}" + (" (x.grad is None when the input you saved is not the tensor "
                                  "the stage ran on)" if t is None else ""))
    if tuple(t.shape) != tuple(want.shape):
        raise _Wrong(f"rank {r}: {kind}{m} sent a tensor of shape {tuple(t.shape)}, expected "
                     f"{tuple(want.shape)}: the stage's {what}")
    if kind == "F" and t.requires_grad:
        raise _Wrong(f"rank {r}: F{m} sent its output still attached to this stage's autograd "
                     "graph: a message carries numbers, not a graph — send out.detach(), and keep "
                     "the output itself in saved for the backward")
    if torch.allclose(t.detach(), want, rtol=1e-4, atol=1e-6):
        return t.detach()
    if kind == "F":
        raise _Wrong(f"rank {r}: the activation F{m} sent differs from stage {r}'s output for "
                     "that micro-batch: send the stage's output")
    if inp is not None and torch.allclose(t.detach(), inp):
        raise _Wrong(f"rank {r}: B{m} sent back the gradient it received: send the gradient of "
                     "the stage's input (the tensor F got as inp)")
    raise _Wrong(f"rank {r}: the gradient B{m} sent back differs from dL/d(input) of stage {r}: "
                 "backpropagate from the gradient the next stage sent, backward(inp), and send "
                 "the input's .grad")


def _check_after_step(r: int, stage, saved: dict, most: int, bound: int, reference) -> None:
    """After the step: ``saved`` emptied, and the stage's gradients the unsplit model's."""
    if saved:
        raise _Wrong(f"rank {r}: after the step saved still holds {len(saved)} micro-batches' "
                     f"tensors (at most {most} at once) where 1F1B needs at most P − rank = "
                     f"{bound}: B must take its micro-batch's tensors out of saved (pop), or "
                     "every micro-batch's activations stay alive until the step ends")
    full = dict(reference.named_parameters())
    for pname, p in stage.named_parameters():
        ref = full[pname].grad
        if p.grad is None:
            raise _Wrong(f"rank {r}: {pname} got no gradient: each B must backpropagate through "
                         "the stage's saved output")
        if not torch.allclose(p.grad, ref, rtol=1e-4, atol=1e-6):
            ratio = (p.grad.norm() / ref.norm()).item() if ref.norm() > 0 else float("nan")
            raise _Wrong(f"rank {r}: the gradient of {pname} differs from the unsplit model's "
                         f"(its norm is {ratio:.2f}× the right one): each micro-batch's backward "
                         "must run once, starting from the gradient the next stage sent, "
                         "backward(inp) (the last stage's output is the loss itself)")


#: appended to a wait's sentence (and cut from what the learner reads): who waited where for what
def _wrong_of(exc) -> str | None:
    """The sentence of the rank that found the problem (a :class:`_Wrong`), if any.  When several
    ranks wait, the cause is a message its sender should already have sent — the sender got past
    that action (it waits somewhere later, or not at all) — not a wait that follows from another."""
    from ...parallel.schedules import orders

    found = [e.exc_args for e in [exc, *getattr(exc, "others", [])]
             if getattr(e, "exc_type", "") == _Wrong.__name__ and len(e.exc_args) == 3]
    for text, _, sender in found:
        if sender:
            return text
    waits = {w[0]: (w[1], w[2], w[3], text) for text, w, _ in found if w}
    if waits:
        P = max(max(waits), *(w[1] for w in waits.values())) + 1
        M = _STEP_ALONE[P][0] if P in _STEP_ALONE else 0
        table = orders("1f1b", P, M) if M else None
        for rank, (_, src, action, text) in sorted(waits.items()):
            row = [f"{a.kind}{a.microbatch}" for a in table[src]] if table else []
            past = src not in waits or (action in row and waits[src][0] in row
                                        and row.index(waits[src][0]) > row.index(action))
            if past:
                return text
    return found[0][0] if found else None


def _one_microbatch_activations(model, stage: int, P: int, batch: int, M: int) -> int:
    """Bytes autograd keeps for backward in one forward of stage ``stage`` on one micro-batch,
    measured the way the executor's meter does (one process, the package's stage)."""
    from ...data import ArithmeticData
    from ...memory import ActivationMeter
    from ...model import GPT, loss_fn
    from ...parallel.pipeline import PipelineStage

    part = PipelineStage(GPT(model, seed=0), stage, P)
    x, y = ArithmeticData(model.seq_len, 0).batch(0, batch)
    xs, ys = torch.tensor_split(x, M), torch.tensor_split(y, M)
    inp = xs[0] if stage == 0 else torch.zeros(len(xs[0]), model.seq_len, model.d_model,
                                               device="cpu", requires_grad=True)
    meter = ActivationMeter(part)
    with meter.measure():
        out = part(inp)
        if part.last:
            loss_fn(out, ys[0])
    return meter.last


def _pipeline_rows(summary, cfg, package) -> list:
    """Bytes each rank sent (tracer), micro-batches in flight (measured timeline), rank 0's
    activation peak (ledger) and the bubble, each beside the lesson's formula."""
    from .inside import Row

    P, steps, rep = cfg.world_size, summary.steps, summary.report[0]
    M, b, s, d = rep["microbatches"], cfg.batch_size, cfg.model.seq_len, cfg.model.d_model
    half = b * s * d * 4  # one direction of one boundary, per step: M micro-batches of b/M (fp32)
    rows = []
    for r in range(P):
        k = (r > 0) + (r < P - 1)  # boundaries rank r sends across: activations on, gradients back
        sent = summary.comm[r].get("send", {}).get("sent_bytes", 0.0) / steps
        rows.append(Row(f"sent per step, rank {r}", sent,
                        f"{k if k > 1 else ''}{'·' if k > 1 else ''}M·(b/M)·s·d·4", k * half))
    gpipe = rep["schedule"] == "gpipe"
    bound = [M if gpipe else min(P - r, M) for r in range(P)]
    for r in range(P):
        rows.append(Row(f"micro-batches in flight, rank {r}", rep["peak_in_flight"][r],
                        "M" if gpipe else "min(P − rank, M)", bound[r], unit=""))
    one = _one_microbatch_activations(cfg.model, 0, P, b, M)
    rows.append(Row("activation peak, rank 0 (ledger)",
                    summary.memory[0]["bytes"]["activations_peak"],
                    f"{bound[0]} × one micro-batch's {one:,} B", bound[0] * one))
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    crowded = f", {P} ranks on {cores} cores" if cores and P > cores else ""
    rows.append(Row(f"bubble (measured timeline{crowded})", rep["bubble_measured"], "(P−1)/(M+P−1)",
                    rep["bubble_formula"], unit="%"))
    return rows


def _pipe_config(P: int, schedule: str, M: int, batch: int):
    from ...strategies.base import TrainConfig
    return TrainConfig(strategy="pipeline", world_size=P, steps=3, batch_size=batch, seed=0,
                       model=_pipe_model(), options={"schedule": schedule, "microbatches": M})


@exercise("stage_step",
          "each stage sends what the unsplit model computes (activations on, gradients back), "
          "frees what it saved, and strategy 'pipeline' with it (GPipe on 2 ranks, 1F1B on 3) "
          "trains like one process")
def _check_stage_step(fn) -> str | None:
    from ...runtime.launch import RankError
    from .inside import inside, rank_trouble

    for P in _STEP_ALONE:
        cluster = ranks(P)
        where = f"alone, {P} stages on {P} ranks (1F1B, M = {_STEP_ALONE[P][0]})"
        try:
            cluster.run(_stage_step_alone, fn, cluster.timeout, timeout=60)
        except RankError as exc:
            wrong = _wrong_of(exc)
            return f"{where}: {wrong}" if wrong else rank_trouble(exc, fn, where)
        except TimeoutError:
            return f"{where} it did not finish within 60 s (a rank waiting for a message?)"
    for P, schedule, M, batch in _STEP_RUNS:
        problem = inside("stage_step", fn, _pipe_config(P, schedule, M, batch),
                         measure=_pipeline_rows)
        if problem:
            return problem
    return None
