"""Lesson prose holds no typed measurement: a number with a unit in a markdown cell (bytes, a
bandwidth, a time, a ratio, a percentage) must be one the notebook computes and prints, or a fact
that is not a measurement of ours — a device's capacity, a setting of the run, a formula's constant.
Those are listed here, each with why; any other number typed into a lesson fails, naming the cell:
compute it in a code cell, or add it here with the reason it is not a measurement."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.`{−-])(\d[\d,.]*)\s*(GB/s|TB/s|Gbit/s|GB|MB|KB|kB|TB|×|%|ms|s\b)")

#: lesson -> {typed text: why it is not a measurement of ours}
ALLOWED = {
    "00": {"80 GB": "the device in the article's example (an H100's capacity)"},
    "01": {"16 MB": "the largest size the timing sweep is set to",
           "5 s": "the cluster's collective timeout, a setting"},
    "03": {"60 ms": "the sleep the slow worker is set to",
           "1%": "topk:0.01, the setting of the run",
           "10 Gbit/s": "the range of links between machines the sentence is about"},
    "04": {"1.5×": "3Ψ / 2Ψ, a ratio of the formulas"},
    "05": {"80 GB": "the device of lesson 00's example", "25 %": "an example of how to write a fraction",
           "14 GB": "7·10⁹ parameters × 2 bytes (bf16), lesson 00's arithmetic",
           "112 GB": "7·10⁹ parameters × 16 bytes (mixed-precision Adam), lesson 00's arithmetic"},
    "07": {"1000×": "2⁻¹⁰, the scale the run applies, written as a factor",
           "100 %": "MFU's ceiling by its definition (the section asks why a step stays below it)"},
    "08": {"5 %": "the chooser's tolerance, a setting", "2 ×": "a mesh's shape (2 × 1 × 2)",
           "1 ×": "a mesh's shape (2 × 1 × 2)"},
    "09": {"4×": "the limit of T² / T when T doubles, a formula", "2 ×": "2 experts × 128 units, a shape"},
}


def typed_numbers(path: Path) -> list[tuple[int, str]]:
    """(cell index, 'number unit') for each number with a unit in the notebook's markdown, outside
    `code` and $maths$."""
    nb = json.loads(path.read_text())
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        text = re.sub(r"\$[^$]*\$", "", re.sub(r"`[^`]*`", "", text))
        found += [(i, f"{m.group(1)}{' ' if m.group(0)[len(m.group(1))] == ' ' else ''}{m.group(2)}")
                  for m in NUMBER.finditer(text)]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("[0-9]*.ipynb")), ids=lambda p: p.name)
def test_no_measurement_is_typed_into_a_lessons_prose(path):
    allowed = ALLOWED.get(path.name.split("_")[0][:2], {})
    typed = [(i, t) for i, t in typed_numbers(path) if t not in allowed]
    assert not typed, (f"{path.name}: numbers typed into the prose (cell, text): {typed}; compute them "
                       "in a code cell, or list them in ALLOWED with why they are not a measurement")


def test_the_check_finds_a_typed_number(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": "DDP sent 1.2 GB here, `3 GB` in code is fine"}]}
    path = tmp_path / "02_x.ipynb"
    path.write_text(json.dumps(nb))
    assert typed_numbers(path) == [(0, "1.2 GB")]
