"""CUDA backend of maco.kernels: generated kernels compiled through CuPy and launched on CuPy
arrays or torch CUDA tensors (DLPack, no copies).

CuPy is imported only when a kernel is built or run, so importing maco never needs it; without
CuPy or a GPU those calls raise a MacoError that says which is missing.

    kernel = compile_cuda(spec, schedule, bias=True, relu=True)
    conv = kernel.bind(weight, bias)          # torch layout (K, C/groups, kh, kw), packed once
    y = conv(x)                               # x in schedule.layout, on the GPU
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from maco.core.errors import MacoError
from maco.kernels import cuda_build
from maco.kernels.api import check_binding
from maco.kernels.cuda_codegen import KERNEL_NAME, CudaPlan, pack_weight, plan as make_plan
from maco.kernels.cuda_schedule import candidates, default_schedule as _default_schedule
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target

__all__ = ["CudaKernel", "CudaConv", "compile_cuda", "default_schedule", "candidates", "prebuild",
           "cupy_module", "gpu_available"]

_MODULES: dict[str, Any] = {}  # cubin path or source hash -> cupy RawModule
_PREBUILT: dict[str, cuda_build.Built] = {}  # source hash -> cubin from a batch build


def cupy_module() -> Any:
    """CuPy, with a usable GPU, or a MacoError naming what is missing."""
    try:
        import cupy
    except ImportError as exc:
        raise MacoError("the CUDA backend needs CuPy: pip install 'maco[cuda]' (cupy-cuda13x) or "
                        f"'maco[cuda12]' (import failed: {exc})") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError when no driver is present
        raise MacoError(f"the CUDA backend found no usable GPU ({exc})") from None
    if count < 1:
        raise MacoError("the CUDA backend found no GPU (CUDA device count is 0)")
    return cupy


def gpu_available() -> bool:
    try:
        cupy_module()
        return True
    except MacoError:
        return False


def require_gpu(what: str = "--target cuda") -> None:
    """MacoError unless an NVIDIA GPU is usable through CuPy: fail before any work is queued."""
    if not gpu_available():
        raise MacoError(f"{what} needs an NVIDIA GPU with CuPy; none is usable here (install "
                        "maco[cuda] on a GPU machine, or use --target cpu)")


def device_arch() -> str:
    """sm_XY of the current device."""
    return "sm_" + str(cupy_module().cuda.Device().compute_capability)


def default_schedule(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW") -> Schedule:
    """The default GPU schedule (the cost model's best of the MACO-tiled family)."""
    if target is not None and target.kind != "cuda":
        raise MacoError(f"default_schedule for the CUDA backend needs a cuda Target, got {target.name!r}")
    return _default_schedule(spec, target, layout)


def prebuild(plans: list[CudaPlan], out_dir: str | Path | None = None, jobs: int | None = None,
             arch: str | None = None) -> dict[str, cuda_build.Built]:
    """Compile many kernels with parallel nvcc for this GPU; later builds of these plans load
    the cubins instead of running NVRTC one by one."""
    built = cuda_build.build(plans, out_dir, arch or device_arch(), jobs=jobs)
    _PREBUILT.update(built)
    return built


class CudaKernel:
    """A compiled convolution for one spec and schedule (the CUDA side of maco.kernels.compile)."""

    target = "cuda"

    def __init__(self, plan: CudaPlan):
        self.plan = plan
        self._function: Any = None

    spec = property(lambda self: self.plan.spec)
    schedule = property(lambda self: self.plan.schedule)
    layout = property(lambda self: self.plan.schedule.layout)
    has_bias = property(lambda self: self.plan.bias)
    relu = property(lambda self: self.plan.relu)
    residual = property(lambda self: self.plan.residual)

    @property
    def source(self) -> str:
        return self.plan.source()

    def __repr__(self) -> str:
        return f"CudaKernel({self.spec}, {self.layout}, {self.plan.blocks} blocks x {self.plan.threads} threads)"

    def build(self) -> Any:
        """Load (prebuilt cubin) or compile (NVRTC, strict fp32: no fast-math) the kernel once."""
        if self._function is not None:
            return self._function
        cupy = cupy_module()
        key = self.plan.source_hash
        pre = _PREBUILT.get(key)
        if pre is not None:
            mod_key, name = str(pre.cubin), pre.name
            if mod_key not in _MODULES:
                _MODULES[mod_key] = cupy.RawModule(path=mod_key)
        else:
            mod_key, name = key, KERNEL_NAME
            if mod_key not in _MODULES:
                try:
                    _MODULES[mod_key] = cupy.RawModule(code=self.source, options=("-std=c++17",),
                                                       backend="nvrtc")
                except cupy.cuda.compiler.CompileException as exc:
                    raise MacoError(f"NVRTC failed on the kernel for {self.spec}: {exc}") from None
        fn = _MODULES[mod_key].get_function(name)
        if self.plan.smem_bytes > 48 << 10:
            fn.max_dynamic_shared_size_bytes = self.plan.smem_bytes
        self._function = fn
        return fn

    def bind(self, weight: Any, bias: Any = None) -> "CudaConv":
        """Weights in torch layout (K, C/groups, kh, kw) as a torch tensor, CuPy or NumPy array;
        packed and copied to the GPU once."""
        cupy = cupy_module()
        w = _to_cupy(weight, "weight")
        b = None if bias is None else cupy.ascontiguousarray(_to_cupy(bias, "bias"))
        check_binding(self.spec, self.has_bias, w.shape, None if b is None else b.shape)
        packed = pack_weight(self.plan, w, xp=cupy)
        self.build()
        return CudaConv(self, packed, b)


class CudaConv:
    """A kernel with its weights on the GPU; call it on an input in the kernel's layout."""

    def __init__(self, kernel: CudaKernel, packed_weight: Any, bias: Any):
        self.kernel = kernel
        self.weight = packed_weight
        self.bias = bias

    def __call__(self, x: Any, residual: Any = None, out: Any = None) -> Any:
        """y = relu?(conv(x) + bias? + residual?). x, residual, out: torch CUDA tensors with the
        logical NCHW shape (channels_last memory for NHWC), or CuPy arrays in the layout's own
        shape ((N, C, H, W) or (N, H, W, C)), C-contiguous. Returns the same kind as x."""
        on = contextlib.nullcontext()
        if type(x).__module__.startswith("torch") and x.is_cuda:
            import torch

            stream = torch.cuda.current_stream(x.device).cuda_stream
            if stream:  # torch's stream, also for the DLPack views: no cross-stream sync, so a CUDA graph can capture it
                on = cupy_module().cuda.ExternalStream(stream)
        with on:
            launch, out = self._prepare(x, residual, out)
            launch()
        return out

    run_tensor = __call__  # a model's per-call path (layouts.maco_modules.MacoConv2d)

    def output(self) -> Any:
        """A new torch CUDA output tensor: the logical shape, the kernel's memory format."""
        import torch

        fmt = torch.channels_last if self.kernel.layout == "NHWC" else torch.contiguous_format
        return torch.empty(self.kernel.spec.output_shape, device="cuda", memory_format=fmt)

    def prepare(self, x: Any, residual: Any = None, out: Any = None) -> Callable[[], None]:
        """A no-argument launcher with every check and conversion done up front (for timing
        loops: it launches on CuPy's current stream and costs one kernel launch)."""
        return self._prepare(x, residual, out)[0]

    def _prepare(self, x: Any, residual: Any, out: Any) -> tuple[Callable[[], None], Any]:
        cupy = cupy_module()
        k = self.kernel
        spec, nhwc = k.spec, k.layout == "NHWC"
        xc = _activation(x, spec.input_shape, nhwc, "input")
        if k.residual and residual is None:
            raise MacoError(f"the kernel for {spec} was compiled with residual=True but got no residual")
        if not k.residual and residual is not None:
            raise MacoError(f"the kernel for {spec} was compiled with residual=False but got a residual")
        rc = _activation(residual, spec.output_shape, nhwc, "residual") if residual is not None else None
        if out is None:
            if type(x).__module__.startswith("torch"):
                import torch

                out = torch.empty(spec.output_shape, device=x.device, dtype=torch.float32,
                                  memory_format=torch.channels_last if nhwc else torch.contiguous_format)
            else:
                n, kk, oh, ow = spec.output_shape
                out = cupy.empty((n, oh, ow, kk) if nhwc else (n, kk, oh, ow), dtype=cupy.float32)
        yc = _activation(out, spec.output_shape, nhwc, "out")
        if k.plan.vec_store == 4:
            for what, arr in (("out", yc), ("residual", rc)):
                if arr is not None and arr.data.ptr % 16:
                    raise MacoError(f"{what} must be 16-byte aligned for this kernel's vector stores "
                                    f"(address {arr.data.ptr:#x})")
        args = (xc, self.weight, self.bias if self.bias is not None else xc,
                rc if rc is not None else xc, yc)
        fn, p = k.build(), k.plan
        grid, block, smem = (p.blocks,), (p.threads,), p.smem_bytes

        def launch() -> None:
            fn(grid, block, args, shared_mem=smem)

        return launch, out


def compile_cuda(spec: ConvSpec, schedule: Schedule | None = None, *, bias: bool = False,
                 relu: bool = False, residual: bool = False, layout: str = "NCHW") -> CudaKernel:
    """A CUDA kernel for `spec` (the default schedule when none is given; `layout` only picks the
    default's layout). The schedule is validated here; CuPy is needed only from bind() on."""
    if schedule is None:
        schedule = default_schedule(spec, Target.h100(), layout)
    return CudaKernel(make_plan(spec, schedule, bias=bias, relu=relu, residual=residual))


# -- array plumbing ----------------------------------------------------------------------------
def _to_cupy(a: Any, what: str) -> Any:
    """A CuPy view of a torch tensor (DLPack, on the GPU) or a CuPy / NumPy array, float32."""
    cupy = cupy_module()
    mod = type(a).__module__
    if mod.startswith("torch"):
        a = a.detach()
        if not a.is_cuda:
            a = a.contiguous().numpy()
        else:
            a = cupy.from_dlpack(a)
    if not isinstance(a, cupy.ndarray):
        a = cupy.asarray(a)
    if a.dtype != cupy.float32:
        raise MacoError(f"{what} must be float32, got {a.dtype}")
    return a


def _activation(a: Any, logical: tuple[int, int, int, int], nhwc: bool, what: str) -> Any:
    """The CuPy view the kernel reads or writes, after checking shape, dtype, device and layout."""
    cupy = cupy_module()
    n, c, h, w = logical
    if type(a).__module__.startswith("torch"):
        import torch

        if not a.is_cuda:
            raise MacoError(f"{what} is a CPU tensor; the CUDA kernel needs it on the GPU (.cuda())")
        if a.dtype != torch.float32:
            raise MacoError(f"{what} must be float32, got {a.dtype}")
        if tuple(a.shape) != logical:
            raise MacoError(f"{what} has shape {tuple(a.shape)}, expected {logical}")
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        if not a.is_contiguous(memory_format=fmt):
            raise MacoError(f"{what} must be {'channels_last (NHWC)' if nhwc else 'contiguous NCHW'} "
                            f"for this kernel; got strides {a.stride()}")
        view = cupy.from_dlpack(a.detach())
        return view.transpose(0, 2, 3, 1) if nhwc else view  # the physical order, C-contiguous
    if not isinstance(a, cupy.ndarray):
        raise MacoError(f"{what} must be a CuPy array or a torch CUDA tensor, got {type(a).__name__}")
    if a.dtype != cupy.float32:
        raise MacoError(f"{what} must be float32, got {a.dtype}")
    physical = (n, h, w, c) if nhwc else logical
    if tuple(a.shape) != physical:
        raise MacoError(f"{what} has shape {tuple(a.shape)}, expected {physical} "
                        f"({'NHWC' if nhwc else 'NCHW'} layout)")
    if not a.flags.c_contiguous:
        raise MacoError(f"{what} must be C-contiguous")
    if a.device.id != cupy.cuda.Device().id:
        raise MacoError(f"{what} is on GPU {a.device.id}, the kernel runs on GPU {cupy.cuda.Device().id}")
    return a
