"""Figure 12: default layout (every layer NCHW, as torch runs a model) against the planned hybrid
NCHW/NHWC layout, for ResNet-18, AlexNet and VGG-11 at batch 1 on this machine: the planner's
predicted time of both, and both measured end to end with torch in interleaved rounds.

Plans are made twice, from measured conv latencies (latency="measure") and from the trained
predictor (latency="predict", OUT/predictor_cpu or the shipped one; skipped with a note where none is saved);
the policy "every flexible layer NHWC" is timed beside them as a reference. Every planned
model's output is checked against the original's. Writes fig12_layout_plan.csv / .png.

    python experiments/fig12_layout_plan.py [--quick] [--out results]
"""
from __future__ import annotations

from pathlib import Path

import torch

from maco.experiments.common import (Figure, num, out_dir, outputs_equal, parser, pyplot, quiet, save_plot,
                                     write_csv)

FIGURE = Figure(
    "fig12", "planned hybrid layouts 1.28x / 1.32x / 1.29x over the default (ResNet-18 / AlexNet / VGG-11)",
    "oneDNN's NHWC convs win almost every layer here, so the plan is nearly all-NHWC with conversions "
    "at the ends; the paper's GPU made more layers prefer NCHW", csv=("fig12_layout_plan.csv",),
    hosts={"fig12_layout_plan.csv": ("08c650afa886913f", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = "resnet18,alexnet,vgg11"
COLUMNS = ["network", "latency", "convs", "nhwc_convs", "conversions", "predicted_default_ms",
           "predicted_planned_ms", "predicted_speedup", "measured_default_ms", "measured_planned_ms",
           "measured_speedup", "speedup_low", "speedup_high", "max_abs_diff", "outputs_equal",
           "planner_ms", "load", "note"]


def all_nhwc(spec, layout: str) -> float:
    """A latency table under which every flexible layer prefers NHWC: the fixed policy."""
    return 1e-6 if layout == "NHWC" else 1.0


def run_network(name: str, sources: list[str], rounds: int, predictor: str | None) -> list[dict]:
    from maco.core.errors import MacoError
    from maco.layouts import compare_end_to_end, load_predictor, plan
    from maco.layouts.networks import build, example_input

    model, x = build(name), example_input(1)
    rows = []
    for source in sources:
        row = dict(network=name, latency=source, note="")
        latency: object = source
        if source == "predict":
            try:
                latency = load_predictor(predictor)
            except MacoError as exc:
                rows.append(dict(row, note=f"skipped: {exc}"))
                continue
        elif source == "all-NHWC":
            latency = all_nhwc
        p = plan(model, x, latency=latency, conversion="measure" if source == "all-NHWC" else None)
        planned = p.apply(model)
        load = quiet()
        e2e = compare_end_to_end(model, planned, x, rounds=rounds)
        predicted = source != "all-NHWC"  # the policy's "costs" are not seconds
        rows.append(dict(
            row, convs=len(p.convs), nhwc_convs=sum(c.layout == "NHWC" for c in p.convs),
            conversions=len(p.conversions),
            predicted_default_ms=p.default_cost * 1e3 if predicted and p.default_cost else "",
            predicted_planned_ms=p.cost * 1e3 if predicted else "",
            predicted_speedup=p.speedup if predicted and p.speedup else "",
            measured_default_ms=e2e.default.median * 1e3, measured_planned_ms=e2e.planned.median * 1e3,
            measured_speedup=e2e.speedup, speedup_low=min(e2e.ratios), speedup_high=max(e2e.ratios),
            max_abs_diff=e2e.max_abs_diff, outputs_equal=outputs_equal(model, planned, x),
            planner_ms=p.planner_seconds * 1e3, load=load, note=p.latency))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import numpy as np

    plt = pyplot()
    nets = list(dict.fromkeys(r["network"] for r in rows))
    sources = list(dict.fromkeys(r["latency"] for r in rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = np.arange(len(nets))
    width = 0.8 / max(len(sources), 1)
    for j, src in enumerate(sources):
        vals = []
        for net in nets:
            r = next((r for r in rows if r["network"] == net and r["latency"] == src), None)
            vals.append(r["measured_speedup"] if r and r.get("measured_speedup") not in (None, "") else 0)
        bars = a1.bar(x + (j - (len(sources) - 1) / 2) * width, vals, width, label=f"planned ({src})")
        for b, v in zip(bars, vals):
            if v:
                a1.annotate(f"{v:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.axhline(1.2, color="gray", lw=0.8, ls="--", label="target 1.2x")
    a1.set_xticks(x, nets)
    a1.set_ylabel("measured speedup over default NCHW")
    a1.set_title("End to end, torch, batch 1")
    a1.legend(fontsize=8)
    for j, src in enumerate(s for s in sources if s != "all-NHWC"):
        sub = [r for r in rows if r["latency"] == src and r.get("predicted_planned_ms") not in (None, "")]
        for k, key, marker in ((0, "default", "o"), (1, "planned", "s")):
            a2.scatter([r[f"predicted_{key}_ms"] for r in sub], [r[f"measured_{key}_ms"] for r in sub],
                       marker=marker, label=f"{key}, latency={src}")
        for r in sub:
            a2.annotate(r["network"], (r["predicted_planned_ms"], r["measured_planned_ms"]), fontsize=7)
    lim = [min(a2.get_xlim()[0], a2.get_ylim()[0]), max(a2.get_xlim()[1], a2.get_ylim()[1])]
    a2.plot(lim, lim, "k:", lw=0.8, label="measured = predicted")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("planner's predicted time (ms): convs + conversions")
    a2.set_ylabel("measured end to end (ms)")
    a2.set_title("Planner estimate vs the whole model")
    a2.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="fewer end-to-end rounds")
    ap.add_argument("--networks", default=NETWORKS)
    ap.add_argument("--latency", default="measure,predict,all-NHWC",
                    help="plans to make: measure, predict, all-NHWC (comma-separated)")
    ap.add_argument("--predictor", default=None, help="predictor folder (default OUT/predictor_cpu, the "
                    "one fig13 trains, else the one shipped with MACO)")
    ap.add_argument("--rounds", type=int, default=None, help="end-to-end rounds (default 7, quick 3)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    sources = [s.strip() for s in args.latency.split(",") if s.strip()]
    unknown = set(sources) - {"measure", "predict", "all-NHWC"}
    if unknown:
        ap.error(f"unknown latency source(s) {', '.join(sorted(unknown))}")
    out = out_dir(args)
    trained = out / "predictor_cpu"
    predictor = args.predictor or (str(trained) if (trained / "predictor.json").exists() else None)
    rows = [r for net in args.networks.split(",") if net.strip()
            for r in run_network(net.strip(), sources, rounds, predictor)]
    write_csv(out / "fig12_layout_plan.csv", rows, COLUMNS, floats=".5g")
    plot(rows, out / "fig12_layout_plan.png")
    print(f"wrote {out / 'fig12_layout_plan.csv'} and .png (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {rounds} interleaved rounds)")
    for r in rows:
        if "measured_speedup" not in r:
            print(f"  {r['network']:9s} {r['latency']:8s} {r['note']}")
            continue
        pred = f"predicted {r['predicted_speedup']:.2f}x" if r["predicted_speedup"] != "" else "predicted -"
        print(f"  {r['network']:9s} {r['latency']:8s} NHWC convs {r['nhwc_convs']}/{r['convs']}, "
              f"{r['conversions']} conversions; {pred}; measured {r['measured_default_ms']:.2f} -> "
              f"{r['measured_planned_ms']:.2f} ms = {r['measured_speedup']:.2f}x "
              f"({r['speedup_low']:.2f}-{r['speedup_high']:.2f}); outputs equal {r['outputs_equal']}")
    return 0 if all(r.get("outputs_equal", True) for r in rows) else 1


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the measured speedup of each plan, and how many convs it puts in NHWC."""
    parts = [f"{r['network']} {num(r, 'measured_speedup'):.2f}x ({r['nhwc_convs']}/{r['convs']} convs NHWC)"
             for r in rows if r["latency"] == "measure"]
    pred = [f"{r['network']} {num(r, 'measured_speedup'):.2f}x" for r in rows if r["latency"] == "predict"]
    return ("planned from measured latencies: " + ", ".join(parts) +
            ("; planned from the predictor: " + ", ".join(pred) if pred else "") + " (measured end to end)")


if __name__ == "__main__":
    raise SystemExit(main())
