"""Ring attention (utils.ring_attention): layout helpers, the single-process simulation, and real runs with 2, 3
and 4 processes on gloo (one launch per world size, every case checked inside it: process start-up dominates)."""
import pytest
import torch

from utils.reference import reference_attention
from utils.ring_attention import (LAYOUTS, RingCase, free_port, ring_attention, run_ring_check, shard,
                                  shard_indices, simulate_ring_attention, step_work, unshard, work_per_step,
                                  zigzag_chunks)
from utils.testing import assert_close, random_qkv

CUDA = torch.cuda.is_available()


def test_zigzag_chunks_pair_early_with_late():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="rank"):
        zigzag_chunks(2, 2)


def test_shard_indices_cover_the_sequence_once():
    assert shard_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_indices(6, 3, 2, "contiguous").tolist() == [4, 5]
    for layout in LAYOUTS:
        for w in (1, 2, 3, 4):
            held = torch.cat([shard_indices(24, w, r, layout) for r in range(w)])
            assert sorted(held.tolist()) == list(range(24))


def test_shard_indices_reject_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 6"):
        shard_indices(10, 3, 0, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        shard_indices(8, 2, 0, "striped")
    with pytest.raises(TypeError, match="world_size"):
        shard_indices(8, 2.0, 0)


def test_shard_then_unshard_is_the_identity():
    x = torch.randn(2, 3, 24, 5)
    for layout in LAYOUTS:
        parts = [shard(x, 3, r, layout) for r in range(3)]
        assert all(p.shape == (2, 3, 8, 5) for p in parts)
        assert torch.equal(unshard(parts, layout), x)
    with pytest.raises(ValueError, match="same shape"):
        unshard([x[:, :, :4], x[:, :, :6]])
    with pytest.raises(TypeError):
        unshard([])


def test_step_work_zigzag_is_balanced_and_contiguous_is_not():
    zigzag = work_per_step(4, causal=True, layout="zigzag")
    assert all(w == 0.5 for row in zigzag for w in row)            # every rank, every step: half a block
    contiguous = work_per_step(4, causal=True, layout="contiguous")
    assert [sum(row) for row in contiguous] == [0.5, 1.5, 2.5, 3.5]  # rank 0 idles, rank 3 works throughout
    assert work_per_step(3, causal=False, layout="zigzag") == [[1.0] * 3] * 3
    assert step_work(2, 0, 4, causal=True) == ("all", "first", False)
    assert step_work(1, 3, 4, causal=True) == ("second", "all", False)
    assert step_work(1, 3, 4, causal=True, layout="contiguous") is None
    assert step_work(1, 1, 4, causal=True) == ("all", "all", True)


def test_step_work_counts_every_visible_pair_once():
    """Sum over steps of the pairs each task covers = the causal mask of the full sequence, pair for pair."""
    w, n = 3, 12
    c = n // (2 * w)
    seen = torch.zeros(n, n, dtype=torch.int64)
    for rank in range(w):
        q_pos = shard_indices(n, w, rank)
        for step in range(w):
            src = (rank - step) % w
            task = step_work(rank, src, w, causal=True)
            if task is None:
                continue
            k_pos = shard_indices(n, w, src)
            rows = {"all": q_pos, "first": q_pos[:c], "second": q_pos[c:]}[task[0]]
            cols = {"all": k_pos, "first": k_pos[:c], "second": k_pos[c:]}[task[1]]
            block = torch.ones(len(rows), len(cols), dtype=torch.int64)
            if task[2]:
                block = torch.tril(block)
            seen[rows[:, None], cols[None, :]] += block
    assert torch.equal(seen, torch.tril(torch.ones(n, n, dtype=torch.int64)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_ring_matches_reference(world_size, causal, layout):
    q, k, v = random_qkv(2, 4, 48, 48, 16, kv_heads=2, seed=world_size)
    out = simulate_ring_attention(q, k, v, world_size=world_size, causal=causal, layout=layout)
    assert_close(out, reference_attention(q, k, v, causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("local", ["flash_triton", "flash_decoding"])
def test_simulated_ring_with_triton_kernels_on_gpu(local):
    q, k, v = random_qkv(1, 8, 2048, 2048, 64, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    out = simulate_ring_attention(q, k, v, world_size=4, causal=True, local_attention=local)
    assert_close(out, reference_attention(q, k, v, causal=True), dtype=torch.bfloat16)


def test_ring_attention_validates_inputs():
    q, k, v = random_qkv(1, 2, 6, 6, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, k, v)
    with pytest.raises(ValueError, match="even"):
        simulate_ring_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], world_size=1, causal=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        simulate_ring_attention(q, k, v, world_size=2, causal=True)
    with pytest.raises(ValueError, match="world_size"):
        simulate_ring_attention(q, k, v, world_size=0)
    with pytest.raises(ValueError, match="local attention"):
        simulate_ring_attention(q, k, v, world_size=1, local_attention="magic")
    with pytest.raises(ValueError, match="same positions"):
        simulate_ring_attention(q, k[:, :, :4], v[:, :, :4], world_size=1)


def test_run_ring_check_validates_arguments():
    with pytest.raises(ValueError, match="backend"):
        run_ring_check([RingCase()], world_size=2, backend="mpi")
    with pytest.raises(TypeError, match="RingCase"):
        run_ring_check([{}], world_size=2)
    with pytest.raises(ValueError, match="multiple of 6"):
        run_ring_check([RingCase(seqlen=64)], world_size=3)
    assert 0 < free_port() < 65536


# One launch per world size covers full and causal attention, both layouts, MHA and GQA.
GLOO_CASES = [RingCase(causal=causal, layout=layout, kv_heads=kv_heads, seqlen=48, head_dim=16, seed=i)
              for i, (causal, layout, kv_heads) in enumerate(
                  [(False, "zigzag", 4), (True, "zigzag", 4), (True, "zigzag", 2), (True, "contiguous", 1)])]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_with_gloo_processes(world_size):
    results = run_ring_check(GLOO_CASES, world_size=world_size, backend="gloo")
    assert len(results) == len(GLOO_CASES)
    for case, result in zip(GLOO_CASES, results):
        assert result["world_size"] == world_size and result["case"]["causal"] == case.causal
        assert result["max_abs_err"] < 1e-5, f"{case}: max error {result['max_abs_err']:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_with_nccl_on_two_gpus():
    cases = [RingCase(causal=True, layout="zigzag", kv_heads=2, seqlen=1024, head_dim=64, dtype="bfloat16",
                      iters=2)]
    (result,) = run_ring_check(cases, world_size=2, backend="nccl")
    assert result["max_abs_err"] <= result["dtype_tolerance"], result
    assert result["ring_ms"] > 0


def test_spawn_hides_the_file_triton_interpreter_leaves_in_main(monkeypatch):
    """A kernel defined in a notebook and run by the interpreter leaves triton's interpreter.py as __main__.__file__;
    run_ring_check's spawned children must not run it as their main script. A real script's path stays."""
    import sys

    from utils.ring_attention import _main_without_interpreter_file

    main = sys.modules["__main__"]
    stray = "/x/site-packages/triton/runtime/interpreter.py"
    monkeypatch.setattr(main, "__file__", stray, raising=False)
    with _main_without_interpreter_file():
        assert not hasattr(main, "__file__")
    assert main.__file__ == stray
    monkeypatch.setattr(main, "__file__", "/home/me/train.py")
    with _main_without_interpreter_file():
        assert main.__file__ == "/home/me/train.py"
