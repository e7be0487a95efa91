"""Gluon kernels, Triton's explicit layer: layouts, barriers and warp roles written out."""
