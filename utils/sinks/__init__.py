"""Attention sinks and sliding windows (notebook 11): a per-head sink logit and a left window, forward,
backward and split-KV decoding."""
