"""I/O lower bound vs the optimal tile's dataflow I/O for every conv layer of ResNet-18, AlexNet
and VGG-11 at the host's L1 and L2 (issue 2, section 4).

    python experiments/bounds_table.py [--batch 1] [--levels L1 L2] [--out results]

Writes results/bounds_table.csv (one row per layer and level) and bounds_table.png, and prints
the min / median / max ratio per level: dataflow I/O over the best valid bound, and over the
paper's eq. (7) alone. Sizes are fp32 elements; each level is taken at one processor's S/Np.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from maco.bounds.report import analyse_levels
from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv
from maco.layouts.networks import network_convs
from maco.core.target import Target

FIGURE = Figure(
    "bounds", "eq. (8): Q >= kh*kw*C*Ho*Wo*K / (4*sqrt(2*R*S)); optimal tiles x*y = R*z, "
    "x*y*z = S/Np", "exact arithmetic, no measurement: a ratio above 1 is the price of integer, "
    "edge-clipped tiles against a bound that allows any schedule", csv=("bounds_table.csv",), quick=False,
    hosts={"bounds_table.csv": ("1e18664238be84b1", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = ("resnet18", "alexnet", "vgg11")
COLUMNS = ["network", "layer", "spec", "level", "S", "processors", "R", "bound_eq7", "bound_best",
           "best_kind", "compulsory", "gemm_leading", "tile_x", "tile_y", "tile_z", "tile_fits",
           "footprint", "dataflow_io", "ratio_best", "ratio_eq7", "cont_x", "cont_y", "cont_z"]


def rows(batch: int, level_names: list[str]) -> list[dict[str, object]]:
    target = Target.host()
    levels = [target.level(name) for name in level_names]
    layers = [(net, name, spec) for net in NETWORKS for name, spec in network_convs(net, batch)]
    out = []
    for net, name, spec in tqdm(layers, desc="bounds", unit="layer"):
        for r in analyse_levels(spec, levels):
            cont = r.tile.continuous or (float("nan"),) * 3
            out.append({"network": net, "layer": name, "spec": str(spec), "level": r.level,
                        "S": r.S, "processors": r.processors, "R": r.bound.R,
                        "bound_eq7": round(r.bound.pebble, 1), "bound_best": round(r.bound.best, 1),
                        "best_kind": r.bound.best_kind, "compulsory": r.bound.compulsory,
                        "gemm_leading": "" if r.bound.gemm_leading is None else round(r.bound.gemm_leading, 1),
                        "tile_x": r.tile.x, "tile_y": r.tile.y, "tile_z": r.tile.z,
                        "tile_fits": r.tile.fits, "footprint": r.footprint, "dataflow_io": r.io,
                        "ratio_best": round(r.ratio, 4),
                        "ratio_eq7": round(r.ratio_eq7, 4) if r.bound.pebble > 0 else "",
                        "cont_x": round(cont[0], 2), "cont_y": round(cont[1], 2), "cont_z": round(cont[2], 2)})
    return out


def summary(data: list[dict[str, object]], level_names: list[str]) -> list[str]:
    lines = []
    for level in level_names:
        for key, label in (("ratio_best", "I/O / best bound"), ("ratio_eq7", "I/O / eq.(7)")):
            vals = [float(r[key]) for r in data if r["level"] == level and r[key] != ""]
            if vals:
                lines.append(f"{level:>3} {label:<17} min {min(vals):8.3f}  median "
                             f"{statistics.median(vals):8.3f}  max {max(vals):8.3f}  ({len(vals)} layers)")
        kinds = [str(r["best_kind"]) for r in data if r["level"] == level]
        lines.append(f"{level:>3} best bound is " + ", ".join(f"{k} for {kinds.count(k)}"
                                                              for k in sorted(set(kinds))))
    return lines


def plot(path: Path, data: list[dict[str, object]], level_names: list[str]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(level_names), 1, figsize=(12, 3.2 * len(level_names)), squeeze=False)
    for ax, level in zip(axes[:, 0], level_names):
        sel = [r for r in data if r["level"] == level]
        xs = range(len(sel))
        ax.bar(xs, [float(r["ratio_best"]) for r in sel], label="I/O / best bound")
        ax.plot(xs, [float(r["ratio_eq7"]) if r["ratio_eq7"] != "" else float("nan") for r in sel],
                "k.", label="I/O / eq.(7)")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [f"{r['network']}:{r['layer']}" for r in sel], rotation=90, fontsize=6)
        ax.set_ylabel("ratio")
        ax.set_title(f"host {level}: S = {sel[0]['S']} elements")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--levels", nargs="+", default=["L1", "L2"], help="host memory levels (default L1 L2)")
    args = ap.parse_args(argv)
    data = rows(args.batch, args.levels)
    out = out_dir(args)
    suffix = "" if args.batch == 1 else f"_n{args.batch}"
    csv_path = out / f"bounds_table{suffix}.csv"
    write_csv(csv_path, data, COLUMNS)
    plot(out / f"bounds_table{suffix}.png", data, args.levels)
    print("\n".join(summary(data, args.levels)))
    print(f"wrote {csv_path} ({len(data)} rows) and {csv_path.with_suffix('.png')}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the spread of dataflow I/O over the best bound, per memory level."""
    ratios = {lvl: sorted(num(r, "ratio_best") for r in rows if r["level"] == lvl) for lvl in ("L1", "L2")}
    parts = [f"{lvl}: dataflow I/O of the chosen tile / best lower bound min {v[0]:.2f}, median "
             f"{v[len(v) // 2]:.2f}, max {v[-1]:.2f}" for lvl, v in ratios.items() if v]
    return f"{len(rows)} (layer, level) pairs; " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
