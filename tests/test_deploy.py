"""The deployment API: plans on the built-in networks and odd models, applied graphs whose outputs
equal the original's, memory formats that follow the plan, JSON round trips, latency sources."""
from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.interpreter import Interpreter

from maco.core.errors import MacoError
from maco.layouts import LayoutPlan, build_problem, plan
from maco.layouts.graph import trace, trace_module
from maco.layouts.networks import build, example_input
from maco.layouts.planners import brute_force

FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def mixed_latency(spec, layout: str) -> float:
    """NHWC wins on wide layers, NCHW on narrow ones: plans with boundaries in the middle."""
    base = spec.flops * 1e-12
    wins = layout == ("NHWC" if spec.c >= 128 or spec.groups > 1 else "NCHW")
    return base * (0.5 if wins else 1.0)


def cheap_conversion(shape, src: str, dst: str) -> float:
    return math.prod(shape) * 1e-11


class FormatRecorder(Interpreter):
    """Runs a GraphModule and keeps every node's output, to read back memory formats."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.outputs: dict[str, object] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        self.outputs[n.name] = out
        return out


def check_applied(model: nn.Module, x, p: LayoutPlan) -> fx.GraphModule:
    """Outputs equal, one conversion node per planned conversion, formats as planned, NHWC conv
    weights channels_last, and the original model left as it was."""
    weights = {n: m.weight.is_contiguous() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    gm = p.apply(model)
    inputs = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        want, got = model(*inputs), gm(*inputs)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        if isinstance(a, torch.Tensor):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
        else:
            assert a == b
    conversions = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]
    assert len(conversions) == len(p.conversions)
    rec = FormatRecorder(gm)
    with torch.no_grad():
        rec.run(*inputs)
    for layer in p.layers:
        out = rec.outputs[layer.name]
        if layer.shape and len(layer.shape) == 4 and isinstance(out, torch.Tensor):
            assert out.is_contiguous(memory_format=FORMATS[layer.layout]), (layer.name, layer.layout)
    for layer in p.convs:
        assert gm.get_submodule(layer.target).weight.is_contiguous(memory_format=FORMATS[layer.layout])
    assert weights == {n: m.weight.is_contiguous() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    return gm


@pytest.mark.parametrize("name", ["resnet18", "alexnet", "vgg11", "mobilenet_v2"])
def test_builtin_networks_mixed_plan_outputs_equal(name: str) -> None:
    model, x = build(name), example_input()
    p = plan(model, x, latency=mixed_latency, conversion=cheap_conversion)
    lays = {layer.layout for layer in p.convs}
    assert lays == {"NCHW", "NHWC"}, lays  # a real mix, so boundaries are exercised
    assert p.conversions and p.cost <= p.default_cost
    # the plan's cost is its own layer seconds plus its conversions
    assert p.cost == pytest.approx(sum(layer.seconds for layer in p.layers)
                                   + sum(sum(layer.converts.values()) for layer in p.layers))
    check_applied(model, x, p)


def test_all_nhwc_plan_has_two_boundaries() -> None:
    model, x = build("resnet18"), example_input()
    p = plan(model, x, latency=lambda s, lay: 1.0 if lay == "NCHW" else 0.5,
             conversion=cheap_conversion)
    assert all(layer.layout == "NHWC" for layer in p.convs)
    # the input goes to NHWC once; the pooled features come back once before flatten
    assert [(a, b) for _, a, b in p.conversions] == [("NCHW", "NHWC"), ("NHWC", "NCHW")]
    assert p.conversions[0][0] == "x"
    check_applied(model, x, p)


class Odd(nn.Module):
    """cat, a squeeze-excite multiply, a functional relu, a shape query, an in-place op on a
    tensor that others read, and a 4-D tensor among the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.b = nn.Conv2d(8, 16, 1)
        self.c = nn.Conv2d(32, 32, 3, padding=1)
        self.d = nn.Conv2d(32, 32, 1)
        self.se = nn.Conv2d(32, 32, 1)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor):
        z = torch.cat([self.a(x), self.b(x)], 1)
        y = torch.relu(self.c(z))
        s = torch.sigmoid(self.se(nn.functional.adaptive_avg_pool2d(y, 1)))
        y = y * s
        t = self.d(y)
        u = self.act(t)  # mutates t, which the add below reads after the mutation
        w = u + t
        v = w.view(w.size(0), 32, -1).mean(-1)
        return self.fc(v), w


def test_odd_model_rules_and_equal_outputs() -> None:
    model, x = Odd().eval(), torch.randn(2, 8, 12, 12)
    p = plan(model, x, latency=lambda s, lay: 1.0 if lay == "NCHW" else 0.1,
             conversion=cheap_conversion)
    by = {layer.name: layer for layer in p.layers}
    assert by["a"].layout == by["b"].layout == by["cat"].layout == by["c"].layout == "NHWC"
    assert by["mul"].costs.keys() == {"NCHW", "NHWC"}  # elementwise ops may follow
    # rule 5: t (mutated in place, read twice) is pinned with its readers
    assert by["d"].costs == {"NCHW": 0.0} and by["act"].costs == {"NCHW": 0.0}
    assert by["add"].costs == {"NCHW": 0.0}
    assert by["sigmoid"].costs == {"NCHW": 0.0}  # unknown op: pinned
    assert by["x"].layout == "NCHW" and by["output"].layout == "NCHW"
    check_applied(model, x, p)


class ChannelsLastBlock(nn.Module):
    """ConvNeXt's block: a depthwise conv, then LayerNorm and Linears on (N, H, W, C) between a
    permute that moves channels last and one that moves them back, a layer scale and the residual."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.scale = nn.Parameter(torch.rand(c, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(nn.functional.gelu(self.fc1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.scale * y


def test_permutes_that_move_channels_run_in_nhwc_and_move_no_data() -> None:
    """Rule 6: the permutes run in NHWC; the LayerNorm reads a contiguous tensor without a
    conversion before it, the layer scale and residual stay channels_last, and the plan's
    conversions are the applied graph's."""
    model = nn.Sequential(nn.Conv2d(3, 16, 1), ChannelsLastBlock(), ChannelsLastBlock()).eval()
    x = torch.randn(1, 3, 14, 14)
    p = plan(model, x, latency=lambda s, lay: 1.0 if lay == "NCHW" else 0.5, conversion=cheap_conversion)
    by = {layer.name: layer for layer in p.layers}
    assert {by[n].layout for n in by if n.startswith("permute")} == {"NHWC"}
    assert {by[n].layout for n in by if n.startswith("add") or n.startswith("mul")} == {"NHWC"}
    assert [(a, b) for _, a, b in p.conversions] == [("NCHW", "NHWC"), ("NHWC", "NCHW")]  # in and out only
    gm = p.apply(model)
    assert len([n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous"]) == 2
    rec = FormatRecorder(gm)
    with torch.no_grad():
        got = rec.run(x)
        assert torch.allclose(got, model(x), rtol=1e-4, atol=1e-5)
    for name in by:
        if name.startswith("permute"):
            src = rec.outputs[by[name].name]
            moved = "last" if tuple(src.shape) == (1, 14, 14, 16) else "first"
            assert src.is_contiguous(memory_format=torch.contiguous_format if moved == "last" else torch.channels_last)


def test_convnext_all_nhwc_converts_only_at_its_ends() -> None:
    model, x = build("convnext_tiny"), example_input()
    p = plan(model, x, latency=lambda s, lay: 1.0 if lay == "NCHW" else 0.5, conversion=cheap_conversion)
    assert len(p.conversions) <= 3, p.conversions
    gm = p.apply(model)
    with torch.no_grad():
        want, got = model(x), gm(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_plan_is_optimal_for_its_problem() -> None:
    """On a small model the planner's choice equals brute force over the same problem."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                          nn.Conv2d(8, 4, 1), nn.Flatten()).eval()
    x = torch.randn(1, 3, 10, 10)
    table = {"0": {"NCHW": 3e-5, "NHWC": 1e-5}, "2": {"NCHW": 1e-5, "NHWC": 2e-5},
             "4": {"NCHW": 2e-5, "NHWC": 1e-5}}
    gm, graph = trace_module(model, x)
    problem, _ = build_problem(gm, graph, ["NCHW", "NHWC"],
                               {f"_{k}": v for k, v in table.items()}, cheap_conversion)
    best = brute_force(problem)
    for method in ("exact", "backtrack", "milp"):
        p = plan(model, x, latency={f"_{k}": v for k, v in table.items()},
                 conversion=cheap_conversion, method=method)
        assert p.cost == pytest.approx(best.cost, rel=1e-12)
    check_applied(model, x, p)


def test_json_round_trip_save_load_and_mismatch(tmp_path) -> None:
    model, x = build("alexnet"), example_input()
    p = plan(model, x, latency=mixed_latency, conversion=cheap_conversion)
    q = LayoutPlan.from_json(p.to_json())
    assert q == p
    path = tmp_path / "sub" / "alexnet.plan.json"
    p.save(path)
    assert LayoutPlan.load(path) == p and not list(path.parent.glob(".*tmp"))
    assert json.loads(path.read_text())["format"] == 1
    check_applied(model, x, LayoutPlan.load(path))
    with pytest.raises(MacoError, match="does not fit"):
        q.apply(build("resnet18"))
    with pytest.raises(MacoError, match="JSON"):
        LayoutPlan.from_json("{not json")
    with pytest.raises(MacoError, match="layout plan"):
        LayoutPlan.from_json('{"format": 99}')
    bad = p.to_dict()
    bad["layers"][0]["layout"] = "NCDHW"
    with pytest.raises(MacoError, match="NCDHW"):
        LayoutPlan.from_dict(bad)
    with pytest.raises(MacoError, match="nowhere"):
        LayoutPlan.load(tmp_path / "nowhere.json")


def test_latency_sources_tables_records_and_errors() -> None:
    from maco.tune.records import Record
    from maco.core.schedule import Schedule
    from maco.core.target import Target
    from maco.core.timing import Timing

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    x = torch.randn(1, 3, 10, 10)
    gm, graph = trace_module(model, x)
    specs = {layer.name: layer.spec for layer in graph.convs()}
    by_spec = {(specs["_0"], "NCHW"): 1e-5, (specs["_0"], "NHWC"): 5e-6,
               (specs["_2"], "NCHW"): 1e-5, (specs["_2"], "NHWC"): 2e-5}
    p = plan(model, x, latency=by_spec, conversion=cheap_conversion)
    assert {layer.name: layer.costs for layer in p.convs} == {
        "_0": {"NCHW": 1e-5, "NHWC": 5e-6}, "_2": {"NCHW": 1e-5, "NHWC": 2e-5}}
    host = Target.host().fingerprint()  # records of this machine: those of others are not used
    recs = [Record(spec, host, Schedule("cpu", (), (), layout=lay), Timing(sec, sec, sec, 0.0, 1, 1))
            for (spec, lay), sec in by_spec.items()]
    recs.append(Record(specs["_0"], host, Schedule("cpu", (), (), layout="NHWC"), Timing(1.0, 1.0, 1.0, 0, 1, 1)))
    p2 = plan(model, x, latency=recs, conversion=cheap_conversion)
    assert [layer.costs for layer in p2.convs] == [layer.costs for layer in p.convs]
    with pytest.raises(MacoError, match=r"'_2'.*NHWC"):
        plan(model, x, latency={"_0": {"NCHW": 1, "NHWC": 1}, "_2": {"NCHW": 1}})
    with pytest.raises(MacoError, match="'fastest'"):
        plan(model, x, latency="fastest")
    with pytest.raises(MacoError, match="'NCDHW'"):
        plan(model, x, layouts=("NCHW", "NCDHW"), latency=by_spec, conversion=cheap_conversion)
    with pytest.raises(MacoError, match="nowhere"):
        plan(model, x, latency="predict", predictor="/nowhere")
    with pytest.raises(MacoError, match="'greedy'"):
        plan(model, x, latency=by_spec, conversion=cheap_conversion, method="greedy")


def test_measured_and_predicted_latency_on_a_small_model() -> None:
    from maco.layouts.latency import ConversionModel
    from maco.layouts.predictor_fit import fit_predictor
    from maco.layouts.predictor_models import MLPConfig
    from maco.core.spec import ConvSpec

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2)).eval()
    x = torch.randn(1, 3, 16, 16)
    p = plan(model, x, latency="measure")
    assert "measured" in p.latency
    assert all(0 < sec < 0.1 for layer in p.convs for sec in layer.costs.values())
    assert all(0 < sec < 0.1 for layer in p.layers for sec in layer.converts.values())
    check_applied(model, x, p)

    specs = [ConvSpec(1, c, 16, 16, 16, 3, 3, padding=1) for c in (3, 8, 16, 32)] * 2
    lays = ["NCHW"] * 4 + ["NHWC"] * 4
    secs = np.array([1e-5 * (i + 1) for i in range(8)])
    conv_model = ConversionModel.fit([((1, c, 16, 16), a, b, 1e-6 * c) for c in (2, 4, 8, 16, 32, 64)
                                      for a, b in (("NCHW", "NHWC"), ("NHWC", "NCHW"))])
    pred = fit_predictor(specs, lays, secs, MLPConfig(layers=1, width=8, epochs=2), conversion=conv_model)
    p = plan(model, x, latency=pred)
    for layer in p.convs:
        spec = next(lay.spec for lay in trace(model, x).convs() if lay.name == layer.name)
        assert layer.costs == {lay: pytest.approx(pred.predict(spec, lay)) for lay in ("NCHW", "NHWC")}
    for layer in p.layers:
        for target, sec in layer.converts.items():
            assert sec == pytest.approx(conv_model.predict(tuple(layer.shape), layer.layout, target))
    check_applied(model, x, p)


def test_records_of_another_machine_are_not_used() -> None:
    """Tuning records carry the fingerprint of the machine they were measured on: a plan for this
    host takes this host's records, even where another machine's are faster."""
    from dataclasses import replace

    from maco.tune.records import Record
    from maco.core.schedule import Schedule
    from maco.core.target import Target
    from maco.core.timing import Timing

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    x = torch.randn(1, 3, 10, 10)
    specs = [layer.spec for layer in trace(model, x).convs()]
    host = Target.host()
    other = replace(host, model="another CPU")
    assert other.fingerprint() != host.fingerprint()

    def records(target: Target, sec: float) -> list[Record]:
        return [Record(spec, target.fingerprint(), Schedule("cpu", (), (), layout=lay),
                       Timing(sec, sec, sec, 0.0, 1, 1)) for spec in specs for lay in ("NCHW", "NHWC")]

    mine, theirs = records(host, 1e-5), records(other, 1e-9)
    p = plan(model, x, latency=theirs + mine, conversion=cheap_conversion)
    assert all(layer.costs == {"NCHW": 1e-5, "NHWC": 1e-5} for layer in p.convs)
    p = plan(model, x, latency=theirs + mine, conversion=cheap_conversion, target=other)
    assert all(layer.costs == {"NCHW": 1e-9, "NHWC": 1e-9} for layer in p.convs)
    with pytest.raises(MacoError, match="records"):
        plan(model, x, latency=theirs, conversion=cheap_conversion)


def test_the_package_exports_the_planning_api_lazily() -> None:
    import maco.layouts
    from maco.layouts import _PLANNING

    for name, module in _PLANNING.items():
        assert getattr(maco.layouts, name) is getattr(importlib.import_module(f"maco.layouts.{module}"), name)
    assert set(_PLANNING) <= set(dir(maco.layouts))
    with pytest.raises(AttributeError, match="nothing"):
        maco.layouts.nothing  # noqa: B018
