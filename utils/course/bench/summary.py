"""Every implementation in the registry side by side: correctness, speed and peak memory.

    python -m utils.course.bench.summary          # on a GPU: writes images/summary_<gpu>.json and summary_<gpu>_*.png

The summary notebook calls the same functions at the sizes the current device affords; the command above made
the committed H200 reference figures. Speed comes from utils.course.bench.forward's sweep (do_bench, SDPA backends pinned).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from utils.course.bench import forward as sweep
from utils.attention import REGISTRY, implementations
from utils.course.bench import attention_flops, benchmark, error_line, tflops
from utils.course.memory import peak_memory
from utils.eager.reference import reference_attention
from utils.course.testing import random_qkv, tolerances

IMAGES = Path(__file__).resolve().parents[3] / "images"
# Stable Diffusion 2.1 at 512x512: a 64x64 latent, so 4096 tokens; head dim 64 with 5 heads at that level;
# batch 2 for classifier-free guidance.
SD21 = dict(batch=2, heads=5, seqlen=4096, head_dim=64)
# The PyTorch models of notebooks 03/04 loop over blocks in Python: beyond this N they teach nothing new.
MAX_SEQLEN = {"flash1_pytorch": 4096, "flash2_pytorch": 8192, "flash2_pytorch_autograd": 8192}
# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal) checked for every implementation.
CORRECTNESS_CASES = [(2, 4, 4, 128, 128, 64, False), (1, 4, 2, 100, 133, 64, True), (1, 2, 2, 77, 77, 128, True)]


def supports(name: str, head_dim: int, dtype: torch.dtype, gqa: bool = False, causal: bool = False) -> bool:
    impl = REGISTRY[name]
    return ((impl.head_dims is None or head_dim in impl.head_dims) and dtype in impl.dtypes
            and (impl.gqa or not gqa) and (impl.causal or not causal))


def correctness(fns: dict, *, device, dtype) -> list[dict]:
    """Max absolute error of each implementation against the float64 reference, with the dtype's tolerance."""
    rows = []
    for name, fn in fns.items():
        for b, h, hk, nq, nk, d, causal in CORRECTNESS_CASES:
            if not supports(name, d, dtype, hk != h, causal):
                continue
            q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=device)
            out = fn(q, k, v, causal=causal)
            expected = reference_attention(q, k, v, causal=causal)
            err = (out.double() - expected).abs().max().item()
            tol = tolerances(dtype)
            bound = tol["atol"] + tol["rtol"] * expected.abs().max().item()
            rows.append(dict(impl=name, shape=f"{b}x{h}/{hk}x{nq}x{nk}x{d}", causal=causal, max_error=err,
                             bound=bound, ok=err <= bound))
    return rows


def memory_sweep(fns: dict, seqlens, *, batch, heads, head_dim, dtype, device, progress=True) -> list[dict]:
    """Peak bytes (utils.course.memory.peak_memory) of each implementation's forward at each sequence length."""
    from tqdm.auto import tqdm

    records = []
    for n in tqdm(seqlens, desc="memory", disable=not progress):
        q, k, v = random_qkv(batch, heads, n, n, head_dim, dtype=dtype, device=device)
        for name, fn in fns.items():
            record = dict(impl=name, seqlen=n, bytes=None, error=None)
            if n > MAX_SEQLEN.get(name, n) or not supports(name, head_dim, dtype):
                record["error"] = "skipped"
            else:
                try:
                    record["bytes"] = peak_memory(fn, q, k, v)
                except (RuntimeError, ValueError) as err:  # torch.OutOfMemoryError is a RuntimeError
                    record["error"] = error_line(err)
            records.append(record)
    return records


def speed_sweep(names, seqlens, *, batch, heads, head_dim, dtype_name, sdpa=(), causal="no", rep=100,
                warmup=25, progress=True) -> list[dict]:
    """utils.course.bench.forward's side-by-side timing for registry `names` (and pinned SDPA backends on a GPU)."""
    argv = ["--impls", *names, "--sdpa", *sdpa, "--batch", str(batch), "--heads", str(heads),
            "--head-dims", str(head_dim), "--seqlens", *map(str, seqlens), "--dtype", dtype_name,
            "--causal", causal, "--rep", str(rep), "--warmup", str(warmup)]
    args = sweep.parse_args(argv)
    fns = sweep.candidates(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    caps = {label: MAX_SEQLEN.get(label) for label in fns}

    def time_ms(fn, q, k, v, causal):
        label = next(name for name, f in fns.items() if f is fn)
        if caps[label] is not None and q.shape[2] > caps[label]:
            raise ValueError("skipped")
        return benchmark(fn, q, k, v, causal=causal, rep=rep, warmup=warmup)

    return sweep.run(args, fns, time_ms=time_ms, device=device, progress=progress)


def stable_diffusion_case(fns: dict, *, dtype, device) -> list[dict]:
    """Time and peak memory of each implementation at the SD 2.1 512x512 self-attention shape."""
    b, h, n, d = SD21["batch"], SD21["heads"], SD21["seqlen"], SD21["head_dim"]
    q, k, v = random_qkv(b, h, n, n, d, dtype=dtype, device=device)
    rows = []
    for name, fn in fns.items():
        if n > MAX_SEQLEN.get(name, n) or not supports(name, d, dtype):
            continue
        ms = benchmark(fn, q, k, v)
        rows.append(dict(impl=name, ms=ms, tflops=tflops(attention_flops(b, h, n, n, d), ms),
                         peak_mib=peak_memory(fn, q, k, v) / 2**20))
    return rows


def plot_memory(records: list[dict], title: str = ""):
    """Peak memory against N on log-log axes, with N and N² guides through the first points."""
    import matplotlib.pyplot as plt

    from utils.course.plotting import seqlen_axis, use_course_style

    use_course_style()
    fig, ax = plt.subplots()
    impls = list(dict.fromkeys(r["impl"] for r in records))
    ax.set_prop_cycle(color=plt.get_cmap("tab20" if len(impls) > 10 else "tab10").colors[:len(impls)])
    for name in impls:
        pts = sorted((r["seqlen"], r["bytes"] / 2**20) for r in records if r["impl"] == name and r["bytes"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    seqlen_axis(ax, sorted({r["seqlen"] for r in records}))
    ax.set_yscale("log")
    ax.set_ylabel("peak memory beyond the inputs (MiB)")
    ax.set_title(title or "peak memory of the forward pass")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=IMAGES)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.bench.summary needs a CUDA GPU")
    from utils.course.plotting import use_course_style

    from utils import gpu as gpu_info

    gpu = torch.cuda.get_device_name()
    tag = "h200" if "H200" in gpu else gpu.split()[-1].lower()
    fns = implementations("cuda")
    dtype = torch.bfloat16
    result = dict(environment=gpu_info.environment("python -m utils.course.bench.summary"), gpu=gpu,
                  correctness=correctness(fns, device="cuda", dtype=dtype))
    result["speed"] = speed_sweep(list(fns), [512, 1024, 2048, 4096, 8192, 16384], batch=4, heads=16,
                                  head_dim=64, dtype_name="bf16", sdpa=("flash", "cudnn"))
    result["memory"] = memory_sweep(fns, [512, 1024, 2048, 4096, 8192, 16384], batch=1, heads=16, head_dim=64,
                                    dtype=dtype, device="cuda")
    result["stable_diffusion"] = stable_diffusion_case(fns, dtype=dtype, device="cuda")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"summary_{tag}.json").write_text(json.dumps(result, indent=1))
    use_course_style()
    sweep.plot(result["speed"], args.out_dir / f"summary_{tag}_speed.png",
                   title=f"{gpu}, bf16, B=4, H=16, D=64")
    plot_memory(result["memory"], f"{gpu}, bf16, B=1, H=16, D=64").savefig(
        args.out_dir / f"summary_{tag}_memory.png", bbox_inches="tight")
    for row in result["stable_diffusion"]:
        print(f"SD 2.1 512x512  {row['impl']:>24s} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
              f"{row['peak_mib']:9.1f} MiB")
    print(sweep.format_table(result["speed"]))


if __name__ == "__main__":
    main()
