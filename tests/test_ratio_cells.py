"""Notebook cells that print a range of TFLOP/s ratios from a stored run take it from
`utils.course.references.ratio_span`, the one place that pairs the shapes, rather than a min/max of their own."""
import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# (notebook, the function in it that turns a stored run into a ratio range)
RANGE_HELPERS = [("05b_triton_fast", "step_gain"), ("05b_triton_fast", "g_span"), ("05b_triton_fast", "w_span"),
                 ("05bw_triton_fast_worklog", "o_span"), ("06b_cuda_tensor_cores", "gain")]


def functions(stem: str) -> dict:
    cells = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())["cells"]
    found = {}
    for cell in cells:
        if cell["cell_type"] == "code" and not "".join(cell["source"]).lstrip().startswith("%"):
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, ast.FunctionDef):
                    found[node.name] = node
    return found


def calls(node) -> set:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


@pytest.mark.parametrize("stem, name", RANGE_HELPERS, ids=lambda x: str(x))
def test_ratio_ranges_come_from_ratio_span(stem, name):
    fn = functions(stem).get(name)
    assert fn is not None, f"{stem} defines no {name}"
    used = calls(fn)
    assert "ratio_span" in used, f"{stem}'s {name} computes its range by hand: use references.ratio_span"


def test_07s_backward_ratios_come_from_ratio_span():
    cells = json.loads((NOTEBOOKS / "07_backward.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "triton / FA2" in "".join(c["source"]))
    assert 'ratio_span(rows, "triton", "sdpa_flash", key="backend")' in source
    assert 'ratio_span(rows, "triton", "sdpa_cudnn", key="backend")' in source
