"""Notebook 10: attention beyond the causal mask, from scratch in Triton.

- `mods`: score and mask modifiers (sliding window, ALiBi, soft-capping, documents, prefix-LM) and the float64
  reference;
- `sparsity`: which tiles a mask leaves empty, full or partial, as lists the kernels walk;
- `kernels`: the forward and backward kernels;
- `attention`: `flex_attention` and `flash_varlen`, differentiable.
"""
from utils.flex.attention import flash_varlen, flex_attention
from utils.flex.sparsity import EMPTY, FULL, PARTIAL, BlockMask, block_mask, block_states
from utils.flex.mods import (Modifier, alibi, alibi_slopes, causal, dense_mask, document, document_ids, prefix_lm,
                             reference, sliding_window, softcap)

__all__ = ["flex_attention", "flash_varlen", "BlockMask", "block_mask", "block_states", "EMPTY", "PARTIAL",
           "FULL", "Modifier", "causal", "sliding_window", "alibi", "alibi_slopes", "softcap", "document",
           "document_ids", "prefix_lm", "reference", "dense_mask"]
