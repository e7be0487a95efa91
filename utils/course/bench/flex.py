"""FlexAttention benchmark (notebook 10): the course's flex kernels (utils.flex) against PyTorch's compiled
flex_attention and against SDPA given the same mask as a dense boolean tensor.

    python -m utils.course.bench.flex                   # images/10_flex_h200.json, 10_flex_h200.png, 10_flex_sparsity_h200.png
    python -m utils.course.bench.flex --quick --out build/10_flex_quick.json   # a few small shapes (the GPU smoke test)
    python -m utils.course.bench.flex --summary         # print the stored table; no GPU needed

Every number is measured in one run, on bf16 inputs of batch 2, 16 heads, head dim 128: a causal sliding window
of 1k tokens at N = 4k..32k, a document mask (causal within each of 8..64 documents) at N = 16k, dense causal
attention at the same N, and the course kernel over windows of 256..16k at N = 16k (fraction of tiles skipped
against time). Each implementation's output and gradients are checked against the others before it is timed
(`utils.course.bench.benchmark`: triton.testing.do_bench, median, L2 flushed). Needs a CUDA GPU; the pure parts (the
plan, the document split, the checks, the table and the plots) run anywhere.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from utils.course.bench import error_line
from utils.course.plotting import pyplot

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = ROOT / "images" / "10_flex_h200.json"
QUICK_OUT = ROOT / "build" / "10_flex_quick.json"    # ignored by git: a smoke test never replaces the reference
BATCH, HEADS, HEAD_DIM, DTYPE = 2, 16, 128, torch.bfloat16
DENSE_MASK_LIMIT = 16384 * 16384   # SDPA's boolean mask is Nq×Nk bytes, and its kernels read all of it
TOLERANCE = 0.03                   # bf16 (utils.course.testing.TOLERANCES): elementwise atol/rtol and relative norm
TIMING = ("fwd_ms: the forward alone (inputs without grad); fwd_bwd_ms: the forward then "
          "torch.autograd.grad(o, (q, k, v), do), timed as one step; bwd_ms = fwd_bwd_ms - fwd_ms")
IMPL_LABELS = {"course": "course (utils.flex)", "torch_flex": "torch flex_attention (compiled)",
               "sdpa_mask": "SDPA, dense bool mask", "sdpa_causal": "SDPA is_causal"}


class Plan(NamedTuple):
    seqlens: tuple            # sliding window and dense causal at each N
    window: int               # the compared sliding window
    doc_seqlen: int           # the document masks' N
    doc_counts: tuple         # documents per sequence
    sparsity_seqlen: int      # the sparsity sweep's N
    sparsity_windows: tuple   # its windows (window = N is dense causal)


FULL = Plan((4096, 8192, 16384, 32768), 1024, 16384, (8, 16, 32, 64), 16384,
            (256, 512, 1024, 2048, 4096, 8192, 16384))
QUICK = Plan((1024,), 256, 1024, (4,), 1024, (128, 1024))


class Case(NamedTuple):
    mask: str                 # "sliding_window", "document" or "causal"
    seqlen: int
    window: int | None = None
    documents: int | None = None


# The implementations timed on each kind of mask. PyTorch's come first: the first that runs is the one the
# others are checked against.
IMPLS = {"sliding_window": ("sdpa_mask", "torch_flex", "course"), "document": ("sdpa_mask", "torch_flex", "course"),
         "causal": ("sdpa_causal", "course")}
SPARSITY_IMPLS = ("sdpa_mask", "course")   # the sweep's other windows: SDPA only as the check's partner


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m utils.course.bench.flex", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few small shapes (the GPU test suite's smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"the JSON; the plots go beside it (default {DEFAULT_OUT.relative_to(ROOT)}, "
                        f"with --quick {QUICK_OUT.relative_to(ROOT)})")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and of the document split")
    p.add_argument("--summary", action="store_true", help="only print the table of the stored JSON (--out)")
    args = p.parse_args(argv)
    if args.warmup <= 0 or args.rep <= 0:
        p.error("--warmup and --rep must be positive")
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    if args.out.suffix != ".json":
        p.error("--out must name a .json file")
    return args


def figure_paths(json_path) -> tuple[Path, Path]:
    """The two plots beside the JSON: 10_flex_h200.json -> 10_flex_h200.png and 10_flex_sparsity_h200.png."""
    path = Path(json_path)
    head, _, tag = path.stem.rpartition("_")
    sparsity = f"{head}_sparsity_{tag}" if head else f"{tag}_sparsity"
    return path.with_suffix(".png"), path.with_name(sparsity + ".png")


def split_documents(total: int, count: int, seed: int = 0) -> list[int]:
    """`count` document lengths, each >= 1, summing to `total`: equal-ish (in proportion to weights drawn from
    [0.5, 1.5], so no document is much more than 3 times another), seeded so that every run packs the same."""
    if not (isinstance(count, int) and isinstance(total, int)) or count < 1 or total < count:
        raise ValueError(f"need 1 <= count <= total, got count={count!r}, total={total!r}")
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(count)]
    extra = total - count                      # one token each first, so no document is empty
    scale = extra / sum(weights)
    shares = [w * scale for w in weights]
    lengths = [1 + int(s) for s in shares]
    by_remainder = sorted(range(count), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:total - sum(lengths)]:   # hand out what rounding down left over
        lengths[i] += 1
    return lengths


def cases(plan: Plan) -> dict:
    """{Case: implementations} of a plan, each case once (the sweep's window may be the compared one)."""
    out = {}
    for n in plan.seqlens:
        out[Case("sliding_window", n, window=plan.window)] = IMPLS["sliding_window"]
    for count in plan.doc_counts:
        out[Case("document", plan.doc_seqlen, documents=count)] = IMPLS["document"]
    for n in sorted({*plan.seqlens, plan.doc_seqlen, plan.sparsity_seqlen}):
        out[Case("causal", n)] = IMPLS["causal"]
    for w in plan.sparsity_windows:
        out.setdefault(Case("sliding_window", plan.sparsity_seqlen, window=w), SPARSITY_IMPLS)
    return out


def describe(case) -> str:
    """'window 1k', '16 documents' or 'causal' (the table's first column)."""
    kind = case["mask"] if isinstance(case, dict) else case.mask
    get = case.get if isinstance(case, dict) else lambda key: getattr(case, key)
    if kind == "sliding_window":
        w = get("window")
        return f"window {w // 1024}k" if w % 1024 == 0 else f"window {w}"
    return f"{get('documents')} documents" if kind == "document" else "causal"


# --- the implementations ------------------------------------------------------------------------------------

def make_modifier(case: Case, device, seed: int = 0):
    """The utils.flex Modifier of a case (documents: split_documents(N, count, seed))."""
    from utils import flex

    if case.mask == "sliding_window":
        return flex.sliding_window(case.window, causal=True)
    if case.mask == "document":
        ids = flex.document_ids(split_documents(case.seqlen, case.documents, seed), device=device)
        return flex.document(ids, causal=True)
    if case.mask == "causal":
        return flex.causal()
    raise ValueError(f"unknown mask {case.mask!r}")


class Skipped(Exception):
    """An implementation left out of a case on purpose (the reason is recorded)."""


_COMPILED = {}


def compiled_flex(key):
    """torch.compile(flex_attention), one per (shape, mask kind): compiling dominates flex's first call, and the
    cache keeps it to once per key (a new document split of the same shape reuses it)."""
    from torch.nn.attention.flex_attention import flex_attention

    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED[key]


def allow_recompiles(limit: int = 64) -> None:
    """Let dynamo keep a graph per shape and mask: past its default of 8 it would fall back to eager flex."""
    import torch._dynamo.config as config

    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 8 * limit)


def build(impl: str, case: Case, modifier, *, batch, heads, device):
    """fn(q, k, v) -> o for one implementation, with its mask built once here, outside any timing."""
    n = case.seqlen
    if impl == "course":
        from utils import flex

        bm = flex.block_mask(modifier, batch, heads, n, n, device=device)

        def course(q, k, v):
            return flex.flex_attention(q, k, v, modifier, block_mask=bm)
        course.sparsity = float(bm.sparsity())   # the case's fraction of tiles skipped, for the records
        return course
    if impl == "torch_flex":
        from torch.nn.attention.flex_attention import create_block_mask

        bm = None if modifier.torch_mask is None else create_block_mask(
            modifier.torch_mask, batch if modifier.per_batch else None, heads if modifier.per_head else None,
            n, n, device=device)
        fn = compiled_flex((batch, heads, n, case.mask))
        return lambda q, k, v: fn(q, k, v, score_mod=modifier.torch_score, block_mask=bm)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if impl == "sdpa_causal":
        return lambda q, k, v: sdpa(q, k, v, is_causal=True)
    if impl == "sdpa_mask":
        return _sdpa_mask(modifier, n, batch=batch, heads=heads, device=device)
    raise ValueError(f"unknown implementation {impl!r}")


def _sdpa_mask(modifier, n, *, batch, heads, device):
    from utils import flex

    if n * n > DENSE_MASK_LIMIT:
        raise Skipped(f"dense mask {n}x{n} is larger than 16384x16384")
    if modifier.score_mod is not None:
        raise Skipped("a score_mod is no boolean mask")
    mask = flex.dense_mask(modifier, batch, heads, n, n, device)
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --- checking and timing ------------------------------------------------------------------------------------

def check_close(got, expected, *, name="output", tol=TOLERANCE) -> None:
    """Raise AssertionError unless `got` matches `expected` for bf16: elementwise (torch.testing.assert_close,
    atol scaled by the tensor's largest value) and in relative norm, which catches small errors on many rows."""
    got, expected = got.float(), expected.float()
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")
    rel = ((got - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    if not rel <= tol:   # also false for NaN
        raise AssertionError(f"{name}: relative error {rel:.3g} in norm exceeds {tol}")


def disagreements(outputs: dict, tol=TOLERANCE) -> dict:
    """{name: error message} for each implementation whose (o, dq, dk, dv) differ from the first one's."""
    names = list(outputs)
    errors = {}
    for name in names[1:]:
        try:
            for part, got, want in zip(("o", "dq", "dk", "dv"), outputs[name], outputs[names[0]]):
                check_close(got, want, name=f"{part} of {name} against {names[0]}", tol=tol)
        except AssertionError as err:
            errors[name] = "mismatch: " + str(err).splitlines()[0][:300]
    return errors


def fwd_bwd(fn, do):
    """A step (q, k, v) -> (dq, dk, dv): the forward and its backward, the way training runs them."""
    def step(q, k, v):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), do)
    return step


def first_call(fn, q, k, v, do) -> tuple[tuple, float]:
    """(o, dq, dk, dv) and the seconds the first forward and forward+backward took (compilation, JIT)."""
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    o = fn(q, k, v)
    grads = fwd_bwd(fn, do)(*(t.detach().requires_grad_() for t in (q, k, v)))
    sync()
    return (o, *grads), time.perf_counter() - start


def time_ms(fn, q, k, v, do, *, warmup, rep) -> dict:
    """Median forward and forward+backward milliseconds (utils.course.bench.benchmark), and their difference."""
    from utils.course.bench import benchmark

    fwd = benchmark(fn, q, k, v, warmup=warmup, rep=rep)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    both = benchmark(fwd_bwd(fn, do), qg, kg, vg, warmup=warmup, rep=rep)
    return dict(fwd_ms=fwd, fwd_bwd_ms=both, bwd_ms=both - fwd)


def measure_case(case: Case, fns: dict, q, k, v, do, *, warmup=25, rep=100, timer=time_ms) -> list[dict]:
    """One record per implementation: built fns ({name: fn or the Exception that stopped building it}) are
    run once, checked against the first that ran, and only those that agree are timed."""
    records, outputs = {}, {}
    for name, fn in fns.items():
        records[name] = dict(case._asdict(), impl=name, fwd_ms=None, fwd_bwd_ms=None, bwd_ms=None,
                             first_call_s=None, error=None)
        if isinstance(fn, Exception):
            records[name]["error"] = str(fn) if isinstance(fn, Skipped) else error_line(fn)
            continue
        try:
            outputs[name], records[name]["first_call_s"] = first_call(fn, q, k, v, do)
        except (RuntimeError, ValueError) as err:   # torch.OutOfMemoryError is a RuntimeError
            records[name]["error"] = error_line(err)
    for name, message in disagreements(outputs).items():
        records[name]["error"] = message            # a wrong kernel posts no time
    del outputs
    for name, record in records.items():
        if record["error"] is None:
            try:
                record.update(timer(fns[name], q, k, v, do, warmup=warmup, rep=rep))
            except (RuntimeError, ValueError) as err:
                record["error"] = error_line(err)
    return list(records.values())


# --- the run ------------------------------------------------------------------------------------------------

def build_all(case: Case, impls, modifier, *, batch, heads, device) -> tuple[dict, dict]:
    """({name: fn, or the exception that stopped it}, {name: seconds its mask took to build})."""
    fns, mask_s = {}, {}
    for name in impls:
        start = time.perf_counter()
        try:
            fns[name] = build(name, case, modifier, batch=batch, heads=heads, device=device)
        except (Skipped, RuntimeError, ValueError) as err:   # a skip, or out of memory for a dense mask
            fns[name] = err
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        mask_s[name] = time.perf_counter() - start
    return fns, mask_s


def run_case(case: Case, impls, *, warmup, rep, seed, device="cuda", batch=BATCH, heads=HEADS,
             head_dim=HEAD_DIM, timer=time_ms) -> list[dict]:
    """Build, check and time each implementation on one case; records carry mask_s and the case's sparsity."""
    modifier = make_modifier(case, device, seed)
    fns, mask_s = build_all(case, impls, modifier, batch=batch, heads=heads, device=device)
    sparsity = getattr(fns.get("course"), "sparsity", None)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(batch, heads, case.seqlen, head_dim, device=device, dtype=DTYPE, generator=gen)
                   for _ in range(4))
    records = measure_case(case, fns, q, k, v, do, warmup=warmup, rep=rep, timer=timer)
    for r in records:
        r.update(mask_s=mask_s[r["impl"]], sparsity=sparsity)
    del fns, q, k, v, do
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


def run(plan: Plan, *, warmup=25, rep=100, seed=0, device="cuda", on_case=None, progress=True) -> list[dict]:
    """Every case of the plan; `on_case(records so far)` after each (main() rewrites the JSON, so that a run
    cut short keeps what it measured)."""
    from tqdm.auto import tqdm

    allow_recompiles()
    records = []
    bar = tqdm(cases(plan).items(), desc="flex benchmark", disable=not progress)
    for case, impls in bar:
        bar.set_postfix_str(f"{describe(case)}, N={case.seqlen}")
        records += run_case(case, impls, warmup=warmup, rep=rep, seed=seed, device=device)
        if on_case is not None:
            on_case(records)
    return records


def settings(plan: Plan, args) -> dict:
    """What the JSON's numbers mean: shapes, the plan, the document lengths, timing and checking."""
    return dict(batch=BATCH, heads=HEADS, head_dim=HEAD_DIM, dtype="bf16", quick=args.quick, seed=args.seed,
                warmup_ms=args.warmup, rep_ms=args.rep, **{key: list(value) if isinstance(value, tuple) else value
                                                            for key, value in plan._asdict().items()},
                doc_lengths={str(c): split_documents(plan.doc_seqlen, c, args.seed) for c in plan.doc_counts},
                dense_mask_limit=DENSE_MASK_LIMIT, timing=TIMING, impls=IMPL_LABELS,
                check=f"before timing, o, dq, dk, dv of each implementation against the first that ran "
                      f"(PyTorch's): elementwise and in relative norm, tolerance {TOLERANCE}",
                sparsity="fraction of tiles the course's block mask skips (utils.flex.block_mask(...).sparsity())",
                first_call="seconds of the first forward and forward+backward: torch.compile for torch_flex, "
                           "Triton's JIT for course",
                mask_s="seconds to build the implementation's mask (block masks, SDPA's dense mask)")


def write_json(data: dict, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load(path=DEFAULT_OUT) -> dict:
    return json.loads(Path(path).read_text())


# --- the table (from the stored JSON: no GPU needed) --------------------------------------------------------

def _index(records) -> dict:
    return {(r["mask"], r["seqlen"], r["window"], r["documents"], r["impl"]): r for r in records}


def _value(index, case: Case, impl: str, key: str):
    record = index.get((*case, impl))
    return None if record is None else record.get(key)


def _cell(x, width: int, spec: str = ".3f", suffix: str = "") -> str:
    return f"{x:{width - len(suffix)}{spec}}{suffix}" if x is not None else f"{'—':>{width}}"


def _times(ratio) -> str:
    return "—" if ratio is None else f"{ratio:.2f}x"


def _ratio(num, den):
    return num / den if num and den else None


def compare_cases(settings: dict) -> list[Case]:
    """The comparison's rows: the window at each N, the document masks, then dense causal at each N."""
    rows = [Case("sliding_window", n, window=settings["window"]) for n in settings["seqlens"]]
    rows += [Case("document", settings["doc_seqlen"], documents=c) for c in settings["doc_counts"]]
    return rows + [Case("causal", n) for n in sorted({*settings["seqlens"], settings["doc_seqlen"]})]


def comparison_table(data: dict, key: str = "fwd_ms", title: str = "forward") -> list[str]:
    """Milliseconds of each implementation per case and the course kernel's speed-up against each."""
    index = _index(data["results"])
    columns = ("torch flex", "SDPA", "causal*")
    lines = [f"{title + ', ms':<18}{'N':>6}{'skipped':>8}{'course':>10}" + "".join(f"{c:>11}" for c in columns)
             + "   course speed-up vs" + "".join(f"{c:>11}" for c in columns)]
    for case in compare_cases(data["settings"]):
        course = _value(index, case, "course", key)
        others = [_value(index, case, "torch_flex", key),
                  _value(index, case, "sdpa_causal" if case.mask == "causal" else "sdpa_mask", key),
                  None if case.mask == "causal" else _value(index, Case("causal", case.seqlen), "course", key)]
        skipped = _value(index, case, "course", "sparsity")
        lines.append(f"{describe(case):<18}{case.seqlen:>6}{_cell(skipped, 8, '.2f')}{_cell(course, 10)}"
                     + "".join(_cell(x, 11) for x in others) + " " * 21
                     + "".join(_cell(_ratio(x, course), 11, ".2f", "x") for x in others))
    return lines


def headline(data: dict) -> list[str]:
    """The window at the longest N against dense causal attention and torch flex_attention, both passes."""
    s, index = data["settings"], _index(data["results"])
    n = max(s["seqlens"])
    case = Case("sliding_window", n, window=s["window"])
    parts = []
    for key, name in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
        course = _value(index, case, "course", key)
        causal = _ratio(_value(index, Case("causal", n), "course", key), course)
        flex = _ratio(_value(index, case, "torch_flex", key), course)
        parts.append(f"{name}: {_times(causal)} dense causal's speed, {_times(flex)} torch flex_attention's")
    return [f"{describe(case)} at N={n}, course kernel: " + "; ".join(parts)]


def sparsity_table(data: dict) -> list[str]:
    """The course kernel over the windows of the sweep: time against the fraction of tiles skipped."""
    s, index = data["settings"], _index(data["results"])
    n = s["sparsity_seqlen"]
    causal = Case("causal", n)
    computed = 1 - (_value(index, causal, "course", "sparsity") or 0.0)
    lines = [f"course kernel, causal sliding windows at N={n} (* / causal: against dense causal at this N)",
             f"{'window':>8}{'skipped':>9}{'tiles / causal':>16}{'fwd ms':>10}{'/ causal':>10}"
             f"{'fwd+bwd ms':>12}{'/ causal':>10}"]
    for w in s["sparsity_windows"]:
        case = Case("sliding_window", n, window=w)
        skipped = _value(index, case, "course", "sparsity")
        tiles = None if skipped is None else (1 - skipped) / computed
        cells = []
        for key, width in (("fwd_ms", 10), ("fwd_bwd_ms", 12)):
            ms = _value(index, case, "course", key)
            cells += [_cell(ms, width), _cell(_ratio(ms, _value(index, causal, "course", key)), 10, ".2f")]
        lines.append(f"{w:>8}{_cell(skipped, 9, '.3f')}{_cell(tiles, 16, '.3f')}" + "".join(cells))
    return lines


def compile_lines(data: dict) -> list[str]:
    """How long the first calls took: torch.compile for PyTorch's flex_attention, Triton's JIT for the course's."""
    lines = []
    for impl, what in (("torch_flex", "torch.compile'd flex_attention"), ("course", "course kernel (Triton JIT)")):
        seconds = [r["first_call_s"] for r in data["results"] if r["impl"] == impl and r["first_call_s"] is not None]
        if seconds:
            lines.append(f"{what}: first forward + forward+backward {min(seconds):.1f}–{max(seconds):.1f} s per "
                         f"case, {sum(seconds):.0f} s over {len(seconds)} cases")
    return lines


def skipped_lines(data: dict) -> list[str]:
    """Each implementation left out of a case, and why (a skipped SDPA mask, a failed check, out of memory)."""
    return [f"{r['impl']} on {describe(r)}, N={r['seqlen']}: {r['error']}" for r in data["results"] if r["error"]]


def summary_text(data: dict) -> str:
    """The printed summary of a run: both comparison tables, the headline, the sparsity sweep, compile times."""
    s, env = data["settings"], data.get("environment") or {}
    lines = [f"{env.get('gpu') or 'no GPU'} (torch {env.get('torch')}, Triton {env.get('triton')}, "
             f"{env.get('date')}); {s['dtype']}, B={s['batch']}, H={s['heads']}, D={s['head_dim']}; median ms",
             "SDPA: dense boolean mask (is_causal on the causal rows); causal*: the course kernel on dense causal "
             "attention at the same N"]
    for key, title in (("fwd_ms", "forward"), ("fwd_bwd_ms", "fwd+bwd")):
        lines += ["", *comparison_table(data, key, title)]
    lines += ["", *headline(data), "", *sparsity_table(data), "", *compile_lines(data)]
    left_out = skipped_lines(data)
    return "\n".join(lines + (["", "not timed:", *left_out] if left_out else []))


def summarize(path=DEFAULT_OUT) -> None:
    """Print the table of a stored run (the notebook's way to show the measured numbers without a GPU)."""
    print(summary_text(load(path)))


# --- the plots ----------------------------------------------------------------------------------------------

def _title(data: dict) -> str:
    s = data["settings"]
    return f"{(data.get('environment') or {}).get('gpu') or ''}, {s['dtype']}, B={s['batch']}, H={s['heads']}, " \
           f"D={s['head_dim']}"


def plot_comparison(data: dict):
    """Bars per masked case (ms, log scale): course, torch flex, SDPA with the mask, the course on dense causal;
    forward above, forward+backward below."""
    plt = pyplot()
    index = _index(data["results"])
    rows = [c for c in compare_cases(data["settings"]) if c.mask != "causal"]
    bars = [("course", IMPL_LABELS["course"]), ("torch_flex", IMPL_LABELS["torch_flex"]),
            ("sdpa_mask", IMPL_LABELS["sdpa_mask"]), ("causal", "course on dense causal, same N")]
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(rows) + 2), 6.5), sharex=True)
    width = 0.8 / len(bars)
    for ax, (key, name) in zip(axes, (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))):
        for j, (impl, label) in enumerate(bars):
            values = [_value(index, Case("causal", c.seqlen) if impl == "causal" else c,
                             "course" if impl == "causal" else impl, key) for c in rows]
            xs = [i + (j - (len(bars) - 1) / 2) * width for i, v in enumerate(values) if v]
            ax.bar(xs, [v for v in values if v], width, label=label, color=f"C{j}")
        ax.set_yscale("log")
        ax.set_ylabel(f"{name}, ms")
    axes[1].set_xticks(range(len(rows)), [f"{describe(c)}\nN={c.seqlen // 1024}k" for c in rows], fontsize=8)
    axes[0].set_title(_title(data))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, bbox_to_anchor=(0.5, -0.06))
    fig.tight_layout()
    return fig


def plot_sparsity(data: dict):
    """The course kernel's time against the fraction of tiles skipped, with lines proportional to the tiles
    computed through dense causal's point (what a kernel that costs only its tiles would take)."""
    plt = pyplot()
    s, index = data["settings"], _index(data["results"])
    n = s["sparsity_seqlen"]
    cases_ = [Case("sliding_window", n, window=w) for w in s["sparsity_windows"]]
    causal_skipped = _value(index, Case("causal", n), "course", "sparsity")
    fig, ax = plt.subplots()
    for j, (key, name) in enumerate((("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))):
        pts = [(_value(index, c, "course", "sparsity"), _value(index, c, "course", key), c) for c in cases_]
        pts = [p for p in pts if p[0] is not None and p[1]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{j}", label=name)
        causal_ms = _value(index, Case("causal", n), "course", key)
        if causal_ms and causal_skipped is not None:
            ax.plot([causal_skipped, 1.0], [causal_ms, 0.0], ":", color=f"C{j}", linewidth=1)
        for i, (x, y, c) in enumerate(pts if j == 0 else ()):   # above and below in turn: small windows crowd
            ax.annotate(describe(c).removeprefix("window "), (x, y), textcoords="offset points",
                        xytext=(-4, 8 if i % 2 else -14), fontsize=8)
    ax.set_xlabel("fraction of tiles skipped")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"course kernel, sliding windows at N={n // 1024}k (dotted: proportional to tiles)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig


def save_figures(data: dict, json_path) -> tuple[Path, Path]:
    """The comparison and sparsity plots, saved beside the JSON (figure_paths)."""
    plt = pyplot()
    paths = figure_paths(json_path)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for fig, path in zip((plot_comparison(data), plot_sparsity(data)), paths):
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)
    return paths


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.summary:
        summarize(args.out)
        return load(args.out)
    if not torch.cuda.is_available():
        raise SystemExit("python -m utils.course.bench.flex needs a CUDA GPU (--summary prints a stored run anywhere)")
    from utils import gpu

    plan = QUICK if args.quick else FULL
    command = " ".join(["python -m utils.course.bench.flex", *(sys.argv[1:] if argv is None else argv)])
    data = dict(environment=gpu.environment(command), settings=settings(plan, args), results=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(records):
        write_json(dict(data, results=records), args.out)

    data["results"] = run(plan, warmup=args.warmup, rep=args.rep, seed=args.seed, on_case=save)
    write_json(data, args.out)
    paths = save_figures(data, args.out)
    print(summary_text(data))
    print("wrote", args.out, *paths)
    return data


if __name__ == "__main__":
    main()
