"""MACO's CPU kernels against torch conv2d (oneDNN) on every distinct conv layer of ResNet-18,
AlexNet and VGG-11 at batch 1: the bound-derived default schedules, and with --records also each
layout's best tuned schedule, timed beside the default in the same rounds (the faster one counts).

Per layer: MACO's NCHW and NHWC kernels (each checked against torch first), torch in NCHW and
channels_last, and the layer's flops done by the FMA-peak loop and by the register-tile mix (the
same loads and FMAs with every operand in L1), all timed in the same interleaved rounds
(maco.tune.benchmark): the VM runs in faster and slower spells, so each fraction of peak is the
median of per-round ratios, beside the fraction of the best peak ever measured here. Writes
kernels_cpu[_tuned].csv (GFLOP/s, those fractions, speedup of MACO's better layout over torch's
faster one), a .png and an .env.json under --out, and prints the geometric means.

    python experiments/kernels_cpu.py --out results [--records results/records_cpu.jsonl]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from maco import Target, kernels
from maco.tune.benchmark import bench_layer
from maco.experiments.common import (Figure, geomean, layer_bars, num, out_dir, parser, save_plot, write_csv,
                                     write_env)
from maco.layouts.networks import distinct_convs, network_convs

FIGURE = Figure(
    "kernels_cpu", "(CPU) MACO kernels vs oneDNN; the paper reports GPU kernels only",
    "a 2-core CPU VM that runs in faster and slower spells of seconds: the FMA peak and the "
    "register-tile ceiling are timed on each layer's flops in the same rounds as the kernels, and "
    "fractions and speedups are medians of per-round ratios (the best peak ever seen here is kept "
    "beside them); the 1x1 stride-2 layers, where oneDNN is slow at batch 1, lift the mean",
    csv=("kernels_cpu_tuned.csv", "kernels_cpu_tuned_quick.csv", "kernels_cpu.csv", "kernels_cpu_quick.csv",
         "kernels_cpu_amd.csv"),
    records=True)

QUICK_LAYERS = {"resnet18": 3, "alexnet": 1, "vgg11": 1}  # --quick: the first layers of each


def layers(networks: list[str], quick: bool) -> list[tuple[str, str, object]]:
    out, seen = [], set()
    for net in networks:
        rows = distinct_convs(network_convs(net, 1))
        if quick:
            rows = [r for r in rows if r[0].kh == 3][:QUICK_LAYERS.get(net, 1)]
        for spec, names in rows:
            if spec not in seen:
                seen.add(spec)
                out.append((net, names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else ""), spec))
    return out


def plot(path: Path, rows: list[dict]) -> None:
    fig, ax, x = layer_bars(rows, (("maco_gflops", "MACO (best layout)"), ("torch_nchw_gflops", "torch NCHW"),
                                   ("torch_nhwc_gflops", "torch channels_last")),
                            "CPU conv kernels, batch 1, geomean speedup over torch's faster layout "
                            f"{geomean([r['speedup'] for r in rows]):.2f}x")
    ax.plot(x, [r["ceiling_gflops"] for r in rows], "_", color="grey", ms=12,
            label="register-tile ceiling (loads + FMAs in L1), same rounds")
    ax.axhline(rows[0]["best_peak_gflops"], color="k", ls=":", lw=0.8, label="best FMA peak measured here")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="a few 3x3 layers, fewer rounds")
    ap.add_argument("--networks", default="resnet18,alexnet,vgg11")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--records", action="append", default=[],
                    help="tuning records (repeatable): each layout's best tuned schedule is timed beside "
                    "the default and the faster counts; writes kernels_cpu_tuned.*")
    args = ap.parse_args(argv)
    missing = [p for p in args.records if not Path(p).is_file()]
    if missing:
        ap.error(f"records file(s) not found: {', '.join(missing)}")
    out = out_dir(args)
    repeats = args.repeats or (3 if args.quick else 7)
    target = Target.host()
    best_peak = kernels.measure_peak(target, fresh=True)
    tuned = {}
    if args.records:
        from maco.tune.records import best_in_files

        tuned = best_in_files(args.records, target)
    rows = []
    for net, name, spec in layers(args.networks.split(","), args.quick):
        # the default always runs; a tuned schedule beside it, and the faster one counts (records
        # taken on another day or before a better default was written may trail today's default)
        schedules = {layout: kernels.default_schedule(spec, target, layout) for layout in ("NCHW", "NHWC")}
        for layout in ("NCHW", "NHWC"):
            if (spec, layout) in tuned and tuned[(spec, layout)].schedule != schedules[layout]:
                schedules[f"{layout} tuned"] = tuned[(spec, layout)].schedule
        r = bench_layer(name, spec, schedules, target, repeats=repeats, ceilings=True)
        g = {k: r.gflops(k) for k in r.seconds}
        per_layout = {layout: max((k for k in schedules if k.startswith(layout)), key=lambda k: g[k])
                      for layout in ("NCHW", "NHWC")}
        label = max(per_layout.values(), key=lambda k: g[k])
        best = label.split()[0]
        speedup = r.speedup(label)
        has_ceiling = "microkernel ceiling" in g
        rows.append({"network": net, "layer": name, "spec": str(spec), "kernel": f"{spec.kh}x{spec.kw}",
                     "maco_layout": best, "maco_gflops": round(g[label], 2),
                     "maco_nchw_gflops": round(g[per_layout["NCHW"]], 2),
                     "maco_nhwc_gflops": round(g[per_layout["NHWC"]], 2),
                     "schedule": "tuned" if label.endswith("tuned") else "default",
                     "fraction_of_peak": round(r.speedup(label, over=("FMA peak",)), 4),
                     "fraction_of_ceiling": round(r.speedup(label, over=("microkernel ceiling",)), 4)
                     if has_ceiling else float("nan"),
                     "fraction_of_best_peak": round(g[label] / best_peak, 4),
                     "torch_nchw_gflops": round(g["torch NCHW"], 2),
                     "torch_nhwc_gflops": round(g["torch NHWC"], 2),
                     "speedup": round(speedup, 4),
                     "peak_gflops": round(g["FMA peak"], 1),
                     "ceiling_gflops": round(g["microkernel ceiling"], 1) if has_ceiling else float("nan"),
                     "best_peak_gflops": round(best_peak, 1),
                     "max_error": f"{r.error:.2e}"})
        print(f"{net:9s} {name:28s} {spec!s:36s} MACO {g[label]:6.1f} ({label}, "
              f"{rows[-1]['fraction_of_peak']:4.0%} of peak {g['FMA peak']:.0f})  "
              f"torch {g['torch NCHW']:6.1f} / {g['torch NHWC']:6.1f}  speedup {speedup:5.2f}x",
              flush=True)
    stem = "kernels_cpu" + ("_tuned" if tuned else "") + ("_quick" if args.quick else "")
    write_csv(out / f"{stem}.csv", rows)
    plot(out / f"{stem}.png", rows)
    write_env(out / f"{stem}.csv", best_peak_gflops=best_peak, threads=target.cores, repeats=repeats,
              records=args.records)
    three = [r for r in rows if r["kernel"] == "3x3"]
    worst = sorted(rows, key=lambda r: r["speedup"])[:3]
    print(f"\ngeomean speedup over torch's faster layout: {geomean([r['speedup'] for r in rows]):.2f}x "
          f"({len(rows)} layers); 3x3 layers: {geomean([r['fraction_of_peak'] for r in three]):.0%} of "
          f"the FMA peak in the same rounds, {geomean([r['fraction_of_ceiling'] for r in three]):.0%} of "
          f"the microkernel ceiling, {geomean([r['fraction_of_best_peak'] for r in three]):.0%} of the best "
          f"peak measured here ({best_peak:.0f} GFLOP/s) (geomeans); slowest vs torch: "
          + ", ".join(f"{r['network']}:{r['layer']} {r['speedup']:.2f}x" for r in worst))
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the geomean speedup over torch, and the 3x3 layers' fractions of peak."""
    tuned = sum(r.get("schedule") == "tuned" for r in rows)
    text = (f"{len(rows)} layers (the faster of the default and the best record: {tuned} tuned, "
            f"{len(rows) - tuned} default schedules): geomean "
            f"{geomean([num(r, 'speedup') for r in rows]):.2f}x over torch's faster layout")
    three = [r for r in rows if r["kernel"] == "3x3"]
    if three:
        text += (f"; 3x3 layers at {100 * geomean([num(r, 'fraction_of_peak') for r in three]):.0f}% of the FMA "
                 "peak timed in the same rounds")
        ceiling = geomean([num(r, "fraction_of_ceiling") for r in three])
        if math.isfinite(ceiling):  # no register-tile ceiling on hosts without intrinsics
            text += f", {100 * ceiling:.0f}% of the register-tile ceiling"
        if "fraction_of_best_peak" in three[0]:
            text += (f", {100 * geomean([num(r, 'fraction_of_best_peak') for r in three]):.0f}% of the best peak "
                     f"measured here ({num(three[0], 'best_peak_gflops'):.0f} GFLOP/s) (geomeans)")
    return text


if __name__ == "__main__":
    sys.exit(main())
