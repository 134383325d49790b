"""The backend-neutral entry points: compile, build_many, default_schedule.

`target` picks the backend: "cpu"/"host" or a cpu Target -> generated C (maco.kernels.cpu);
"cuda"/"h100" or a cuda Target -> maco.kernels.cuda (imported only then).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from maco.core.errors import MacoError
from maco.kernels.epilogue import activation_of
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target


class BoundKernel(Protocol):
    """A compiled kernel with its weights packed: what callers run (CpuConv, CudaConv)."""

    def __call__(self, x: Any, residual: Any = None, out: Any = None) -> Any:
        """act(conv(x) + bias? + residual?), torch in torch out, numpy in numpy out."""

    def prepare(self, x: Any, residual: Any = None, out: Any = None) -> Callable[[], None]:
        """A zero-argument call on these buffers with every check done up front (for timers)."""


class CompiledKernel(Protocol):
    """A built kernel for one spec, schedule and epilogue (CpuKernel, CudaKernel)."""

    @property
    def spec(self) -> ConvSpec: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def source(self) -> str: ...

    def bind(self, weight: Any, bias: Any = None) -> BoundKernel:
        """Pack the weights once for this kernel's layout and blocking."""


def check_binding(spec: ConvSpec, has_bias: bool, weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None) -> None:
    """What bind() checks on every backend, naming the value: weights of the spec's shape (K,
    C/groups, kh, kw), and a bias of K values exactly where the kernel was compiled with one."""
    if tuple(weight_shape) != spec.weight_shape:
        raise MacoError(f"weight has shape {tuple(weight_shape)}, expected {spec.weight_shape} for {spec}")
    if has_bias and bias_shape is None:
        raise MacoError(f"the kernel for {spec} was compiled with bias=True but bind() got no bias")
    if not has_bias and bias_shape is not None:
        raise MacoError(f"the kernel for {spec} was compiled with bias=False but bind() got a bias")
    if bias_shape is not None and tuple(bias_shape) != (spec.k,):
        raise MacoError(f"bias has shape {tuple(bias_shape)}, expected ({spec.k},)")


def host_target() -> Target:
    """This CPU as MACO's kernels run on it inside torch: with torch's intra-op thread count."""
    return Target.host(_torch_threads())


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def resolve_target(target: Any) -> Target:
    if target is None:
        return host_target()
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        return Target.named(target, _torch_threads())
    raise MacoError(f"target must be a name (cpu, host, cuda, h100) or a maco.Target, got {target!r}")


def compile(spec: ConvSpec, schedule: Schedule | None = None, target: Any = "cpu", *, bias: bool = False,
            relu: bool = False, residual: bool = False, activation: str | None = None,
            input_layout: str | None = None) -> CompiledKernel:  # noqa: A001 - the public name
    """A built kernel for `spec` with `schedule` (the default schedule when None); call
    .bind(weight, bias) on it. The epilogue adds the bias, then the residual, then applies the
    activation (kernels.epilogue.ACTIVATIONS; relu=True is "relu"). `input_layout` ("NCHW" or
    "NHWC", CPU only) reads the input in that layout where it is not the schedule's: an NHWC conv
    reading an NCHW tensor needs no conversion before it. MacoError lists the schedule's
    problems when it is invalid."""
    tgt = resolve_target(target)
    if not isinstance(spec, ConvSpec):
        raise MacoError(f"spec must be a maco.ConvSpec, got {type(spec).__name__}")
    act = activation_of(relu, activation)
    if tgt.kind == "cuda":
        from maco.kernels.cuda import compile_cuda

        if act not in ("none", "relu"):
            raise MacoError(f"the CUDA backend fuses relu only, not {act!r}")
        if input_layout is not None:
            raise MacoError("the CUDA backend reads its input in the schedule's layout: input_layout is CPU only")
        return compile_cuda(spec, schedule, bias=bias, relu=act == "relu", residual=residual)
    from maco.kernels.cpu import compile_cpu

    if schedule is None:
        schedule = default_schedule(spec, tgt)
    if not isinstance(schedule, Schedule):
        raise MacoError(f"schedule must be a maco.Schedule, got {type(schedule).__name__}")
    return compile_cpu(spec, schedule, tgt, bias=bias, activation=act, residual=residual, input_layout=input_layout)


def build_many(spec: ConvSpec, schedules: list[Schedule], target: Any = None, *,
               timeout: float = 300.0, **epilogue: Any) -> list[CompiledKernel | MacoError]:
    """Kernels for many schedules of one spec, compiled in parallel through the disk cache; a
    schedule that is invalid or does not compile (within `timeout` seconds on CPU) gives its
    MacoError in place of the kernel."""
    tgt = resolve_target(target)
    epilogue = dict(epilogue)
    act = activation_of(epilogue.pop("relu", False), epilogue.pop("activation", None))
    if tgt.kind == "cuda":

        out: list[CompiledKernel | MacoError] = []
        for schedule in schedules:
            try:
                out.append(compile(spec, schedule, tgt, activation=act, **epilogue))
            except MacoError as exc:
                out.append(exc)
        return out
    from maco.kernels.cpu import build_many_cpu

    return build_many_cpu(spec, list(schedules), tgt, timeout=timeout, activation=act, **epilogue)


def default_schedule(spec: ConvSpec, target: Any = None, layout: str = "NCHW") -> Schedule:
    """The MACO-tiled schedule without search (CPU; the host when target is None)."""
    tgt = resolve_target(target)
    if tgt.kind == "cuda":
        from maco.kernels.cuda import default_schedule as cuda_default

        return cuda_default(spec, tgt, layout)
    from maco.kernels.cpu_default import default_schedule as cpu_default

    return cpu_default(spec, tgt, layout)


def measure_peak(target: Any = None, fresh: bool = False, kind: str = "fma") -> float:
    """Measured fp32 ceiling in GFLOP/s of a CPU target on all its cores: "fma" (the FMA peak) or
    "microkernel" (a conv register tile's loads and FMAs in L1); cached per host, `fresh`
    measures again and keeps the best seen."""
    from maco.kernels.cpu_peak import measure_peak as peak

    return peak(resolve_target(target), fresh, kind)
