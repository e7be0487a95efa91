"""utils.explicit.backward (worklog 07w section 5): validation and configs on CPU, the synchronisation replayed
under random interleavings (and each of its rules shown necessary), the per-row statistics the kernel's producer
loads, the compiled kernel's schedule (compiled for sm_90 on this machine), and on an sm_90 GPU
the gradients against float64 autograd on odd shapes, directly and through the Gluon forwards' autograd."""
import itertools
import math

import pytest
import torch

from utils.explicit import backward as gb
from utils import gpu

on_hopper = pytest.mark.skipif(not torch.cuda.is_available() or gpu.capability() != (9, 0),
                               reason="needs an sm_90 GPU (H100/H200)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the preprocess kernel: compiled, or interpreted on CPU


def _inputs(shape=(1, 2, 2, 16, 16, 64), dtype=torch.bfloat16, device="cpu"):
    b, h, hk, nq, nk, d = shape
    q, do, o = (torch.randn(b, h, nq, d, dtype=dtype, device=device) for _ in range(3))
    k, v = (torch.randn(b, hk, nk, d, dtype=dtype, device=device) for _ in range(2))
    return do, q, k, v, o, torch.zeros(b, h, nq, device=device)


def test_inputs_are_checked_before_anything_is_built():
    do, q, k, v, o, lse = _inputs()
    with pytest.raises(ValueError, match="q is on cpu"):
        gb.flash_attention_backward(do, q, k, v, o, lse)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        gb.flash_attention_backward(do.float(), q.float(), k.float(), v.float(), o.float(), lse)
    with pytest.raises(ValueError, match="head_dim 32"):
        gb.flash_attention_backward(*(t[..., :32] for t in (do, q, k, v, o)), lse)
    with pytest.raises(TypeError, match="causal must be a bool"):
        gb.flash_attention_backward(do, q, k, v, o, lse, causal=1)
    with pytest.raises(ValueError, match="lse must have shape"):
        gb.flash_attention_backward(do, q, k, v, o, lse[:, :1])
    with pytest.raises(ValueError, match="do has shape"):
        gb.flash_attention_backward(do[:, :, :8], q, k, v, o, lse)


@pytest.mark.parametrize("seqlen_k, error, match", [(0, ValueError, "seqlen_k must be >= 1"),
                                                     (2048.0, TypeError, "seqlen_k must be an int"),
                                                     (True, TypeError, "seqlen_k must be an int")])
def test_a_bad_length_for_pick_config_is_named(seqlen_k, error, match):
    with pytest.raises(error, match=match):
        gb.pick_config(64, True, seqlen_k)


@pytest.mark.parametrize("config,head_dim,error,match", [
    ((64, 2, 240), 64, TypeError, "config must be a utils.explicit.backward.Config"),
    (gb.Config(32, 2, 240), 64, ValueError, "block_m must be 64 or 128"),
    (gb.Config(128, 2, 240), 128, ValueError, "must be 64 at head dim 128"),
    (gb.Config(64, 4, 240), 64, ValueError, "stages must be 1, 2 or 3"),
    (gb.Config(64, 2, 244), 64, ValueError, "consumer_regs must be a multiple of 8"),
    (gb.Config(64, 2, 240, 1), 64, TypeError, "prefetch_s must be a bool"),
    (gb.Config(128, 1, 240, True), 64, ValueError, "prefetch_s needs stages >= 2"),
    (gb.Config(64, 2, 240, False, 4.0), 128, TypeError, "bh_group must be an int"),
    (gb.Config(64, 2, 240, False, -1), 128, ValueError, "bh_group must be >= 0"),
    (gb.Config(64, 2, 240, False, 0, 1), 128, TypeError, "dq_writer must be a bool"),
    (gb.Config(64, 2, 240, ds_first=1), 128, TypeError, "ds_first must be a bool"),
    (gb.Config(64, 2, 240, scaled_p=None), 128, TypeError, "scaled_p must be a bool"),
    (gb.Config(64, 2, 240, dq_fragments=1), 128, TypeError, "dq_fragments must be a bool"),
    (gb.Config(64, 2, 240, dq_fragments=True), 64, ValueError, "block_m 128 at head dim 64"),
    (gb.Config(64, 2, 240, dq_writer=True, dq_fragments=True), 128, ValueError, "do not go together"),
    (gb.Config(64, 2, 240, mask_loop="yes"), 128, TypeError, "mask_loop must be a bool"),
    (gb.Config(64, 2, 240, dq_first=0), 128, TypeError, "dq_first must be a bool"),
    (gb.Config(64, 2, 240, free_early=1), 128, TypeError, "free_early must be a bool"),
    (gb.Config(64, 2, 240, dq_buffers=2.0), 128, TypeError, "dq_buffers must be an int"),
    (gb.Config(64, 2, 240, dq_buffers=3), 128, ValueError, "dq_buffers must be 1 or 2"),
    (gb.Config(64, 2, 240, dq_writer=True, dq_buffers=2), 128, ValueError, "does not go with dq_writer"),
    (gb.Config(64, 2, 240, dq_writer=True, free_early=True), 128, ValueError, "free_early goes with neither"),
    (gb.Config(128, 2, 240, True, dq_first=True, free_early=True), 64, ValueError, "free_early goes with neither"),
])
def test_bad_configs_are_named(config, head_dim, error, match):
    with pytest.raises(error, match=match):
        gb.check_config(config, head_dim)


def test_the_picked_configs_are_valid_and_use_wide_tiles_where_registers_allow():
    assert gb.check_config(gb.pick_config(64), 64).block_m == 128
    assert gb.check_config(gb.pick_config(128), 128).block_m == 64
    # launched in groups of (batch, head)s where it measured faster: causal at head dim 128 only
    assert [gb.pick_config(d, causal).bh_group for d in (64, 128) for causal in (False, True)] == [0, 0, 0, 4]
    # with the length known, causal: a group's key blocks make about one wave, at least four heads at 128;
    # a group of one head is no group
    lengths = (1024, 2048, 4096, 8192, 16384)
    assert [gb.pick_config(64, True, n).bh_group for n in lengths] == [16, 8, 4, 2, 0]
    assert [gb.pick_config(128, True, n).bh_group for n in lengths] == [16, 8, 4, 4, 4]
    assert {gb.pick_config(d, False, n).bh_group for d in (64, 128) for n in lengths} == {0}
    # dSᵀ before dV's product where that measured faster: all but head dim 128 without a mask
    assert [gb.pick_config(d, causal).ds_first for d in (64, 128) for causal in (False, True)] == [
        True, True, False, True]
    # P computed as scale·P where that measured faster: head dim 64
    assert [gb.pick_config(d, causal).scaled_p for d in (64, 128) for causal in (False, True)] == [
        True, True, False, False]
    # the masked tiles in a loop of their own where that measured faster: causal at head dim 64
    assert [gb.pick_config(d, causal).mask_loop for d in (64, 128) for causal in (False, True)] == [
        False, True, False, False]
    # the ring slot freed before dQ's reduce-adds where that measured faster: head dim 64 without a mask
    assert [gb.pick_config(d, causal).free_early for d in (64, 128) for causal in (False, True)] == [
        True, False, False, False]


@pytest.mark.parametrize("dq_writer,dq_buffers", [(False, 1), (True, 1), (False, 2)],
                         ids=["consumers reduce", "dq writer", "two dq buffers"])
@pytest.mark.parametrize("stages,prefetch_s", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_the_kernels_protocol_never_hangs_reads_stale_tiles_or_overwrites_early(stages, prefetch_s, dq_writer,
                                                                              dq_buffers):
    for n_tiles, seed, p_event in itertools.product(range(0, 9), range(40), (0.4, 0.1)):
        gb.replay_protocol(n_tiles, stages, seed, prefetch_s=prefetch_s, dq_writer=dq_writer, dq_buffers=dq_buffers,
                           p_event=p_event)


def test_prefetching_s_with_one_stage_hangs():
    """Why check_config wants two stages for prefetch_s: the consumers would wait for tile 1 in the slot that
    tile 0 still holds."""
    with pytest.raises(AssertionError, match="hang with 2 tiles and 1 stages"):
        gb.replay_protocol(2, 1, 0, prefetch_s=True)


@pytest.mark.parametrize("broken,match", [
    (dict(ds_buffers=1), "dSᵀ buffer 0 of consumer"),                 # tile t+1's dSᵀ over the one still read
    (dict(wait_reduces=False), "overwritten before the TMA read it"),  # staging reused too early
    (dict(last_meeting=False), "already holds dK"),                    # dK over the K the other one reads
    (dict(dq_writer=True, writer_waits=False), "the writer"),          # staged over a dQ the writer has not read
    (dict(pending=1), "overwritten before the TMA read it"),           # one buffer, waited for as if two
    # the TMA engine lagging (events taken rarely), so that it falls two tiles behind
    (dict(dq_buffers=2, wait_reduces=False, p_event=0.1), "overwritten before the TMA read it"),
], ids=["one dS slot", "no store_wait", "no last meeting", "consumer ahead of the writer", "one buffer as two",
        "two buffers, no wait"])
def test_each_rule_of_the_protocol_is_needed(broken, match):
    with pytest.raises(AssertionError, match=match):
        for stages, n_tiles, seed in itertools.product(range(1, 4), range(1, 9), range(40)):
            gb.replay_protocol(n_tiles, stages, seed, **broken)


@pytest.mark.parametrize("shift", [0.0, math.log2(0.125)], ids=["P", "scale·P"])
@pytest.mark.parametrize("nq", [16, 13, 1])
def test_stats_are_base2_lse_and_rowsum_with_rows_padded_to_16_bytes(nq, shift):
    """_stats: D = rowsum(dO ∘ O), lse2 = lse·log2(e) − shift with +inf where lse = -inf (a row that sees no
    key), each (batch·heads) row padded with zeros to a multiple of 4 floats, which TMA needs. The shift
    log2(scale) makes the kernel's exp2(s·scale·log2(e) − lse2) scale·P (Config.scaled_p)."""
    b, h, d = 2, 3, 64
    o, do = torch.randn(b, h, nq, d, device=DEVICE), torch.randn(b, h, nq, d, device=DEVICE)
    lse = torch.randn(b, h, nq, device=DEVICE)
    lse[0, 1, 0] = float("-inf")
    lse2, delta = gb._stats(o, do, lse, h, shift)
    width = 4 * math.ceil(nq / 4)
    assert lse2.shape == delta.shape == (b * h, width)
    want_lse2 = (lse * math.log2(math.e) - shift).reshape(b * h, nq)
    want_lse2[1, 0] = float("inf")
    torch.testing.assert_close(lse2[:, :nq], want_lse2)
    torch.testing.assert_close(delta[:, :nq], (o * do).sum(-1).reshape(b * h, nq), rtol=1e-5, atol=1e-5)
    assert (lse2[:, nq:] == 0).all() and (delta[:, nq:] == 0).all()


@pytest.mark.parametrize("head_dim,block_m", [(64, 128), (128, 64)])
def test_dq_unpermute_reads_each_value_where_the_layout_put_it(head_dim, block_m):
    """Config.dq_fragments: an accumulator filled from FRAGMENT_BASES alone (bit i of an offset adds basis i to
    (row, column); consumer w's block: rows 64w.. at 128-row tiles, else columns 64w..), then _dq_unpermute
    (interpreted on a CPU) must give the rows back, the ragged last tile cut at Nq."""
    b, h, nq = 1, 2, block_m + 37
    n_tiles = math.ceil(nq / block_m)
    want = torch.randn(b, h, n_tiles * block_m, head_dim)
    place = torch.zeros(4096, 2, dtype=torch.long)   # (row, column) of each offset of a block
    for offset in range(4096):
        for bit, basis in enumerate(gb.FRAGMENT_BASES):
            if offset >> bit & 1:
                place[offset] += torch.tensor(basis)
    assert len(set(map(tuple, place.tolist()))) == 4096   # every (row, column) of the 64 × 64 block once
    config = gb.Config(block_m, 2, 240, dq_fragments=True)
    acc = gb._dq_accumulator(b, h, nq, head_dim, config, DEVICE).view(-1, 4096)
    for bh, tile, w in itertools.product(range(b * h), range(n_tiles), range(2)):
        rows = tile * block_m + (64 * w if block_m == 128 else 0) + place[:, 0]
        cols = (0 if block_m == 128 else 64 * w) + place[:, 1]
        acc[(bh * n_tiles + tile) * 2 + w] = want[bh // h, bh % h, rows, cols].to(DEVICE)
    dq = torch.empty(b, h, nq, head_dim, dtype=torch.float32, device=DEVICE)
    launcher, grid, tail, meta = gb._unpermute(dq, config)
    launcher[grid](acc, dq, *tail, **meta)
    torch.testing.assert_close(dq.cpu(), want[:, :, :nq], rtol=0, atol=0)


def test_dq_fragments_store_without_conflicts_and_reduce_once_a_tile():
    """Compiled for sm_90 here: with Config.dq_fragments each consumer's tile loop stores dQ with 16-byte stores
    (STS.128: a warp's 512 bytes in a row, no bank conflicts) and adds it with one 2-D reduce; by rows it takes 8-byte
    stores into the swizzled boxes and two 3-D reduces."""
    from utils.course.cross_compile import script_in_fresh_process

    printed = script_in_fresh_process(
        "import collections\n"
        "from utils.course import cross_compile as cc\n"
        "for frag in (True, False):\n"
        "    sass = cc.compile_launch(cc._gluon_bwd_launch(128, False, dq_fragments=frag), (9, 0)).asm['sass']\n"
        "    for ops in cc._hgmma_loops(sass):\n"
        "        n = collections.Counter(o for o in ops if o.startswith(('STS.', 'UTMAREDG')))\n"
        "        print(frag, sorted(n.items()))\n")
    lines = printed.strip().splitlines()
    assert lines == ["True [('STS.128', 8), ('UTMAREDG.2D.ADD', 1)]"] * 2 + [
        "False [('STS.64', 16), ('UTMAREDG.3D.ADD', 2)]"] * 2, printed


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_compiled_loop_does_five_products_and_waits_for_a_reduce_one_tile_later(head_dim):
    """Compiled for sm_90 here, in a process without the interpreter. Per tile the consumer issues Sᵀ and dPᵀ, then
    dV, dK and its dQ block (one chain of two products: the two key halves); it reduce-adds the block at the end of
    the tile (two 64 × 32 boxes by rows; one box with dq_fragments, at head dim 64) and waits for it (reduce-wait)
    only at the next tile, before the consumers meet. With prefetch_s (head dim 64) the next tile's Sᵀ is issued
    between the dQ block's wait and its reduce-adds, and waited for at the tile's end. The kernel fits the 227 KiB
    of shared memory an H100/H200 gives a block."""
    from utils.course.cross_compile import in_fresh_process

    printed = in_fresh_process("--schedule", "gluon_bwd", "--head-dim", str(head_dim))
    header, *blocks = printed.splitlines()
    shared = int(header.split(" bytes of shared memory")[0].rsplit(" ", 1)[1])
    assert shared <= 227 * 1024, header
    prefetch = gb.pick_config(head_dim).prefetch_s
    reduces = "reduce" if gb.pick_config(head_dim).dq_fragments else "reduce×2"
    tail = [b.split() for b in blocks if reduces in b.split()]
    assert tail, printed
    for events in tail:
        reduce = events.index(reduces)
        assert events.index("reduce-wait") < reduce, events
        dq_wait = max(i for i, e in enumerate(events[:reduce]) if e == "wait(0)")
        assert events[dq_wait - 4:dq_wait] == ["wgmma×4", "commit", "wgmma×4", "commit"], events   # the dQ chain
        # dV, dK, the dQ chain (Sᵀ, dPᵀ at the loop's head), and with prefetch_s the next tile's Sᵀ
        assert sum(e == "commit" for e in events) == 4 + prefetch, events
        if prefetch:
            assert "tile?" in events[dq_wait:reduce] and "commit" in events[dq_wait:reduce], events
            assert events[-1] == "wait(0)", events


def _reduce_loops(head_dim: int, arrives: bool = False, **changes) -> list[list[str]]:
    """The Gluon backward (no mask, pick_config's tiles with `changes`) compiled for sm_90 in a fresh process: the
    events (cross_compile.DQ_EVENTS, and mbarrier arrives with `arrives`) of each loop that issues reduce-adds."""
    from utils.course.cross_compile import script_in_fresh_process

    kinds = "cc.DQ_EVENTS + (('mbarrier.arrive', 'arrive'),)" if arrives else "cc.DQ_EVENTS"
    printed = script_in_fresh_process(
        "from utils.course import cross_compile as cc\n"
        f"launch = cc._gluon_bwd_launch({head_dim}, False, **{changes!r})\n"
        f"for line in cc.schedule(cc.compile_launch(launch, (9, 0)).asm['ptx'], {kinds}):\n"
        "    print(line)\n")
    loops = [line.split() for line in printed.splitlines() if "reduce" in line.split() or "reduce×2" in line.split()]
    assert loops, printed
    return loops


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_first_issues_dk_after_the_dq_chain_and_waits_for_it_after_the_reduce(head_dim):
    """Compiled for sm_90 here: with Config.dq_first, once the consumers meet, each issues its dQ chain (two
    products) and then dK's product, waits for all but the last group (dK runs on), stages and adds dQ, and only
    then waits for dK, before the ring slot is freed."""
    dk = f"wgmma×{gb.pick_config(head_dim).block_m // 16}"   # dK's K is the tile's rows, 16 a product
    for events in _reduce_loops(head_dim, dq_first=True, free_early=False):
        meet = events.index("bar×2")
        assert events[meet + 1:meet + 8] == ["wgmma×4", "commit", "wgmma×4", "commit", dk, "commit", "wait(1)"], events
        reduce = next(i for i, e in enumerate(events) if e.startswith("reduce") and e != "reduce-wait")
        # dK's wait right after the reduce-adds; with prefetch_s the next tile's Sᵀ is still in flight then
        assert events[reduce + 1] == ("wait(1)" if gb.pick_config(head_dim).prefetch_s else "wait(0)"), events


@pytest.mark.parametrize("free_early", [False, True], ids=["freed after", "freed early"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_free_early_frees_the_slot_before_the_reduce_adds_and_waits_in_one_thread(head_dim, free_early):
    """Compiled for sm_90 here: with Config.free_early each consumer arrives on the ring slot's empty barrier
    once dQ is staged, before it issues the reduce-adds, and its wait for the last tile's reduces
    (cp.async.bulk.wait_group) is not followed by a warpgroup barrier: the pair barrier (bar) comes next.
    Without it the wait syncs the warpgroup (bar×2 with the pair barrier) and the slot is freed after the
    reduce-adds."""
    for events in _reduce_loops(head_dim, arrives=True, free_early=free_early):
        after_wait = events[events.index("reduce-wait") + 1]
        reduce = next(i for i, e in enumerate(events) if e.startswith("reduce") and e != "reduce-wait")
        arrive = events.index("arrive")
        if free_early:
            assert after_wait == "bar" and arrive < reduce, events
        else:
            assert after_wait == "bar×2" and arrive > reduce, events


@pytest.mark.parametrize("free_early", [False, True], ids=["store_wait", "one thread waits"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_two_dq_buffers_leave_the_last_tiles_reduces_in_flight_and_fit(head_dim, free_early):
    """Compiled for sm_90 here: with Config.dq_buffers = 2 the wait before the consumers meet leaves the last
    tile's bulk groups unread (one a tile in register order at 64, two row boxes at 128) and waits for the
    tile's before, and the kernel's shared memory still fits an H100/H200's 227 KB."""
    from utils.course.cross_compile import script_in_fresh_process

    printed = script_in_fresh_process(
        "import re\n"
        "from utils.course import cross_compile as cc\n"
        f"compiled = cc.compile_launch(cc._gluon_bwd_launch({head_dim}, False, dq_buffers=2, "
        f"free_early={free_early}), (9, 0))\n"
        "print(compiled.metadata.shared)\n"
        "print(sorted(set(re.findall(r'wait_group\\.read\\s+(\\d)', compiled.asm['ptx']))))\n")
    shared, waits = printed.strip().splitlines()[-2:]
    groups = 1 if gb.pick_config(head_dim).dq_fragments else 2
    assert int(shared) <= 227 * 1024, printed
    # the epilogue's store_wait(0) for dK, dV; in the loop, all but the last tile's groups
    assert waits == str(sorted({"0", str(groups)})), printed


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("changes,seed", [(dict(free_early=True), 13), (dict(dq_first=True, free_early=False), 11)],
                         ids=["free early", "dq first"])
def test_a_switch_on_the_picked_configs_gives_their_gradients(changes, seed, head_dim, causal):
    """Config.free_early, and Config.dq_first, on pick_config's config, with a ragged last tile and GQA."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    q, k, v = random_qkv(2, 4, 1000, 900, head_dim, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=seed)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    config = gb.pick_config(head_dim, causal, 900)._replace(**changes)
    grads = gb.flash_attention_backward(do, q, k, v, o, lse, causal=causal, config=config)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), torch.bfloat16)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gradients_match_float64_on_odd_shapes(dtype, causal):
    """GQA, Nq != Nk both ways (rows that see no key), one query, lengths not a multiple of a tile or of 4."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import ODD_SHAPES_64_128, assert_gradients_close, random_qkv, reference_gradients

    for b, h, hk, nq, nk, d in ODD_SHAPES_64_128:
        q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device="cuda", seed=nq + nk)
        do = torch.randn_like(q)
        o, lse = flash_attention_forward(q, k, v, causal=causal)
        grads = gb.flash_attention_backward(do, q, k, v, o, lse, causal=causal)
        assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=causal), dtype)


@on_hopper
@pytest.mark.parametrize("config,head_dim", [
    (gb.Config(64, 2, 240), 64), (gb.Config(128, 1, 232), 64), (gb.Config(64, 3, 240, True), 64),
    (gb.Config(128, 2, 240, False), 64), (gb.Config(64, 3, 240, True), 128),
    (gb.Config(128, 2, 240, True, 3), 64), (gb.Config(64, 2, 240, False, 3), 128),
    (gb.Config(64, 2, 240, False, 8), 128), (gb.Config(128, 2, 240, True, 0, True), 64),
    (gb.Config(64, 2, 240, False, 4, True), 128), (gb.Config(128, 1, 232, False, 0, True), 64),
    (gb.Config(64, 2, 240, ds_first=True), 128), (gb.Config(128, 2, 240, True, ds_first=False), 64),
    (gb.Config(64, 2, 240, scaled_p=True), 128), (gb.Config(128, 2, 240, True, scaled_p=False), 64),
    (gb.Config(64, 2, 240, False, 0, True, scaled_p=True), 128),
    (gb.Config(128, 2, 240, True, ds_first=True, scaled_p=True, dq_fragments=True), 64),
    (gb.Config(64, 2, 240, False, 4, ds_first=True, dq_fragments=True), 128),
    (gb.Config(128, 2, 240, True, ds_first=True, scaled_p=True, dq_fragments=True, mask_loop=True), 64),
    (gb.Config(128, 2, 240, False, mask_loop=True), 64), (gb.Config(64, 2, 240, False, 4, mask_loop=True), 128),
    (gb.Config(128, 2, 240, True, ds_first=True, scaled_p=True, dq_fragments=True, mask_loop=True, dq_first=True), 64),
    (gb.Config(64, 2, 240, False, 4, dq_first=True), 128), (gb.Config(64, 2, 240, dq_writer=True, dq_first=True), 128),
    (gb.Config(128, 2, 240, True, ds_first=True, scaled_p=True, dq_fragments=True, free_early=True), 64),
    (gb.Config(64, 2, 240, False, 4, free_early=True), 128), (gb.Config(128, 1, 232, free_early=True), 64),
    (gb.Config(64, 2, 240, False, 4, dq_buffers=2), 128),
    (gb.Config(128, 2, 240, True, ds_first=True, scaled_p=True, dq_fragments=True, free_early=True, dq_buffers=2), 64),
    (gb.Config(128, 2, 240, True, dq_buffers=2), 64), (gb.Config(64, 2, 240, free_early=True, dq_buffers=2), 128)],
    ids=["64x2 d64", "128x1 d64", "64x3 prefetch d64", "128x2 no prefetch d64", "64x3 prefetch d128",
         "groups of 3 d64", "groups of 3 d128", "one group of 4 d128", "dq writer d64", "dq writer d128",
         "dq writer 1 stage d64", "ds first d128", "dv first d64", "scaled p d128", "plain p d64",
         "dq writer scaled p d128", "dq fragments d64", "dq fragments d128", "mask loop d64",
         "mask loop no prefetch d64", "mask loop d128", "dq first d64", "dq first d128", "dq first writer d128",
         "free early d64", "free early d128", "free early 1 stage d64", "two dq buffers d128",
         "two dq buffers free early d64", "two dq buffers rows d64", "two dq buffers free early d128"])
def test_every_config_gives_the_same_gradients(config, head_dim):
    """The dQ block's split (rows of a 128-row tile, else columns), prefetch_s, the launch order (bh_group:
    4 (batch, K/V head)s in groups of 3, the last group short, or in one group larger than there are) and the
    order of dSᵀ and dV's product (ds_first), P scaled or not (scaled_p), dQ's staging order (dq_fragments) and
    the masked tiles in a loop of their own (mask_loop: with GQA, one per query head) and dK's product issued
    after dQ's (dq_first), the ring slot freed before the reduce-adds (free_early) and dQ staged in two buffers
    (dq_buffers), beside the picked configs."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    q, k, v = random_qkv(2, 4, 777, 1000, head_dim, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=3)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    grads = gb.flash_attention_backward(do, q, k, v, o, lse, causal=True, config=config)
    assert_gradients_close(grads, reference_gradients(q, k, v, do, causal=True), torch.bfloat16)


@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_fragments_give_the_gradients_on_a_kinds_first_and_later_calls(head_dim, causal):
    """Config.dq_fragments through the kept launches (Nq a multiple of 4, so the call has a kind: the second
    call runs the bound launches, the un-permute among them), with a ragged last tile and GQA."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    q, k, v = random_qkv(2, 4, 1000, 900, head_dim, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=7)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v, causal=causal)
    config = gb.pick_config(head_dim, causal)._replace(dq_fragments=True)
    assert gb._call_key(do, q, k, v, o, lse, causal, None, config) is not None
    ref = reference_gradients(q, k, v, do, causal=causal)
    for _ in range(2):
        assert_gradients_close(gb.flash_attention_backward(do, q, k, v, o, lse, causal=causal, config=config), ref,
                               torch.bfloat16)


@on_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_mask_loop_without_a_causal_mask_masks_the_ragged_key_block(head_dim):
    """Config.mask_loop without the causal mask: the last key block (Nk = 900) is ragged, so all of its tiles run
    in the masked loop and every other block's in the loop without the mask."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    q, k, v = random_qkv(2, 4, 1000, 900, head_dim, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=11)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v)
    config = gb.pick_config(head_dim)._replace(mask_loop=True)
    assert_gradients_close(gb.flash_attention_backward(do, q, k, v, o, lse, config=config),
                           reference_gradients(q, k, v, do), torch.bfloat16)


@on_hopper
@pytest.mark.parametrize("name", ["gluon", "gluon_ws"])
def test_the_gluon_forwards_differentiate_through_it(name):
    from utils.attention import REGISTRY
    from utils.course.testing import assert_gradients_match_reference, random_qkv

    q, k, v = random_qkv(1, 4, 300, 200, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda", seed=5)
    assert_gradients_match_reference(REGISTRY[name].load(), q, k, v, causal=True)


def test_calls_on_a_cpu_or_with_nq_not_a_multiple_of_4_are_checked_every_time():
    """No kind (utils.tiled.fast.launch.kind_key) for CPU tensors, nor where the statistics are padded between
    launches."""
    assert gb._call_key(*_inputs(), False, None, None) is None
    do, q, k, v, o, lse = _inputs((1, 2, 2, 13, 16, 64))
    assert gb._call_key(do, q, k, v, o, lse, False, None, None) is None


@on_hopper
def test_a_kind_of_call_is_checked_once_and_launched_bound(monkeypatch):
    """A second call of a kind reuses the first one's checks, config and bound launches (two; three with
    dq_fragments, the un-permute last), and so does nothing through Triton's own dispatch differently: dK and dV
    come out bitwise the same (dQ is summed by reduce-adds whose order varies). Nq not a multiple of 4 and bad
    arguments are not kept."""
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.tiled.fast.launch import Bound, dispatch_by_triton
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    q, k, v = random_qkv(2, 4, 256, 256, 64, dtype=torch.bfloat16, device="cuda", seed=1)
    do = torch.randn_like(q)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    args = (do, q, k, v, o, lse)
    gb._KINDS.clear()
    first = gb.flash_attention_backward(*args, causal=True)
    calls, run = [], Bound.__call__

    def counted(self, stream, *head):
        calls.append(len(head))
        run(self, stream, *head)

    monkeypatch.setattr(Bound, "__call__", counted)
    again = gb.flash_attention_backward(*(t.clone() for t in args), causal=True)
    # preprocess, the kernel's nine descriptors, with dq_fragments the un-permute's accumulator and dQ
    bound = [5, 9] + [2] * gb.pick_config(64, True).dq_fragments
    assert len(gb._KINDS) == 1 and calls == bound, calls
    with dispatch_by_triton():
        through_triton = gb.flash_attention_backward(*args, causal=True)
    assert calls == bound
    truth = reference_gradients(q, k, v, do, causal=True)
    for grads in (first, again, through_triton):
        assert_gradients_close(grads, truth, torch.bfloat16)
        for a, b in zip(first[1:], grads[1:]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    q, k, v, do = (t[:, :, :13] for t in (q, k, v, do))       # 13 query rows: their statistics are padded
    o, lse = flash_attention_forward(q, k, v, causal=True)
    assert_gradients_close(gb.flash_attention_backward(do, q, k, v, o, lse, causal=True),
                           reference_gradients(q, k, v, do, causal=True), torch.bfloat16)
    with pytest.raises(TypeError, match="causal must be a bool"):
        gb.flash_attention_backward(*args, causal=1)
    assert len(gb._KINDS) == 1


@on_hopper
def test_the_kinds_of_call_kept_stay_at_the_bound(monkeypatch):
    """A new kind per shape, never more than launch.MAX_KINDS (here 2): the least recently used is forgotten."""
    from utils.tiled.fast import launch
    from utils.tiled.fast.forward import flash_attention_forward
    from utils.course.testing import assert_gradients_close, random_qkv, reference_gradients

    monkeypatch.setattr(launch, "MAX_KINDS", 2)
    monkeypatch.setattr(gb, "_KINDS", launch.kind_cache())
    keys = []
    for n in (64, 128, 192, 256):
        q, k, v = random_qkv(1, 2, n, n, 64, dtype=torch.bfloat16, device="cuda", seed=n)
        do = torch.randn_like(q)
        o, lse = flash_attention_forward(q, k, v, causal=True)
        assert_gradients_close(gb.flash_attention_backward(do, q, k, v, o, lse, causal=True),
                               reference_gradients(q, k, v, do, causal=True), torch.bfloat16)
        keys.append(gb._call_key(do, q, k, v, o, lse, True, None, None))
    assert None not in keys and list(gb._KINDS) == keys[2:]
