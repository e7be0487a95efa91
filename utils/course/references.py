"""Regenerate the course's stored reference results (images/*.json and their figures) with one command.

    python -m utils.course.references --list                 # what there is, and what each needs
    python -m utils.course.references                        # everything this machine can run
    python -m utils.course.references --only ceilings summary
    python -m utils.course.references --readme               # only rewrite README's results from the stored JSON

Each reference is its own command (listed below), run with COURSE_WRITE_IMAGES=1 so that figures land in
images/; each JSON records its environment (utils.gpu.environment: GPU, versions, date, command). README's
results section is then rendered from the JSON (tests/test_references.py fails if README and JSON disagree).
Notebook 09 prints the rest from the same files: findings() (the course's results as ranges), stored_kernels()
(every registered kernel, forward and backward), stored_decoding() and technique_gains().
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
README = ROOT / "README.md"
BEGIN, END = "<!-- results: begin (python -m utils.course.references --readme) -->", "<!-- results: end -->"


def _gluon_bwd_steps(name: str, *backends: str, masks: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """The entry of a stored run of the Gluon backward's steps (worklog 07w, section 5): `backends` with both
    masks (or `masks`), at 2k to 16k keys, 3 rounds, into images/<name>.json; one GPU."""
    mask_args = ["--masks", *masks] if masks else []
    return (1, ["utils.course.bench.backward", "--backends", *backends, *mask_args,
                "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "3", "--out", f"images/{name}.json"])


# name -> (GPUs it needs, the command after `python -m`). Order: quick first.
REFERENCES = {
    "ceilings": (1, ["utils.course.references", "--ceilings"]),
    "softmax": (1, ["utils.course.bench.softmax", "--out", "images/06_softmax_h200.json"]),
    "triton_lesson": (1, ["utils.course.bench.forward", "--impls", "triton_lesson", "triton", "--sdpa", "flash", "cudnn",
                          "--seqlens", "2048", "4096", "16384", "--rounds", "2", "--name", "triton_lesson_h200"]),
    "triton_fwd": (1, ["utils.course.bench.forward", "--worklog", "--sdpa", "flash", "cudnn", "efficient",
                       "--name", "triton_fwd_h200"]),
    # host time against GPU time at small N (notebook 05b, step 3): the direct launch and Triton's dispatch, the
    # Gluon kernels and the Triton tutorial (.peer/, as for "peers" below; fp16, the one dtype it takes)
    "host": (1, ["utils.course.bench.host", "--name", "host_h200", "--impls", "gluon", "gluon_ws", "--dtype", "fp16",
                 "--peers", "triton-tutorial", "--tutorial", ".peer/06-fused-attention.py", "--tutorial-ref",
                 "release/3.6.x"]),
    # worklog 06cw section 7: the Hopper kernel's host and GPU time per call beside FlashAttention-4 (where
    # flash-attn-4 is installed: ../shared/tools/fa4_pack.sh) and cuDNN, forward and backward
    "host_fa4": (1, ["utils.course.bench.host", "--name", "host_fa4_h200", "--impls", "cuda_hopper", "--peers",
                     "flash-attn-4", "--seqlens", "1024", "2048", "8192", "--calls", "20", "--reps", "3"]),
    "triton_sweep": (1, ["utils.course.bench.forward", "--sweep", "--sdpa", "cudnn", "--seqlens", "2048", "8192",
                         "--name", "triton_sweep_h200"]),
    # notebook 05b, section 5: each tuned tile with its loop in order and overlapped by one tile, 3 rounds
    "triton_overlap": (1, ["utils.course.bench.forward", "--impls", "triton", "--overlap", "--sdpa", "cudnn", "--seqlens",
                           "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_overlap_h200"]),
    # notebook 05b, section 5: each tuned tile with none, 1 in 2 and 1 in 4 exponentials on the FMA units
    "triton_exp2": (1, ["utils.course.bench.forward", "--impls", "triton", "--exp2-fma", "--sdpa", "cudnn", "flash",
                        "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_exp2_h200"]),
    # notebook 05b, section 9: the Gluon kernel (FlashAttention-3's wait(1)) per tile, beside the Triton kernel
    "gluon": (1, ["utils.course.bench.forward", "--impls", "triton", "gluon", "--gluon-tiles", "--sdpa", "cudnn", "flash",
                  "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--name", "05b_gluon_h200"]),
    # notebook 05b, section 10: the warp-specialised Gluon kernel per tile, beside the Gluon and Triton kernels
    "gluon_ws": (1, ["utils.course.bench.forward", "--impls", "triton", "gluon", "gluon_ws", "--ws-tiles", "--sdpa", "cudnn",
                     "flash", "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--name",
                     "05b_gluon_ws_h200"]),
    # issue 78: three consumer warpgroups (192-row programs) at head dim 64, beside gluon_ws's tiles
    "gluon_ws3": (1, ["utils.course.bench.forward", "--impls", "gluon_ws", "--ws-tiles", "--ws3-tiles", "--sdpa",
                      "cudnn", "--head-dims", "64", "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "2",
                      "--name", "05b_gluon_ws3_h200"]),
    # worklog 05bw: the warp-specialised forwards with the consumers' products in turns (ping-pong) beside them
    "gluon_pingpong": (1, ["utils.course.bench.forward", "--impls", "gluon_ws", "gluon_ws3", "--ws-pingpong", "--sdpa",
                           "cudnn", "flash", "--seqlens", "4096", "16384", "--name", "05b_gluon_pingpong_h200"]),
    # worklog 05bw section 6: the Gluon forwards as they are ("before") and with the whole softmax in each arm of the
    # mask's branch ("after": the patch section 6 shows, applied by hand), two runs of each tree alternated
    "sass_split": (1, ["utils.course.bench.forward", "--impls", "gluon", "gluon_ws", "gluon_ws3", "--sdpa", "cudnn",
                       "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "1", "--name",
                       "05bw_sass_split_before_0", "--out-dir", "images"]),
    # worklog 05bw section 7: the Gluon forwards as they are ("before"), with a branch before wait(0) ("branch") and
    # with membar.cta there ("membar"; both the patch section 7 shows, applied by hand), two runs of each in turn
    "sass_fence": (1, ["utils.course.bench.forward", "--impls", "gluon", "gluon_ws", "gluon_ws3", "--sdpa",
                       "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "1", "--name",
                       "05bw_fence_before_0", "--out-dir", "images"]),
    # worklog 05bw section 7: gluon_ws and gluon_ws3 as they are ("before") and with every consumer thread arriving
    # on the "empty" barriers ("after", by hand), two runs of each in turn
    "release_per_thread": (1, ["utils.course.bench.forward", "--impls", "gluon_ws", "gluon_ws3", "--sdpa", "cudnn",
                               "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "1", "--name",
                               "05bw_release_before_0", "--out-dir", "images"]),
    "cuda_flash": (1, ["utils.course.bench.forward", "--impls", "cuda_tiled", "cuda_naive", "--sdpa", "flash",
                       "--name", "06_cuda_flash_h200"]),
    "cuda_mma": (1, ["utils.course.bench.cuda_mma", "--name", "06b_cuda_mma_h200"]),
    "cuda_mma_steps89": (1, ["utils.course.bench.cuda_mma", "--steps", "exp2", "causal_skip", "split_kv", "occupancy",
                             "--seqlens", "4096", "8192", "16384", "--name", "06b_steps89_h200"]),
    "cuda_mma_steps910": (1, ["utils.course.bench.cuda_mma", "--steps", "causal_skip", "occupancy", "one_group",
                              "--seqlens", "4096", "8192", "16384", "--name", "06b_steps910_h200"]),
    # step 11 beside the steps it is compared with, each shape timed in 3 rounds of rotated order; the run that
    # made it the registry's "cuda"
    "cuda_mma_step11": (1, ["utils.course.bench.cuda_mma", "--steps", "causal_skip", "one_group", "warp_rows",
                            "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step11_h200"]),
    "mma_ncu_step11": (1, ["utils.course.bench.ncu", "--worklog", "mma", "--steps", "causal_skip", "warp_rows",
                           "--head-dim", "64", "--seqlen", "4096", "--name", "06b_ncu_step11_h200"]),  # needs ncu
    # steps 12 and 13 beside step 11, 3 rounds of rotated order: the run that made step 13 the registry's "cuda";
    # then one profiled launch of each at d = 128 (needs ncu)
    "cuda_mma_step13": (1, ["utils.course.bench.cuda_mma", "--steps", "warp_rows", "hoisted", "late_copy", "--seqlens",
                            "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step13_h200"]),
    "mma_ncu_step13": (1, ["utils.course.bench.ncu", "--worklog", "mma", "--steps", "warp_rows", "hoisted", "late_copy",
                           "--head-dim", "128", "--seqlen", "4096", "--name", "06b_ncu_step13_h200"]),
    # steps 14 and 15 beside step 13, 3 rounds of rotated order: the run issue 18's forward bar is read from, and
    # the run that made step 15 the registry's "cuda"; then one profiled launch of each at d = 128 (needs ncu)
    "cuda_mma_step15": (1, ["utils.course.bench.cuda_mma", "--steps", "late_copy", "rare_rescale", "whole_tiles",
                            "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--name", "06b_step15_h200"]),
    "mma_ncu_step15": (1, ["utils.course.bench.ncu", "--worklog", "mma", "--steps", "late_copy", "rare_rescale",
                           "whole_tiles", "--head-dim", "128", "--seqlen", "4096", "--name", "06b_ncu_step15_h200"]),
    "hopper": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--name", "06c_hopper_h200"]),  # sm_90 only
    # sm_90 only: step 17 (K and V on full barriers of their own) beside the default step, 2 rounds (06cw section 6)
    "hopper_split_full": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "tma_store", "split_full",
                              "--seqlens", "4096", "16384", "--rounds", "2", "--name", "06c_split_full_h200"]),
    # worklog 06cw section 6: step 18 (128-key tiles on step 15) beside step 15, one round
    "hopper_wide_tma_store": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "tma_store",
                                  "wide_tma_store", "--seqlens", "4096", "16384", "--rounds", "1", "--name",
                                  "06c_wide_tma_store_h200"]),
    # worklog 06cw section 6: steps 18-20 (a third 128-key stage; causal blocks longest first) beside step 15
    "hopper_wide_stages": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "tma_store",
                               "wide_tma_store", "wide_stages", "tma_heavy_first", "--seqlens", "2048", "4096", "8192",
                               "16384", "--rounds", "2", "--name", "06c_wide_stages_h200"]),
    "hopper_one_p": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "tma_store", "wide_stages",
                         "one_p", "one_p_turns", "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "2",
                         "--name", "06c_one_p_h200"]),
    "hopper_one_p_causal": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "wide_stages",
                                "one_p", "one_p_diagonal", "one_p_heavy_first", "--seqlens", "2048", "4096", "8192",
                                "16384", "--rounds", "3", "--name", "06c_one_p_causal_h200"]),
    "hopper_one_p_persistent": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "wide_stages",
                                    "one_p", "one_p_persistent", "one_p_head_groups", "--seqlens", "2048",
                                    "4096", "8192", "16384", "--rounds", "3", "--name",
                                    "06c_one_p_persistent_h200"]),
    "hopper_uniform": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "wide_stages",
                           "wide_uniform", "wide_lazy", "one_p", "one_p_uniform", "one_p_lazy",
                           "--seqlens", "2048", "4096", "8192", "16384",
                           "--rounds", "3", "--name", "06c_uniform_h200"]),
    "hopper_tree": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "wide_uniform",
                        "wide_lazy", "wide_tree", "one_p_lazy", "one_p_tree", "--seqlens", "2048", "4096", "8192",
                        "16384", "--rounds", "3", "--name", "06c_tree_h200"]),
    "hopper_desc": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "one_p_lazy",
                        "one_p_desc", "wide_lazy", "wide_desc", "--seqlens", "2048", "4096", "8192", "16384",
                        "--rounds", "3", "--name", "06c_desc_h200"]),
    "hopper_desc_diagonal": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "one_p_desc",
                                 "desc_diagonal", "desc_heavy_first", "wait_suspend", "--seqlens", "2048", "4096", "8192",
                                 "16384", "--rounds", "3", "--name", "06c_desc_diagonal_h200"]),
    "hopper_persistent": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "v_direct", "three_consumers",
                              "persistent", "--seqlens", "4096", "8192", "16384", "--name", "06c_persistent_h200"]),
    "hopper_diagonal": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "three_consumers",
                            "head_groups", "own_diagonal", "--seqlens", "4096", "8192", "16384",
                            "--name", "06c_diagonal_h200"]),
    # sm_90 only: the last Hopper steps side by side on every shape, each timed in 5 rounds of rotated order;
    # the run issue 19's bar is read from
    "hopper_final": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "three_consumers", "own_diagonal",
                         "tma_store", "--seqlens", "4096", "8192", "16384", "--rounds", "5",
                         "--name", "06c_tma_store_h200"]),
    # sm_90 only: 128-key tiles on "v_direct" without ping-pong's turns (what "wide_tiles" was measured with), beside
    # "v_direct" and the default step, each shape in 3 rounds of rotated order
    "hopper_wide_v_direct": (1, ["utils.course.bench.cuda_mma", "--worklog", "hopper", "--steps", "v_direct", "tma_store",
                                 "wide_v_direct", "--seqlens", "4096", "8192", "16384", "--rounds", "3",
                                 "--name", "06c_wide_v_direct_h200"]),
    # sm_90 only: where a block's time goes, from the kernel's own clock (notebook 06cw, section 5)
    "hopper_timeline": (1, ["utils.course.bench.timeline", "--name", "06c_timeline_h200"]),
    "hopper_ncu": (1, ["utils.course.bench.ncu", "--worklog", "hopper", "--name", "06c_ncu_h200"]),  # needs ncu
    "mma_ncu": (1, ["utils.course.bench.ncu", "--worklog", "mma", "--steps", "causal_skip", "split_kv", "--head-dim", "128",
                    "--seqlen", "4096", "--name", "06b_ncu_steps78_h200"]),
    # the Triton backward as registered and with its loads pinned (worklog 07w, sections 2 and 3), beside SDPA's
    "backward": (1, ["utils.course.bench.backward", "--backends", "triton", "triton_pointer", "triton_tma",
                     "triton_tma_stats", "sdpa_flash", "sdpa_cudnn", "--rounds", "3", "--out", "images/07_backward_benchmark.json"]),
    # dQ added with atomics by the dK/dV pass against the dQ pass (worklog 07w, section 4), beside cuDNN
    "backward_atomic": (1, ["utils.course.bench.backward", "--backends", "triton", "triton_atomic_dq", "sdpa_flash",
                            "sdpa_cudnn", "--seqlens", "4096", "8192", "16384", "--rounds", "3", "--out",
                            "images/07_backward_atomic_h200.json"]),
    # and with one TMA bulk reduce-add per tile instead of an atomic add per element (section 4)
    "backward_reduce": (1, ["utils.course.bench.backward", "--backends", "triton", "triton_atomic_dq", "triton_reduce_dq",
                            "sdpa_flash", "sdpa_cudnn", "--seqlens", "4096", "8192", "16384", "--rounds", "3",
                            "--out", "images/07_backward_reduce_h200.json"]),
    # the one-kernel warp-specialised Gluon backward (section 5; sm_90) beside the Triton backward and SDPA's
    "backward_gluon": (1, ["utils.course.bench.backward", "--backends", "triton", "gluon_bwd", "gluon_bwd_by_head",
                           "gluon_bwd_grouped", "sdpa_flash", "sdpa_cudnn",
                           "--seqlens", "1024", "2048", "4096", "8192", "16384", "--rounds", "3", "--out",
                           "images/07_gluon_bwd_h200.json"]),
    # ... with dSᵀ formed before dV's product is issued and after it, on every shape (section 5, Config.ds_first)
    "backward_gluon_order": _gluon_bwd_steps("07w_gluon_bwd_order_h200", "gluon_bwd_ds_first", "gluon_bwd_dv_first"),
    # ... with P computed as scale·P and as P, on every shape (section 5, Config.scaled_p)
    "backward_gluon_scale": _gluon_bwd_steps("07w_gluon_bwd_scale_h200", "gluon_bwd_scaled_p", "gluon_bwd_plain_p"),
    # ... with dQ staged and accumulated in register order and by rows, on every shape (Config.dq_fragments)
    "backward_gluon_fragments": _gluon_bwd_steps("07w_gluon_bwd_fragments_h200", "gluon_bwd_fragments",
                                                 "gluon_bwd_row_boxes"),
    # ... with the masked tiles in a loop of their own and tested in the one loop, on every shape (Config.mask_loop)
    "backward_gluon_mask_loop": _gluon_bwd_steps("07w_gluon_bwd_mask_loop_h200", "gluon_bwd_mask_loop",
                                                 "gluon_bwd_one_loop"),
    # ... causal, with the programs launched head by head and in groups of 2 to 16 heads (Config.bh_group)
    "backward_gluon_groups": _gluon_bwd_steps("07w_gluon_bwd_groups_h200", "gluon_bwd", "gluon_bwd_by_head",
                                              "gluon_bwd_group2", "gluon_bwd_grouped", "gluon_bwd_group8",
                                              "gluon_bwd_group16", masks=("causal",)),
    # ... dK's product issued after dQ's or before, and after with dSᵀ formed first (Config.dq_first)
    "backward_gluon_dq_first": _gluon_bwd_steps("07w_gluon_bwd_dq_first_h200", "gluon_bwd_dk_first",
                                                "gluon_bwd_dq_first", "gluon_bwd_dq_ds_first"),
    # ... the ring slot freed before dQ's reduce-adds are issued, or after them (Config.free_early)
    "backward_gluon_free_early": _gluon_bwd_steps("07w_gluon_bwd_free_early_h200", "gluon_bwd_free_late",
                                                  "gluon_bwd_free_early"),
    # ... dQ staged in one buffer per consumer or two (Config.dq_buffers)
    "backward_gluon_dq_buffers": _gluon_bwd_steps("07w_gluon_bwd_dq_buffers_h200", "gluon_bwd_one_dq_buffer",
                                                  "gluon_bwd_two_dq_buffers"),
    # one profiled launch of each pass of the Triton backward per load step (worklog 07w, sections 2 and 3;
    # needs ncu): d = 64 without a mask, d = 128 without and with one
    "backward_ncu_d64": (1, ["utils.course.bench.ncu", "--worklog", "triton_bwd", "--head-dim", "64", "--seqlen", "4096",
                             "--steps", "pointer", "tma", "--name", "07_ncu_d64_h200"]),
    "backward_ncu_d128": (1, ["utils.course.bench.ncu", "--worklog", "triton_bwd", "--seqlen", "4096",
                              "--steps", "pointer", "tma", "--name", "07_ncu_d128_h200"]),
    "backward_ncu_d128_causal": (1, ["utils.course.bench.ncu", "--worklog", "triton_bwd", "--seqlen", "4096", "--causal",
                                     "--name", "07_ncu_d128_causal_h200"]),
    # the tiles of the Triton backward's two passes, each candidate timed in the whole backward
    # (utils.tiled.fast.backward.pick_config)
    "backward_tiles": (1, ["utils.course.bench.backward_tiles", "--out", "images/07_backward_tiles_h200.json"]),
    # notebook 06b's tensor-core backward, every step of its worklog beside SDPA's FA2 and cuDNN backwards
    "cuda_backward": (1, ["utils.course.bench.backward", "--backends", "cuda_atomic_dq", "cuda_dq_pass", "cuda_narrow_rows",
                          "cuda_two_blocks", "cuda_per_head_dim", "cuda_unroll_two", "cuda_mask_after",
                          "cuda_warp_tiles", "cuda_hoisted", "sdpa_flash", "sdpa_cudnn",
                          "--seqlens", "4096", "8192", "16384", "--out", "images/06b_cuda_backward_h200.json"]),
    # steps 10-12 of that backward beside step 9, N from 2k, each shape in 2 rounds of rotated order: the run that made
    # step 11 the registry's backward until step 14
    "cuda_backward_steps1012": (1, ["utils.course.bench.backward", "--backends", "cuda_hoisted", "cuda_wide_queries",
                                    "cuda_store_matrix", "cuda_pair_dq", "sdpa_flash", "sdpa_cudnn", "--seqlens",
                                    "2048", "4096", "8192", "16384", "--rounds", "2", "--out",
                                    "images/06b_bwd_steps1012_h200.json"]),
    # steps 13-15 beside step 11, as that run: the run that made step 14 the registry's backward until step 19
    "cuda_backward_steps1315": (1, ["utils.course.bench.backward", "--backends", "cuda_store_matrix", "cuda_dq_between",
                                    "cuda_prepare", "cuda_padded_dq", "sdpa_flash", "sdpa_cudnn", "--seqlens",
                                    "2048", "4096", "8192", "16384", "--rounds", "2", "--out",
                                    "images/06b_bwd_steps1315_h200.json"]),
    # steps 16-19 beside step 14, as that run: the run that made step 19 the registry's backward
    "cuda_backward_steps1619": (1, ["utils.course.bench.backward", "--backends", "cuda_prepare", "cuda_lse_by_thread",
                                    "cuda_pairs_between", "cuda_split_kv", "cuda_stagger", "sdpa_flash",
                                    "sdpa_cudnn", "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "2",
                                    "--out", "images/06b_bwd_steps1619_h200.json"]),
    # sm_90 only: 06c's backward beside the Gluon backward, 06b's and SDPA's (06cw section 7)
    "hopper_backward": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper", "gluon_bwd", "cuda_stagger",
                            "sdpa_flash", "sdpa_cudnn", "--seqlens", "4096", "16384", "--out",
                            "images/06c_backward_h200.json"]),
    # worklog 06cw section 7: the backward's dQ steps beside the Gluon backward (and its dQ writer), FA2, cuDNN
    "hopper_bwd_steps": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_atomic_dq",
                             "cuda_hopper_reduce_dq", "cuda_hopper_prefetch_s", "gluon_bwd", "gluon_bwd_dq_writer",
                             "sdpa_flash", "sdpa_cudnn", "--seqlens", "4096", "16384", "--rounds", "2", "--out",
                             "images/06c_bwd_steps_h200.json"]),
    # worklog 06cw section 7: the backward's causal blocks in groups of heads (bh_group) beside reduce_dq
    "hopper_bwd_group": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_reduce_dq",
                             "cuda_hopper_bh_group", "gluon_bwd", "sdpa_flash", "sdpa_cudnn", "--seqlens", "4096",
                             "16384", "--rounds", "2", "--out", "images/06c_bwd_group_h200.json"]),
    # worklog 06cw section 7: dSᵀ stored by stmatrix (stsm_ds) beside reduce_dq and bh_group
    "hopper_bwd_stsm": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_reduce_dq",
                            "cuda_hopper_bh_group", "cuda_hopper_stsm_ds", "gluon_bwd", "sdpa_flash", "sdpa_cudnn",
                            "--seqlens", "4096", "16384", "--rounds", "3", "--out", "images/06c_bwd_stsm_h200.json"]),
    # worklog 06cw section 7: stsm_ds beside reduce_dq again, 5 rounds (the head dims' defaults)
    "hopper_bwd_stsm5": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_reduce_dq",
                             "cuda_hopper_stsm_ds", "sdpa_cudnn", "--seqlens", "4096", "16384", "--rounds", "5",
                             "--out", "images/06c_bwd_stsm5_h200.json"]),
    # worklog 06cw section 7: stsm_uniform beside stsm_ds and reduce_dq, 5 rounds
    "hopper_bwd_uniform": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_reduce_dq",
                               "cuda_hopper_stsm_ds", "cuda_hopper_stsm_uniform", "sdpa_cudnn", "--seqlens", "4096",
                               "16384", "--rounds", "5", "--out", "images/06c_bwd_uniform_h200.json"]),
    # worklog 06cw section 7: dq_first beside stsm_uniform, the Gluon backward and cuDNN, 5 rounds
    "hopper_bwd_dq_first": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_stsm_uniform",
                                "cuda_hopper_dq_first", "gluon_bwd", "sdpa_cudnn", "--seqlens", "4096", "16384",
                                "--rounds", "5", "--out", "images/06c_bwd_dq_first_h200.json"]),
    # worklog 06cw section 7: desc_add, edge_mask and dv_late beside stsm_uniform, the Gluon backward and cuDNN, 5 rounds
    "hopper_bwd_desc": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_stsm_uniform",
                            "cuda_hopper_desc_add", "cuda_hopper_edge_mask", "cuda_hopper_dv_late", "gluon_bwd",
                            "sdpa_cudnn", "--seqlens", "4096", "16384", "--rounds", "5", "--out",
                            "images/06c_bwd_desc_h200.json"]),
    # worklog 06cw section 7: late_prefetch and late_group beside dv_late, edge_mask, the Gluon backward and cuDNN
    "hopper_bwd_late": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_dv_late",
                            "cuda_hopper_edge_mask", "cuda_hopper_late_prefetch", "cuda_hopper_late_group",
                            "gluon_bwd", "sdpa_cudnn", "--seqlens", "4096", "16384", "--rounds", "5", "--out",
                            "images/06c_bwd_late_h200.json"]),
    # worklog 06cw section 7: rows80 (80-query tiles at D = 128, dQ transposed) beside late_prefetch, late_group,
    # the Gluon backward and cuDNN
    "hopper_bwd_rows80": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_prefetch",
                              "cuda_hopper_late_group", "cuda_hopper_rows80", "gluon_bwd", "sdpa_cudnn", "--seqlens",
                              "2048", "4096", "8192", "16384", "--rounds", "3", "--out",
                              "images/06c_bwd_rows80_h200.json"]),
    # worklog 06cw section 7: rows80_group (rows80 with bh_group's causal launch) beside rows80 and late_group
    "hopper_bwd_rows80_group": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_rows80",
                                    "cuda_hopper_rows80_group", "cuda_hopper_late_group", "gluon_bwd", "sdpa_cudnn",
                                    "--head-dims", "128", "--masks", "causal", "--seqlens", "2048", "4096", "8192",
                                    "16384", "--rounds", "5", "--out", "images/06c_bwd_rows80_group_h200.json"]),
    # worklog 06cw section 7: late_dq_first (dQ staged while dK runs) beside rows80_group and late_prefetch, at
    # both head dims
    "hopper_bwd_late_dq_first": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_prefetch",
                                     "cuda_hopper_rows80_group", "cuda_hopper_late_dq_first", "sdpa_cudnn",
                                     "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "3", "--out",
                                     "images/06c_bwd_late_dq_first_h200.json"]),
    # worklog 06cw section 7: frag_dq (dQ in register order, a writer warp) and early_lse beside late_dq_first
    # (the run named no outside peer: its --peers is empty)
    "hopper_bwd_frag_dq": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_dq_first",
                               "cuda_hopper_frag_dq", "cuda_hopper_early_lse", "sdpa_cudnn", "--peers", "--seqlens",
                               "2048", "4096", "8192", "16384", "--rounds", "3", "--out",
                               "images/06c_bwd_frag_dq_h200.json"]),
    # and one profiled launch of each at D = 128, N = 8k, with each instruction sampled (needs ncu)
    "hopper_bwd_ncu_frag_dq": (1, ["utils.course.bench.ncu", "--worklog", "hopper_bwd", "--steps", "late_dq_first",
                                   "frag_dq", "early_lse", "--head-dim", "128", "--seqlen", "8192", "--source",
                                   "--name", "06c_ncu_bwd_frag_dq_h200"]),
    # worklog 06cw section 7: dq_writer (late_dq_first with a dQ writer warp) beside late_dq_first
    "hopper_bwd_dq_writer": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_dq_first",
                                 "cuda_hopper_dq_writer", "sdpa_cudnn", "--seqlens", "2048", "4096", "8192", "16384",
                                 "--rounds", "3", "--out", "images/06c_bwd_dq_writer_h200.json"]),
    # worklog 06cw section 7: stagger (late_dq_first with staggered walks) beside late_dq_first
    "hopper_bwd_stagger": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_dq_first",
                               "cuda_hopper_stagger", "sdpa_cudnn", "--seqlens", "2048", "4096", "8192", "16384",
                               "--rounds", "3", "--out", "images/06c_bwd_stagger_h200.json"]),
    # worklog 06cw section 7: rows64 (late_dq_first on 64-query tiles at D = 128) beside late_dq_first
    "hopper_bwd_rows64": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_dq_first",
                              "cuda_hopper_rows64", "sdpa_cudnn", "--seqlens", "2048", "4096", "8192", "16384",
                              "--head-dims", "128", "--rounds", "3", "--out", "images/06c_bwd_rows64_h200.json"]),
    # worklog 06cw section 7: frag_dq_first (FlashAttention-4's loop at D = 64) beside late_dq_first and frag_dq
    "hopper_bwd_frag_dq_first": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_dq_first",
                                     "cuda_hopper_frag_dq", "cuda_hopper_frag_dq_first", "sdpa_cudnn", "--seqlens",
                                     "2048", "4096", "8192", "16384", "--head-dims", "64", "--rounds", "3", "--out",
                                     "images/06c_bwd_frag_dq_first_h200.json"]),
    # and one profiled launch of each at D = 64, N = 8k beside FlashAttention-4's (needs ncu and flash-attn-4)
    "hopper_bwd_ncu_d64_fa4": (1, ["utils.course.bench.ncu", "--worklog", "hopper_bwd", "--steps", "late_dq_first",
                                   "frag_dq_first", "flash-attn-4", "--head-dim", "64", "--seqlen", "8192",
                                   "--source", "--name", "06c_ncu_bwd_d64_fa4_h200"]),
    # 06c's backward table: the default step beside the Gluon backward, FA2 and cuDNN
    "hopper_bwd_default": (1, ["utils.course.bench.backward", "--backends", "cuda_hopper_late_prefetch",
                               "cuda_hopper_dv_late", "cuda_hopper_edge_mask", "gluon_bwd", "sdpa_flash",
                               "sdpa_cudnn", "--seqlens", "4096", "16384", "--rounds", "3", "--out",
                               "images/06c_bwd_default_h200.json"]),
    # worklog 06cw section 6: 06c's forward beside the Gluon forwards in one run (issue 78's 0.9 bar)
    "hopper_vs_gluon": (1, ["utils.course.bench.forward", "--impls", "cuda_hopper", "gluon_ws", "gluon_ws3", "--sdpa",
                            "cudnn", "--seqlens", "2048", "4096", "8192", "16384", "--rounds", "2", "--name",
                            "06c_vs_gluon_h200"]),
    "decoding": (1, ["utils.course.bench.decoding", "--out", "images"]),
    "launch_floor": (1, ["utils.course.bench.decoding", "--launch-floor", "--out", "images"]),
    "decoding_tiles": (1, ["utils.course.bench.decoding", "--tile-sweep", "--out", "images"]),
    "decoding_paged": (1, ["utils.course.bench.decoding", "--paged", "--out", "images"]),
    "decoding_latency": (1, ["utils.course.bench.decoding", "--latency", "--out", "images"]),
    "flex": (1, ["utils.course.bench.flex"]),
    # the Triton tutorial beside the course, from the file of the GPU machine's Triton (3.6: release/3.6.x) put in
    # the ignored .peer/ (utils.course.bench.peers says how); the sweep records the file's SHA-256. FlashAttention-4
    # joins where flash-attn-4 is installed (../shared/tools/fa4_pack.sh), else the sweep says it skipped it
    "peers": (1, ["utils.course.bench.peers_sweep", "--tutorial", ".peer/06-fused-attention.py", "--tutorial-ref",
                  "release/3.6.x", "--impls", "triton", "gluon", "gluon_ws", "--name", "peers_h200",
                  "--rounds", "3"]),
    # issue 78: FlashAttention-4 (../shared/tools/fa4_pack.sh) beside the course's fast kernels, cuDNN and FA2 in one
    # run, bf16 at N 2k-16k (the grid); kept apart from "peers" so that neither run needs the other's peer
    "peers_fa4": (1, ["utils.course.bench.peers_sweep", "--impls", "triton", "gluon", "gluon_ws", "gluon_ws3",
                      "cuda_hopper", "--peers", "flash-attn-4", "--dtypes", "bf16",
                      "--seqlens", "2048", "4096", "8192", "16384", "--name", "peers_fa4_h200", "--rounds", "3"]),
    # issue 71: the fast registry kernels beside cuDNN before (a copy of the older utils/) and after the regroup
    "layout_check": (1, ["utils.course.bench.peers_sweep", "--impls", "triton", "gluon", "gluon_ws", "--sdpa", "cudnn",
                         "--modes", "fwd", "bwd", "--dtypes", "fp16", "bf16", "--head-dims", "64", "128", "--causal",
                         "both", "--seqlens", "2048", "8192", "--rounds", "3", "--name", "layout_after_h200",
                         "--out-dir", "images"]),
    # issue 71: the Gluon kernels at N = 2048 (noisy in layout_check), two runs of each tree alternated, 5 rounds
    "layout_check_gluon2k": (1, ["utils.course.bench.peers_sweep", "--impls", "gluon", "gluon_ws", "--sdpa", "cudnn",
                                 "--modes", "fwd", "bwd", "--dtypes", "fp16", "bf16", "--head-dims", "64", "128",
                                 "--causal", "both", "--seqlens", "2048", "--rounds", "5", "--name", "gluon2k_after_0",
                                 "--out-dir", "images"]),
    "summary": (1, ["utils.course.bench.summary"]),
    "real_model": (1, ["utils.course.bench.real_model"]),
    # notebook 11
    "fp8": (1, ["utils.course.bench.fp8"]),
    "fp8_sweep": (1, ["utils.course.bench.fp8", "--sweep"]),
    "mla": (1, ["utils.course.bench.mla"]),
    "mla_sweep": (1, ["utils.course.bench.mla", "--sweep"]),
    "sinks": (1, ["utils.course.bench.sinks"]),
    "context_parallel": (2, ["utils.course.bench.context_parallel"]),
    "ring_nccl": (2, ["utils.course.ring_check", "--backend", "nccl", "--world-size", "2"]),
    "ring_comm": (2, ["utils.course.bench.ring_comm", "--backend", "nccl", "--world-size", "2", "--out", "images"]),
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
    result = dict(environment=gpu.environment("python -m utils.course.references --only ceilings"),
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


def ratio_span(records, impl: str, base: str, *, min_seqlen: int = 0, head_dims=None,
               key: str = "impl") -> tuple[float, float]:
    """(lowest, highest) of impl's TFLOP/s over base's across a stored run's shapes (head dim, causal, N) with
    N >= min_seqlen and, if given, a head dim in head_dims. `key` names the implementation field of a record."""
    rate = _by(records, key, "head_dim", "causal", "seqlen")
    ratios = [v / rate[(base, *shape)] for (name, *shape), v in rate.items()
              if name == impl and shape[2] >= min_seqlen and (head_dims is None or shape[0] in head_dims)
              and (base, *shape) in rate]
    if not ratios:
        raise ValueError(f"no shape with both {impl!r} and {base!r} (N >= {min_seqlen}, head dims {head_dims})")
    return min(ratios), max(ratios)


def _fmt_k(n: int) -> str:
    return f"{n // 1024}k"


def _span(values) -> str:
    return f"{min(values):.2f}–{max(values):.2f}×"


# the shapes README's tables and notebook 09's tables show: (head dim, causal, N)
COLUMNS = [(64, False, 4096), (64, False, 16384), (128, False, 4096), (128, False, 16384), (128, True, 16384)]
# where each range of findings() was measured, for the reader who wants the run behind it
CUDA_BWD_RUN = "06b_bwd_steps1619_h200.json"  # the run of the CUDA backward's default step (06bw section 10)
HOPPER_RUNS = ("06c_hopper_h200.json", "06c_vdirect_h200.json", "06c_three_h200.json", "06c_persistent_h200.json",
               "06c_diagonal_h200.json", "06c_tma_store_h200.json", "06c_wide_stages_h200.json",
               "06c_one_p_h200.json", "06c_uniform_h200.json", "06c_tree_h200.json", "06c_desc_h200.json",
               "06c_desc_diagonal_h200.json")
MMA_RUN = "06b_step15_h200.json"  # the run of the registry's step (utils.native.build.MMA_DEFAULT_STEP)


def hopper_default_run(head_dim: int) -> str:
    """The newest run of HOPPER_RUNS (listed oldest first) that timed the Hopper forward's default step at
    `head_dim` (64 or 128)."""
    from utils.course.bench.cuda_mma import step_label
    from utils.native.hopper import default_step

    label = step_label(default_step(head_dim), "hopper")
    for name in reversed(HOPPER_RUNS):
        if any(r["impl"] == label and r["head_dim"] == head_dim for r in _load(name)["results"]):
            return name
    raise ValueError(f"no stored 06c run times the default step {label!r} at head_dim={head_dim}")


def _finding(what, values, unit, shapes, source, notebook) -> dict:
    values = list(values)
    if not values:
        raise ValueError(f"no stored values for {what!r} in {source}")
    return dict(what=what, low=min(values), high=max(values), unit=unit, shapes=shapes, source=source,
                notebook=notebook)


def findings() -> list[dict]:
    """The course's results as ranges over the stored runs: one row per claim, each with its lowest and highest
    value, unit, shapes, stored run and notebook. Notebook 09 prints them; every value is computed here from
    images/*.json."""
    from utils.course.bench.backward import ratios as backward_ratios
    from utils.course.bench.cuda_mma import step_label
    from utils.course.bench.peers import FA4, PEERS as PEER_LABELS
    from utils.course.bench.peers_sweep import versus
    from utils.native.backward import BWD_DEFAULT_STEP
    from utils.native.build import MMA_DEFAULT_STEP
    from utils.native.hopper import DEFAULT_STEPS

    rows = []
    forward = _load("triton_fwd_h200.json")["results"]
    rows.append(_finding("Triton forward / FlashAttention-2",
                         ratio_span(forward, "triton", "sdpa-flash", min_seqlen=2048), "×", "N ≥ 2k",
                         "triton_fwd_h200.json", "05"))
    rows.append(_finding("Triton forward / cuDNN", ratio_span(forward, "triton", "sdpa-cudnn", min_seqlen=4096), "×",
                         "N ≥ 4k", "triton_fwd_h200.json", "05"))
    b = _by(_load("07_backward_benchmark.json")["rows"], "backend", "head_dim", "causal", "seqlen")
    shortest = min(n for (i, _, _, n) in b if i == "triton")
    rows.append(_finding("Triton backward / cuDNN's", [v / b["sdpa_cudnn", d, c, n] for (i, d, c, n), v in b.items()
                                                        if i == "triton" and ("sdpa_cudnn", d, c, n) in b],
                         "×", f"N ≥ {_fmt_k(shortest)}", "07_backward_benchmark.json", "07"))

    g = _by(_load("05b_gluon_ws_h200.json")["results"], "impl", "head_dim", "causal", "seqlen")
    rows.append(_finding("Gluon forward (faster of gluon, gluon_ws) / cuDNN",
                         [max(g.get((i, d, c, n), 0) for i in ("gluon", "gluon_ws")) / v
                          for (i, d, c, n), v in g.items() if i == "sdpa-cudnn" and n >= 4096],
                         "×", "N ≥ 4k", "05b_gluon_ws_h200.json", "05b"))
    rows.append(_finding("Gluon backward / cuDNN's",
                         [r for (n, _, _), r in backward_ratios(_load("07_gluon_bwd_h200.json")["rows"], "gluon_bwd",
                                                                "sdpa_cudnn").items() if n >= 4096],
                         "×", "N ≥ 4k", "07_gluon_bwd_h200.json", "07"))

    peers = _load("peers_h200.json")
    course = tuple(dict.fromkeys(r["impl"] for r in peers["results"]
                                 if not r["impl"].startswith("sdpa-") and r["impl"] not in PEER_LABELS))
    tutorial = versus(peers["results"], course)
    fastest = "course's best"  # per shape the fastest of `course` (09 names them)
    for mode, name in (("fwd", "forward"), ("bwd", "backward")):
        for long in (True, False):
            rows.append(_finding(f"{fastest} {name} / Triton tutorial's, fp16",
                                 [r["ratio"] for r in tutorial if r["mode"] == mode and (r["seqlen"] >= 2048) == long],
                                 "×", "N ≥ 2k" if long else "N < 2k (host-bound)", "peers_h200.json", "05b"))
    below = sum(r["ratio"] < 1.0 for r in tutorial)
    rows.append(_finding("shapes where the course is below the tutorial", [below], f"of {len(tutorial)}",
                         "fwd and bwd, fp16, N ≥ 1k", "peers_h200.json", "05b"))
    for name in ("peers_h200.json", "peers_fa4_h200.json"):   # the stored runs with flash-attn-4 (issue 78)
        records = _load(name)["results"] if (IMAGES / name).exists() else []
        if any(r["impl"] == FA4 for r in records):
            mine = tuple(dict.fromkeys(r["impl"] for r in records   # the course's kernels in that run
                                       if not r["impl"].startswith("sdpa-") and r["impl"] not in PEER_LABELS))
            fa4 = versus(records, mine, (FA4,))
            dtypes = " and ".join(sorted({r["dtype"] for r in records if r["impl"] == FA4}))
            for mode, label in (("fwd", "forward"), ("bwd", "backward")):
                # from N = 4k, as against cuDNN: at 2k both kernels' calls take about as long on the host as
                # on the GPU, and their ratio moves from run to run
                rows.append(_finding(f"{fastest} {label} / FlashAttention-4, {dtypes}",
                                     [r["ratio"] for r in fa4 if r["mode"] == mode and r["seqlen"] >= 4096],
                                     "×", "N ≥ 4k", name, "05b, 07"))
            break
    for mode, name, sdpa, label, shortest in (("fwd", "forward", "sdpa-cudnn", "cuDNN", 4096),
                                              ("fwd", "forward", "sdpa-flash", "FlashAttention-2", 1024),
                                              ("bwd", "backward", "sdpa-cudnn", "cuDNN's", 4096)):
        rows.append(_finding(f"{fastest} {name} / {label}, fp16 and bf16",
                             [r["ratio"] for r in versus(peers["results"], course, (sdpa,))
                              if r["mode"] == mode and r["seqlen"] >= shortest],
                             "×", f"N ≥ {_fmt_k(shortest)}", "peers_h200.json", "05b, 07"))

    m = _by(_load(MMA_RUN)["results"], "impl", "head_dim", "causal", "seqlen")
    final = step_label(MMA_DEFAULT_STEP)
    mma = [(v, v / m["sdpa-flash", d, c, n]) for (i, d, c, n), v in m.items()
           if i == final and n >= 4096 and ("sdpa-flash", d, c, n) in m]
    rows.append(_finding(f"CUDA tensor-core forward (`cuda`, step {MMA_DEFAULT_STEP})", [v for v, _ in mma],
                         "TFLOP/s", "N ≥ 4k", MMA_RUN, "06b"))
    rows.append(_finding(f"CUDA tensor-core forward (step {MMA_DEFAULT_STEP}) / FlashAttention-2",
                         [r for _, r in mma], "×", "N ≥ 4k", MMA_RUN, "06b"))
    cb = backward_ratios(_load(CUDA_BWD_RUN)["rows"], f"cuda_{BWD_DEFAULT_STEP}")  # × FA2
    for dim in (64, 128):
        rows.append(_finding(f"CUDA tensor-core backward (step {BWD_DEFAULT_STEP}) / FlashAttention-2's, d={dim}",
                             [r for (n, d, _), r in cb.items() if d == dim and n >= 4096], "×", "N ≥ 4k",
                             CUDA_BWD_RUN, "06b"))

    best, vs = {}, {}  # per shape: the best step's TFLOP/s and ratio to cuDNN, over the runs (each side by side)
    for name in HOPPER_RUNS:
        h = _by(_load(name)["results"], "impl", "head_dim", "causal", "seqlen")
        for (i, d, c, n), value in h.items():
            if i.startswith("h") and n >= 4096 and ("sdpa-cudnn", d, c, n) in h:
                best[d, c, n] = max(best.get((d, c, n), 0), value)
                vs[d, c, n] = max(vs.get((d, c, n), 0), value / h["sdpa-cudnn", d, c, n])
    hopper_sources = f"06c_*_h200.json ({len(HOPPER_RUNS)} runs)"
    rows.append(_finding("Hopper forward (`cuda_hopper`), best step per shape", best.values(), "TFLOP/s", "N ≥ 4k",
                         hopper_sources, "06c"))
    rows.append(_finding("Hopper forward, best step per shape / cuDNN", vs.values(), "×", "N ≥ 4k",
                         hopper_sources, "06c"))
    for dim, step in DEFAULT_STEPS.items():
        run = hopper_default_run(dim)
        last = _by(_load(run)["results"], "impl", "head_dim", "causal", "seqlen")
        rows.append(_finding(f"Hopper forward, default step {step} / cuDNN, d={dim}",
                             [v / last["sdpa-cudnn", d, c, n] for (i, d, c, n), v in last.items()
                              if i == step_label(step, "hopper") and d == dim and n >= 4096],
                             "×", "N ≥ 4k", run, "06c"))

    dec = stored_decoding()
    for key in dict.fromkeys(r["layout"] for r in dec):
        ours = [r for r in dec if r["layout"] == key]
        top = max(ours, key=lambda r: r["tb_per_s"])
        label = f"decoding, {key.upper()}, {top['heads']} query / {top['kv_heads']} KV heads"
        rows.append(_finding(f"{label}: best bandwidth", [top["tb_per_s"]], "TB/s",
                             f"batch {top['batch']}, {_fmt_k(top['seqlen_k'])} tokens", "decoding_h200.json", "08"))
        rows.append(_finding(f"{label}: speed / cuDNN's", [r["speedup"] for r in ours if r["speedup"]], "×",
                             _decoding_shapes(ours), "decoding_h200.json", "08"))
    for r in _load("ring_nccl.json")["results"]:
        case = r["case"]
        rows.append(_finding(f"ring attention, {r['world_size']} GPUs / one GPU, "
                             f"{'causal, ' + case['layout'] if case['causal'] else 'full attention'}",
                             [r["single_device_ms"] / r["ring_ms"]], "×", f"{_fmt_k(case['seqlen'])} tokens, NCCL",
                             "ring_nccl.json", "08"))
    return rows


def format_findings(rows: list[dict]) -> str:
    """findings() as a plain-text table: what, the range, the shapes, the notebook and the stored run."""
    def value(r):
        one = r["low"] == r["high"]
        if r["unit"] == "×":
            return f"{r['low']:.2f}×" if one else f"{r['low']:.2f}–{r['high']:.2f}×"
        digits = 0 if r["unit"] == "TFLOP/s" else 1 if r["unit"] == "TB/s" else 0
        span = f"{r['low']:.{digits}f}" if one else f"{r['low']:.{digits}f}–{r['high']:.{digits}f}"
        return f"{span} {r['unit']}"
    width = max(len(r["what"]) for r in rows)
    lines = [f"{'finding':{width}s}  {'range':>18s}  {'shapes':26s} {'nb':7s} stored run (images/)"]
    for r in rows:
        lines.append(f"{r['what']:{width}s}  {value(r):>18s}  {r['shapes']:26s} {r['notebook']:7s} {r['source']}")
    return "\n".join(lines)


# ---- notebook 09: every registered kernel from its stored runs --------------------------------------------

# registered kernel -> (stored forward run, or a function of the head dim giving it; its name there, notebook);
# None: the registered step (see below)
FORWARD_RUNS = {
    **{kernel: ("summary_h200.json", kernel, notebook) for kernel, notebook in (
        ("sdpa", "01"), ("naive", "01"), ("flash1_pytorch", "03"), ("flash2_pytorch", "04"),
        ("flash_decoding", "08"), ("cuda_naive", "06"), ("cuda_tiled", "06"), ("flash2_pytorch_autograd", "07"))},
    "triton_lesson": ("triton_lesson_h200.json", "triton_lesson", "05"),
    "triton": ("triton_fwd_h200.json", "triton", "05b"),
    "gluon": ("05b_gluon_ws_h200.json", "gluon", "05b"),
    "gluon_ws": ("05b_gluon_ws_h200.json", "gluon_ws", "05b"),
    "gluon_ws3": ("05b_gluon_ws3_h200.json", "gluon_ws3 n128 s2 r160", "05b"),   # forward_ws3.pick_config(64)
    "cuda": (MMA_RUN, None, "06b"),
    "cuda_hopper": (hopper_default_run, None, "06c"),
    "flex_triton": ("10_flex_h200.json", "course", "10"),
}
# registered kernel -> (stored backward run, its name there, notebook); gluon and gluon_ws share one backward
BACKWARD_RUNS = {
    "triton": ("07_backward_benchmark.json", "triton", "07"),
    "gluon, gluon_ws, gluon_ws3": ("07_gluon_bwd_h200.json", "gluon_bwd", "07"),
    "cuda": (CUDA_BWD_RUN, None, "06b"),
    "cuda_hopper": ("peers_fa4_h200.json", "cuda_hopper", "06c"),  # its default step per head dim, beside FA4
    "flex_triton": ("10_flex_h200.json", "course", "10"),
}
BASELINES = {"cuDNN": "sdpa-cudnn", "FA2": "sdpa-flash", "SDPA's pick": "sdpa-default"}


def stored_records(name: str, mode: str = "fwd") -> list[dict]:
    """The rows of a stored attention run in one form: impl, head_dim, causal, seqlen, tflops. SDPA's pinned
    backends are named sdpa-cudnn and sdpa-flash in every run; 10_flex_h200.json's causal rows (batch 2, d=128)
    are converted from its times, and its unpinned SDPA is sdpa-default. Runs of both passes (the peers sweeps)
    give the rows of `mode` only."""
    if mode not in ("fwd", "bwd"):
        raise ValueError(f"mode must be 'fwd' or 'bwd', got {mode!r}")
    from utils.course.bench import attention_flops

    data = _load(name)
    if name.startswith("10_flex"):
        s = data["settings"]
        names = {"course": "course", "sdpa_causal": "sdpa-default"}
        return [dict(impl=names[r["impl"]], head_dim=s["head_dim"], causal=True, seqlen=r["seqlen"],
                     tflops=attention_flops(s["batch"], s["heads"], r["seqlen"], r["seqlen"], s["head_dim"],
                                            causal=True, mode=mode) / (r[f"{mode}_ms"] * 1e9))
                for r in data["results"] if r["mask"] == "causal" and r["impl"] in names and r.get(f"{mode}_ms")]
    rows = data.get("results") or data.get("rows") or data.get("speed")
    if not isinstance(rows, list) or not rows or "head_dim" not in rows[0]:
        raise ValueError(f"{name} is not a run of attention kernels by shape")
    return [dict(impl=(r.get("impl") or r["backend"]).replace("sdpa_", "sdpa-"), head_dim=r["head_dim"],
                 causal=r["causal"], seqlen=r["seqlen"], tflops=r["tflops"])
            for r in rows if r.get("tflops") and r.get("mode", mode) == mode]


def stored_kernels(mode: str = "fwd", columns=COLUMNS) -> list[dict]:
    """One row per registered kernel with a stored run: TFLOP/s at each column's shape, and its ratio to each
    baseline (cuDNN, FlashAttention-2, or SDPA's own pick) measured in the same run; None where not measured.
    `runs` lists the stored runs a row reads (one per head dim at most), `run` joins them for display."""
    from utils.course.bench.cuda_mma import step_label
    from utils.course.bench.peers_sweep import kernel_steps

    def default(kernel, d):  # the label of the step a kernel built in steps runs by default, as its runs store it
        step = kernel_steps(kernel, mode, d)[mode]
        return step_label(step, "hopper" if kernel == "cuda_hopper" else "mma") if mode == "fwd" else f"{kernel}_{step}"

    out = []
    for kernel, (run, label, notebook) in (FORWARD_RUNS if mode == "fwd" else BACKWARD_RUNS).items():
        labels = {col: label or default(kernel, col[0]) for col in columns}  # col = (head_dim, causal, N)
        runs = {col: run if isinstance(run, str) else run(col[0]) for col in columns}
        tables = {name: _by(stored_records(name, mode), "impl", "head_dim", "causal", "seqlen")
                  for name in dict.fromkeys(runs.values())}
        t = {col: tables[runs[col]] for col in columns}
        row = dict(kernel=kernel, notebook=notebook, runs=list(tables), run=" + ".join(tables),
                   label=" / ".join(dict.fromkeys(labels.values())),
                   tflops={col: t[col].get((labels[col], *col)) for col in columns})
        for short, base in BASELINES.items():
            row[short] = {col: t[col][labels[col], *col] / t[col][base, *col]
                          if (labels[col], *col) in t[col] and (base, *col) in t[col] else None for col in columns}
        out.append(row)
    return out


def format_stored(rows: list[dict], value: str = "tflops", columns=COLUMNS) -> str:
    """stored_kernels() as a plain-text table of one value: "tflops" or a baseline's ratio ("cuDNN", "FA2",
    "SDPA's pick"); "–" where a run has no such shape; rows without any value are left out."""
    if value != "tflops" and value not in BASELINES:
        raise ValueError(f"value must be 'tflops' or one of {list(BASELINES)}, got {value!r}")
    head = [f"d={d}{' causal' if c else ''} N={_fmt_k(n)}" for d, c, n in columns]
    width = max(len(r["kernel"]) for r in rows)
    lines = [f"{'kernel':{width}s} {'nb':3s} " + " ".join(f"{h:>19s}" for h in head) + "  stored run (images/)"]
    for r in rows:
        cells = [r[value][col] for col in columns]
        if all(x is None for x in cells):
            continue
        text = ["–" if x is None else f"{x:.0f}" if value == "tflops" else f"{x:.2f}×" for x in cells]
        lines.append(f"{r['kernel']:{width}s} {r['notebook']:3s} " + " ".join(f"{x:>19s}" for x in text)
                     + f"  {r['run']}")
    return "\n".join(lines)


def environments(names) -> list[dict]:
    """Where and when each stored run was measured: its file, GPU, torch, Triton, cuDNN and date."""
    rows = []
    for name in dict.fromkeys(names):
        env = _load(name)["environment"]
        rows.append(dict(run=name, gpu=env["gpu"], torch=env["torch"], triton=env["triton"], cudnn=env["cudnn"],
                         date=env["date"][:10]))
    return rows


def stored_decoding(method: str = "flash_decode", against: str = "SDPA cuDNN") -> list[dict]:
    """One row per layout (mha, gqa), batch and cache length of decoding_h200.json: `method`'s time and
    bandwidth, and its speed over `against`'s (their time over its time; None where `against` did not run)."""
    dec = _load("decoding_h200.json")
    known = {r["method"] for key in ("mha", "gqa") for r in dec[key]}
    for name in (method, against):
        if name not in known:
            raise ValueError(f"unknown decoding method {name!r}; known: {sorted(known)}")
    out = []
    for key in ("mha", "gqa"):
        ms = {(r["method"], r["batch"], r["seqlen_k"]): r for r in dec[key] if r.get("ms")}
        for (m, batch, n), r in ms.items():
            if m == method:
                other = ms.get((against, batch, n))
                out.append(dict(layout=key, heads=r["heads"], kv_heads=r["kv_heads"], batch=batch, seqlen_k=n,
                                ms=r["ms"], tb_per_s=r["gbps"] / 1000,
                                speedup=other["ms"] / r["ms"] if other else None))
    return out


def _decoding_shapes(rows) -> str:
    batches, lengths = [r["batch"] for r in rows], [r["seqlen_k"] for r in rows]
    return f"batch {min(batches)}–{max(batches)}, {_fmt_k(min(lengths))}–{_fmt_k(max(lengths))} tokens"


def format_decoding(rows: list[dict], against: str = "cuDNN") -> str:
    """stored_decoding() as a plain-text table: one line per layout, batch and cache length."""
    lines = [f"{'layout':6s} {'batch':>5s} {'cache':>6s} {'ms':>8s} {'TB/s':>6s} {'× ' + against:>10s}"]
    for r in rows:
        ratio = "–" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(f"{r['layout']:6s} {r['batch']:5d} {_fmt_k(r['seqlen_k']):>6s} {r['ms']:8.3f} "
                     f"{r['tb_per_s']:6.2f} {ratio:>10s}")
    return "\n".join(lines)


# technique -> (stored run, with it, without it, notebook): each pair measured side by side in one run
TECHNIQUES = [
    ("TMA loads (Triton forward, fixed tiles)", "triton_fwd_h200.json", "triton + TMA (fixed tiles)",
     "triton 05 (fixed tiles)", "05b"),
    ("tuned tiles and TMA (Triton forward)", "triton_fwd_h200.json", "triton", "triton 05 (fixed tiles)", "05b"),
    ("FlashAttention-3's wait(1) overlap (Gluon)", "05b_gluon_h200.json", "gluon", "triton", "05b"),
    ("warp specialisation (Gluon forward)", "05b_gluon_ws_h200.json", "gluon_ws", "gluon", "05b"),
    ("XOR swizzle (CUDA mma.sync)", "06b_cuda_mma_h200.json", "s3_swizzle", "s2_ldmatrix", "06b"),
    ("cp.async double buffering (CUDA mma.sync)", "06b_cuda_mma_h200.json", "s4_cp_async", "s3_swizzle", "06b"),
    ("06b's steps 2-13 (CUDA mma.sync)", "06b_cuda_mma_h200.json", "s13_late_copy", "s1_mma", "06b"),
    ("warp specialisation (CUDA wgmma)", "06c_hopper_h200.json", "h3_specialised", "h2_pipelined", "06c"),
    ("ping-pong consumers (CUDA wgmma)", "06c_hopper_h200.json", "h7_pingpong", "h6_overlap", "06c"),
    ("O stored through TMA (CUDA wgmma)", "06c_tma_store_h200.json", "h15_tma_store", "h14_own_diagonal", "06c"),
    ("TMA loads (Triton backward)", "07_backward_benchmark.json", "triton_tma", "triton_pointer", "07"),
    ("dQ by atomic adds instead of a dQ pass", "07_backward_atomic_h200.json", "triton_atomic_dq", "triton", "07"),
    ("one warp-specialised kernel (Gluon backward)", "07_gluon_bwd_h200.json", "gluon_bwd", "triton", "07"),
    ("06b's backward steps (CUDA mma.sync)", "06b_cuda_backward_h200.json", "cuda_hoisted", "cuda_atomic_dq", "06b"),
    ("06b's backward steps 10-11 (CUDA mma.sync)", "06b_bwd_steps1012_h200.json", "cuda_store_matrix", "cuda_hoisted",
     "06b"),
    ("prepare and finish kernels (06b's CUDA backward)", "06b_bwd_steps1315_h200.json", "cuda_prepare",
     "cuda_store_matrix", "06b"),
    ("warps split between dV and dK (06b's CUDA backward)", CUDA_BWD_RUN, "cuda_split_kv", "cuda_prepare", "06b"),
    ("staggered query walks (06b's CUDA backward)", CUDA_BWD_RUN, "cuda_stagger", "cuda_split_kv", "06b"),
]


def _speedups(run, new, old, shortest=4096) -> list[float]:
    """TFLOP/s of `new` over `old` at each shape of `run` with N >= shortest where both were measured."""
    t = _by(stored_records(run), "impl", "head_dim", "causal", "seqlen")
    return [v / t[old, d, c, n] for (i, d, c, n), v in t.items() if i == new and n >= shortest and (old, d, c, n) in t]


def technique_gains() -> list[dict]:
    """Each technique's speed-up over the kernel without it, as a range over the shapes of one stored run (N >= 4k
    for kernels; every batch and cache length for decoding; the one shape of the ring run)."""
    rows = [_finding(what, _speedups(run, new, old), "×", "N ≥ 4k", run, nb)
            for what, run, new, old, nb in TECHNIQUES]
    split = stored_decoding(against="flash_decode, 1 split")
    for key in dict.fromkeys(r["layout"] for r in split):
        ours = [r for r in split if r["layout"] == key]
        rows.append(_finding(f"split-KV (flash-decoding, {key.upper()})", [r["speedup"] for r in ours if r["speedup"]],
                             "×", _decoding_shapes(ours), "decoding_h200.json", "08"))
    lat = _load("decoding_latency_h200.json")
    us = {(r["method"], r["seqlen_k"]): r["us"] for r in lat["rows"]}
    graph, python = "flash_decode (CUDA graph replay)", "flash_decode (Python launch)"
    lengths = [n for m, n in us if m == graph and (python, n) in us]
    rows.append(_finding("CUDA graph replay (decoding, one token)",
                         [us[python, n] / us[graph, n] for n in lengths], "×",
                         f"batch {lat['shape']['batch']}, {_fmt_k(min(lengths))}–{_fmt_k(max(lengths))} tokens",
                         "decoding_latency_h200.json", "08"))
    ring = {r["case"]["layout"]: r for r in _load("ring_nccl.json")["results"] if r["case"]["causal"]}
    rows.append(_finding("zigzag layout (causal ring attention)",
                         [ring["contiguous"]["ring_ms"] / ring["zigzag"]["ring_ms"]], "×",
                         f"{_fmt_k(ring['zigzag']['case']['seqlen'])} tokens, {ring['zigzag']['world_size']} GPUs",
                         "ring_nccl.json", "08"))
    return rows


def results_markdown() -> str:
    """README's results section, every number read from images/*.json."""
    fwd = _load("triton_fwd_h200.json")
    env = fwd["environment"]
    f = _by(fwd["results"], "impl", "head_dim", "causal", "seqlen")
    head = " | ".join(f"d={d}{' causal' if c else ''}, N={_fmt_k(n)}" for d, c, n in COLUMNS)
    rows = [("course Triton forward (`triton`: notebook 05, tuned in 05b)", "triton"),
            ("the same kernel before notebook 05b (fixed tiles)", "triton 05 (fixed tiles)"),
            ("SDPA FlashAttention-2 backend", "sdpa-flash"),
            ("SDPA cuDNN backend (PyTorch's default on the H200)", "sdpa-cudnn")]
    lines = [f"| forward, TFLOP/s | {head} |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, impl in rows:
        lines.append(f"| {label} | " + " | ".join(f"{f[impl, d, c, n]:.0f}" for d, c, n in COLUMNS) + " |")

    b = _by(_load("07_backward_benchmark.json")["rows"], "backend", "head_dim", "causal", "seqlen")
    lines += ["", f"| backward, TFLOP/s (notebook 07) | {head} |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, impl in [("course Triton backward", "triton"), ("SDPA FlashAttention-2 backward", "sdpa_flash"),
                        ("SDPA cuDNN backward", "sdpa_cudnn")]:
        lines.append(f"| {label} | " + " | ".join(f"{b[impl, d, c, n]:.0f}" for d, c, n in COLUMNS) + " |")
    pointer = ("The other kernels (Gluon, CUDA, Hopper, decoding, ring attention), each beside cuDNN, "
               "FlashAttention-2 or the Triton tutorial, are printed from the stored runs in "
               "[notebook 09](notebooks/09_summary.ipynb).")
    measured = (f"Measured on {env['gpu']} with torch {env['torch']} and Triton {env['triton']} "
                f"(`images/triton_fwd_h200.json`, `07_backward_benchmark.json`); "
                f"the course pins torch 2.13.0 / Triton 3.7.1, which the GPU machine did not have.")
    return "\n".join([*lines, "", pointer, "", measured])


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
