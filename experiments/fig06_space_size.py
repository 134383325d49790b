"""Figure 6: schedule-space size of every distinct conv layer of AlexNet, ResNet-18 and VGG-11,
before and after MACO pruning, on this machine's CPU (sketch SSRSRS) and on the H100 (SSSRRSRS).

    python experiments/fig06_space_size.py [--out results] [--batch 1] [--tolerance 2]

Sizes are exact counts (maco.space.schedules.space_size), not estimates; a layer whose pruning had to be
relaxed says so in the `relaxed` column. Writes fig06_space_size.csv and .png under --out.
"""
from __future__ import annotations

import math
from pathlib import Path

from maco.experiments.common import Figure, geomean, num, out_dir, parser, pyplot, save_plot, write_csv

FIGURE = Figure(
    "fig06", "AlexNet's schedule spaces reach tens of millions; pruning keeps a small fraction",
    "counts of our own sketch (SSRSRS on CPU, SSSRRSRS on GPU) with its annotations, not TVM's, so "
    "absolute sizes differ; the reduction is what to compare", csv=("fig06_space_size.csv",), quick=False,
    hosts={"fig06_space_size.csv": ("ea2f56d919add035", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = ("alexnet", "resnet18", "vgg11")
COLUMNS = ["network", "layer", "spec", "target", "sketch", "unpruned", "pruned", "ratio", "relaxed"]


def measure(batch: int, tolerance: float) -> list[dict]:
    from tqdm import tqdm

    from maco.space import prune, schedules as space
    from maco.layouts.networks import distinct_convs, network_convs
    from maco.core.schedule import SKETCHES
    from maco.core.target import Target

    config = prune.PruneConfig(tolerance=tolerance)
    targets = (Target.host(), Target.h100())
    jobs = [(net, names, spec) for net in NETWORKS
            for spec, names in distinct_convs(network_convs(net, batch))]
    rows = []
    for net, names, spec in tqdm(jobs, desc="fig06 space sizes", unit="layer"):
        for target in targets:
            full = space.space_size(spec, target)
            kept = space.space_size(spec, target, pruned=True, config=config)
            rows.append(dict(network=net, layer="+".join(names), spec=str(spec), target=target.name,
                             sketch=SKETCHES[target.kind], unpruned=full, pruned=kept,
                             ratio=f"{full / kept:.4g}",
                             relaxed="; ".join(space.prune_plan(spec, target, config).notes)))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(len(NETWORKS), len(targets), figsize=(7 * len(targets), 3.2 * len(NETWORKS)),
                             squeeze=False)
    for i, net in enumerate(NETWORKS):
        for j, target in enumerate(targets):
            ax = axes[i][j]
            sel = [r for r in rows if r["network"] == net and r["target"] == target]
            xs = range(len(sel))
            ax.bar([x - 0.2 for x in xs], [r["unpruned"] for r in sel], 0.4, label="unpruned")
            ax.bar([x + 0.2 for x in xs], [r["pruned"] for r in sel], 0.4, label="MACO pruned")
            ax.set_yscale("log")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([f"L{k + 1}" for k in xs], fontsize=7)
            ax.set_title(f"{net} on {target} ({sel[0]['sketch'] if sel else ''})", fontsize=9)
            ax.set_ylabel("schedules")
            ax.grid(axis="y", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.suptitle("Fig. 6: schedule-space size per distinct conv layer (exact counts, log scale)")
    fig.tight_layout()
    save_plot(fig, path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--tolerance", type=float, default=2.0, help="pruning tolerance on x*y/(R*z)")
    args = ap.parse_args(argv)
    out = out_dir(args)
    rows = measure(args.batch, args.tolerance)
    write_csv(out / "fig06_space_size.csv", rows, COLUMNS)
    plot(rows, out / "fig06_space_size.png")
    for target in dict.fromkeys(r["target"] for r in rows):
        sel = [r for r in rows if r["target"] == target]
        gm = math.exp(sum(math.log(r["unpruned"] / r["pruned"]) for r in sel) / len(sel))
        print(f"{target}: {len(sel)} layers, unpruned {min(r['unpruned'] for r in sel):.3g}.."
              f"{max(r['unpruned'] for r in sel):.3g}, pruned {min(r['pruned'] for r in sel):.3g}.."
              f"{max(r['pruned'] for r in sel):.3g}, geometric-mean reduction {gm:.3g}x")
    print(f"wrote {out / 'fig06_space_size.csv'} and {out / 'fig06_space_size.png'}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per target, the geomean reduction and the largest space."""
    parts = []
    for tgt in sorted({r["target"] for r in rows}):
        sub = [r for r in rows if r["target"] == tgt]
        biggest = max(sub, key=lambda r: int(r["unpruned"]))
        parts.append(f"{tgt}: geomean reduction {geomean([num(r, 'ratio') for r in sub]):,.0f}x over "
                     f"{len(sub)} layers; largest space {int(biggest['unpruned']):.3g} "
                     f"({biggest['network']} {biggest['layer']}) -> {int(biggest['pruned']):,}")
    return "; ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
