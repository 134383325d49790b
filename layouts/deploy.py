"""The deployment API: plan a layout per layer of a torch model, then apply the plan.

    plan = maco.layouts.plan(model, example_input, layouts=("NCHW", "NHWC"), latency="measure")
    fast = plan.apply(model)          # a torch.fx GraphModule, outputs equal to model's
    plan.save("resnet18.plan.json");  LayoutPlan.load("resnet18.plan.json")

Which layer gets a choice (the rules, applied to every node torch.fx traces):
1. Conv2d modules (with a describable ConvSpec) choose among `layouts`, at the seconds the
   latency source gives.
2. Ops torch runs in either memory format, keeping their input's format (BatchNorm2d, ReLU and
   other activations, max/avg/adaptive pooling, add, mul, cat, dropout, identity) choose too, at
   zero cost in every layout: they follow their neighbours so that conversions are few.
3. Everything else is pinned to NCHW: the network's inputs and output, flatten/view/reshape,
   linear, unknown functions, any op on a tensor that is not 4-D. A 4-D tensor reaching them in
   another layout is converted to NCHW, and the plan pays for it.
4. Shape queries (x.size(), x.shape, x.dim()) read no data: they are not consumers.
5. A tensor mutated in place by one op and also read by others is pinned to NCHW with all of its
   readers, so the applied graph runs exactly as traced.
6. A permute that moves channels last, x.permute(0, 2, 3, 1), or first, x.permute(0, 3, 1, 2)
   (ConvNeXt's blocks around their LayerNorm and Linears), runs in NHWC, where it moves no data:
   it reads a channels_last tensor as a contiguous (N, H, W, C) one, or hands on a contiguous one
   as a channels_last (N, C, H, W) tensor; no conversion is placed after the first or before the
   second.
A layer's output is converted once per distinct layout its consumers use (the conversion is
placed just before the first of those consumers); weights of NHWC convs are converted ahead of
time to channels_last.

The pieces, each in its own module: latency_sources (where seconds come from), model_problem
(these rules as a LayoutProblem), planners (solving it), layout_plan (the plan as JSON, and
applying it), end_to_end (timing the planned model against the default one).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.target import Target
from maco.core.timing import environment

from maco.layouts.graph import trace_module
from maco.layouts.latency import check_layout
from maco.layouts.latency_sources import latency_source
from maco.layouts.layout_plan import LayerPlan, LayoutPlan
from maco.layouts.model_problem import DEFAULT_LAYOUT, build_problem, placed_conversions
from maco.layouts.planners import solve


def plan(model: nn.Module, example_input: Any, layouts: Sequence[str] = ("NCHW", "NHWC"),
         latency: Any = "measure", *, predictor: Any = None, conversion: Any = None,
         method: str = "exact", device: str | None = None, target: Target | None = None,
         progress: bool = False, time_limit: float | None = None) -> LayoutPlan:
    """Plan a layout per layer of `model` for inputs like `example_input` (see the module
    docstring for the rules and latency_source for the forms `latency` takes). Latencies are
    measured on `device`, by default the example input's; tuning records are read for `target`,
    by default the machine `device` is (this host's CPU, or the H100 for cuda)."""
    first = example_input[0] if isinstance(example_input, (tuple, list)) and example_input else example_input
    if device is None:
        device = str(first.device) if isinstance(first, torch.Tensor) else "cpu"
    lays = list(dict.fromkeys(check_layout(lay) for lay in layouts))
    if not lays:
        raise MacoError("give at least one layout to plan with")
    costs = latency_source(latency, predictor=predictor, conversion=conversion, device=device,
                           target=target, progress=progress)
    gm, graph = trace_module(model, example_input)
    convs = [(layer.name, layer.spec) for layer in graph.convs() if layer.spec is not None]
    conv_seconds = costs.conv(convs, lays)  # type: ignore[arg-type]
    problem, _ = build_problem(gm, graph, lays, conv_seconds, costs.conversion)
    sol = solve(problem, method, time_limit=time_limit)
    planner_seconds = sol.runtime
    default = {v: DEFAULT_LAYOUT for v in problem.layers}
    has_default = all(DEFAULT_LAYOUT in problem.layer_cost[v] for v in problem.layers)
    default_cost = problem.cost(default) if has_default else None
    converted = placed_conversions(gm, graph, problem, sol.assignment)
    layers = []
    for name, layer in graph.layers.items():
        lay = sol.assignment[name]
        layers.append(LayerPlan(
            name=name, kind=layer.kind, op=layer.op, target=layer.target, layout=lay,
            shape=list(layer.shape) if layer.shape is not None else None,
            costs=dict(problem.layer_cost[name]),
            converts={t: problem.convert_cost[name][(lay, t)] for t in converted[name]},
            spec=str(layer.spec) if layer.spec is not None else None))
    inputs = example_input if isinstance(example_input, (tuple, list)) else (example_input,)
    return LayoutPlan(layers=layers, layouts=lays, cost=sol.cost, default_cost=default_cost,
                      method=sol.method, latency=costs.describe,
                      input_shapes=[list(x.shape) for x in inputs], planner_seconds=planner_seconds,
                      env=environment())


__all__ = ["plan"]
