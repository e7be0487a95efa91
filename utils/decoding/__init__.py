"""Attention for decoding: split-KV (flash decoding) and the paged KV cache."""
