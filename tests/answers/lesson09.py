"""Lesson 09: ring attention's online-softmax merge and the MoE all-to-all dispatch."""

import torch

from answers import Answers


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def naive_exp_merge(out_a, lse_a, out_b, lse_b):  # exp(lse) itself: inf in float32 at lse ~ 100
    sa, sb = torch.exp(lse_a), torch.exp(lse_b)
    s = sa + sb
    return (sa.unsqueeze(-1) * out_a + sb.unsqueeze(-1) * out_b) / s.unsqueeze(-1), torch.log(s)


def no_rescale(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def lse_as_max(out_a, lse_a, out_b, lse_b):
    return merge(out_a, lse_a, out_b, lse_b)[0], torch.maximum(lse_a, lse_b)


def exp_without_subtracting(out_a, lse_a, out_b, lse_b):
    """exp(lse_b) / exp(lse): NaN on fully masked rows (-inf - -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a + (torch.exp(lse_b) / torch.exp(lse))
            .unsqueeze(-1) * out_b * torch.exp(lse_b - lse_b).unsqueeze(-1)), lse


def only_the_output(out_a, lse_a, out_b, lse_b):
    return merge(out_a, lse_a, out_b, lse_b)[0]


def dispatch(output, input, output_splits, input_splits, comm):
    r, works = comm.rank, []
    ins, outs = input.split(input_splits), output.split(output_splits)
    for p in range(comm.size):
        if p != r:
            works.append(comm.isend(ins[p].contiguous(), p))
            works.append(comm.irecv(outs[p], p))
    outs[r].copy_(ins[r])
    for w in works:
        w.wait()
    return output


def splits_swapped(output, input, output_splits, input_splits, comm):
    return dispatch(output, input, input_splits, output_splits, comm)


def the_library_call(output, input, output_splits, input_splits, comm):
    torch.distributed.all_to_all_single(output, input, output_splits, input_splits, group=comm.group)
    return output


def blocking_sends(output, input, output_splits, input_splits, comm):  # every rank sends first
    r = comm.rank
    ins, outs = input.split(input_splits), output.split(output_splits)
    for p in range(comm.size):
        if p != r:
            comm.send(ins[p].contiguous(), p)
            comm.recv(outs[p], p)
    outs[r].copy_(ins[r])
    return output


def own_block_forgotten(output, input, output_splits, input_splits, comm):
    r, works = comm.rank, []
    ins, outs = input.split(input_splits), output.split(output_splits)
    for p in range(comm.size):
        if p != r:
            works.append(comm.isend(ins[p].contiguous(), p))
            works.append(comm.irecv(outs[p], p))
    for w in works:
        w.wait()
    return output  # its own rows never copied


def returns_nothing(output, input, output_splits, input_splits, comm):
    dispatch(output, input, output_splits, input_splits, comm)


ANSWERS = {
    "online_softmax_merge": Answers(merge, [
        (no_rescale, "exp(lse_a - lse)"),
        (lse_as_max, "logaddexp"),
        (exp_without_subtracting, "NaN"),
        (only_the_output, "(out, lse)"),
        (naive_exp_merge, "overflows float32"),
    ]),
    "all_to_all_dispatch": Answers(dispatch, [
        (splits_swapped, "not the other way round"),
        (the_library_call, "not dist.all_to_all_single"),
        (returns_nothing, "return output"),
        (blocking_sends, "your blocking_sends: comm.send(ins[p].contiguous(), p))"),
        (own_block_forgotten, "its own rows are wrong: copy input's block for rank 0 into output's "
                              "block for rank 0"),
    ]),
}


# -- moe_router(logits (G, S, E), k, capacity) -> (experts, gates, keep, aux_loss) -------------------


def router(logits, k, capacity):
    G, S, E = logits.shape
    probs = torch.softmax(logits.float(), -1)
    top, experts = probs.topk(k, -1)
    gates = top / top.sum(-1, keepdim=True)
    chosen = torch.nn.functional.one_hot(experts, E)                # (G, S, k, E)
    queue = chosen.transpose(1, 2).reshape(G, k * S, E)             # first choices first
    position = ((queue.cumsum(1) - 1) * queue).sum(-1).view(G, k, S).transpose(1, 2)
    keep = position < capacity if capacity is not None else torch.ones_like(position, dtype=torch.bool)
    f = chosen.sum((1, 2)).float() / (S * k)
    aux = (E * (f * probs.mean(1)).sum(-1)).mean()
    return experts, gates, keep, aux


def token_order_queue(logits, k, capacity):  # a token's second choice before later first choices
    experts, gates, _, aux = router(logits, k, capacity)
    G, S, E = logits.shape
    chosen = torch.nn.functional.one_hot(experts, E).reshape(G, S * k, E)
    position = ((chosen.cumsum(1) - 1) * chosen).sum(-1).view(G, S, k)
    keep = position < capacity if capacity is not None else torch.ones_like(position, dtype=torch.bool)
    return experts, gates, keep, aux


def raw_probabilities_as_gates(logits, k, capacity):
    experts, _, keep, aux = router(logits, k, capacity)
    return experts, torch.softmax(logits.float(), -1).gather(-1, experts), keep, aux


def aux_without_gradient(logits, k, capacity):
    experts, gates, keep, aux = router(logits.detach(), k, capacity)
    return experts, gates, keep, aux


def aux_over_all_groups(logits, k, capacity):
    experts, gates, keep, _ = router(logits, k, capacity)
    G, S, E = logits.shape
    probs = torch.softmax(logits.float(), -1)
    f = torch.nn.functional.one_hot(experts, E).sum((0, 1, 2)).float() / (G * S * k)
    return experts, gates, keep, E * (f * probs.mean((0, 1))).sum()


def capacity_ignored(logits, k, capacity):
    experts, gates, keep, aux = router(logits, k, None)
    return experts, gates, keep, aux


def capacity_counted_over_all_groups(logits, k, capacity):
    experts, gates, _, aux = router(logits, k, None)
    G, S, E = logits.shape
    queue = torch.nn.functional.one_hot(experts, E).transpose(1, 2).reshape(1, G * k * S, E)
    position = ((queue.cumsum(1) - 1) * queue).sum(-1).view(G, k, S).transpose(1, 2)
    keep = position < capacity if capacity is not None else torch.ones_like(position, dtype=torch.bool)
    return experts, gates, keep, aux


def gates_under_no_grad(logits, k, capacity):  # the gates made where autograd does not look
    experts, _, keep, aux = router(logits, k, capacity)
    with torch.no_grad():
        top = torch.softmax(logits.float(), -1).gather(-1, experts)
        gates = top / top.sum(-1, keepdim=True)
    return experts, gates, keep, aux


def gates_detached(logits, k, capacity):
    experts, gates, keep, aux = router(logits, k, capacity)
    return experts, gates.detach(), keep, aux


ANSWERS["moe_router"] = Answers(router, [
    (token_order_queue, "an expert's queue takes every token's first choice, in token order, before "
                        "any second choice"),
    (raw_probabilities_as_gates, "they are the chosen experts' probabilities renormalised"),
    (aux_without_gradient, "aux_loss carries no gradient to the logits"),
    (aux_over_all_groups, "that is the loss over all groups pooled together"),
    (capacity_ignored, "where its capacity is 4"),
    (capacity_counted_over_all_groups, "kept only"),
    (gates_under_no_grad, "the gates have the right values but carry no gradient to the router: "
                          "the gates do not require grad"),
    (gates_detached, "carry no gradient to the router"),
])
