"""Kernels: C and CUDA code generation, build cache, runners and vendor baselines.

    kernel = maco.kernels.compile(spec, schedule, target="cpu", bias=False, relu=False, residual=False)
    conv = kernel.bind(weight, bias)          # packs the weights once
    y = conv(x, residual=None, out=None)      # numpy or torch, in the schedule's layout
    fn = conv.prepare(x, out=y)               # what a timer calls

Importing this package is light: gcc runs on compile/build_many, CuPy loads only for CUDA targets.
"""
from maco.kernels.api import (BoundKernel, CompiledKernel, build_many, compile, default_schedule, host_target,
                              measure_peak, resolve_target)

__all__ = ["BoundKernel", "CompiledKernel", "build_many", "compile", "default_schedule", "host_target",
           "measure_peak", "resolve_target"]
