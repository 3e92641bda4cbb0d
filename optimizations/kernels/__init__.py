"""Triton kernels (imported only when a plan asks for them: they import triton)."""
