"""Split-KV flash-decoding (utils.decoding.split_kv) against the float64 reference, on the CPU through the
interpreter and, where there is one, on a GPU."""
import pytest
import torch

from utils.decoding.split_kv import (MAX_SPLITS, choose_num_splits, flash_decode, merge_partials)
from utils.eager.reference import causal_mask, reference_attention
from utils.eager.softmax import attention_with_lse
from utils.course.testing import assert_close, random_qkv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def reference_with_lengths(q, k, v, seqlens, *, causal):
    """Each sequence attends to its first seqlens[b] cache entries, the new tokens aligned to the end."""
    outs, lses = [], []
    for b, n in enumerate(seqlens.tolist()):
        qb = q[b:b + 1].double()
        if n == 0:
            outs.append(torch.zeros_like(qb))
            lses.append(torch.full(qb.shape[:3], float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_with_lse(qb, k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(), causal=causal)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


# (batch, heads, kv_heads, new tokens, cache length, head_dim, num_splits): splits that do not divide the cache,
# more splits than cache tiles (empty splits), GQA and MQA, 1 and several new tokens, odd head dims.
CASES = [
    (2, 4, 4, 1, 200, 64, 3),
    (1, 8, 2, 1, 257, 32, 4),
    (2, 4, 1, 4, 100, 64, 2),
    (1, 2, 2, 3, 33, 80, 7),
    (1, 6, 3, 2, 130, 16, 1),
    (1, 2, 1, 1, 64, 64, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_reference(case, causal, dtype):
    b, h, hk, nq, nk, d, splits = case
    q, k, v = random_qkv(b, h, nq, nk, d, kv_heads=hk, dtype=dtype, device=DEVICE, seed=1)
    out, lse = flash_decode(q, k, v, causal=causal, num_splits=splits, return_lse=True)
    ref_out, ref_lse = attention_with_lse(q.double(), k.double(), v.double(), causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype=dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2 if dtype != torch.float32 else 1e-4, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cache_seqlens_per_sequence(causal):
    """Ragged caches: lengths 0 (nothing seen: zero output), shorter than the new tokens, not a tile multiple."""
    q, k, v = random_qkv(4, 4, 3, 150, 32, kv_heads=2, device=DEVICE, seed=2)
    seqlens = torch.tensor([150, 0, 2, 77], device=DEVICE, dtype=torch.int32)
    for splits in (1, 3, 8):
        out, lse = flash_decode(q, k, v, causal=causal, num_splits=splits, cache_seqlens=seqlens, return_lse=True)
        ref_out, ref_lse = reference_with_lengths(q.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), causal=causal)
        assert_close(out.cpu(), ref_out, dtype=torch.float32)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-4, rtol=0)
    assert torch.all(out[1] == 0)
    if causal:  # sequence 2 has 2 cached entries and 3 new tokens: the first new token sees nothing
        assert torch.all(out[2, :, 0] == 0) and torch.all(lse[2, :, 0] == float("-inf"))


def test_cache_entries_past_the_length_are_ignored():
    q, k, v = random_qkv(2, 2, 1, 96, 32, device=DEVICE, seed=3)
    seqlens = torch.tensor([40, 96], device=DEVICE)
    out = flash_decode(q, k, v, cache_seqlens=seqlens, num_splits=2)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 40:], v2[0, :, 40:] = 1e4, float("nan")  # garbage where sequence 0 has no entries
    assert torch.equal(flash_decode(q, k2, v2, cache_seqlens=seqlens, num_splits=2), out)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")   # the interpreter's max of NaN rows
def test_lengths_written_without_a_version_bump_never_reach_past_the_cache():
    """Lengths changed after their check without a version bump (a kernel's write, a CUDA graph's replay; here
    through `.data`) are not checked again: the kernel still reads nothing past the cache, and gives the
    sequence whose length lies outside [0, Nk] NaN rows. The cache is a view of a longer one, so that reading
    past it would give finite numbers."""
    q, k, v = random_qkv(2, 2, 2, 64, 32, device=DEVICE, seed=3)
    k, v = k[:, :, :48], v[:, :, :48]                               # Nk = 48 in a store of 64 positions
    seqlens = torch.tensor([40, 48], device=DEVICE, dtype=torch.int32)
    for splits in (1, 2):
        good, good_lse = flash_decode(q, k, v, cache_seqlens=seqlens, num_splits=splits, return_lse=True)
        version = seqlens._version
        for value in (60, -1):
            seqlens.data[0] = value                                 # the stamp still vouches for the values
            out, lse = flash_decode(q, k, v, cache_seqlens=seqlens, num_splits=splits, return_lse=True)
            seqlens.data[0] = 40
            assert seqlens._version == version
            assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all(), (splits, value)
            assert torch.equal(out[1], good[1]) and torch.equal(lse[1], good_lse[1])


def test_splits_do_not_change_the_answer():
    q, k, v = random_qkv(1, 4, 1, 300, 64, kv_heads=1, device=DEVICE, seed=4)
    outs = [flash_decode(q, k, v, num_splits=s) for s in (1, 2, 5, 16)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


def test_large_logits_and_custom_scale():
    q, k, v = random_qkv(1, 2, 2, 128, 64, device=DEVICE, seed=5)
    out = flash_decode(q * 30, k, v, num_splits=4, sm_scale=0.2)
    assert torch.isfinite(out).all()
    assert_close(out, reference_attention(q * 30, k, v, sm_scale=0.2), dtype=torch.float32)


def test_non_contiguous_inputs():
    q, k, v = random_qkv(2, 4, 2, 70, 32, kv_heads=2, device=DEVICE, seed=6)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not kt.is_contiguous()
    torch.testing.assert_close(flash_decode(qt, kt, vt, num_splits=3), flash_decode(q, k, v, num_splits=3))


def test_merge_partials_matches_torch():
    gen = torch.Generator().manual_seed(7)
    o_parts = torch.randn(2, 3, 2, 5, 24, generator=gen)
    lse_parts = torch.randn(2, 3, 2, 5, generator=gen) * 5
    lse_parts[0, 0, 0] = float("-inf")           # a row where no split saw a key
    lse_parts[1, 2, 1, :3] = float("-inf")       # empty splits
    o_parts[1, 2, 1, :3] = float("nan")          # whatever an empty split holds, it weighs nothing
    out, lse = merge_partials(o_parts.to(DEVICE), lse_parts.to(DEVICE))
    expect_lse = torch.logsumexp(lse_parts, dim=-1)
    weights = torch.exp(lse_parts - expect_lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
    expect = (weights[..., None] * o_parts.nan_to_num(0.0)).sum(3)
    torch.testing.assert_close(out.cpu(), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), expect_lse)
    assert torch.all(out[0, 0, 0] == 0)


def test_merge_partials_rejects_bad_input():
    o, lse = torch.zeros(1, 1, 1, 2, 8, device=DEVICE), torch.zeros(1, 1, 1, 2, device=DEVICE)
    with pytest.raises(ValueError, match="lse_parts has shape"):
        merge_partials(o, lse[..., :1])
    with pytest.raises(ValueError, match="o_parts must be"):
        merge_partials(o[0], lse)
    with pytest.raises(TypeError, match="o_parts must be a torch.Tensor"):
        merge_partials(o.tolist(), lse)


def test_choose_num_splits():
    assert choose_num_splits(200, 4096, 64, 132) == 1        # already more programs than SMs
    assert choose_num_splits(16, 131072, 64, 132) == 17       # two waves: cdiv(264, 16)
    assert choose_num_splits(1, 200, 64, 132) == 4            # never more splits than cache tiles
    assert choose_num_splits(1, 10**7, 64, 132) == MAX_SPLITS
    with pytest.raises(ValueError):
        choose_num_splits(0, 10, 64, 132)
    with pytest.raises(TypeError):
        choose_num_splits(1.5, 10, 64, 132)


def test_bad_inputs_raise_clear_errors():
    q, k, v = random_qkv(2, 4, 1, 32, 32, kv_heads=2, device=DEVICE)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        flash_decode(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        flash_decode(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="not a multiple"):
        flash_decode(torch.cat([q, q[:, :1]], 1), k, v)
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        flash_decode(q, k, v, num_splits=2.0)
    with pytest.raises(ValueError, match="cache_seqlens must lie"):
        flash_decode(q, k, v, cache_seqlens=torch.tensor([1, 33], device=DEVICE))
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        flash_decode(q, k, v, cache_seqlens=torch.tensor([1.0, 3.0], device=DEVICE))
    with pytest.raises(ValueError, match="cache_seqlens must be"):
        flash_decode(q, k, v, cache_seqlens=torch.tensor([1], device=DEVICE))
    with pytest.raises(TypeError, match="cache_seqlens must be"):
        flash_decode(q, k, v, cache_seqlens=[1, 2])
    with pytest.raises(TypeError, match="return_lse"):
        flash_decode(q, k, v, return_lse=1)
    with pytest.raises(ValueError, match="sm_scale"):
        flash_decode(q, k, v, sm_scale=-1.0)


def test_causal_mask_is_bottom_right_per_sequence():
    """The mask the kernel applies for one sequence equals the course's causal_mask of (Nq, L)."""
    q, k, v = random_qkv(1, 1, 3, 5, 16, device=DEVICE, seed=8)
    out = flash_decode(q, k, v, causal=True, num_splits=2)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 4
    scores = scores.masked_fill(~causal_mask(3, 5, device=DEVICE), float("-inf"))
    assert_close(out, torch.softmax(scores, -1) @ v.double(), dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_long_cache_on_gpu(dtype):
    q, k, v = random_qkv(4, 16, 1, 32768, 128, kv_heads=2, dtype=dtype, device="cuda", seed=9)
    seqlens = torch.tensor([32768, 1000, 20000, 5], device="cuda")
    out = flash_decode(q, k, v, cache_seqlens=seqlens)
    ref, _ = reference_with_lengths(q.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), causal=False)
    assert_close(out.cpu(), ref, dtype=dtype)


@pytest.mark.gpu
def test_batch_offsets_past_2_to_the_31_on_gpu():
    """A cache whose second sequence starts 2**31 elements in: a 32-bit b * stride would wrap around."""
    n, d = 64, 128
    stride_b = 2**31 + n * d  # the storage is about 4 GiB of bf16, almost all of it never read
    storage = torch.zeros(stride_b + n * d, device="cuda", dtype=torch.bfloat16)
    k = storage.as_strided((2, 1, n, d), (stride_b, n * d, d, 1))
    k.copy_(torch.randn(2, 1, n, d, device="cuda"))
    v = k  # the same huge strides for V
    q = torch.randn(2, 4, 1, d, device="cuda", dtype=torch.bfloat16)
    out = flash_decode(q, k, v)
    ref = reference_attention(q.float(), k.float(), v.float())
    assert_close(out.float(), ref, dtype=torch.bfloat16)


def test_launch_floor_json_has_its_environment_and_one_row_per_method(tmp_path):
    """The launch-floor writer on the CPU: fake steps and a fake timer stand in for the GPU."""
    import json

    from utils.course.bench.decoding import LAUNCH_FLOOR_COMMAND, launch_floor_path, write_launch_floor

    def broken():
        raise RuntimeError("no kernel for this shape\nsecond line")

    methods = {"flash_decode (Python launch)": lambda: 1, "flash_decode (CUDA graph replay)": lambda: 2,
               "SDPA cuDNN": broken}
    path = write_launch_floor(tmp_path / "out", "test", methods=methods, timer=lambda fn: 10.0 * fn())
    assert path == launch_floor_path(tmp_path / "out", "test") and path.name == "decoding_launch_floor_test.json"
    result = json.loads(path.read_text())
    assert set(result) == {"environment", "shape", "rows"}
    assert {"gpu", "capability", "torch", "triton", "cuda", "cudnn", "date", "command"} <= set(result["environment"])
    assert result["environment"]["command"] == LAUNCH_FLOOR_COMMAND
    assert result["environment"]["torch"] == torch.__version__
    assert result["shape"]["batch"] == 1 and result["shape"]["dtype"] == "bfloat16"
    assert result["rows"][:2] == [{"method": "flash_decode (Python launch)", "us": 10.0},
                                  {"method": "flash_decode (CUDA graph replay)", "us": 20.0}]
    assert result["rows"][2] == {"method": "SDPA cuDNN", "error": "RuntimeError: no kernel for this shape"}


@pytest.mark.gpu
def test_launch_floor_on_gpu(tmp_path):
    import json

    from utils.course.bench.decoding import write_launch_floor

    rows = json.loads(write_launch_floor(tmp_path, "gpu").read_text())["rows"]
    timed = {r["method"]: r["us"] for r in rows if "us" in r}
    assert timed["flash_decode (CUDA graph replay)"] > 0 and timed["flash_decode (Python launch)"] > 0


def test_latency_json_has_a_row_per_length_and_method(tmp_path):
    """The latency sweep's writer on the CPU: fake steps and a fake timer stand in for the GPU."""
    import json

    from utils.course.bench.decoding import LATENCY_COMMAND, latency_path, write_latency

    methods = {"flash_decode (CUDA graph replay)": lambda: 2, "SDPA cuDNN (CUDA graph replay)": lambda: 3}
    path = write_latency(tmp_path, "test", seqlens=(1024, 4096), methods=methods, timer=lambda fn: 5.0 * fn())
    assert path == latency_path(tmp_path, "test")
    result = json.loads(path.read_text())
    assert result["environment"]["command"] == LATENCY_COMMAND
    assert result["shape"] == dict(batch=1, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert result["rows"] == [dict(seqlen_k=n, method=m, us=us) for n in (1024, 4096)
                              for m, us in (("flash_decode (CUDA graph replay)", 10.0),
                                            ("SDPA cuDNN (CUDA graph replay)", 15.0))]


@pytest.mark.gpu
def test_latency_on_gpu(tmp_path):
    """Every step of launch_floor_methods, eager and replayed from a CUDA graph, at two cache lengths."""
    import json

    from utils.course.bench.decoding import write_latency

    rows = json.loads(write_latency(tmp_path, "gpu", seqlens=(1024, 8192)).read_text())["rows"]
    timed = {(r["seqlen_k"], r["method"]): r["us"] for r in rows if "us" in r}
    for n in (1024, 8192):
        for method in ("flash_decode (Python launch)", "flash_decode (CUDA graph replay)",
                       "flash_decode, cache_seqlens (CUDA graph replay)", "SDPA cuDNN"):
            assert timed[(n, method)] > 0


def test_a_failed_method_keeps_its_case():
    from utils.course.bench.decoding import _row

    case = dict(batch=2, seqlen_k=512, heads=4, kv_heads=2, head_dim=64, new_tokens=1, dtype="bfloat16")
    assert _row("SDPA cuDNN", case, "RuntimeError: no kernel", None) == dict(method="SDPA cuDNN", **case,
                                                                            error="RuntimeError: no kernel")
