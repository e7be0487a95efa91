"""utils.course.bench.context_parallel: its arguments and refusals and, on two GPUs, one small run."""
import json

import pytest
import torch

from utils.course.bench import context_parallel as cp


def test_arguments_and_refusals():
    args = cp.parse_args([])
    assert (args.world_size, args.seq, args.heads, args.head_dim, args.not_causal) == (None, 32768, 16, 128, False)
    assert args.sdpa_backend == "flash" and args.out == cp.DEFAULT_OUT and args.out.parent.name == "images"
    from torch.nn.attention import SDPBackend
    assert all(hasattr(SDPBackend, b) for b in cp.SDPA_BACKENDS.values())
    for bad in (["--sdpa-backend", "math"], ["--seq", "0"], ["--iters", "-1"]):
        with pytest.raises(SystemExit):
            cp.parse_args(bad)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal without two GPUs")
def test_without_two_gpus_it_says_so():
    with pytest.raises(SystemExit, match="at least 2 CUDA GPUs"):
        cp.main([])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_small_run_on_two_gpus(tmp_path):
    out = tmp_path / "cp.json"
    data = cp.main(["--world-size", "2", "--seq", "1024", "--heads", "4", "--head-dim", "64", "--iters", "2",
                    "--out", str(out)])
    assert json.loads(out.read_text()) == data and data["environment"]["gpus"] == 2
    ring, torch_cp = data["rows"]
    assert ring["ms"] > 0 and ring["max_abs_err"] < 2e-2 and ring["grad_rel_err"] < 2e-2, ring
    assert "error" in torch_cp or (torch_cp["max_abs_err"] < 2e-2 and torch_cp["grad_rel_err"] < 2e-2), torch_cp
