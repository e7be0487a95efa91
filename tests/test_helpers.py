import pytest
import torch

from utils.course.bench import attention_flops, benchmark, tflops
from utils.course.exercises import check
from utils.course.plotting import pyplot, save_figure, use_course_style, write_png
from utils.course.testing import (ODD_SHAPES_64_128, assert_attention_matches_reference, assert_close,
                           assert_matches_on_odd_shapes, misaligned, pairwise, random_qkv, reference_lse, tolerances)
from utils.eager.reference import naive_attention


def test_attention_flops():
    assert attention_flops(1, 1, 2, 3, 4) == 4 * 2 * 3 * 4
    assert attention_flops(2, 3, 8, 8, 16, causal=True) == 4 * 2 * 3 * 8 * 8 * 16 / 2
    assert attention_flops(1, 1, 8, 8, 8, mode="bwd") == 2.5 * attention_flops(1, 1, 8, 8, 8)
    assert attention_flops(1, 1, 8, 8, 8, mode="fwd_bwd") == 3.5 * attention_flops(1, 1, 8, 8, 8)


@pytest.mark.parametrize("args,kwargs,error", [((0, 1, 1, 1, 1), {}, ValueError), ((1.0, 1, 1, 1, 1), {}, TypeError),
                                               ((1, 1, 1, 1, 1), {"mode": "back"}, ValueError)])
def test_attention_flops_rejects_bad_input(args, kwargs, error):
    with pytest.raises(error):
        attention_flops(*args, **kwargs)


def test_benchmark_on_cpu():
    x = torch.randn(64, 64)
    ms = benchmark(torch.matmul, x, x, rep=20)
    assert 0 < ms < 1000
    with pytest.raises(TypeError):
        benchmark("not callable")


@pytest.mark.parametrize("kwargs,error", [(dict(warmup=-1), ValueError), (dict(rep=0), ValueError),
                                          (dict(warmup="25"), TypeError), (dict(rep=True), TypeError)])
def test_benchmark_rejects_bad_times(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        benchmark(lambda: None, **kwargs)


def test_benchmark_warms_up_a_closure_for_warmup_ms_before_timing(monkeypatch):
    """A closure (no tensor arguments) is timed by torch's Timer: `warmup` ms of calls must come first."""
    import time

    calls = []
    timed_at = []

    class FakeTimer:
        def __init__(self, stmt, globals):
            timed_at.append(time.perf_counter())

        def blocked_autorange(self, min_run_time):
            return type("M", (), {"median": 0.001})()

    monkeypatch.setattr(torch.utils.benchmark, "Timer", FakeTimer)
    fn = lambda: calls.append(time.perf_counter())  # noqa: E731
    assert benchmark(fn, warmup=30, rep=5) == pytest.approx(1.0)
    assert calls and timed_at[0] - calls[0] >= 0.029  # the loop ends 30 ms after it began
    calls.clear()
    benchmark(fn, warmup=0, rep=5)
    assert calls == []


@pytest.mark.gpu
def test_benchmark_on_gpu():
    x = torch.randn(256, 256, device="cuda")
    assert 0 < benchmark(torch.matmul, x, x) < 100


def test_tflops():
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        tflops(1.0, 0.0)


@pytest.mark.parametrize("axes", [dict(a=[1, 2, 3], b="xy", c=[True, False]), dict(shape=range(11), causal=[0, 1],
                                  dtype="abc", layout="xy"), dict(a=[1, 2, 3, 4], b=[5, 6, 7], c=[8, 9, 10], d=[0, 1])])
def test_pairwise_covers_every_pair_of_values_in_fewer_rows(axes):
    axes = {name: list(values) for name, values in axes.items()}
    rows = pairwise(axes)
    names = list(axes)
    for i, x in enumerate(names):
        assert {row[x] for row in rows} == set(axes[x])
        for y in names[i + 1:]:
            missing = {(a, b) for a in axes[x] for b in axes[y]} - {(row[x], row[y]) for row in rows}
            assert not missing, f"pairs of {x} and {y} never tried: {missing}"
    full = 1
    for values in axes.values():
        full *= len(values)
    assert len(rows) < full and pairwise(axes) == rows  # smaller than the product, and the same every time
    longest = sorted(len(v) for v in axes.values())[-2:]
    assert len(rows) <= 2 * longest[0] * longest[1]


def test_pairwise_of_one_axis_and_bad_axes():
    assert pairwise(dict(a=[1, 2])) == [dict(a=1), dict(a=2)]
    for bad in ({}, dict(a=[]), dict(a="xy", b=3), [("a", [1])]):
        with pytest.raises(ValueError, match="axes must|axis"):
            pairwise(bad)


def test_tolerances_and_assert_close():
    assert tolerances(torch.bfloat16)["atol"] > tolerances(torch.float16)["atol"] > tolerances(torch.float32)["atol"]
    with pytest.raises(TypeError):
        tolerances(torch.int8)
    a = torch.ones(4)
    assert_close(a + 1e-4, a, dtype=torch.float32)
    with pytest.raises(AssertionError):
        assert_close(a + 1e-1, a, dtype=torch.float32)


def test_random_qkv_shapes_and_seed():
    q, k, v = random_qkv(2, 8, 5, 7, 16, kv_heads=2, dtype=torch.float16)
    assert q.shape == (2, 8, 5, 16) and k.shape == v.shape == (2, 2, 7, 16) and q.dtype == torch.float16
    assert torch.equal(random_qkv(seed=3)[0], random_qkv(seed=3)[0])


def test_misaligned_keeps_shape_strides_and_values_but_not_the_alignment():
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(2, 3, 5, dtype=dtype)
        y = misaligned(x)
        assert y.shape == x.shape and y.stride() == x.stride() and torch.equal(x, y)
        assert x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == y.element_size()


def test_assert_attention_matches_reference_catches_wrong_results():
    q, k, v = random_qkv(1, 2, 8, 8, 16)
    assert_attention_matches_reference(naive_attention, q, k, v, causal=True)
    with pytest.raises(AssertionError):
        assert_attention_matches_reference(lambda q, k, v, **kw: naive_attention(q, k, v) * 1.1, q, k, v)


def test_check_reports_three_outcomes(capsys):
    def right():
        assert 1 + 1 == 2

    def not_yet():
        raise NotImplementedError

    def wrong():
        assert 1 + 1 == 3, "1 + 1 is 2"

    def wrapped_stub():  # what the Triton interpreter makes of a stub inside a kernel
        try:
            raise NotImplementedError("exercise: replace this line with your code")
        except NotImplementedError as err:
            raise RuntimeError("InterpreterError") from err

    def crash():
        raise KeyError("bug")

    assert check("d", hint="h")(wrapped_stub) == "not yet"
    with pytest.raises(KeyError):
        check("e", hint="h")(crash)
    assert check("a", hint="h")(right) == "right"
    assert check("b", hint="think")(not_yet) == "not yet"
    with pytest.raises(AssertionError):
        check("c", hint="add")(wrong)
    out = capsys.readouterr().out
    assert "✓ a" in out and "b: not yet. Hint: think" in out and "✗ c: 1 + 1 is 2" in out and "Hint: add" in out


def test_plot_style_and_save(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use_course_style()
    assert plt.rcParams["axes.grid"] is True
    monkeypatch.setattr("utils.course.plotting.IMAGES", tmp_path / "images")
    monkeypatch.setattr("utils.course.plotting.LEARNER_FIGURES", tmp_path / "build")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    monkeypatch.delenv("COURSE_WRITE_IMAGES", raising=False)  # a learner's run: never the committed images/
    assert save_figure(fig, "demo") == tmp_path / "build" / "demo.png" and (tmp_path / "build" / "demo.png").is_file()
    assert not (tmp_path / "images").exists()
    monkeypatch.setenv("COURSE_WRITE_IMAGES", "1")        # python -m utils.course.references
    assert save_figure(fig, "demo") == tmp_path / "images" / "demo.png"
    with pytest.raises(ValueError):
        save_figure(fig, "demo.png")
    assert write_png(fig, str(tmp_path / "bench.png")) == tmp_path / "bench.png" and (tmp_path / "bench.png").is_file()
    assert not plt.fignum_exists(fig.number)  # closed: a sweep of plots does not pile up figures


def test_gpu_primer_figure_is_drawn_by_a_command(tmp_path):
    """Notebook 00's figure: `python -m utils.course.gpu_primer` redraws the committed PNG; a path not ending .png is refused."""
    from utils.course.gpu_primer import PNG, write

    assert PNG.is_file() and PNG.stat().st_size < 200_000, "images/gpu_primer.png: python -m utils.course.gpu_primer"
    out = write(tmp_path / "primer.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="path must end in .png"):
        write(tmp_path / "primer.svg")


def test_seqlen_axis_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.course.plotting import seqlen_axis

    fig, ax = plt.subplots()
    seqlen_axis(ax, [512, 1024, 16384])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1k", "16k"] and ax.get_xscale() == "log"
    plt.close(fig)


def test_positive_int():
    from utils.checks import positive_int

    assert positive_int("n", 3) == 3
    for bad, error in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="n must"):
            positive_int("n", bad)


def test_check_int_bounds():
    from utils.checks import check_int

    assert check_int("n", 0, 0) == 0 and check_int("n", 5, 0, 5) == 5 and check_int("n", -3) == -3
    for bad, low, high, error, message in ((1.0, 0, None, TypeError, "n must be an int"),
                                           (True, 0, None, TypeError, "n must be an int"),
                                           (-1, 0, None, ValueError, r"n must be >= 0, got -1"),
                                           (6, 0, 5, ValueError, r"n must be in \[0, 5\], got 6"),
                                           (3, None, 2, ValueError, r"n must be <= 2, got 3")):
        with pytest.raises(error, match=message):
            check_int("n", bad, low, high)


def test_check_capability():
    from utils.checks import check_capability

    assert check_capability((9, 0)) == (9, 0) and check_capability(None, optional=True) is None
    for bad in (None, [9, 0], (9,), (9, -1), (9, True), (9.0, 0)):
        with pytest.raises(TypeError, match="capability must be a"):
            check_capability(bad)
    with pytest.raises(TypeError, match="capability must be None or a"):
        check_capability("sm_90", optional=True)


def test_check_bool():
    from utils.checks import check_bool

    assert check_bool("flag", True) is True
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="flag must be a bool"):
            check_bool("flag", bad)


def test_assert_rows_close_names_rows_blocks_and_the_worst_element():
    from utils.course.exercises import assert_rows_close

    a = torch.randn(2, 3, 130, 16)
    assert_rows_close(a.clone(), a, atol=0, rtol=0)
    b = a.clone()
    b[1, 2, 64:100] += 1
    b[0, 0, 129, 3] = float("nan")
    with pytest.raises(AssertionError) as err:
        assert_rows_close(b, a, atol=1e-3, rtol=1e-3, block_rows=64, name="O")
    text = str(err.value)
    assert "batch=1, head=2: rows 64–99 wrong (36 of 130), in block(s) 1 of 64 rows" in text
    assert "batch=0, head=0: rows 129 wrong" in text and "block(s) 2" in text and "worst at (0, 0, 129, 3)" in text
    with pytest.raises(AssertionError, match="shape"):
        assert_rows_close(a[:, :, :5], a, atol=1, rtol=1)
    with pytest.raises(TypeError):
        assert_rows_close(a.tolist(), a, atol=1, rtol=1)


def test_assert_matches_on_odd_shapes_runs_every_shape_and_catches_errors():
    from utils.eager.reference import naive_attention

    seen = []

    def recording(q, k, v, **kw):
        seen.append(tuple(q.shape))
        return naive_attention(q, k, v, **kw)

    shapes = ODD_SHAPES_64_128[:2]
    assert_matches_on_odd_shapes(recording, dtype=torch.float32, causal=True, device="cpu", shapes=shapes)
    assert seen == [(b, h, nq, d) for b, h, _, nq, _, d in shapes] + [(1, 2, 300, 64)]
    with pytest.raises(AssertionError):
        assert_matches_on_odd_shapes(lambda q, k, v, **kw: naive_attention(q, k, v, **kw) * 1.01,
                                     dtype=torch.float32, causal=False, device="cpu", shapes=shapes)


def test_reference_lse_is_the_log_of_the_softmax_denominator():
    """GQA heads share their K head; causal is bottom-right, so with Nq > Nk the first Nq - Nk rows see no key."""
    q, k, _ = random_qkv(1, 4, 7, 5, 16, kv_heads=2, dtype=torch.float64, seed=4)
    lse = reference_lse(q, k, sm_scale=0.5)
    scores = torch.einsum("bhnd,bhmd->bhnm", q, k[:, [0, 0, 1, 1]]) * 0.5
    torch.testing.assert_close(lse, scores.exp().sum(-1).log())
    causal = reference_lse(q, k, causal=True)
    assert torch.isneginf(causal[..., :2]).all() and torch.isfinite(causal[..., 2:]).all()
    row = q[0, 3, 4] @ k[0, 1, :3].T / 4   # the fifth query sees the first three keys; 1/sqrt(16) by default
    torch.testing.assert_close(causal[0, 3, 4], torch.logsumexp(row, 0))


def test_pyplot_is_styled_and_never_needs_a_display():
    import matplotlib

    plt = pyplot()
    assert plt.rcParams["axes.grid"] is True and plt.rcParams["legend.frameon"] is False
    assert matplotlib.get_backend().lower() in ("agg", "module://matplotlib_inline.backend_inline")
