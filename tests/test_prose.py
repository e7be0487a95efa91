"""Lessons a learner can finish (issue 72): at most 4,000 words of running prose each, sentences of at most 20
words on average, at most 10 % of them over 35 words (worklog notebooks, optional reading, are exempt); and
in every notebook no measured number typed into the prose.

Running prose is the markdown's text: fenced code, display and inline math, tables, headings and HTML tags
are left out, and inline code counts as one word.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_WORDS, MAX_MEAN, MAX_LONG_SHARE, LONG = 4000, 20.0, 0.10, 35


def is_worklog(path: Path) -> bool:
    first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    return "Worklog (optional)" in "".join(first["source"])


def running_text(markdown: str) -> str:
    """The prose of one markdown cell, without what is not read as sentences."""
    drop = [(r"```.*?```", re.S), (r"\$\$.*?\$\$", re.S), (r"^\s*\|.*\|\s*$", re.M), (r"^\s*#+ .*$", re.M),
            (r"<[^>\n]+>", 0)]
    for pattern, flags in drop:
        markdown = re.sub(pattern, " ", markdown, flags=flags)
    return re.sub(r"`[^`]*`|\$[^$\n]*\$", "X", markdown)


def sentences(text: str) -> list[str]:
    """Sentences: split after . ! ? : ; before a capital, a digit or a mark, at paragraph breaks and at list
    bullets; three words or more."""
    parts = re.split(r"(?<=[.!?:;])\s+(?=[A-Z0-9(*`\-])|\n\s*\n|\n\s*(?:[-*]|\d+\.)\s+", text)
    parts = (re.sub(r"^(?:[-*]|\d+\.)\s+", "", " ".join(part.split())) for part in parts)
    return [p for p in parts if len(p.split()) >= 3]


def prose_stats(path: Path) -> tuple[int, float, float]:
    """(words, mean words a sentence, share of sentences over LONG words) of a notebook's markdown."""
    cells = json.loads(path.read_text())["cells"]
    found = [s for c in cells if c["cell_type"] == "markdown" for s in sentences(running_text("".join(c["source"])))]
    lengths = [len(s.split()) for s in found]
    return sum(lengths), sum(lengths) / max(1, len(lengths)), sum(n > LONG for n in lengths) / max(1, len(lengths))


LESSONS = [p for p in NOTEBOOKS if not is_worklog(p)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_is_short_and_its_sentences_too(path):
    words, mean, long = prose_stats(path)
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose, more than {MAX_WORDS}: move history to a worklog"
    assert mean <= MAX_MEAN, f"{path.name}: {mean:.1f} words a sentence on average, more than {MAX_MEAN}"
    assert long <= MAX_LONG_SHARE, f"{path.name}: {long:.0%} of sentences over {LONG} words"


def test_the_counts_follow_the_rules():
    cell = ("# A heading that is not counted\nOne two three four. Five six seven `code here` eight.\n\n"
            "```python\nx = 1\n```\n| a | table |\n- a bullet with words\n\n$$ math $$\n\n" + "word " * 39 + "end.")
    found = sentences(running_text(cell))
    assert found[:3] == ["One two three four.", "Five six seven X eight.", "a bullet with words"]
    assert len(found) == 4 and len(found[3].split()) == 40


def test_the_limits_catch_a_long_lesson(tmp_path):
    path = tmp_path / "x.ipynb"
    text = ("This sentence has exactly eight words in it. " * 600)
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": [text]}]}))
    words, mean, long = prose_stats(path)
    assert words == 4800 and mean == 8 and long == 0


# A measured number is printed by a code cell from images/*.json, never typed (issue 72). In prose: no range of
# ratios ("1.29-1.40×") and no time in ms or µs at all; a rate (TFLOP/s, TB/s, GB/s) only in a cell that names its
# source (a datasheet, a paper, a spec sheet), where it is a cited figure, not a measurement.
RATIO_RANGE = re.compile(r"\d+\.\d+\s*[–-]\s*\d+\.\d+\s*×")
TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:ms|µs)\b")
RATE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s*(?:TFLOP/s|PFLOP/s|TB/s|GB/s)")
CITED = re.compile(r"datasheet|data sheet|paper|et al\.|spec sheet|specification|NVIDIA gives|NVIDIA lists", re.I)


def typed_measurements(path: Path) -> list[str]:
    """The sentences of a notebook's markdown that type what looks like a measured number."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = running_text("".join(cell["source"]))
        cited = CITED.search(text)
        found += [s for s in sentences(text)
                  if RATIO_RANGE.search(s) or TIME.search(s) or (RATE.search(s) and not cited)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_measurement_is_typed_into_prose(path):
    found = typed_measurements(path)
    assert not found, f"{path.name}: print these from images/*.json instead: {found}"


def test_typed_measurements_are_found(tmp_path):
    path = tmp_path / "x.ipynb"
    cells = ["It runs at 1.29–1.40× FlashAttention-2 here.", "A launch takes 12 µs on this GPU.",
             "The kernel reaches 450 TFLOP/s in our run.", "The H200 datasheet gives 4.8 TB/s of bandwidth.",
             "Backward FLOPs are 2.5× the forward's."]
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": [c]} for c in cells]}))
    assert typed_measurements(path) == cells[:3]
