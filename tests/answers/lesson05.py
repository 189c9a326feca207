"""Lesson 05: the 1F1B order of one rank, and one stage's step with its messages."""

from answers import Answers


# -- one_f_one_b(rank, stages, microbatches) ---------------------------------------------------------


def one_f_one_b(rank, stages, microbatches):
    warmup = min(stages - rank - 1, microbatches)
    actions = [f"F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    return actions + [f"B{m}" for m in range(microbatches - warmup, microbatches)]


def gpipe_order(rank, stages, microbatches):  # all forwards, then all backwards: M in flight
    return [f"F{m}" for m in range(microbatches)] + [f"B{m}" for m in range(microbatches)]


def no_warm_up(rank, stages, microbatches):  # valid and light, but the ranks wait on each other
    return [a for m in range(microbatches) for a in (f"F{m}", f"B{m}")]


def warm_up_one_too_many(rank, stages, microbatches):  # P − rank warm-up forwards: more memory
    warmup = min(stages - rank, microbatches)
    actions = [f"F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    return actions + [f"B{m}" for m in range(microbatches - warmup, microbatches)]


def warm_up_without_min(rank, stages, microbatches):  # P − rank − 1 warm-up forwards, even when M
    warmup = stages - rank - 1                           # is smaller: at P = 4, M = 2 rank 0 runs F2
    actions = [f"F{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    return actions + [f"B{m}" for m in range(microbatches - warmup, microbatches)]


def backwards_first(rank, stages, microbatches):  # a backward before its forward
    return one_f_one_b(rank, stages, microbatches)[::-1]


def returns_nothing(rank, stages, microbatches):  # builds the list, forgets to return it
    one_f_one_b(rank, stages, microbatches)


def words_not_actions(rank, stages, microbatches):
    return [f"forward {m}" for m in range(microbatches)]


def last_backward_missing(rank, stages, microbatches):
    return one_f_one_b(rank, stages, microbatches)[:-1]


# -- stage_step(action, stage, inp, saved, send, loss) -----------------------------------------------


def stage_step(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def gradient_not_sent_back(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward(inp)  # ... and the previous stage waits for x.grad forever
    return None


def output_never_sent(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        return out if stage.last else None  # ... and the next stage waits for it forever
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def output_sent_attached(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out)  # the graph goes along
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def detached_output_saved(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
            saved[key] = (inp, out)
            return out
        out = out.detach()  # detached once, then saved and sent: backward has no graph
        saved[key] = (inp, out)
        send(out)
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def backward_without_the_gradient(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward()  # the received gradient is not used
    if not stage.first:
        send(x.grad)
    return None


def backward_of_the_sum(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.sum().backward()  # runs, but as if every output's gradient were 1
    if not stage.first:
        send(x.grad)
    return None


def saved_never_popped(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved[key]  # read, never taken out
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def loss_forgotten(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        saved[key] = (inp, out)
        if stage.last:
            return out  # the logits, not the loss
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(x.grad)
    return None


def received_gradient_sent_back(action, stage, inp, saved, send, loss):
    key = (action.microbatch, action.stage)
    if action.kind == "F":
        out = stage(inp)
        if stage.last:
            out = loss(out)
        saved[key] = (inp, out)
        if stage.last:
            return out
        send(out.detach())
        return None
    x, out = saved.pop(key)
    out.backward(inp)
    if not stage.first:
        send(inp if inp is not None else x.grad)  # passes on what it got
    return None


ANSWERS = {
    "one_f_one_b": Answers(one_f_one_b, [
        (gpipe_order, "that is GPipe"),
        (no_warm_up, "time units where 1F1B takes"),
        (warm_up_one_too_many, "rank 0 holds 3 micro-batches' activations at once; 1F1B holds at "
                               "most P − rank = 2"),
        (warm_up_without_min, "warm_up_without_min(0, 4, 2) returned ['F0', 'F1', 'F2', 'B-1', 'B0', 'B1']: "
                              "micro-batches -1, 2 do not exist — with M = 2 they are 0 to 1; it ran "
                              "3 forwards before its first backward"),
        (backwards_first, "comes before"),
        (returns_nothing, "returned None"),
        (words_not_actions, "is not an action"),
        (last_backward_missing, "missing"),
    ]),
    "stage_step": Answers(stage_step, [
        (gradient_not_sent_back, "rank 0 waits in recv for the gradient of its output for "
                                 "micro-batch 0 (stage 1's B0) from rank 1, which never sent it"),
        (output_never_sent, "rank 1 waits in recv for the activation of micro-batch 0 "
                            "(stage 0's F0) from rank 0, which never sent it"),
        (output_sent_attached, "still attached to this stage's autograd graph"),
        (detached_output_saved, "the output you saved has no graph"),
        (backward_without_the_gradient, "backpropagate the gradient the next stage sent"),
        (backward_of_the_sum, "starting from the gradient the next stage sent"),
        (saved_never_popped, "saved still holds 3 micro-batches' tensors"),
        (loss_forgotten, "the stage's output, not its loss"),
        (received_gradient_sent_back, "sent back the gradient it received"),
    ]),
}
