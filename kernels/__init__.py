"""Kernels: C and CUDA code generation, build cache, runners and vendor baselines."""
