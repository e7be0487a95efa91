"""The Triton tutorial as a peer in the benchmarks (utils.course.bench.peers, .forward, .backward, .peers_sweep).

The real tutorial needs a GPU driver to import, so these tests load small stand-ins written to tmp_path with its
interface; the sweep's timings are fakes. The last tests use the real file where one is given and there is a GPU.
"""
import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from utils.course.bench import backward, forward, peers, peers_sweep
from utils.eager.reference import naive_attention

# A stand-in with the tutorial's interface: `attention = _attention.apply`, forward(ctx, q, k, v, causal,
# sm_scale, warp_specialize=True); it records its calls and whether PYTEST_VERSION was visible at import.
FAKE = '''
import os
import torch
from utils.eager.reference import naive_attention

PYTEST_AT_IMPORT = os.environ.get("PYTEST_VERSION")
calls = []


class _attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, warp_specialize=True):
        calls.append((causal, sm_scale, warp_specialize))
        with torch.enable_grad():
            args = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = naive_attention(*args, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(out, *args)
        return out.detach().to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        out, *args = ctx.saved_tensors
        grads = torch.autograd.grad(out, args, do.float())
        return (*(g.to(do.dtype) for g in grads), None, None, None, None)


attention = _attention.apply
'''
OLD = '''
calls = []


def attention(q, k, v, causal, sm_scale):  # an older tutorial: no warp_specialize
    from utils.eager.reference import naive_attention
    calls.append((causal, sm_scale))
    return naive_attention(q, k, v, causal=causal, sm_scale=sm_scale)
'''


def write(tmp_path, text, name="06-fused-attention.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def fake(tmp_path):
    return write(tmp_path, FAKE)


def qkv(n=128, d=64, dtype=torch.float16, batch=1, heads=2):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, n, d, generator=gen).to(dtype) for _ in range(3)]


# ---- loading --------------------------------------------------------------------------------------------------

def test_load_records_the_file_and_hides_pytest_from_it(fake, monkeypatch):
    import triton

    monkeypatch.setenv("PYTEST_VERSION", "8")
    tutorial = peers.load_tutorial(fake, ref="release/3.6.x")
    assert tutorial.module.PYTEST_AT_IMPORT is None and os.environ["PYTEST_VERSION"] == "8"
    assert tutorial.module.__name__.startswith("_course_peer_tutorial_") and tutorial.warp_specialize
    info = tutorial.peer("triton-tutorial").provenance()
    assert info["sha256"] == hashlib.sha256(fake.read_bytes()).hexdigest() and info["path"] == str(fake.resolve())
    assert info["ref"] == "release/3.6.x" and info["triton"] == triton.__version__
    assert info["ref_matches_triton"] == (peers.release_branch() == "release/3.6.x")
    assert info["warp_specialize"] is False and tutorial.peer("triton-tutorial-ws").provenance()["warp_specialize"]
    assert peers.load_tutorial(fake).module is tutorial.module  # loaded once: its autotuning is kept
    quick = peers.load_tutorial(fake, tuned=False)  # as the tutorial's own tests import it: one config
    assert quick.module.PYTEST_AT_IMPORT == "tests" and os.environ["PYTEST_VERSION"] == "8"
    assert info["tuned"] and not quick.provenance()["tuned"] and quick.module is not tutorial.module
    assert peers.load_tutorial(fake, ref="5c846f0").provenance()["ref_matches_triton"] is None


def test_release_branch():
    assert peers.release_branch("3.6.0") == "release/3.6.x" and peers.release_branch("3.7.1+git0") == "release/3.7.x"
    with pytest.raises(ValueError, match="version"):
        peers.release_branch("main")


def test_path_from_the_environment_and_clear_errors_when_missing(fake, tmp_path, monkeypatch):
    monkeypatch.delenv(peers.ENV_VAR, raising=False)
    with pytest.raises(peers.TutorialNotFound, match=f"--tutorial PATH or {peers.ENV_VAR}") as info:
        peers.load_tutorial()
    assert "git clone --depth 1 --branch release/" in str(info.value) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(peers.TutorialNotFound, match="nope.py does not exist"):
        peers.load_tutorial(tmp_path / "nope.py")
    with pytest.raises(peers.TutorialNotFound, match="does not exist"):
        peers.load_tutorial(tmp_path)  # a folder is not the file
    monkeypatch.setenv(peers.ENV_VAR, str(fake))
    assert peers.load_tutorial().path == fake.resolve()
    with pytest.raises(TypeError, match="path must be"):
        peers.load_tutorial(3)
    with pytest.raises(TypeError, match="ref must be"):
        peers.load_tutorial(fake, ref=" ")


def test_a_file_that_fails_to_import_or_lacks_attention(tmp_path):
    broken = write(tmp_path, "raise RuntimeError('0 active drivers')\n", "broken.py")
    with pytest.raises(peers.TutorialImportFailed, match="broken.py failed: RuntimeError: 0 active drivers"):
        peers.load_tutorial(broken)
    assert not [m for m in sys.modules if m.startswith("_course_peer_tutorial_")
                and getattr(sys.modules[m], "__file__", "") == str(broken.resolve())]
    for text in ("x = 1\n", "attention = 3\n"):
        with pytest.raises(peers.TutorialInterfaceError, match="no callable `attention`"):
            peers.load_tutorial(write(tmp_path, text, f"f{len(text)}.py"))


# ---- the peer -------------------------------------------------------------------------------------------------

def test_the_peer_calls_the_tutorial_forward_and_backward(fake):
    tutorial = peers.load_tutorial(fake)
    q, k, v = qkv()
    out = tutorial.peer("triton-tutorial")(q, k, v, causal=True)
    ref = naive_attention(q.float(), k.float(), v.float(), causal=True)
    assert out.dtype == torch.float16 and (out.float() - ref).abs().max() < 1e-2
    assert tutorial.module.calls[-1] == (True, pytest.approx(64 ** -0.5), False)
    tutorial.peer("triton-tutorial-ws")(q, k, v, sm_scale=0.5)
    assert tutorial.module.calls[-1] == (False, 0.5, True)
    qg = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(tutorial.peer("triton-tutorial")(qg, k, v).float().sum(), (qg,))
    assert dq.shape == q.shape and dq.abs().sum() > 0


def test_an_older_tutorial_without_warp_specialize(tmp_path):
    tutorial = peers.load_tutorial(write(tmp_path, OLD, "old.py"))
    assert not tutorial.warp_specialize
    q, k, v = qkv()
    tutorial.peer("triton-tutorial")(q, k, v)
    assert tutorial.module.calls[-1] == (False, pytest.approx(0.125))
    assert "takes no warp_specialize" in tutorial.peer("triton-tutorial-ws").unsupported(64, torch.float16, False)


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.bfloat16), TypeError, "q has dtype torch.bfloat16"),
    (dict(d=16), ValueError, "head_dim 16 is not supported"),
    (dict(n=200), ValueError, "N=200 .*multiple of 128"),
])
def test_the_peer_refuses_what_the_tutorial_cannot_run(fake, change, error, match):
    peer = peers.load_tutorial(fake).peer("triton-tutorial")
    with pytest.raises(error, match=match):
        peer(*qkv(**change))


def test_the_peer_validates_its_arguments(fake):
    peer = peers.load_tutorial(fake).peer("triton-tutorial")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k has shape .* the tutorial needs equal shapes"):
        peer(q, k[:, :, :64].contiguous(), v[:, :, :64].contiguous())
    with pytest.raises(ValueError, match="q must be contiguous"):
        peer(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        peer(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="sm_scale must be finite and positive"):
        peer(q, k, v, sm_scale=-1.0)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        peer(None, k, v)
    with pytest.raises(ValueError, match="unknown peer"):
        peer.tutorial.peer("flash")


def test_what_the_tutorial_supports(fake):
    tutorial = peers.load_tutorial(fake)
    plain, ws = tutorial.peer("triton-tutorial"), tutorial.peer("triton-tutorial-ws")
    f16 = torch.float16
    for d in (64, 128):
        for causal in (False, True):
            for mode in ("fwd", "bwd", "fwd_bwd"):
                assert plain.supports(d, f16, causal, seqlen=16384, mode=mode, capability=(9, 0))
    assert "fp16 inputs only" in plain.unsupported(64, torch.bfloat16, False)
    assert "head_dim 16" in plain.unsupported(16, f16, False)
    assert "multiple of 128" in plain.unsupported(64, f16, False, seqlen=1000)
    assert ws.supports(128, f16, False, mode="fwd", capability=(9, 0))
    assert ws.supports(128, f16, True, mode="fwd", capability=(10, 0)) and ws.supports(64, f16, True)
    assert "sm_90 causal" in ws.unsupported(128, f16, True, mode="fwd", capability=(9, 0))
    assert "sm_80" in ws.unsupported(64, f16, False, capability=(8, 0))
    assert "backward" in ws.unsupported(64, f16, False, mode="bwd")
    for kwargs, error in ((dict(head_dim="64"), TypeError), (dict(dtype="fp16"), TypeError),
                          (dict(causal=1), TypeError), (dict(seqlen=0), ValueError), (dict(mode="train"), ValueError),
                          (dict(capability=(9,)), TypeError), (dict(capability=[9, 0]), TypeError)):
        call = dict(dict(head_dim=64, dtype=f16, causal=False), **kwargs)
        with pytest.raises(error, match=next(iter(kwargs))):
            plain.unsupported(call.pop("head_dim"), call.pop("dtype"), call.pop("causal"), **call)


def test_from_args_skips_a_missing_tutorial_with_a_message(fake, tmp_path, capsys):
    none = argparse.Namespace(peers=[], tutorial=None, tutorial_ref=None)
    assert peers.from_args(none) == {} and capsys.readouterr().err == ""
    missing = argparse.Namespace(peers=["triton-tutorial"], tutorial=tmp_path / "nope.py", tutorial_ref=None)
    assert peers.from_args(missing) == {}
    err = capsys.readouterr().err
    assert err.startswith("skipping triton-tutorial: the tutorial file") and "Traceback" not in err
    other = argparse.Namespace(peers=["triton-tutorial", "triton-tutorial-ws"], tutorial=fake,
                               tutorial_ref="release/2.0.x")
    assert list(peers.from_args(other)) == ["triton-tutorial", "triton-tutorial-ws"]
    assert "comes from release/2.0.x" in capsys.readouterr().err


# ---- utils.course.bench.forward --------------------------------------------------------------------------------------

def test_forward_measures_the_peer_beside_the_others(fake, tmp_path):
    assert forward.parse_args([]).peers == []  # the course benchmark is unchanged without --peers
    args = forward.parse_args(["--impls", "naive", "--sdpa", "--peers", "triton-tutorial", "--tutorial", str(fake),
                               "--tutorial-ref", "release/3.6.x", "--seqlens", "128", "192", "--head-dims", "64",
                               "--batch", "1", "--heads", "2", "--dtype", "fp16", "--causal", "no"])
    fns = forward.candidates(args)
    assert list(fns) == ["naive", "triton-tutorial"]
    ran = []

    def time_ms(fn, q, k, v, causal):
        ran.append((fn.__name__, q.shape[2]))
        return 2.0 if fn.__name__ == "naive_attention" else 1.0

    records = forward.run(args, fns, time_ms=time_ms, device="cpu", progress=False)
    assert ran == [("naive_attention", 128), ("triton-tutorial", 128), ("naive_attention", 192)]
    (skipped,) = [r for r in records if r["error"]]
    assert skipped["impl"] == "triton-tutorial" and skipped["seqlen"] == 192 and skipped["tflops"] is None
    assert skipped["error"].startswith("not supported: N=192")
    assert forward.ratio_table(records, "naive", ["triton-tutorial"])[0]["vs triton-tutorial"] == pytest.approx(0.5)
    data = json.loads(forward.write_json(records, args, tmp_path / "f.json", fns).read_text())
    assert data["peers"]["triton-tutorial"]["sha256"] == hashlib.sha256(fake.read_bytes()).hexdigest()
    assert "peers" not in json.loads(forward.write_json(records, args, tmp_path / "g.json").read_text())


def test_forward_parse_args_with_only_peers(fake):
    args = forward.parse_args(["--impls", "--sdpa", "--peers", "triton-tutorial-ws"])
    assert args.peers == ["triton-tutorial-ws"] and args.tutorial is None
    with pytest.raises(SystemExit):
        forward.parse_args(["--peers", "flash"])
    with pytest.raises(SystemExit):
        forward.parse_args(["--impls", "--sdpa", "--peers"])


# ---- utils.course.bench.backward -------------------------------------------------------------------------------------

ROWS = [dict(backend=b, seqlen=n, head_dim=64, causal=c, ms=1.0, tflops=t, error=None)
        for n in (2048, 4096) for c in (False, True)
        for b, t in (("triton", 300.0), ("sdpa_flash", 250.0), ("sdpa_efficient", 100.0),
                     ("triton_tutorial", 200.0))]


def test_backward_table_and_plot_with_the_tutorial():
    assert backward.ratios(ROWS, "triton", "triton_tutorial")[(4096, 64, True)] == pytest.approx(1.5)
    header, first = backward.format_table(ROWS).splitlines()[:2]
    assert header.split() == ["N", "D", "causal", "triton", "sdpa_flash", "sdpa_efficient", "triton_tutorial",
                              "triton/flash", "triton/tutorial"]
    assert first.split()[3:] == ["300.0", "250.0", "100.0", "200.0", "1.20x", "1.50x"]
    assert len(first) == len(header)  # columns as wide as their names
    missing = [r for r in ROWS if not (r["backend"] == "sdpa_flash" and r["seqlen"] == 2048)]
    line = backward.format_table(missing).splitlines()[1]
    assert line.split()[3:] == ["300.0", "-", "100.0", "200.0", "1.50x"] and len(line) == len(header)
    fig = backward.plot_backward_benchmark(ROWS)
    assert "triton_tutorial full" in fig.axes[0].get_legend_handles_labels()[1]


def test_backward_arguments():
    args = backward.parse_args([])
    assert (args.backends, args.dtype, args.peers) == (list(backward.BACKENDS), "bf16", [])
    args = backward.parse_args(["--dtype", "fp16", "--backends", "triton", "sdpa_efficient", "--peers",
                                "triton-tutorial", "--tutorial", "x.py"])
    assert args.backends == ["triton", "sdpa_efficient"] and args.tutorial == Path("x.py")
    for argv in (["--peers", "triton-tutorial-ws"], ["--backends", "triton_tutorial"], ["--dtype", "fp32"]):
        with pytest.raises(SystemExit):
            backward.parse_args(argv)
    with pytest.raises(ValueError, match="go together"):
        backward.run_backward_benchmark(backends=("triton", "triton_tutorial"))
    with pytest.raises(ValueError, match="unknown backends"):
        backward.run_backward_benchmark(backends=("nope",))


# ---- utils.course.bench.peers_sweep ----------------------------------------------------------------------------------

def test_sweep_defaults_are_the_issues_grid():
    args = peers_sweep.parse_args([])
    assert args.peers == ["triton-tutorial", "triton-tutorial-ws", "flash-attn-4"] and args.impls == ["triton"]
    assert args.sdpa == ["flash", "cudnn", "efficient"] and args.modes == ["fwd", "bwd"]
    assert args.dtypes == ["fp16", "bf16"] and args.head_dims == [64, 128] and args.causal == "both"
    assert args.seqlens == [1024, 2048, 4096, 8192, 16384] and len(peers_sweep.configurations(args)) == 40
    for argv in (["--modes", "train"], ["--dtypes", "int8"], ["--rep", "0"], ["--name", "a/b"],
                 ["--impls", "--sdpa", "--peers"]):
        with pytest.raises(SystemExit):
            peers_sweep.parse_args(argv)


def small_sweep(fake, *extra):
    return peers_sweep.parse_args(["--impls", "--sdpa", "--peers", "triton-tutorial", "--tutorial", str(fake),
                                   "--seqlens", "128", "--head-dims", "64", "--batch", "1", "--heads", "2",
                                   "--dtypes", "fp16", "fp32", "--causal", "both", *extra])


def sweep_fns(args):
    def wrong(q, k, v, *, causal=False, sm_scale=None):  # fast and wrong: must be flagged, not ranked
        return naive_attention(q, k, v, causal=not causal, sm_scale=sm_scale)

    def broken(q, k, v, *, causal=False, sm_scale=None):
        raise AssertionError("N_CTX % 128 == 0\nmore")

    return {"naive": naive_attention, **forward.candidates(args), "wrong": wrong, "broken": broken}


def test_sweep_runs_every_mode_and_flags_what_is_wrong(fake):
    args = small_sweep(fake)
    fns = sweep_fns(args)
    timed, saved = [], []

    def time_ms(closure):
        result = closure()
        timed.append(type(result).__name__)  # a forward gives a tensor, a backward its three gradients
        return 1.0

    records = peers_sweep.run(args, fns, time_ms=time_ms, device="cpu", progress=False,
                              checkpoint=lambda r: saved.append(len(r)))
    assert len(records) == 4 * len(fns) * 2 and saved == [8, 16, 24, 32]  # 2 dtypes x 2 masks, 2 modes
    by = {(r["impl"], r["mode"], r["dtype"], r["causal"]): r for r in records}
    ok = by[("naive", "bwd", "fp16", True)]
    assert ok["accurate"] and ok["max_err"] < 1e-2 and ok["tflops"] == pytest.approx(
        2.5 * 4 * 2 * 128 * 128 * 64 / 2 / 1e-3 / 1e12)
    assert by[("triton-tutorial", "fwd", "fp16", False)]["accurate"] is True
    assert by[("triton-tutorial", "fwd", "fp32", False)]["error"].startswith("not supported: float32")
    wrong = by[("wrong", "fwd", "fp16", True)]
    assert wrong["accurate"] is False and wrong["max_err"] > peers_sweep.TOLERANCE["fp16"] and wrong["tflops"]
    assert by[("broken", "bwd", "fp32", False)]["error"] == "AssertionError: N_CTX % 128 == 0"
    assert timed.count("Tensor") == timed.count("tuple") == 4 + 4 + 2  # naive, wrong; the tutorial: fp16 only
    done = {peers_sweep.key(r) for r in records if r["dtype"] == "fp16"}
    rest = peers_sweep.run(args, fns, time_ms=lambda c: 1.0, device="cpu", progress=False, done=done)
    assert {peers_sweep.key(r) for r in rest} == {peers_sweep.key(r) for r in records} - done
    text = peers_sweep.format_tables(records)
    assert text.startswith("fwd fp16 (TFLOP/s)") and "bwd fp32 (TFLOP/s)" in text
    assert "inaccurate (left out" in text and "wrong fwd fp16 D=64 N=128: max_err" in text


def test_sweep_json_resume_and_plot(fake, tmp_path):
    args = small_sweep(fake, "--modes", "fwd")
    fns = sweep_fns(args)
    records = peers_sweep.run(args, fns, time_ms=lambda c: 1.0, device="cpu", progress=False)
    path = peers_sweep.write_json(records, args, tmp_path / "s.json", fns, command="python -m utils.course.bench.peers_sweep")
    data = json.loads(path.read_text())
    assert data["results"] == records and data["settings"]["batch"] == 1 and data["earlier"] == []
    assert data["peers"]["triton-tutorial"]["sha256"] == hashlib.sha256(fake.read_bytes()).hexdigest()
    assert data["environment"]["command"] == "python -m utils.course.bench.peers_sweep"
    assert [p.name for p in tmp_path.iterdir() if p.is_file() and p.suffix != ".py"] == ["s.json"]  # no partial file
    kept, earlier = peers_sweep.resume_from(path, args, fns)
    assert kept == records and earlier == [data["environment"]]
    again = small_sweep(fake, "--modes", "fwd", "--resume", "--remeasure", "fwd")   # every fwd record dropped
    assert peers_sweep.resume_from(path, again, fns)[0] == []
    fp32 = small_sweep(fake, "--modes", "fwd", "--resume", "--remeasure", "fwd", "--dtypes", "fp32")
    assert peers_sweep.resume_from(path, fp32, fns)[0] == [r for r in records if r["dtype"] == "fp16"]  # its grid's
    with pytest.raises(ValueError, match="measured with"):
        peers_sweep.resume_from(path, small_sweep(fake, "--rep", "7"), fns)
    for field in peers_sweep.ENVIRONMENT:   # another GPU, profile or version: its numbers do not compare
        moved = tmp_path / f"moved_{field}.json"
        moved.write_text(json.dumps(dict(data, environment=dict(data["environment"], **{field: "elsewhere"}))))
        with pytest.raises(ValueError, match=f"measured with {field} 'elsewhere'"):
            peers_sweep.resume_from(moved, args, fns)
    other = write(tmp_path, FAKE + "\n# another version\n", "other.py")
    with pytest.raises(ValueError, match="from another file"):
        peers_sweep.resume_from(path, args, {"triton-tutorial": peers.load_tutorial(other).peer("triton-tutorial")})
    png = peers_sweep.plot(records, tmp_path / "s.png", title="fake")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no records"):
        peers_sweep.plot([], tmp_path / "e.png")


def test_sweep_rounds_take_turns_and_keep_the_median(fake):
    """Round r starts at the r-th closure; each record keeps its timings and their median."""
    args = small_sweep(fake, "--modes", "bwd", "--dtypes", "fp16", "--causal", "no", "--rounds", "3")
    fns = {"a": naive_attention, "b": naive_attention}
    closures, calls = {}, []

    def time_ms(closure):
        if closure not in closures:
            closures[closure] = "ab"[len(closures)]
        calls.append(closures[closure])
        return float(len(calls))

    records = peers_sweep.run(args, fns, time_ms=time_ms, device="cpu", progress=False)
    assert "".join(calls) == "abbaab"
    by = {r["impl"]: r for r in records}
    assert by["a"]["rounds"] == [1.0, 4.0, 5.0] and by["a"]["ms"] == 4.0
    assert by["b"]["rounds"] == [2.0, 3.0, 6.0] and by["b"]["ms"] == 3.0
    with pytest.raises(SystemExit):
        peers_sweep.parse_args(["--remeasure", "bwd"])        # goes with --resume
    nothing = small_sweep(fake, "--dtypes", "fp32", "--rounds", "2")      # the tutorial cannot run fp32
    records = peers_sweep.run(nothing, {"triton-tutorial": forward.candidates(nothing)["triton-tutorial"]},
                              time_ms=time_ms, device="cpu", progress=False)
    assert all(r["error"].startswith("not supported") for r in records)


def test_kernel_steps_name_each_pass_that_a_mode_runs():
    from utils.native.backward import BWD_DEFAULT_STEP
    from utils.native.build import MMA_DEFAULT_STEP
    from utils.native.hopper import DEFAULT_STEPS
    from utils.native.hopper_backward import BWD_DEFAULT_STEPS

    for d in (64, 128):
        assert peers_sweep.kernel_steps("cuda_hopper", "fwd", d) == {"fwd": DEFAULT_STEPS[d]}
        assert peers_sweep.kernel_steps("cuda_hopper", "bwd", d) == {"bwd": BWD_DEFAULT_STEPS[d]}
        assert peers_sweep.kernel_steps("cuda_hopper", "fwd_bwd", d) == {"fwd": DEFAULT_STEPS[d],
                                                                         "bwd": BWD_DEFAULT_STEPS[d]}
    assert peers_sweep.kernel_steps("cuda", "fwd_bwd", 64) == {"fwd": MMA_DEFAULT_STEP, "bwd": BWD_DEFAULT_STEP}
    assert peers_sweep.kernel_steps("triton", "bwd", 64) == {} == peers_sweep.kernel_steps("flash-attn-4", "fwd", 64)
    with pytest.raises(ValueError, match="mode must be one of"):
        peers_sweep.kernel_steps("cuda_hopper", "train", 64)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        peers_sweep.kernel_steps("cuda_hopper", "bwd", 96)


def test_sweep_rows_record_the_steps_they_measured(fake):
    """A kernel built in steps keeps, in each measured row, the step each pass ran; a failed row keeps none."""
    args = small_sweep(fake, "--dtypes", "fp16", "--causal", "no", "--modes", "fwd", "bwd", "fwd_bwd")

    def broken(q, k, v, *, causal=False, sm_scale=None):
        raise RuntimeError("no kernel")

    records = peers_sweep.run(args, {"cuda_hopper": naive_attention, "cuda": broken, "triton": naive_attention},
                              time_ms=lambda c: 1.0, device="cpu", progress=False)
    by = {(r["impl"], r["mode"]): r for r in records}
    for mode in ("fwd", "bwd", "fwd_bwd"):
        assert by["cuda_hopper", mode]["steps"] == peers_sweep.kernel_steps("cuda_hopper", mode, 64)
        assert "steps" not in by["triton", mode] and "steps" not in by["cuda", mode]
    assert set(by["cuda_hopper", "fwd_bwd"]["steps"]) == {"fwd", "bwd"}


def test_stale_steps_names_rows_measured_with_another_default(tmp_path):
    row = dict(impl="cuda_hopper", mode="bwd", dtype="bf16", head_dim=64, causal=True, seqlen=2048)
    today = peers_sweep.kernel_steps("cuda_hopper", "bwd", 64)
    path = tmp_path / "peers_x.json"
    path.write_text(json.dumps({"results": [dict(row, steps=today), dict(row, impl="triton"),
                                            dict(row, seqlen=4096, steps={"bwd": "atomic_dq"})]}))
    assert peers_sweep.stale_steps(path) == [
        "peers_x.json: cuda_hopper bwd bf16 D=64 N=4096 causal measured {'bwd': 'atomic_dq'}"]


def test_stored_sweeps_measured_todays_default_steps():
    """Every stored sweep's recorded steps are today's defaults (a changed default needs a new measurement)."""
    images = Path(__file__).resolve().parents[1] / "images"
    stale = [line for path in sorted(images.glob("peers*.json")) for line in peers_sweep.stale_steps(path)]
    assert not stale, "measure these again (or restore the default):\n" + "\n".join(stale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_sweep_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        peers_sweep.main(["--peers"])


def record(impl, tflops, accurate=True, n=1024, causal=False):
    return dict(impl=impl, mode="fwd", dtype="fp16", head_dim=64, causal=causal, seqlen=n, ms=1.0, tflops=tflops,
                max_err=0.0, accurate=accurate, error=None)


def test_versus_takes_the_best_accurate_tutorial_variant():
    records = [record("triton", 300.0), record("triton-tutorial", 200.0), record("triton-tutorial-ws", 250.0),
               record("triton", 300.0, n=2048), record("triton-tutorial", 150.0, n=2048),
               record("triton-tutorial-ws", 600.0, accurate=False, n=2048),
               record("triton", 300.0, causal=True), record("triton-tutorial", None, accurate=None, causal=True)]
    rows = peers_sweep.versus(records)
    assert [(r["seqlen"], r["peer"], r["ratio"]) for r in rows] == [(1024, "triton-tutorial-ws", 1.2),
                                                                     (2048, "triton-tutorial", 2.0)]
    records[0]["tflops"] = 125.0
    text = peers_sweep.format_versus(peers_sweep.versus(records))
    assert "min 0.50x at fwd fp16 D=64 N=1024" in text and "below 1.0 on 1 of 2 shapes" in text
    assert "no shape" in peers_sweep.format_versus([])


def test_versus_the_course_takes_its_fastest_accurate_kernel_per_shape():
    records = [record("triton", 300.0), record("gluon", 360.0), record("triton-tutorial", 200.0),
               record("triton", 300.0, n=2048), record("gluon", 900.0, accurate=False, n=2048),
               record("triton-tutorial", 400.0, n=2048), record("gluon", 100.0, causal=True)]
    rows = peers_sweep.versus(records, ("triton", "gluon"))
    assert [(r["seqlen"], r["impl"], r["ratio"]) for r in rows] == [(1024, "gluon", 1.8), (2048, "triton", 0.75)]
    assert peers_sweep.versus(records, ("gluon",)) == peers_sweep.versus(records, "gluon")
    text = peers_sweep.format_versus(rows, ("triton", "gluon"))
    assert text.startswith("best of triton, gluon / tutorial") and "min 0.75x at fwd fp16 D=64 N=2048" in text


# ---- FlashAttention-4 --------------------------------------------------------------------------------------

class FakeFA4:
    """flash_attn.cute's interface on (batch, N, heads, head_dim) tensors: returns (out, lse) as flash-attn-4 does;
    records the layout and storage of what it was given."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False):
        self.calls.append(dict(shape=tuple(q.shape), ptrs=tuple(t.data_ptr() for t in (q, k, v)),
                               scale=softmax_scale, causal=causal))
        out = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                              sm_scale=softmax_scale)
        return out.transpose(1, 2), torch.zeros(q.shape[0], q.shape[2], q.shape[1])


@pytest.fixture
def fake_fa4(monkeypatch):
    import types

    fake = FakeFA4()
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = fake.flash_attn_func
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    real_version = metadata.version

    def version(name):  # the fake has no distribution, even where the real package is installed (the GPU machine)
        if name in peers.FA4_PACKAGES:
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    return fake


def test_flash_attention_4_missing_is_named_with_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_attn", None)   # import flash_attn raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(peers.FlashAttention4Unavailable, match="flash_attn.cute does not import: .*fa4_pack.sh"):
        peers.load_flash_attention_4()
    args = argparse.Namespace(peers=["flash-attn-4"], tutorial=None, tutorial_ref=None)
    assert peers.from_args(args) == {}
    err = capsys.readouterr().err
    assert err.startswith("skipping flash-attn-4: flash_attn.cute does not import") and "Traceback" not in err


def test_flash_attention_4_gets_views_in_its_layout_and_matches_attention(fake_fa4):
    peer = peers.load_flash_attention_4()
    assert peer.label == peer.__name__ == "flash-attn-4"
    assert peer.provenance()["versions"] == {"flash-attn-4": None, "nvidia-cutlass-dsl": None}   # the fake's
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 64, generator=gen, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 53, 64, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    out = peer(q, k, v, causal=True, sm_scale=0.2)
    (call,) = fake_fa4.calls
    assert call["shape"] == (2, 37, 4, 64) and call["ptrs"] == tuple(t.data_ptr() for t in (q, k, v)), "no copies"
    assert call["scale"] == 0.2 and call["causal"] is True
    assert out.shape == q.shape
    torch.testing.assert_close(out, naive_attention(q, k, v, causal=True, sm_scale=0.2))
    assert all(g is not None for g in torch.autograd.grad(out.float().sum(), (q, k, v)))
    peer(q, k, v)
    assert fake_fa4.calls[-1]["scale"] == pytest.approx(64 ** -0.5)   # the course's default scale, passed on


def test_what_flash_attention_4_supports(fake_fa4):
    peer = peers.load_flash_attention_4()
    f16, bf16 = torch.float16, torch.bfloat16
    assert peer.supports(128, bf16, True, seqlen=1000, capability=(9, 0)) and peer.supports(64, f16, False)
    assert peer.unsupported(64, torch.float32, False) == "float32 (it runs fp16 and bf16)"
    assert peer.unsupported(20, f16, False) == "head_dim 20 (it runs multiples of 8 from 8 to 256)"
    assert peer.unsupported(512, f16, False).startswith("head_dim 512")
    assert peer.unsupported(64, f16, False, capability=(8, 0)) == "sm_80 (its kernels are for sm_90 and sm_100)"
    assert peer.supports(64, f16, False, capability=(10, 0))
    with pytest.raises(TypeError, match="dtype"):
        peer.unsupported(64, "fp16", False)
    with pytest.raises(ValueError, match="mode"):
        peer.unsupported(64, f16, False, mode="train")
    q = torch.zeros(1, 2, 8, 64)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        peer(q, q, q)
    with pytest.raises(TypeError, match="fn must be callable"):
        peers.FlashAttention4Peer(None, {})


def test_the_sweep_compares_the_course_with_flash_attention_4(fake_fa4, tmp_path):
    args = peers_sweep.parse_args(["--impls", "--sdpa", "--peers", "flash-attn-4", "--seqlens", "128",
                                   "--head-dims", "64", "--batch", "1", "--heads", "2", "--dtypes", "fp16", "fp32",
                                   "--causal", "no", "--modes", "fwd"])
    fns = {"naive": naive_attention, **forward.candidates(args)}
    assert list(fns) == ["naive", "flash-attn-4"]
    records = peers_sweep.run(args, fns, time_ms=lambda c: 1.0, device="cpu", progress=False)
    by = {(r["impl"], r["dtype"]): r for r in records}
    assert by["flash-attn-4", "fp16"]["accurate"] and by["flash-attn-4", "fp32"]["error"].startswith(
        "not supported: float32")
    rows = peers_sweep.versus(records, "naive", (peers.FA4,))
    assert [(r["dtype"], r["peer"], r["ratio"]) for r in rows] == [("fp16", "flash-attn-4", 1.0)]
    assert peers_sweep.format_versus(rows, "naive", peers.FA4).startswith("naive / flash-attn-4: min 1.00x")
    assert peers_sweep.versus(records, "naive") == []   # the tutorial was not run
    path = peers_sweep.write_json(records, args, tmp_path / "s.json", fns)
    assert json.loads(path.read_text())["peers"]["flash-attn-4"]["package"] == "flash-attn-4"
    newer = {"flash-attn-4": peers.FlashAttention4Peer(fake_fa4.flash_attn_func, {"flash-attn-4": "9"})}
    with pytest.raises(ValueError, match="measured flash-attn-4"):
        peers_sweep.resume_from(path, args, newer)


def _fa4_importable() -> bool:
    import importlib

    try:
        importlib.import_module("flash_attn.cute")
    except Exception:  # noqa: BLE001 - not installed, or its libraries do not load
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and _fa4_importable()), reason="needs flash-attn-4 on a GPU")
def test_the_real_flash_attention_4_on_gpu():
    """The installed package against SDPA, forward and backward, GQA and causal, through the peer."""
    import torch.nn.functional as F

    peer = peers.load_flash_attention_4()
    assert peer.versions["flash-attn-4"] is not None
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    for causal in (False, True):
        out = peer(q, k, v, causal=causal)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
        do = torch.randn_like(out)
        for g, g_ref in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
            torch.testing.assert_close(g, g_ref, atol=5e-2, rtol=5e-2)


# ---- the real tutorial ----------------------------------------------------------------------------------------

REAL = os.environ.get(peers.ENV_VAR) or str(Path(__file__).resolve().parents[1] / ".peer" / "06-fused-attention.py")


@pytest.mark.skipif(torch.cuda.is_available() or not Path(REAL).is_file(), reason="checks the CPU error")
def test_the_real_tutorial_needs_a_gpu_to_import():
    with pytest.raises(peers.TutorialImportFailed, match="driver"):
        peers.load_tutorial(REAL)


@pytest.mark.gpu
@pytest.mark.skipif(not Path(REAL).is_file(), reason=f"no tutorial file (set {peers.ENV_VAR})")
def test_the_real_tutorial_on_gpu():
    peer = peers.load_tutorial(REAL, tuned=False).peer("triton-tutorial")  # one config: no long autotuning
    q, k, v = (t.cuda().requires_grad_() for t in qkv(n=256, d=64, batch=2))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).half().cuda()
    for causal in (False, True):
        out = peer(q, k, v, causal=causal)
        ref = naive_attention(*(t.float() for t in (q, k, v)), causal=causal)
        assert (out.float() - ref).abs().max() < 1e-2
        grads = torch.autograd.grad(out, (q, k, v), do)
        refs = torch.autograd.grad(ref, (q, k, v), do.float())
        assert all((g.float() - r).abs().max() < 2e-2 for g, r in zip(grads, refs))
