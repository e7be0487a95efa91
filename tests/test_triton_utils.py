import os
import pdb
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from utils import triton_utils as tu
from utils.triton_utils import breakpoint_if, cdiv, check_tensors_gpu_ready, print_if, test_pid_conds

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("a,b,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (1000, 128, 8), (-5, 4, -1)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


@pytest.mark.parametrize("a,b,error", [(1, 0, ValueError), (1.5, 2, TypeError), (3, "2", TypeError),
                                       (True, 2, TypeError)])
def test_cdiv_rejects_bad_input(a, b, error):
    with pytest.raises(error, match="cdiv"):
        cdiv(a, b)


@pytest.mark.parametrize("conds,pid,expected", [
    ("=1", 1, True), ("=1", 2, False),
    ("==1", 1, True), ("==1", 0, False),
    ("!=1", 0, True), ("!=1", 1, False),
    ("<2", 1, True), ("<2", 2, False),
    ("<=2", 2, True), ("<=2", 3, False),
    (">2", 3, True), (">2", 2, False),
    (">=2", 2, True), (">=2", 1, False),
    (" >= 2 ", 5, True), ("", 7, True), ("=-1", -1, True),
])
def test_each_operator(conds, pid, expected):
    assert test_pid_conds(conds, pid) is expected


def test_entries_apply_per_axis_and_all_must_hold():
    assert test_pid_conds(">=2,,!=3", 2, 99, 4)
    assert not test_pid_conds(">=2,,!=3", 2, 99, 3)
    assert not test_pid_conds(">=2,,!=3", 1, 0, 0)
    assert test_pid_conds("=0,>1", 0, 2)
    assert not test_pid_conds("=0,>1", 0, 1)
    assert test_pid_conds(",,", 5, 6, 7)


@pytest.mark.parametrize("pid", [3, [3], (3,), torch.tensor([3]), torch.tensor(3), torch.tensor([[3]])])
def test_program_id_forms(pid):
    assert test_pid_conds("=3", pid)
    assert not test_pid_conds("=4", pid)


SEEN = []


@triton.jit
def _record_pids(x_ptr):
    pid = tl.program_id(0)
    if tu.test_pid_conds(">=2", pid):
        SEEN.append(int(pid))


def test_interpreter_program_ids():
    """Inside an interpreted kernel tl.program_id is a tensor; the helpers accept it as it is."""
    if not tu.interpreting():
        pytest.skip("needs the Triton interpreter")
    SEEN.clear()
    _record_pids[(4,)](torch.zeros(1))
    assert SEEN == [2, 3]


@pytest.mark.parametrize("conds", ["=1,=2,=3,=4", "1", "=x", "=>1", "=1.5", "~1", "=1;=2"])
def test_malformed_conditions(conds):
    with pytest.raises(ValueError):
        test_pid_conds(conds, 1, 1, 1)


@pytest.mark.parametrize("pid,error", [([1, 2], ValueError), (torch.tensor([1, 2]), ValueError),
                                       (1.0, TypeError), ("1", TypeError), (None, TypeError)])
def test_bad_program_ids(pid, error):
    with pytest.raises(error, match="pid_0"):
        test_pid_conds("=1", pid)


def test_conds_must_be_a_string():
    with pytest.raises(TypeError):
        test_pid_conds(1, 1)


def test_print_if(capsys):
    print_if("hello", "=1", 1)
    print_if("hidden", "=1", 2)
    assert capsys.readouterr().out == "hello\n"


def test_breakpoint_if_stops_in_the_callers_frame(monkeypatch):
    frames = []
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.setattr(pdb.Pdb, "set_trace", lambda self, frame=None: frames.append(frame))
    offs = 42  # noqa: F841 (what a learner would inspect with `p offs`)
    breakpoint_if("=0,=1", 0, 1)
    breakpoint_if("=0,=1", 0, 2)
    assert len(frames) == 1 and frames[0].f_locals["offs"] == 42


def test_breakpoint_if_is_off_with_pythonbreakpoint_0(monkeypatch):
    frames = []
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    monkeypatch.setattr(pdb.Pdb, "set_trace", lambda self, frame=None: frames.append(frame))
    breakpoint_if("=0", 0)
    assert frames == []


BREAK_LOCALS = []


@triton.jit
def _break_after_load(x_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)  # noqa: F841 (inspected through the frame)
    tu.breakpoint_if("=1", pid)


def test_breakpoint_if_in_a_kernel_sees_the_kernels_variables(monkeypatch):
    if not tu.interpreting():
        pytest.skip("needs the Triton interpreter")
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.setattr(pdb.Pdb, "set_trace", lambda self, frame=None: BREAK_LOCALS.append(dict(frame.f_locals)))
    BREAK_LOCALS.clear()
    _break_after_load[(2,)](torch.arange(8, dtype=torch.float32), BLOCK=4)
    assert len(BREAK_LOCALS) == 1
    assert {"offs", "x", "pid"} <= set(BREAK_LOCALS[0])


@pytest.mark.parametrize("conds,pids", [("=0,=1", (0,)), (",,=2", (0, 1)), ("=0", ()), (",>1", (5,))])
def test_a_condition_on_a_pid_not_passed_raises(conds, pids):
    with pytest.raises(ValueError, match="was not passed"):
        test_pid_conds(conds, *pids)


def test_pids_not_passed_are_fine_without_conditions_on_them():
    assert test_pid_conds("=3", 3) and test_pid_conds("=3,", 3) and test_pid_conds(",=1", 0, 1)


def test_check_tensors_gpu_ready_accepts_cpu_in_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_tensors_gpu_ready(torch.zeros(3), torch.zeros(2, 2))


def test_check_tensors_gpu_ready_rejects_cpu_outside_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="argument 0 is on cpu"):
        check_tensors_gpu_ready(torch.zeros(3))


def test_check_tensors_gpu_ready_names_the_non_contiguous_argument(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="argument 1 .* not contiguous"):
        check_tensors_gpu_ready(torch.zeros(4, 4), torch.zeros(4, 4).t())


def test_check_tensors_gpu_ready_flags_bf16_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_tensors_gpu_ready(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="argument 1 is bfloat16"):
        check_tensors_gpu_ready(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_check_tensors_gpu_ready_flags_mixed_devices(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="argument 1 is on cpu but argument 0 is on cuda"):
        check_tensors_gpu_ready(torch.zeros(3, device="cuda"), torch.zeros(3))


def test_check_tensors_gpu_ready_rejects_non_tensors():
    with pytest.raises(TypeError, match="argument 0"):
        check_tensors_gpu_ready([1, 2, 3])


@pytest.mark.gpu
def test_check_tensors_gpu_ready_on_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_tensors_gpu_ready(torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="argument 1 is on cpu"):
        check_tensors_gpu_ready(torch.zeros(3, device="cuda"), torch.zeros(3))


@triton.jit
def _copy_tile(src_ptr, dst_ptr, rows, cols, stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Copy one (BLOCK_R, BLOCK_C) tile per program with the offset and mask helpers."""
    offs_r = tu.offsets_1d(BLOCK_R, tl.program_id(0))
    offs_c = tu.offsets_1d(BLOCK_C, tl.program_id(1))
    offs = tu.offsets_2d(offs_r, offs_c, stride)
    mask = tu.mask_2d(offs_r, offs_c, rows, cols)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _copy_1d(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tu.offsets_1d(BLOCK, tl.program_id(0))
    mask = tu.mask_1d(offs, n)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * 2, mask=mask)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 5), (16, 16), (33, 17)])
def test_offset_and_mask_helpers_2d(rows, cols):
    src = torch.arange(rows * cols, dtype=torch.float32, device=_device()).reshape(rows, cols)
    dst = torch.full_like(src, -1)
    grid = (cdiv(rows, 8), cdiv(cols, 8))
    _copy_tile[grid](src, dst, rows, cols, src.stride(0), BLOCK_R=8, BLOCK_C=8)
    torch.testing.assert_close(dst, src)


@pytest.mark.parametrize("n", [1, 15, 16, 100])
def test_offset_and_mask_helpers_1d(n):
    src = torch.arange(n, dtype=torch.float32, device=_device())
    dst = torch.zeros_like(src)
    _copy_1d[(cdiv(n, 16),)](src, dst, n, BLOCK=16)
    torch.testing.assert_close(dst, 2 * src)


def test_show_source_prints_the_lines_between_markers(capsys):
    tu.show_source(tu.cdiv, "if b == 0", "return")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "if b == 0" in out[0] and "raise ValueError" in out[1]
    with pytest.raises(ValueError, match="no line contains"):
        tu.show_source(tu.cdiv, "not in the source")


def test_show_diff_prints_a_unified_diff_of_kernels(capsys):
    tu.show_diff(_copy_1d, _copy_tile)
    out = capsys.readouterr().out
    assert out.startswith("--- _copy_1d\n+++ _copy_tile\n")
    assert "-    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) * 2, mask=mask)" in out
    tu.show_diff("a\nb\n", "a\nc\n")
    assert capsys.readouterr().out.splitlines()[-2:] == ["-b", "+c"]
    with pytest.raises(TypeError):
        tu.show_diff(1, "a")


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("when,message", [("never", "interpreter is off"), ("after", "Restart the kernel"),
                                          ("before", None)])
def test_require_interpreter_says_when_triton_came_first(when, message):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os\n" + ("os.environ['TRITON_INTERPRET'] = '1'\n" if when == "before" else "") +
            "import triton\n" + ("os.environ['TRITON_INTERPRET'] = '1'\n" if when == "after" else "") +
            "from utils.triton_utils import require_interpreter\nrequire_interpreter()\nprint('ready')")
    done = _python(code, env)
    if message is None:
        assert done.returncode == 0 and "ready" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


@triton.jit
def _row_sums(X, OUT, n_cols, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):   # a loop bound that is a kernel argument: __index__ in the interpreter
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(X + cols, mask=cols < n_cols, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0))


def test_fix_interpreter_scalars_repairs_the_index_of_triton_36(monkeypatch):
    """Triton 3.6's interpreter does int() of a one-element array, which NumPy >= 2.4 refuses."""
    if not tu.interpreting():
        pytest.skip("needs the Triton interpreter")
    from triton.runtime import interpreter

    newer = interpreter._patch_lang_tensor

    def as_in_triton_36(tensor, scope):
        newer(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", as_in_triton_36)
    x, out = torch.arange(40, dtype=torch.float32), torch.zeros(1)
    if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
        with pytest.raises(Exception, match="0-dimensional"):
            _row_sums[(1,)](x, out, 40, BLOCK=16)
    assert tu.fix_interpreter_scalars() is True and tu.fix_interpreter_scalars() is False
    _row_sums[(1,)](x, out, 40, BLOCK=16)
    assert out.item() == x.sum().item()


def test_fix_interpreter_scalars_leaves_a_fixed_triton_alone():
    from triton.runtime import interpreter

    if "squeeze" not in __import__("inspect").getsource(interpreter._patch_lang_tensor):
        pytest.skip("this Triton has the old interpreter")
    assert tu.fix_interpreter_scalars() is False
