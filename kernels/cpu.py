"""CPU backend of maco.kernels: generated C (OpenMP + SIMD) built by gcc, called through ctypes.

    kernel = compile_cpu(spec, schedule, bias=True, activation="relu")
    conv = kernel.bind(weight, bias)     # torch layout (K, C/groups, kh, kw), packed once
    y = conv(x)                          # numpy or CPU torch, in the schedule's layout
    fn = conv.prepare(x, out=y)          # zero-argument call for timing loops
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable

import numpy as np

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.api import check_binding
from maco.kernels.aligned import aligned_empty
from maco.kernels.cpu_codegen import FUNCTION, CpuPlan
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target

__all__ = ["CpuKernel", "CpuConv", "compile_cpu", "build_many_cpu"]


class CpuKernel:
    """A compiled convolution for one spec, schedule and epilogue on a CPU target."""

    def __init__(self, plan: CpuPlan, so: Path | None = None):
        self.plan = plan
        self.flags = cpu_build.flags_for(plan.target)
        self.so = so
        self._fn: Any = None

    spec = property(lambda self: self.plan.spec)
    schedule = property(lambda self: self.plan.schedule)
    target = property(lambda self: self.plan.target)
    layout = property(lambda self: self.plan.schedule.layout)
    has_bias = property(lambda self: self.plan.bias)
    activation = property(lambda self: self.plan.activation)
    residual = property(lambda self: self.plan.residual)
    input_layout = property(lambda self: self.plan.reads)

    @property
    def source(self) -> str:
        return self.plan.source

    @property
    def flavour(self) -> str:
        return self.plan.intrinsics or "portable"

    def __repr__(self) -> str:
        return f"CpuKernel({self.spec}, {self.layout}, {self.flavour}, {self.plan.threads} threads)"

    def build(self) -> Path:
        if self.so is None:
            self.so = cpu_build.build(self.source, self.flags)
        return self.so

    def function(self) -> Any:
        if self._fn is None:
            fn = cpu_build.load(self.build(), FUNCTION)
            fn.argtypes = [ctypes.c_void_p] * 5
            self._fn = fn
        return self._fn

    def bind(self, weight: Any, bias: Any = None) -> "CpuConv":
        """Weights in torch layout (K, C/groups, kh, kw), torch or numpy float32; packed once."""
        w = _numpy(weight, "weight")
        b = None if bias is None else np.ascontiguousarray(_numpy(bias, "bias"))
        check_binding(self.spec, self.has_bias, w.shape, None if b is None else b.shape)
        self.function()
        return CpuConv(self, self.plan.pack_weight(w), b)


class CpuConv:
    """A CPU kernel with its packed weights; call it on inputs in the kernel's layout."""

    def __init__(self, kernel: CpuKernel, packed_weight: np.ndarray, bias: np.ndarray | None):
        self.kernel = kernel
        self.weight = packed_weight
        self.bias = bias

    def __call__(self, x: Any, residual: Any = None, out: Any = None) -> Any:
        """y = act(conv(x) + bias? + residual?). NCHW kernels: (N, C, H, W) arrays or contiguous
        tensors; NHWC kernels: (N, H, W, C) arrays or channels_last tensors of logical shape
        (N, C, H, W). Returns the same kind as x (torch in, torch out)."""
        run, y = self._prepare(x, residual, out, convert=True)
        run()
        return y

    def run_tensor(self, x: Any, residual: Any = None, out: Any = None) -> Any:
        """The kernel on CPU float32 tensors already of the spec's shapes and in the kernel's memory
        format, into `out` (a new tensor when None): a model's per-call path (MacoConv2d checks
        its tensors first), without __call__'s checks, which cost ~12 us of Python a call, 2-5%
        of a 0.6 ms layer."""
        k = self.kernel
        if k.residual != (residual is not None):
            raise MacoError(f"the kernel for {k.spec} was compiled with residual={k.residual}")
        if out is None:
            out = _torch_output(k.spec, k.layout == "NHWC")
        k.function()(x.data_ptr(), self.weight.ctypes.data,
                     None if self.bias is None else self.bias.ctypes.data,
                     None if residual is None else residual.data_ptr(), out.data_ptr())
        return out

    def output(self) -> Any:
        """A new output tensor for this kernel (the logical shape, the kernel's memory format)."""
        return _torch_output(self.kernel.spec, self.kernel.layout == "NHWC")

    def prepare(self, x: Any, residual: Any = None, out: Any = None) -> Callable[[], None]:
        """A zero-argument call on these buffers, every check done up front (for timers)."""
        return self._prepare(x, residual, out, convert=True)[0]

    def _prepare(self, x: Any, residual: Any, out: Any, convert: bool) -> tuple[Callable[[], None], Any]:
        k = self.kernel
        spec, nhwc = k.spec, k.layout == "NHWC"
        if k.residual and residual is None:
            raise MacoError(f"the kernel for {spec} was compiled with residual=True but got no residual")
        if not k.residual and residual is not None:
            raise MacoError(f"the kernel for {spec} was compiled with residual=False but got a residual")
        torch_in = _is_torch(x)
        xs = _activation(x, spec.input_shape, k.plan.input_nhwc, "input", convert)
        rs = _activation(residual, spec.output_shape, nhwc, "residual", convert) if residual is not None else None
        if out is None:
            if torch_in:
                out = _torch_output(spec, nhwc)
            else:
                n, kk, oh, ow = spec.output_shape
                out = aligned_empty((n, oh, ow, kk) if nhwc else (n, kk, oh, ow))
        ys = _activation(out, spec.output_shape, nhwc, "out", convert=False)
        keep = (xs, rs, ys, self.weight, self.bias)  # the closure owns its buffers
        fn = k.function()
        args = (_ptr(xs), self.weight.ctypes.data, _ptr(self.bias) if self.bias is not None else None,
                _ptr(rs) if rs is not None else None, _ptr(ys))

        def run() -> None:
            fn(*args)
            del_guard = keep  # noqa: F841 - keeps the buffers alive as long as the closure

        return run, out


def compile_cpu(spec: ConvSpec, schedule: Schedule, target: Target, *, bias: bool = False,
                activation: str = "none", residual: bool = False, input_layout: str | None = None) -> CpuKernel:
    """Generate and build (or fetch from the cache) the kernel; MacoError on an invalid schedule
    (its problems listed) or a compiler error (gcc's message). `input_layout`: the layout the
    input is read in, where it is not the schedule's."""
    kernel = CpuKernel(CpuPlan(spec, schedule, target, bias, activation, residual, input_layout))
    kernel.build()
    return kernel


def build_many_cpu(spec: ConvSpec, schedules: list[Schedule], target: Target, *, bias: bool = False,
                   activation: str = "none", residual: bool = False,
                   timeout: float = 300.0) -> list[CpuKernel | MacoError]:
    """Kernels for many schedules, gcc running in parallel (each for at most `timeout` seconds);
    a failure is its MacoError in place."""
    out: list[CpuKernel | MacoError] = []
    for schedule in schedules:
        try:
            out.append(CpuKernel(CpuPlan(spec, schedule, target, bias, activation, residual)))
        except MacoError as exc:
            out.append(exc)
    todo = [k for k in out if isinstance(k, CpuKernel)]
    built = cpu_build.build_parallel([(k.source, k.flags) for k in todo], timeout=timeout)
    by_id = {id(k): so for k, so in zip(todo, built)}
    result: list[CpuKernel | MacoError] = []
    for k in out:
        if isinstance(k, CpuKernel):
            so = by_id[id(k)]
            if isinstance(so, MacoError):
                result.append(so)
                continue
            k.so = so
        result.append(k)
    return result


# -- array plumbing --------------------------------------------------------------------------
def _torch_output(spec: ConvSpec, nhwc: bool) -> Any:
    """A new output tensor of logical shape (N, K, OH, OW) in the kernel's memory format."""
    import torch

    return torch.empty(spec.output_shape, dtype=torch.float32,
                       memory_format=torch.channels_last if nhwc else torch.contiguous_format)


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def _ptr(a: Any) -> int:
    return a.data_ptr() if _is_torch(a) else a.ctypes.data


def _numpy(a: Any, what: str) -> np.ndarray:
    if _is_torch(a):
        a = a.detach()
        if a.device.type != "cpu":
            raise MacoError(f"{what} is on {a.device}; the CPU kernel needs a CPU tensor")
        a = a.contiguous().numpy()
    if not isinstance(a, np.ndarray):
        raise MacoError(f"{what} must be a numpy array or a torch tensor, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise MacoError(f"{what} must be float32, got {a.dtype}")
    return a


def _activation(a: Any, logical: tuple[int, int, int, int], nhwc: bool, what: str, convert: bool) -> Any:
    """The buffer the kernel reads or writes, checked for kind, dtype, shape and layout; inputs
    in another memory order are copied once when `convert`, outputs never are."""
    n, c, h, w = logical
    layout = "NHWC" if nhwc else "NCHW"
    if _is_torch(a):
        import torch

        if a.device.type != "cpu":
            raise MacoError(f"{what} is on {a.device}; the CPU kernel needs a CPU tensor")
        if a.dtype != torch.float32:
            raise MacoError(f"{what} must be float32, got {a.dtype}")
        if tuple(a.shape) != logical:
            raise MacoError(f"{what} has shape {tuple(a.shape)}, expected {logical} (logical NCHW)")
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        if not a.is_contiguous(memory_format=fmt):
            if not convert:
                raise MacoError(f"{what} must be {'channels_last' if nhwc else 'contiguous NCHW'} for "
                                f"this {layout} kernel; got strides {a.stride()}")
            a = a.contiguous(memory_format=fmt)
        return a.detach()
    if not isinstance(a, np.ndarray):
        raise MacoError(f"{what} must be a numpy array or a CPU torch tensor, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise MacoError(f"{what} must be float32, got {a.dtype}")
    physical = (n, h, w, c) if nhwc else logical
    if a.shape != physical:
        raise MacoError(f"{what} has shape {a.shape}, expected {physical} ({layout} layout)")
    if not a.flags.c_contiguous:
        if not convert:
            raise MacoError(f"{what} must be C-contiguous")
        a = np.ascontiguousarray(a)
    if not a.flags.writeable and what == "out":
        raise MacoError("out is read-only")
    return a
