"""FlashAttention in PyTorch, instrumented (notebooks 03 and 04).

- `flash1_attention`: Algorithm 1 of FlashAttention (Dao et al., 2022, arXiv:2205.14135), with the paper's line
  numbers in the comments: block sizes from an on-chip memory of M elements, outer loop over K/V blocks, inner
  loop over Q blocks, and O, l, m kept in "HBM" tensors that every inner step reads and writes back.
- `flash2_program`: one program `(pid_m, pid_bh)` of the FlashAttention-2 forward (Dao, 2023, arXiv:2307.08691),
  written like a GPU kernel (offsets, masked loads and stores, exp2 with log2(e) folded into the scale) so that
  notebook 05 can translate it line by line into Triton. `flash2_attention` launches the grid
  `cdiv(seqlen_q, BLOCK_M) x (batch * heads)`: program by program, or all programs in lockstep (vectorised).
- `HBMCounter` counts the elements and bytes each algorithm moves between "HBM" (the full tensors) and "SRAM"
  (the blocks), and which score blocks it computes; `flash1_hbm_accesses`, `flash2_hbm_accesses` and
  `standard_hbm_accesses` give the same counts in closed form. `count_ops` counts the arithmetic PyTorch runs.

Course conventions (utils.eager.reference): (batch, heads, seq, head_dim) tensors, K/V heads dividing Q heads (query
head h reads K/V head h // (heads // kv_heads), never copied), causal masks aligned bottom-right, rows that see no
key give 0 (lse = -inf). 16-bit inputs are computed in fp32 (fp64 in fp64) and returned in the input dtype.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from utils.checks import check_attention_inputs, check_bool, positive_int, resolve_scale

LOG2E = 1.4426950408889634   # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453     # ln(2): back from base-2 to natural logs for the lse
# The paper's A100: "192KB of on-chip SRAM per each of 108 streaming multiprocessors" (Dao et al., 2022, §2.1).
SRAM_BYTES = 192 * 1024


# --- "HBM" traffic ------------------------------------------------------------------------------------------

@dataclass
class HBMCounter:
    """What an algorithm moves between HBM (the full tensors) and SRAM (blocks), counted per tensor name.

    reads / writes: elements, by tensor name ("Q", "K", "O", ...), summed over batch and heads (a K/V block that
    g query heads share under GQA counts g times: each of their programs loads it). bytes_read / bytes_written:
    the same in bytes. blocks: {(i, j): how many (batch, head) pairs computed score block S_ij}, in the order
    the blocks were first computed. skipped: score blocks (times batch * heads) never computed (causal masking).
    """
    reads: Counter = field(default_factory=Counter)
    writes: Counter = field(default_factory=Counter)
    bytes_read: int = 0
    bytes_written: int = 0
    blocks: Counter = field(default_factory=Counter)
    skipped: int = 0

    def read(self, name: str, block: torch.Tensor, *, elements: int | None = None, times: int = 1):
        """Count a load of `block` (or of `elements` of it, for a masked load) and return `block`."""
        n = (block.numel() if elements is None else int(elements)) * times
        self.reads[name] += n
        self.bytes_read += n * block.element_size()
        return block

    def write(self, name: str, block: torch.Tensor, *, elements: int | None = None):
        """Count a store of `block` (or of `elements` of it, for a masked store) and return `block`."""
        n = block.numel() if elements is None else int(elements)
        self.writes[name] += n
        self.bytes_written += n * block.element_size()
        return block

    def computed(self, i: int, j: int, times: int = 1) -> None:
        """Record that score block S_ij was computed for `times` (batch, head) pairs."""
        self.blocks[(i, j)] += times

    @property
    def accesses(self) -> int:
        """Elements read plus elements written: the paper's "HBM accesses"."""
        return sum(self.reads.values()) + sum(self.writes.values())

    def summary(self) -> str:
        names = sorted(set(self.reads) | set(self.writes))
        parts = ", ".join(f"{n}: {self.reads[n]:,} read / {self.writes[n]:,} written" for n in names)
        text = f"{self.accesses:,} HBM accesses ({(self.bytes_read + self.bytes_written) / 1e6:.3f} MB) — {parts}"
        if self.blocks or self.skipped:
            text += f"; {sum(self.blocks.values()):,} score blocks computed, {self.skipped:,} skipped"
        return text


# --- validation and small helpers -----------------------------------------------------------------------------



def _check_counter(counter):
    if counter is not None and not isinstance(counter, HBMCounter):
        raise TypeError(f"counter must be an HBMCounter or None, got {type(counter).__name__}")
    return counter if counter is not None else HBMCounter()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit and fp32 inputs (what tensor cores accumulate in), fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dot(a, b, acc_dtype):
    """A matmul like tl.dot: operands in their own dtype, products summed in the accumulator dtype."""
    return a.to(acc_dtype) @ b.to(acc_dtype)


def _no_inf(m):
    """m with -inf replaced by 0: a row that has seen no key keeps m = -inf, and exp(-inf - -inf) would be NaN."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def block_is_visible(rows: range, cols: range, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether any query of `rows` sees any key of `cols` under the bottom-right causal mask (j <= i + Nk - Nq).

    The last query of the block sees the most keys, so the block is visible iff its first key is visible to it.
    """
    return len(rows) > 0 and len(cols) > 0 and cols[0] <= rows[-1] + seqlen_k - seqlen_q


# --- FlashAttention (Algorithm 1) -----------------------------------------------------------------------------

def flash1_block_sizes(M: int, d: int) -> tuple[int, int]:
    """Algorithm 1, line 1: (B_r, B_c) = (min(ceil(M / 4d), d), ceil(M / 4d)) for an SRAM of M elements.

    B_c = ceil(M/4d) lets the four B x d blocks Q_i, K_j, V_j, O_i fit in M; B_r <= d keeps the B_r x B_c score
    block S_ij no larger than M/4 as well.
    """
    M, d = positive_int("M", M), positive_int("d", d)
    B_c = _cdiv(M, 4 * d)
    return min(B_c, d), B_c


def flash1_attention(q, k, v, *, causal=False, sm_scale=None, sram_bytes=SRAM_BYTES, counter=None):
    """Exact attention by Algorithm 1 of FlashAttention, run on all (batch, head) pairs at once.

    sram_bytes: the on-chip memory; M = sram_bytes // q.element_size() elements sets the block sizes.
    counter: an HBMCounter to record the traffic (O, l and m live in fp32 "HBM" tensors, as the fp32 buffer of
    the original CUDA code; the final cast to q's dtype is outside Algorithm 1 and not counted).
    causal: S_ij is masked (bottom-right), and blocks that are masked entirely are skipped (as in the paper's
    block-sparse variant, Algorithm 5), so their Q_i, O_i, l_i, m_i are not loaded either.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    sram_bytes = positive_int("sram_bytes", sram_bytes)
    hbm = _check_counter(counter)
    b, h, h_kv, n_q, n_k, d = shape
    g = h // h_kv
    acc = accumulator_dtype(q.dtype)
    Q = q.unflatten(1, (h_kv, g))             # (b, h_kv, g, n_q, d): a view; the g query heads of a group
    K, V = k.unsqueeze(2), v.unsqueeze(2)     # (b, h_kv, 1, n_k, d): broadcast over the group, never copied
    M = max(1, sram_bytes // q.element_size())

    # 1: block sizes from the on-chip memory
    B_r, B_c = flash1_block_sizes(M, d)
    # 2: O = 0, l = 0, m = -inf, in HBM
    O = hbm.write("O", torch.zeros(b, h_kv, g, n_q, d, dtype=acc, device=q.device))
    l = hbm.write("l", torch.zeros(b, h_kv, g, n_q, dtype=acc, device=q.device))
    m = hbm.write("m", torch.full((b, h_kv, g, n_q), float("-inf"), dtype=acc, device=q.device))
    # 3-4: T_r blocks of B_r rows of Q (and of O, l, m), T_c blocks of B_c rows of K and V (the last may be short)
    T_r, T_c = _cdiv(n_q, B_r), _cdiv(n_k, B_c)
    rows = [range(i * B_r, min((i + 1) * B_r, n_q)) for i in range(T_r)]
    cols = [range(j * B_c, min((j + 1) * B_c, n_k)) for j in range(T_c)]

    for j in range(T_c):                                                     # 5
        c = slice(cols[j].start, cols[j].stop)
        K_j = hbm.read("K", K[..., c, :], times=g)                           # 6
        V_j = hbm.read("V", V[..., c, :], times=g)
        for i in range(T_r):                                                 # 7
            if causal and not block_is_visible(rows[i], cols[j], n_q, n_k):
                hbm.skipped += b * h
                continue
            hbm.computed(i, j, b * h)
            r = slice(rows[i].start, rows[i].stop)
            Q_i = hbm.read("Q", Q[..., r, :])                                # 8
            O_i, l_i, m_i = hbm.read("O", O[..., r, :]), hbm.read("l", l[..., r]), hbm.read("m", m[..., r])
            S_ij = scale * _dot(Q_i, K_j.transpose(-1, -2), acc)             # 9 (scale as in Algorithm 2)
            if causal:
                i_idx = torch.arange(r.start, r.stop, device=q.device)[:, None]
                j_idx = torch.arange(c.start, c.stop, device=q.device)[None, :]
                S_ij = S_ij.masked_fill(j_idx > i_idx + (n_k - n_q), float("-inf"))
            m_tilde = S_ij.amax(-1)                                          # 10
            P_tilde = torch.exp(S_ij - _no_inf(m_tilde)[..., None])
            l_tilde = P_tilde.sum(-1)
            m_new = torch.maximum(m_i, m_tilde)                              # 11
            alpha = torch.exp(m_i - _no_inf(m_new))      # e^{m_i - m_new}: rescales what O_i, l_i hold so far
            beta = torch.exp(m_tilde - _no_inf(m_new))   # e^{m~_ij - m_new}: rescales this block's terms
            l_new = alpha * l_i + beta * l_tilde
            PV = _dot(P_tilde.to(q.dtype), V_j, acc)     # P~ rounded to the input dtype, as the GPU's matmul takes it
            O_new = ((l_i * alpha)[..., None] * O_i + beta[..., None] * PV) \
                / torch.where(l_new == 0, 1.0, l_new)[..., None]             # 12 (a row with no key yet stays 0)
            O[..., r, :] = hbm.write("O", O_new)
            l[..., r] = hbm.write("l", l_new)                                # 13
            m[..., r] = hbm.write("m", m_new)
    return O.flatten(1, 2).to(q.dtype)                                       # 16


def flash1_hbm_accesses(seqlen_q: int, seqlen_k: int, d: int, M: int, *, causal: bool = False) -> int:
    """HBM accesses (elements) of Algorithm 1 for one (batch, query head), as `flash1_attention` counts them.

    2·Nk·d to read K and V once, Nq·(d+2) to initialise O, l, m, then for every score block computed, B_r·(2d+2)
    to read Q_i, O_i, l_i, m_i and B_r·(d+2) to write O_i, l_i, m_i back. Without masking that is
    2·Nk·d + Nq·(d+2) + T_c·Nq·(3d+4), T_c = ceil(Nk/B_c) ≈ 4·Nk·d/M: Θ(N²d²/M) (Theorem 2).
    """
    n_q, n_k = positive_int("seqlen_q", seqlen_q), positive_int("seqlen_k", seqlen_k)
    d, M = positive_int("d", d), positive_int("M", M)
    check_bool("causal", causal)
    B_r, B_c = flash1_block_sizes(M, d)
    T_c = _cdiv(n_k, B_c)
    if not causal:
        return 2 * n_k * d + n_q * (d + 2) + T_c * n_q * (3 * d + 4)
    rows = [range(i, min(i + B_r, n_q)) for i in range(0, n_q, B_r)]
    cols = [range(j, min(j + B_c, n_k)) for j in range(0, n_k, B_c)]
    visited_rows = sum(len(r) for r in rows for c in cols if block_is_visible(r, c, n_q, n_k))
    return 2 * n_k * d + n_q * (d + 2) + visited_rows * (3 * d + 4)


def standard_hbm_accesses(seqlen_q: int, seqlen_k: int, d: int) -> int:
    """HBM accesses (elements) of standard attention (the paper's Algorithm 0) for one (batch, head).

    Read Q, K (Nq·d + Nk·d); write S and read it back (2·Nq·Nk); write P and read it back (2·Nq·Nk); read V
    (Nk·d); write O (Nq·d). Θ(Nd + N²).
    """
    n_q, n_k = positive_int("seqlen_q", seqlen_q), positive_int("seqlen_k", seqlen_k)
    d = positive_int("d", d)
    return 4 * n_q * n_k + 2 * n_q * d + 2 * n_k * d


# --- FlashAttention-2: one program of the kernel ---------------------------------------------------------------

def _load_rows(ptr, offs, limit, counter, name):
    """tl.load(ptr + offs[:, None] * stride + offs_d[None, :], mask=offs[:, None] < limit, other=0):
    the rows `offs` of the (rows, cols) matrix `ptr`, zeros where a row is past `limit`."""
    mask = offs < limit
    block = torch.where(mask[:, None], ptr[offs.clamp(max=limit - 1)], ptr.new_zeros(()))
    return counter.read(name, block, elements=int(mask.sum()) * ptr.shape[1])


def _store_rows(ptr, offs, limit, value, counter, name):
    """tl.store(ptr + offs, value, mask=offs < limit) for rows of a matrix (or entries of a vector)."""
    mask = offs < limit
    ptr[offs[mask]] = value[mask].to(ptr.dtype)
    counter.write(name, ptr, elements=int(mask.sum()) * (ptr.shape[1] if ptr.dim() == 2 else 1))


def flash2_kv_end(pid_m: int, BLOCK_M: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """How many keys program pid_m must look at: all of them, or, when causal, up to the last key its last query
    sees (query i sees keys j <= i + seqlen_k - seqlen_q). 0 or less: the block sees no key at all."""
    if not causal:
        return seqlen_k
    return min(seqlen_k, (pid_m + 1) * BLOCK_M + seqlen_k - seqlen_q)


def flash2_program(pid_m, pid_bh, Q, K, V, O, LSE, *, sm_scale, causal, BLOCK_M, BLOCK_N, counter=None):
    """One program of the FlashAttention-2 forward: BLOCK_M queries of one (batch, head) against their keys.

    Grid: (cdiv(seqlen_q, BLOCK_M), batch * heads). Q, O: (batch, heads, seqlen_q, head_dim); K, V: (batch,
    kv_heads, seqlen_k, head_dim); LSE: (batch, heads, seqlen_q), fp32 (fp64 for fp64 inputs). The program
    writes its rows of O (in O's dtype) and of LSE (natural log, -inf for a query that sees no key).
    """
    batch, heads, seqlen_q, head_dim = Q.shape
    kv_heads, seqlen_k = K.shape[1], K.shape[2]
    BLOCK_M, BLOCK_N = positive_int("BLOCK_M", BLOCK_M), positive_int("BLOCK_N", BLOCK_N)
    if not (0 <= pid_m < _cdiv(seqlen_q, BLOCK_M) and 0 <= pid_bh < batch * heads):
        raise ValueError(f"program ({pid_m}, {pid_bh}) is outside the grid "
                         f"({_cdiv(seqlen_q, BLOCK_M)}, {batch * heads})")
    counter = _check_counter(counter)
    acc_dtype = LSE.dtype

    # Which (batch, head) this program serves. GQA: query head h reads K/V head h // group, in place.
    group = heads // kv_heads
    b, h = pid_bh // heads, pid_bh % heads
    h_kv = h // group
    q_ptr, k_ptr, v_ptr = Q[b, h], K[b, h_kv], V[b, h_kv]      # in Triton: a base pointer plus strides
    o_ptr, lse_ptr = O[b, h], LSE[b, h]

    qk_scale = sm_scale * LOG2E            # fold log2(e) into the scale: exp(s) = exp2(s * log2(e))
    start_m = pid_m * BLOCK_M
    offs_m = start_m + torch.arange(BLOCK_M, device=Q.device)
    offs_n = torch.arange(BLOCK_N, device=Q.device)
    q = _load_rows(q_ptr, offs_m, seqlen_q, counter, "Q")     # loaded once, stays in SRAM for the whole loop

    m_i = torch.full((BLOCK_M,), float("-inf"), dtype=acc_dtype, device=Q.device)  # running max, base 2
    l_i = torch.zeros(BLOCK_M, dtype=acc_dtype, device=Q.device)   # running sum of exp2, NOT yet divided
    acc = torch.zeros(BLOCK_M, head_dim, dtype=acc_dtype, device=Q.device)  # unnormalised output

    causal_offset = seqlen_k - seqlen_q    # bottom-right alignment: query i sees keys j <= i + causal_offset
    n_end = flash2_kv_end(pid_m, BLOCK_M, seqlen_q, seqlen_k, causal)  # blocks past it: skipped, not masked
    n_blocks = 0
    for start_n in range(0, n_end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_ptr, cols, seqlen_k, counter, "K")
        v = _load_rows(v_ptr, cols, seqlen_k, counter, "V")
        qk = _dot(q, k.T, acc_dtype)                                # (BLOCK_M, BLOCK_N) raw scores
        keep = cols[None, :] < seqlen_k                             # the ragged last block
        if causal:
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
        qk = torch.where(keep, qk, float("-inf"))
        m_ij = torch.maximum(m_i, qk.amax(1) * qk_scale)            # new running max
        m_sub = _no_inf(m_ij)                                       # a row with no key yet: subtract 0, not -inf
        p = torch.exp2(qk * qk_scale - m_sub[:, None])              # unnormalised probabilities
        alpha = torch.exp2(m_i - m_sub)                             # rescales what came before
        l_i = l_i * alpha + p.sum(1)
        acc = acc * alpha[:, None] + _dot(p.to(V.dtype), v, acc_dtype)   # no division here: delayed to the end
        m_i = m_ij
        counter.computed(pid_m, start_n // BLOCK_N)
        n_blocks += 1
    counter.skipped += _cdiv(seqlen_k, BLOCK_N) - n_blocks

    # Epilogue: one division per row. Rows that saw no key have l_i = 0: output 0 and lse = -inf, never 0/0.
    seen = l_i > 0
    acc = acc / torch.where(seen, l_i, 1.0)[:, None]
    lse = torch.where(seen, (m_i + torch.log2(torch.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    _store_rows(lse_ptr, offs_m, seqlen_q, lse, counter, "LSE")
    _store_rows(o_ptr, offs_m, seqlen_q, acc, counter, "O")


def _flash2_lockstep(q, k, v, o, lse, *, scale, causal, block_m, block_n, counter):
    """Every program of the grid at once: step t of the loop advances each program that is still running by its
    t-th key block. Same arithmetic as `flash2_program`, vectorised over (batch, head, pid_m)."""
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    acc_dtype, bh = lse.dtype, batch * heads
    T_m = _cdiv(seqlen_q, block_m)
    qk_scale = scale * LOG2E
    # (b, h_kv, group, pid_m, BLOCK_M, head_dim): the Q block of every program, zero-padded like a masked load
    q_blocks = F.pad(q, (0, 0, 0, T_m * block_m - seqlen_q)).unflatten(2, (T_m, block_m)).unflatten(1, (kv_heads, group))
    counter.read("Q", q)
    offs_m = torch.arange(T_m * block_m, device=q.device).view(T_m, block_m)
    n_end = [flash2_kv_end(p, block_m, seqlen_q, seqlen_k, causal) for p in range(T_m)]
    m_i = torch.full(q_blocks.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros(q_blocks.shape, dtype=acc_dtype, device=q.device)
    causal_offset = seqlen_k - seqlen_q
    computed = 0
    for start_n in range(0, max(n_end), block_n):
        first = next(p for p in range(T_m) if n_end[p] > start_n)   # n_end grows with pid_m: a suffix runs
        run = slice(first, T_m)
        cols = torch.arange(start_n, min(start_n + block_n, seqlen_k), device=q.device)  # a short last block
        k_blk = counter.read("K", k[:, :, start_n:start_n + block_n], times=group * (T_m - first))
        v_blk = counter.read("V", v[:, :, start_n:start_n + block_n], times=group * (T_m - first))
        k_blk, v_blk = k_blk[:, :, None, None], v_blk[:, :, None, None]   # broadcast over group and pid_m
        qk = _dot(q_blocks[:, :, :, run], k_blk.transpose(-1, -2), acc_dtype)
        if causal:
            keep = cols[None, None, :] <= offs_m[run, :, None] + causal_offset
            qk = torch.where(keep, qk, float("-inf"))
        m_ij = torch.maximum(m_i[..., run, :], qk.amax(-1) * qk_scale)
        m_sub = _no_inf(m_ij)
        p = torch.exp2(qk * qk_scale - m_sub[..., None])
        alpha = torch.exp2(m_i[..., run, :] - m_sub)
        l_i[..., run, :] = l_i[..., run, :] * alpha + p.sum(-1)
        acc[..., run, :, :] = acc[..., run, :, :] * alpha[..., None] + _dot(p.to(v.dtype), v_blk, acc_dtype)
        m_i[..., run, :] = m_ij
        for p_m in range(first, T_m):
            counter.computed(p_m, start_n // block_n, bh)
        computed += T_m - first
    counter.skipped += bh * (T_m * _cdiv(seqlen_k, block_n) - computed)

    seen = l_i > 0
    out = acc / torch.where(seen, l_i, 1.0)[..., None]
    lse_blocks = torch.where(seen, (m_i + torch.log2(torch.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    o.copy_(out.flatten(3, 4)[..., :seqlen_q, :].flatten(1, 2))
    lse.copy_(lse_blocks.flatten(3, 4)[..., :seqlen_q].flatten(1, 2))
    counter.write("LSE", lse)
    counter.write("O", o)


def flash2_attention(q, k, v, *, causal=False, sm_scale=None, block_m=64, block_n=64, return_lse=False,
                     counter=None, per_program=False):
    """Exact attention in the FlashAttention-2 order: each Q block runs to completion in its own program.

    Runs the grid (cdiv(seqlen_q, block_m), batch * heads) of `flash2_program`: one program after the other
    (per_program=True, slow, the kernel's own shape) or all programs in lockstep (default, vectorised).
    Returns O in q's dtype, and with return_lse=True also the natural-log log-sum-exp of each query's scaled
    scores, (batch, heads, seqlen_q), fp32 (fp64 for fp64 inputs), -inf for a query that sees no key.
    counter: an HBMCounter to record traffic and which blocks were computed or skipped.
    """
    shape = check_attention_inputs(q, k, v, causal=causal)
    scale = resolve_scale(sm_scale, shape.head_dim)
    block_m, block_n = positive_int("block_m", block_m), positive_int("block_n", block_n)
    check_bool("return_lse", return_lse)
    check_bool("per_program", per_program)
    counter = _check_counter(counter)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=accumulator_dtype(q.dtype), device=q.device)
    if per_program:
        grid = (_cdiv(shape.seqlen_q, block_m), shape.batch * shape.heads)
        for pid_bh in range(grid[1]):
            for pid_m in range(grid[0]):
                flash2_program(pid_m, pid_bh, q, k, v, o, lse, sm_scale=scale, causal=causal,
                               BLOCK_M=block_m, BLOCK_N=block_n, counter=counter)
    else:
        _flash2_lockstep(q, k, v, o, lse, scale=scale, causal=causal, block_m=block_m, block_n=block_n,
                         counter=counter)
    return (o, lse) if return_lse else o


def flash2_hbm_accesses(seqlen_q: int, seqlen_k: int, d: int, block_m: int, block_n: int, *,
                        causal: bool = False) -> int:
    """HBM accesses (elements) of the FlashAttention-2 forward for one (batch, query head).

    Q read once (Nq·d), O and LSE written once (Nq·d + Nq); each program reads the K and V rows of the key blocks
    it visits (2·d per key; masked-off rows past the end are not read). Without masking: Nq·d·2 + Nq +
    T_m·2·Nk·d, T_m = ceil(Nq/block_m): Θ(N²d/block_m).
    """
    n_q, n_k = positive_int("seqlen_q", seqlen_q), positive_int("seqlen_k", seqlen_k)
    d = positive_int("d", d)
    block_m, block_n = positive_int("block_m", block_m), positive_int("block_n", block_n)
    check_bool("causal", causal)
    keys = 0
    for pid_m in range(_cdiv(n_q, block_m)):
        n_end = flash2_kv_end(pid_m, block_m, n_q, n_k, causal)
        keys += min(n_k, _cdiv(n_end, block_n) * block_n) if n_end > 0 else 0
    return 2 * n_q * d + n_q + 2 * d * keys


# --- counting arithmetic --------------------------------------------------------------------------------------

_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "exp", "exp2", "log", "log2", "maximum", "minimum", "neg",
                "reciprocal"}
_REDUCTIONS = {"amax", "amin", "sum", "max", "min"}
_MATMULS = {"mm", "bmm"}


@dataclass
class OpCounts:
    """What `count_ops` saw: matmul FLOPs (2·m·n·k per product) and non-matmul arithmetic by operation, one FLOP
    per element (per input element for reductions). Copies, casts, comparisons and selects are not counted."""
    matmul_flops: int = 0
    non_matmul: Counter = field(default_factory=Counter)

    @property
    def non_matmul_flops(self) -> int:
        return sum(self.non_matmul.values())


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
            return out  # index arithmetic and comparisons are not FLOPs
        if name in _MATMULS:
            self.counts.matmul_flops += 2 * out.numel() * args[0].shape[-1]
        elif name in _ELEMENTWISE:
            self.counts.non_matmul[name] += out.numel()
        elif name in _REDUCTIONS and isinstance(args[0], torch.Tensor):
            self.counts.non_matmul[name] += args[0].numel()
        return out


def count_ops(fn, *args, **kwargs):
    """Run `fn(*args, **kwargs)` and count the arithmetic PyTorch executes: returns (result, OpCounts)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    counts = OpCounts()
    with _OpCounter(counts):
        result = fn(*args, **kwargs)
    return result, counts
