"""Inverted residuals as one kernel (issue 38, item 3): each block of a network against its kernels,
and the whole model with and without the blocks, on MACO's default schedules.

    flock /tmp/maco-timing.lock python results/blocks_cpu.py --model mobilenet_v2 --batch 8

Per block: its modules in the every-conv model (kernel_choice.kernels_everywhere) run as one
segment, as the model runs them ("three kernels"), against the one kernel (MacoInvertedResidual)
with its threads sharing the rows and, where they can, the expanded channels, on the tensor the
block gets in the model. Whole model: the same model run as segments, without blocks and with
the blocks the timing gate keeps (faster_blocks), in the same interleaved rounds. Statistic: the
median over rounds of each label's fastest repeat (ms).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from maco.core.errors import MacoError
from maco.core.target import Target
from maco.core.timing import interleaved_rounds
from maco.deploy.kernel_choice import MIN_GAIN, arguments_seen, block_chain, faster_blocks, kernels_everywhere
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
    print("| block (last conv) | input | expanded | three kernels | one, rows | one, channels | three / best one |")
    print("|---|---|---|---|---|---|---|")
    gm, _ = kernels_everywhere(model, x, target)
    blocks = find_blocks(gm)
    seen = arguments_seen(gm, x, [b.paths[0] or b.paths[1] for b in blocks])
    with torch.inference_mode():
        for block in blocks:
            xin = seen[block.paths[0] or block.paths[1]][0]
            mods = [None if p is None else gm.get_submodule(p) for p in block.paths]
            runs = {}
            for split in ("rows", "channels"):
                try:
                    runs[split] = (lambda f: lambda: f(xin))(MacoInvertedResidual(*mods, tuple(xin.shape), target,
                                                                                  split=split))
                except MacoError:
                    pass
            plan = MacoInvertedResidual(*mods, tuple(xin.shape), target).plan
            chain = block_chain(mods, plan.residual, target)
            runs["three"] = lambda: chain(xin)
            ms = medians(runs, args.rounds)
            best = min(v for k, v in ms.items() if k != "three")
            print(f"| {block.paths[2] or block.paths[1]} | {tuple(xin.shape)} | {plan.m} | {ms['three']:.3f} | "
                  f"{ms['rows']:.3f} | {ms.get('channels', float('nan')):.3f} | {ms['three'] / best:.2f}x |")
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
