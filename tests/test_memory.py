import pytest
import torch

from utils.course.memory import AllocationTracker, peak_memory
from utils.eager.reference import naive_attention
from utils.course.testing import random_qkv


def test_tracker_counts_new_tensors_and_frees():
    x = torch.ones(1000)                              # allocated before: not counted
    with AllocationTracker() as tracker:
        y = x * 2                                     # 4000 bytes
        z = y.view(10, 100)                           # a view: no new memory
        del y, z
        w = x + 1                                     # the first buffer is dead: live stays at one buffer
    assert tracker.peak == 4000 and tracker.current == 4000
    assert [entry[0] for entry in tracker.log] == ["mul", "add"]
    del w


def test_peak_memory_of_naive_attention_is_quadratic():
    def peak(n):
        q, k, v = random_qkv(1, 1, n, n, 32)
        return peak_memory(naive_attention, q, k, v)

    small, large = peak(128), peak(256)
    assert 3.5 < large / small < 4.5                 # the N×N matrices dominate
    assert large >= 2 * 256 * 256 * 4                # at least S and P in fp32


def test_peak_memory_validates():
    with pytest.raises(TypeError):
        peak_memory("not callable")


@pytest.mark.gpu
def test_peak_memory_on_gpu_matches_the_allocator_scale():
    q, k, v = random_qkv(1, 1, 1024, 1024, 64, device="cuda")
    assert peak_memory(naive_attention, q, k, v) >= 2 * 1024 * 1024 * 4
