"""utils.course.bench.timeline and the timeline helpers of utils.native.hopper: arguments, the summary and the
records on fake timelines (CPU); the kernel's own milestones on an H100/H200."""
import json

import pytest
import torch

from utils.native import hopper
from utils.course.bench import timeline as tl
from utils.gpu import capability


def fake_timeline(tiles, per_tile=1000, fixed=3000, sms=2):
    """Blocks one after another on `sms` SMs, each `fixed + per_tile * tiles` ns long with a 300 ns launch gap."""
    tiles = torch.tensor(tiles)
    duration = fixed + per_tile * tiles
    start, end, free = [], [], [0] * sms
    for i, d in enumerate(duration.tolist()):
        unit = i % sms
        start.append(free[unit])
        end.append(free[unit] + d)
        free[unit] += d + 300
    phases = torch.stack([duration // 6] * 5 + [duration - 5 * (duration // 6)], dim=1)
    return {"sm": torch.arange(len(tiles)) % sms, "tiles": tiles, "start": torch.tensor(start),
            "end": torch.tensor(end), "phases": phases}


def test_summary_fits_time_per_tile_and_per_block():
    summary = hopper.timeline_summary(fake_timeline([2, 4, 6, 8, 10]))
    assert summary["ns_per_tile"] == pytest.approx(1000) and summary["fixed_ns"] == pytest.approx(3000)
    assert summary["launch_gap_ns"] == 300 and summary["blocks"] == 5
    assert list(summary["phases_ns"]) == list(hopper.TIMELINE_PHASES)
    assert summary["block_ns"] == 3000 + 1000 * 6
    assert summary["span_ns"] == 5000 + 300 + 9000 + 300 + 13000  # the first SM's three blocks


def test_summary_without_a_causal_mask_has_no_fit():
    summary = hopper.timeline_summary(fake_timeline([8] * 4))
    assert summary["ns_per_tile"] is None and summary["fixed_ns"] is None and summary["block_ns"] == 11000


def test_summary_and_timeline_name_bad_arguments():
    with pytest.raises(TypeError, match="block_timeline's dict"):
        hopper.timeline_summary({"sm": torch.zeros(1)})
    q = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="warp-specialised step"):
        hopper.block_timeline(q, q, q, step="pipelined")
    with pytest.raises(ValueError, match="step must be one of"):
        hopper.block_timeline(q, q, q, step="fastest")
    with pytest.raises(TypeError, match="4-d torch.Tensor"):
        hopper.block_timeline(q[0], q, q)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        hopper.block_timeline(q, q, q)


def test_parse_args_defaults_and_errors():
    args = tl.parse_args([])
    assert args.steps == ["three_consumers", "tma_store"] and args.seqlen == 4096 and args.head_dims == [128, 64]
    for bad in (["--steps", "tma"], ["--steps", "fastest"], ["--repeats", "0"], ["--warmup", "-1"],
                ["--name", "a/b"], ["--head-dims", "96"]):
        with pytest.raises(SystemExit):
            tl.parse_args(bad)


def test_measure_keeps_the_median_span_launch(monkeypatch):
    spans = iter([5, 1, 3] * 4)
    warmups = []
    monkeypatch.setattr(hopper, "flash_hopper", lambda q, k, v, **kw: warmups.append(kw))
    monkeypatch.setattr(hopper, "block_timeline", lambda q, k, v, **kw: kw)
    monkeypatch.setattr(hopper, "timeline_summary", lambda timeline: {"span_ns": next(spans)})
    args = tl.parse_args(["--steps", "tma_store", "--repeats", "3", "--warmup", "2", "--batch", "1", "--heads", "1",
                          "--seqlen", "64", "--causal", "yes"])
    records = tl.measure(args, device="cpu")
    assert [(r["step"], r["head_dim"], r["causal"], r["seqlen"], r["span_ns"]) for r in records] == [
        ("tma_store", 128, True, 64, 3), ("tma_store", 64, True, 64, 3)]
    assert warmups == [{"causal": True, "step": "tma_store"}] * 4


@pytest.mark.skipif(capability() != (9, 0), reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("step", ["three_consumers", "persistent", "tma_store"])
def test_the_kernel_notes_each_blocks_milestones(step):
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1000, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    timeline = hopper.block_timeline(q, k, v, causal=True, step=step)
    blocks = len(timeline["sm"])
    if step == "persistent":  # one block per SM, each its first work item
        assert 0 < blocks <= torch.cuda.get_device_properties(0).multi_processor_count
    else:
        assert blocks == 8 * -(-1000 // 128)  # two consumers of 64 rows per block at D = 128
    phases, duration = timeline["phases"], timeline["end"] - timeline["start"]
    assert (phases >= 0).all() and torch.equal(phases.sum(dim=1), duration) and (duration > 0).all()
    assert set(timeline["tiles"].tolist()) <= set(range(1, 17)) and timeline["start"].min() == 0
    summary = hopper.timeline_summary(timeline)
    json.dumps(summary)  # what the benchmark stores
    assert summary["ns_per_tile"] is None or summary["ns_per_tile"] > 0

