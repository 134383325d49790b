"""Squeeze-excitation as one generated kernel (kernels.squeeze_excite, MacoSqueezeExcite): equal to
torch's six calls on many shapes, NaN and infinities where torch puts them, found in the planned
graphs of EfficientNet-B0 and MobileNetV3, run inside segments, saved and loaded."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco.core.errors import MacoError
from maco.deploy import deployment, kernel_choice
from maco.deploy.kernel_choice import faster_blocks, faster_squeeze, kernels_everywhere
from maco.kernels import host_target
from maco.kernels.squeeze_excite import SqueezeKernel, SqueezePlan
from maco.layouts.blocks import find_squeeze_excites
from maco.layouts.maco_modules import MacoSqueezeExcite
from maco.layouts.networks import SqueezeExcitation, build, example_input, trained_like
from maco.layouts.segments import segments_of, use_segments

HOST = host_target()
NAN, INF = float("nan"), float("inf")
ACT = {"relu": F.relu, "silu": F.silu}
GATE = {"sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}


def reference(plan: SqueezePlan, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    w1, b1, w2, b2 = w
    pooled = x.mean((2, 3), keepdim=True)
    return x * GATE[plan.gate](F.conv2d(ACT[plan.act](F.conv2d(pooled, w1, b1)), w2, b2))


def setup(plan: SqueezePlan, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if plan.layout == "NHWC" else torch.contiguous_format
    x = torch.randn(plan.shape, generator=g).contiguous(memory_format=fmt)
    s, c = plan.squeeze, plan.c
    w = [torch.randn(s, c, 1, 1, generator=g) / c ** 0.5, torch.randn(s, generator=g) * 0.1,
         torch.randn(c, s, 1, 1, generator=g) / s ** 0.5, torch.randn(c, generator=g) * 0.1]
    return x, w


def run(plan: SqueezePlan, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    weight, bias = plan.pack(*[t.numpy() for t in w])
    y = torch.empty_like(x)
    SqueezeKernel(plan, HOST)(x, weight, bias, y)
    return y


CASES = [(1, 72, 28, 28, 24, "relu", "hardsigmoid", "NHWC", 2), (1, 96, 56, 56, 4, "silu", "sigmoid", "NHWC", 2),
         (2, 40, 7, 5, 10, "silu", "sigmoid", "NCHW", 2), (3, 30, 3, 3, 7, "relu", "sigmoid", "NCHW", 1),
         (1, 1152, 7, 7, 48, "silu", "sigmoid", "NHWC", 3), (2, 20, 1, 1, 5, "relu", "hardsigmoid", "NHWC", 2),
         (1, 13, 9, 11, 3, "silu", "hardsigmoid", "NCHW", 2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_kernel_equals_torch(case):
    plan = SqueezePlan(*case)
    x, w = setup(plan)
    want = reference(plan, x, w)
    got = run(plan, x, w)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_nan_and_infinities_land_where_torch_puts_them(gate, layout):
    for n, spots in ((2, [(0, 1, 0, 0, NAN)]), (2, [(1, 3, 2, 2, INF)]), (1, [(0, 0, 1, 1, -INF)]),
                     (1, [(0, 2, 0, 1, INF), (0, 2, 3, 3, -INF)])):
        plan = SqueezePlan(n, 24, 5, 6, 6, "relu" if gate == "hardsigmoid" else "silu", gate, layout, 2)
        x, w = setup(plan, seed=n)
        for b, c, i, j, v in spots:
            x[b, c, i, j] = v
        want, got = reference(plan, x, w), run(plan, x, w)
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(got), test(want))
        finite = want.isfinite()
        assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, needle", [
    (dict(act="gelu"), "activation"), (dict(gate="tanh"), "gate"), (dict(layout="NCDHW"), "layout"),
    (dict(c=0), "c must be"), (dict(threads=True), "threads"), (dict(n=64, c=1024), "scratch"),
])
def test_a_bad_plan_is_one_clear_error(bad, needle):
    args = dict(n=1, c=8, h=4, w=4, squeeze=2, act="relu", gate="sigmoid", layout="NHWC", threads=1) | bad
    with pytest.raises(MacoError, match=needle):
        SqueezePlan(**args)


class _SE(nn.Module):
    """A conv, then squeeze-excitation on its output, then another conv."""

    def __init__(self, act: type = nn.ReLU, gate: type = nn.Hardsigmoid):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.se = SqueezeExcitation(32, 8, act, gate)
        self.out = nn.Conv2d(32, 16, 1)

    def forward(self, x):
        return self.out(self.se(self.conv(x)))


@pytest.mark.parametrize("act, gate", [(nn.ReLU, nn.Hardsigmoid), (nn.SiLU, nn.Sigmoid)])
def test_squeeze_excitation_runs_as_one_kernel_in_a_segment(act, gate, monkeypatch):
    torch.manual_seed(0)
    model = trained_like(_SE(act, gate)).eval()
    x = torch.randn(2, 3, 12, 12)
    gm, _ = kernels_everywhere(model, x, HOST)
    (found,) = find_squeeze_excites(gm)
    assert (found.paths[0], found.paths[3]) == ("se.avgpool", "se.scale_activation")
    monkeypatch.setattr(kernel_choice, "_faster_end_to_end", lambda *args: True)
    assert faster_squeeze(gm, x, HOST) == 1
    assert isinstance(gm.get_submodule("se.scale_activation"), MacoSqueezeExcite)
    assert not any(n.op == "call_function" and "mul" in str(n.target) for n in gm.graph.nodes)
    use_segments(gm, HOST)
    assert len(segments_of(gm)) == 1 and len(segments_of(gm)[0].modules_in_order) == 3
    with torch.inference_mode():
        want = model(x)
        assert float((gm(x) - want).abs().max() / want.abs().max()) < 1e-5
        x[1, 0, 3, 3] = NAN
        assert torch.equal(torch.isnan(gm(x)), torch.isnan(model(x))) and torch.isnan(model(x)).any()


def test_an_input_the_kernel_does_not_take_runs_torch():
    torch.manual_seed(0)
    model = trained_like(_SE()).eval()
    gm, _ = kernels_everywhere(model, torch.randn(1, 3, 6, 6), HOST)
    mods = [gm.get_submodule(p) for p in find_squeeze_excites(gm)[0].paths]
    se = MacoSqueezeExcite(*mods, (1, 32, 6, 6), "NHWC", HOST)
    with torch.inference_mode():
        for x in (torch.randn(1, 32, 6, 6), torch.randn(2, 32, 5, 5).contiguous(memory_format=torch.channels_last)):
            assert torch.allclose(se(x), model.se(x), atol=1e-6)  # NCHW, another shape: torch's modules
    with pytest.raises(MacoError, match="no generated kernel"):
        MacoSqueezeExcite(*mods[:3], nn.Tanh(), (1, 32, 6, 6), "NHWC", HOST)
    with pytest.raises(MacoError, match="no generated kernel"):  # ReLU not fused into fc1
        MacoSqueezeExcite(model.se.avgpool, model.se.fc1, model.se.fc2, model.se.scale_activation,
                          (1, 32, 6, 6), "NHWC", HOST)


def test_a_squeeze_excitation_whose_gate_is_read_twice_is_left_alone():
    class Twice(_SE):
        def forward(self, x):
            x = self.conv(x)
            se = self.se
            g = se.scale_activation(se.fc2(se.activation(se.fc1(se.avgpool(x)))))
            return self.out(x * g) + g.mean()

    gm, _ = kernels_everywhere(trained_like(Twice()).eval(), torch.randn(1, 3, 8, 8), HOST)
    assert find_squeeze_excites(gm) == []


def test_squeeze_excitations_found_in_the_networks():
    for net, count in (("efficientnet_b0", 16), ("mobilenet_v3_large", 8), ("mobilenet_v2", 0), ("resnet18", 0)):
        gm, _ = kernels_everywhere(build(net), example_input(1), HOST, others=False)
        assert len(find_squeeze_excites(gm)) == count, net


@pytest.mark.parametrize("net", ["efficientnet_b0", "mobilenet_v3_large"])
def test_a_network_with_blocks_and_squeeze_excitation_equals_eager_saved_and_loaded(net, monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = trained_like(build(net)).eval()
    x = example_input(1)
    gm, plan = kernels_everywhere(model, x, HOST)
    monkeypatch.setattr(kernel_choice, "MIN_GAIN", 0.0)
    faster_blocks(gm, x, HOST, rounds=1)
    kept = faster_squeeze(gm, x, HOST)
    count = {"efficientnet_b0": 16, "mobilenet_v3_large": 8}[net]
    assert kept == count
    use_segments(gm, HOST)
    assert len(segments_of(gm)) == 1  # blocks, squeeze-excitation and convs: one C call
    path = tmp_path / "m.maco"
    deployment.save(deployment.describe(gm, "planned_maco", x, HOST, plan), path)
    saved = json.loads(path.read_text())
    assert len(saved["squeeze"]) == count
    inside = {p for e in saved["squeeze"].values() for p in (e["pool"], e["fc1"], e["fc2"])}
    assert not inside & set(saved["convs"]) and not inside & set(saved["pools"])
    loaded = deployment.load(path, model)
    assert sum(isinstance(m, MacoSqueezeExcite) for m in loaded.modules()) == count
    with torch.inference_mode():
        want = model(x)
        for got in (gm(x), loaded(x)):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-4
        x[0, 1, 100, 7] = NAN
        assert torch.equal(torch.isnan(loaded(x)), torch.isnan(model(x)))


@pytest.mark.parametrize("tamper, needle", [
    (lambda e: e.update(fc1="se.fc2"), "no squeeze-excitation"),
    (lambda e: e.update(shape=[1, 3, 12, 12]), "no generated kernel"),
    (lambda e: e.update(shape="big"), "no generated kernel"),
    (lambda e: e.update(layout="NC"), "no generated kernel"),
])
def test_a_tampered_saved_squeeze_excitation_is_one_clear_error(tamper, needle, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = trained_like(_SE()).eval()
    x = torch.randn(1, 3, 12, 12)
    gm, plan = kernels_everywhere(model, x, HOST)
    monkeypatch.setattr(kernel_choice, "_faster_end_to_end", lambda *args: True)
    faster_squeeze(gm, x, HOST)
    dep = deployment.describe(gm, "planned_maco", x, HOST, plan)
    tamper(dep.squeeze["se.scale_activation"])
    path = tmp_path / "bad.maco"
    deployment.save(dep, path)
    with pytest.raises(MacoError, match=needle):
        deployment.load(path, model)


def test_squeeze_excitation_not_faster_in_the_model_is_undone(monkeypatch):
    torch.manual_seed(0)
    model = trained_like(_SE()).eval()
    x = torch.randn(1, 3, 12, 12)
    gm, _ = kernels_everywhere(model, x, HOST)
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    monkeypatch.setattr(kernel_choice, "_faster_end_to_end", lambda *args: False)
    assert faster_squeeze(gm, x, HOST) == 0
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before
    assert not any(isinstance(m, MacoSqueezeExcite) for m in gm.modules())
