"""The layer graph of any torch model: torch.fx traces it from an example input, ShapeProp runs
the example through it, and every fx node becomes a Layer with its kind (conv, bn, relu, pool,
add, linear, flatten, ...), its inputs and its output shape. The network's input(s) and output
are layers too, so a layout planner can pin them.

    graph = trace(model, example_input)
    graph.layers["conv1"].spec, graph.consumers("conv1"), graph.convs()
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec

# Module types -> kind. Order matters only for subclasses (checked with isinstance).
_MODULE_KINDS: list[tuple[type, str]] = [
    (nn.Conv2d, "conv"), (nn.BatchNorm2d, "bn"), (nn.Linear, "linear"),
    (nn.ReLU, "relu"), (nn.ReLU6, "relu"), (nn.LeakyReLU, "relu"), (nn.SiLU, "act"),
    (nn.GELU, "act"), (nn.Hardswish, "act"), (nn.Sigmoid, "act"), (nn.Tanh, "act"),
    (nn.MaxPool2d, "pool"), (nn.AvgPool2d, "pool"), (nn.AdaptiveAvgPool2d, "pool"),
    (nn.AdaptiveMaxPool2d, "pool"), (nn.Dropout, "dropout"), (nn.Identity, "identity"),
    (nn.Flatten, "flatten"),
]
_FUNCTION_KINDS: dict[Any, str] = {
    operator.add: "add", torch.add: "add", operator.iadd: "add", operator.mul: "mul", torch.mul: "mul",
    torch.flatten: "flatten", torch.cat: "cat", torch.relu: "relu",
    nn.functional.relu: "relu", nn.functional.relu6: "relu", nn.functional.silu: "act",
    nn.functional.adaptive_avg_pool2d: "pool", nn.functional.max_pool2d: "pool",
    nn.functional.avg_pool2d: "pool", nn.functional.dropout: "dropout",
    nn.functional.conv2d: "conv_fn", nn.functional.linear: "linear",
}
_METHOD_KINDS = {"view": "reshape", "reshape": "reshape", "flatten": "flatten", "size": "meta",
                 "dim": "meta", "relu": "relu", "add": "add", "mean": "reduce", "permute": "permute",
                 "contiguous": "contiguous"}
# Kinds that read a tensor's metadata (x.size(), x.dim()) or an attribute, never its data.
META_KINDS = frozenset({"meta", "getattr"})


@dataclass
class Layer:
    """One op of the traced model. `shape` is the output's shape (None when the output is not a
    single tensor); `spec` is set for Conv2d modules; `target` is the module path for modules."""

    name: str
    kind: str
    op: str  # fx op: placeholder, call_module, call_function, call_method, get_attr, output
    target: str
    inputs: list[str] = field(default_factory=list)
    shape: tuple[int, ...] | None = None
    spec: ConvSpec | None = None

    @property
    def is_4d(self) -> bool:
        return self.shape is not None and len(self.shape) == 4


@dataclass
class LayerGraph:
    """Layers in the traced (topological) order, with who consumes whom."""

    layers: dict[str, Layer]

    def __post_init__(self) -> None:
        self._consumers: dict[str, list[str]] = {name: [] for name in self.layers}
        for layer in self.layers.values():
            for src in dict.fromkeys(layer.inputs):
                self._consumers[src].append(layer.name)

    def consumers(self, name: str) -> list[str]:
        if name not in self._consumers:
            raise MacoError(f"no layer named {name!r} in this graph")
        return list(self._consumers[name])

    @property
    def inputs(self) -> list[str]:
        return [n for n, layer in self.layers.items() if layer.op == "placeholder"]

    @property
    def output(self) -> str:
        return next(n for n, layer in self.layers.items() if layer.op == "output")

    def convs(self) -> list[Layer]:
        return [layer for layer in self.layers.values() if layer.kind == "conv"]

    def __len__(self) -> int:
        return len(self.layers)


class _Tracer(fx.Tracer):
    """fx's tracer, which also keeps MACO's own ops (modules with `maco_leaf`, such as a fused
    conv) as one node each: a traced-through fused conv would be a conv again, unfused."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return getattr(m, "maco_leaf", False) or super().is_leaf_module(m, qualname)


def symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """torch.fx's trace, with a MacoError naming the model when it cannot be traced."""
    if not isinstance(model, nn.Module):
        raise MacoError(f"expected a torch.nn.Module, got {type(model).__name__}")
    try:
        graph = _Tracer().trace(model)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        raise MacoError(f"torch.fx cannot trace {type(model).__name__}: {exc}") from None
    name = model.__class__.__name__ if isinstance(model, nn.Module) else "GraphModule"
    return fx.GraphModule(model, graph, name)


def _as_tuple(example: Any) -> tuple[torch.Tensor, ...]:
    inputs = example if isinstance(example, (tuple, list)) else (example,)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise MacoError(f"example input {i} must be a torch.Tensor, got {type(x).__name__}")
    return tuple(inputs)


def node_kind(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str]:
    """(kind, target) of an fx node: the kind names what the op does, e.g. conv, add, pool."""
    if node.op == "placeholder":
        return "input", str(node.target)
    if node.op == "output":
        return "output", "output"
    if node.op == "get_attr":
        return "attr", str(node.target)
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        kind = next((k for t, k in _MODULE_KINDS if isinstance(mod, t)), type(mod).__name__.lower())
        return kind, str(node.target)
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return _FUNCTION_KINDS.get(node.target, name), name
    return _METHOD_KINDS.get(str(node.target), str(node.target)), str(node.target)


def channel_permute(node: fx.Node) -> str | None:
    """"last" for x.permute(0, 2, 3, 1) (channels moved last: ConvNeXt's blocks before their
    LayerNorm and Linears), "first" for x.permute(0, 3, 1, 2) (moved back), None for any other
    node. The first reads a channels_last tensor as a contiguous one, the second makes a
    contiguous tensor channels_last: both move no data where their input is in that layout."""
    if node.op == "call_method" and node.target == "permute":
        dims: Any = node.args[1:]
    elif node.op == "call_function" and node.target is torch.permute:
        dims = node.args[1:] or (node.kwargs.get("dims"),)
    else:
        return None
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    return {(0, 2, 3, 1): "last", (0, 3, 1, 2): "first"}.get(tuple(dims))


def conversion_placed(node: fx.Node, user: fx.Node, layout: str, user_layout: str) -> bool:
    """Whether applying a plan converts `node`'s output for `user`, given the layouts they run in:
    where those differ, except after a permute moving channels last or before one moving them
    first, each run in NHWC (layouts.deploy, rule 6: those move no data)."""
    return (layout != user_layout and not (layout == "NHWC" and channel_permute(node) == "last")
            and not (user_layout == "NHWC" and channel_permute(user) == "first"))


def reads_data(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` reads its inputs' data: a shape query does not, so it is no consumer whose
    layout matters."""
    return node_kind(gm, node)[0] not in META_KINDS


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return tuple(int(v) for v in shape) if shape is not None else None


def graph_of(gm: fx.GraphModule) -> LayerGraph:
    """The LayerGraph of an fx GraphModule whose nodes already carry ShapeProp's tensor_meta."""
    layers: dict[str, Layer] = {}
    for node in gm.graph.nodes:
        kind, target = node_kind(gm, node)
        inputs = [n.name for n in node.all_input_nodes]
        layer = Layer(node.name, kind, node.op, target, inputs, _shape(node))
        if kind == "conv" and layer.is_4d:
            src = node.all_input_nodes[0]
            in_shape = _shape(src)
            if in_shape is not None and len(in_shape) == 4:
                try:
                    layer.spec = ConvSpec.from_module(gm.get_submodule(target), in_shape)
                except MacoError:
                    layer.spec = None  # e.g. padding="same": planned as a pinned op
        layers[node.name] = layer
    return LayerGraph(layers)


def trace_module(model: nn.Module, example_input: Any) -> tuple[fx.GraphModule, LayerGraph]:
    """Trace `model`, run `example_input` (a tensor or a tuple of them) through it without grad,
    and return the GraphModule (sharing the model's parameters) with its LayerGraph."""
    inputs = _as_tuple(example_input)
    gm = symbolic_trace(model)
    modes = {mod: mod.training for mod in gm.modules()}
    try:
        gm.eval()  # shapes only: no BatchNorm statistics update, no dropout
        with torch.no_grad():
            ShapeProp(gm).propagate(*inputs)
    except Exception as exc:
        shapes = [tuple(x.shape) for x in inputs]
        raise MacoError(f"running example input(s) of shape {shapes} through "
                        f"{type(model).__name__} failed: {exc}") from None
    finally:
        for mod, training in modes.items():
            mod.training = training
    return gm, graph_of(gm)


def trace(model: nn.Module, example_input: Any) -> LayerGraph:
    """The layer graph of `model` with the shapes the example input gives it."""
    return trace_module(model, example_input)[1]


__all__ = ["Layer", "LayerGraph", "trace", "trace_module", "graph_of", "symbolic_trace", "node_kind",
           "reads_data", "META_KINDS"]
