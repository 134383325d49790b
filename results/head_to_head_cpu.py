"""MACO's model against ONNX Runtime in one process, round by round (issue 38's batch-1 gap).

    flock /tmp/maco-timing.lock python results/head_to_head_cpu.py --networks mobilenet_v2,efficientnet_b0

The engines experiment times each engine in its own process beside torch eager; on a shared VM a
process can land in a slower spell than the next one, and a single pass may rank two close
engines either way. Here both run in the same interleaved rounds, so each round's ratio compares
them under the same conditions. MACO's model is the every-conv model `maco optimize` builds
before it times anything (kernel_choice.kernels_everywhere: default schedules, all NHWC), with
the linear, Winograd, inverted-residual and squeeze-excitation kernels where the model gains, the
first conv reading the NCHW input itself where that wins, as segments; no tuning. ONNX Runtime as
in experiments/engines_cpu.py (ORT_ENABLE_ALL, as many intra-op threads as torch). Statistic: medians over rounds of each one's median call (ms), and
the median of the per-round ratio ONNX Runtime / MACO (above 1: MACO faster).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from maco.core.target import Target
from maco.core.timing import interleaved_rounds, steady_allocator
from maco.deploy.engines import Job, export_onnx
from maco.deploy.kernel_choice import (faster_blocks, faster_input_reads, faster_linears, faster_squeeze,
                                       faster_winograd, kernels_everywhere)
from maco.layouts.networks import build, example_input
from maco.layouts.segments import use_segments


def maco_model(net: str, x: torch.Tensor, target: Target) -> torch.nn.Module:
    gm, _ = kernels_everywhere(build(net), x, target, portable=False)  # as maco optimize builds it
    faster_linears(gm, x, target)
    faster_winograd(gm, x, target)
    faster_blocks(gm, x, target)
    faster_squeeze(gm, x, target)
    faster_input_reads(gm, x, target)
    use_segments(gm, target)
    return gm


def onnxruntime_run(net: str, x: torch.Tensor, folder: Path):
    import onnxruntime as ort

    export_onnx(Job(model=net, input_shape=tuple(x.shape)), x, folder / f"{net}.onnx")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(folder / f"{net}.onnx"), opts, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.numpy()}
    return lambda: sess.run(None, feed)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", default="mobilenet_v2,efficientnet_b0,mobilenet_v3_large,resnet50")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    steady_allocator()
    target = Target.host(torch.get_num_threads())
    print(f"{target.model} ({target.isa}, {target.cores} threads), batch {args.batch}\n")
    print("| network | MACO ms | ONNX Runtime ms | ORT / MACO per round: median (min-max) | max rel. diff |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for net in args.networks.split(","):
            x = example_input(args.batch)
            gm, ort_run = maco_model(net, x, target), onnxruntime_run(net, x, Path(tmp))
            with torch.inference_mode():
                want, got, theirs = build(net)(x), gm(x), torch.from_numpy(ort_run())
                diff = max(float((y - want).abs().max() / want.abs().max()) for y in (got, theirs))
                runs = {"maco": lambda: gm(x), "onnxruntime": ort_run}
                timed = interleaved_rounds(runs, args.rounds, repeats=3, min_run_time=0.1, warmup=3)
            ratios = [o.median / m.median for o, m in zip(timed["onnxruntime"], timed["maco"])]
            ms = {k: statistics.median(t.median for t in v) * 1e3 for k, v in timed.items()}
            print(f"| {net} | {ms['maco']:.2f} | {ms['onnxruntime']:.2f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {diff:.1e} |")


if __name__ == "__main__":
    main()
