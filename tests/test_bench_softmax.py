"""utils.course.bench.softmax (notebook 06): notebook 06's softmax kernels timed beside torch.softmax."""
import json
from pathlib import Path

import pytest
import torch

from utils.course.bench.softmax import format_softmax_table, main, softmax_table

STORED = Path(__file__).resolve().parents[1] / "images" / "06_softmax_h200.json"


def test_the_table_prints_every_stored_record():
    records = json.loads(STORED.read_text())["results"]
    lines = format_softmax_table(records).splitlines()
    assert len(lines) == len(records) + 1 and "vs torch" in lines[0]
    assert all(r["kernel"] in line for r, line in zip(records, lines[1:]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_it_refuses_without_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        softmax_table()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_command_line_writes_records_with_their_environment(tmp_path):
    out = tmp_path / "softmax.json"
    records = main(["--out", str(out)])
    stored = json.loads(out.read_text())
    assert stored["results"] == records and stored["environment"]["gpu"]
    assert {r["kernel"] for r in records} >= {"torch.softmax", "warp"}
