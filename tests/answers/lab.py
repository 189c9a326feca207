"""Lesson 01b, the debugging lab: per broken program, the fix, the original broken program (the
learner's starting point) and plausible wrong fixes, each with a fragment of the check's message."""

import torch
import torch.distributed as dist

from answers import Answers

# -- 1. a skipped collective ------------------------------------------------------------------------


def mean_loss(loss):
    dist.all_reduce(loss)
    loss = loss / dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"mean loss {loss.item():.4f}")
    return loss


def mean_loss_broken(loss):
    if dist.get_rank() == 0:
        dist.all_reduce(loss)
        loss = loss / dist.get_world_size()
        print(f"mean loss {loss.item():.4f}")
    return loss


def mean_loss_nobody_reduces(loss):  # "fixed" by making every rank skip it
    if dist.get_rank() == 0:
        print(f"mean loss {loss.item():.4f}")
    return loss


def mean_loss_divides_on_rank_0(loss):
    dist.all_reduce(loss)
    if dist.get_rank() == 0:
        loss = loss / dist.get_world_size()
        print(f"mean loss {loss.item():.4f}")
    return loss


def mean_loss_reduce_to_0(loss):
    dist.reduce(loss, dst=0)
    loss = loss / dist.get_world_size()
    return loss


def mean_loss_divides_by_4(loss):  # the notebook's 4 ranks, written in
    dist.all_reduce(loss)
    return loss / 4


def mean_loss_drops_the_division(loss):  # the quotient is computed and thrown away
    dist.all_reduce(loss)
    loss / dist.get_world_size()
    return loss


# -- 2. send/send -----------------------------------------------------------------------------------


def pass_right(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.empty_like(mine)
    work = dist.isend(mine, right)
    dist.recv(theirs, left)
    work.wait()
    return theirs


def pass_right_broken(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.empty_like(mine)
    dist.send(mine, right)
    dist.recv(theirs, left)
    return theirs


def pass_right_receives_first(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.empty_like(mine)
    dist.recv(theirs, left)
    dist.send(mine, right)
    return theirs


def pass_right_the_wrong_way(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.empty_like(mine)
    work = dist.isend(mine, left)
    dist.recv(theirs, right)
    work.wait()
    return theirs


def pass_right_returns_its_own(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.empty_like(mine)
    work = dist.isend(mine, right)
    dist.recv(theirs, left)
    work.wait()
    return mine


def pass_right_sends_the_receive_buffer(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.zeros_like(mine)
    work = dist.isend(theirs, right)
    dist.recv(theirs, left)
    work.wait()
    return theirs


def pass_right_never_waits_for_the_receive(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    theirs = torch.zeros_like(mine)
    dist.irecv(theirs, left)
    work = dist.isend(mine, right)
    work.wait()
    return theirs


def pass_right_both_ways_to_the_right(mine):
    rank, size = dist.get_rank(), dist.get_world_size()
    right = (rank + 1) % size
    theirs = torch.empty_like(mine)
    sending = dist.isend(mine, right)
    receiving = dist.irecv(theirs, right)
    sending.wait()
    receiving.wait()
    return theirs


# -- 3. collectives in a different order on each rank -----------------------------------------------


def sum_stats(stats):
    for name in sorted(stats):
        dist.all_reduce(stats[name])
    return stats


def sum_stats_broken(stats):
    for name, value in stats.items():
        dist.all_reduce(value)
    return stats


def sum_stats_sorted_on_rank_0(stats):
    names = sorted(stats) if dist.get_rank() == 0 else list(stats)
    for name in names:
        dist.all_reduce(stats[name])
    return stats


def sum_stats_by_size(stats):  # ties (loss, tokens: one element each) keep each rank's order
    for name, value in sorted(stats.items(), key=lambda item: item[1].numel()):
        dist.all_reduce(value)
    return stats


def sum_stats_over_a_set(stats):  # a set's order: each process's string hashes
    for name in set(stats):
        dist.all_reduce(stats[name])
    return stats


# -- 4. a collective on the wrong group -------------------------------------------------------------


def tp_sum(partial, groups):
    dist.all_reduce(partial, group=groups[dist.get_rank() // 2])
    return partial


def tp_sum_broken(partial, groups):
    dist.all_reduce(partial, group=groups[dist.get_rank() % 2])
    return partial


def tp_sum_on_the_world(partial, groups):
    dist.all_reduce(partial)
    return partial


def tp_sum_first_group(partial, groups):
    dist.all_reduce(partial, group=groups[0])
    return partial


def tp_sum_broadcast(partial, groups):  # the right group, the wrong collective
    pair = dist.get_rank() // 2
    dist.broadcast(partial, src=2 * pair, group=groups[pair])
    return partial


def tp_sum_new_group(partial, groups):  # makes its pair's group itself, on the pair's ranks only
    rank = dist.get_rank()
    pair = dist.new_group([2 * (rank // 2), 2 * (rank // 2) + 1])
    dist.all_reduce(partial, group=pair)
    return partial


# -- 5. float16 overflow ----------------------------------------------------------------------------


def grad_norm(grad):
    squares = grad.float().pow(2).sum()
    dist.all_reduce(squares)
    return squares.sqrt().item()


def grad_norm_scaled(grad):  # the other fix: scale by the largest |value| first
    scale = grad.abs().max().float()
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    squares = (grad.float() / scale).pow(2).sum()
    dist.all_reduce(squares)
    return (squares.sqrt() * scale).item()


def grad_norm_broken(grad):
    squares = (grad * grad).sum()
    dist.all_reduce(squares)
    return squares.sqrt().item()


def grad_norm_casts_after_squaring(grad):
    squares = (grad * grad).float().sum()
    dist.all_reduce(squares)
    return squares.sqrt().item()


def grad_norm_adds_norms(grad):
    norm = grad.float().norm()
    dist.all_reduce(norm)
    return norm.item()


def grad_norm_reduces_in_half(grad):
    squares = grad.float().pow(2).sum().half()
    dist.all_reduce(squares)
    return squares.float().sqrt().item()


#: what tp_sum_new_group is told, wherever it is checked (tests/test_exercise_answers.py)
NEW_GROUP_SAYS = ("your tp_sum_new_group called dist.new_group inside the function (line 3 of your "
                  "tp_sum_new_group: pair = dist.new_group([2 * (rank // 2), 2 * (rank // 2) + "
                  "1])): rank 0 asked for ranks 0, 1; rank 1 asked for ranks 0, 1; rank 2 asked "
                  "for ranks 2, 3; rank 3 asked for ranks 2, 3")

ANSWERS = {
    "lab_skipped_collective": Answers(mean_loss, [
        (mean_loss_broken, "rank 0 waited in all_reduce (line 3 of your mean_loss_broken"),
        (mean_loss_nobody_reduces, "returned each its own loss (2, 2.375, 3, 3.875)"),
        (mean_loss_divides_on_rank_0, "every rank must divide the sum by the world size, not only rank 0"),
        (mean_loss_reduce_to_0, "a reduce leaves the sum on its destination (rank 0) only"),
        (mean_loss_divides_by_4, "the sum 7.375 divided by 4"),
        (mean_loss_drops_the_division, "none returned the sum divided by the world size"),
    ]),
    "lab_send_send": Answers(pass_right, [
        (pass_right_broken, "Every rank is in a blocking send"),
        (pass_right_receives_first, "Every rank is receiving and none is sending"),
        (pass_right_the_wrong_way, "rank 0 sent to rank 3; it should send to its right neighbour, rank 1"),
        (pass_right_returns_its_own, "returned its own tensor"),
        (pass_right_sends_the_receive_buffer, "not its own tensor"),
        (pass_right_never_waits_for_the_receive, "never waited for it"),
        (pass_right_both_ways_to_the_right, "Every rank waits on the handle of an asynchronous send or receive"),
    ]),
    "lab_mismatched_order": Answers(sum_stats, [
        (sum_stats_broken, "Your loop follows an order that differs from rank to rank"),
        (sum_stats_sorted_on_rank_0, "the order must not depend on anything that differs between processes"),
        (sum_stats_by_size, "The ranks all-reduced in different orders"),
        (sum_stats_over_a_set, "whose dicts all list the names in the same order"),
    ]),
    "lab_wrong_group": Answers(tp_sum, [
        (tp_sum_broken, "the launcher found a deadlock"),
        (tp_sum_on_the_world, "the sum over all 4 ranks (the whole world)"),
        (tp_sum_first_group, "which it is not a member of"),
        (tp_sum_broadcast, "a broadcast does not sum"),
        (tp_sum_new_group, NEW_GROUP_SAYS),
    ]),
    "lab_fp16_overflow": Answers(grad_norm, [
        (grad_norm_broken, "the all_reduce's float16 sum overflowed"),
        (grad_norm_casts_after_squaring, "convert to float32 before you square"),
        (grad_norm_adds_norms, "norms do not add"),
        (grad_norm_reduces_in_half, "the all_reduce's float16 sum overflowed"),
    ]),
}

def sum_stats_in_a_written_order(stats):  # one order, written out: right on every rank
    out = {}
    for name in ("histogram", "loss", "tokens"):
        dist.all_reduce(stats[name])
        out[name] = stats[name]
    return out


def mean_loss_even_ranks_print(loss):  # prints elsewhere too: the mean is what counts
    dist.all_reduce(loss)
    loss /= dist.get_world_size()
    if dist.get_rank() % 2 == 0:
        print(loss.item())
    return loss


#: fixes other than the one in the notebook that must pass too
ALSO_RIGHT = {"lab_fp16_overflow": [grad_norm_scaled],
              "lab_mismatched_order": [sum_stats_in_a_written_order],
              "lab_skipped_collective": [mean_loss_even_ranks_print]}
