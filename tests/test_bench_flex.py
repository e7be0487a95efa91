"""utils.course.bench.flex (notebook 10's benchmark): the plan, the document split, the checks, the stored table and the
plots run on a CPU (fake timings); the measurement itself is a GPU test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.course.bench import flex as fb

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_write_the_reference_into_images():
    args = fb.parse_args([])
    assert args.out == ROOT / "images" / "10_flex_h200.json" == fb.DEFAULT_OUT
    assert (args.quick, args.warmup, args.rep, args.seed, args.summary) == (False, 25, 100, 0, False)
    assert fb.figure_paths(args.out) == (ROOT / "images" / "10_flex_h200.png",
                                         ROOT / "images" / "10_flex_sparsity_h200.png")


def test_quick_and_out_options(tmp_path):
    assert fb.parse_args(["--quick"]).out == fb.QUICK_OUT and fb.QUICK_OUT.parent == ROOT / "build"
    args = fb.parse_args(["--quick", "--out", str(tmp_path / "f.json"), "--rep", "5", "--warmup", "2"])
    assert (args.out, args.rep, args.warmup, args.quick) == (tmp_path / "f.json", 5, 2, True)
    assert fb.figure_paths(tmp_path / "f.json") == (tmp_path / "f.png", tmp_path / "f_sparsity.png")


@pytest.mark.parametrize("argv", [["--rep", "0"], ["--warmup", "-1"], ["--out", "x.png"], ["--seed", "a"],
                                  ["--nope"]])
def test_parse_args_rejects_bad_values(argv):
    with pytest.raises(SystemExit):
        fb.parse_args(argv)


@pytest.mark.parametrize("count", [1, 8, 16, 32, 64, 16384])
def test_split_documents(count):
    lengths = fb.split_documents(16384, count, seed=3)
    assert len(lengths) == count and sum(lengths) == 16384 and min(lengths) >= 1
    assert max(lengths) <= 3 * min(lengths) + 2                           # equal-ish
    assert fb.split_documents(16384, count, seed=3) == lengths           # seeded


def test_split_documents_seeds_differ_and_bad_counts_raise():
    assert fb.split_documents(16384, 8, seed=0) != fb.split_documents(16384, 8, seed=1)
    assert len(set(fb.split_documents(16384, 8))) > 1
    for total, count in ((10, 0), (10, 11), (10, 2.5), (-1, 1)):
        with pytest.raises(ValueError):
            fb.split_documents(total, count)


def test_the_full_plan():
    cases = fb.cases(fb.FULL)
    window = [c for c in cases if c.mask == "sliding_window" and c.window == 1024]
    assert [c.seqlen for c in window] == [4096, 8192, 16384, 32768]
    assert all(cases[c] == ("sdpa_mask", "torch_flex", "course") for c in window)   # the sweep's 1k case too
    assert [c.documents for c in cases if c.mask == "document"] == [8, 16, 32, 64]
    assert [c.seqlen for c in cases if c.mask == "causal"] == [4096, 8192, 16384, 32768]
    sweep = [c.window for c in cases if c.mask == "sliding_window" and c.seqlen == 16384]
    assert sorted(sweep) == [256, 512, 1024, 2048, 4096, 8192, 16384] and len(cases) == 18
    assert fb.cases(fb.QUICK) and all(c.seqlen <= 2048 for c in fb.cases(fb.QUICK))


def test_describe():
    assert fb.describe(fb.Case("sliding_window", 4096, window=1024)) == "window 1k"
    assert fb.describe(dict(mask="sliding_window", window=256, documents=None)) == "window 256"
    assert fb.describe(fb.Case("document", 16384, documents=8)) == "8 documents"


def test_make_modifier_builds_each_cases_mask():
    from utils import flex

    q, kv = torch.arange(12)[:, None], torch.arange(12)
    window = fb.make_modifier(fb.Case("sliding_window", 12, window=3), "cpu")
    assert torch.equal(flex.dense_mask(window, 1, 1, 12, 12)[0, 0], (kv <= q) & (q - kv < 3))
    assert torch.equal(flex.dense_mask(fb.make_modifier(fb.Case("causal", 12), "cpu"), 1, 1, 12, 12)[0, 0], kv <= q)
    doc = fb.split_documents(12, 3, seed=1)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(doc))
    documents = fb.make_modifier(fb.Case("document", 12, documents=3), "cpu", seed=1)
    assert torch.equal(flex.dense_mask(documents, 1, 1, 12, 12)[0, 0], (ids[:, None] == ids) & (kv <= q))
    with pytest.raises(ValueError, match="unknown mask"):
        fb.make_modifier(fb.Case("nope", 12), "cpu")


def test_check_close_passes_bf16_noise_and_raises_on_wrong_outputs():
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(2, 4, 256, 64, generator=gen)
    fb.check_close(expected.bfloat16(), expected)                 # rounding to bf16 is fine
    with pytest.raises(AssertionError, match="dq"):
        fb.check_close(2 * expected, expected, name="dq")
    with pytest.raises(AssertionError, match="relative error"):   # small everywhere: only the norm sees it
        fb.check_close(expected * 1.05, expected)
    bad = expected.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(AssertionError):
        fb.check_close(bad, expected)


def test_disagreements_names_the_wrong_implementation():
    gen = torch.Generator().manual_seed(0)
    ref = tuple(torch.randn(1, 2, 64, 16, generator=gen) for _ in range(4))
    good = tuple(t.bfloat16() for t in ref)
    wrong_dk = (ref[0], ref[1], -ref[2], ref[3])
    errors = fb.disagreements({"ref": ref, "good": good, "wrong": wrong_dk})
    assert list(errors) == ["wrong"] and errors["wrong"].startswith("mismatch: dk of wrong against ref")


def sdpa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_measure_case_times_only_what_agrees():
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(4))

    def broken(q, k, v):
        raise RuntimeError("CUDA out of memory.\nmore")

    fns = {"ref": sdpa_causal, "same": lambda q, k, v: sdpa_causal(q, k, v) + 0,
           "wrong": lambda q, k, v: 2 * sdpa_causal(q, k, v), "skipped": fb.Skipped("too big"), "broken": broken}
    timed = []

    def timer(fn, q, k, v, do, *, warmup, rep):
        timed.append(fn)
        return dict(fwd_ms=1.0, fwd_bwd_ms=3.0, bwd_ms=2.0)

    records = {r["impl"]: r for r in fb.measure_case(fb.Case("causal", 64), fns, q, k, v, do, timer=timer)}
    assert timed == [fns["ref"], fns["same"]]
    assert records["same"]["fwd_bwd_ms"] == 3.0 and records["same"]["error"] is None
    assert records["same"]["first_call_s"] >= 0 and records["same"]["seqlen"] == 64
    assert records["wrong"]["error"].startswith("mismatch: o of wrong") and records["wrong"]["fwd_ms"] is None
    assert records["skipped"]["error"] == "too big" and records["skipped"]["first_call_s"] is None
    assert records["broken"]["error"] == "RuntimeError: CUDA out of memory."


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter; test_quick_run_on_gpu runs the GPU")
def test_run_case_checks_the_course_kernel_against_sdpa_on_cpu():
    def timer(fn, q, k, v, do, *, warmup, rep):
        return dict(fwd_ms=1.0, fwd_bwd_ms=3.0, bwd_ms=2.0)

    for case in (fb.Case("sliding_window", 64, window=16), fb.Case("document", 64, documents=3)):
        records = fb.run_case(case, ("sdpa_mask", "course"), warmup=1, rep=1, seed=0, device="cpu", batch=1,
                              heads=2, head_dim=16, timer=timer)
        assert [r["impl"] for r in records] == ["sdpa_mask", "course"]
        assert all(r["error"] is None and r["fwd_ms"] == 1.0 for r in records), records
        assert 0 < records[0]["sparsity"] == records[1]["sparsity"] < 1


def test_sdpa_mask_is_skipped_beyond_the_dense_limit():
    from utils import flex

    with pytest.raises(fb.Skipped, match="larger than 16384x16384"):
        fb.build("sdpa_mask", fb.Case("sliding_window", 32768, window=1024), flex.sliding_window(1024),
                 batch=1, heads=1, device="cpu")
    with pytest.raises(ValueError, match="unknown implementation"):
        fb.build("nope", fb.Case("causal", 64), flex.causal(), batch=1, heads=1, device="cpu")


MS = {"course": 1.0, "torch_flex": 2.0, "sdpa_mask": 4.0, "sdpa_causal": 0.5}


def synthetic() -> dict:
    """A stored run of the quick plan with made-up times: causal costs the course 3x the window."""
    settings = fb.settings(fb.QUICK, fb.parse_args(["--quick"]))
    results = []
    for case, impls in fb.cases(fb.QUICK).items():
        for impl in impls:
            ms = 3.0 if case.mask == "causal" and impl == "course" else MS[impl]
            skipped = 0.25 if case.mask == "causal" else 1 - (case.window or 256) / 1024
            results.append(dict(case._asdict(), impl=impl, fwd_ms=ms, fwd_bwd_ms=3 * ms, bwd_ms=2 * ms,
                                first_call_s=10.0, mask_s=0.1, sparsity=skipped, error=None))
    results[0].update(fwd_ms=None, fwd_bwd_ms=None, bwd_ms=None, error="dense mask too big")
    return dict(environment=dict(gpu="Fake GPU", torch="t", triton="tr", date="d"), settings=settings,
                results=results)


def test_settings_are_json_and_record_the_documents():
    s = json.loads(json.dumps(synthetic()["settings"]))
    assert (s["batch"], s["heads"], s["head_dim"], s["dtype"]) == (2, 16, 128, "bf16")
    assert s["doc_lengths"] == {str(c): fb.split_documents(s["doc_seqlen"], c, 0) for c in fb.QUICK.doc_counts}
    assert "bwd_ms = fwd_bwd_ms - fwd_ms" in s["timing"] and s["seqlens"] == list(fb.QUICK.seqlens)


def test_summary_table_from_a_stored_json(tmp_path, capsys):
    data = synthetic()
    text = fb.summary_text(data)
    forward = fb.comparison_table(data, "fwd_ms")
    row = next(line for line in forward if line.startswith("4 documents"))
    assert row.split()[-3:] == ["2.00x", "4.00x", "3.00x"]   # course against torch flex, SDPA and causal
    causal_row = next(line for line in forward if line.startswith("causal"))
    assert causal_row.split()[-3:] == ["—", "0.17x", "—"]
    assert "window 256 at N=1024, course kernel: forward: 3.00x dense causal's speed, 2.00x" in text
    assert "not timed:" in text and "sdpa_mask on window 256, N=1024: dense mask too big" in text
    assert "torch.compile'd flex_attention" in text and "Fake GPU" in text
    sweep = fb.sparsity_table(data)
    assert sweep[-1].split()[:3] == ["1024", "0.000", "1.333"] and len(sweep) == 2 + len(fb.QUICK.sparsity_windows)
    path = fb.write_json(data, tmp_path / "f.json")
    fb.summarize(path)
    assert capsys.readouterr().out.strip() == text.strip()
    assert fb.main(["--summary", "--out", str(path)]) == data


def test_plots_are_written_beside_the_json(tmp_path):
    paths = fb.save_figures(synthetic(), tmp_path / "10_flex_test.json")
    assert [p.name for p in paths] == ["10_flex_test.png", "10_flex_sparsity_test.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 1000 for p in paths)


def test_imports_and_parses_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code = "import utils.course.bench.flex as f; f.parse_args(['--quick']); print(f.figure_paths(f.DEFAULT_OUT)[1].name)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10_flex_sparsity_h200.png"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_measuring_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="CUDA"):
        fb.main(["--quick", "--out", str(tmp_path / "f.json")])
    assert not (tmp_path / "f.json").exists()


@pytest.mark.gpu
@pytest.mark.capability(8, 0)   # bf16 and PyTorch's flex_attention kernels
def test_quick_run_on_gpu(tmp_path):
    out = tmp_path / "f.json"
    data = fb.main(["--quick", "--out", str(out), "--warmup", "2", "--rep", "5"])
    assert json.loads(out.read_text()) == data
    assert data["environment"]["command"] == f"python -m utils.course.bench.flex --quick --out {out} --warmup 2 --rep 5"
    assert len(data["results"]) == sum(map(len, fb.cases(fb.QUICK).values()))
    assert all(r["error"] is None and 0 < r["fwd_ms"] < r["fwd_bwd_ms"] for r in data["results"]), \
        [r for r in data["results"] if r["error"]]
    assert all(p.exists() for p in fb.figure_paths(out))
    assert "not timed" not in fb.summary_text(data)
