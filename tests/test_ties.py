"""Naming a winner among projected times: a difference under PROJECTED_TIE is a tie, never a
winner (minitrain.planning.analysis)."""

from minitrain.planning.analysis import PROJECTED_TIE, order_with_ties, tied_with_best


def test_a_lone_winner_stands_out_and_near_equal_times_tie():
    assert tied_with_best({"a": 100.0, "b": 120.0, "c": 130.0}) == ["a"]
    tie = {"x": 382.31, "y": 382.29, "z": 400.0}
    assert tied_with_best(tie) == ["y", "x"]  # both named, the smaller first
    assert tied_with_best(tie, largest=True) == ["z"]
    edge = 100.0 * (1 + PROJECTED_TIE)
    assert tied_with_best({"a": 100.0, "b": edge * 1.001}) == ["a"]
    assert tied_with_best({"a": 100.0, "b": edge * 0.999}) == ["a", "b"]


def test_the_order_marks_ties_between_neighbours():
    times = {"2x2x2": 96.0, "8x1x1": 71.0, "2x1x4": 71.3, "2x4x1": 131.0}
    assert order_with_ties(times) == "8x1x1 ≈ 2x1x4 < 2x2x2 < 2x4x1"
    assert order_with_ties({"a": 1.0}) == "a" and order_with_ties({}) == ""
    assert order_with_ties({1: 2.0, 2: 1.0}, name=lambda k: f"#{k}") == "#2 < #1"
