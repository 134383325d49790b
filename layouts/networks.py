"""The paper's networks, and three deployed today, as plain torch modules (torchvision does not
import beside the local torch).

Architectures match torchvision's ResNet-18/50, AlexNet, VGG-11, MobileNetV2, EfficientNet-B0,
MobileNetV3-Large and ConvNeXt-Tiny layer for layer (default hyper-parameters, stochastic depth
left out: it is the identity at inference), so their conv shapes are the ones deployed. Weights
are random: MACO needs shapes and timings, not accuracy.
"""
from __future__ import annotations

import importlib.util
import math
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.target import require_memory


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, stages = 64, []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            mods = []
            for b in range(blocks):
                mods.append(block(cin, planes, stride if b == 0 else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*mods))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(256 * 36, 4096), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG(nn.Module):
    def __init__(self, config: list[int | str], num_classes: int = 1000):
        super().__init__()
        mods: list[nn.Module] = []
        cin = 3
        for v in config:
            if v == "M":
                mods.append(nn.MaxPool2d(2, 2))
            else:
                mods += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                cin = int(v)
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 49, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        mods: list[nn.Module] = []
        if expand != 1:
            mods += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        mods += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                 nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
                 nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*mods)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        mods: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True)]
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                mods.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        mods += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*mods)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def _make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's channel rounding (to a multiple of 8, never more than 10% down)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _conv_bn_act(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
                 act: type | None = nn.ReLU, eps: float = 1e-5) -> nn.Sequential:
    """torchvision's Conv2dNormActivation with BatchNorm: a same-padded conv without bias."""
    mods: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout, eps=eps)]
    return nn.Sequential(*mods, act(inplace=True)) if act else nn.Sequential(*mods)


class SqueezeExcitation(nn.Module):
    """torchvision's SE block: 1x1 convs on the pooled input scale its channels."""

    def __init__(self, channels: int, squeeze: int, act: type, gate: type):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation, self.scale_activation = act(), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class MBConv(nn.Module):
    """EfficientNet's block: expand, depthwise, SE (a quarter of the block's input), project."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, expand: int):
        super().__init__()
        hidden = _make_divisible(cin * expand)
        mods: list[nn.Module] = [] if hidden == cin else [_conv_bn_act(cin, hidden, 1, act=nn.SiLU)]
        mods += [_conv_bn_act(hidden, hidden, k, stride, hidden, nn.SiLU),
                 SqueezeExcitation(hidden, max(1, cin // 4), nn.SiLU, nn.Sigmoid),
                 _conv_bn_act(hidden, cout, 1, act=None)]
        self.block = nn.Sequential(*mods)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_residual else self.block(x)


class EfficientNetB0(nn.Module):
    SETTINGS = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))  # expand, k, stride, cout, n

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        mods: list[nn.Module] = [_conv_bn_act(3, 32, 3, 2, act=nn.SiLU)]
        cin = 32
        for t, k, s, c, n in self.SETTINGS:
            mods.append(nn.Sequential(*(MBConv(cin if i == 0 else c, c, k, s if i == 0 else 1, t) for i in range(n))))
            cin = c
        mods.append(_conv_bn_act(cin, 1280, 1, act=nn.SiLU))
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class InvertedResidualV3(nn.Module):
    """MobileNetV3's block: ReLU or hardswish, SE gated by a hard sigmoid, BatchNorm eps 1e-3."""

    def __init__(self, cin: int, k: int, hidden: int, cout: int, se: bool, act: type, stride: int):
        super().__init__()
        mods: list[nn.Module] = [] if hidden == cin else [_conv_bn_act(cin, hidden, 1, act=act, eps=1e-3)]
        mods.append(_conv_bn_act(hidden, hidden, k, stride, hidden, act, 1e-3))
        if se:
            mods.append(SqueezeExcitation(hidden, _make_divisible(hidden // 4), nn.ReLU, nn.Hardsigmoid))
        mods.append(_conv_bn_act(hidden, cout, 1, act=None, eps=1e-3))
        self.block = nn.Sequential(*mods)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_residual else self.block(x)


class MobileNetV3Large(nn.Module):
    RE, HS = nn.ReLU, nn.Hardswish
    SETTINGS = ((16, 3, 16, 16, False, RE, 1), (16, 3, 64, 24, False, RE, 2), (24, 3, 72, 24, False, RE, 1),
                (24, 5, 72, 40, True, RE, 2), (40, 5, 120, 40, True, RE, 1), (40, 5, 120, 40, True, RE, 1),
                (40, 3, 240, 80, False, HS, 2), (80, 3, 200, 80, False, HS, 1), (80, 3, 184, 80, False, HS, 1),
                (80, 3, 184, 80, False, HS, 1), (80, 3, 480, 112, True, HS, 1), (112, 3, 672, 112, True, HS, 1),
                (112, 5, 672, 160, True, HS, 2), (160, 5, 960, 160, True, HS, 1), (160, 5, 960, 160, True, HS, 1))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential(_conv_bn_act(3, 16, 3, 2, act=nn.Hardswish, eps=1e-3),
                                      *(InvertedResidualV3(*row) for row in self.SETTINGS),
                                      _conv_bn_act(160, 960, 1, act=nn.Hardswish, eps=1e-3))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(960, 1280), nn.Hardswish(inplace=True), nn.Dropout(0.2),
                                        nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class Permute(nn.Module):
    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


class LayerNorm2d(nn.LayerNorm):
    """torchvision's LayerNorm over the channels of an NCHW tensor (through NHWC and back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, then LayerNorm and a GELU MLP on channels-last tensors,
    scaled per channel (layer scale) and added to the input."""

    def __init__(self, dim: int):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(dim, dim, 7, padding=3, groups=dim), Permute(0, 2, 3, 1),
                                   nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim), nn.GELU(),
                                   nn.Linear(4 * dim, dim), Permute(0, 3, 1, 2))
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer_scale * self.block(x)


class ConvNeXtTiny(nn.Module):
    STAGES = ((96, 3), (192, 3), (384, 9), (768, 3))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        mods: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 96, 4, 4), LayerNorm2d(96, eps=1e-6))]
        for i, (dim, n) in enumerate(self.STAGES):
            if i:
                cin = self.STAGES[i - 1][0]
                mods.append(nn.Sequential(LayerNorm2d(cin, eps=1e-6), nn.Conv2d(cin, dim, 2, 2)))
            mods.append(nn.Sequential(*(CNBlock(dim) for _ in range(n))))
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(768, eps=1e-6), nn.Flatten(1), nn.Linear(768, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


NETWORKS: dict[str, Callable[[], nn.Module]] = OrderedDict(
    resnet18=lambda: ResNet(BasicBlock, [2, 2, 2, 2]),
    alexnet=AlexNet,
    vgg11=lambda: VGG([64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]),
    resnet50=lambda: ResNet(Bottleneck, [3, 4, 6, 3]),
    mobilenet_v2=MobileNetV2,
    efficientnet_b0=EfficientNetB0,
    mobilenet_v3_large=MobileNetV3Large,
    convnext_tiny=ConvNeXtTiny,
)
INPUT_SHAPE = (1, 3, 224, 224)


def build(name: str) -> nn.Module:
    """A fresh network in eval mode, seeded so that repeated builds have equal weights, initialised
    as torchvision initialises them and with BatchNorm statistics as a trained network has them
    (see trained_like): with torch's default init, MobileNetV2's features shrink below 1e-7, and
    its output is the classifier's bias whatever the convs compute."""
    if name not in NETWORKS:
        raise MacoError(f"unknown network {name!r}; choose one of {', '.join(NETWORKS)}")
    torch.manual_seed(0)
    return trained_like(NETWORKS[name]()).eval()


@torch.no_grad()
def trained_like(model: nn.Module) -> nn.Module:
    """torchvision's init (convs kaiming-normal fan-out, linears N(0, 0.01)), small random biases,
    BatchNorm running statistics, Batch/LayerNorm scales and shifts and ConvNeXt's layer scales
    drawn around 1 and 0 (as a trained network has them, so folding them into the convs is
    exercised) and the running variance set so that each BatchNorm normalises what it sees on one
    random image (activations stay of order 1, layer after layer)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
        if isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None:
            m.bias.uniform_(-0.1, 0.1)  # torchvision zeroes them; a bias bug should show
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.2, 0.2)
        elif isinstance(m, CNBlock):  # at its initial 1e-6 a block would vanish from the output
            m.layer_scale.uniform_(0.5, 1.5)

    def calibrate(bn: nn.Module, args: tuple) -> None:  # runs before the BatchNorm, in forward order
        x = args[0]
        bn.running_mean.copy_(x.mean((0, 2, 3)) + 0.05 * torch.randn(bn.num_features))
        bn.running_var.copy_(x.var((0, 2, 3)) * (0.75 + 0.5 * torch.rand(bn.num_features)) + bn.eps)

    hooks = [m.register_forward_pre_hook(calibrate) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    if hooks:
        model.eval()(torch.randn(1, *INPUT_SHAPE[1:]))
    for h in hooks:
        h.remove()
    return model


def example_input(batch: int = 1) -> torch.Tensor:
    """A fixed random image batch; refused up front where the batch's activations (about 16 times
    the input at the networks' widest layers) would not fit this host's memory."""
    shape = (batch, *INPUT_SHAPE[1:])
    require_memory(16 * 4 * math.prod(shape), f"a batch of {batch} images of {INPUT_SHAPE[1:]}")
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def conv_layers(model: nn.Module, example: torch.Tensor) -> list[tuple[str, ConvSpec]]:
    """Every Conv2d the example input passes through, in execution order, with its ConvSpec."""
    found: list[tuple[str, ConvSpec]] = []
    names = {mod: name for name, mod in model.named_modules()}
    hooks = [mod.register_forward_pre_hook(
        lambda mod, args: found.append((names[mod], ConvSpec.from_module(mod, tuple(args[0].shape)))))
        for mod in model.modules() if isinstance(mod, nn.Conv2d)]
    try:
        with torch.no_grad():
            model(example)
    except MacoError:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's model failing is a user error, said in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise MacoError(f"the model's forward failed on an input of shape {tuple(example.shape)}: "
                        f"{type(exc).__name__}: {first}") from None
    finally:
        for hook in hooks:
            hook.remove()
    return found


def network_convs(name: str, batch: int = 1) -> list[tuple[str, ConvSpec]]:
    """The conv layers of a built-in network at a batch size (shapes only: traced on torch's meta
    device, so a batch too large to run still lists its layers)."""
    return conv_layers(build(name).to("meta"), torch.empty(batch, *INPUT_SHAPE[1:], device="meta"))


def distinct_convs(layers: list[tuple[str, ConvSpec]]) -> list[tuple[ConvSpec, list[str]]]:
    """Distinct specs in first-seen order, each with the layer names that share it."""
    groups: dict[ConvSpec, list[str]] = OrderedDict()
    for name, spec in layers:
        groups.setdefault(spec, []).append(name)
    return list(groups.items())


def load_model(text: str) -> tuple[str, nn.Module]:
    """A built-in network name, or `path/to/file.py:ClassName` (built with no arguments)."""
    if text in NETWORKS:
        return text, build(text)
    if ":" not in text:
        raise MacoError(f"unknown model {text!r}: give a built-in network ({', '.join(NETWORKS)}) "
                        "or path/to/file.py:ClassName")
    path, cls_name = text.rsplit(":", 1)
    if not Path(path).is_file():
        raise MacoError(f"model file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"maco_user_model_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:
        raise MacoError(f"importing {path!r} failed: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise MacoError(f"{path!r} has no {cls_name!r}")
    try:
        model = cls()
    except Exception as exc:
        raise MacoError(f"building {cls_name}() from {path!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise MacoError(f"{cls_name}() from {path!r} is a {type(model).__name__}, not a torch.nn.Module")
    return cls_name, model
