"""The map of the techniques shown before lesson 02 comes from real steps of each strategy."""

from minitrain.viz.techniques import MAP, technique_rows, technique_table


def test_every_row_is_read_from_a_run(clusters):
    rows = technique_rows(clusters(4))
    assert [r["strategy"] for r in rows] == [m[0] for m in MAP]
    by = {r["strategy"]: r for r in rows}
    assert by["ddp"]["lesson"] == "02" and by["zero3"]["lesson"] == "04" and by["expert"]["lesson"] == "09"
    assert by["ddp"]["splits"] == "the batch over 4 replicas" and "all-reduce" in by["ddp"]["sends"]
    assert "the weights" in by["zero3"]["splits"] and "all-gather" in by["zero3"]["sends"]
    assert by["pipeline"]["splits"] == "the layers into 4 stages" and "send" in by["pipeline"]["sends"]
    assert "all-reduce" not in by["pipeline"]["sends"]  # one replica: no gradient all-reduce
    assert by["tensor"]["splits"].startswith("each layer's matrices over 4")
    table = technique_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert all(line.count(" | ") == 4 for line in table.splitlines()[2:])  # bars inside cells escaped
