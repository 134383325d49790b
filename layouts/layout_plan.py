"""A layout plan as data: a layout per traced node of a model, saved and loaded as JSON, and
applied to the model as a torch.fx GraphModule that changes memory format only at boundaries.

    p = LayoutPlan.load("resnet18.plan.json")
    fast = p.apply(model)          # outputs equal to model's
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from maco.core.errors import MacoError
from maco.core.files import load_json, load_json_file, write_atomic

from maco.layouts.graph import conversion_placed, node_kind, reads_data, symbolic_trace
from maco.layouts.latency import check_layout, memory_format

FORMAT_VERSION = 1


@dataclass
class LayerPlan:
    """One traced node: its layout, the seconds per layout the planner saw, and the layouts its
    output is converted to, with the seconds each costs."""

    name: str
    kind: str
    op: str
    target: str
    layout: str
    shape: list[int] | None = None
    costs: dict[str, float] = field(default_factory=dict)
    converts: dict[str, float] = field(default_factory=dict)
    spec: str | None = None  # ConvSpec in its text form, for convs

    @property
    def seconds(self) -> float:
        return self.costs.get(self.layout, 0.0)


@dataclass
class LayoutPlan:
    """A layout per traced node of a model, the planner's cost of it and of the default (every
    layer in NCHW), and how to apply it."""

    layers: list[LayerPlan]
    layouts: list[str]
    cost: float
    default_cost: float | None
    method: str
    latency: str
    input_shapes: list[list[int]]
    planner_seconds: float = 0.0
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def assignment(self) -> dict[str, str]:
        return {layer.name: layer.layout for layer in self.layers}

    @property
    def convs(self) -> list[LayerPlan]:
        return [layer for layer in self.layers if layer.kind == "conv" and layer.spec]

    @property
    def conversions(self) -> list[tuple[str, str, str]]:
        """(layer, from, to) of every conversion the plan pays for."""
        return [(layer.name, layer.layout, t) for layer in self.layers for t in layer.converts]

    @property
    def speedup(self) -> float | None:
        return self.default_cost / self.cost if self.default_cost and self.cost > 0 else None

    # -- files
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayoutPlan":
        if not isinstance(d, Mapping) or d.get("format") != FORMAT_VERSION:
            raise MacoError(f"not a MACO layout plan (format {d.get('format') if isinstance(d, Mapping) else d!r})")
        try:
            layers = [LayerPlan(**layer) for layer in d["layers"]]
            for layer in layers:
                check_layout(layer.layout)
            return cls(layers=layers, layouts=list(d["layouts"]), cost=float(d["cost"]),
                       default_cost=None if d.get("default_cost") is None else float(d["default_cost"]),
                       method=str(d["method"]), latency=str(d["latency"]),
                       input_shapes=[list(s) for s in d["input_shapes"]],
                       planner_seconds=float(d.get("planner_seconds", 0.0)), env=dict(d.get("env") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise MacoError(f"a malformed layout plan: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str) -> "LayoutPlan":
        return cls.from_dict(load_json(text, "layout plan JSON"))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Written atomically (a temp file beside it, then os.replace)."""
        write_atomic(Path(path), self.to_json().encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "LayoutPlan":
        return cls.from_dict(load_json_file(path, "layout plan"))

    # -- applying it
    def apply(self, model: nn.Module) -> fx.GraphModule:
        """A copy of `model` as a torch.fx GraphModule that runs this plan: NHWC convs hold
        channels_last weights (converted once, here) and tensors change memory format only at
        layout boundaries (`.contiguous(memory_format=...)` before the first consumer that needs
        the other layout). `model` itself is left untouched; outputs are equal to its."""
        gm = symbolic_trace(copy.deepcopy(model))
        _check_signature(self, gm)
        plan = {layer.name: layer for layer in self.layers}
        seen_modules: set[str] = set()
        for layer in self.convs:
            if layer.target in seen_modules:
                continue  # a conv module called twice keeps the format of its first call
            seen_modules.add(layer.target)
            conv = gm.get_submodule(layer.target)
            with torch.no_grad():
                conv.weight.data = conv.weight.data.contiguous(memory_format=memory_format(layer.layout))
        position = _position(gm)
        for node in list(gm.graph.nodes):
            mine = plan[node.name].layout
            groups: dict[str, list[fx.Node]] = {}
            for user in node.users:
                if (user.name in plan and conversion_placed(node, user, mine, plan[user.name].layout)
                        and reads_data(gm, user)):
                    if plan[node.name].shape is not None and len(plan[node.name].shape) == 4:
                        groups.setdefault(plan[user.name].layout, []).append(user)
            for target, users in groups.items():
                first = min(users, key=position)
                with gm.graph.inserting_before(first):
                    conv_node = gm.graph.create_node(
                        "call_method", "contiguous", (node,), {"memory_format": memory_format(target)},
                        name=f"{node.name}_to_{target.lower()}")
                for user in users:
                    user.replace_input_with(node, conv_node)
        gm.graph.lint()
        gm.recompile()
        gm.meta["maco_layout_plan"] = self.to_json()
        return gm


def _position(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: order[n]


def _check_signature(plan: LayoutPlan, gm: fx.GraphModule) -> None:
    have = [(n.name, n.op, node_kind(gm, n)[1]) for n in gm.graph.nodes]
    want = [(layer.name, layer.op, layer.target) for layer in plan.layers]
    if have != want:
        for i, (h, w) in enumerate(zip(have, want)):
            if h != w:
                raise MacoError(f"this plan does not fit the model: node {i} is {h[0]!r} ({h[1]} "
                                f"{h[2]}) but the plan has {w[0]!r} ({w[1]} {w[2]})")
        raise MacoError(f"this plan does not fit the model: it has {len(want)} nodes, the model {len(have)}")


__all__ = ["LayoutPlan", "LayerPlan", "FORMAT_VERSION"]
