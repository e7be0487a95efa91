"""The repository's own promises: one dependency list, stripped notebooks, a bootstrap cell, an up-to-date map."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def requirement_lines(text):
    return sorted(line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip())


def test_environment_yml_mirrors_requirements():
    env = (ROOT / "environment.yml").read_text()
    pip_section = env.split("- pip:", 1)[1]
    from_env = requirement_lines("\n".join(re.sub(r"^\s*-\s*", "", line) for line in pip_section.splitlines()))
    assert from_env == requirement_lines((ROOT / "requirements.txt").read_text())


def test_torch_and_triton_are_pinned_together():
    reqs = requirement_lines((ROOT / "requirements.txt").read_text())
    assert "torch==2.13.0" in reqs and "triton==3.7.1" in reqs


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_notebooks_exist_and_are_numbered_in_order():
    """Names start with a two-digit lesson number, optionally a letter for a follow-up lesson (05b_...), and a
    `w` for a lesson's optional worklog (06cw_...), which sits beside the lesson it extends."""
    numbers = [p.name.split("_")[0] for p in NOTEBOOKS]
    assert numbers and all(re.fullmatch(r"\d\d[a-z]?w?", n) for n in numbers), numbers
    lessons = set(numbers)
    assert all(n[:-1] in lessons for n in numbers if n.endswith("w")), "a worklog without its lesson"
    assert len(set(numbers)) == len(numbers)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 cells carry ids; a notebook written without them warns now and fails in later nbformats."""
    ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]
    assert None not in ids, f"{path.name}: {ids.count(None)} cells without an id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"run `make strip` ({path.name})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_starts_with_the_bootstrap(path):
    nb = json.loads(path.read_text())
    first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "from utils.course.bootstrap import setup" in "".join(first_code["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_readme_maps_every_notebook(path):
    assert f"notebooks/{path.name}" in (ROOT / "README.md").read_text()


MAP_ROW_WORDS = 20   # issue 72: README fits on a screen before its details


def notebook_map(text):
    """{notebook file name: its description} for each row of README's notebook map, a table row that starts
    with a link to notebooks/<name>.ipynb; the description is the second column."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| \[`notebooks/([^`]+\.ipynb)`\]\([^)]*\) \|(.*)\|[^|]*\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def test_notebook_map_rows_are_short():
    rows = notebook_map((ROOT / "README.md").read_text())
    assert len(rows) == len(NOTEBOOKS), f"map rows {sorted(rows)} against notebooks {[p.name for p in NOTEBOOKS]}"
    long = {name: len(text.split()) for name, text in rows.items() if len(text.split()) > MAP_ROW_WORDS}
    assert not long, f"README notebook-map descriptions over {MAP_ROW_WORDS} words (name: words): {long}"


def test_notebook_map_parser_reads_the_second_column():
    text = ("| notebook | what it teaches | hardware |\n|---|---|---|\n"
            "| [`notebooks/01_x.ipynb`](notebooks/01_x.ipynb) | one two three | CPU or GPU |\n"
            "| [`notebooks/02_y.ipynb`](notebooks/02_y.ipynb) | a `b` (c, d) | GPU (benchmark: GPU) |\n")
    assert notebook_map(text) == {"01_x.ipynb": "one two three", "02_y.ipynb": "a `b` (c, d)"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_badge_objectives_and_recap(path):
    nb = json.loads(path.read_text())
    markdown = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    assert "colab-badge" in markdown[0] and f"notebooks/{path.name}" in markdown[0], "Colab badge for this notebook"
    assert "By the end you will be able to" in markdown[0], "learning objectives at the top"
    assert any(m.lstrip().startswith("## Recap") for m in markdown), "a recap at the end"


def test_readme_and_instructors_give_make_tests_time_from_its_report():
    """The minutes README and INSTRUCTORS give for `make test` on a CPU are those of tests/make_test_report.json,
    written by .ci/time_make_test.py from fresh clones."""
    report = json.loads((ROOT / "tests" / "make_test_report.json").read_text())
    assert report["command"] == "python3 .ci/time_make_test.py" and report["total_s"] == pytest.approx(
        report["install_s"] + report["test_s"], abs=0.11)
    assert "passed" in report["result"] and "failed" not in report["result"], report["result"]
    total, unit = f"{report['total_s'] / 60:.1f}", f"{report['unit_tests_s'] / 60:.1f}"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.findall(r"CPU-only machine with (\d+) cores it took (\d+\.\d) minutes", readme) == [
        (str(report["cpus"]), total)], f"README's make test time is not the report's {total} minutes"
    assert re.findall(r"the unit tests alone (\d+\.\d) minutes", readme) == [unit]
    instructors = " ".join((ROOT / "INSTRUCTORS.md").read_text().split())
    assert re.findall(r"`make test` on the machine you will teach from \((\d+\.\d) minutes on (\d+) CPU cores",
                      instructors) == [(total, str(report["cpus"]))]
