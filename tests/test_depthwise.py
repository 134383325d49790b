"""Generated depthwise kernels (kernels.depthwise) against torch's grouped conv, in both layouts,
with the fused bias and activations, on MobileNetV2's layers and on random shapes; swapped into a
network only where they win, and saved and reloaded with it."""
import json
import random

import pytest
import torch
from torch import nn

import maco
from maco import kernels
from maco.deploy.deployment import describe
from maco.core.errors import MacoError
from maco.deploy.kernel_choice import faster_depthwise
from maco.kernels.depthwise import DepthwisePlan, is_depthwise
from maco.layouts import fuse
from maco.layouts.deploy import plan
from maco.layouts.fusion import FusedConv2d
from maco.layouts.maco_modules import MacoDepthwise2d, depthwise_can_run, swap_module
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from maco.core.spec import ConvSpec

HOST = kernels.host_target()
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def _cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        c, k, s, d = rng.choice([2, 3, 8, 16, 24, 40, 144]), rng.choice([1, 3, 5, 7]), rng.choice([1, 2, 3]), rng.choice([1, 1, 2])
        p = rng.choice([0, k // 2 * d, 1])
        h, w = rng.randint(k * d, 19), rng.randint(k * d, 19)
        yield (rng.choice([1, 2]), c, h, w), nn.Conv2d(c, c, k, s, p, d, groups=c, bias=rng.random() < 0.7)


MOBILENET = [(spec.input_shape, nn.Conv2d(spec.c, spec.c, 3, spec.stride, 1, groups=spec.c))
             for spec, _ in distinct_convs(conv_layers(build("mobilenet_v2"), example_input(1))) if spec.groups > 1]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape,conv", MOBILENET + list(_cases(0, 30)))
def test_depthwise_equals_torch(shape, conv, layout):
    conv = conv.eval()
    spec = ConvSpec.from_module(conv, shape)
    x = torch.randn(shape).contiguous(memory_format=FORMATS[layout])
    with torch.inference_mode():
        torch.testing.assert_close(MacoDepthwise2d(conv, spec, layout, HOST)(x), conv(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation,torch_act", [("relu", nn.ReLU()), ("relu6", nn.ReLU6()), ("none", nn.Identity()),
                                                  ("silu", nn.SiLU()), ("hardswish", nn.Hardswish()), ("gelu", nn.GELU())])
def test_fused_epilogue_equals_torch(activation, torch_act):
    conv = nn.Conv2d(32, 32, 3, 1, 1, groups=32).eval()
    fused = FusedConv2d.__new__(FusedConv2d)
    nn.Conv2d.__init__(fused, 32, 32, 3, 1, 1, groups=32)
    fused.load_state_dict(conv.state_dict())
    fused.activation, fused.residual = activation, "none"
    fused.eval()
    x = torch.randn(1, 32, 12, 12).contiguous(memory_format=torch.channels_last)
    spec = ConvSpec.from_module(conv, tuple(x.shape))
    with torch.inference_mode():
        torch.testing.assert_close(MacoDepthwise2d(fused, spec, "NHWC", HOST)(x), torch_act(conv(x)), rtol=1e-4, atol=1e-5)


def test_fallbacks_and_refusals():
    conv = nn.Conv2d(8, 8, 3, 1, 1, groups=8).eval()
    spec = ConvSpec.from_module(conv, (1, 8, 10, 10))
    mod = MacoDepthwise2d(conv, spec, "NHWC", HOST, preallocate=True)
    x = torch.randn(1, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    assert mod(x) is mod(x)  # one buffer
    with torch.inference_mode():
        for other in (torch.randn(1, 8, 12, 12), torch.randn(1, 8, 10, 10), x.transpose(2, 3)):
            torch.testing.assert_close(mod(other), conv(other))
    assert not is_depthwise(ConvSpec.parse("n1_c8_h10_w10_k16_r3x3_g8"))  # multiplier 2
    assert not depthwise_can_run(nn.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode="reflect"), spec)
    with pytest.raises(MacoError, match="one channel and one filter per group"):
        DepthwisePlan(ConvSpec.parse("n1_c8_h10_w10_k8_r3x3"))
    with pytest.raises(MacoError, match="unknown activation"):
        DepthwisePlan(spec, activation="mish")
    with pytest.raises(MacoError, match="no generated depthwise kernel"):
        MacoDepthwise2d(nn.Conv2d(8, 16, 3, groups=8), ConvSpec.parse("n1_c8_h10_w10_k16_r3x3_g8"), "NHWC", HOST)


def test_mobilenet_swaps_and_saves_depthwise_kernels(tmp_path):
    model, x = build("mobilenet_v2"), example_input(1)
    fused = fuse(model, x)
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    p = plan(fused, x, latency={(s, lay): (1.0 if lay == "NHWC" else 2.0) for s in specs for lay in ("NCHW", "NHWC")},
             conversion=lambda shape, a, b: 1e-9)
    gm = p.apply(fused)
    faster_depthwise(gm, x, HOST, rounds=1)
    first = next(n for n, m in gm.named_modules() if not n.endswith("torch_conv")
                 and (isinstance(m, MacoDepthwise2d) or (isinstance(m, nn.Conv2d) and m.groups > 1)))
    if not isinstance(gm.get_submodule(first), MacoDepthwise2d):  # torch won the timing: swap one anyway
        conv = gm.get_submodule(first)
        spec = next(s for s in specs if s.groups == conv.groups and s.groups > 1)
        swap_module(gm, first, MacoDepthwise2d(conv, spec, "NHWC", HOST))
    dep = describe(gm, "planned_maco", x, HOST, p)
    assert dep.depthwise
    (tmp_path / "m.maco").write_text(json.dumps(dep.to_dict()))
    loaded = maco.load(tmp_path / "m.maco", build("mobilenet_v2"))
    with torch.inference_mode():
        want = model(x)
        for got in (gm(x), loaded(x)):
            assert float((want - got).abs().max() / want.abs().max()) < 1e-4
    assert sum(isinstance(m, MacoDepthwise2d) for m in loaded.modules()) == len(dep.depthwise)
    path, saved = next(iter(dep.depthwise.items()))
    dep.depthwise[path] = {**saved, "spec": "n1_c8_h10_w10_k8_r3x3_g8"}
    (tmp_path / "bad.maco").write_text(json.dumps(dep.to_dict()))
    with pytest.raises(MacoError, match="is not the saved"):
        maco.load(tmp_path / "bad.maco", build("mobilenet_v2"))


def test_the_planner_sees_the_depthwise_kernel_where_it_beats_torch(monkeypatch):
    """with_depthwise puts the depthwise kernel's time into each layout's entry of the depthwise
    convs it beats torch on (not other convs, not where it loses), so that the plan keeps a
    depthwise conv in the layout its kernel runs fastest in."""
    from maco.deploy import kernel_choice

    ratio = {"value": 2.0}
    monkeypatch.setattr(kernel_choice, "_round_ratios", lambda runs, rounds, before=None: [ratio["value"]] * rounds)
    dw, dense = ConvSpec.parse("n1_c32_h8_w8_k32_r3x3_p1_g32"), ConvSpec.parse("n1_c16_h8_w8_k32_r3x3_p1")
    assert is_depthwise(dw) and not is_depthwise(dense)
    torch_s = {(dw, "NCHW"): 1.0, (dw, "NHWC"): 3.0, (dense, "NHWC"): 3.0}
    table = {**torch_s, (dw, "NCHW"): 0.4}  # a MACO direct kernel was faster than torch there
    assert kernel_choice.with_depthwise(table, torch_s, HOST) == {**table, (dw, "NHWC"): 1.5}
    ratio["value"] = 0.9
    assert kernel_choice.with_depthwise(table, torch_s, HOST) == table
