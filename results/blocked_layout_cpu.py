"""Does the channel-blocked layout itself make a conv faster? oneDNN (through torch) on one network's
convs in its blocked layout (nChw8c / nChw16c, torch.utils.mkldnn), in NHWC and in NCHW (issue 38,
item 2).

    flock /tmp/maco-timing.lock python results/blocked_layout_cpu.py --networks mobilenet_v2,resnet50

ONNX Runtime and OpenVINO run these networks' convs in channel-blocked layouts, and ONNX Runtime's
blocked convs are faster than MACO's NHWC ones on EfficientNet-B0. Whether the layout or the
kernels make that difference shows where one library offers both: oneDNN's own kernels, the same
weights and the same threads, once on a blocked tensor (weights reordered once, beforehand) and
once on an NHWC one. Every distinct conv of the network (batch 1, as the network runs it, with
bias), each label timed in the same interleaved rounds; statistic: the median over rounds of each
label's fastest repeat; a network's total weighs each conv by how often the network runs it.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.utils.mkldnn as mkldnn
from torch import nn

from maco.core.target import Target
from maco.core.timing import interleaved_rounds, steady_allocator
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input


def runs_for(spec) -> dict:
    conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                     spec.groups).eval()
    nhwc = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                     spec.groups).eval().to(memory_format=torch.channels_last)
    nhwc.load_state_dict(conv.state_dict())
    blocked = mkldnn.to_mkldnn(nn.Sequential(conv))
    x = torch.randn(spec.input_shape)
    xl, xb = x.contiguous(memory_format=torch.channels_last), x.to_mkldnn()
    want = conv(x)
    assert torch.allclose(blocked(xb).to_dense(), want, rtol=1e-4, atol=1e-4)
    assert torch.allclose(nhwc(xl), want, rtol=1e-4, atol=1e-4)
    return {"NCHW": lambda: conv(x), "NHWC": lambda: nhwc(xl), "blocked": lambda: blocked(xb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", default="mobilenet_v2,resnet50")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    steady_allocator()
    target = Target.host(torch.get_num_threads())
    print(f"{target.model} ({target.isa}, {target.cores} threads), torch {torch.__version__}, batch 1; "
          "microseconds\n")
    for net in args.networks.split(","):
        print(f"## {net}\n\n| conv | times | NCHW | NHWC | blocked | NHWC / blocked |\n|---|---|---|---|---|---|")
        totals = dict.fromkeys(("NCHW", "NHWC", "blocked"), 0.0)
        with torch.inference_mode():
            for spec, names in distinct_convs(conv_layers(build(net), example_input(1))):
                count = len(names)
                timed = interleaved_rounds(runs_for(spec), args.rounds, repeats=3, min_run_time=0.02, warmup=2)
                us = {k: statistics.median(t.min for t in v) * 1e6 for k, v in timed.items()}
                for k in totals:
                    totals[k] += count * us[k]
                print(f"| {spec} | {count} | {us['NCHW']:.1f} | {us['NHWC']:.1f} | {us['blocked']:.1f} | "
                      f"{us['NHWC'] / us['blocked']:.2f} |", flush=True)
        print(f"| **total** | | {totals['NCHW']:.0f} | {totals['NHWC']:.0f} | {totals['blocked']:.0f} | "
              f"**{totals['NHWC'] / totals['blocked']:.2f}** |\n")


if __name__ == "__main__":
    main()
