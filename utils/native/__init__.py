"""CUDA C++ kernels: their sources (src/), their build and their Python entries."""
