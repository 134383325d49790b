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
A layer's output is converted once per distinct layout its consumers use (the conversion is
placed just before the first of those consumers); weights of NHWC convs are converted ahead of
time to channels_last.
"""
from __future__ import annotations

import copy
import json
from contextlib import contextmanager
import operator
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from maco.errors import MacoError
from maco.files import load_json, load_json_file
from maco.spec import ConvSpec
from maco.timing import Timing, environment, time_callable

from maco.layouts.graph import Layer, LayerGraph, node_kind, symbolic_trace, trace_module
from maco.layouts.latency import check_layout, memory_format
from maco.layouts.planners import solve
from maco.layouts.problem import LayoutProblem

FLEXIBLE_KINDS = frozenset({"conv", "bn", "relu", "act", "pool", "add", "mul", "cat", "dropout", "identity"})
META_KINDS = frozenset({"meta", "getattr"})
FORMAT_VERSION = 1
# the predictor trained on this repository's data set: found from any working directory
DEFAULT_PREDICTOR = str(Path(__file__).resolve().parents[1] / "results" / "predictor_cpu")
# How "measure" times each distinct conv: interleaved rounds of both layouts, each by the protocol.
MEASURE = {"rounds": 3, "repeats": 3, "min_run_time": 2e-3}
BASE = "NCHW"

ConvCost = Callable[[ConvSpec, str], float]
ConversionCost = Callable[[tuple[int, ...], str, str], float]


# -- latency sources -----------------------------------------------------------------------------
@dataclass
class Costs:
    """Per-layer conv seconds and per-tensor conversion seconds for one model, and where they
    came from. `conv` is filled by a source for a list of (name, spec) at once (measuring
    interleaves layouts; predicting batches); `conversion` is asked per distinct shape."""

    describe: str
    conv: Callable[[list[tuple[str, ConvSpec]], Sequence[str]], dict[str, dict[str, float]]]
    conversion: ConversionCost


def _measure_convs(device: str, progress: bool) -> Callable:
    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        from tqdm import tqdm

        from maco.layouts.latency import measure_layouts

        by_spec: dict[ConvSpec, dict[str, float]] = {}
        specs = list(dict.fromkeys(spec for _, spec in convs))
        for spec in tqdm(specs, desc="measuring convs", unit="conv", disable=not progress, leave=False):
            timings = measure_layouts(spec, layouts, device, **MEASURE)
            by_spec[spec] = {lay: t.median for lay, t in timings.items()}
        return {name: by_spec[spec] for name, spec in convs}
    return run


def _measure_conversion(device: str) -> ConversionCost:
    from maco.layouts.latency import measure_conversion

    cache: dict[tuple, float] = {}

    def run(shape: tuple[int, ...], src: str, dst: str) -> float:
        key = (tuple(shape), src, dst)
        if key not in cache:
            cache[key] = measure_conversion(shape, src, dst, device, repeats=3).median
        return cache[key]
    return run


def _predicted_convs(predictor: Any) -> Callable:
    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        pairs = [(name, spec, lay) for name, spec in convs for lay in layouts]
        secs = predictor.predict_many([s for _, s, _ in pairs], [lay for _, _, lay in pairs]) if pairs else []
        out: dict[str, dict[str, float]] = {}
        for (name, _, lay), sec in zip(pairs, secs):
            out.setdefault(name, {})[lay] = float(sec)
        return out
    return run


def _table_convs(lookup: Callable[[str, ConvSpec, str], float | None], what: str) -> Callable:
    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, spec in convs:
            for lay in layouts:
                sec = lookup(name, spec, lay)
                if sec is None:
                    raise MacoError(f"{what} has no latency for conv layer {name!r} ({spec}) in {lay}")
                out.setdefault(name, {})[lay] = float(sec)
        return out
    return run


def load_predictor(predictor: Any = None) -> Any:
    """A LatencyPredictor: the one given, one loaded from a path, or the default
    ($MACO_PREDICTOR or the checkout's results/predictor_cpu)."""
    from maco.layouts.predictor import LatencyPredictor

    if isinstance(predictor, LatencyPredictor):
        return predictor
    path = predictor or os.environ.get("MACO_PREDICTOR") or DEFAULT_PREDICTOR
    if not (Path(path) / "predictor.json").exists():
        raise MacoError(f"no trained latency predictor at {str(path)!r}; train one with "
                        "`python -m maco.layouts.predictor results/dataset_cpu.csv results/predictor_cpu` "
                        "or pass predictor=PATH")
    return LatencyPredictor.load(path)


def _conversion_source(conversion: Any, device: str, predictor: Any = None) -> ConversionCost:
    from maco.layouts.latency import ConversionModel, predict_conversion

    if conversion is None or conversion == "measure":
        return _measure_conversion(device)
    if conversion == "predict":
        if predictor is not None:
            return predictor.predict_conversion
        return lambda shape, a, b: predict_conversion(shape, a, b, device)
    if isinstance(conversion, ConversionModel):
        return conversion.predict
    if isinstance(conversion, Mapping):
        def lookup(shape: tuple[int, ...], a: str, b: str) -> float:
            for key in ((tuple(shape), a, b), (a, b)):
                if key in conversion:
                    return float(conversion[key])
            raise MacoError(f"the conversion table has no entry for shape {tuple(shape)} {a}->{b}")
        return lookup
    if callable(conversion):
        return lambda shape, a, b: float(conversion(tuple(shape), a, b))
    raise MacoError(f"conversion must be 'measure', 'predict', a ConversionModel, a dict or a "
                    f"callable (shape, src, dst) -> seconds; got {conversion!r}")


def latency_source(latency: Any, *, predictor: Any = None, conversion: Any = None,
                   device: str = "cpu", progress: bool = False) -> Costs:
    """Costs from `latency`: "measure" (torch, this machine), "predict" (a LatencyPredictor),
    a LatencyPredictor, tuning records (a RecordFile or Records: the best per spec and layout),
    a dict ({layer name: {layout: s}} or {(ConvSpec, layout): s}) or a callable
    (spec, layout) -> s. Conversions: measured for "measure", the predictor's for "predict",
    else `conversion` ("measure" by default, "predict", a ConversionModel, a dict or a callable)."""
    from maco.layouts.predictor import LatencyPredictor
    from maco.records import Record, RecordFile

    if isinstance(latency, str):
        if latency == "measure":
            return Costs(f"measured with torch on {device}", _measure_convs(device, progress),
                         _conversion_source(conversion or "measure", device))
        if latency == "predict":
            pred = load_predictor(predictor)
            return Costs("predicted by the latency predictor", _predicted_convs(pred),
                         _conversion_source(conversion or "predict", device, pred))
        raise MacoError(f"unknown latency source {latency!r}; use 'measure', 'predict', a "
                        "predictor, records, a dict or a callable")
    conv_cost = _conversion_source(conversion, device)
    if isinstance(latency, LatencyPredictor):
        return Costs("predicted by the latency predictor", _predicted_convs(latency),
                     _conversion_source(conversion or "predict", device, latency))
    if isinstance(latency, (RecordFile, list, tuple)) and (
            isinstance(latency, RecordFile) or all(isinstance(r, Record) for r in latency)):
        records = latency.load() if isinstance(latency, RecordFile) else list(latency)
        best: dict[tuple[ConvSpec, str], float] = {}
        for r in records:
            if r.ok:
                key = (r.spec, r.schedule.layout)
                best[key] = min(best.get(key, float("inf")), r.seconds)
        return Costs(f"{len(records)} tuning records",
                     _table_convs(lambda name, spec, lay: best.get((spec, lay)), "the records"), conv_cost)
    if isinstance(latency, Mapping):
        def lookup(name: str, spec: ConvSpec, lay: str) -> float | None:
            if name in latency and isinstance(latency[name], Mapping):
                return latency[name].get(lay)
            return latency.get((spec, lay))
        return Costs("a latency table", _table_convs(lookup, "the latency table"), conv_cost)
    if callable(latency):
        return Costs(f"the function {getattr(latency, '__name__', 'latency')}",
                     _table_convs(lambda name, spec, lay: latency(spec, lay), "the latency function"),
                     conv_cost)
    raise MacoError(f"unsupported latency source {latency!r}")


# -- the plan ------------------------------------------------------------------------------------
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
        from maco.files import write_atomic

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
                if user.name in plan and plan[user.name].layout != mine and _reads_data(gm, user):
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


# -- building the problem ------------------------------------------------------------------------
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


def _reads_data(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node_kind(gm, node)[0] not in META_KINDS


def build_problem(gm: fx.GraphModule, graph: LayerGraph, layouts: Sequence[str],
                  conv_seconds: Mapping[str, Mapping[str, float]],
                  conversion: ConversionCost) -> tuple[LayoutProblem, set[str]]:
    """The LayoutProblem of a traced model by the rules in this module's docstring; also the
    names of the flexible layers."""
    nodes = {n.name: n for n in gm.graph.nodes}
    consumers = {name: [u for u in graph.consumers(name) if _reads_data(gm, nodes[u])]
                 for name in graph.layers}
    flexible = {name for name, layer in graph.layers.items() if _flexible(layer, graph)}
    for name in graph.layers:  # rule 5: a tensor mutated in place while others read it
        readers = consumers[name]
        if len(readers) > 1 and any(_inplace(gm, nodes[u]) for u in readers):
            flexible.discard(name)
            flexible.difference_update(readers)
    layer_cost: dict[str, dict[str, float]] = {}
    for name, layer in graph.layers.items():
        if name not in flexible:
            layer_cost[name] = {BASE: 0.0}
        elif layer.kind == "conv":
            layer_cost[name] = dict(conv_seconds[name])
        else:
            layer_cost[name] = {lay: 0.0 for lay in layouts}
    convert_cost: dict[str, dict[tuple[str, str], float]] = {}
    for name, layer in graph.layers.items():
        if not consumers[name] or not layer.is_4d:
            continue
        mine = layer_cost[name]
        wanted = {lay for u in consumers[name] for lay in layer_cost[u]}
        convert_cost[name] = {(a, b): conversion(layer.shape, a, b)  # type: ignore[arg-type]
                              for a in mine for b in wanted if a != b}
    problem = LayoutProblem(list(graph.layers), consumers, layer_cost, convert_cost)
    return problem, flexible


def _flexible(layer: Layer, graph: LayerGraph) -> bool:
    if layer.kind not in FLEXIBLE_KINDS or not layer.is_4d:
        return False
    if layer.kind == "conv" and layer.spec is None:
        return False
    return all(graph.layers[src].is_4d for src in layer.inputs)


def plan(model: nn.Module, example_input: Any, layouts: Sequence[str] = ("NCHW", "NHWC"),
         latency: Any = "measure", *, predictor: Any = None, conversion: Any = None,
         method: str = "exact", device: str | None = None, progress: bool = False,
         time_limit: float | None = None) -> LayoutPlan:
    """Plan a layout per layer of `model` for inputs like `example_input` (see the module
    docstring for the rules and latency_source for the forms `latency` takes). Latencies are
    measured on `device`, by default the example input's."""
    first = example_input[0] if isinstance(example_input, (tuple, list)) and example_input else example_input
    if device is None:
        device = str(first.device) if isinstance(first, torch.Tensor) else "cpu"
    lays = list(dict.fromkeys(check_layout(lay) for lay in layouts))
    if not lays:
        raise MacoError("give at least one layout to plan with")
    costs = latency_source(latency, predictor=predictor, conversion=conversion, device=device,
                           progress=progress)
    gm, graph = trace_module(model, example_input)
    convs = [(layer.name, layer.spec) for layer in graph.convs() if layer.spec is not None]
    conv_seconds = costs.conv(convs, lays)  # type: ignore[arg-type]
    problem, _ = build_problem(gm, graph, lays, conv_seconds, costs.conversion)
    sol = solve(problem, method, time_limit=time_limit)
    planner_seconds = sol.runtime
    default = {v: BASE for v in problem.layers}
    default_cost = problem.cost(default) if all(BASE in problem.layer_cost[v] for v in problem.layers) else None
    converted = problem.conversions(sol.assignment)
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


# -- end to end ---------------------------------------------------------------------------------
@dataclass
class EndToEnd:
    """Default vs planned model, timed in interleaved rounds: each round times both by the
    protocol, so a load change on a shared machine hits both; speedup is the median of the
    rounds' default/planned ratios. `max_abs_diff` compares their outputs on the input."""

    default: Timing
    planned: Timing
    ratios: list[float]
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return float(statistics.median(self.ratios))


def compare_end_to_end(model: nn.Module, planned: nn.Module, example_input: Any, *, rounds: int = 5,
                       repeats: int = 3, min_run_time: float = 0.02, warmup: int = 3,
                       progress: bool = False) -> EndToEnd:
    """Time `model` (the default layout) against `planned` (e.g. plan.apply(model)) on
    `example_input`, interleaved by rounds, with torch.inference_mode."""
    from tqdm import tqdm

    from maco.timing import pool_timings, steady_allocator

    steady_allocator()  # the allocator's steady state, as the per-layer latencies were measured
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    cuda = any(t.is_cuda for t in inputs if isinstance(t, torch.Tensor))
    with torch.inference_mode(), _strict_fp32(cuda):
        want, got = model(*inputs), planned(*inputs)
        diff = max((float((a - b).abs().max()) for a, b in zip(_tensors(want), _tensors(got))), default=0.0)
    runs = {"default": lambda: model(*inputs), "planned": lambda: planned(*inputs)}
    per_round: dict[str, list[Timing]] = {k: [] for k in runs}
    sync = torch.cuda.synchronize if cuda else None
    with torch.inference_mode(), _strict_fp32(cuda):
        for _ in range(warmup):  # first calls build oneDNN/cuDNN primitives: keep them off the clock
            for fn in runs.values():
                fn()
        for _ in tqdm(range(max(rounds, 1)), desc="end to end", unit="round", disable=not progress,
                      leave=False):
            for key, fn in runs.items():
                per_round[key].append(time_callable(fn, repeats=repeats, min_run_time=min_run_time,
                                                    warmup=1, sync=sync))
    ratios = [d.median / p.median for d, p in zip(per_round["default"], per_round["planned"])]
    return EndToEnd(pool_timings(per_round["default"]), pool_timings(per_round["planned"]), ratios, diff)


@contextmanager
def _strict_fp32(cuda: bool) -> Iterator[None]:
    """On a GPU, time as the per-layer latencies were: fp32 without TF32, cuDNN autotuned."""
    if not cuda:
        yield
        return
    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = flags


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, Mapping):
        return [t for o in out.values() for t in _tensors(o)]
    return []


__all__ = ["plan", "LayoutPlan", "LayerPlan", "latency_source", "build_problem", "load_predictor",
           "compare_end_to_end", "EndToEnd", "FLEXIBLE_KINDS"]
