"""Inverted residuals as one kernel (issue 38, item 3): each block of a network against its three
kernels, and the whole model with and without the blocks, on MACO's default schedules.

    flock /tmp/maco-timing.lock python results/blocks_cpu.py --model mobilenet_v2 --batch 8

Per block: the expand, depthwise and project modules of the every-conv model (kernel_choice.
kernels_everywhere) each timed alone on the tensors they get in the model, their sum ("three
kernels", each warm: what the chain costs if nothing leaves the caches), the chain called as the
model calls it ("chain"), and the one kernel (MacoInvertedResidual). Whole model: the same model
run as segments, without blocks and with the blocks the timing gate keeps (faster_blocks), in the
same interleaved rounds. Statistic: the median over rounds of each label's fastest repeat (ms).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from maco.core.target import Target
from maco.core.timing import interleaved_rounds
from maco.deploy.kernel_choice import MIN_GAIN, arguments_seen, faster_blocks, kernels_everywhere
from maco.layouts.blocks import find_blocks
from maco.layouts.maco_modules import MacoInvertedResidual
from maco.layouts.networks import build, example_input, trained_like
from maco.layouts.segments import use_segments


def medians(runs: dict, rounds: int) -> dict[str, float]:
    timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=0.02, warmup=1)
    return {k: statistics.median(t.min for t in ts) * 1e3 for k, ts in timed.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    target = Target.host()
    torch.manual_seed(0)
    model = trained_like(build(args.model)).eval()
    x = example_input(args.batch)
    print(f"{args.model}, batch {args.batch}, {target.model} ({target.isa}, {target.cores} threads)\n")
    print("| block (project conv) | input | expand | depthwise | project | three kernels | chain | one kernel | chain / one |")
    print("|---|---|---|---|---|---|---|---|---|")
    gm, _ = kernels_everywhere(model, x, target)
    blocks = find_blocks(gm)
    seen = arguments_seen(gm, x, [b.paths[0] or b.paths[1] for b in blocks])
    with torch.inference_mode():
        for block in blocks:
            xin = seen[block.paths[0] or block.paths[1]][0]
            expand, dw, project = [None if p is None else gm.get_submodule(p) for p in block.paths]
            fused = MacoInvertedResidual(expand, dw, project, tuple(xin.shape), target)
            e = expand(xin) if expand is not None else xin
            d = dw(e)
            residual = (xin,) if fused.plan.residual else ()
            runs = {"depthwise": lambda: dw(e), "project": lambda: project(d, *residual),
                    "chain": lambda: project(dw(expand(xin) if expand is not None else xin), *residual),
                    "one": lambda: fused(xin)}
            if expand is not None:
                runs["expand"] = lambda: expand(xin)
            ms = medians(runs, args.rounds)
            three = ms.get("expand", 0.0) + ms["depthwise"] + ms["project"]
            print(f"| {block.paths[2]} | {tuple(xin.shape)} | {ms.get('expand', 0.0):.3f} | {ms['depthwise']:.3f} | "
                  f"{ms['project']:.3f} | {three:.3f} | {ms['chain']:.3f} | {ms['one']:.3f} | "
                  f"{ms['chain'] / ms['one']:.2f}x |")
        with_blocks, _ = kernels_everywhere(model, x, target)
        ratios = faster_blocks(with_blocks, x, target)
        use_segments(gm, target)
        use_segments(with_blocks, target)
        want = model(x)
        err = float((with_blocks(x) - want).abs().max() / want.abs().max())
        ms = medians({"eager": lambda: model(x), "segments": lambda: gm(x), "blocks": lambda: with_blocks(x)},
                     args.rounds)
    kept = sum(r >= MIN_GAIN for r in ratios.values())
    print(f"\nWhole model: eager {ms['eager']:.2f} ms; every conv a MACO kernel, as segments, {ms['segments']:.2f} ms; "
          f"with the {kept} of {len(ratios)} blocks the gate kept as one kernel {ms['blocks']:.2f} ms "
          f"({ms['segments'] / ms['blocks']:.2f}x); max relative error against eager {err:.1e}")


if __name__ == "__main__":
    main()
