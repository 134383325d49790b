"""The inference graph pass: fold each BatchNorm into the conv before it, and fuse into that conv the
elementwise chain only it feeds (a residual add and an activation, in either order), so that a
network's conv -> bn -> (+ identity) -> relu runs as one op; a Linear takes the activation only it
feeds the same way (kernels.epilogue.ACTIVATIONS: ReLU, ReLU6, SiLU, hardswish, GELU), or, on
channels-last tensors permuted back to NCHW, the per-channel scale and the residual add after it
(ConvNeXt's `x + layer_scale * block(x)`).

Detection follows MegEngine's JIT fusion: nodes are visited in reverse topological order, and from
each conv the chain grows through single consumers for as long as the next op is one the fused op
can hold; every value a fused op reads (its input, the residual) is computed before the chain's
last op, where the fused op takes its place. Visiting later convs first gives a residual add to the
conv of the main path (whose activation follows) rather than to the conv of the shortcut. A value
with other consumers ends the chain there: the fused op's output is that value, so every consumer
still sees what it saw before.

    fused = fuse(traced_model, example_input)   # outputs equal the model's (eval mode)
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

from maco.layouts.graph import channel_permute, trace_module

ACTIVATION_MODULES: list[tuple[type, str]] = [(nn.ReLU, "relu"), (nn.ReLU6, "relu6"), (nn.SiLU, "silu"),
                                              (nn.Hardswish, "hardswish")]
ACTIVATION_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.relu6: "relu6", F.silu: "silu",
                        F.hardswish: "hardswish", F.gelu: "gelu"}  # gelu: not with approximate="tanh" (a kwarg)
ACTIVATION_METHODS = {"relu": "relu", "relu_": "relu"}
ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
ADD_METHODS = {"add", "add_"}
_APPLY = {"none": lambda y: y, "relu": lambda y: F.relu(y, inplace=True),
          "relu6": lambda y: F.hardtanh(y, 0.0, 6.0, inplace=True), "silu": lambda y: F.silu(y, inplace=True),
          "hardswish": lambda y: F.hardswish(y, inplace=True), "gelu": F.gelu}
RESIDUAL = ("none", "before", "after")  # no residual, added before the activation, or after it


class FusedConv2d(nn.Conv2d):
    """act(conv(x) + residual) or act(conv(x)) + residual, with any BatchNorm folded into the
    weight and bias. A Conv2d, so planners and ConvSpec.from_module see the conv it is."""

    maco_leaf = True  # traced as one op (maco.layouts.graph.symbolic_trace)

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor | None,
                 activation: str = "none", residual: str = "none"):
        super().__init__(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                         conv.dilation, conv.groups, bias is not None, conv.padding_mode,
                         device=weight.device, dtype=weight.dtype)
        if activation not in _APPLY or residual not in RESIDUAL:
            raise ValueError(f"activation {activation!r} / residual {residual!r}")
        with torch.no_grad():
            self.weight.copy_(weight)
            if bias is not None:
                self.bias.copy_(bias)
        self.activation, self.residual = activation, residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self._conv_forward(x, self.weight, self.bias)
        if self.residual == "before":
            y = y + residual
        y = _APPLY[self.activation](y)
        return y + residual if self.residual == "after" else y

    def extra_repr(self) -> str:
        parts = [super().extra_repr()]
        if self.residual != "none":
            parts.append(f"residual={self.residual}")
        if self.activation != "none":
            parts.append(f"activation={self.activation}")
        return ", ".join(parts)


class FusedLinear(nn.Linear):
    """act(linear(x)): a Linear with the activation only it feeds; or, with `scale` (one factor per
    output feature), the Linear a per-channel scale of its output was folded into (weight and
    bias times the scale: ConvNeXt's layer scale); with `residual` ("before": added before the
    activation, as the conv kernels' epilogue does; only with no activation here), linear(x) +
    residual, the add after it taken in."""

    maco_leaf = True

    def __init__(self, linear: nn.Linear, activation: str, scale: torch.Tensor | None = None,
                 residual: str = "none"):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        if activation not in _APPLY or residual not in ("none", "before") or (residual != "none" and activation != "none"):
            raise ValueError(f"activation {activation!r} / residual {residual!r}")
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
            if scale is not None:
                self.weight.mul_(scale.reshape(-1, 1))
                if self.bias is not None:
                    self.bias.mul_(scale.reshape(-1))
        self.activation, self.scaled, self.residual = activation, scale is not None, residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return _APPLY[self.activation](y) if residual is None else y + residual

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, activation={self.activation}" + (", scale folded" if self.scaled else "")
                + (f", residual={self.residual}" if self.residual != "none" else ""))


def adds_residual(linear: nn.Module) -> bool:
    """Whether `linear` is a FusedLinear that adds a residual (which only some kernels compute)."""
    return getattr(linear, "residual", "none") != "none"


def fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of the conv with the eval-mode BatchNorm after it folded in:
    w' = w * g / sqrt(var + eps) per output channel, b' = (b - mean) * g / sqrt(var + eps) + beta."""
    with torch.no_grad():
        scale = bn.running_var.add(bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        bias = (bias - bn.running_mean) * scale
        if bn.bias is not None:
            bias = bias + bn.bias
        return conv.weight * scale.reshape(-1, 1, 1, 1), bias


def fuse(model: nn.Module, example_input: Any, fold_scales: bool = True,
         linear_residuals: bool = True) -> fx.GraphModule:
    """A copy of `model` (in eval mode) as a GraphModule in which every conv -> bn -> add -> act
    chain is one FusedConv2d (see the module docstring), and, with `fold_scales`, a per-channel
    scale of a Linear's output permuted back to NCHW is folded into it (`_channel_scale`), and,
    with `linear_residuals`, the add after that permute too (`_linear_residual`). Models saved
    before each of these rebuild without it. Outputs equal the model's in eval mode."""
    import copy

    gm, _ = trace_module(copy.deepcopy(model).eval(), example_input)
    modules = dict(gm.named_modules())
    done: set[fx.Node] = set()
    count = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_module" and type(modules.get(node.target)) is nn.Linear and len(node.users) == 1:
            user = next(iter(node.users))
            if kind := _activation(modules, user, node):
                count += 1
                _replace(gm, [node, user], _fused_name(count, node),
                         FusedLinear(modules[node.target], kind), (node.args[0],))
                continue
            scale = None
            if fold_scales and (found := _channel_scale(gm, node)) is not None:
                mul, factor, scale = found
                mul.replace_all_uses_with(user)  # user: the permute back to NCHW, now of the scaled Linear
                gm.graph.erase_node(mul)
                gm.graph.erase_node(factor)
            add = _linear_residual(node) if linear_residuals else None
            if scale is None and add is None:
                continue
            count += 1
            name, args = _fused_name(count, node), (node.args[0],)
            if add is None:
                _replace(gm, [node], name, FusedLinear(modules[node.target], "none", scale), args)
                continue
            # linear -> permute -> add(other) becomes linear(x, other permuted channels last) -> permute,
            # all where the add was (other may be computed after the linear)
            add_node, other = add
            gm.add_submodule(name, FusedLinear(modules[node.target], "none", scale, "before"))
            with gm.graph.inserting_before(add_node):
                other_last = gm.graph.call_method("permute", (other, 0, 2, 3, 1))
                fused = gm.graph.call_module(name, args + (other_last,))
                back = gm.graph.call_method("permute", (fused, 0, 3, 1, 2))
            fused.meta, back.meta = dict(node.meta), dict(user.meta)
            add_node.replace_all_uses_with(back)
            for old in (add_node, user, node):
                gm.graph.erase_node(old)
            continue
        if node in done or node.op != "call_module" or type(modules.get(node.target)) is not nn.Conv2d:
            continue
        chain, bn, residual_arg, where, act = _grow(gm, modules, node)
        if len(chain) == 1:
            continue
        conv = modules[node.target]
        weight, bias = fold_batchnorm(conv, bn) if bn is not None else (conv.weight, conv.bias)
        count += 1
        module = FusedConv2d(conv, weight.detach(), None if bias is None else bias.detach(), act, where)
        args = (node.args[0],) + ((residual_arg,) if residual_arg is not None else ())
        _replace(gm, chain, _fused_name(count, node), module, args)
        done.update(chain)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def _fused_name(count: int, node: fx.Node) -> str:
    """The name of the count-th fused module, which takes the place of `node`'s module."""
    return f"fused_{count}_{str(node.target).replace('.', '_')}"


def _replace(gm: fx.GraphModule, chain: list[fx.Node], name: str, module: nn.Module, args: tuple) -> None:
    """Put `module`, called on `args`, where the chain's last node was, and drop the chain."""
    gm.add_submodule(name, module)
    last = chain[-1]
    with gm.graph.inserting_after(last):
        fused = gm.graph.call_module(name, args)
    fused.meta = dict(last.meta)
    last.replace_all_uses_with(fused)
    for old in reversed(chain):
        gm.graph.erase_node(old)


def _grow(gm: fx.GraphModule, modules: dict[str, nn.Module],
          conv: fx.Node) -> tuple[list[fx.Node], nn.BatchNorm2d | None, fx.Node | None, str, str]:
    """The longest chain conv [-> bn] [-> add] [-> act] [-> add] through single consumers:
    (nodes, the bn, the residual operand, where it is added, the activation)."""
    chain, bn, residual, where, act = [conv], None, None, "none", "none"
    shape = _shape(conv)
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        if bn is None and where == act == "none" and _is_bn(modules, user) and user.args[0] is chain[-1]:
            bn = modules[user.target]
        elif where == "none" and (other := _residual_operand(user, chain[-1], shape)) is not None:
            residual, where = other, "before" if act == "none" else "after"
        elif act == "none" and where != "after" and (kind := _activation(modules, user, chain[-1])):
            act = kind
        else:
            break
        chain.append(user)
    return chain, bn, residual, where, act


def _channel_scale(gm: fx.GraphModule, linear: fx.Node) -> tuple[fx.Node, fx.Node, torch.Tensor] | None:
    """(the multiply, the factor's node, the factor as one value per output feature) where the
    Linear's output, permuted (0, 3, 1, 2) back to NCHW, only feeds a multiply by a parameter of
    shape (out_features, 1, 1) that nothing else reads (ConvNeXt's `layer_scale * block(x)`)."""
    if (found := _permuted_back(linear)) is None:
        return None
    perm, mul = found
    if (mul.op != "call_function" or mul.target not in (operator.mul, torch.mul) or mul.kwargs
            or len(mul.args) != 2 or perm not in mul.args):
        return None
    factor = mul.args[0] if mul.args[1] is perm else mul.args[1]
    if not isinstance(factor, fx.Node) or factor.op != "get_attr" or len(factor.users) != 1:
        return None
    value = functools.reduce(getattr, str(factor.target).split("."), gm)
    out = gm.get_submodule(str(linear.target)).out_features
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or tuple(value.shape) != (out, 1, 1):
        return None
    return mul, factor, value.detach()


def _linear_residual(linear: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the add, its other operand) where the Linear's output, permuted (0, 3, 1, 2) back to NCHW,
    only feeds an add of a float32 tensor of that shape (ConvNeXt's residual: `x + block(x)`)."""
    if (found := _permuted_back(linear)) is None:
        return None
    perm, add = found
    other = _residual_operand(add, perm, _shape(perm))
    return None if other is None else (add, other)


def _permuted_back(linear: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the permute, its one user) where the Linear's one user permutes it (0, 3, 1, 2) back to NCHW
    and nothing else reads that permute."""
    perm = next(iter(linear.users))
    if channel_permute(perm) != "first" or perm.args[0] is not linear or len(perm.users) != 1:
        return None
    return perm, next(iter(perm.users))


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if getattr(meta, "shape", None) is not None else None


def _is_bn(modules: dict[str, nn.Module], node: fx.Node) -> bool:
    mod = modules.get(node.target) if node.op == "call_module" else None
    return (isinstance(mod, nn.BatchNorm2d) and mod.track_running_stats and mod.running_mean is not None
            and len(node.args) == 1 and not node.kwargs)


def _residual_operand(node: fx.Node, value: fx.Node, shape: tuple[int, ...] | None) -> fx.Node | None:
    """The other operand of `value + other` when it is a tensor of the conv's output shape."""
    is_add = ((node.op == "call_function" and node.target in ADD_FUNCTIONS)
              or (node.op == "call_method" and node.target in ADD_METHODS))
    if not is_add or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if node.target in ("add_", operator.iadd) and a is not value:
        return None  # in place into the other operand: that tensor is the result
    other = b if a is value else a if b is value else None
    if not isinstance(other, fx.Node) or other is value or shape is None or _shape(other) != shape:
        return None
    meta = other.meta.get("tensor_meta")
    return other if getattr(meta, "dtype", None) == torch.float32 else None


def _activation(modules: dict[str, nn.Module], node: fx.Node, value: fx.Node) -> str:
    """The name of the activation `node` applies to `value` alone ("" when it is none we fuse)."""
    if tuple(node.args) != (value,):
        return ""
    if node.op == "call_module":
        mod = modules.get(node.target)
        if type(mod) is nn.Hardtanh:
            return "relu6" if (mod.min_val, mod.max_val) == (0.0, 6.0) else ""
        if type(mod) is nn.GELU:
            return "gelu" if mod.approximate == "none" else ""
        return next((k for t, k in ACTIVATION_MODULES if isinstance(mod, t)), "")
    if node.op == "call_function":
        if set(node.kwargs) - {"inplace"}:
            return ""
        return ACTIVATION_FUNCTIONS.get(node.target, "")
    if node.op == "call_method" and not node.kwargs:
        return ACTIVATION_METHODS.get(node.target, "")
    return ""
