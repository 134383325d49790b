"""The traced layer graph: kinds, shapes (checked against running the modules), edges, errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from maco.core.errors import MacoError
from maco.layouts.graph import trace, trace_module
from maco.layouts.networks import build, conv_layers, example_input


def test_resnet18_graph_shapes_and_kinds() -> None:
    model, x = build("resnet18"), example_input()
    graph = trace(model, x)
    assert graph.inputs == ["x"] and graph.layers[graph.output].kind == "output"
    kinds = [layer.kind for layer in graph.layers.values()]
    assert kinds.count("conv") == 20 and kinds.count("add") == 8
    assert {"bn", "relu", "pool", "linear", "flatten"} <= set(kinds)
    assert graph.layers["x"].shape == (1, 3, 224, 224)
    assert graph.layers[graph.output].shape == (1, 1000)
    # every conv's spec and output shape agree with running the model (independent: hooks)
    by_module = dict(conv_layers(model, x))
    outs: dict[str, tuple[int, ...]] = {}

    def record(name: str):
        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            outs[name] = tuple(out.shape)
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    for layer in graph.convs():
        assert layer.spec == by_module[layer.target]
        assert layer.shape == outs[layer.target] == layer.spec.output_shape
    # the skip connection: the first block's input feeds its conv and the add
    assert set(graph.consumers("maxpool")) == {"layer1_0_conv1", "add"}
    assert graph.layers["add"].inputs == ["layer1_0_bn2", "maxpool"]


@pytest.mark.parametrize("name", ["alexnet", "vgg11", "mobilenet_v2"])
def test_other_networks_trace(name: str) -> None:
    model = build(name)
    graph = trace(model, example_input())
    assert len(graph.convs()) == len(conv_layers(model, example_input()))
    assert graph.layers[graph.output].shape == (1, 1000)
    names = list(graph.layers)
    for layer in graph.layers.values():  # topological: inputs come first
        assert all(names.index(src) < names.index(layer.name) for src in layer.inputs)


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(16)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        z = torch.cat([self.a(x), self.b(x)], 1)
        z = torch.relu(self.bn(z)) * y.mean()
        return z, z.size(0)


def test_functional_ops_multiple_inputs_and_training_mode_untouched() -> None:
    model = Odd().train()
    before = model.bn.running_mean.clone()
    gm, graph = trace_module(model, (torch.randn(2, 3, 9, 9), torch.randn(4)))
    assert graph.inputs == ["x", "y"]
    kinds = {layer.name: layer.kind for layer in graph.layers.values()}
    assert kinds["cat"] == "cat" and kinds["relu"] == "relu" and kinds["mul"] == "mul"
    assert kinds["size"] == "meta" and graph.layers["size"].shape is None
    assert graph.layers["cat"].shape == (2, 16, 9, 9)
    assert model.training and model.bn.training
    assert torch.equal(model.bn.running_mean, before)  # ShapeProp ran in eval mode


def test_errors_name_the_problem() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(MacoError, match="Branchy"):
        trace(Branchy(), torch.randn(1))
    with pytest.raises(MacoError, match=r"\(1, 5, 8, 8\)"):
        trace(nn.Conv2d(3, 4, 3), torch.randn(1, 5, 8, 8))
    with pytest.raises(MacoError, match="list"):
        trace(nn.ReLU(), [[1.0]])
    with pytest.raises(MacoError, match="int"):
        trace(3, torch.randn(1))  # type: ignore[arg-type]
