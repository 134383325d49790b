"""Winograd F(2x2) and F(4x4) against MACO's direct kernels and torch on every distinct 3x3 and 5x5
stride-1 conv of ResNet-18, AlexNet, VGG-11 and ResNet-50 at batch 1 (issue 18: the direct
kernels run near the FMA peak, so fewer multiplies are what is left).

Per layer, in the same interleaved rounds (maco.tune.benchmark.bench_layer): the Winograd kernel in
each tile size (kernels.winograd, NHWC), MACO's bound-derived default in NHWC, torch in NCHW and
channels_last, and the layer's flops done by the FMA loop. GFLOP/s count the direct conv's flops
for every kernel, so Winograd's can pass the FMA peak. Speedups are medians of per-round ratios;
"best" is the faster tile size per round. Every kernel is checked against torch first. The
layers are timed warm (one after another, the weights in cache): inside a model, F(4x4)'s larger
transformed filters (4x the weights) stream from memory, which optimize's choice weighs.
Writes winograd_cpu.csv, .png and .env.json under --out.

    python experiments/winograd_cpu.py --out results [--networks resnet18,vgg11] [--quick]
"""
from __future__ import annotations

from pathlib import Path

from maco import Target, kernels
from maco.tune.benchmark import bench_layer
from maco.experiments.common import Figure, geomean, layer_bars, num, out_dir, parser, save_plot, write_csv, write_env
from maco.kernels.winograd import winograd_can_run
from maco.layouts.networks import distinct_convs, network_convs

FIGURE = Figure(
    "winograd", "(not in the paper: its kernels are direct convolutions)",
    "Winograd F(2x2) and F(4x4) beside the direct kernels on the 3x3 and 5x5 stride-1 layers; GFLOP/s "
    "count the direct conv's flops, timed in the same rounds as the FMA peak",
    csv=("winograd_cpu.csv", "winograd_cpu_quick.csv"))


def layers(networks: list[str], lanes: int, quick: bool) -> list[tuple[str, str, object]]:
    out, seen = [], set()
    for net in networks:
        for spec, names in distinct_convs(network_convs(net, 1)):
            if spec not in seen and winograd_can_run(spec, lanes):
                seen.add(spec)
                out.append((net, names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else ""), spec))
    return out[:3] if quick else out


def plot(path: Path, rows: list[dict]) -> None:
    bars = (("f4_gflops", "MACO Winograd F(4x4)"), ("f2_gflops", "MACO Winograd F(2x2)"),
            ("direct_gflops", "MACO direct (default)"), ("torch_gflops", "torch, faster layout"))
    title = ("3x3/5x5 stride-1 convs, batch 1: Winograd over the direct kernel, geomean "
             f"{geomean([r['over_direct'] for r in rows]):.2f}x")
    fig, ax, _ = layer_bars(rows, bars, title, "GFLOP/s (direct conv's flops)", 0.6)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="three layers, three rounds")
    ap.add_argument("--networks", default="resnet18,alexnet,vgg11,resnet50")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    args = ap.parse_args(argv)
    out = out_dir(args)
    repeats = args.repeats or (3 if args.quick else 7)
    target = Target.host()
    rows = []
    for net, name, spec in layers(args.networks.split(","), target.simd_width, args.quick):
        r = bench_layer(name, spec, {"direct": kernels.default_schedule(spec, target, "NHWC")}, target,
                        repeats=repeats, ceilings=True, winograd=True)
        r.rounds["winograd"] = [min(r.rounds[k][i] for k in r.rounds if k.startswith("winograd F"))
                                for i in range(repeats)]  # the faster tile size in each round
        g = {k: r.gflops(k) for k in r.rounds}
        torch_label = max(("torch NCHW", "torch NHWC"), key=lambda k: g[k])
        rows.append({"network": net, "layer": name, "spec": str(spec),
                     "f2_gflops": round(g.get("winograd F2", 0.0), 1), "f4_gflops": round(g.get("winograd F4", 0.0), 1),
                     "direct_gflops": round(g["direct"], 1),
                     "torch_gflops": round(g[torch_label], 1), "torch_layout": torch_label.split()[1],
                     "peak_gflops": round(g["FMA peak"], 1),
                     "over_direct": round(r.speedup("winograd", over=("direct",)), 4),
                     "over_torch": round(r.speedup("winograd"), 4),
                     "f4_over_f2": (round(r.speedup("winograd F4", over=("winograd F2",)), 4)
                                    if "winograd F4" in g else ""),
                     "winograd_of_peak": round(r.speedup("winograd", over=("FMA peak",)), 4),
                     "direct_of_peak": round(r.speedup("direct", over=("FMA peak",)), 4),
                     "max_error": f"{r.error:.2e}"})
        print(f"{net:9s} {name:26s} {spec!s:32s} F(4x4) {g.get('winograd F4', 0.0):6.1f}  F(2x2) "
              f"{g.get('winograd F2', 0.0):6.1f}  direct {g['direct']:6.1f}  torch {g[torch_label]:6.1f}  FMA peak "
              f"{g['FMA peak']:6.1f} GFLOP/s  Winograd/direct {rows[-1]['over_direct']:.2f}x", flush=True)
    stem = "winograd_cpu" + ("_quick" if args.quick else "")
    write_csv(out / f"{stem}.csv", rows)
    plot(out / f"{stem}.png", rows)
    write_env(out / f"{stem}.csv", threads=target.cores, repeats=repeats)
    print(f"\n{summarise([{k: str(v) for k, v in r.items()} for r in rows])}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: where Winograd wins over the direct kernel, and by how much."""
    wins = [r for r in rows if num(r, "over_direct") > 1.0]
    best = max(rows, key=lambda r: num(r, "over_direct"))
    return (f"{len(rows)} layers: Winograd (the faster tile size) over MACO's direct kernel geomean "
            f"{geomean([num(r, 'over_direct') for r in rows]):.2f}x, ahead on {len(wins)} "
            f"(best {num(best, 'over_direct'):.2f}x on {best['network']}:{best['layer']}, "
            f"{100 * num(best, 'winograd_of_peak'):.0f}% of the FMA peak in direct-conv flops); "
            f"over torch's faster layout geomean {geomean([num(r, 'over_torch') for r in rows]):.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
