"""The Triton kernels of notebook 10: FlashAttention-2 forward and backward with a score modifier, a mask
modifier and block sparsity, and the same kernels over packed sequences (cu_seqlens).

They are notebook 05's and 07's kernels with three changes:
1. the key tiles a program visits come from a block mask's lists (full tiles, then partial ones) instead of a
   range, so empty tiles cost nothing and full tiles never evaluate the mask;
2. scores pass through SCORE_MOD (and, in the backward, its derivative SCORE_GRAD) and partial tiles through
   MASK_MOD, Triton functions given as constexpr arguments (utils.flex.mods);
3. with VARLEN, each batch entry is one sequence of a packed tensor, found through cu_seqlens; the key range
   then comes from causality, as in notebook 05.
When every tile is whole (EVEN: lengths multiples of the block mask's tiles, utils.flex.attention._even), the
inner loops load without masks: each mask costs registers there, and the backward at D=128 spilled for them.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): exp(x) = exp2(x * log2(e))


@triton.jit
def _mod_pos(pos, seqlen_k):
    """A position as the modifiers get it: at most the last key's. Ragged tiles hold rows past the last query and
    keys past the last key, whose scores are never stored or are masked; clamped, they never lead a modifier
    that indexes a per-position table (document ids) past its end."""
    return tl.minimum(pos, seqlen_k - 1)


@triton.jit
def _scores(qk, b, h, q_pos, kv_pos, seqlen_k, sm_scale, qk_scale, args,
            SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Scores in base 2 (exp2 of them is the softmax's exp), modified and, on partial tiles, masked; and the
    scaled scores given to SCORE_MOD (the backward differentiates the modifier there). q_pos (M, 1) and
    kv_pos (1, N) are positions in the key sequence, clamped to it for the modifiers (_mod_pos)."""
    raw = qk * sm_scale
    if SCORE_MOD is not None:
        s = SCORE_MOD(raw, b, h, _mod_pos(q_pos, seqlen_k), _mod_pos(kv_pos, seqlen_k), args) * LOG2E
    else:
        s = qk * qk_scale
    if MASKED:
        keep = kv_pos < seqlen_k
        if CAUSAL:
            keep = keep & (kv_pos <= q_pos)
        if MASK_MOD is not None:
            keep = keep & MASK_MOD(b, h, _mod_pos(q_pos, seqlen_k), _mod_pos(kv_pos, seqlen_k), args)
        s = tl.where(keep, s, float("-inf"))
    return s, raw


@triton.jit
def _load(ptrs, rows_ok, d_ok, other, CHECK_ROWS: tl.constexpr, CHECK_D: tl.constexpr):
    """tl.load masked only where a mask can be false (rows past the end, columns past the head dim): in the inner
    loops every mask costs registers and instructions (the fastest flex kernels drop them the same way)."""
    if CHECK_ROWS and CHECK_D:
        x = tl.load(ptrs, mask=rows_ok & d_ok, other=other)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=rows_ok, other=other)
    elif CHECK_D:
        x = tl.load(ptrs, mask=d_ok, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, q_pos, offs_n, offs_d, b, h, seqlen_k,
              stride_kn, stride_vn, sm_scale, qk_scale, args,
              SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """The online softmax of one key tile (notebook 05's loop body). k_ptrs, v_ptrs point at the first tile:
    moving them by start_n rows is one add per element, where rebuilding them costs several."""
    cols = start_n + offs_n
    rows_ok, d_ok = cols[:, None] < seqlen_k, offs_d[None, :] < HEAD_DIM     # full tiles hold no key past the end
    k = _load(k_ptrs + start_n * stride_kn, rows_ok, d_ok, 0.0, MASKED and not EVEN, HEAD_DIM != BLOCK_D)
    v = _load(v_ptrs + start_n * stride_vn, rows_ok, d_ok, 0.0, MASKED and not EVEN, HEAD_DIM != BLOCK_D)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s, _ = _scores(qk, b, h, q_pos[:, None], cols[None, :], seqlen_k, sm_scale, qk_scale, args,
                   SCORE_MOD, MASK_MOD, MASKED, CAUSAL)
    m_ij = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)      # a row that has seen no key: avoid -inf - -inf
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_ij


@triton.jit
def _sequence(CU, b, seqlen):
    """(start, length) of batch entry b: from cu_seqlens when CU is given, else (0, seqlen)."""
    if CU is not None:
        start = tl.load(CU + b)
        return start, tl.load(CU + b + 1) - start
    return b * 0, seqlen + b * 0     # tensors (b * 0: a zero of b's type), like the branch above


@triton.jit
def _offset(b, h, row, s_b, s_h, s_row):
    """Elements from a tensor's start to row `row` of (batch b, head h), in int64: big tensors pass 2**31."""
    return b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + row.to(tl.int64) * s_row


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed sequences (no block mask): keys [0, n_full) every query of the tile sees, [n_full, n_end) those
    that need the causal mask or are the ragged end (notebook 05's split)."""
    if CAUSAL:
        n_full = tl.maximum(start_m + seqlen_k - seqlen_q + 1, 0) // BLOCK_N * BLOCK_N
        n_end = tl.minimum(tl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0), seqlen_k)
        return n_full, n_end
    return seqlen_k // BLOCK_N * BLOCK_N, seqlen_k


@triton.jit
def _tile_start(index, it, first, SUB: tl.constexpr, SPARSE: tl.constexpr, BLOCK: tl.constexpr):
    """First row of a pass's it-th tile: from a block-mask list (SUB kernel tiles per listed tile of SPARSE
    rows), or, without one (index None), the range from `first` in steps of BLOCK."""
    if index is not None:
        return tl.load(index + it // SUB) * SPARSE + (it % SUB) * BLOCK
    return first + it * BLOCK


@triton.jit(do_not_specialize=["heads", "mask_sb", "mask_sh", "mod_i"])
def flex_fwd_kernel(Q, K, V, O, LSE, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                    s_ob, s_oh, s_om, s_od, heads, seqlen_q, seqlen_k, sm_scale, qk_scale, lse_sb, lse_sh,
                    KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, mask_sb, mask_sh, n_q_tiles, n_kv_tiles,
                    CU_Q, CU_K, MOD_T, mod_i, mod_f,
                    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, CAUSAL: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head). Grid (cdiv(max Nq, BLOCK_M), batch * heads).
    With a block mask (KV_COUNT given) it visits the tiles of its row's lists; with CU_Q/CU_K (packed
    sequences) the causal range of its own sequence."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    q_start, seqlen_q = _sequence(CU_Q, b, seqlen_q)
    k_start, seqlen_k = _sequence(CU_K, b, seqlen_k)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:      # packed sequences: this one is shorter than the longest
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = offs_m + (seqlen_k - seqlen_q)          # bottom-right: the query's position among the keys
    args = (MOD_T, mod_i, mod_f)
    q_base = Q + _offset(b, h, q_start, s_qb, s_qh, s_qm)
    k_base = K + _offset(b, h // GROUP, k_start, s_kb, s_kh, s_kn)
    v_base = V + _offset(b, h // GROUP, k_start, s_vb, s_vh, s_vn)
    k_ptrs = k_base + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd
    v_ptrs = v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
    io_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd, mask=io_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Two passes over the key tiles: the full ones (no mask evaluated), then the partial ones; from the block
    # mask's lists for this program's row of tiles, or, for packed sequences, from causality.
    SUB: tl.constexpr = SPARSE_N // BLOCK_N                                # kernel tiles per block-mask tile
    row = (b * mask_sb + h * mask_sh + start_m // SPARSE_M).to(tl.int64)
    n_full, n_end = _key_range(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    for partial in tl.static_range(2):
        if KV_COUNT is not None:
            index = (KV_INDEX if partial else FULL_INDEX) + row * n_kv_tiles
            n_tiles = tl.load((KV_COUNT if partial else FULL_COUNT) + row) * SUB
        else:
            index = KV_INDEX                                               # None: a range
            n_tiles = ((n_end - n_full + BLOCK_N - 1) if partial else n_full) // BLOCK_N   # n_full: whole tiles
        for it in range(0, n_tiles):
            start_n = _tile_start(index, it, n_full if partial else 0, SUB, SPARSE_N, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, q_pos, offs_n, offs_d, b, h,
                                      seqlen_k, s_kn, s_vn, sm_scale, qk_scale, args,
                                      SCORE_MOD, MASK_MOD, partial == 1, CAUSAL, HEAD_DIM, BLOCK_D, PRECISION, EVEN)

    seen = l_i > 0.0             # a query that sees no key: output 0, lse -inf
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    lse_row = LSE + _offset(b, h, q_start, lse_sb, lse_sh, 1)
    tl.store(lse_row + offs_m, lse, mask=offs_m < seqlen_q)
    o_base = O + _offset(b, h, q_start, s_ob, s_oh, s_om)
    tl.store(o_base + offs_m[:, None] * s_om + offs_d[None, :] * s_od, acc.to(O.dtype.element_ty), mask=io_mask)


# --- backward (notebook 07's three passes; the preprocessing pass is utils.tiled.fast.backward's) -------------------

@triton.jit
def _dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, lse2_row, delta_row, m0, kv_pos, offs_d, b, h, seqlen_q, seqlen_k,
               s_qm, s_dom, sm_scale, qk_scale, args,
               SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """dK, dV of one key tile from one query tile, transposed (keys x queries) so Pᵀ and dSᵀ come out of the
    dots directly."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seqlen_q                                               # query tiles may be ragged
    CHECK_D: tl.constexpr = HEAD_DIM != BLOCK_D
    q_t = _load(q_ptrs + m0 * s_qm, mask_m[None, :], offs_d[:, None] < HEAD_DIM, 0.0, not EVEN, CHECK_D)  # (D, M)
    lse2 = _load(lse2_row + offs_m, mask_m, mask_m, float("inf"), not EVEN, False)   # rows past the end: P = 0
    q_pos = offs_m + (seqlen_k - seqlen_q)
    s_t, raw_t = _scores(tl.dot(k, q_t, input_precision=PRECISION), b, h, q_pos[None, :], kv_pos[:, None],
                         seqlen_k, sm_scale, qk_scale, args, SCORE_MOD, MASK_MOD, MASKED, CAUSAL)
    p_t = tl.math.exp2(s_t - lse2[None, :])                                  # (N, M)
    do = _load(do_ptrs + m0 * s_dom, mask_m[:, None], offs_d[None, :] < HEAD_DIM, 0.0, not EVEN, CHECK_D)  # (M, D)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)            # dV += Pᵀ dO
    delta = _load(delta_row + offs_m, mask_m, mask_m, 0.0, not EVEN, False)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                # dPᵀ = V dOᵀ
    ds_t = p_t * (dp_t - delta[None, :])                                     # dSᵀ = Pᵀ ∘ (dPᵀ − D)
    if SCORE_GRAD is not None:                                               # chain rule through score_mod
        ds_t = ds_t * SCORE_GRAD(raw_t, b, h, _mod_pos(q_pos, seqlen_k)[None, :], _mod_pos(kv_pos, seqlen_k)[:, None],
                                 args)
    dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=PRECISION)   # dK += dSᵀ Q
    return dk, dv


@triton.jit
def _query_range(n0, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packed sequences (no block mask): query tiles from `start` see keys n0.. of this tile; those before
    `split` cross the diagonal (causal), the rest see every key of the tile."""
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        start = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M
        masked = tl.maximum(n0 + BLOCK_N - 1 - offset - start + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
        return start, tl.minimum(start + masked, seqlen_q)
    return n0 * 0, n0 * 0


@triton.jit
def _dkdv_program(pid_n, b, hk, Q, K, V, DO, LSE2, DELTA, DK, DV, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                  s_vb, s_vh, s_vn, s_vd, s_dob, s_doh, s_dom, s_dod, s_dkb, s_dkh, s_dkn, s_dkd,
                  s_dvb, s_dvh, s_dvn, s_dvd, seqlen_q, seqlen_k, sm_scale, qk_scale, lse_sb, lse_sh,
                  Q_COUNT, Q_INDEX, FULL_COUNT, FULL_INDEX, mask_sb, mask_sh, n_q_tiles, CU_Q, CU_K, MOD_T, mod_i, mod_f,
                  SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                  CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr,
                  SPARSE_N: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """BLOCK_N keys of one (batch, K/V head), kept on chip with their dK, dV, against the query tiles of every
    query head of its group that see them (the column lists of the block mask)."""
    q_start, seqlen_q = _sequence(CU_Q, b, seqlen_q)
    k_start, seqlen_k = _sequence(CU_K, b, seqlen_k)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    kv_pos = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    args = (MOD_T, mod_i, mod_f)
    kv_mask = (kv_pos[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    k_off = _offset(b, hk, k_start, s_kb, s_kh, s_kn)
    v_off = _offset(b, hk, k_start, s_vb, s_vh, s_vn)
    k = tl.load(K + k_off + kv_pos[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + v_off + kv_pos[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(GROUP):   # the query heads sharing this K/V head: their gradients add up here
        h = hk * GROUP + g
        q_base = Q + _offset(b, h, q_start, s_qb, s_qh, s_qm)
        do_base = DO + _offset(b, h, q_start, s_dob, s_doh, s_dom)
        q_ptrs = q_base + offs_m0[None, :] * s_qm + offs_d[:, None] * s_qd    # Qᵀ's first tile
        do_ptrs = do_base + offs_m0[:, None] * s_dom + offs_d[None, :] * s_dod
        row_off = _offset(b, h, q_start, lse_sb, lse_sh, 1)
        lse2_row = LSE2 + row_off
        delta_row = DELTA + row_off
        # Two passes over the query tiles that see these keys: full tiles, then partial ones; from the block
        # mask's lists for this program's column of tiles, or, for packed sequences, from causality: tiles
        # [start, split) cross the diagonal. (Keys past the end need no mask here: they only touch their own
        # rows of dK, dV, never stored.)
        SUB: tl.constexpr = SPARSE_M // BLOCK_M
        col = (b * mask_sb + h * mask_sh + n0 // SPARSE_N).to(tl.int64)
        start, split = _query_range(n0, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
        for partial in tl.static_range(2):
            if Q_COUNT is not None:
                index = (Q_INDEX if partial else FULL_INDEX) + col * n_q_tiles
                n_tiles = tl.load((Q_COUNT if partial else FULL_COUNT) + col) * SUB
            else:
                index = Q_INDEX                                            # None: a range
                n_tiles = ((split - start if partial else seqlen_q - split) + BLOCK_M - 1) // BLOCK_M
            for it in range(0, n_tiles):
                m0 = _tile_start(index, it, start if partial else split, SUB, SPARSE_M, BLOCK_M)
                dk, dv = _dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, lse2_row, delta_row, m0, kv_pos, offs_d, b, h,
                                    seqlen_q, seqlen_k, s_qm, s_dom, sm_scale, qk_scale, args, SCORE_MOD,
                                    SCORE_GRAD, MASK_MOD, partial == 1, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION,
                                    EVEN)
    dk *= sm_scale
    dk_off = _offset(b, hk, k_start, s_dkb, s_dkh, s_dkn)
    dv_off = _offset(b, hk, k_start, s_dvb, s_dvh, s_dvn)
    tl.store(DK + dk_off + kv_pos[:, None] * s_dkn + offs_d[None, :] * s_dkd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + dv_off + kv_pos[:, None] * s_dvn + offs_d[None, :] * s_dvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, q_pos, offs_n, offs_d, b, h, seqlen_k,
             s_kn, s_vn, sm_scale, qk_scale, args,
             SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
             EVEN: tl.constexpr):
    """dQ of one query tile from one key tile."""
    kv_pos = start_n + offs_n
    rows_ok, d_ok = kv_pos[None, :] < seqlen_k, offs_d[:, None] < HEAD_DIM    # as the forward's
    k_t = _load(k_ptrs + start_n * s_kn, rows_ok, d_ok, 0.0, MASKED and not EVEN, HEAD_DIM != BLOCK_D)   # (D, N)
    v_t = _load(v_ptrs + start_n * s_vn, rows_ok, d_ok, 0.0, MASKED and not EVEN, HEAD_DIM != BLOCK_D)
    s, raw = _scores(tl.dot(q, k_t, input_precision=PRECISION), b, h, q_pos[:, None], kv_pos[None, :], seqlen_k,
                     sm_scale, qk_scale, args, SCORE_MOD, MASK_MOD, MASKED, CAUSAL)
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, v_t, input_precision=PRECISION)                          # dP = dO Vᵀ
    ds = p * (dp - delta[:, None])                                           # dS = P ∘ (dP − D)
    if SCORE_GRAD is not None:
        ds = ds * SCORE_GRAD(raw, b, h, _mod_pos(q_pos, seqlen_k)[:, None], _mod_pos(kv_pos, seqlen_k)[None, :], args)
    return dq + tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)   # dQ += dS K


@triton.jit
def _dq_program(pid_m, b, h, Q, K, V, DO, LSE2, DELTA, DQ, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                s_vb, s_vh, s_vn, s_vd, s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
                seqlen_q, seqlen_k, sm_scale, qk_scale, lse_sb, lse_sh,
                KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, mask_sb, mask_sh, n_kv_tiles, CU_Q, CU_K, MOD_T, mod_i, mod_f,
                SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr,
                PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """dQ of BLOCK_M queries of one (batch, head), over the key tiles of its row's lists."""
    q_start, seqlen_q = _sequence(CU_Q, b, seqlen_q)
    k_start, seqlen_k = _sequence(CU_K, b, seqlen_k)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = offs_m + (seqlen_k - seqlen_q)
    args = (MOD_T, mod_i, mod_f)
    io_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    q_off = _offset(b, h, q_start, s_qb, s_qh, s_qm)
    do_off = _offset(b, h, q_start, s_dob, s_doh, s_dom)
    q = tl.load(Q + q_off + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd, mask=io_mask, other=0.0)
    do = tl.load(DO + do_off + offs_m[:, None] * s_dom + offs_d[None, :] * s_dod, mask=io_mask, other=0.0)
    row_off = _offset(b, h, q_start, lse_sb, lse_sh, 1)
    lse2 = tl.load(LSE2 + row_off + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_base = K + _offset(b, h // GROUP, k_start, s_kb, s_kh, s_kn)
    v_base = V + _offset(b, h // GROUP, k_start, s_vb, s_vh, s_vn)
    k_ptrs = k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd         # Kᵀ's first tile
    v_ptrs = v_base + offs_n[None, :] * s_vn + offs_d[:, None] * s_vd
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    SUB: tl.constexpr = SPARSE_N // BLOCK_N           # as the forward: full key tiles, then partial ones
    row = (b * mask_sb + h * mask_sh + start_m // SPARSE_M).to(tl.int64)
    n_full, n_end = _key_range(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    for partial in tl.static_range(2):
        if KV_COUNT is not None:
            index = (KV_INDEX if partial else FULL_INDEX) + row * n_kv_tiles
            n_tiles = tl.load((KV_COUNT if partial else FULL_COUNT) + row) * SUB
        else:
            index = KV_INDEX
            n_tiles = ((n_end - n_full + BLOCK_N - 1) if partial else n_full) // BLOCK_N   # n_full: whole tiles
        for it in range(0, n_tiles):
            start_n = _tile_start(index, it, n_full if partial else 0, SUB, SPARSE_N, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse2, delta, k_ptrs, v_ptrs, start_n, q_pos, offs_n, offs_d, b, h, seqlen_k,
                          s_kn, s_vn, sm_scale, qk_scale, args,
                          SCORE_MOD, SCORE_GRAD, MASK_MOD, partial == 1, CAUSAL, HEAD_DIM, BLOCK_D, PRECISION, EVEN)
    dq *= sm_scale
    dq_off = _offset(b, h, q_start, s_dqb, s_dqh, s_dqm)
    tl.store(DQ + dq_off + offs_m[:, None] * s_dqm + offs_d[None, :] * s_dqd, dq.to(DQ.dtype.element_ty),
             mask=io_mask)


@triton.jit(do_not_specialize=["kv_heads", "mask_sb", "mask_sh", "maskt_sb", "maskt_sh", "mod_i",
                               "n_kv_programs", "n_q_programs"])
def flex_bwd_kernel(Q, K, V, DO, LSE2, DELTA, DQ, DK, DV, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                    s_vb, s_vh, s_vn, s_vd, s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
                    s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd, kv_heads, seqlen_q, seqlen_k,
                    sm_scale, qk_scale, lse_sb, lse_sh,
                    KV_COUNT, KV_INDEX, FULL_KV_COUNT, FULL_KV_INDEX, mask_sb, mask_sh,
                    Q_COUNT, Q_INDEX, FULL_Q_COUNT, FULL_Q_INDEX, maskt_sb, maskt_sh, n_q_tiles, n_kv_tiles,
                    n_kv_programs, n_q_programs, CU_Q, CU_K, MOD_T, mod_i, mod_f,
                    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                    CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                    SPARSE_M: tl.constexpr, SPARSE_N: tl.constexpr, PRECISION: tl.constexpr, PART: tl.constexpr,
                    EVEN: tl.constexpr):
    """The backward's two kinds of programs in one grid (n_kv_programs + n_q_programs * GROUP, batch * kv_heads):
    first the dK/dV programs, one per BLOCK_N1 keys, then the dQ programs, one per BLOCK_M2 queries of each query
    head of the group, so that one launch keeps the GPU busy with both (no tail between two launches).
    PART 1 or 2 compiles only the dK/dV or only the dQ programs, for two launches with tiles and warps of their
    own (GPUs with little shared memory)."""
    pid = tl.program_id(0)
    b = tl.program_id(1) // kv_heads
    hk = tl.program_id(1) % kv_heads
    if PART != 2 and pid < n_kv_programs:
        _dkdv_program(pid, b, hk, Q, K, V, DO, LSE2, DELTA, DK, DV, s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
                      s_vb, s_vh, s_vn, s_vd, s_dob, s_doh, s_dom, s_dod, s_dkb, s_dkh, s_dkn, s_dkd,
                      s_dvb, s_dvh, s_dvn, s_dvd, seqlen_q, seqlen_k, sm_scale, qk_scale, lse_sb, lse_sh,
                      Q_COUNT, Q_INDEX, FULL_Q_COUNT, FULL_Q_INDEX, maskt_sb, maskt_sh, n_q_tiles, CU_Q, CU_K,
                      MOD_T, mod_i, mod_f, SCORE_MOD, SCORE_GRAD, MASK_MOD, CAUSAL, GROUP, HEAD_DIM, BLOCK_D,
                      BLOCK_M1, BLOCK_N1, SPARSE_M, SPARSE_N, PRECISION, EVEN)
    elif PART != 1:
        j = pid - n_kv_programs
        h = hk * GROUP + j // n_q_programs
        _dq_program(j % n_q_programs, b, h, Q, K, V, DO, LSE2, DELTA, DQ, s_qb, s_qh, s_qm, s_qd,
                    s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_dob, s_doh, s_dom, s_dod, s_dqb, s_dqh, s_dqm, s_dqd,
                    seqlen_q, seqlen_k, sm_scale, qk_scale, lse_sb, lse_sh, KV_COUNT, KV_INDEX, FULL_KV_COUNT,
                    FULL_KV_INDEX, mask_sb, mask_sh, n_kv_tiles, CU_Q, CU_K, MOD_T, mod_i, mod_f, SCORE_MOD,
                    SCORE_GRAD, MASK_MOD, CAUSAL, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, SPARSE_M, SPARSE_N,
                    PRECISION, EVEN)
