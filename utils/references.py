"""Regenerate the course's stored reference results (images/*.json and their figures) with one command.

    python -m utils.references --list                 # what there is, and what each needs
    python -m utils.references                        # everything this machine can run
    python -m utils.references --only ceilings summary
    python -m utils.references --readme               # only rewrite README's results from the stored JSON

Each reference is its own command (listed below), run with COURSE_WRITE_IMAGES=1 so that figures land in
images/; each JSON records its environment (utils.gpu.environment: GPU, versions, date, command). README's
results section is then rendered from the JSON (tests/test_references.py fails if README and JSON disagree).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
README = ROOT / "README.md"
BEGIN, END = "<!-- results: begin (python -m utils.references --readme) -->", "<!-- results: end -->"

# name -> (GPUs it needs, the command after `python -m`). Order: quick first.
REFERENCES = {
    "ceilings": (1, ["utils.references", "--ceilings"]),
    "softmax": (1, ["utils.cuda_ext", "softmax", "--out", "images/06_softmax_h200.json"]),
    "triton_fwd": (1, ["utils.bench.forward", "--worklog", "--sdpa", "flash", "cudnn", "efficient",
                       "--name", "triton_fwd_h200"]),
    # host time against GPU time at small N (notebook 05b, step 3): the direct launch and Triton's dispatch, the
    # Gluon kernels and the Triton tutorial (.peer/, as for "peers" below; fp16, the one dtype it takes)
    "host": (1, ["utils.bench.host", "--name", "host_h200", "--impls", "gluon", "gluon_ws", "--dtype", "fp16",
                 "--peers", "triton-tutorial", "--tutorial", ".peer/06-fused-attention.py", "--tutorial-ref",
                 "release/3.6.x"]),
    "triton_sweep": (1, ["utils.bench.forward", "--sweep", "--sdpa", "cudnn", "--seqlens", "2048", "8192",
                         "--name", "triton_sweep_h200"]),
    # notebook 05b, section 5: each tuned tile with its loop in order and overlapped by one tile, 3 rounds
    "triton_overlap": (1, ["utils.bench.forward", "--impls", "triton", "--overlap", "--sdpa", "cudnn", "--seqlens",
                           "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_overlap_h200"]),
    # notebook 05b, section 5: each tuned tile with none, 1 in 2 and 1 in 4 exponentials on the FMA units
    "triton_exp2": (1, ["utils.bench.forward", "--impls", "triton", "--exp2-fma", "--sdpa", "cudnn", "flash",
                        "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_exp2_h200"]),
    # notebook 05b, section 9: the Gluon kernel (FlashAttention-3's wait(1)) per tile, beside the Triton kernel
    "gluon": (1, ["utils.bench.forward", "--impls", "triton", "gluon", "--gluon-tiles", "--sdpa", "cudnn", "flash",
                  "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_gluon_h200"]),
    # notebook 05b, section 10: the warp-specialised Gluon kernel per tile, beside the Gluon and Triton kernels
    "gluon_ws": (1, ["utils.bench.forward", "--impls", "triton", "gluon", "gluon_ws", "--ws-tiles", "--sdpa", "cudnn",
                     "flash", "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--name",
                     "05b_gluon_ws_h200"]),
    "cuda_flash": (1, ["utils.bench.forward", "--impls", "cuda_tiled", "cuda_naive", "--sdpa", "flash",
                       "--name", "06_cuda_flash_h200"]),
    "cuda_mma": (1, ["utils.bench.cuda_mma", "--name", "06b_cuda_mma_h200"]),
    "cuda_mma_steps89": (1, ["utils.bench.cuda_mma", "--steps", "exp2", "causal_skip", "split_kv", "occupancy",
                             "--seqlens", "4096", "8192", "16384", "--name", "06b_steps89_h200"]),
    "cuda_mma_steps910": (1, ["utils.bench.cuda_mma", "--steps", "causal_skip", "occupancy", "one_group",
                              "--seqlens", "4096", "8192", "16384", "--name", "06b_steps910_h200"]),
    # step 11 beside the steps it is compared with, each shape timed in 3 rounds of rotated order; the run that
    # made it the registry's "cuda"
    "cuda_mma_step11": (1, ["utils.bench.cuda_mma", "--steps", "causal_skip", "one_group", "warp_rows",
                            "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step11_h200"]),
    "mma_ncu_step11": (1, ["utils.bench.ncu", "--worklog", "mma", "--steps", "causal_skip", "warp_rows",
                           "--head-dim", "64", "--seqlen", "4096", "--name", "06b_ncu_step11_h200"]),  # needs ncu
    # steps 12 and 13 beside step 11, 3 rounds of rotated order: the run that made step 13 the registry's "cuda";
    # then one profiled launch of each at d = 128 (needs ncu)
    "cuda_mma_step13": (1, ["utils.bench.cuda_mma", "--steps", "warp_rows", "hoisted", "late_copy", "--seqlens",
                            "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step13_h200"]),
    "mma_ncu_step13": (1, ["utils.bench.ncu", "--worklog", "mma", "--steps", "warp_rows", "hoisted", "late_copy",
                           "--head-dim", "128", "--seqlen", "4096", "--name", "06b_ncu_step13_h200"]),
    # steps 14 and 15 beside step 13, 3 rounds of rotated order: the run issue 18's forward bar is read from, and
    # the run that made step 15 the registry's "cuda"; then one profiled launch of each at d = 128 (needs ncu)
    "cuda_mma_step15": (1, ["utils.bench.cuda_mma", "--steps", "late_copy", "rare_rescale", "whole_tiles",
                            "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step15_h200"]),
    "mma_ncu_step15": (1, ["utils.bench.ncu", "--worklog", "mma", "--steps", "late_copy", "rare_rescale",
                           "whole_tiles", "--head-dim", "128", "--seqlen", "4096", "--name", "06b_ncu_step15_h200"]),
    "hopper": (1, ["utils.bench.cuda_mma", "--worklog", "hopper", "--name", "06c_hopper_h200"]),  # sm_90 only
    "hopper_persistent": (1, ["utils.bench.cuda_mma", "--worklog", "hopper", "--steps", "v_direct", "three_consumers",
                              "persistent", "--seqlens", "4096", "8192", "16384", "--name", "06c_persistent_h200"]),
    "hopper_diagonal": (1, ["utils.bench.cuda_mma", "--worklog", "hopper", "--steps", "three_consumers",
                            "head_groups", "own_diagonal", "--seqlens", "4096", "8192", "16384",
                            "--name", "06c_diagonal_h200"]),
    # sm_90 only: the last Hopper steps side by side on every shape, each timed in 5 rounds of rotated order;
    # the run issue 19's bar is read from
    "hopper_final": (1, ["utils.bench.cuda_mma", "--worklog", "hopper", "--steps", "three_consumers", "own_diagonal",
                         "tma_store", "--seqlens", "4096", "8192", "16384", "--rounds", "5",
                         "--name", "06c_tma_store_h200"]),
    # sm_90 only: 128-key tiles on "v_direct" without ping-pong's turns (what "wide_tiles" was measured with), beside
    # "v_direct" and the default step, each shape in 3 rounds of rotated order
    "hopper_wide_v_direct": (1, ["utils.bench.cuda_mma", "--worklog", "hopper", "--steps", "v_direct", "tma_store",
                                 "wide_v_direct", "--seqlens", "4096", "8192", "16384", "--rounds", "3",
                                 "--name", "06c_wide_v_direct_h200"]),
    # sm_90 only: where a block's time goes, from the kernel's own clock (notebook 06cw, section 5)
    "hopper_timeline": (1, ["utils.bench.timeline", "--name", "06c_timeline_h200"]),
    "hopper_ncu": (1, ["utils.bench.ncu", "--worklog", "hopper", "--name", "06c_ncu_h200"]),  # needs ncu
    "mma_ncu": (1, ["utils.bench.ncu", "--worklog", "mma", "--steps", "causal_skip", "split_kv", "--head-dim", "128",
                    "--seqlen", "4096", "--name", "06b_ncu_steps78_h200"]),
    # the Triton backward as registered and with its loads pinned (notebook 07, sections 8 and 9), beside SDPA's
    "backward": (1, ["utils.bench.backward", "--backends", "triton", "triton_pointer", "triton_tma",
                     "triton_tma_stats", "sdpa_flash", "sdpa_cudnn", "--rounds", "3", "--out", "images/07_backward_benchmark.json"]),
    # dQ added with atomics by the dK/dV pass against the dQ pass (notebook 07, section 10), beside cuDNN
    "backward_atomic": (1, ["utils.bench.backward", "--backends", "triton", "triton_atomic_dq", "sdpa_flash",
                            "sdpa_cudnn", "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--out",
                            "images/07_backward_atomic_h200.json"]),
    # and with one TMA bulk reduce-add per tile instead of an atomic add per element (section 10)
    "backward_reduce": (1, ["utils.bench.backward", "--backends", "triton", "triton_atomic_dq", "triton_reduce_dq",
                            "sdpa_flash", "sdpa_cudnn", "--seqlens", "4096", "8192", "16384", "--rounds", "3",
                            "--out", "images/07_backward_reduce_h200.json"]),
    # the one-kernel warp-specialised Gluon backward (section 11; sm_90) beside the Triton backward and SDPA's
    "backward_gluon": (1, ["utils.bench.backward", "--backends", "triton", "gluon_bwd", "gluon_bwd_by_head",
                           "gluon_bwd_grouped", "sdpa_flash", "sdpa_cudnn",
                           "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--out",
                           "images/07_gluon_bwd_h200.json"]),
    # one profiled launch of each pass of the Triton backward per load step (notebook 07, sections 8 and 9;
    # needs ncu): d = 64 without a mask, d = 128 without and with one
    "backward_ncu_d64": (1, ["utils.bench.ncu", "--worklog", "triton_bwd", "--head-dim", "64", "--seqlen", "4096",
                             "--steps", "pointer", "tma", "--name", "07_ncu_d64_h200"]),
    "backward_ncu_d128": (1, ["utils.bench.ncu", "--worklog", "triton_bwd", "--seqlen", "4096",
                              "--steps", "pointer", "tma", "--name", "07_ncu_d128_h200"]),
    "backward_ncu_d128_causal": (1, ["utils.bench.ncu", "--worklog", "triton_bwd", "--seqlen", "4096", "--causal",
                                     "--name", "07_ncu_d128_causal_h200"]),
    # the tiles of the Triton backward's two passes, each candidate timed in the whole backward (default_config)
    "backward_tiles": (1, ["utils.bench.backward_tiles", "--out", "images/07_backward_tiles_h200.json"]),
    # notebook 06b's tensor-core backward, every step of its worklog beside SDPA's FA2 and cuDNN backwards
    "cuda_backward": (1, ["utils.bench.backward", "--backends", "cuda_atomic_dq", "cuda_dq_pass", "cuda_narrow_rows",
                          "cuda_two_blocks", "cuda_per_head_dim", "cuda_unroll_two", "cuda_mask_after",
                          "cuda_warp_tiles", "cuda_hoisted", "sdpa_flash", "sdpa_cudnn",
                          "--seqlens", "4096", "8192", "16384", "--out", "images/06b_cuda_backward_h200.json"]),
    "decoding": (1, ["utils.bench.decoding", "--out", "images"]),
    "launch_floor": (1, ["utils.bench.decoding", "--launch-floor", "--out", "images"]),
    "decoding_tiles": (1, ["utils.bench.decoding", "--tile-sweep", "--out", "images"]),
    "decoding_paged": (1, ["utils.bench.decoding", "--paged", "--out", "images"]),
    "decoding_latency": (1, ["utils.bench.decoding", "--latency", "--out", "images"]),
    "flex": (1, ["utils.bench.flex"]),
    # the Triton tutorial beside the course, from the file of the GPU machine's Triton (3.6: release/3.6.x) put in
    # the ignored .peer/ (utils.bench.peers says how); the sweep records the file's SHA-256
    "peers": (1, ["utils.bench.peers_sweep", "--tutorial", ".peer/06-fused-attention.py", "--tutorial-ref",
                  "release/3.6.x", "--impls", "triton", "gluon", "gluon_ws", "--name", "peers_h200",
                  "--rounds", "3"]),
    "summary": (1, ["utils.bench.summary"]),
    "ring_nccl": (2, ["utils.ring_attention", "--backend", "nccl", "--world-size", "2"]),
    "ring_comm": (2, ["utils.bench.ring_comm", "--backend", "nccl", "--world-size", "2", "--out", "images"]),
}


def measure_ceilings(path: Path | None = None) -> dict:
    """The two roofs of notebook 01's roofline, measured on this GPU: a large bf16 matrix product (TFLOP/s, on
    random data) and a large device-to-device copy (TB/s, bytes read plus bytes written)."""
    import torch
    import triton

    from utils import gpu

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    src = torch.randn(2**29, device="cuda", dtype=torch.float16)   # 1 GiB, far beyond the L2
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    result = dict(environment=gpu.environment("python -m utils.references --only ceilings"),
                  matmul=dict(shape=[n, n, n], dtype="bfloat16", ms=matmul_ms, tflops=2 * n**3 / matmul_ms / 1e9),
                  copy=dict(bytes=2 * src.numel() * src.element_size(), ms=copy_ms,
                            tb_per_s=2 * src.numel() * src.element_size() / copy_ms / 1e9))
    tag = "h200" if "H200" in torch.cuda.get_device_name() else torch.cuda.get_device_name().split()[-1].lower()
    path = path or IMAGES / f"ceilings_{tag}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{path.name}: bf16 matmul {result['matmul']['tflops']:.0f} TFLOP/s, copy "
          f"{result['copy']['tb_per_s']:.2f} TB/s")
    return result


# ---- README's results, rendered from the JSON ------------------------------------------------------------

def _load(name: str) -> dict:
    return json.loads((IMAGES / name).read_text())


def _by(rows, *keys, value="tflops"):
    return {tuple(r[k] for k in keys): r[value] for r in rows if r.get(value)}


def _fmt_k(n: int) -> str:
    return f"{n // 1024}k"


def _span(values) -> str:
    return f"{min(values):.2f}–{max(values):.2f}×"


def _gluon_and_tutorial() -> str:
    """README's sentences on the Gluon kernels (05b, 07) against cuDNN and on the course against the Triton
    tutorial (images/peers_h200.json: the course's fastest kernel per shape, fp16, the tutorial's one dtype)."""
    from utils.bench.backward import ratios as backward_ratios
    from utils.bench.peers_sweep import versus

    g = _by(_load("05b_gluon_ws_h200.json")["results"], "impl", "head_dim", "causal", "seqlen")
    fwd = [max(g.get((i, d, c, n), 0) for i in ("gluon", "gluon_ws")) / value
           for (i, d, c, n), value in g.items() if i == "sdpa-cudnn" and n >= 4096]
    bwd = [r for (n, _, _), r in backward_ratios(_load("07_gluon_bwd_h200.json")["rows"], "gluon_bwd",
                                                 "sdpa_cudnn").items() if n >= 4096]
    peers = _load("peers_h200.json")
    course = tuple(dict.fromkeys(r["impl"] for r in peers["results"]
                                 if not r["impl"].startswith(("sdpa-", "triton-tutorial"))))
    rows = versus(peers["results"], course)
    ref = next(iter(peers["peers"].values()))["ref"]
    text = (f"The Gluon kernels go further: the forwards of notebook 05b (`gluon`, `gluon_ws`: the faster per "
            f"shape) are {_span(fwd)} cuDNN at N ≥ 4k (`images/05b_gluon_ws_h200.json`), and the one-kernel "
            f"Gluon backward of notebook 07 is {_span(bwd)} cuDNN's backward at N ≥ 4k "
            f"(`images/07_gluon_bwd_h200.json`). "
            f"Beside the official Triton tutorial's fused attention (its {ref} file, fp16: the one dtype it "
            f"supports; `images/peers_h200.json`, one run with SDPA's backends), the course's fastest kernel per "
            f"shape (of `{'`, `'.join(course)}`) is")
    def against_tutorial(long):   # the spans of the forward's and the backward's ratios, N >= 2k or below
        return " and ".join(
            _span([r["ratio"] for r in rows if r["mode"] == mode and (r["seqlen"] >= 2048) == long])
            + f" the tutorial's {name}" for mode, name in (("fwd", "forward"), ("bwd", "backward")))

    short = sorted({_fmt_k(r["seqlen"]) for r in rows if r["seqlen"] < 2048})
    text += f" {against_tutorial(True)} at N ≥ 2k"
    if short:
        text += (f", and {against_tutorial(False)} at N = {', '.join(short)}, where the CPU's time per call, not "
                 "the kernel's, sets the pace (notebook 05b, section 7)")
    below = [r for r in rows if r["ratio"] < 1.0]
    text += ("; it is below the tutorial on " + ", ".join(
        f"the {'forward' if r['mode'] == 'fwd' else 'backward'} at d={r['head_dim']}"
        f"{' causal' if r['causal'] else ''}, N={_fmt_k(r['seqlen'])} ({r['ratio']:.2f}×)" for r in below)
        + f": {len(below)} of {len(rows)} shapes") if below else f": at least its speed on all {len(rows)} shapes"

    def spread(mode, sdpa, shortest):   # the course's fastest per shape over one SDPA backend, both dtypes
        return _span([r["ratio"] for r in versus(peers["results"], course, (sdpa,))
                      if r["mode"] == mode and r["seqlen"] >= shortest])

    return text + (f". In the same run, fp16 and bf16, the course's fastest forward per shape is "
                   f"{spread('fwd', 'sdpa-cudnn', 4096)} cuDNN at N ≥ 4k and {spread('fwd', 'sdpa-flash', 1024)} "
                   f"FlashAttention-2 at N ≥ 1k, and its fastest backward {spread('bwd', 'sdpa-cudnn', 4096)} "
                   f"cuDNN's at N ≥ 4k.")


def results_markdown() -> str:
    """README's results section, every number read from images/*.json."""
    fwd = _load("triton_fwd_h200.json")
    env = fwd["environment"]
    f = _by(fwd["results"], "impl", "head_dim", "causal", "seqlen")
    cols = [(64, False, 4096), (64, False, 16384), (128, False, 4096), (128, False, 16384), (128, True, 16384)]
    head = " | ".join(f"d={d}{' causal' if c else ''}, N={_fmt_k(n)}" for d, c, n in cols)
    rows = [("course Triton forward (`triton`: notebook 05, tuned in 05b)", "triton"),
            ("the same kernel before notebook 05b (fixed tiles)", "triton 05 (fixed tiles)"),
            ("SDPA FlashAttention-2 backend", "sdpa-flash"),
            ("SDPA cuDNN backend (PyTorch's default on the H200)", "sdpa-cudnn")]
    lines = [f"| forward, TFLOP/s | {head} |", "|---" * (len(cols) + 1) + "|"]
    for label, impl in rows:
        lines.append(f"| {label} | " + " | ".join(f"{f[impl, d, c, n]:.0f}" for d, c, n in cols) + " |")

    bwd = _load("07_backward_benchmark.json")
    b = _by(bwd["rows"], "backend", "head_dim", "causal", "seqlen")
    bcols = [(64, False, 4096), (64, False, 16384), (128, False, 4096), (128, False, 16384), (128, True, 16384)]
    lines += ["", "| backward, TFLOP/s (notebook 07) | "
              + " | ".join(f"d={d}{' causal' if c else ''}, N={_fmt_k(n)}" for d, c, n in bcols) + " |",
              "|---" * (len(bcols) + 1) + "|"]
    for label, impl in [("course Triton backward", "triton"), ("SDPA FlashAttention-2 backward", "sdpa_flash"),
                        ("SDPA cuDNN backward", "sdpa_cudnn")]:
        lines.append(f"| {label} | " + " | ".join(f"{b[impl, d, c, n]:.0f}" for d, c, n in bcols) + " |")

    ratios = [f[("triton", d, c, n)] / f[("sdpa-cudnn", d, c, n)] for (_, d, c, n) in f if _ == "triton"
              and n >= 4096 and ("sdpa-cudnn", d, c, n) in f]
    fa2 = [f[("triton", d, c, n)] / f[("sdpa-flash", d, c, n)] for (_, d, c, n) in f if _ == "triton"
           and n >= 2048 and ("sdpa-flash", d, c, n) in f]
    bratio = [b[("triton", d, c, n)] / b[("sdpa_cudnn", d, c, n)] for (_, d, c, n) in b if _ == "triton"
              and ("sdpa_cudnn", d, c, n) in b]
    from utils.bench.cuda_mma import step_label
    from utils.cuda_ext import MMA_DEFAULT_STEP

    mma_run = "06b_step15_h200.json"  # the run of the registry's step (cuda_ext.MMA_DEFAULT_STEP)
    m = _by(_load(mma_run)["results"], "impl", "head_dim", "causal", "seqlen")
    final = step_label(MMA_DEFAULT_STEP)
    cuda = [(m[final, d, c, n], m[final, d, c, n] / m["sdpa-flash", d, c, n]) for (i, d, c, n) in m
            if i == final and n >= 4096 and ("sdpa-flash", d, c, n) in m]
    summary = (f"On N ≥ 2k the Triton forward is {min(fa2):.2f}–{max(fa2):.2f}× SDPA's FlashAttention-2 "
               f"backend, and {min(ratios):.2f}–{max(ratios):.2f}× cuDNN at N ≥ 4k; the backward is "
               f"{min(bratio):.2f}–{max(bratio):.2f}× cuDNN's. {_gluon_and_tutorial()} "
               f"The CUDA tensor-core kernel of notebook 06b "
               f"(its registered step, `{MMA_DEFAULT_STEP}`) reaches {min(c[0] for c in cuda):.0f}–"
               f"{max(c[0] for c in cuda):.0f} TFLOP/s at N ≥ 4k ({min(c[1] for c in cuda):.2f}–"
               f"{max(c[1] for c in cuda):.2f}× FlashAttention-2; `images/{mma_run}`).")
    from utils.bench.backward import ratios as backward_ratios
    from utils.cuda_backward import BWD_DEFAULT_STEP

    cb = backward_ratios(_load("06b_cuda_backward_h200.json")["rows"], f"cuda_{BWD_DEFAULT_STEP}")  # × FA2
    by_d = {d: [r for (_, dim, _), r in cb.items() if dim == d] for d in (64, 128)}
    summary += (f" Its backward (step `{BWD_DEFAULT_STEP}`) reaches " + " and ".join(
        f"{min(v):.2f}–{max(v):.2f}× (d={d})" for d, v in by_d.items()) + " FlashAttention-2's backward at N ≥ 4k "
        "(`images/06b_cuda_backward_h200.json`).")
    best, vs = {}, {}  # per shape: the best step's TFLOP/s and ratio to cuDNN, over the runs (each side by side)
    hopper_runs = ("06c_hopper_h200.json", "06c_vdirect_h200.json", "06c_three_h200.json", "06c_persistent_h200.json",
                   "06c_diagonal_h200.json", "06c_tma_store_h200.json")
    for name in hopper_runs:
        h = _by(_load(name)["results"], "impl", "head_dim", "causal", "seqlen")
        for (i, d, c, n), value in h.items():
            if i.startswith("h") and n >= 4096 and ("sdpa-cudnn", d, c, n) in h:
                best[d, c, n] = max(best.get((d, c, n), 0), value)
                vs[d, c, n] = max(vs.get((d, c, n), 0), value / h["sdpa-cudnn", d, c, n])
    summary += (f" The Hopper kernel of notebook 06c (`wgmma`, TMA, warp specialisation; its best step per shape) "
                f"reaches {min(best.values()):.0f}–{max(best.values()):.0f} TFLOP/s at N ≥ 4k, "
                f"{min(vs.values()):.2f}–{max(vs.values()):.2f}× cuDNN "
                "(`images/" + "`, `".join(hopper_runs) + "`)")
    from utils.hopper import DEFAULT_STEP

    last = _by(_load(hopper_runs[-1])["results"], "impl", "head_dim", "causal", "seqlen")
    default = [value / last["sdpa-cudnn", d, c, n] for (i, d, c, n), value in last.items()
               if i == step_label(DEFAULT_STEP, "hopper") and n >= 4096]
    summary += (f"; its default step, `{DEFAULT_STEP}`, is {min(default):.2f}–{max(default):.2f}× cuDNN in "
                f"the last run alone.")
    dec = _load("decoding_h200.json")
    decoding = []
    for key, label in (("mha", "MHA, 16 heads"), ("gqa", "GQA, 16 query / 2 KV heads")):
        ours = [r for r in dec[key] if r["method"] == "flash_decode" and r.get("gbps")]
        best = max(ours, key=lambda r: r["gbps"])
        cudnn = {(r["batch"], r["seqlen_k"]): r["ms"] for r in dec[key] if r["method"] == "SDPA cuDNN" and r.get("ms")}
        vs = [cudnn[r["batch"], r["seqlen_k"]] / r["ms"] for r in ours if (r["batch"], r["seqlen_k"]) in cudnn]
        decoding.append(f"{label}: up to {best['gbps'] / 1000:.1f} TB/s (batch {best['batch']}, "
                        f"{_fmt_k(best['seqlen_k'])} tokens), {min(vs):.2f}–{max(vs):.2f}× cuDNN's speed")
    ring = _load("ring_nccl.json")["results"]
    ring_text = ", ".join(f"{r['single_device_ms'] / r['ring_ms']:.2f}× one GPU "
                          f"({'causal, ' + r['case']['layout'] if r['case']['causal'] else 'full attention'})"
                          for r in ring)
    summary += (" Decoding one token against a KV cache (notebook 08, d=128, bf16, batch 1–64, caches of 4k–128k "
                "tokens; `images/decoding_h200.json`): " + "; ".join(decoding) + ". Ring attention over 2 GPUs "
                f"(NCCL, {_fmt_k(ring[0]['case']['seqlen'])} tokens; `images/ring_nccl.json`): {ring_text}.")
    measured = (f"Measured on {env['gpu']} with torch {env['torch']} and Triton {env['triton']} "
                f"(`images/triton_fwd_h200.json`, `07_backward_benchmark.json`, `{mma_run}`); "
                f"the course pins torch 2.13.0 / Triton 3.7.1, which the GPU machine did not have.")
    return "\n".join([*lines, "", summary, "", measured])


def update_readme(check: bool = False) -> bool:
    """Rewrite README's results section from the JSON; with `check`, only say whether it is up to date."""
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no results section between {BEGIN!r} and {END!r}")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + results_markdown() + "\n" + text[end:]
    if check:
        return new == text
    README.write_text(new)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(REFERENCES), help="default: all this machine can run")
    parser.add_argument("--list", action="store_true", help="list the references and their commands")
    parser.add_argument("--readme", action="store_true", help="only rewrite README's results from the JSON")
    parser.add_argument("--ceilings", action="store_true", help=argparse.SUPPRESS)  # the "ceilings" reference
    args = parser.parse_args(argv)
    if args.list:
        for name, (gpus, command) in REFERENCES.items():
            print(f"{name:13s} {gpus} GPU{'s' if gpus > 1 else ' '}  python -m {' '.join(command)}")
        return 0
    if args.ceilings:
        measure_ceilings()
        return 0
    if not args.readme:
        import torch

        if not torch.cuda.is_available():
            print("the references are measured on a CUDA GPU (see --list)", file=sys.stderr)
            return 2
        failed = []
        for name in args.only or list(REFERENCES):
            gpus, command = REFERENCES[name]
            if torch.cuda.device_count() < gpus:
                print(f"{name}: skipped, needs {gpus} GPUs")
                continue
            print(f"== {name}: python -m {' '.join(command)}", flush=True)
            env = dict(os.environ, COURSE_WRITE_IMAGES="1")
            if subprocess.run([sys.executable, "-m", *command], cwd=ROOT, env=env).returncode != 0:
                failed.append(name)
        if failed:
            print(f"failed: {', '.join(failed)}", file=sys.stderr)
            return 1
    update_readme()
    print("README.md: results rewritten from images/*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
