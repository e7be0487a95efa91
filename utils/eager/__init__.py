"""Attention in eager PyTorch: reference, softmax, multi-head, FlashAttention forward and backward."""
