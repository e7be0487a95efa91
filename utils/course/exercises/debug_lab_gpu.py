"""Notebook 05a's GPU side: `tl.device_print` and `tl.device_assert` in a compiled kernel.

    python -m utils.course.exercises.debug_lab_gpu        # on a CUDA GPU

It runs as a process of its own, for two reasons. Triton works one way per process: whether `tl.sum` and the
rest of its library are compiled or interpreted is fixed when triton is imported, and the lab's notebook
imports it for the interpreter. And a compiled kernel prints with the device's printf, into the process's
C-level stdout, which Jupyter does not show: the notebook runs this as a child process and prints what it wrote.
"""
import os

if __name__ == "__main__":                # run as a program: compiled for the GPU, whatever the shell says
    os.environ["TRITON_INTERPRET"] = "0"   # (before triton is imported); imported, e.g. by show_source, it
                                           # leaves the importer's mode alone

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit(debug=True)   # compiles tl.device_assert in (TRITON_DEBUG=1 does it for every kernel)
def scale_rows_gpu(X, W, OUT, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.device_assert(pid_m * BLOCK_M < n_rows, "a program past the last row")
    if (pid_m == 1) & (pid_n == 0):                       # the GPU's print_if: one program prints
        tl.device_print("rows of program (1, 0): ", rows)
    in_bounds = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    w = tl.load(W + rows, mask=rows < n_rows, other=0.0)
    x = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=in_bounds, other=0.0)
    tl.store(OUT + rows[:, None] * n_cols + cols[None, :], x * w[:, None], mask=in_bounds)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.exercises.debug_lab_gpu needs a CUDA GPU")
    x, w = torch.randn(20, 50, device="cuda"), torch.randn(20, device="cuda")
    out = torch.empty_like(x)
    scale_rows_gpu[(triton.cdiv(20, 8), triton.cdiv(50, 16))](x, w, out, 20, 50, BLOCK_M=8, BLOCK_N=16)
    torch.cuda.synchronize()   # the device's prints are flushed when the kernel has finished
    torch.testing.assert_close(out, x * w[:, None])
    print("compiled with debug=True: the assert held, and program (1, 0) printed its rows above", flush=True)


if __name__ == "__main__":
    main()
