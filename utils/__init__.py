"""Shared code of the FlashAttention-from-scratch course.

Nothing is imported here on purpose: modules that define Triton kernels must be imported only after
`utils.course.bootstrap.setup()` (or tests/conftest.py) has decided whether TRITON_INTERPRET is on.
"""
