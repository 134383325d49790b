"""MACO kernels inside a torch model: a conv (with its fused bias, residual and activation) that runs
a compiled kernel, and the swap of a planned model's convs for them where a tuned schedule won.

A swapped conv whose output stays inside the model writes into a buffer it owns, reused every
call: no allocation per call, one memory plan per graph and input shape. Such a model runs one
call at a time (as the tensors it hands back never alias those buffers, its outputs stay valid).
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

from maco import kernels
from maco.kernels.epilogue import ACTIVATIONS
from maco.kernels.linear import compile_linear
from maco.core.errors import MacoError
from maco.kernels.depthwise import MAX_TAPS, DepthwiseKernel, DepthwisePlan, is_depthwise
from maco.kernels.inverted_residual import BlockKernel, BlockPlan
from maco.kernels.pool import PoolKernel, plan_for
from maco.kernels.squeeze_excite import SqueezeKernel, SqueezePlan
from maco.kernels.winograd import WinogradKernel, WinogradPlan, direct, winograd_can_run
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target

from maco.layouts.fusion import FusedConv2d, adds_residual
from maco.layouts.latency import memory_format

if TYPE_CHECKING:
    from maco.layouts import LayoutPlan

# Ops whose output is a new tensor, never a view of (or the same tensor as) an input.
FRESH_MODULES = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
                 nn.AdaptiveMaxPool2d)
FRESH_FUNCTIONS = {operator.add, torch.add, torch.cat, F.linear, F.conv2d, F.adaptive_avg_pool2d,
                   F.max_pool2d, F.avg_pool2d}


def epilogue_of(conv: nn.Conv2d) -> tuple[str, str]:
    """(activation, residual) a conv module carries: a FusedConv2d's, else none."""
    return (conv.activation, conv.residual) if isinstance(conv, FusedConv2d) else ("none", "none")


def kernel_can_run(conv: nn.Conv2d, target: Target | None = None) -> bool:
    """Whether a generated kernel computes this module's epilogue (bias, a residual added before
    the activation, an activation of kernels.epilogue.ACTIVATIONS; on CUDA relu alone)."""
    activation, residual = epilogue_of(conv)
    acts = ("none", "relu") if target is not None and target.kind == "cuda" else ACTIVATIONS
    return activation in acts and residual in ("none", "before") and conv.padding_mode == "zeros"


class MacoConv2d(nn.Module):
    """`conv` (a Conv2d or FusedConv2d) run by a compiled MACO kernel for the one input shape it
    was tuned for, on the target's device (a CPU or a CUDA GPU); any other input runs `conv`
    itself, with the same weights. `input_layout` (CPU): the layout it reads its input in, where
    that is not the schedule's (fold_input_conversion)."""

    maco_leaf = True

    def __init__(self, conv: nn.Conv2d, spec: ConvSpec, schedule: Schedule, target: Target,
                 preallocate: bool = False, input_layout: str | None = None):
        super().__init__()
        activation, residual = epilogue_of(conv)
        self.spec, self.layout, self.torch_conv = spec, schedule.layout, conv
        self.input_layout = input_layout or self.layout
        self._kernel = kernels.compile(spec, schedule, target=target, bias=conv.bias is not None,
                                       activation=activation, residual=residual == "before",
                                       input_layout=None if self.input_layout == self.layout else self.input_layout)
        self._conv = self._kernel.bind(conv.weight.detach(), None if conv.bias is None else conv.bias.detach())
        self._format = memory_format(self.layout)
        self._in_format = memory_format(self.input_layout)
        self._device = target.device
        self._out = self._conv.output() if preallocate else None

    @property
    def preallocated(self) -> bool:
        return self._out is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        if (tuple(x.shape) != s.input_shape or x.dtype != torch.float32 or x.device.type != self._device
                or (residual is not None and (tuple(residual.shape) != s.output_shape
                                              or residual.dtype != torch.float32))):
            return self.torch_conv(x) if residual is None else self.torch_conv(x, residual)
        if residual is not None:
            residual = residual.contiguous(memory_format=self._format)
        return self._conv.run_tensor(x.contiguous(memory_format=self._in_format), residual, self._out)

    def extra_repr(self) -> str:
        activation, residual = epilogue_of(self.torch_conv)
        reads = f", input_layout={self.input_layout}" if self.input_layout != self.layout else ""
        return (f"{self.spec}, layout={self.layout}{reads}, activation={activation}, residual={residual}, "
                f"preallocated={self.preallocated}")


class MacoLinear(nn.Module):
    """`linear` (a Linear or FusedLinear) run by a generated memory-speed kernel for the one input
    shape it was built for (kernels.linear); any other input runs `linear` itself."""

    maco_leaf = True

    def __init__(self, linear: nn.Linear, batch: int, target: Target, preallocate: bool = False):
        super().__init__()
        if adds_residual(linear):
            raise MacoError("a linear with a residual add runs as a 1x1 conv on (N, H, W, C) inputs only, "
                            "not on (batch, features) ones")
        self.torch_linear, self.batch = linear, batch
        self._kernel = compile_linear(batch, linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      activation=getattr(linear, "activation", "none"), target=target)
        self._weight = linear.weight.detach().contiguous()
        self._bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self._shape = (batch, linear.in_features)
        self._out = torch.empty(batch, linear.out_features) if preallocate else None

    @property
    def preallocated(self) -> bool:
        return self._out is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) != self._shape or x.dtype != torch.float32 or x.device.type != "cpu":
            return self.torch_linear(x)
        out = self._out if self._out is not None else torch.empty(self.batch, self.torch_linear.out_features)
        self._kernel(x.contiguous(), self._weight, self._bias, out)
        return out

    def extra_repr(self) -> str:
        return (f"batch {self.batch}, {self.torch_linear.in_features} -> {self.torch_linear.out_features}, "
                f"activation={getattr(self.torch_linear, 'activation', 'none')}, preallocated={self.preallocated}")


class MacoLinearAsConv(nn.Module):
    """`linear` (a Linear or FusedLinear) applied over the last dimension of an (N, H, W, C)
    tensor, as ConvNeXt's MLP runs on channels-last activations: the 1x1 conv it is, run by a
    generated NHWC conv kernel on its bound-derived default schedule. The tensor is, as it lies
    in memory, a channels_last (N, C, H, W) tensor, so neither side copies. A FusedLinear with a
    residual adds it in the kernel's epilogue. Any other input runs `linear` itself."""

    maco_leaf = True

    def __init__(self, linear: nn.Linear, shape: tuple[int, ...], target: Target, preallocate: bool = False):
        super().__init__()
        if len(shape) != 4 or shape[3] != linear.in_features:
            raise MacoError(f"a linear of {linear.in_features} inputs runs as a 1x1 conv on (N, H, W, "
                            f"{linear.in_features}) tensors, not on {tuple(shape)}")
        n, h, w, c = shape
        k = linear.out_features
        self.torch_linear, self.shape = linear, tuple(shape)
        self.spec = ConvSpec(n=n, c=c, h=h, w=w, k=k, kh=1, kw=1)
        self.residual = adds_residual(linear)
        self._kernel = kernels.compile(self.spec, kernels.default_schedule(self.spec, target, "NHWC"), target=target,
                                       bias=linear.bias is not None, activation=getattr(linear, "activation", "none"),
                                       residual=self.residual)
        self._conv = self._kernel.bind(linear.weight.detach().reshape(k, c, 1, 1),
                                       None if linear.bias is None else linear.bias.detach())
        self._out = self._conv.output() if preallocate else None

    @property
    def preallocated(self) -> bool:
        return self._out is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if (not self._runs(x, self.shape) or self.residual != (residual is not None)
                or (residual is not None and not self._runs(residual, self.shape[:3] + (self.spec.k,)))):
            return self.torch_linear(x) if residual is None else self.torch_linear(x, residual)
        return self._conv.run_tensor(x.permute(0, 3, 1, 2), None if residual is None else residual.permute(0, 3, 1, 2),
                                     self._out).permute(0, 2, 3, 1)

    @staticmethod
    def _runs(x: torch.Tensor, shape: tuple[int, ...]) -> bool:
        return tuple(x.shape) == shape and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()

    def extra_repr(self) -> str:
        return (f"{self.shape} -> {self.torch_linear.out_features}, "
                f"activation={getattr(self.torch_linear, 'activation', 'none')}, residual={self.residual}, "
                f"preallocated={self.preallocated}")


class _GeneratedOp(nn.Module):
    """What a generated pooling or depthwise module shares: one input shape and memory format it
    runs (any other input runs the torch module), and an output buffer it may own."""

    maco_leaf = True

    def _output_in(self, layout: str, shape: tuple[int, ...], preallocate: bool) -> None:
        self._format = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        self._out_shape = shape
        self._out = self._new_output() if preallocate else None

    def _new_output(self) -> torch.Tensor:
        return torch.empty(self._out_shape, memory_format=self._format)

    def _output(self) -> torch.Tensor:
        return self._out if self._out is not None else self._new_output()

    def _runs(self, x: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether the kernel takes `x` (else the torch module does)."""
        return (tuple(x.shape) == shape and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.is_contiguous(memory_format=self._format))

    @property
    def preallocated(self) -> bool:
        return self._out is not None


class MacoPool2d(_GeneratedOp):
    """`pool` (a torch pooling module) run by a generated kernel (kernels.pool) for the one input
    shape and memory format it was built for; any other input runs `pool` itself."""

    def __init__(self, pool: nn.Module, shape: tuple[int, ...], layout: str, target: Target,
                 preallocate: bool = False):
        super().__init__()
        plan = plan_for(pool, shape, layout, target.cores)
        if plan is None:
            raise MacoError(f"no generated kernel computes {pool} on an input of shape {shape}")
        self.torch_pool, self.shape, self.layout = pool, tuple(shape), layout
        self._kernel = PoolKernel(plan, target)
        self._output_in(layout, plan.out_shape, preallocate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._runs(x, self.shape):
            return self.torch_pool(x)
        out = self._output()
        self._kernel(x, out)
        return out

    def extra_repr(self) -> str:
        return f"{self.torch_pool}, input {self.shape}, {self.layout}, preallocated={self.preallocated}"


class MacoDepthwise2d(_GeneratedOp):
    """A depthwise `conv` (a Conv2d or FusedConv2d without a residual) run by a generated kernel
    (kernels.depthwise) for the one input shape and layout it was built for; any other input
    runs `conv` itself."""

    def __init__(self, conv: nn.Conv2d, spec: ConvSpec, layout: str, target: Target, preallocate: bool = False):
        super().__init__()
        activation, _ = epilogue_of(conv)
        if not depthwise_can_run(conv, spec):
            raise MacoError(f"no generated depthwise kernel computes {conv} ({spec})")
        self.spec, self.layout, self.torch_conv = spec, layout, conv
        self._plan = DepthwisePlan(spec, layout, conv.bias is not None, activation, target.cores,
                                   min(16, max(1, target.simd_width)))
        self._kernel = DepthwiseKernel(self._plan, target)
        self._weight = self._plan.pack_weight(conv.weight.detach().numpy())
        self._bias = None if conv.bias is None else conv.bias.detach().numpy().astype("float32")
        self._output_in(layout, spec.output_shape, preallocate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._runs(x, self.spec.input_shape):
            return self.torch_conv(x)
        out = self._output()
        self._kernel(x, self._weight, self._bias, out)
        return out

    def extra_repr(self) -> str:
        return (f"{self.spec}, layout={self.layout}, activation={self._plan.activation}, "
                f"preallocated={self.preallocated}")


class MacoWinograd2d(_GeneratedOp):
    """A 3x3 or 5x5 stride-1 `conv` (a Conv2d or FusedConv2d) run by the Winograd kernel
    (kernels.winograd) in NHWC, in output tiles of m x m, for the one input shape it was built
    for; any other input runs `conv` itself. A call whose conv outputs were not all finite (a NaN
    or infinity in the input) is recomputed by torch's direct conv, as are all calls where the
    weights or bias hold one: NaN and infinities land where eager torch puts them."""

    def __init__(self, conv: nn.Conv2d, spec: ConvSpec, target: Target, preallocate: bool = False, m: int = 2):
        super().__init__()
        activation, residual = epilogue_of(conv)
        if not winograd_module_can_run(conv, spec, target):
            raise MacoError(f"no generated Winograd kernel computes {conv} ({spec}) on {target.name}")
        self.spec, self.layout, self.torch_conv = spec, "NHWC", conv
        self._plan = WinogradPlan(spec, conv.bias is not None, activation, residual == "before", target.cores,
                                  target.simd_width, m=m)
        self._kernel = WinogradKernel(self._plan, target)
        self._weight = self._plan.pack_weight(conv.weight.detach().numpy())
        self._bias = None if conv.bias is None else conv.bias.detach().numpy().astype("float32")
        self._torch_weight = conv.weight.detach()  # for `direct`: the weights U was packed from
        self._torch_bias = None if conv.bias is None else conv.bias.detach()
        self._finite = bool(torch.isfinite(self._torch_weight).all()) and bool(np.isfinite(self._weight).all()) \
            and (self._bias is None or bool(np.isfinite(self._bias).all()))
        self._output_in("NHWC", spec.output_shape, preallocate)

    @property
    def m(self) -> int:
        return self._plan.m

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if (not self._runs(x, self.spec.input_shape) or self._plan.residual != (residual is not None)
                or (residual is not None and not self._runs(residual, self.spec.output_shape))):
            return self.torch_conv(x) if residual is None else self.torch_conv(x, residual)
        out = self._output()
        # the kernel returns False where an output was not finite (a stand-in kernel, such as
        # end_to_end's that skips it, returns None: nothing to recompute)
        if not self._finite or self._kernel(x, self._weight, self._bias, residual, out) is False:
            direct(self._plan, x, self._torch_weight, self._torch_bias, residual, out)
        return out

    def extra_repr(self) -> str:
        return (f"{self.spec}, Winograd F({self.m}x{self.m},{self.spec.kh}x{self.spec.kw}), NHWC, "
                f"activation={self._plan.activation}, "
                f"residual={self._plan.residual}, preallocated={self.preallocated}")


class MacoInvertedResidual(_GeneratedOp):
    """An inverted residual (1x1 `expand` conv or None, depthwise conv, 1x1 `project` conv or None,
    whose residual, if any, is the block's input) run by one generated kernel
    (kernels.inverted_residual) on NHWC inputs of one shape, its expanded tensor kept in each
    thread's cache; any other input runs the torch convs. The convs may be MACO kernel modules:
    their torch convs are used. It stands where its last conv stood in the model (`torch_conv` is
    that conv), and `chain` holds the torch convs in order."""

    def __init__(self, expand: nn.Module | None, depthwise: nn.Module, project: nn.Module | None,
                 shape: tuple[int, ...], target: Target, preallocate: bool = False, split: str = "auto"):
        super().__init__()
        convs = _torch_convs(expand, depthwise, project)
        self.plan = block_plan(*convs, tuple(shape), target, split)
        if self.plan is None:
            raise MacoError(f"no generated kernel computes the block {[type(c).__name__ for c in convs]} on {shape}")
        self.torch_conv = convs[2] if convs[2] is not None else convs[1]
        self.chain = tuple(convs)  # a tuple: the convs stay registered where the model has them
        self.shape = tuple(shape)
        self.paths: tuple[str | None, str, str | None] | None = None  # the convs' paths in the model (layouts.blocks)
        self._kernel = BlockKernel(self.plan, target)
        self._weight = self.plan.pack(*[None if c is None else (c.weight.detach().numpy(),
                                                               None if c.bias is None else c.bias.detach().numpy())
                                        for c in convs])
        self._output_in("NHWC", self.plan.output_shape, preallocate)

    @property
    def specs(self) -> tuple[ConvSpec, ...]:
        """The ConvSpecs of the convs it runs, in order."""
        p = self.plan
        shapes = [(p.n, p.c, p.h, p.w), (p.n, p.m, p.h, p.w), (p.n, p.m, p.out_h, p.out_w)]
        return tuple(ConvSpec.from_module(conv, shape) for conv, shape in zip(self.chain, shapes) if conv is not None)

    def torch_chain(self, x: torch.Tensor) -> torch.Tensor:
        """The block as the torch convs compute it."""
        expand, depthwise, project = self.chain
        h = depthwise(x if expand is None else expand(x))
        if project is None:
            return h
        return project(h, x) if self.plan.residual else project(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._runs(x, self.shape):
            return self.torch_chain(x)
        out = self._output()
        # False: a thread could not allocate its buffers (a stand-in kernel, such as end_to_end's
        # that skips it, returns None: nothing to recompute)
        if self._kernel(x, self._weight, out) is False:
            out.copy_(self.torch_chain(x))
        return out

    def extra_repr(self) -> str:
        return f"input {self.shape}, {self.plan.summary}, preallocated={self.preallocated}"


class MacoSqueezeExcite(_GeneratedOp):
    """Squeeze-excitation, x * gate(fc2(fc1(pool(x)))), run by one generated kernel
    (kernels.squeeze_excite) on inputs of one shape and memory format; any other input runs the
    torch modules. It stands where its gate module stood in the model, and `chain` holds the
    pool, fc1, fc2 and gate modules (MACO kernel modules among them run as they would)."""

    def __init__(self, pool: nn.Module, fc1: nn.Module, fc2: nn.Module, gate: nn.Module, shape: tuple[int, ...],
                 layout: str, target: Target, preallocate: bool = False):
        super().__init__()
        self.plan = squeeze_plan(pool, fc1, fc2, gate, tuple(shape), layout, target)
        if self.plan is None:
            raise MacoError(f"no generated kernel computes squeeze-excitation with "
                            f"{[type(m).__name__ for m in (pool, fc1, fc2, gate)]} on {shape} in {layout}")
        self.chain = (pool, fc1, fc2, gate)  # a tuple: the modules stay registered where the model has them
        self.shape, self.layout = tuple(shape), layout
        self.paths: tuple[str, str, str, str] | None = None  # pool, fc1, fc2, gate in the model (layouts.blocks)
        self._kernel = SqueezeKernel(self.plan, target)
        fc1, fc2 = _torch_convs(fc1, fc2)
        self._weight, self._bias = self.plan.pack(*[t if t is None else t.detach().numpy()
                                                    for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)])
        self._output_in(layout, self.shape, preallocate)

    def torch_chain(self, x: torch.Tensor) -> torch.Tensor:
        """Squeeze-excitation as the torch modules compute it."""
        pool, fc1, fc2, gate = self.chain
        return x * gate(fc2(fc1(pool(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._runs(x, self.shape):
            return self.torch_chain(x)
        out = self._output()
        self._kernel(x, self._weight, self._bias, out)
        return out

    def extra_repr(self) -> str:
        p = self.plan
        return (f"input {self.shape}, {self.layout}, {p.squeeze} hidden, {p.act}, {p.gate}, "
                f"preallocated={self.preallocated}")


def squeeze_plan(pool: nn.Module, fc1: nn.Module, fc2: nn.Module, gate: nn.Module, shape: tuple[int, ...],
                 layout: str, target: Target) -> SqueezePlan | None:
    """The SqueezePlan of squeeze-excitation's modules (torch modules, or MACO kernel modules: their
    torch modules) on an (N, C, H, W) input in `layout`, None where the kernel does not compute
    them: a global average pool, 1x1 convs C -> S with a ReLU or SiLU fused and S -> C with
    nothing fused (stride 1, no padding, one group), a Sigmoid or Hardsigmoid gate, a CPU target."""
    pool = getattr(pool, "torch_pool", pool)
    fc1, fc2 = _torch_convs(fc1, fc2)
    gates = {nn.Sigmoid: "sigmoid", nn.Hardsigmoid: "hardsigmoid"}

    def pointwise(conv: Any, cin: int) -> bool:
        return (isinstance(conv, nn.Conv2d) and conv.in_channels == cin and conv.kernel_size == (1, 1)
                and conv.stride == (1, 1) and conv.padding in ((0, 0), "valid") and conv.groups == 1
                and conv.dilation == (1, 1) and epilogue_of(conv)[1] == "none")

    if (target.kind != "cpu" or len(shape) != 4 or type(gate) not in gates
            or not isinstance(pool, nn.AdaptiveAvgPool2d) or pool.output_size not in (1, (1, 1))):
        return None
    n, c, h, w = shape
    if not (pointwise(fc1, c) and pointwise(fc2, fc1.out_channels) and fc2.out_channels == c
            and epilogue_of(fc2)[0] == "none"):
        return None
    try:
        return SqueezePlan(n, c, h, w, fc1.out_channels, epilogue_of(fc1)[0], gates[type(gate)], layout, target.cores)
    except MacoError:
        return None


def _torch_convs(*modules: nn.Module | None) -> list[nn.Module | None]:
    """The torch conv of each module (a MACO kernel module's own), None kept."""
    return [None if m is None else getattr(m, "torch_conv", m) for m in modules]


def block_plan(expand: nn.Module | None, depthwise: nn.Module, project: nn.Module | None, shape: tuple[int, ...],
               target: Target, split: str = "auto") -> BlockPlan | None:
    """The BlockPlan of a block's convs (torch convs, or MACO kernel modules: their torch convs) on
    an (N, C, H, W) input, None where the kernel does not compute them: 1x1 expand and project
    convs (stride 1, no padding, one group; at least one of them), a depthwise conv with a square
    odd window, stride 1 or 2 and padding half the window, zero padding, no residual but
    project's own "before" one, activations the kernel fuses (at most one smooth kind), a CPU
    target with vectors; `split` as BlockPlan takes it."""
    expand, depthwise, project = _torch_convs(expand, depthwise, project)

    def pointwise(conv: Any) -> bool:
        return (isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
                and conv.padding in ((0, 0), "valid") and conv.groups == 1 and conv.padding_mode == "zeros")

    if (target.kind != "cpu" or len(shape) != 4 or not isinstance(depthwise, nn.Conv2d)
            or (project is not None and not pointwise(project)) or (expand is None and project is None)):
        return None
    if expand is not None and not (pointwise(expand) and epilogue_of(expand)[1] == "none"):
        return None
    n, c, h, w = shape
    m = depthwise.in_channels
    r, s = depthwise.kernel_size[0], depthwise.stride[0]
    if ((expand is not None and (expand.in_channels != c or expand.out_channels != m)) or (expand is None and m != c)
            or depthwise.groups != m or depthwise.out_channels != m or depthwise.kernel_size != (r, r)
            or depthwise.stride != (s, s) or depthwise.padding != (r // 2, r // 2) or depthwise.dilation != (1, 1)
            or depthwise.padding_mode != "zeros" or epilogue_of(depthwise)[1] != "none"
            or (project is not None and project.in_channels != m)):
        return None
    acts = [epilogue_of(conv)[0] for conv in (expand, depthwise, project) if conv is not None]
    residual = "none" if project is None else epilogue_of(project)[1]
    if residual not in ("none", "before") or any(a not in ACTIVATIONS for a in acts):
        return None
    registers = target.level_bytes("registers", 0) // (4 * max(1, target.simd_width))
    try:
        return BlockPlan(n=n, c=c, h=h, w=w, m=m, k=m if project is None else project.out_channels, r=r, s=s,
                         expand=expand is not None, project=project is not None,
                         act_expand=acts[0] if expand is not None else "none",
                         act_depthwise=acts[1] if expand is not None else acts[0],
                         act_project=acts[-1] if project is not None else "none", residual=residual == "before",
                         threads=target.cores, lanes=target.simd_width, registers=registers or 16,
                         cache_bytes=target.level_bytes("L2", 1 << 20) // 2, split=split)
    except MacoError:
        return None


def winograd_module_can_run(conv: nn.Module, spec: ConvSpec, target: Target) -> bool:
    """Whether kernels.winograd computes this conv module on `target`: a CPU with vectors, a 3x3
    stride-1 conv it takes (winograd_can_run), zero padding, an epilogue a kernel computes."""
    return (isinstance(conv, nn.Conv2d) and target.kind == "cpu" and target.simd_width in (4, 8, 16)
            and winograd_can_run(spec, target.simd_width) and kernel_can_run(conv))


def depthwise_can_run(conv: nn.Module, spec: ConvSpec) -> bool:
    """Whether kernels.depthwise computes this conv module: depthwise, zero padding, no residual,
    an activation it fuses."""
    activation, residual = epilogue_of(conv)
    return (isinstance(conv, nn.Conv2d) and is_depthwise(spec) and conv.padding_mode == "zeros"
            and residual == "none" and activation in ACTIVATIONS and spec.kh * spec.kw <= MAX_TAPS)


def escapes(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the tensor `node` produces can reach the model's output, itself or as a view (through
    ops that may return their input: reshapes, in-place ops, dropout, unknown ones)."""
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return True
            fresh = ((user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)),
                                                              FRESH_MODULES + (MacoConv2d, MacoLinear, MacoLinearAsConv,
                                                                              _GeneratedOp)))
                     or (user.op == "call_function" and user.target in FRESH_FUNCTIONS))
            if not fresh and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def call_sites(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Module path -> the nodes that call it."""
    calls: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls.setdefault(str(node.target), []).append(node)
    return calls


def swap_module(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    setattr(gm.get_submodule(parent_name) if parent_name else gm, child, module)


def input_conversion(gm: fx.GraphModule, path: str,
                     calls: Mapping[str, list[fx.Node]] | None = None) -> fx.Node | None:
    """The conversion to NHWC (LayoutPlan.apply's `contiguous` node) that feeds the input of the
    one call of the NHWC MacoConv2d `path` on a CPU, where that call is its only reader: the
    conversion the conv makes unnecessary by reading the tensor before it (fold_input_conversion);
    else None. `calls`: call_sites(gm), where the caller asks about many modules."""
    sites = (call_sites(gm) if calls is None else calls).get(path, [])
    mod = gm.get_submodule(path)
    if (len(sites) != 1 or not isinstance(mod, MacoConv2d) or mod._device != "cpu"
            or not mod.layout == mod.input_layout == "NHWC" or not sites[0].args):
        return None
    node, conversion = sites[0], sites[0].args[0]
    if (not isinstance(conversion, fx.Node) or conversion.op != "call_method" or conversion.target != "contiguous"
            or len(conversion.args) != 1 or conversion.kwargs != {"memory_format": torch.channels_last}
            or list(conversion.users) != [node] or sum(a is conversion for a in node.args) != 1
            or conversion in node.kwargs.values()):
        return None
    return conversion


def fold_input_conversion(gm: fx.GraphModule, path: str, target: Target) -> None:
    """MacoConv2d `path` rebuilt to read the tensor before its input_conversion in NCHW (the
    layout a plan converts from to NHWC), and the conversion taken out of the graph (in place):
    the tensor is read once, by the conv, instead of copied first. Before the first conv this is
    the model's input, whose 3 channels become the innermost axis of NHWC in a slow strided copy."""
    conversion = input_conversion(gm, path)
    if conversion is None:
        raise MacoError(f"no conversion to NHWC feeds conv {path!r} alone: it reads its input as planned")
    mod = gm.get_submodule(path)
    swap_module(gm, path, MacoConv2d(mod.torch_conv, mod.spec, mod._kernel.schedule, target, mod.preallocated,
                                     input_layout="NCHW"))
    next(iter(conversion.users)).replace_input_with(conversion, conversion.args[0])
    gm.graph.erase_node(conversion)
    gm.graph.lint()
    gm.recompile()


def use_maco_kernels(gm: fx.GraphModule, plan: LayoutPlan, chosen: dict[ConvSpec, dict[str, Schedule]],
                     target: Target) -> list[str]:
    """Swap the planned convs whose layer has a chosen MACO schedule in the plan's layout, and
    whose epilogue a kernel computes, for MacoConv2d modules (in place); a conv module called
    once whose output stays inside the model gets a preallocated output. Returns the module
    paths swapped."""
    calls = call_sites(gm)
    swapped = []
    for layer in plan.convs:
        spec = ConvSpec.parse(layer.spec)
        schedule = chosen.get(spec, {}).get(layer.layout)
        conv = gm.get_submodule(layer.target)
        if schedule is None or layer.target in swapped or not kernel_can_run(conv, target):
            continue
        sites = calls.get(layer.target, [])
        preallocate = len(sites) == 1 and not escapes(gm, sites[0])
        swap_module(gm, layer.target, MacoConv2d(conv, spec, schedule, target, preallocate))
        swapped.append(layer.target)
    return swapped
