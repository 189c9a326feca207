"""A projected step time carries its uncertainty: the spread of published runs against their
projections (benchmarks/projection_bench.py (b), written to minitrain/planning/data/), read back
as a band, turned into ranges on a projection, drawn by the widget, and shipped with the package."""

import fnmatch
import json
from dataclasses import replace
from pathlib import Path

import pytest

from minitrain import train
from minitrain.planning import projection as projection_module
from minitrain.planning.projection import BAND_COMMAND, BAND_FILE, project, published_band
from minitrain.viz.projection import projection_figure, projection_view, uncertainty

ROOT = Path(__file__).resolve().parents[1]


def fake_band(path: Path, ratios, groups) -> Path:
    """A band file as projection_bench.py --write lays it out, for the given ratios."""
    rows = [{"key": f"row{i}", "independent_group": g, "gpus": 8, "stack": "flash", "ratio": r}
            for i, (r, g) in enumerate(zip(ratios, groups))]
    ordered = sorted(ratios)
    summary = {"rows": len(rows), "groups": len(set(groups)),
               "median_ratio": ordered[len(ordered) // 2], "min_ratio": min(ratios),
               "max_ratio": max(ratios),
               "median_abs_error": sorted(abs(r - 1) for r in ratios)[len(ratios) // 2],
               "failed": [], "date": "2000-01-01", "torch": "0", "command": "test"}
    path.write_text(json.dumps({"rows": rows, "summary": summary}))
    return path


@pytest.fixture(scope="module")
def run(clusters):
    return train(strategy="ddp", world_size=2, steps=3, batch_size=8, cluster=clusters(2),
                 record_events=True)


# --------------------------------------------------------------------------------------------------
# The committed file and the band read from it
# --------------------------------------------------------------------------------------------------


def test_the_band_file_holds_the_published_check():
    doc = json.loads(BAND_FILE.read_text())
    rows, summary = doc["rows"], doc["summary"]
    assert len(rows) >= 10 and summary["rows"] == len(rows)
    ratios = [r["ratio"] for r in rows]
    assert all(r > 0 for r in ratios)
    assert summary["groups"] == len({r["independent_group"] for r in rows}) >= 2
    assert summary["min_ratio"] == min(ratios) and summary["max_ratio"] == max(ratios)
    assert "projection_bench.py" in summary["command"] and "--write" in summary["command"]


def test_the_band_reports_the_files_spread():
    band = published_band()
    ratios = [r["ratio"] for r in json.loads(BAND_FILE.read_text())["rows"]]
    assert 0 < band.low <= band.median <= band.high
    assert (band.low, band.high) == (min(ratios), max(ratios))
    assert band.rows == len(ratios) >= 10 and band.median_error >= 0
    assert f"{band.rows} published runs from {band.groups} independent groups" in band.source
    assert published_band() is band  # read once


def test_a_missing_band_file_names_the_command_that_makes_it(tmp_path, monkeypatch, run):
    monkeypatch.setattr(projection_module, "BAND_FILE", tmp_path / "published_check.json")
    with pytest.raises(FileNotFoundError, match="published_check.json") as err:
        published_band()
    assert BAND_COMMAND in str(err.value) and "--only b --write" in BAND_COMMAND
    p = project(run, "dgx-h100", "1.3b")
    with pytest.raises(FileNotFoundError, match="--only b --write"):
        p.step_time_range_s


def test_the_benchmarks_writer_is_what_the_band_reads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import projection_bench

    table = [{"key": k, "independent_group": g, "gpus": 64, "stack": "flash", "ratio": r}
             for k, g, r in (("a", "A", 0.9), ("b", "A", 1.3), ("c", "B", 1.05))]
    path = tmp_path / "data" / "band.json"
    projection_bench.write_band(table, [("d", "boom")], "python x --write", path=str(path))
    monkeypatch.setattr(projection_module, "BAND_FILE", path)
    band = published_band()
    assert (band.low, band.high, band.median, band.rows, band.groups) == (0.9, 1.3, 1.05, 3, 2)
    assert band.median_error == pytest.approx(0.1)
    assert json.loads(path.read_text())["summary"]["failed"] == ["d"]


def test_the_band_file_ships_with_the_package():
    """pyproject's package data names the file, so a non-editable install has it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config.get("package-data", {}).get("minitrain.planning", [])
    inside = BAND_FILE.relative_to(ROOT / "minitrain" / "planning").as_posix()
    assert any(fnmatch.fnmatch(inside, pattern) for pattern in patterns), patterns


# --------------------------------------------------------------------------------------------------
# A projection's ranges
# --------------------------------------------------------------------------------------------------


def test_the_step_time_range_is_the_step_time_times_the_band(tmp_path, monkeypatch, run):
    monkeypatch.setattr(projection_module, "BAND_FILE",
                        fake_band(tmp_path / "band.json", [0.8, 1.0, 1.1, 1.25], "AABC"))
    small, big = project(run, "dgx-h100", "1.3b"), project(run, "dgx-h100", "7b")
    assert big.step_time_s > small.step_time_s
    for p in (small, big):
        low, high = p.step_time_range_s
        assert low < p.step_time_s < high
        assert (low, high) == pytest.approx((0.8 * p.step_time_s, 1.25 * p.step_time_s))
        assert p.mfu_range == pytest.approx((p.mfu / 1.25, p.mfu / 0.8))
        assert p.to_dict()["step_time_range_s"] == pytest.approx([low, high])
    assert replace(small, mfu=None).mfu_range is None
    # the band changes no projected value
    monkeypatch.setattr(projection_module, "BAND_FILE",
                        fake_band(tmp_path / "wide.json", [0.5, 2.0], "AB"))
    again = project(run, "dgx-h100", "1.3b")
    assert again.step_time_s == small.step_time_s and again.mfu == small.mfu
    assert again.step_time_range_s == pytest.approx((0.5 * small.step_time_s,
                                                      2.0 * small.step_time_s))


def test_the_range_in_words(tmp_path, monkeypatch, run):
    monkeypatch.setattr(projection_module, "BAND_FILE",
                        fake_band(tmp_path / "band.json", [0.8, 1.0, 1.1, 1.25], "AABC"))
    p = replace(project(run, "dgx-h100", "1.3b"), step_time_s=0.4)
    assert p.range_text() == ("400 ms (uncertainty 320–500 ms: 4 published runs from 3 groups "
                              "took 0.80–1.25× their projected step time)")
    assert p.range_text("s").startswith("0.400 s (uncertainty 0.320–0.500 s:")
    with pytest.raises(ValueError, match="'ms' or 's'"):
        p.range_text("minutes")


def test_a_replay_on_this_machine_carries_no_published_band(run):
    """The published runs judge projections on GPU clusters; this machine's replay is judged by
    (a) and (d) of the benchmark, not by them."""
    p = project(run, "local")
    assert p.band is None and p.step_time_range_s is None and p.mfu_range is None
    assert "uncertainty" not in p.range_text() and p.range_text().endswith(" ms")
    assert p.to_dict()["step_time_range_s"] is None


# --------------------------------------------------------------------------------------------------
# The widget draws it
# --------------------------------------------------------------------------------------------------


def test_the_widget_draws_the_range_on_the_step_time(run):
    view = projection_view(run, "dgx-h100", "1.3b")
    p = view["projection"]
    low, high = p.step_time_range_s
    drawn = uncertainty(p)
    assert (drawn["low_ms"], drawn["high_ms"]) == pytest.approx((low * 1e3, high * 1e3))
    assert "uncertainty" in view["html"] and f"{p.band.rows} published runs" in view["html"]
    fig = projection_figure(view)
    parts = fig.axes[2]
    bars = [c for c in parts.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 1 and bars[0].get_label() == drawn["label"]
    assert drawn["label"].startswith("uncertainty ")
    assert f"{p.band.rows} published runs" in drawn["note"] and drawn["note"] in parts.get_xlabel()
    # the bar's end is the step time; the error bar spans the range around it
    segment = bars[0].lines[2][0].get_segments()[0]
    assert [x for x, _ in segment] == pytest.approx([low * 1e3, high * 1e3])
    assert parts.get_xlim()[1] >= high * 1e3
    assert any(t.get_text() == drawn["label"] for t in parts.get_legend().get_texts())


def test_the_widget_draws_no_range_off_accelerators(run):
    p = project(run, "local")
    assert uncertainty(p) is None
