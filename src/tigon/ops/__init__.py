"""Fused Triton kernels, one op per file, each with its PyTorch reference and autograd Function."""
