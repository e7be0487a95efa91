"""Ring attention (utils.ring.attention): layout helpers, the single-process simulation, its gradients against
float64 autograd, a model trained through it, and real runs with 2, 3 and 4 processes on gloo, forward and
backward, through utils.course.ring_check (one launch per world size, every case checked inside it: process
start-up dominates)."""
import functools
import json

import pytest
import torch

from utils.eager.backward import attention_gradients
from utils.eager.reference import naive_attention, reference_attention
from utils.course.ring_check import RING_NCCL_JSON, RingCase, free_port, run_ring_check
from utils.ring.attention import (LAYOUTS, block_gradients, pick_local_backward, ring_attention, shard,
                                  shard_indices, simulate_ring_attention, simulate_ring_backward, step_work, unshard,
                                  work_per_step, zigzag_chunks)
from utils.eager.softmax import attention_with_lse
from utils.course.testing import assert_close, random_qkv

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


def reference_gradients(q, k, v, do, causal):
    """(dq, dk, dv) by autograd through the naive formula in float64: the ground truth."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(naive_attention(*leaves, causal=causal), leaves, do.double())


def ring_gradients(q, k, v, do, **kwargs):
    """(dq, dk, dv) by autograd through the simulated ring."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(simulate_ring_attention(*leaves, **kwargs), leaves, do)


@pytest.mark.gpu
@pytest.mark.parametrize("local", ["flash_triton", "flash_decoding"])
def test_simulated_ring_with_triton_kernels_on_gpu(local):
    """bf16: the output within bf16's tolerance; the gradients (Triton backward per block) no further from float64
    truth than SDPA's own error plus the rounding of the ring's bf16 partial sums: autograd adds the world_size
    partial gradients of a block in bf16, each addition off by up to half a unit in the last place (2^-9 of the
    largest gradient). A wrong block or mask is off by far more."""
    from utils.eager.reference import sdpa_attention

    world = 4
    q, k, v = random_qkv(1, 8, 2048, 2048, 64, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    out = simulate_ring_attention(q, k, v, world_size=world, causal=True, local_attention=local)
    assert_close(out, reference_attention(q, k, v, causal=True), dtype=torch.bfloat16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    truth = reference_gradients(q, k, v, do, True)
    ours = ring_gradients(q, k, v, do, world_size=world, causal=True, local_attention=local)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdpa = torch.autograd.grad(sdpa_attention(*leaves, causal=True), leaves, do)
    for name, g, s, t in zip(("dq", "dk", "dv"), ours, sdpa, truth):
        error, sdpa_error = (g.double() - t).abs().max().item(), (s.double() - t).abs().max().item()
        partial_sums = world * 2 ** -9 * t.abs().max().item()
        assert g.dtype == torch.bfloat16 and error <= sdpa_error + partial_sums + 1e-3, (name, error, sdpa_error)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_ring_gradients_match_float64_autograd(world_size, causal, layout):
    """float64 inputs, GQA, an odd head dim: every gradient to float64 precision (1e-7)."""
    q, k, v = random_qkv(2, 4, 24, 24, 7, kv_heads=2, dtype=torch.float64, seed=10 + world_size)
    do = torch.randn_like(q)
    grads = ring_gradients(q, k, v, do, world_size=world_size, causal=causal, layout=layout)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, reference_gradients(q, k, v, do, causal)):
        assert got.shape == expected.shape, name
        assert_close(got, expected, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("head_dim", [5, 13])
def test_simulated_ring_gradients_in_float32(head_dim):
    """float32 in, float32 gradients out (accumulated in float32), close to float64 truth."""
    q, k, v = random_qkv(1, 3, 32, 32, head_dim, kv_heads=1, seed=head_dim)
    do = torch.randn_like(q)
    grads = ring_gradients(q, k, v, do, world_size=4, causal=True, sm_scale=0.3)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    truth = torch.autograd.grad(naive_attention(*leaves, causal=True, sm_scale=0.3), leaves, do.double())
    for got, expected in zip(grads, truth):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_block_gradients_of_key_blocks_add_up_with_the_global_lse():
    """Split the keys in three: with the whole rows' lse and delta the blocks' dq add up to the full dq, and
    each block's dk, dv are the full gradient's rows for its keys. With a block's own lse they would not."""
    q, k, v = random_qkv(1, 4, 10, 30, 8, kv_heads=2, dtype=torch.float64, seed=5)
    do = torch.randn_like(q)
    o, lse = attention_with_lse(q, k, v)
    delta = (do * o).sum(-1)
    dq_full, dk_full, dv_full = attention_gradients(do, q, k, v, o, lse)
    dq = torch.zeros_like(q)
    for cols in (slice(0, 7), slice(7, 20), slice(20, 30)):
        dq_b, dk_b, dv_b = block_gradients(q, k[:, :, cols], v[:, :, cols], do, lse, delta)
        dq += dq_b
        assert_close(dk_b, dk_full[:, :, cols])
        assert_close(dv_b, dv_full[:, :, cols])
    assert_close(dq, dq_full)
    _, own_lse = attention_with_lse(q, k[:, :, :7], v[:, :, :7])
    wrong = block_gradients(q, k[:, :, :7], v[:, :, :7], do, own_lse, delta)[2]
    assert (wrong - dv_full[:, :, :7]).abs().max() > 0.1


def test_block_gradients_causal_block_and_rows_without_keys():
    """A causal block is the bottom-right mask; a row that sees no key (lse = -inf) gets zero, not NaN."""
    q, k, v = random_qkv(1, 2, 12, 12, 16, dtype=torch.float64, seed=6)
    do = torch.randn_like(q)
    o, lse = attention_with_lse(q, k, v, causal=True)
    got = block_gradients(q, k, v, do, lse, (do * o).sum(-1), causal=True)
    for a, b in zip(got, attention_gradients(do, q, k, v, o, lse, causal=True)):
        assert_close(a, b)
    lse[:, :, 3] = float("-inf")
    dq = block_gradients(q, k, v, do, lse, (do * o).sum(-1), causal=True)[0]
    assert not dq.isnan().any() and torch.all(dq[:, :, 3] == 0)


def test_block_gradients_and_the_backward_ring_validate_inputs():
    q, k, v = random_qkv(1, 2, 8, 8, 4)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="delta must have shape"):
        block_gradients(q, k, v, q, lse, lse[:, :, :4])
    with pytest.raises(TypeError, match="do must be"):
        block_gradients(q, k, v, "do", lse, lse)
    with pytest.raises(TypeError, match="lse must be a floating"):
        block_gradients(q, k, v, q, lse.long(), lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        simulate_ring_backward(q, q, k, v, q, lse[:, :1], world_size=2)
    with pytest.raises(ValueError, match="multiple of 6"):
        simulate_ring_backward(q, q, k, v, q, lse, world_size=3, causal=True)
    with pytest.raises(ValueError, match="local attention"):
        pick_local_backward("cpu", "magic")
    assert pick_local_backward("cpu", "auto") is pick_local_backward("cpu", "torch")


def test_simulate_ring_backward_is_the_autograd_backward():
    """Called directly with a forward's o and lse, the backward ring gives what autograd gets through it."""
    q, k, v = random_qkv(1, 2, 16, 16, 8, dtype=torch.float64, seed=7)
    do = torch.randn_like(q)
    o, lse = attention_with_lse(q, k, v, causal=True)
    direct = simulate_ring_backward(do, q, k, v, o, lse, world_size=2, causal=True)
    for a, b in zip(direct, ring_gradients(q, k, v, do, world_size=2, causal=True)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("world_size, causal, layout", [(2, True, "zigzag"), (3, False, "contiguous")])
def test_simulated_ring_backward_with_the_triton_kernels(world_size, causal, layout):
    """The Triton forward and backward (the interpreter on a CPU) as the local kernels: the backward kernel,
    fed the final o and lse, returns exactly a block's share."""
    device = "cuda" if CUDA else "cpu"
    q, k, v = random_qkv(1, 2, 24, 24, 16, kv_heads=1, device=device, seed=world_size)
    do = torch.randn_like(q)
    grads = ring_gradients(q, k, v, do, world_size=world_size, causal=causal, layout=layout,
                           local_attention="flash_triton")
    for got, expected in zip(grads, reference_gradients(q, k, v, do, causal)):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_model_trains_through_the_simulated_ring():
    """A few SGD steps of notebook 07's character model with zigzag ring attention (3 ranks) reduce the loss and
    follow single-device attention step for step, weights included."""
    from utils.course.char_model import CharTokenizer, CharTransformer, get_batch, load_corpus

    text = load_corpus(3000)
    tok = CharTokenizer(text)
    x, y = get_batch(tok.encode(text), 4, 24, torch.Generator().manual_seed(0))

    def train(attention):
        torch.manual_seed(0)
        model = CharTransformer(tok.vocab_size, dim=16, heads=2, layers=1, max_len=24, attention=attention)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(6):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model

    ring_losses, ring_model = train(functools.partial(simulate_ring_attention, world_size=3))
    single_losses, single_model = train(naive_attention)
    assert ring_losses[-1] < ring_losses[0] - 0.5, ring_losses
    torch.testing.assert_close(ring_losses, single_losses, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(ring_model.named_parameters(), single_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


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
    with pytest.raises(TypeError, match="dtype"):
        simulate_ring_attention(q.int(), k.int(), v.int(), world_size=1)


def test_run_ring_check_validates_arguments():
    with pytest.raises(ValueError, match="backend"):
        run_ring_check([RingCase()], world_size=2, backend="mpi")
    with pytest.raises(TypeError, match="RingCase"):
        run_ring_check([{}], world_size=2)
    with pytest.raises(ValueError, match="multiple of 6"):
        run_ring_check([RingCase(seqlen=64)], world_size=3)
    assert 0 < free_port() < 65536


# One launch per world size covers full and causal attention, both layouts, MHA and GQA, forward and backward
# (gradients against float64 autograd), with and without overlap, and the timing paths (iters).
GLOO_CASES = [RingCase(causal=causal, layout=layout, kv_heads=kv_heads, seqlen=48, head_dim=16, seed=i,
                       overlap=overlap, iters=iters)
              for i, (causal, layout, kv_heads, overlap, iters) in enumerate(
                  [(False, "zigzag", 4, True, 0), (True, "zigzag", 4, True, 0), (True, "zigzag", 2, False, 0),
                   (True, "contiguous", 1, True, 1)])]


# 3 and 4 in the full suite: make test runs notebook 08, whose ring check runs 4 gloo processes
@pytest.mark.parametrize("world_size", [2, *(pytest.param(n, marks=pytest.mark.full) for n in (3, 4))])
def test_ring_with_gloo_processes(world_size):
    results = run_ring_check(GLOO_CASES, world_size=world_size, backend="gloo")
    assert len(results) == len(GLOO_CASES)
    for case, result in zip(GLOO_CASES, results):
        assert result["world_size"] == world_size and result["case"]["causal"] == case.causal
        assert result["max_abs_err"] < 1e-5, f"{case}: max error {result['max_abs_err']:.2e}"
        assert result["grad_rel_err"] < 1e-5, f"{case}: gradient error {result['grad_rel_err']:.2e}"
    assert results[-1]["ring_fwd_bwd_ms"] > 0 and results[-1]["ring_fwd_bwd_no_overlap_ms"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_with_nccl_on_two_gpus():
    cases = [RingCase(causal=True, layout="zigzag", kv_heads=2, seqlen=1024, head_dim=64, dtype="bfloat16",
                      iters=2)]
    (result,) = run_ring_check(cases, world_size=2, backend="nccl")
    assert result["max_abs_err"] <= result["dtype_tolerance"], result
    assert result["grad_rel_err"] <= result["dtype_tolerance"], result
    assert result["ring_ms"] > 0 and result["ring_fwd_bwd_ms"] > 0


def test_spawn_hides_the_file_triton_interpreter_leaves_in_main(monkeypatch):
    """A kernel defined in a notebook and run by the interpreter leaves triton's interpreter.py as __main__.__file__;
    run_ring_check's spawned children must not run it as their main script. A real script's path stays."""
    import sys

    from utils.course.ring_check import _main_without_interpreter_file

    main = sys.modules["__main__"]
    stray = "/x/site-packages/triton/runtime/interpreter.py"
    monkeypatch.setattr(main, "__file__", stray, raising=False)
    with _main_without_interpreter_file():
        assert not hasattr(main, "__file__")
    assert main.__file__ == stray
    monkeypatch.setattr(main, "__file__", "/home/me/train.py")
    with _main_without_interpreter_file():
        assert main.__file__ == "/home/me/train.py"


@pytest.mark.full   # make test runs the 2-process ring itself (test_ring_with_gloo_processes)
def test_gloo_command_line_writes_its_results_with_their_environment(tmp_path):
    """The command line (the one that makes images/ring_nccl.json on GPUs) records where it measured."""
    from utils.course.ring_check import _main

    path = tmp_path / "ring.json"
    argv = ["--backend", "gloo", "--world-size", "2", "--seqlen", "64", "--heads", "2", "--head-dim", "16",
            "--iters", "1", "--json", str(path)]
    results = _main(argv)
    stored = json.loads(path.read_text())
    assert (stored["backend"], stored["world_size"], stored["device"]) == ("gloo", 2, "CPU")
    env = stored["environment"]
    assert all(k in env for k in ("gpu", "capability", "torch", "triton", "cuda", "cudnn", "driver", "date",
                                  "command")), env
    assert env["torch"] == torch.__version__
    assert [r["case"]["causal"] for r in stored["results"]] == [False, True, True] == [
        r["case"]["causal"] for r in results]
    assert all(r["max_abs_err"] <= r["dtype_tolerance"] for r in stored["results"])


def test_the_nccl_command_line_writes_to_the_stored_reference_by_default():
    assert RING_NCCL_JSON.is_file() and RING_NCCL_JSON.parent.name == "images", RING_NCCL_JSON
