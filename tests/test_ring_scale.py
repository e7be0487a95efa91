"""Ring attention on paper (utils.ring.scale): every count against a hand computation on small sizes, against
the ring's own tensors and step table, and argument checks."""
import math

import pytest
import torch

from utils.course.bench import attention_flops
from utils.ring.attention import shard, work_per_step
from utils.ring.scale import (break_even_tokens_per_rank, compute_ms, pass_ms, rank_memory, ring_step,
                              slowest_hop, step_bytes, step_flops, tokens_per_rank, transfer_ms)

MIB = 2**20


def test_tokens_per_rank():
    assert tokens_per_rank(2**20, 8) == 131072
    assert tokens_per_rank(48, 3) == 16
    with pytest.raises(ValueError, match="2 × world_size"):
        tokens_per_rank(40, 8)                       # 16 zigzag chunks do not divide 40
    with pytest.raises(TypeError, match="world_size"):
        tokens_per_rank(64, 8.0)
    with pytest.raises(ValueError, match="tokens"):
        tokens_per_rank(0, 2)


def test_rank_memory_by_hand():
    # N=16 over W=2: c=8 tokens per rank; H=4, Hkv=2, D=8; bf16 (2 bytes), fp32 accumulators (4 bytes).
    # Q 8·4·8·2 = 512; one K/V chunk 2·8·2·8·2 = 512; O accumulator 8·4·8·4 = 1024; lse 8·4·4 = 128.
    fwd = rank_memory(16, 4, 2, 8, 2)
    assert fwd == {"Q": 512, "K, V": 512, "K/V in hand": 512, "K/V arriving": 512, "O accumulator (fp32)": 1024,
                   "lse": 128}
    # The backward adds O 512, dO 512, delta 128, dQ 1024 and four fp32 dK/dV accumulators 4·(2·8·2·8·4) = 4096.
    train = rank_memory(16, 4, 2, 8, 2, training=True)
    assert sum(train.values()) == 512 + 512 + 512 + 128 + 512 + 128 + 1024 + 512 + 512 + 4096
    assert train["dK/dV accumulators (4, fp32)"] == 4096
    # notebook 08's 2-GPU run: 64k tokens, 16 heads, d=128: 128 + 256 + 256 + 256 + 256 + 2 MiB
    assert sum(rank_memory(65536, 16, 16, 128, 2).values()) == 1154 * MIB
    assert rank_memory(2**20, 32, 8, 128, 16)["Q"] * 2 == rank_memory(2**20, 32, 8, 128, 8)["Q"]   # 1/W


def test_step_bytes_by_hand_and_against_the_ring_tensors():
    # 1M tokens over 64 ranks: c=16384; K and V of 8 heads × 128 in bf16: 2·16384·8·128·2 = 64 MiB
    assert step_bytes(2**20, 8, 128, 64) == 64 * MIB
    assert step_bytes(2**20, 8, 128, 64, backward=True) == 64 * MIB + 128 * MIB   # + dK/dV in fp32
    # what _ring_forward stacks and sends, and what _ring_backward's accumulator is: the same byte counts
    k = torch.zeros(1, 2, 24, 8, dtype=torch.bfloat16)
    kv = torch.stack([shard(k, 3, 0), shard(k, 3, 0)])
    dkv = torch.zeros(kv.shape, dtype=torch.float32)
    assert step_bytes(24, 2, 8, 3) == kv.nbytes
    assert step_bytes(24, 2, 8, 3, backward=True) == kv.nbytes + dkv.nbytes


def test_step_flops_by_hand_and_summed_over_the_ring():
    # c=8, H=4, D=8: a full block 4·8·8·4·8 = 8192 FLOPs; causal zigzag half; backward 2.5×
    assert step_flops(16, 4, 8, 2, causal=False) == 8192
    assert step_flops(16, 4, 8, 2) == 4096
    assert step_flops(16, 4, 8, 2, backward=True) == 10240
    # zigzag's half block at every step is the ring's own step table
    assert all(w == 0.5 for row in work_per_step(4, causal=True, layout="zigzag") for w in row)
    # W ranks × W steps add up to attention over the whole sequence (utils.course.bench's count)
    for causal in (False, True):
        for mode, backward in (("fwd", False), ("bwd", True)):
            total = 4 * 4 * step_flops(64, 8, 16, 4, causal=causal, backward=backward)
            assert total == attention_flops(1, 8, 64, 64, 16, causal=causal, mode=mode)


def test_times():
    assert compute_ms(1e12, 1.0) == pytest.approx(1000.0)        # 1 TFLOP at 1 TFLOP/s: a second
    assert transfer_ms(1e9, 1.0) == pytest.approx(1000.0)        # 1 GB at 1 GB/s: a second
    assert transfer_ms(64 * MIB, 450) == pytest.approx(67108864 / 450e9 * 1e3)
    for bad, error in ((0, ValueError), (-1.0, ValueError), (math.inf, ValueError), ("fast", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match="tflops"):
            compute_ms(1e12, bad)
        with pytest.raises(error, match="gbps"):
            transfer_ms(1e9, bad)


def test_break_even_by_hand():
    # H=32, Hkv=8, bf16, 500 TFLOP/s, 50 GB/s; per unit of D (it cancels). Forward causal: a step sends
    # 2·8·2 = 32 bytes per token and computes 4·½·32 = 64 FLOPs per token²: c* = 32·500e12 / (64·50e9) = 5000
    assert break_even_tokens_per_rank(32, 8, tflops=500, gbps=50) == pytest.approx(5000)
    # backward: 2·8·(2+4) = 96 bytes per token, 4·½·2.5·32 = 160 FLOPs per token²: 96·500e12/(160·50e9) = 6000
    assert break_even_tokens_per_rank(32, 8, tflops=500, gbps=50, backward=True) == pytest.approx(6000)
    # full attention, no GQA: 2·32·2 = 128 bytes per token, 4·32 = 128 FLOPs per token²: 500e12/50e9 = 10000
    assert break_even_tokens_per_rank(32, 32, tflops=500, gbps=50, causal=False) == pytest.approx(10000)
    # at c = c*, a step's compute and transfer take the same time (N = 2·5000 over 2 ranks)
    compute = compute_ms(step_flops(10000, 32, 128, 2), 500)
    assert compute == pytest.approx(transfer_ms(step_bytes(10000, 8, 128, 2), 50))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        break_even_tokens_per_rank(32, 6, tflops=500, gbps=50)


def test_slowest_hop():
    assert slowest_hop(8, 8, 450, 50) == (450, 0)        # one node: every hop on NVLink
    assert slowest_hop(16, 8, 450, 50) == (50, 2)        # 7 → 8 and 15 → 0 leave the node
    assert slowest_hop(64, 8, 450, 50) == (50, 8)
    assert slowest_hop(12, 8, 450, 50) == (50, 2)        # a partly filled second node
    with pytest.raises(ValueError, match="gpus_per_node"):
        slowest_hop(8, 0, 450, 50)


def test_pass_ms_by_hand():
    assert pass_ms(2.0, 1.0, 4) == 8.0                   # compute-bound: 3 × 2 + the last step's 2
    assert pass_ms(1.0, 3.0, 4) == 10.0                  # transfer-bound: 3 × 3 + 1
    assert pass_ms(5.0, 1.0, 1) == 5.0                   # one rank: no ring
    # backward, W=4, compute 2, K/V 1, dK/dV 2: step 0 max(2, 1) = 2; steps 1, 2 max(2, 1+2) = 3 each;
    # step 3 max(2, 2) = 2; the last accumulator's hop home 2: 2 + 6 + 2 + 2 = 12
    assert pass_ms(2.0, 1.0, 4, dkv=2.0) == 12.0
    with pytest.raises(ValueError, match="kv"):
        pass_ms(1.0, 0.0, 4)


def test_ring_step_at_one_million_tokens():
    # 1M tokens over 64 ranks at 500 TFLOP/s and 50 GB/s: compute ½·4·16384²·32·128 FLOPs = 4.398 ms,
    # transfer 64 MiB = 1.342 ms: hidden, ratio 3.28
    r = ring_step(2**20, 32, 8, 128, 64, tflops=500, gbps=50)
    assert r["tokens_per_rank"] == 16384 and r["bytes"] == 64 * MIB
    assert r["compute_ms"] == pytest.approx(2 * 16384**2 * 32 * 128 / 500e12 * 1e3)
    assert r["comm_ms"] == pytest.approx(67108864 / 50e9 * 1e3)
    assert r["ratio"] == pytest.approx(3.2768) and r["hidden"]
    assert r["pass_ms"] == pytest.approx(64 * r["compute_ms"])     # compute-bound: W steps of compute
    assert r["memory_bytes"] == sum(rank_memory(2**20, 32, 8, 128, 64).values())
    assert r["break_even"] == pytest.approx(5000)
    # without GQA the messages are 4× larger: at 16384 tokens per rank below c* = 20000, not hidden
    mha = ring_step(2**20, 32, 32, 128, 64, tflops=500, gbps=50)
    assert mha["ratio"] == pytest.approx(3.2768 / 4) and not mha["hidden"]
    back = ring_step(2**20, 32, 8, 128, 64, tflops=500, gbps=50, backward=True)
    assert back["bytes"] == 192 * MIB and back["memory_bytes"] > r["memory_bytes"]
