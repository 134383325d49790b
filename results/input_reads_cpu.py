"""The first conv reading the model's NCHW input itself, against a conversion to NHWC and the conv,
whole model, same process (maco_modules.fold_input_conversion).

    flock /tmp/maco-timing.lock python results/input_reads_cpu.py --networks mobilenet_v2,resnet50

Both models are MACO's every-conv model (kernel_choice.kernels_everywhere, default schedules,
with the linear, Winograd, block and squeeze-excitation kernels where the model gains, as
segments), built once, saved, and loaded twice, so that both make the same timed choices; in
the second the gate (faster_input_reads) times the fold, whose ratio is printed beside, and the
first conv is folded whatever it says.

Statistics: the median over interleaved rounds of each model's median call (ms), and the median
of per-round ratios; then, for an effect smaller than the rounds' spread, single calls of the
two alternated --paired times (A B, B A, ...): the median of the paired differences (converted
minus folded, ms), and its range over ten interleaved subsets of the pairs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from maco.core.target import Target
from maco.core.timing import interleaved_rounds, steady_allocator
from maco.deploy.deployment import describe, load, save
from maco.deploy.kernel_choice import (faster_blocks, faster_input_reads, faster_linears, faster_squeeze,
                                       faster_winograd, kernels_everywhere)
from maco.layouts.maco_modules import fold_input_conversion, input_conversion
from maco.layouts.networks import build, example_input
from maco.layouts.segments import use_segments


def twins(net: str, x: torch.Tensor, target: Target) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The every-conv model twice, with the same kernels: its choices are timed (and so may differ
    from one build to the next), so it is built once and loaded back twice."""
    gm, plan = kernels_everywhere(build(net), x, target, portable=False)  # as maco optimize builds it
    for pick in (faster_linears, faster_winograd, faster_blocks, faster_squeeze):
        pick(gm, x, target)
    with tempfile.TemporaryDirectory() as tmp:
        save(describe(gm, "planned_maco", x, target, plan), Path(tmp) / "m.maco")
        return tuple(load(Path(tmp) / "m.maco", build(net), segments=False) for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", default="mobilenet_v2,mobilenet_v3_large,efficientnet_b0,resnet50")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--paired", type=int, default=2000, help="alternated single calls of each (0: none)")
    args = ap.parse_args()
    steady_allocator()
    target = Target.host(torch.get_num_threads())
    print(f"{target.model} ({target.isa}, {target.cores} threads), batch 1\n")
    print("| network | first conv | converted, ms | read as NCHW, ms | ratio per round: median (min-max) | "
          "paired difference, ms: median (subsets) | the gate's ratio | max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for net in args.networks.split(","):
        x = example_input(1)
        gm, folded = twins(net, x, target)
        path = next(p for p, _ in gm.named_modules() if p and input_conversion(gm, p) is not None)
        gate = faster_input_reads(folded, x, target)[path]
        if input_conversion(folded, path) is not None:
            fold_input_conversion(folded, path, target)
        use_segments(gm, target)
        use_segments(folded, target)
        with torch.inference_mode():
            want = build(net)(x)
            diff = max(float((m(x) - want).abs().max() / want.abs().max()) for m in (gm, folded))
            if not torch.equal(gm(x), folded(x)):  # the same sums in the same order: bit for bit
                raise SystemExit(f"{net}: the folded model's output differs from its twin's")
            timed = interleaved_rounds({"converted": lambda: gm(x), "folded": lambda: folded(x)}, args.rounds,
                                       repeats=3, min_run_time=0.1, warmup=3)
            pairs = paired(lambda: gm(x), lambda: folded(x), args.paired)
        ratios = [c.median / f.median for c, f in zip(timed["converted"], timed["folded"])]
        ms = {k: statistics.median(t.median for t in v) * 1e3 for k, v in timed.items()}
        subsets = [statistics.median(pairs[i::10]) * 1e3 for i in range(10)] if len(pairs) >= 10 else [float("nan")]
        print(f"| {net} | {path} | {ms['converted']:.2f} | {ms['folded']:.2f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{statistics.median(pairs) * 1e3 if pairs else float('nan'):.3f} ({min(subsets):.3f} to {max(subsets):.3f}) | "
              f"{gate:.2f} | {diff:.1e} |", flush=True)


def paired(a, b, n: int) -> list[float]:
    """a's time minus b's (s) for n pairs of single calls, alternately a first and b first."""
    clock, out = time.perf_counter, []
    for i in range(n):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        ta, tb = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        out.append(ta - tb)
    return out


if __name__ == "__main__":
    main()
