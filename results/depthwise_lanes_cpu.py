"""The NHWC depthwise kernel with 16-float and 8-float channel blocks (DepthwisePlan.lanes) beside
torch channels_last, on MobileNetV2's 3x3 depthwise layers (ReLU6, bias): each checked against torch
within 1e-4, then timed in 5 alternating rounds (median of round medians).

    flock /tmp/maco-timing.lock python results/depthwise_lanes_cpu.py
"""
import statistics

import torch
from maco import kernels
from maco.core.spec import ConvSpec
from maco.core.timing import interleaved_rounds
from maco.kernels.depthwise import DepthwisePlan, DepthwiseKernel
host = kernels.host_target()
print(host.simd_width, host.cores)
specs = ["n1_c144_h56_w56_k144_r3x3_p1_g144", "n1_c32_h112_w112_k32_r3x3_p1_g32", "n1_c96_h112_w112_k96_r3x3_s2_p1_g96",
         "n1_c192_h28_w28_k192_r3x3_p1_g192", "n1_c576_h14_w14_k576_r3x3_p1_g576", "n1_c960_h7_w7_k960_r3x3_p1_g960"]
for sp in specs:
    spec = ConvSpec.parse(sp)
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    w = torch.randn(spec.c, 1, 3, 3); b = torch.randn(spec.c)
    want = torch.nn.functional.hardtanh(torch.nn.functional.conv2d(x, w, b, spec.stride, spec.padding, groups=spec.groups), 0, 6)
    runs = {}
    for lanes in (16, 8):
        plan = DepthwisePlan(spec, "NHWC", True, "relu6", host.cores, lanes)
        k = DepthwiseKernel(plan, host)
        wp = plan.pack_weight(w.numpy()); bp = b.numpy()
        y = torch.empty(spec.output_shape, memory_format=torch.channels_last)
        k(x, wp, bp, y)
        assert float((y - want).abs().max()) < 1e-4, lanes
        runs[lanes] = lambda k=k, wp=wp, bp=bp, y=y: k(x, wp, bp, y)
    runs["torch"] = lambda: torch.nn.functional.conv2d(x, w, b, spec.stride, spec.padding, groups=spec.groups)
    per = interleaved_rounds(runs, 5, repeats=3, min_run_time=0.01, warmup=2)
    med = {k: statistics.median(t.median for t in v) * 1e3 for k, v in per.items()}
    print(sp, {k: f"{v:.3f} ms {spec.flops / v / 1e6:.1f} GF/s" for k, v in med.items()})
