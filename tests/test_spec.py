"""ConvSpec: shapes against torch, validation messages, serialisation round trips."""
import pytest
import torch

from maco import ConvSpec, MacoError
from maco.layouts.networks import conv_layers, network_convs

CASES = [
    dict(n=1, c=3, h=224, w=224, k=64, kh=7, kw=7, stride=2, padding=3),
    dict(n=2, c=8, h=13, w=17, k=6, kh=3, kw=5, stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
    dict(n=1, c=16, h=9, w=9, k=16, kh=3, kw=3, padding=1, groups=16),
    dict(n=3, c=12, h=11, w=7, k=8, kh=1, kw=1, stride=4, groups=4),
]


@pytest.mark.parametrize("kw", CASES)
def test_shapes_and_flops_match_torch(kw):
    spec = ConvSpec(**kw)
    conv = torch.nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding,
                           spec.dilation, spec.groups, bias=False)
    x = torch.randn(spec.input_shape)
    y = conv(x)
    assert tuple(y.shape) == spec.output_shape
    assert tuple(conv.weight.shape) == spec.weight_shape
    assert spec.output_elems == y.numel() and spec.input_elems == x.numel()
    assert spec.weight_elems == conv.weight.numel()
    assert spec.flops == 2 * y.numel() * conv.weight[0].numel()
    assert spec.input_bytes == 4 * x.numel()
    assert ConvSpec.from_module(conv, x.shape) == spec


@pytest.mark.parametrize("kw", CASES)
def test_round_trips(kw):
    spec = ConvSpec(**kw)
    assert ConvSpec.from_json(spec.to_json()) == spec
    assert ConvSpec.parse(str(spec)) == spec
    assert hash(ConvSpec.from_dict(spec.to_dict())) == hash(spec)


@pytest.mark.parametrize("kw, message", [
    (dict(n=0, c=3, h=8, w=8, k=4, kh=3, kw=3), "n must be a positive int, got 0"),
    (dict(n=1, c=3, h=8, w=8, k=4, kh=3, kw=3, groups=2), "c=3 is not divisible by groups=2"),
    (dict(n=1, c=4, h=8, w=8, k=3, kh=3, kw=3, groups=2), "k=3 is not divisible by groups=2"),
    (dict(n=1, c=3, h=4, w=8, k=4, kh=7, kw=3, padding=1), "kernel extent 7 along h is larger than the padded input 4 + 2*1 = 6"),
    (dict(n=1, c=3, h=8, w=8, k=4, kh=3, kw=3, dilation=(1, 4)), "kernel extent 9 along w"),
    (dict(n=1, c=3, h=8, w=8, k=4, kh=3, kw=3, stride=0), "stride must be positive"),
    (dict(n=1, c=3, h=8, w=8, k=4, kh=3, kw=3, padding=-1), "padding must be >= 0"),
    (dict(n=1, c=3, h=8, w=8, k=4, kh=3, kw=3, stride=(1, 2, 3)), "stride must be an int or an (h, w) pair"),
    (dict(n=1.5, c=3, h=8, w=8, k=4, kh=3, kw=3), "n must be a positive int, got 1.5"),
])
def test_validation_names_the_bad_value(kw, message):
    with pytest.raises(MacoError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*").replace("+", r"\+")):
        ConvSpec(**kw)


def test_parse_errors_and_defaults():
    assert ConvSpec.parse("c64_h56_w56_k64_r3_p1") == ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1)
    for bad in ("c64_h56_w56_r3", "c64_h56_w56_k64", "c64_hx_w56_k64_r3", "z3_c64_h56_w56_k64_r3"):
        with pytest.raises(MacoError, match="layer spec"):
            ConvSpec.parse(bad)
    with pytest.raises(MacoError, match="unknown ConvSpec field"):
        ConvSpec.from_dict({**ConvSpec(1, 3, 8, 8, 4, 3, 3).to_dict(), "bogus": 1})
    with pytest.raises(MacoError, match="not a ConvSpec JSON"):
        ConvSpec.from_json("{")


def test_from_module_rejects_what_it_cannot_describe():
    with pytest.raises(MacoError, match="expected a torch.nn.Conv2d"):
        ConvSpec.from_module(torch.nn.Linear(3, 4), (1, 3, 8, 8))
    with pytest.raises(MacoError, match="padding='same'"):
        ConvSpec.from_module(torch.nn.Conv2d(3, 4, 3, padding="same"), (1, 3, 8, 8))
    with pytest.raises(MacoError, match="input has 5 channels but the conv expects 3"):
        ConvSpec.from_module(torch.nn.Conv2d(3, 4, 3), (1, 5, 8, 8))


def test_networks_have_the_papers_layers():
    resnet = network_convs("resnet18")
    assert len(resnet) == 20  # 17 3x3/7x7 convs + 3 downsample 1x1
    assert resnet[0][1] == ConvSpec(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3)
    alex = [spec for _, spec in network_convs("alexnet")]
    assert [(s.c, s.k, s.kh, s.out_h) for s in alex] == [
        (3, 64, 11, 55), (64, 192, 5, 27), (192, 384, 3, 13), (384, 256, 3, 13), (256, 256, 3, 13)]
    vgg = network_convs("vgg11", batch=2)
    assert len(vgg) == 8 and all(s.n == 2 for _, s in vgg)
    mobile = network_convs("mobilenet_v2")
    assert sum(s.is_depthwise for _, s in mobile) == 17
    assert len(network_convs("resnet50")) == 53


def test_conv_layers_on_a_user_model():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, stride=2, groups=2))
    found = conv_layers(model, torch.randn(2, 3, 10, 12))
    assert [name for name, _ in found] == ["0", "2"]
    assert found[1][1] == ConvSpec(2, 8, 10, 12, 8, 3, 3, stride=2, groups=2)
