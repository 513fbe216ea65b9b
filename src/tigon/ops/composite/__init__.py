"""Ops that are cuBLAS choreography around tigon's kernels (or around none): LoRA linears and their
groups, linear groups, and the gated MLPs. Each is an autograd Function of torch GEMMs that calls
the Triton ops' launchers where it needs a kernel, dispatched like every op."""
