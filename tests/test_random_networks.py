"""Networks no test was written for: random small CNNs (convs of every size, stride, dilation and
grouping MACO's kernels take or refuse, BatchNorm, every activation, residual adds, squeeze-
excitation, inverted residuals, pools, a linear head) run with MACO kernels everywhere
(kernels_everywhere: direct, depthwise, pooling, Winograd F(2x2) and F(4x4) in turn), as
segments or module by module, against eager torch on finite inputs and on inputs holding NaN and
infinities: the same outputs, NaN and infinities where eager puts them."""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from torch import nn

from maco import kernels
from maco.deploy.kernel_choice import kernels_everywhere
from maco.layouts.maco_modules import MacoWinograd2d
from maco.layouts.segments import segments_of, use_segments

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HOST = kernels.host_target()
ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish, nn.GELU, nn.Identity, nn.Sigmoid, nn.Hardsigmoid,
               nn.Tanh, nn.LeakyReLU)
SEEDS = 20
CHANNELS = (5, 8, 16, 24, 40, 64, 64, 128)  # 64 and 128 filters: Winograd's register blocks fit


class Residual(nn.Module):
    def __init__(self, body: nn.Module, act: nn.Module):
        super().__init__()
        self.body, self.act = body, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x) + x)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.pool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, max(1, c // 4), 1), nn.Conv2d(max(1, c // 4), c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(self.pool(x)))))


def _conv(rng: random.Random, c: int, size: int) -> tuple[nn.Module, int, int]:
    k = rng.choice(CHANNELS)
    ks = rng.choice((1, 3, 3, 3, 5, 7))
    stride = rng.choice((1, 1, 2)) if size >= 6 else 1
    dil = rng.choice((1, 1, 2)) if ks > 1 and size >= 8 else 1
    pad = rng.choice((ks // 2 * dil, ks // 2 * dil, 0))
    groups = c if c == k and rng.random() < 0.3 else (2 if c % 2 == 0 and k % 2 == 0 and rng.random() < 0.15 else 1)
    layers = [nn.Conv2d(c, k, ks, stride, pad, dil, groups, bias=rng.random() < 0.5)]
    layers += [nn.BatchNorm2d(k)] if rng.random() < 0.7 else []
    layers.append(rng.choice(ACTIVATIONS)())
    return nn.Sequential(*layers), k, (size + 2 * pad - dil * (ks - 1) - 1) // stride + 1


def random_network(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """A random CNN in eval mode (BatchNorm statistics random too) and an input for it."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    c, size = rng.choice((3, 4, 16)), rng.randint(9, 40)
    image = (rng.choice((1, 1, 2)), c, size, size)
    layers: list[nn.Module] = []
    while len(layers) < rng.randint(3, 7) and size >= 3:
        kind = rng.random()
        if kind < 0.45 or not layers:
            conv, k, out = _conv(rng, c, size)
            if out < 1:
                break
            layers.append(conv)
            c, size = k, out
        elif kind < 0.6:
            ks = rng.choice((1, 3))
            body = nn.Sequential(nn.Conv2d(c, c, ks, 1, ks // 2), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.Conv2d(c, c, 3, 1, 1, groups=rng.choice((1, c))), nn.BatchNorm2d(c))
            layers.append(Residual(body, rng.choice(ACTIVATIONS)()))
        elif kind < 0.7:
            layers.append(SqueezeExcite(c))
        elif kind < 0.85 and size >= 4:
            ks, stride, pad = rng.choice((2, 3)), rng.choice((1, 2)), rng.choice((0, 1))
            layers.append(rng.choice((nn.MaxPool2d, nn.AvgPool2d))(ks, stride, min(pad, ks // 2)))
            size = (size + 2 * min(pad, ks // 2) - ks) // stride + 1
        else:
            e = c * rng.choice((2, 4, 6))
            body = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
                                 nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e), nn.ReLU6(),
                                 nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))
            layers.append(Residual(body, nn.Identity()))
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, rng.choice((10, 17))))
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.normal_(0, 0.3)
            mod.running_var.uniform_(0.5, 2)
            mod.weight.data.normal_(1, 0.2)
            mod.bias.data.normal_(0, 0.2)
    return net.eval(), torch.randn(image)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_networks_equal_eager_with_nan_and_infinities(seed):
    net, x = random_network(seed)
    rng = random.Random(seed)
    gm, _ = kernels_everywhere(net, x, HOST, winograd=lambda i: (2, 4)[(seed + i) % 2])
    if seed % 3:
        use_segments(gm, HOST)
    assert any(mod.__class__.__module__.startswith("maco.") for mod in gm.modules())
    for trial in range(3):
        xi = x.clone()
        if trial:  # one NaN, or an infinity of each sign
            xi.view(-1)[rng.randrange(xi.numel())] = float("nan") if trial == 1 else float("inf")
            xi.view(-1)[rng.randrange(xi.numel())] = float("nan") if trial == 1 else -float("inf")
        with torch.no_grad():
            want, got = net(xi), gm(xi)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (seed, trial, net)
        finite = want.isfinite()
        scale = max([1.0] + want[finite].abs().tolist())
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-3, atol=1e-3 * scale)


def test_the_random_networks_reach_every_kernel_family():
    """The seeds above put MACO's direct, depthwise, pooling and both Winograd tile sizes to work,
    and segments run some of them: a generator that drifted would test less than it says."""
    seen: set[str] = set()
    for seed in range(SEEDS):
        net, x = random_network(seed)
        gm, _ = kernels_everywhere(net, x, HOST, winograd=lambda i: (2, 4)[(seed + i) % 2])
        if seed % 3:
            use_segments(gm, HOST)
            seen |= {"segment"} if segments_of(gm) else set()
        for mod in gm.modules():
            seen.add(f"{type(mod).__name__}{mod.m if isinstance(mod, MacoWinograd2d) else ''}")
    assert {"MacoConv2d", "MacoDepthwise2d", "MacoPool2d", "MacoWinograd2d2", "MacoWinograd2d4", "segment"} <= seen, seen
