"""utils.tiled.fast.launch: launching compiled Triton kernels without Triton's per-call dispatch."""
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from utils.tiled.fast import launch
from utils.tiled.fast.launch import FastLauncher, dispatch_by_triton, specialization_key

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@triton.jit
def _scale_rows(X, Y, n, stride_x, stride_y, factor, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0.0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n, other=0.0)
    tl.store(Y + row * stride_y + cols, x * factor + SHIFT, mask=cols < n)


# --- the key ---------------------------------------------------------------------------------------------------

def test_key_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    key = lambda *args: specialization_key(args)  # noqa: E731
    assert key(base) == key(torch.ones(64))                  # same dtype, both 16-byte aligned
    assert key(base) != key(base[1:])                        # 4-byte offset: not 16-byte aligned
    assert key(base) != key(base.half())                     # dtype
    assert key(16) == key(32) != key(8) != key(1)            # divisible by 16; equal to 1
    assert key(7) == key(9)
    assert key(2**31 - 16) != key(2**31 + 16)                # i32 vs i64, both divisible by 16
    assert key(True) != key(1) and key(0.5) == key(2.0) != key(None)


def test_key_separates_host_descriptors_by_tile_and_dtype():
    from triton.tools.tensor_descriptor import TensorDescriptor
    x = torch.zeros(2, 3, 64, 32)
    key = lambda t, tile: specialization_key((TensorDescriptor.from_tensor(t, tile),))  # noqa: E731
    assert key(x, [1, 1, 16, 32]) == key(torch.ones(2, 3, 64, 32), [1, 1, 16, 32])  # another tensor, same kind
    assert key(x, [1, 1, 16, 32]) != key(x, [1, 1, 32, 32])                        # tile shape
    assert key(x, [1, 1, 16, 32]) != key(x.half(), [1, 1, 16, 32])                 # dtype
    assert key(x, [1, 1, 16, 32]) != key(x[0], [1, 16, 32])                        # rank
    assert specialization_key((TensorDescriptor.from_tensor(x, [1, 1, 16, 32]),)) != specialization_key((x,))


def test_key_separates_gluon_descriptors_by_tile_dtype_and_layout():
    """utils.explicit.forward launches through FastLauncher with Gluon's descriptors, whose type carries a layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    def key(t, tile, swizzle=128):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=4)
        return specialization_key((GluonDescriptor(t, list(t.shape), list(t.stride()), tile, layout),))

    x = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    assert key(x, [1, 1, 64, 64]) == key(x.clone(), [1, 1, 64, 64])
    assert len({key(x, [1, 1, 64, 64]), key(x, [1, 1, 128, 64]), key(x.half(), [1, 1, 64, 64]),
                key(x, [1, 1, 64, 64], swizzle=64)}) == 4
    hash(key(x, [1, 1, 64, 64]))   # the layout, a frozen dataclass, is part of the key


def test_key_is_hashable_and_flat_per_argument():
    key = specialization_key((torch.zeros(4), 3, 0.5, None, False))
    assert len(key) == 5 and hash(key) is not None


# --- the launcher, with a stand-in for a compiled kernel (runs anywhere) --------------------------------------

class _Param:
    def __init__(self, name, is_constexpr, default=None):
        self.name, self.is_constexpr, self.default = name, is_constexpr, default


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        self.log.append("init")

    def run(self, *args):
        self.log.append(("run", args))


class _FakeKernel:
    """What FastLauncher uses of a JITFunction: params, device_caches, kernel[grid](...) returning the compiled."""
    __name__ = "fake"
    device_caches = {}

    def __init__(self):
        self.params = [_Param("X", False), _Param("n", False), _Param("BLOCK", True), _Param("FLAG", True, 7)]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _FakeCompiled(self.log)
        return launch


class _FakeDriver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "driver", _FakeDriver)
    kernel = _FakeKernel()
    return kernel, FastLauncher(kernel)


def test_first_call_goes_through_triton_then_launches_directly(fake):
    kernel, launcher = fake
    x = torch.zeros(64)
    launcher[(3,)](x, 5, BLOCK=32, num_warps=4)
    launcher[(4, 2)](torch.ones(64), 5, BLOCK=32, num_warps=4)
    assert kernel.log[0] == ("jit", (3,), (x, 5), dict(BLOCK=32, num_warps=4)) and kernel.log[1] == "init"
    kind, args = kernel.log[2]
    # grid padded to 3 dims, the stream, the handles, no metadata or hooks, runtime args then constexprs
    assert kind == "run" and args[:9] == (4, 2, 1, 1234, "fn", "meta", None, None, None)
    assert args[10:] == (5, 32, 7) and args[9] is not x and len(launcher.compiled) == 1


@pytest.mark.parametrize("change", ["alignment", "dtype", "int class", "meta", "options"])
def test_a_call_triton_would_compile_apart_is_compiled_apart(fake, change):
    kernel, launcher = fake
    x = torch.zeros(64)
    launcher[(1,)](x, 32, BLOCK=32, num_warps=4)
    other = {"alignment": ((x[1:], 32), dict(BLOCK=32, num_warps=4)),
             "dtype": ((x.half(), 32), dict(BLOCK=32, num_warps=4)),
             "int class": ((x, 33), dict(BLOCK=32, num_warps=4)),
             "meta": ((x, 32), dict(BLOCK=64, num_warps=4)),
             "options": ((x, 32), dict(BLOCK=32, num_warps=8))}[change]
    launcher[(1,)](*other[0], **other[1])
    assert [entry[0] for entry in kernel.log if entry != "init"] == ["jit", "jit"] and len(launcher.compiled) == 2


def test_dispatch_by_triton_and_hooks_bypass_the_cache(fake, monkeypatch):
    kernel, launcher = fake
    x = torch.zeros(64)
    launcher[(1,)](x, 32, BLOCK=32)
    with dispatch_by_triton():
        launcher[(1,)](x, 32, BLOCK=32)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)   # as Triton 3.6 keeps it
    launcher[(1,)](x, 32, BLOCK=32)
    assert [entry[0] for entry in kernel.log if entry != "init"] == ["jit", "jit", "jit"]
    if not hasattr(triton.knobs, "HookChain"):  # Triton 3.6 keeps None or a function
        return
    chain = triton.knobs.HookChain()                                               # as Triton 3.7 keeps it
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    launcher[(1,)](x, 32, BLOCK=32)                                                # empty: direct
    chain.add(lambda *a: None)
    launcher[(1,)](x, 32, BLOCK=32)
    assert [entry[0] for entry in kernel.log if entry != "init"] == ["jit", "jit", "jit", "run", "jit"]


def test_bind_launches_once_and_fixes_all_but_the_leading_arguments(fake):
    kernel, launcher = fake
    x = torch.zeros(64)
    bound = launcher.bind((3, 2), (x, 5), dict(BLOCK=32), head=1)
    assert kernel.log[0] == ("jit", (3, 2), (x, 5), dict(BLOCK=32))            # this call's launch
    y = torch.ones(64)
    bound(99, y)                                                                # stream 99, a new X
    kind, args = kernel.log[-1]
    assert kind == "run" and args[:9] == (3, 2, 1, 99, "fn", "meta", None, None, None)
    assert args[9] is y and args[10:] == (5, 32, 7)                            # n, BLOCK, FLAG's default


def test_bind_gives_nothing_to_keep_where_launches_go_through_triton(fake, monkeypatch):
    kernel, launcher = fake
    x = torch.zeros(64)
    assert launch.direct()
    with dispatch_by_triton():
        assert not launch.direct() and launcher.bind((1,), (x, 5), dict(BLOCK=32), head=1) is None
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda *a: None)   # a profiler's hook
    assert not launch.direct() and launcher.bind((1,), (x, 5), dict(BLOCK=32), head=1) is None
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]                  # both still launched
    recording = FastLauncher(_RecordingKernel())                                # utils.course.cross_compile
    assert recording.bind((1,), (x, 5), dict(BLOCK=32), head=1) is None


def test_a_kind_binds_its_launches_once_and_runs_them_after(fake):
    kernel, launcher = fake
    kind = launch.Kind("choices")
    specs = lambda: [(launcher, (2,), (5,), dict(BLOCK=32))]   # noqa: E731 - the trailing arguments and meta
    x, y = torch.zeros(64), torch.ones(64)
    kind.launch([(x,)], specs, keep=True)
    kind.launch([(y,)], lambda: pytest.fail("a kept kind asked for its specs"), keep=True)
    assert [entry[0] for entry in kernel.log if entry != "init"] == ["jit", "run"]
    assert kernel.log[-1][1][9] is y and kind.device == 0 and kind.choices == "choices" and kind.ready()
    kind.run([(x,)])                                           # the bound launch alone (the forward's fast path)
    assert kernel.log[-1][0] == "run" and kernel.log[-1][1][9] is x and kernel.log[-1][1][3] == 1234
    with dispatch_by_triton():                                 # through Triton, kept launches untouched
        assert not kind.ready()
        kind.launch([(y,)], specs, keep=True)
    assert kernel.log[-1][0] == "jit" and kind.launches is not None
    other = launch.Kind("cpu call")
    other.launch([(x,)], specs, keep=False)                    # no key: never kept
    assert other.launches is None and not other.ready()
    assert kind.derived == other.derived == {} and kind.derived is not other.derived   # a dict of its own each


def test_kind_of_checks_a_kind_once_and_never_keeps_a_call_without_a_key():
    kinds, checked = launch.kind_cache(), []

    def choose(what):
        checked.append(what)
        if what == "bad":
            raise ValueError("bad argument")
        return what

    first = launch.kind_of(kinds, "key", lambda: choose("ok"))
    assert launch.kind_of(kinds, "key", lambda: choose("again")) is first and checked == ["ok"]
    assert first.choices == "ok" and first.launches is None and kinds == {"key": first}
    unkeyed = [launch.kind_of(kinds, None, lambda: choose("cpu")) for _ in range(2)]
    assert unkeyed[0] is not unkeyed[1] and checked == ["ok", "cpu", "cpu"] and list(kinds) == ["key"]
    with pytest.raises(ValueError, match="bad argument"):
        launch.kind_of(kinds, "other", lambda: choose("bad"))
    assert list(kinds) == ["key"]   # a call whose checks fail leaves no kind behind


def test_a_kind_cache_keeps_the_kinds_used_most_recently_up_to_its_bound():
    """A program whose shapes vary makes a new kind per shape: the cache stays at MAX_KINDS, forgetting the
    least recently used (here every shape but the first, which is asked for again and again)."""
    kinds, made = launch.kind_cache(), []
    hot = launch.kind_of(kinds, ("shape", 0), lambda: "hot")
    for n in range(1, 3 * launch.MAX_KINDS):
        launch.kind_of(kinds, ("shape", n), lambda: made.append(n))
        assert launch.kind_of(kinds, ("shape", 0), lambda: pytest.fail("the hot kind was forgotten")) is hot
        assert len(kinds) == min(n + 1, launch.MAX_KINDS)
    last = 3 * launch.MAX_KINDS - 1                                     # the last shape's n
    assert list(kinds) == [("shape", n) for n in range(last - launch.MAX_KINDS + 2, last + 1)] + [("shape", 0)]
    launch.kind_of(kinds, ("shape", 1), lambda: made.append("again"))   # forgotten: checked again
    assert made[-1] == "again" and len(made) == 3 * launch.MAX_KINDS and len(kinds) == launch.MAX_KINDS
    derived = launch.Kind(None).derived                                  # a forward's backward kinds, too
    for n in range(2 * launch.MAX_KINDS):
        launch.keep(derived, n, launch.Kind(n))
    assert list(derived) == list(range(launch.MAX_KINDS, 2 * launch.MAX_KINDS))


def test_rebase_copies_a_descriptor_onto_another_tensor_without_its_checks():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor
    x, y = torch.zeros(2, 3, 64, 32), torch.ones(2, 3, 64, 32)
    template = launch.rebase(TensorDescriptor.from_tensor(x, [1, 1, 16, 32]), None)
    assert template.base is None and template.block_shape == [1, 1, 16, 32]
    copy = launch.rebase(template, y)
    assert copy == TensorDescriptor.from_tensor(y, [1, 1, 16, 32]) and copy.base is y and template.base is None
    assert specialization_key((copy,)) == specialization_key((TensorDescriptor.from_tensor(y, [1, 1, 16, 32]),))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=4)
    gluon = GluonDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, 32], layout)
    assert launch.rebase(launch.rebase(gluon, None), y) == GluonDescriptor(y, list(y.shape), list(y.stride()),
                                                                           [1, 1, 16, 32], layout)
    assert launch.rebase(None, y) is None


def test_a_kind_makes_its_descriptors_once_and_copies_them_onto_later_tensors(fake):
    from triton.tools.tensor_descriptor import TensorDescriptor
    kernel, launcher = fake
    made = []

    def make(*tensors):
        made.append(tensors)
        return (TensorDescriptor.from_tensor(tensors[0], [1, 16]), None)

    kind = launch.Kind("choices")
    x, y = torch.zeros(4, 64), torch.ones(4, 64)
    first = kind.descriptors((x, None), lambda: make(x))
    assert first[0].base is x and first[1] is None and len(made) == 1
    assert kind.templates[0].base is None and kind.templates[1] is None     # the first call's x is not kept alive
    later = kind.descriptors((y, None), lambda: pytest.fail("a kind made its descriptors twice"))
    assert later == (TensorDescriptor.from_tensor(y, [1, 16]), None) and later[0].base is y
    kind.launch([(x,)], lambda: [(launcher, (1,), (5,), dict(BLOCK=32))], keep=True)   # new launches: new templates
    assert kind.templates is None and kind.descriptors((y, None), lambda: make(y))[0].base is y and len(made) == 2
    with pytest.raises(ValueError, match="2 descriptors for 1 tensors"):
        launch.Kind("other").descriptors((x,), lambda: make(x))


def test_kind_key_is_none_unless_every_tensor_is_on_a_gpu():
    x = torch.zeros(4)
    assert launch.kind_key((x, x), (True, None)) is None
    assert launch.kind_key((x, "not a tensor"), ()) is None


class _RecordingKernel(_FakeKernel):
    def __getitem__(self, grid):
        return lambda *args, **meta: None


def test_a_launch_that_returns_nothing_is_not_kept(monkeypatch):
    """utils.course.cross_compile replaces JITFunction.run to record launches; kernel[grid] then returns None."""
    monkeypatch.setattr(launch, "driver", _FakeDriver)
    launcher = FastLauncher(_RecordingKernel())
    assert launcher[(1,)](torch.zeros(4), 3, BLOCK=32) is None and launcher.compiled == {}


class _OtherRunCompiled(_FakeCompiled):
    """A compiled kernel of a Triton whose launcher takes another argument before the kernel's."""

    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_cooperative_grid,
            launch_enter_hook, launch_exit_hook, *args):
        pytest.fail("a launcher of another signature was called directly")


class _OtherRunKernel(_FakeKernel):
    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _OtherRunCompiled(self.log)
        return launch


def test_a_triton_whose_run_differs_launches_through_triton_with_one_warning(monkeypatch):
    monkeypatch.setattr(launch, "driver", _FakeDriver)
    monkeypatch.setattr(launch, "_warned_run", False)
    kernels = [_OtherRunKernel(), _OtherRunKernel()]
    launchers = [FastLauncher(kernel) for kernel in kernels]
    x = torch.zeros(64)
    with pytest.warns(RuntimeWarning, match="CompiledKernel.run.*launch_cooperative_grid") as caught:
        for launcher in launchers:
            launcher[(1,)](x, 5, BLOCK=32)
            launcher[(2,)](x, 5, BLOCK=32)
            assert launcher.bind((3,), (x, 5), dict(BLOCK=32), head=1) is None
    assert len([w for w in caught if w.category is RuntimeWarning]) == 1    # once, for all launchers
    for kernel, launcher in zip(kernels, launchers):
        assert [entry[1] for entry in kernel.log if entry != "init"] == [(1,), (2,), (3,)]   # every one by Triton
        assert launcher.compiled == {}
    kind = launch.Kind(None)
    kind.launch([(x,)], lambda: [(launchers[0], (4,), (5,), dict(BLOCK=32))], keep=True)
    assert kind.launches is None and kernels[0].log[-1][:2] == ("jit", (4,))


def test_runs_directly_accepts_the_launchers_of_the_triton_installed(monkeypatch):
    """Triton's CUDA launcher as installed (3.7 names its parameters; older ones take them as *args), and the
    stand-in above; not a launcher that takes another argument, or no *args."""
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import CudaLauncher

    monkeypatch.setattr(launch, "_warned_run", True)   # no warning wanted here
    compiled = lambda run: SimpleNamespace(run=run, function=None, packed_metadata=None)  # noqa: E731
    assert launch.runs_directly(compiled(CudaLauncher.__call__.__get__(object())))
    assert launch.runs_directly(compiled(lambda gridX, gridY, gridZ, stream, function, *args: None))
    assert launch.runs_directly(_FakeCompiled([]))
    assert not launch.runs_directly(_OtherRunCompiled([]))
    assert not launch.runs_directly(compiled(lambda gridX, gridY, gridZ, stream, function, meta: None))
    assert not launch.runs_directly(SimpleNamespace(run=lambda *args: None))   # no function, no packed_metadata


def test_wrong_argument_count_is_named(fake):
    _, launcher = fake
    with pytest.raises(TypeError, match="fake takes 2 runtime arguments by position, got 1"):
        launcher[(1,)](torch.zeros(4), BLOCK=32)


def _constexpr_first(BLOCK: tl.constexpr, X):
    pass


def test_a_kernel_with_a_constexpr_before_a_runtime_argument_is_refused():
    with pytest.raises(ValueError, match="runtime parameters before the constexprs"):
        FastLauncher(JITFunction(_constexpr_first))


# --- the real thing -----------------------------------------------------------------------------------------

def _run(launcher, x, factor=2.0, **meta):
    y = torch.zeros(x.shape, device=x.device)
    launcher[(x.shape[0],)](x, y, x.shape[1] - 3, x.stride(0), y.stride(0), factor, BLOCK=64, **meta)
    return y


def _expected(x, factor=2.0, shift=0.0):
    y = x * factor + shift
    return torch.where(torch.arange(x.shape[1], device=x.device) < x.shape[1] - 3, y, torch.zeros_like(y))


def test_launches_compute_what_the_kernel_computes():
    """On a GPU the second call takes the direct path; in the interpreter every call is Triton's."""
    launcher = FastLauncher(_scale_rows)
    x = torch.randn(5, 64, device=DEVICE)
    for factor in (2.0, 3.0):   # the second call reuses the compiled kernel with a new runtime value
        torch.testing.assert_close(_run(launcher, x, factor), _expected(x, factor), rtol=0, atol=0)
    torch.testing.assert_close(_run(launcher, x, SHIFT=1.5), _expected(x, shift=1.5), rtol=0, atol=0)
    assert len(launcher.compiled) == (2 if CUDA else 0)


@pytest.mark.gpu
def test_direct_launch_matches_triton_dispatch_on_odd_arguments():
    launcher = FastLauncher(_scale_rows)
    base = torch.randn(7 * 67 + 1, device="cuda")
    for x in (base[: 7 * 64].view(7, 64), base[1: 1 + 7 * 67].view(7, 67)[:, :64]):  # aligned; offset + odd stride
        for _ in range(2):
            direct = _run(launcher, x)
        with dispatch_by_triton():
            by_triton = _run(launcher, x)
        torch.testing.assert_close(direct, by_triton, rtol=0, atol=0)
        torch.testing.assert_close(direct, _expected(x), rtol=0, atol=0)
    assert len(launcher.compiled) == 2   # the misaligned view got its own kernel
