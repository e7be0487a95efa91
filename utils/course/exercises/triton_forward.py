"""Checks for notebook 05's kernel exercises: the step kernels of the FlashAttention-2 forward in Triton.

Every step kernel has one signature, so one launcher runs them all:

    kernel(Q, K, V, O, LSE, seqlen_q, seqlen_k, qk_scale, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N[, CAUSAL])

on contiguous (batch * heads, seq, head_dim) buffers, with the grid (cdiv(Nq, BLOCK_M), batch * heads); query
head h of a batch reads K/V head h // GROUP, i.e. row pid_bh // GROUP of the K/V buffers (GQA without copies).
`qk_scale` is sm_scale · log2(e): the kernels work in base 2.

The references are computed here from scratch in float64, never by a course kernel. An interpreted kernel
(CPU) runs on fp32 inputs with tight tolerances; a compiled one runs on the GPU on fp16 inputs (fp32 dots
would use TF32) with fp16 tolerances. The checks run odd shapes: Nq and Nk not multiples of the blocks, Nq != Nk, GQA, scores large enough for the running maximum to
move between key blocks. A failure names the (batch, head) slices, rows and Q blocks that are wrong.

Before a launch, `learner_kernel` makes sure the kernel is the learner's own step kernel: a Triton kernel, not
one of the course's (utils), not another step's (a later step's kernel does more than the step asks), and not
calling a course device function that does the step (utils.tiled.fast.forward's online softmax, say).
"""
from __future__ import annotations

import math
import types

import torch

from utils.course.exercises import assert_rows_close
from utils.course.exercises.refuse import RefusedAnswer, refused_name, refusing

LOG2E = 1.4426950408889634
BLOCK_M = BLOCK_N = 16


# Course device functions a learner's kernel may call: the index and mask helpers, and the debugging helpers.
HELPER_MODULES = ("utils.triton_utils",)


def _jit_function(obj):
    """The Python function of a Triton kernel (compiled or interpreted), or None for anything else."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:          # pragma: no cover (every supported Triton has it)
        InterpretedFunction = JITFunction
    return obj.fn if isinstance(obj, (JITFunction, InterpretedFunction)) else None


def _from_course(fn) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return (module == "utils" or module.startswith("utils.")) and module not in HELPER_MODULES


def _library(fn) -> bool:
    """Triton's own device functions (tl.max, ...) and the helpers a learner may call."""
    module = getattr(fn, "__module__", None) or ""
    return module in HELPER_MODULES or module == "triton" or module.startswith("triton.")


def _names(code: types.CodeType) -> set[str]:
    """Every global or attribute name the code (and the functions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _course_kernels_called(fn, seen=None) -> list[str]:
    """The course's device functions that `fn` calls, directly, through a module (`fast_forward._f`) or through
    a device function of the learner's own."""
    seen = set() if seen is None else seen
    seen.add(fn)
    names, found = _names(fn.__code__), []
    for name in sorted(names):
        obj = fn.__globals__.get(name)
        called = ([getattr(obj, attr, None) for attr in sorted(names)] if isinstance(obj, types.ModuleType)
                  else [obj])
        for callee in filter(None, map(_jit_function, called)):
            if _from_course(callee):
                found.append(refused_name(callee))
            elif callee not in seen and not _library(callee):   # the learner's own device function
                found += _course_kernels_called(callee, seen)
    return list(dict.fromkeys(found))


def learner_kernel(kernel, name: str) -> None:
    """Fail unless `kernel` is the learner's Triton kernel `name`, written without the course's kernels."""
    fn = _jit_function(kernel)
    if fn is None:
        raise AssertionError(f"pass your @triton.jit kernel {name} itself, not a {type(kernel).__name__}")
    if _from_course(fn):
        raise RefusedAnswer(f"the check refuses the course's own kernel `{refused_name(fn)}`: it checks your "
                            f"{name}, so pass that")
    if fn.__name__ != name:
        raise RefusedAnswer(f"this check is for your kernel `{name}`, not `{fn.__name__}`: another step's kernel "
                            f"answers a different exercise, so write {name}'s step yourself")
    used = _course_kernels_called(fn)
    if used:
        raise RefusedAnswer(f"your {name} calls the course's own `{used[0]}`: the check refuses it, since it does "
                            f"the step for you; write the step with your own code")


def launch(kernel, q, k, v, *, causal=None, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """Run a step kernel on (batch, heads, seq, head_dim) tensors; returns (o, lse), lse natural-log.

    `causal=None` launches a kernel without a CAUSAL argument (steps 1-3)."""
    b, h, nq, d = q.shape
    h_kv, nk = k.shape[1], k.shape[2]
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of k's {h_kv}")
    q, k, v = (t.reshape(-1, t.shape[2], d).contiguous() for t in (q, k, v))
    o = torch.zeros_like(q)
    lse = torch.full((b * h, nq), float("nan"), device=q.device, dtype=torch.float32)
    meta = {} if causal is None else {"CAUSAL": causal}
    grid = ((nq + block_m - 1) // block_m, b * h)
    counted_launch(kernel, grid, q, k, v, o, lse, nq, nk, LOG2E / math.sqrt(d), GROUP=h // h_kv, HEAD_DIM=d,
                   BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    return o.view(b, h, nq, d), lse.view(b, h, nq)


def counted_launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, failing unless the kernel passed is what ran, once (a kernel object
    whose launch runs another kernel fails)."""
    hooks, launches = getattr(kernel, "pre_run_hooks", None), []
    count = lambda *a, **k: launches.append(1)   # noqa: E731 (Triton calls it as the kernel starts)
    if isinstance(hooks, list):
        hooks.append(count)
    try:
        kernel[grid](*args, **kwargs)
    finally:
        if isinstance(hooks, list):
            hooks.remove(count)
    if isinstance(hooks, list) and len(launches) != 1:
        raise AssertionError(f"one launch ran the kernel you passed {len(launches)} times: the check must see your "
                             f"kernel itself run, once")


def reference(q, k, v, causal: bool = False):
    """(o, lse) in float64: softmax(Q Kᵀ / sqrt(d)) V with K/V heads repeated for GQA and the causal mask aligned
    bottom-right (query i sees key j iff j <= i + Nk - Nq); a query that sees no key gives 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        sees = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(~sees.to(s.device), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def _setting(kernel):
    """(device, dtype, tolerance) for a kernel: interpreted on the CPU in fp32, compiled on the GPU in fp16."""
    from triton.runtime.interpreter import InterpretedFunction  # not imported by `import triton` on a GPU

    if isinstance(kernel, InterpretedFunction):
        return "cpu", torch.float32, 1e-4
    return "cuda", torch.float16, 1e-2


def _qkv(b, h, h_kv, nq, nk, d, growing: bool, seed: int):
    """Random fp32 inputs; `growing` scales the keys up along the sequence so the running maximum rises from
    one key block to the next (a missing rescale of the accumulator cannot hide)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=gen) for x, n in ((h, nq), (h_kv, nk), (h_kv, nk)))
    if growing:
        k = k * torch.linspace(0.5, 4.0, nk)[:, None]
    return q, k, v


def _check(kernel, cases, causal):
    for b, h, h_kv, nq, nk, d, growing in cases:
        device, dtype, tol = _setting(kernel)
        q, k, v = (t.to(device, dtype) for t in _qkv(b, h, h_kv, nq, nk, d, growing, seed=nq * 1000 + nk))
        o, lse = launch(kernel, q, k, v, causal=causal)
        o_ref, lse_ref = reference(q, k, v, causal=bool(causal))
        where = f"B={b}, H={h}, H_kv={h_kv}, Nq={nq}, Nk={nk}, d={d}{', causal' if causal else ''}"
        assert_rows_close(o, o_ref, atol=tol, rtol=tol, block_rows=BLOCK_M, name=f"O ({where})")
        yield lse.cpu(), lse_ref.cpu(), where, tol


def _check_lse(lse, lse_ref, where, tol):
    wrong = (torch.isinf(lse) != torch.isinf(lse_ref)) | (torch.isfinite(lse_ref) & ~torch.isclose(
        lse.double(), lse_ref, atol=tol, rtol=tol))
    if wrong.any():
        rows = wrong.any(0).any(0).nonzero().flatten().tolist()
        raise AssertionError(f"lse ({where}) is wrong in rows {rows[:8]}{' ...' if len(rows) > 8 else ''}: "
                             f"got {lse[wrong][:3].tolist()}, expected {lse_ref[wrong][:3].tolist()}")


def check_online_softmax(kernel) -> None:
    """Exercise 5.1: the online-softmax update of step 1 (Nk a multiple of BLOCK_N, no masks yet). Step 1's kernel
    stores O only: one that also writes LSE is a later step's kernel or the library's, and fails."""
    learner_kernel(kernel, "fa_step1")
    cases = [(1, 2, 2, 40, 48, 32, True),    # Nq ragged (3 Q blocks, the last one 8 rows), 3 key blocks
             (2, 4, 2, 17, 64, 16, True),    # GQA: 2 query heads per K/V head
             (1, 1, 1, 16, 16, 16, False)]   # one key block: no rescale needed yet
    for lse, _, where, _ in _check(kernel, cases, causal=None):
        if not torch.isnan(lse).all():
            raise RefusedAnswer(f"{where}: the kernel wrote LSE, which step 1's fa_step1 never stores: this is a "
                                f"later step's kernel (fa_step2 writes lse) or the library's, not your step 1")


def check_ragged(kernel) -> None:
    """Exercise 5.2: masks for a ragged last key block (Nk not a multiple of BLOCK_N); o and lse."""
    learner_kernel(kernel, "fa_step3")
    cases = [(1, 2, 2, 40, 37, 32, True), (2, 4, 1, 5, 100, 16, True), (1, 2, 1, 33, 5, 16, False),
             (1, 1, 1, 16, 48, 16, True)]
    for result in _check(kernel, cases, causal=None):
        _check_lse(*result)



def check_causal(kernel) -> None:
    """Exercise 5.3: the causal mask of the diagonal blocks, bottom-right aligned, with Nq < Nk, Nq > Nk (queries
    that see no key: output 0, lse -inf), Nq = Nk and GQA; and the ragged tail, causal or not."""
    learner_kernel(kernel, "fa_step4")
    cases = [(1, 2, 1, 40, 56, 32, True), (1, 2, 2, 56, 40, 16, True), (2, 4, 2, 17, 17, 16, False),
             (1, 1, 1, 1, 30, 16, False), (1, 1, 1, 30, 1, 16, False)]
    for causal in (True, False):
        for result in _check(kernel, cases, causal=causal):
            _check_lse(*result)


def check_causal_key_range(causal_key_range) -> None:
    """Exercise 5.6: causal_key_range(start_m, block_m, Nq, Nk) = (n_full, n_end): the keys every query of the
    block sees, and one past the last key any of them sees, from the bottom-right causal mask. The notebook's
    `kernel_key_ranges` and `block_kinds` and the course's `flash2_kv_end` are refused while it runs."""
    from utils.eager.forward import flash2_kv_end

    for seqlen_q, seqlen_k in [(8, 8), (5, 12), (12, 5), (1, 7), (7, 1)]:
        for block_m in (1, 2, 4):
            for start_m in range(0, seqlen_q, block_m):
                rows = torch.arange(start_m, start_m + block_m)[:, None]
                sees = torch.arange(seqlen_k)[None, :] <= rows + (seqlen_k - seqlen_q)
                expected = (int(sees.all(0).long().sum()), int(sees.any(0).long().sum()))
                with refusing(flash2_kv_end, names=("kernel_key_ranges", "block_kinds"),
                              scope=getattr(causal_key_range, "__globals__", None)):
                    got = causal_key_range(start_m, block_m, seqlen_q, seqlen_k)
                assert tuple(got) == expected, (f"Nq={seqlen_q}, Nk={seqlen_k}, start_m={start_m}, "
                                                f"block_m={block_m}: expected {expected}, got {got}")


def check_merge_halves(merge_halves) -> None:
    """Exercise 5.7: merge_halves(o1, lse1, o2, lse2) = the attention over both halves of the keys, from each
    half's fp32 output and natural-log lse; a half with lse -inf counts for nothing, and rows with no key in
    either half give 0. The course's merges (`merge_attention`, `merge_partials`, ...) are refused."""
    from utils.course.exercises.online_softmax import course_lse

    gen = torch.Generator().manual_seed(56)
    for nq, nk, split in [(20, 40, 16), (1, 9, 8), (33, 17, 1)]:
        q, k, v = (torch.randn(1, 2, n, 32, generator=gen) for n in (nq, nk, nk))
        (o1, lse1), (o2, lse2) = (reference(q, k[:, :, keys], v[:, :, keys])
                                  for keys in (slice(None, split), slice(split, None)))
        with refusing(*course_lse()):
            got = merge_halves(o1.float(), lse1.float(), o2.float(), lse2.float())
        assert_rows_close(got, reference(q, k, v)[0], atol=1e-5, rtol=1e-5, block_rows=None,
                          name=f"the merge with the keys split at {split} of {nk}")
    none = torch.full_like(lse1, -math.inf).float()
    with refusing(*course_lse()):
        one = merge_halves(torch.zeros_like(o1).float(), none, o2.float(), lse2.float())
        both = merge_halves(torch.zeros_like(o1).float(), none, torch.zeros_like(o2).float(), none)
    assert_rows_close(one, o2, atol=1e-6, rtol=1e-6, name="the merge with a first half of no keys (lse -inf)")
    assert torch.isfinite(both).all() and (both == 0).all(), "rows with no key in either half must give 0, not nan"


# Exercise 5.4, the capstone: the whole forward kernel with strides. Each case adds one thing to the ones before
# it, so the first case that fails says where to look.
FORWARD_CASES = [
    # (B, H, H_kv, Nq, Nk, d, causal, layout, what the case adds)
    (1, 2, 2, 40, 37, 16, False, "contiguous", "the online softmax and the ragged last key block (Nk = 37)"),
    (2, 4, 2, 17, 48, 16, False, "contiguous", "grouped-query attention: query head h reads K/V head h // GROUP"),
    (1, 4, 2, 24, 40, 32, False, "bshd", "strides: Q, K, V and O are (batch, seq, heads, head_dim) buffers seen "
                                         "as (batch, heads, seq, head_dim), and K/V rows of a longer cache"),
    (1, 2, 1, 40, 56, 16, True, "contiguous", "the causal mask, bottom-right aligned (Nq < Nk)"),
    (1, 2, 2, 50, 20, 16, True, "bshd", "causal with Nq > Nk: the first Nq - Nk queries see no key (O = 0, "
                                        "lse = -inf)"),
]
FORWARD_HINTS = (
    "read which case failed first and what it adds; each program is one Q block of one (batch, head): load the "
    "Q tile once, stream the K/V tiles of its key range with the online softmax in base 2, then divide by l and "
    "write O and the natural-log lse.",
    "program (pid_m, pid_bh): batch ⌊pid_bh / n_heads⌋, head pid_bh mod n_heads, K/V head ⌊head / GROUP⌋; "
    "element (b, h, i, c) of Q lies at Q plus b·stride_qb + h·stride_qh + i·stride_qm + c (likewise K, V, O). "
    "Per key tile: scores s = q·kᵀ·qk_scale, −∞ where the key j ≥ Nk or, causal, j > i + Nk − Nq; m′ is the "
    "larger of m and the row maximum of s, and m̃ is m′ with 0 in place of −∞; p = 2^(s − m̃); α = 2^(m − m̃); "
    "l′ = l·α plus the row sum of p; acc′ = acc·α + p·v. At the end O is acc / l and lse is (m + log₂ l)·ln 2, "
    "with O = 0 and lse = −∞ where l is 0. Causal: no query of the block sees a key past "
    "start_m + BLOCK_M + Nk − Nq, so the loop stops there.",
)


def _layout(t, layout: str, seq_capacity: int | None = None):
    """`t` (B, H, N, d) as the kernel should see it: contiguous, or ("bshd") a view of a (B, N', H, d) buffer
    whose first N rows are t's, N' = seq_capacity (a longer cache) or N: every stride differs from contiguous."""
    if layout == "contiguous":
        return t.contiguous()
    b, h, n, d = t.shape
    buf = torch.full((b, seq_capacity or n, h, d), float("nan"), dtype=t.dtype, device=t.device)
    buf[:, :n] = t.transpose(1, 2)
    return buf.transpose(1, 2)[:, :, :n]


def launch_flash_forward(kernel, q, k, v, *, causal: bool, layout: str = "contiguous",
                         block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The capstone's launch: `kernel` on (B, H, N, d) tensors seen through `layout`; returns (o, lse), lse
    natural-log, shape (B, H, Nq). O is written through its strides; LSE is a contiguous (B, H, Nq) buffer."""
    b, h, nq, d = q.shape
    h_kv, nk = k.shape[1], k.shape[2]
    if h % h_kv:
        raise ValueError(f"q has {h} heads, not a multiple of k's {h_kv}")
    q = _layout(q, layout)
    k, v = (_layout(t, layout, seq_capacity=nk + 7 if layout != "contiguous" else None) for t in (k, v))
    o = _layout(torch.zeros_like(q), layout)
    lse = torch.full((b, h, nq), float("nan"), device=q.device, dtype=torch.float32)
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    counted_launch(kernel, ((nq + block_m - 1) // block_m, b * h), q, k, v, o, lse, *strides, h, nq, nk,
                   LOG2E / math.sqrt(d), GROUP=h // h_kv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                   CAUSAL=causal)
    return o, lse


def check_flash_forward(kernel) -> None:
    """Exercise 5.4, the capstone: the whole FlashAttention-2 forward kernel `flash_forward`, with strides, GQA,
    ragged lengths and the causal mask, on FORWARD_CASES. O and lse are compared with a float64 reference; a
    failure names the case, what it adds, and the wrong (batch, head) rows and Q blocks. Course kernels are
    refused, and the launch must run the kernel passed."""
    learner_kernel(kernel, "flash_forward")
    from utils.tiled.attention import flash_attention
    from utils.tiled.forward import flash_attention_forward

    for number, (b, h, h_kv, nq, nk, d, causal, layout, adds) in enumerate(FORWARD_CASES, 1):
        device, dtype, tol = _setting(kernel)
        q, k, v = (t.to(device, dtype) for t in _qkv(b, h, h_kv, nq, nk, d, True, seed=nq * 1000 + nk))
        with refusing(flash_attention, flash_attention_forward):   # interpreted kernels are Python: no detours
            o, lse = launch_flash_forward(kernel, q, k, v, causal=causal, layout=layout)
        o_ref, lse_ref = reference(q, k, v, causal=causal)
        where = f"case {number} (B={b}, H={h}, H_kv={h_kv}, Nq={nq}, Nk={nk}, d={d}, {layout}" \
                f"{', causal' if causal else ''}), the first to add {adds}"
        try:
            assert_rows_close(o, o_ref, atol=tol, rtol=tol, block_rows=BLOCK_M, name="O")
            assert_rows_close(lse[..., None], lse_ref[..., None], atol=tol, rtol=tol, block_rows=BLOCK_M, name="lse")
        except RefusedAnswer:
            raise
        except AssertionError as err:
            raise AssertionError(f"{where}:\n  {err}") from None
