"""Generated pooling kernels (kernels.pool) against torch's own pooling, in both layouts, on the
networks' layers and on random shapes, strides, paddings, ceil_mode and adaptive sizes."""
import random

import pytest
import torch
from torch import nn

from maco import kernels
from maco.core.errors import MacoError
from maco.kernels.pool import PoolPlan, Windows, adaptive, plan_for, sliding
from maco.layouts.maco_modules import MacoPool2d

HOST = kernels.host_target()
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def _random_cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        k, s = rng.randint(1, 4), rng.randint(1, 3)
        p, ceil_mode = rng.randint(0, k // 2), rng.random() < 0.5
        shape = (rng.randint(1, 2), rng.randint(1, 20), rng.randint(k, 15), rng.randint(k, 15))
        yield rng.choice([
            nn.MaxPool2d(k, s, p, ceil_mode=ceil_mode),
            nn.MaxPool2d((k, max(1, k - 1)), (s, rng.randint(1, 3))),
            nn.AvgPool2d(k, s, p, ceil_mode=ceil_mode, count_include_pad=rng.random() < 0.5),
            nn.AdaptiveAvgPool2d((rng.randint(1, 6), rng.randint(1, 6))),
            nn.AdaptiveMaxPool2d((rng.randint(1, 6), None)),
        ]), shape


NETWORK_POOLS = [(nn.MaxPool2d(3, 2, 1), (1, 64, 112, 112)), (nn.AdaptiveAvgPool2d(1), (1, 512, 7, 7)),
                 (nn.MaxPool2d(3, 2), (1, 64, 55, 55)), (nn.AdaptiveAvgPool2d((6, 6)), (1, 256, 6, 6)),
                 (nn.MaxPool2d(2, 2), (1, 64, 224, 224)), (nn.AdaptiveAvgPool2d((7, 7)), (1, 512, 7, 7)),
                 (nn.AdaptiveAvgPool2d(1), (2, 1280, 7, 7))]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("pool,shape", NETWORK_POOLS + list(_random_cases(0, 40)))
def test_pooling_equals_torch(pool, shape, layout):
    x = torch.randn(shape).contiguous(memory_format=FORMATS[layout])
    mod = MacoPool2d(pool, shape, layout, HOST)
    got, want = mod(x), pool(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_max_pooling_keeps_nan_and_infinities_as_torch(layout):
    x = torch.randn(1, 16, 9, 9)
    x[0, 3, 2, 2], x[0, 5, 0, 0], x[0, 7, 4, 4] = float("nan"), float("inf"), -float("inf")
    x = x.contiguous(memory_format=FORMATS[layout])
    pool = nn.MaxPool2d(3, 2, 1)
    torch.testing.assert_close(MacoPool2d(pool, tuple(x.shape), layout, HOST)(x), pool(x), equal_nan=True)


def test_preallocated_output_and_fallbacks():
    pool = nn.MaxPool2d(3, 2, 1)
    mod = MacoPool2d(pool, (1, 8, 10, 10), "NHWC", HOST, preallocate=True)
    x = torch.randn(1, 8, 10, 10).contiguous(memory_format=torch.channels_last)
    assert mod(x) is mod(x)  # the same buffer every call
    for other in (torch.randn(1, 8, 12, 12), torch.randn(1, 8, 10, 10),  # another shape; NCHW input
                  x.double(), x.transpose(2, 3)):
        out = mod(other)
        assert out is not mod._out
        torch.testing.assert_close(out, pool(other))


def test_unsupported_pooling_has_no_plan():
    shape = (1, 4, 8, 8)
    assert plan_for(nn.MaxPool2d(2, dilation=2), shape, "NHWC", 2) is None
    assert plan_for(nn.MaxPool2d(2, return_indices=True), shape, "NHWC", 2) is None
    assert plan_for(nn.AvgPool2d(2, divisor_override=3), shape, "NHWC", 2) is None
    assert plan_for(nn.ReLU(), shape, "NHWC", 2) is None
    assert plan_for(nn.MaxPool2d(2), (4, 8, 8), "NHWC", 2) is None
    with pytest.raises(MacoError, match="no generated kernel computes"):
        MacoPool2d(nn.MaxPool2d(2, dilation=2), shape, "NHWC", HOST)


def test_plans_refuse_bad_values():
    good = adaptive(4, 2)
    with pytest.raises(MacoError, match="unknown pooling"):
        PoolPlan("min", 1, 1, 4, 4, good, good)
    with pytest.raises(MacoError, match="unknown layout"):
        PoolPlan("max", 1, 1, 4, 4, good, good, layout="NCWH")
    with pytest.raises(MacoError, match="outside 0..4"):
        PoolPlan("max", 1, 1, 4, 4, Windows((0, 3), (2, 5), (2, 2)), good)
    with pytest.raises(MacoError, match="must be a positive int"):
        PoolPlan("avg", 1, "8", 4, 4, good, good)
    with pytest.raises(MacoError, match="leaves nothing|padding"):
        sliding(2, 5, 1, 3)
    assert sliding(7, 3, 2, 1) == Windows((0, 1, 3, 5), (2, 4, 6, 7), (3, 3, 3, 3))
