"""utils.course.bench.cuda_mma: the two CUDA worklogs' step labels, their functions, arguments and the worklog table."""
import json
import math

import pytest

from utils.native import build as native_build, hopper
from utils.course.bench import cuda_mma as cm
from utils.native.build import MMA_STEPS


def test_step_labels_number_the_steps_of_each_worklog():
    assert cm.step_label("exp2") == "s6_exp2" and cm.step_label("mma") == "s1_mma"
    assert cm.step_label("overlap", "hopper") == "h6_overlap"
    assert [cm.step_label(s, "hopper") for s in hopper.ATTENTION_STEPS][:2] == ["h1_tma", "h2_pipelined"]


@pytest.mark.parametrize("step,worklog,message", [("overlap", "mma", "step must be one of"),
                                                  ("exp2", "hopper", "step must be one of"),
                                                  ("exp2", "ampere", "worklog must be one of")])
def test_step_label_names_what_is_wrong(step, worklog, message):
    with pytest.raises(ValueError, match=message):
        cm.step_label(step, worklog)


def test_step_functions_keep_worklog_order_and_pass_the_step():
    fns = cm.step_functions(["causal_skip", "mma"])
    assert list(fns) == ["s1_mma", "s7_causal_skip"] and fns["s7_causal_skip"].keywords == {"step": "causal_skip"}
    every = cm.step_functions(worklog="hopper")
    assert list(every) == [cm.step_label(s, "hopper") for s in hopper.ATTENTION_STEPS]
    assert all(fn.func is hopper.flash_hopper for fn in every.values())
    assert len(cm.step_functions()) == len(MMA_STEPS)
    with pytest.raises(ValueError, match="step must be one of"):
        cm.step_functions(["pingpong"])


def test_parse_args_picks_the_worklog_and_its_default_name():
    args = cm.parse_args(["--worklog", "hopper", "--steps", "overlap", "softmax", "--head-dims", "128"])
    assert (args.cuda_worklog, args.steps, args.name, args.impls) == ("hopper", ["overlap", "softmax"], "06c_hopper", [])
    assert args.worklog is False  # forward's flag for notebook 05b's Triton steps stays off (it once timed them too)
    assert args.sdpa == ["flash", "cudnn"] and args.head_dims == [128]
    args = cm.parse_args([])
    assert (args.cuda_worklog, args.steps, args.name, args.worklog) == ("mma", list(MMA_STEPS), "06b_cuda_mma", False)
    with pytest.raises(SystemExit):
        cm.parse_args(["--worklog", "hopper", "--steps", "exp2"])  # a step of the other worklog


def _record(impl, tflops, d=128, causal=False, n=4096):
    return dict(impl=impl, tflops=tflops, head_dim=d, causal=causal, seqlen=n)


def test_worklog_table_orders_steps_by_number_and_takes_ratios():
    records = [_record("h10_later", 300.0), _record("h2_pipelined", 200.0), _record("h1_tma", 100.0),
               _record("sdpa-flash", 250.0), _record("sdpa-cudnn", 400.0), _record("h1_tma", 999.0, n=8192)]
    rows = cm.worklog_table(records, head_dim=128, causal=False, seqlen=4096)
    assert [r["step"] for r in rows] == ["h1_tma", "h2_pipelined", "h10_later"]  # 10 after 2: by number
    assert rows[0]["vs_previous"] is None and rows[1]["vs_previous"] == 2.0 and rows[2]["vs_first"] == 3.0
    assert rows[2]["vs sdpa-flash"] == 1.2 and rows[2]["vs sdpa-cudnn"] == 0.75
    text = cm.format_worklog(rows)
    assert "h10_later" in text and "0.75x" in text and "sdpa-flash" not in [r["step"] for r in rows]


def test_format_worklog_keeps_columns_aligned_for_long_step_names():
    rows = cm.worklog_table([_record("h10_v_direct", 400.0), _record("h11_three_consumers", 440.0)],
                            head_dim=128, causal=False, seqlen=4096)
    lines = cm.format_worklog(rows).splitlines()
    assert len({line.index("TFLOP/s") + len("TFLOP/s") for line in lines[:1]} |
               {line.index(f"{row['tflops']:.1f}") + len(f"{row['tflops']:.1f}") for line, row in zip(lines[1:], rows)}) == 1


def test_ratio_range_spans_every_shape_of_one_head_dim():
    records = [_record("s11", 300.0), _record("s7", 200.0), _record("s11", 330.0, causal=True),
               _record("s7", 300.0, causal=True), _record("s11", 100.0, d=64), _record("s7", 1.0, d=64),
               _record("s11", 500.0, n=8192), _record("s7", None, n=8192)]   # a missing number is left out
    assert cm.ratio_range(records, "s11", "s7", head_dim=128) == (1.1, 1.5)
    assert cm.ratio_range(records, "s11", "s7", head_dim=64) == (100.0, 100.0)
    with pytest.raises(ValueError, match="no shape at head_dim=96"):
        cm.ratio_range(records, "s11", "s7", head_dim=96)


def test_worklog_table_marks_missing_numbers_and_refuses_an_unmeasured_shape():
    rows = cm.worklog_table([_record("s1_mma", None), _record("s2_ldmatrix", 50.0)], head_dim=128, causal=False,
                            seqlen=4096)
    assert rows[0]["tflops"] is None and rows[1]["vs_previous"] is None and rows[1]["vs sdpa-flash"] is None
    assert "—" in cm.format_worklog(rows) and cm.format_worklog([]) == "(no steps)"
    with pytest.raises(ValueError, match="no records at head_dim=64"):
        cm.worklog_table([_record("s1_mma", 1.0)], head_dim=64, causal=False, seqlen=4096)


@pytest.mark.parametrize("worklog,defaults,stored", [
    ("mma", {64: native_build.MMA_DEFAULT_STEP, 128: native_build.MMA_DEFAULT_STEP}, "06b_*_h200.json"),
    ("hopper", hopper.DEFAULT_STEPS, "06c_*_h200.json")])
def test_the_default_step_is_the_fastest_stored(worklog, defaults, stored):
    """Each worklog's default step at a head dim (the registry's kernel there) has a geometric-mean TFLOP/s over
    N >= 4k at that head dim within 2% (run-to-run noise) of the best step's, in every stored timing run of that
    worklog that timed it."""
    runs = [json.loads(p.read_text()) for p in sorted((native_build.ROOT / "images").glob(stored))]
    runs = [run for run in runs if "utils.course.bench.cuda_mma" in run["environment"]["command"]]  # timings only
    labels = {cm.step_label(s, worklog) for s in cm.WORKLOGS[worklog][0]}
    timed = {dim: 0 for dim in defaults}
    for run in runs:
        for dim, default in defaults.items():
            logs = {}
            for r in run["results"]:
                if r["impl"] in labels and r["head_dim"] == dim and r["seqlen"] >= 4096 and r["tflops"]:
                    logs.setdefault(r["impl"], []).append(math.log(r["tflops"]))
            means = {label: math.exp(sum(v) / len(v)) for label, v in logs.items()}
            if cm.step_label(default, worklog) in means:
                timed[dim] += 1
                assert means[cm.step_label(default, worklog)] >= 0.98 * max(means.values()), (dim, means)
    assert all(timed.values()), f"no stored run of the {worklog} worklog times its default step at some head dim: {timed}"


def test_format_pairs_divides_each_head_dims_pair_at_the_shapes_that_have_both():
    rec = lambda impl, d, c, n, t: dict(impl=impl, head_dim=d, causal=c, seqlen=n, tflops=t)
    records = [rec("h29_one_p_lazy", 64, False, 4096, 400.0), rec("h33_one_p_desc", 64, False, 4096, 440.0),
               rec("sdpa-cudnn", 64, False, 4096, 500.0),
               rec("h30_wide_lazy", 128, True, 8192, 600.0), rec("h34_wide_desc", 128, True, 8192, 540.0),
               rec("sdpa-cudnn", 128, True, 8192, 450.0),
               rec("h33_one_p_desc", 64, True, 4096, 300.0)]   # no step 29 there: no line
    text = cm.format_pairs(records, {64: ("one_p_desc", "one_p_lazy"), 128: ("wide_desc", "wide_lazy")})
    lines = text.splitlines()
    assert lines[0].split() == ["D", "mask", "N", "new", "/", "before", "new", "TFLOP/s", "new", "/", "cudnn"]
    assert len(lines) == 3
    assert lines[1].split() == ["64", "none", "4096", "1.10", "440", "0.88"]
    assert lines[2].split() == ["128", "causal", "8192", "0.90", "540", "1.20"]
    with pytest.raises(ValueError, match="step must be one of"):
        cm.format_pairs(records, {64: ("no_such_step", "one_p_lazy")})
    with pytest.raises(ValueError, match="no shape"):
        cm.format_pairs(records, {64: ("wide_desc", "wide_lazy")})
    with pytest.raises(TypeError, match="pairs"):
        cm.format_pairs(records, [("one_p_desc", "one_p_lazy")])
