"""FP8 (e4m3) attention forward: per-block scales and an optional Hadamard rotation (notebook 11)."""
