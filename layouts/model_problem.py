"""The LayoutProblem of a traced torch model: which layers choose a layout and at what seconds,
which are pinned to NCHW, and what converting each 4-D tensor costs. The rules are those listed
in maco.layouts.deploy, whose `plan` solves the problem built here.

    gm, graph = trace_module(model, example_input)
    problem, flexible = build_problem(gm, graph, ["NCHW", "NHWC"], conv_seconds, conversion)
"""
from __future__ import annotations

import operator
from typing import Mapping, Sequence

import torch.fx as fx

from maco.layouts.graph import Layer, LayerGraph, channel_permute, conversion_placed, reads_data
from maco.layouts.problem import ConversionCost, LayoutProblem

# Ops torch runs in either memory format, keeping their input's: they may choose a layout.
FLEXIBLE_KINDS = frozenset({"conv", "bn", "relu", "act", "pool", "add", "mul", "cat", "dropout", "identity"})
# The layout of pinned layers, and of every layer in the unplanned (default) model.
DEFAULT_LAYOUT = "NCHW"


def _inplace(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function":
        if node.kwargs.get("inplace") or node.target in (operator.iadd, operator.imul, operator.isub,
                                                           operator.itruediv):
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).endswith("__")
    return False


def _flexible(layer: Layer, graph: LayerGraph) -> bool:
    if layer.kind not in FLEXIBLE_KINDS or not layer.is_4d:
        return False
    if layer.kind == "conv" and layer.spec is None:
        return False
    # other inputs may be of fewer dimensions (a layer scale of (C, 1, 1), a scalar): broadcast,
    # they follow the 4-D one's memory format
    shapes = [graph.layers[src].shape for src in layer.inputs]
    return any(graph.layers[src].is_4d for src in layer.inputs) and all(s is not None and len(s) <= 4 for s in shapes)


def build_problem(gm: fx.GraphModule, graph: LayerGraph, layouts: Sequence[str],
                  conv_seconds: Mapping[str, Mapping[str, float]],
                  conversion: ConversionCost) -> tuple[LayoutProblem, set[str]]:
    """The LayoutProblem of a traced model by the rules in maco.layouts.deploy's docstring; also
    the names of the flexible layers."""
    nodes = {n.name: n for n in gm.graph.nodes}
    consumers = {name: [u for u in graph.consumers(name) if reads_data(gm, nodes[u])]
                 for name in graph.layers}
    flexible = {name for name, layer in graph.layers.items() if _flexible(layer, graph)}
    for name in graph.layers:  # rule 5: a tensor mutated in place while others read it
        readers = consumers[name]
        if len(readers) > 1 and any(_inplace(gm, nodes[u]) for u in readers):
            flexible.discard(name)
            flexible.difference_update(readers)
    # rule 6: a permute that moves channels last or first runs in NHWC, where it moves no data:
    # its input channels_last gives a contiguous (N, H, W, C) tensor, a contiguous one a
    # channels_last (N, C, H, W) tensor; its output is not converted for its readers, nor the
    # input of one that moves channels first (layout_plan.apply)
    swaps = {name: channel_permute(nodes[name]) for name, layer in graph.layers.items()
             if layer.is_4d and "NHWC" in layouts and all(graph.layers[src].is_4d for src in layer.inputs)}
    swaps = {name: way for name, way in swaps.items() if way is not None}
    layer_cost: dict[str, dict[str, float]] = {}
    for name, layer in graph.layers.items():
        if name in swaps:
            layer_cost[name] = {"NHWC": 0.0}
        elif name not in flexible:
            layer_cost[name] = {DEFAULT_LAYOUT: 0.0}
        elif layer.kind == "conv":
            layer_cost[name] = dict(conv_seconds[name])
        else:
            layer_cost[name] = {lay: 0.0 for lay in layouts}
    convert_cost: dict[str, dict[tuple[str, str], float]] = {}
    for name, layer in graph.layers.items():
        if not consumers[name]:
            continue
        mine = layer_cost[name]
        wanted = {lay for u in consumers[name] for lay in layer_cost[u]}
        if not layer.is_4d:  # read as it is (a broadcast operand): nothing to convert
            convert_cost[name] = {(a, b): 0.0 for a in mine for b in wanted if a != b}
            continue
        paid = set() if swaps.get(name) == "last" else {
            lay for u in consumers[name] if swaps.get(u) != "first" for lay in layer_cost[u]}
        convert_cost[name] = {(a, b): conversion(layer.shape, a, b) if b in paid else 0.0  # type: ignore[arg-type]
                              for a in mine for b in wanted if a != b}
    problem = LayoutProblem(list(graph.layers), consumers, layer_cost, convert_cost)
    return problem, flexible


def placed_conversions(gm: fx.GraphModule, graph: LayerGraph, problem: LayoutProblem,
                       assignment: Mapping[str, str]) -> dict[str, list[str]]:
    """Per layer, the layouts its output is converted to in the applied graph: the problem's
    conversions less those of tensors that are not 4-D and those rule 6 leaves out (after a
    permute moving channels last, and for readers that are permutes moving channels first);
    they cost nothing in the problem."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return {v: [t for t in targets if graph.layers[v].is_4d and any(
                assignment[u] == t and conversion_placed(nodes[v], nodes[u], assignment[v], t)
                for u in problem.consumers.get(v, []))]
            for v, targets in problem.conversions(assignment).items()}


__all__ = ["build_problem", "placed_conversions", "FLEXIBLE_KINDS", "DEFAULT_LAYOUT"]
