"""The stored reference results: each JSON says where it was measured, README's numbers are the JSON's, and
every reference has a command that regenerates it."""
import importlib.util
import json
import re

import pytest

from utils.course.references import (COLUMNS, FORWARD_RUNS, HOPPER_RUNS, IMAGES, README, REFERENCES, findings,
                                     format_stored, hopper_default_run, main, results_markdown, stored_decoding,
                                     stored_kernels, stored_records, technique_gains, update_readme)

JSONS = sorted(IMAGES.glob("*.json"))
ENV_KEYS = ("gpu", "capability", "torch", "triton", "cuda", "cudnn", "driver", "date", "command")


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_every_stored_result_records_its_environment(path):
    env = json.loads(path.read_text()).get("environment")
    assert isinstance(env, dict), f"{path.name} has no 'environment' (utils.gpu.environment)"
    missing = [k for k in ENV_KEYS if k not in env]
    assert not missing, f"{path.name}: environment lacks {missing}"
    for key in ("gpu", "torch", "triton", "date", "command"):
        assert env[key], f"{path.name}: environment.{key} is empty"
    unknown = [k for k in ENV_KEYS if env[k] is None]
    assert not unknown or env.get("reconstructed"), f"{path.name}: {unknown} unknown and no word on why"
    assert env["command"].startswith("python -m "), env["command"]


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_every_stored_result_has_a_command_that_makes_it(path):
    commands = [" ".join(command) for _, command in REFERENCES.values()]
    made_by = json.loads(path.read_text())["environment"]["command"].removeprefix("python -m ")
    via_references = made_by.startswith("utils.course.references --only ")
    assert via_references or any(made_by.startswith(c.split(" --out")[0].split(" --name")[0]) for c in commands), made_by


@pytest.mark.parametrize("name", list(REFERENCES))
def test_each_reference_command_names_a_module(name):
    module = REFERENCES[name][1][0]
    assert importlib.util.find_spec(module) is not None, module


def test_readme_results_equal_the_json():
    assert update_readme(check=True), "README's results differ from images/*.json: python -m utils.course.references --readme"
    text = results_markdown()
    assert "| course Triton forward" in text and "SDPA cuDNN backward" in text and "torch 2.11" in text
    assert "notebooks/09_summary.ipynb" in text, "README points to notebook 09 for the other kernels"


def _finding(what):
    rows = [r for r in findings() if r["what"] == what]
    assert len(rows) == 1, f"findings() has {len(rows)} rows {what!r}"
    return rows[0]


def test_findings_count_the_shapes_where_the_course_is_below_the_tutorial():
    """The count findings() gives, computed here from the peers run's records: per fp16 shape, the course's fastest
    kernel against the tutorial's fastest variant."""
    results = json.loads((IMAGES / "peers_h200.json").read_text())["results"]
    best = {}
    for r in results:
        if r["accurate"] and r["ms"] and (r["impl"] in ("triton", "gluon", "gluon_ws")
                                          or r["impl"].startswith("triton-tutorial")):
            who = "tutorial" if r["impl"].startswith("triton-tutorial") else "course"
            shape = (r["mode"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"])
            best[who, shape] = min(best.get((who, shape), float("inf")), r["ms"])
    shapes = [s for who, s in best if who == "tutorial" and ("course", s) in best]
    below = sum(best["course", s] > best["tutorial", s] for s in shapes)
    row = _finding("shapes where the course is below the tutorial")
    assert (row["low"], row["high"], row["unit"]) == (below, below, f"of {len(shapes)}")


def test_findings_course_against_fa2_is_the_fastest_course_kernel_per_shape():
    """The peers run's forward against FlashAttention-2, computed here from the records themselves."""
    results = json.loads((IMAGES / "peers_h200.json").read_text())["results"]
    fast = {}
    for r in results:
        if r["mode"] == "fwd" and r["seqlen"] >= 1024 and r["tflops"] and r["accurate"]:
            shape = (r["dtype"], r["head_dim"], r["causal"], r["seqlen"])
            if r["impl"] in ("triton", "gluon", "gluon_ws"):
                fast[shape] = max(fast.get(shape, 0.0), r["tflops"])
    fa2 = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in results
           if r["impl"] == "sdpa-flash" and r["mode"] == "fwd" and r["tflops"] and r["accurate"]}
    ratios = [fast[s] / fa2[s] for s in fast if s in fa2]
    assert len(ratios) == 2 * 2 * 2 * 5   # dtypes, head dims, masks, N 1k-16k
    row = _finding("course's best forward / FlashAttention-2, fp16 and bf16")
    assert (row["low"], row["high"]) == pytest.approx((min(ratios), max(ratios)))


def test_findings_triton_forward_against_sdpa_from_the_records():
    results = json.loads((IMAGES / "triton_fwd_h200.json").read_text())["results"]
    t = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in results if r["tflops"]}
    for sdpa, what, shortest in (("sdpa-flash", "Triton forward / FlashAttention-2", 2048),
                                 ("sdpa-cudnn", "Triton forward / cuDNN", 4096)):
        ratios = [v / t[sdpa, *s] for (i, *s), v in t.items() if i == "triton" and s[2] >= shortest and (sdpa, *s) in t]
        row = _finding(what)
        assert (row["low"], row["high"]) == pytest.approx((min(ratios), max(ratios))), what


def test_findings_name_stored_runs_and_notebooks():
    notebooks = {p.name.split("_")[0] for p in (IMAGES.parent / "notebooks").glob("*.ipynb")}
    for row in findings() + technique_gains():
        assert row["low"] <= row["high"], row
        assert set(row["notebook"].split(", ")) <= notebooks, row
        named = [s for s in row["source"].split(", ") if s.endswith(".json")]
        assert all((IMAGES / s).is_file() for s in named), row


def test_the_hopper_default_run_is_the_newest_that_timed_the_default():
    from utils.course.bench.cuda_mma import step_label
    from utils.native.hopper import default_step

    for d in (64, 128):
        label = step_label(default_step(d), "hopper")
        timed = [name for name in HOPPER_RUNS if any(r["impl"] == label and r["head_dim"] == d
                                                     for r in json.loads((IMAGES / name).read_text())["results"])]
        assert timed and hopper_default_run(d) == timed[-1], (d, timed)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        hopper_default_run(96)


def test_technique_gain_is_the_ratio_of_the_two_kernels_in_one_run():
    """Warp specialisation in Gluon, computed here from 05b_gluon_ws_h200.json's records."""
    results = json.loads((IMAGES / "05b_gluon_ws_h200.json").read_text())["results"]
    t = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in results if r["tflops"]}
    ratios = [v / t["gluon", *s] for (i, *s), v in t.items() if i == "gluon_ws" and s[2] >= 4096 and ("gluon", *s) in t]
    row = next(r for r in technique_gains() if r["what"] == "warp specialisation (Gluon forward)")
    assert (row["low"], row["high"]) == pytest.approx((min(ratios), max(ratios)))
    ring = {r["case"]["layout"]: r["ring_ms"] for r in json.loads((IMAGES / "ring_nccl.json").read_text())["results"]
            if r["case"]["causal"]}
    row = next(r for r in technique_gains() if r["what"].startswith("zigzag"))
    assert row["low"] == pytest.approx(ring["contiguous"] / ring["zigzag"])


def test_stored_kernels_cover_the_registry():
    """Notebook 09 shows every registered kernel's forward, and the backward of each kernel that has its own."""
    from utils.attention import REGISTRY

    assert set(FORWARD_RUNS) == set(REGISTRY), set(REGISTRY) ^ set(FORWARD_RUNS)
    for row in stored_kernels("fwd"):
        assert any(v is not None for v in row["tflops"].values()), f"{row['kernel']}: no shape of {COLUMNS}"
    for row in stored_kernels("bwd"):
        for kernel in row["kernel"].split(", "):
            assert REGISTRY[kernel].grad_dtypes, kernel
        assert any(v is not None for v in row["tflops"].values()), row["kernel"]
    triton = next(r for r in stored_kernels("fwd") if r["kernel"] == "triton")
    records = json.loads((IMAGES / "triton_fwd_h200.json").read_text())["results"]
    cudnn = {(r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in records if r["impl"] == "sdpa-cudnn"}
    mine = {(r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in records if r["impl"] == "triton"}
    assert triton["cuDNN"] == pytest.approx({col: mine[col] / cudnn[col] for col in COLUMNS})


def test_stored_tables_refuse_a_bad_argument():
    with pytest.raises(ValueError, match="mode"):
        stored_records("triton_fwd_h200.json", "sideways")
    with pytest.raises(ValueError, match="value"):
        format_stored(stored_kernels("fwd"), "speed")
    with pytest.raises(ValueError, match="not a run"):
        stored_records("ceilings_h200.json")
    with pytest.raises(ValueError, match="decoding method"):
        stored_decoding(against="SDPA cudnn")


def test_stored_decoding_against_cudnn_from_the_records():
    data = json.loads((IMAGES / "decoding_h200.json").read_text())
    rows = stored_decoding()
    for key in ("mha", "gqa"):
        ms = {(r["method"], r["batch"], r["seqlen_k"]): r["ms"] for r in data[key] if r.get("ms")}
        ratios = {(b, n): ms["SDPA cuDNN", b, n] / v for (m, b, n), v in ms.items()
                  if m == "flash_decode" and ("SDPA cuDNN", b, n) in ms}
        mine = {(r["batch"], r["seqlen_k"]): r["speedup"] for r in rows if r["layout"] == key}
        assert mine == pytest.approx(ratios), key
        best = max(r["gbps"] for r in data[key] if r["method"] == "flash_decode" and r.get("gbps")) / 1000
        row = next(r for r in findings() if r["what"].startswith(f"decoding, {key.upper()}") and r["unit"] == "TB/s")
        assert row["high"] == pytest.approx(best)


def test_notebook_09_prints_the_findings_and_types_no_measurement():
    """The results moved from README to notebook 09, printed by its code cells; its prose types no measured
    number (a TFLOP/s, TB/s or × figure must be printed from images/*.json)."""
    nb = json.loads((IMAGES.parent / "notebooks" / "09_summary.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for call in ("findings()", "technique_gains()", "stored_decoding()", 'stored_kernels("fwd")',
                 'stored_kernels("bwd")', "environments("):
        assert call in code, call
    prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    typed = re.findall(r"\d[\d.,]*\s*(?:TFLOP/s|TB/s|GB/s|×(?!\d)|x\b)", prose)   # not 512×512
    assert not typed, typed


def test_list_and_no_gpu(capsys):
    assert main(["--list"]) == 0
    assert "ring_nccl" in capsys.readouterr().out
    import torch

    if not torch.cuda.is_available():
        assert main(["--only", "summary"]) == 2
    assert README.is_file()


def test_ratio_span_reads_one_runs_shapes():
    from utils.course.references import ratio_span

    rows = [dict(impl=i, head_dim=d, causal=False, seqlen=n, tflops=t)
            for i, d, n, t in [("a", 64, 1024, 50.0), ("b", 64, 1024, 100.0), ("a", 64, 4096, 90.0),
                               ("b", 64, 4096, 100.0), ("a", 128, 4096, 120.0), ("b", 128, 4096, 100.0),
                               ("a", 128, 8192, None), ("b", 128, 8192, 100.0)]]
    assert ratio_span(rows, "a", "b") == (0.5, 1.2)
    assert ratio_span(rows, "a", "b", min_seqlen=2048) == pytest.approx((0.9, 1.2))
    assert ratio_span(rows, "a", "b", min_seqlen=2048, head_dims=(128,)) == pytest.approx((1.2, 1.2))
    with pytest.raises(ValueError, match="no shape with both 'a' and 'c'"):
        ratio_span(rows, "a", "c")


def test_findings_read_flash_attention_4_from_its_own_run_when_the_peers_run_has_none(tmp_path, monkeypatch):
    """A stored peers_fa4_h200.json (issue 78's run) adds the course's best over FlashAttention-4, per pass and
    shape at N >= 4k, computed here from the records; without it, no such row."""
    from utils.course import references

    assert not [r for r in findings() if "FlashAttention-4" in r["what"]] or (IMAGES / "peers_fa4_h200.json").exists()
    for path in IMAGES.glob("*.json"):
        (tmp_path / path.name).symlink_to(path)
    records = []
    for r in json.loads((IMAGES / "peers_h200.json").read_text())["results"]:   # a stand-in run: cuDNN's rows
        if r["dtype"] == "bf16" and r["impl"] in ("triton", "gluon", "gluon_ws", "sdpa-cudnn"):
            records.append(r)
            if r["impl"] == "sdpa-cudnn" and r["tflops"]:   # as FlashAttention-4, 10 % faster
                records.append(dict(r, impl="flash-attn-4", tflops=r["tflops"] * 1.1))
    (tmp_path / "peers_fa4_h200.json").unlink(missing_ok=True)
    (tmp_path / "peers_fa4_h200.json").write_text(json.dumps(dict(results=records)))
    monkeypatch.setattr(references, "IMAGES", tmp_path)
    for mode, name in (("fwd", "forward"), ("bwd", "backward")):
        best, fa4 = {}, {}
        for r in records:
            shape = (r["head_dim"], r["causal"], r["seqlen"])
            if r["mode"] == mode and r["seqlen"] >= 4096 and r["tflops"] and r["accurate"]:
                if r["impl"] == "flash-attn-4":
                    fa4[shape] = r["tflops"]
                elif not r["impl"].startswith("sdpa-"):
                    best[shape] = max(best.get(shape, 0.0), r["tflops"])
        ratios = [best[s] / fa4[s] for s in best if s in fa4]
        assert len(ratios) == 2 * 2 * 3   # head dims, masks, N 4k-16k
        rows = [r for r in findings() if r["what"] == f"course's best {name} / FlashAttention-4, bf16"]
        assert len(rows) == 1 and rows[0]["source"] == "peers_fa4_h200.json"
        assert (rows[0]["low"], rows[0]["high"]) == pytest.approx((min(ratios), max(ratios)))
