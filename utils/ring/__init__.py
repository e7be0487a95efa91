"""Ring attention across GPUs and its scaling model."""
