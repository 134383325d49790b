"""EfficientNet-B0, MobileNetV3-Large and ConvNeXt-Tiny: torchvision's architectures (its published
parameter counts), named by the CLI, and through the torch.compile backend equal to eager."""
import pytest
import torch

from maco.cli import main
from maco.commands.common import NETWORK_NAMES
from maco.layouts.networks import NETWORKS, build, distinct_convs, network_convs
from tests.test_compile_backend import _randomize_bn

MODERN = {"efficientnet_b0": 5_288_548, "mobilenet_v3_large": 5_483_032, "convnext_tiny": 28_589_128}
# the depthwise kernel sizes each network is known for
DEPTHWISE = {"efficientnet_b0": {3, 5}, "mobilenet_v3_large": {3, 5}, "convnext_tiny": {7}}


def test_the_cli_names_every_built_in_network(capsys):
    assert NETWORK_NAMES == tuple(NETWORKS)
    for command in ("optimize", "tune", "layers", "plan", "space", "cim"):
        assert main([command, "--help"]) == 0
        assert "convnext_tiny" in capsys.readouterr().out.replace("\n", " "), command


@pytest.mark.parametrize("name", MODERN)
def test_torchvision_parameter_counts_and_output_shape(name):
    model = build(name)
    assert sum(p.numel() for p in model.parameters()) == MODERN[name]
    with torch.inference_mode():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


@pytest.mark.parametrize("name", MODERN)
def test_layers_lists_the_distinct_convs(name, capsys):
    assert main(["layers", name]) == 0
    out = capsys.readouterr().out
    distinct = [spec for spec, _ in distinct_convs(network_convs(name))]
    assert f"{len(distinct)} distinct conv layers" in out
    assert {s.kh for s in distinct if s.groups > 1 and s.groups == s.c} == DEPTHWISE[name]


def test_bound_runs(capsys):
    assert main(["bound", "convnext_tiny"]) == 0
    assert "n1_c96_h56_w56_k96_r7x7_p3_g96" in capsys.readouterr().out


# a 2-core machine spends minutes on the first two (timing the variants of their many small convs)
@pytest.mark.parametrize("name", [pytest.param("efficientnet_b0", marks=pytest.mark.slow),
                                  pytest.param("mobilenet_v3_large", marks=pytest.mark.slow), "convnext_tiny"])
def test_compiled_equals_eager(name):
    """SE's broadcast multiply, hardswish/hardsigmoid, SiLU, GELU and LayerNorm over permuted
    tensors: whatever MACO does not take over stays torch's, and the output still equals eager."""
    model = _randomize_bn(build(name))
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    fast = torch.compile(model, backend="maco", options={"tune": "none"})
    with torch.inference_mode():
        want, got = model(x), fast(x)
    assert float((want - got).abs().max() / want.abs().max()) < 1e-4
