"""The layout-planning problem: which layout each layer of a network runs in.

Semantics (issue 6, section 5): every layer gets one layout from those its cost table allows (a
table with one layout pins the layer) and pays that table's seconds; every layer's output tensor
is converted at most once per distinct layout its consumers use other than its own, paying
``convert_cost[layer][(own, target)]`` once per such target however many consumers share it. The
network's input and output are layers like any other (pinned to NCHW by whoever builds the
problem, so that a plan pays for converting them).

    p = LayoutProblem(layers=["in", "conv", "out"], consumers={"in": ["conv"], "conv": ["out"]},
                      layer_cost={"in": {"NCHW": 0}, "conv": {"NCHW": 3, "NHWC": 1}, "out": {"NCHW": 0}},
                      convert_cost={"in": {("NCHW", "NHWC"): 1}, "conv": {("NHWC", "NCHW"): 1}})
    p.cost({"in": "NCHW", "conv": "NHWC", "out": "NCHW"})  # 1 + 1 + 1 = 3
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Real
from typing import Any, Callable, Hashable, Mapping, Sequence

from maco.core.errors import MacoError

Name = Hashable
# Seconds to convert a tensor of this shape from one layout to another: (shape, src, dst) -> s.
ConversionCost = Callable[[tuple[int, ...], str, str], float]


def _check_seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise MacoError(f"{where} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


@dataclass
class LayoutProblem:
    """Layers in topological order, who consumes each layer's output, per-layer per-layout
    seconds and per-tensor conversion seconds. Validated on construction: a bad item raises a
    MacoError that names it."""

    layers: Sequence[Name]
    consumers: Mapping[Name, Sequence[Name]]
    layer_cost: Mapping[Name, Mapping[str, float]]
    convert_cost: Mapping[Name, Mapping[tuple[str, str], float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layers:
            raise MacoError("a layout problem needs at least one layer")
        self.index: dict[Name, int] = {}
        for i, name in enumerate(self.layers):
            if name in self.index:
                raise MacoError(f"layer {name!r} is listed twice in layers")
            self.index[name] = i
        self.consumers = {v: list(dict.fromkeys(us)) for v, us in dict(self.consumers).items()}
        for v, us in self.consumers.items():
            if v not in self.index:
                raise MacoError(f"unknown layer {v!r} in consumers (not in layers)")
            for u in us:
                if u not in self.index:
                    raise MacoError(f"consumer {u!r} of layer {v!r} is not in layers")
                if self.index[u] <= self.index[v]:
                    raise MacoError(f"layers are not in topological order: {u!r} consumes "
                                    f"{v!r} but does not come after it")
        self.layer_cost = {v: dict(t) for v, t in dict(self.layer_cost).items()}
        for v in self.layer_cost:
            if v not in self.index:
                raise MacoError(f"unknown layer {v!r} in layer_cost (not in layers)")
        for v in self.layers:
            table = self.layer_cost.get(v)
            if not table:
                raise MacoError(f"layer {v!r} has no layer_cost (give at least one layout)")
            for lay, sec in table.items():
                table[lay] = _check_seconds(sec, f"layer_cost[{v!r}][{lay!r}]")
        self.convert_cost = {v: dict(t) for v, t in dict(self.convert_cost).items()}
        for v, table in self.convert_cost.items():
            if v not in self.index:
                raise MacoError(f"unknown layer {v!r} in convert_cost (not in layers)")
            for pair, sec in table.items():
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise MacoError(f"convert_cost[{v!r}] key {pair!r} must be a (from, to) pair")
                table[pair] = _check_seconds(sec, f"convert_cost[{v!r}][{pair!r}]")
        for v, us in self.consumers.items():
            for u in us:
                for a in self.layer_cost[v]:
                    for b in self.layer_cost[u]:
                        if a != b and (a, b) not in self.convert_cost.get(v, {}):
                            raise MacoError(
                                f"layer {v!r} feeds {u!r}, which may run in {b!r} while {v!r} may "
                                f"run in {a!r}, but convert_cost[{v!r}] has no ({a!r}, {b!r}) entry")
        self.producers: dict[Name, list[Name]] = {v: [] for v in self.layers}
        for v in self.layers:
            for u in self.consumers.get(v, []):
                self.producers[u].append(v)

    @property
    def layouts(self) -> list[str]:
        """Every layout some layer allows, in first-seen order."""
        return list(dict.fromkeys(lay for v in self.layers for lay in self.layer_cost[v]))

    def allowed(self, name: Name) -> list[str]:
        return list(self.layer_cost[name])

    def check_assignment(self, assignment: Mapping[Name, str]) -> None:
        for v in self.layers:
            if v not in assignment:
                raise MacoError(f"the assignment gives layer {v!r} no layout")
            if assignment[v] not in self.layer_cost[v]:
                raise MacoError(f"layer {v!r} cannot run in {assignment[v]!r}; "
                                f"it allows {', '.join(map(repr, self.layer_cost[v]))}")
        extra = set(assignment) - set(self.index)
        if extra:
            raise MacoError(f"the assignment names unknown layer(s) {sorted(map(repr, extra))}")

    def conversions(self, assignment: Mapping[Name, str]) -> dict[Name, list[str]]:
        """Per layer, the distinct layouts (other than its own) its output is converted to."""
        out: dict[Name, list[str]] = {}
        for v in self.layers:
            targets = dict.fromkeys(assignment[u] for u in self.consumers.get(v, []))
            out[v] = [t for t in targets if t != assignment[v]]
        return out

    def cost(self, assignment: Mapping[Name, str], exact: bool = False) -> float | Fraction:
        """Total seconds of an assignment: layer costs plus one conversion per (tensor, distinct
        other layout its consumers use). `exact` sums as Fractions (floats are exact binary
        fractions), to check a solver without rounding."""
        self.check_assignment(assignment)
        num = Fraction if exact else float
        total = num(0)
        conversions = self.conversions(assignment)
        for v in self.layers:
            total += num(self.layer_cost[v][assignment[v]])
            for t in conversions[v]:
                total += num(self.convert_cost[v][(assignment[v], t)])
        return total


@dataclass
class Solution:
    """A planner's answer: the layout of every layer and the total seconds it costs."""

    assignment: dict[Name, str]
    cost: float
    method: str = ""
    runtime: float = 0.0  # seconds the planner took
    optimal: bool = True


class PlannerTimeout(MacoError):
    """A planner ran past its time limit; `best` is the best solution it had found (or None)."""

    def __init__(self, message: str, best: Solution | None = None):
        super().__init__(message)
        self.best = best


__all__ = ["LayoutProblem", "Solution", "PlannerTimeout", "ConversionCost"]
