"""utils.course.bench.real_model: its arguments and, on a GPU, one small run of every row it stores."""
import json

import pytest
import torch

from utils.course.bench import real_model


def test_arguments_and_refusals():
    args = real_model.parse_args([])
    assert args.attentions == list(real_model.ATTENTIONS) and args.modes == list(real_model.MODES)
    assert args.out == real_model.DEFAULT_OUT and args.out.parent.name == "images"
    with pytest.raises(ValueError, match="attention must be one of"):
        real_model.attention_function("flash")
    with pytest.raises(SystemExit):
        real_model.parse_args(["--modes", "jit"])
    assert set(real_model.SDPA_PINNED) < set(real_model.ATTENTIONS)
    assert {a.removeprefix("sdpa_") for a in real_model.SDPA_PINNED} <= set(real_model.BACKEND_MARKERS)
    assert real_model.backend_of({"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>"}) == "flash"
    assert real_model.backend_of({"ampere_sgemm", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"}) == "cudnn"
    assert real_model.backend_of({"fmha_cutlassF_bf16_aligned_64x64_rf_sm80"}) == "efficient"
    assert real_model.backend_of({"cudnn_gemm_kernel", "vectorized_elementwise_kernel"}) == "unknown"
    from torch.nn.attention import SDPBackend
    assert all(hasattr(SDPBackend, b) for b in real_model.SDPA_PINNED.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        real_model.main([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_small_run_writes_every_row_with_its_environment(tmp_path):
    out = tmp_path / "real.json"
    data = real_model.main(["--batch", "1", "--seq", "128", "--dim", "128", "--heads", "4", "--kv-heads", "2",
                            "--layers", "1", "--vocab", "512", "--rep", "5", "--out", str(out)])
    assert json.loads(out.read_text()) == data
    assert {"gpu", "torch", "triton", "date", "command"} <= set(data["environment"])
    rows = {(r["mode"], r["attention"]): r for r in data["rows"]}
    assert set(rows) == {(m, a) for m in real_model.MODES for a in real_model.ATTENTIONS}
    assert rows["eager", "sdpa_flash"].get("backend", "flash") == "flash"   # eager keeps a pin (or refuses)
    assert all(r["backend"] in (*real_model.BACKEND_MARKERS, "unknown") for r in rows.values() if "backend" in r)
    refused = [r for r in rows.values() if "error" in r]
    assert all(r["attention"] in real_model.SDPA_PINNED for r in refused), refused   # only a pinned backend may
    timed = [r for r in rows.values() if "error" not in r]
    assert all(r["ms"] > 0 for r in timed) and {r["attention"] for r in timed} >= {"sdpa", "triton", "triton_lesson"}
    losses = [r["first_loss"] for r in timed]
    assert max(losses) - min(losses) < 0.05, losses   # same weights and tokens: one loss, up to bf16 rounding
