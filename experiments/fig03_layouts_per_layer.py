"""Figure 3: per-layer conv time of AlexNet (or other built-in networks) in the two layouts,
NCHW and NHWC (torch channels_last), with the cost of converting each layer's input between
them: no single layout is best for every layer once conversions are priced in.

Each layer's layouts are timed in interleaved rounds (maco.layouts.latency.measure_layouts),
after a canary says the shared cores are quiet (maco.layouts.canary.Canary); the canary's load
is kept in the CSV. Writes fig03_layouts_per_layer.csv / .png under --out.

    python experiments/fig03_layouts_per_layer.py [--quick] [--networks alexnet] [--out results]
"""
from __future__ import annotations

from pathlib import Path

from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv
from maco.layouts.canary import Canary
from maco.layouts.latency import measure_conversion, measure_layouts
from maco.layouts.networks import network_convs
from maco.core.timing import environment

FIGURE = Figure(
    "fig03", "AlexNet: the faster layout differs from layer to layer (no single layout is best)",
    "the paper timed GPU kernels; on the CPU named in the row oneDNN's channels_last path is the faster one on most "
    "layers, so the per-layer choice matters less than on the paper's GPU",
    csv=("fig03_layouts_per_layer.csv",),
    hosts={"fig03_layouts_per_layer.csv": ("7b4d78f60a4e8a17", "Intel Xeon (avx512, 2 cores)")})

COLUMNS = ["network", "layer", "spec", "gflop", "nchw_ms", "nhwc_ms", "nchw_gflops", "nhwc_gflops",
           "faster", "nchw_over_nhwc", "convert_in_to_nhwc_ms", "convert_out_to_nchw_ms",
           "spread_nchw", "spread_nhwc", "load"]


def measure_network(name: str, batch: int, rounds: int, canary: Canary) -> list[dict]:
    rows = []
    for layer, spec in network_convs(name, batch):
        load = canary.wait_quiet(patience=10)
        t = measure_layouts(spec, rounds=rounds, repeats=5)
        load = max(load, canary.load())
        to_nhwc = measure_conversion(spec.input_shape, "NCHW", "NHWC").median
        to_nchw = measure_conversion(spec.output_shape, "NHWC", "NCHW").median
        a, b = t["NCHW"].median, t["NHWC"].median
        rows.append(dict(network=name, layer=layer, spec=str(spec), gflop=spec.flops / 1e9,
                         nchw_ms=a * 1e3, nhwc_ms=b * 1e3, nchw_gflops=spec.flops / a / 1e9,
                         nhwc_gflops=spec.flops / b / 1e9, faster="NCHW" if a < b else "NHWC",
                         nchw_over_nhwc=a / b, convert_in_to_nhwc_ms=to_nhwc * 1e3,
                         convert_out_to_nchw_ms=to_nchw * 1e3, spread_nchw=t["NCHW"].spread,
                         spread_nhwc=t["NHWC"].spread, load=load))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import numpy as np

    plt = pyplot()
    nets = list(dict.fromkeys(r["network"] for r in rows))
    fig, axes = plt.subplots(len(nets), 1, figsize=(max(6, 0.7 * max(
        sum(r["network"] == n for r in rows) for n in nets) + 2), 3.6 * len(nets)), squeeze=False)
    for ax, net in zip(axes[:, 0], nets):
        sub = [r for r in rows if r["network"] == net]
        x = np.arange(len(sub))
        ax.bar(x - 0.2, [r["nchw_ms"] for r in sub], 0.4, label="NCHW")
        ax.bar(x + 0.2, [r["nhwc_ms"] for r in sub], 0.4, label="NHWC (channels_last)")
        ax.plot(x, [r["convert_in_to_nhwc_ms"] for r in sub], "k_", markersize=14, mew=2,
                label="convert input NCHW->NHWC")
        ax.set_xticks(x, [f"conv{i + 1}" for i in range(len(sub))])
        ax.set_ylabel("ms per call")
        ax.set_title(f"{net}: conv layers in two layouts (torch/oneDNN, batch {sub[0]['spec'].split('_')[0][1:]})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="fewer timing rounds")
    ap.add_argument("--networks", default="alexnet")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds per layer (default 5, quick 2)")
    args = ap.parse_args(argv)
    out = out_dir(args)
    rounds = args.rounds or (2 if args.quick else 5)
    canary = Canary()
    rows = [r for net in args.networks.split(",") if net.strip() for r in
            measure_network(net.strip(), args.batch, rounds, canary)]
    csv_path = out / "fig03_layouts_per_layer.csv"
    write_csv(csv_path, rows, COLUMNS, floats=".5g")
    plot(rows, out / "fig03_layouts_per_layer.png")
    env = environment()
    print(f"{csv_path} ({env['cpu']}, torch {env['torch']}, {env['torch_threads']} threads)")
    for r in rows:
        print(f"  {r['network']:9s} {r['layer']:22s} {r['spec']:36s} NCHW {r['nchw_ms']:8.3f} ms "
              f"NHWC {r['nhwc_ms']:8.3f} ms  faster {r['faster']} ({max(r['nchw_over_nhwc'], 1 / r['nchw_over_nhwc']):.2f}x)"
              f"  to-NHWC {r['convert_in_to_nhwc_ms']:.3f} ms  load {r['load']:.2f}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: on how many layers each layout wins, and by how much."""
    nhwc = sum(r["faster"] == "NHWC" for r in rows)
    ratio = [num(r, "nchw_over_nhwc") for r in rows]
    return (f"{rows[0]['network']}: NHWC faster on {nhwc} of {len(rows)} conv layers; NCHW time / "
            f"NHWC time from {min(ratio):.2f} to {max(ratio):.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
