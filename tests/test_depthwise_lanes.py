"""A depthwise kernel's channel block is at most one of the target's vectors (kernels.depthwise):
wider generic vectors were split lane by lane by gcc on AVX2 (~5 GFLOP/s on MobileNetV2's 3x3
layers); every block width computes what torch does, NaN included."""
import re

import pytest
import torch
from torch.nn import functional as F

from maco import kernels
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.kernels.depthwise import DepthwiseKernel, DepthwisePlan
from maco.layouts.maco_modules import MacoDepthwise2d

HOST = kernels.host_target()


@pytest.mark.parametrize("lanes", [4, 8, 16])
@pytest.mark.parametrize("spec", ["n1_c48_h15_w17_k48_r3x3_p1_g48", "n1_c40_h14_w14_k40_r3x3_s2_p1_g40",
                                  "n1_c24_h9_w9_k24_r5x5_p2_g24"])
def test_every_block_width_equals_torch(lanes, spec):
    spec = ConvSpec.parse(spec)
    gen = torch.Generator().manual_seed(lanes)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    x[0, 3, 2, 4] = float("nan")
    w, b = torch.randn(spec.c, 1, spec.kh, spec.kw, generator=gen), torch.randn(spec.c, generator=gen)
    plan = DepthwisePlan(spec, "NHWC", True, "relu6", HOST.cores, lanes)
    width = int(re.search(r"vector_size\((\d+)\)", plan.source).group(1))
    assert width <= 4 * lanes and spec.c % (width // 4) == 0
    y = torch.empty(spec.output_shape, memory_format=torch.channels_last)
    DepthwiseKernel(plan, HOST)(x, plan.pack_weight(w.numpy()), b.numpy(), y)
    want = F.hardtanh(F.conv2d(x, w, b, spec.stride, spec.padding, groups=spec.groups), 0.0, 6.0)
    assert torch.equal(want.isnan(), y.isnan())
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_the_module_blocks_by_the_targets_vectors():
    spec = ConvSpec.parse("n1_c32_h8_w8_k32_r3x3_p1_g32")
    conv = torch.nn.Conv2d(32, 32, 3, 1, 1, groups=32)
    mod = MacoDepthwise2d(conv, spec, "NHWC", HOST)
    assert mod._plan.lanes == min(16, HOST.simd_width)
    with pytest.raises(MacoError, match="lanes"):
        DepthwisePlan(spec, "NHWC", lanes=12)
