"""Figure 18: end to end at batch 1 on this machine, for ResNet-18, AlexNet and VGG-11: the model
as torch runs it by default (every layer NCHW), the planned hybrid layout with torch's convs,
and the planned layout with MACO's tuned kernels where tuning records hold one faster than torch.
Both planned variants run the fused graph (maco.layouts.fuse: BatchNorm folded, each conv's
residual add and activation in its epilogue), as `maco optimize` does.

The last column needs tuning records (`maco optimize NET --records R`, or `maco tune`): pass
them with --records R (repeatable). Without records that column is left empty and the CSV's
note says so. With records, the plan is remade from the per-layer best of torch and MACO in each
layout (torch measured here, each layout's best MACO record re-timed beside it in this process,
maco.deploy.kernel_choice.faster_kernels) and the convs whose MACO kernel wins are swapped for MacoConv2d
modules. Each planned model is timed against
the default in interleaved rounds and its output checked against the original's.
Writes fig18_end_to_end.csv / .png.

    python experiments/fig18_end_to_end.py [--quick] [--out results] [--records R.jsonl]
"""
from __future__ import annotations

from pathlib import Path

import torch

from maco.experiments.common import (Figure, num, out_dir, outputs_equal, parser, pyplot, quiet, save_plot,
                                     write_csv)

FIGURE = Figure(
    "fig18", "end to end 1.07x / 1.62x / 1.34x (ResNet-18 / AlexNet / VGG-11)", "batch 1 on a 2-core CPU "
    "with oneDNN as the baseline; the paper ran its GPU kernels", csv=("fig18_end_to_end.csv",), records=True,
    hosts={"fig18_end_to_end.csv": ("9d1cde157a1cd613", "Intel Xeon (avx512, 2 cores)")})

NETWORKS = "resnet18,alexnet,vgg11"
PAPER = {"resnet18": 1.07, "alexnet": 1.62, "vgg11": 1.34}
COLUMNS = ["network", "convs", "default_ms", "planned_torch_ms", "speedup_torch", "planned_maco_ms",
           "speedup_maco", "maco_convs", "max_abs_diff", "outputs_equal", "paper_speedup", "load", "note"]


def run_network(name: str, rounds: int, records: dict | None) -> dict:
    from maco.layouts import compare_end_to_end, fuse, plan
    from maco.layouts.networks import build, example_input
    from maco.deploy.kernel_choice import faster_kernels
    from maco.layouts.maco_modules import use_maco_kernels
    from maco.core.spec import ConvSpec
    from maco.core.target import Target

    model, x = build(name).eval(), example_input(1)
    fused = fuse(model, x)
    p = plan(fused, x, latency="measure")
    planned = p.apply(fused)
    load = quiet()
    e = compare_end_to_end(model, planned, x, rounds=rounds)
    row = dict(network=name, convs=len(p.convs), default_ms=e.default.median * 1e3,
               planned_torch_ms=e.planned.median * 1e3, speedup_torch=e.speedup, planned_maco_ms="",
               speedup_maco="", maco_convs="", max_abs_diff=e.max_abs_diff,
               outputs_equal=outputs_equal(model, planned, x), paper_speedup=PAPER.get(name, ""),
               load=load)
    if records is None:
        row["note"] = "MACO column empty: no tuning records given (--records)"
        return row
    torch_seconds = {(ConvSpec.parse(layer.spec), lay): secs  # measured by the plan above
                     for layer in p.convs for lay, secs in layer.costs.items()}
    table, chosen, _ = faster_kernels(torch_seconds, records, Target.host())
    if not chosen:
        row["note"] = "MACO column empty: no recorded kernel beat torch when re-timed beside it here"
        return row
    pm = plan(fused, x, latency=table, conversion="measure")
    gm = pm.apply(fused)
    swapped = use_maco_kernels(gm, pm, chosen, Target.host())
    if not swapped:
        row["note"] = ("MACO column empty: the plan puts no conv in a layout where a MACO kernel "
                       "beat torch")
        return row
    load = quiet()
    em = compare_end_to_end(model, gm, x, rounds=rounds)
    row.update(planned_maco_ms=em.planned.median * 1e3, speedup_maco=em.speedup,
               maco_convs=len(swapped), max_abs_diff=max(e.max_abs_diff, em.max_abs_diff),
               outputs_equal=row["outputs_equal"] and outputs_equal(model, gm, x),
               load=max(row["load"], load),
               note=f"MACO kernels in {len(swapped)} of {len(pm.convs)} convs")
    return row


def plot(rows: list[dict], path: Path) -> None:
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(len(rows))
    bars = [("default (NCHW, torch)", [1.0] * len(rows)),
            ("planned layouts, torch", [r["speedup_torch"] for r in rows]),
            ("planned layouts, MACO kernels", [r["speedup_maco"] or 0.0 for r in rows])]
    for j, (label, vals) in enumerate(bars):
        bs = ax.bar(x + (j - 1) * 0.27, vals, 0.27, label=label)
        for b, v, r in zip(bs, vals, rows):
            text = f"{v:.2f}x" if v else "no\nrecords"
            ax.annotate(text, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.scatter(x + 0.27, [r["paper_speedup"] or np.nan for r in rows], marker="_", s=300, color="k",
               zorder=3, label="paper (MACO, their machine)")
    ax.set_xticks(x, [f"{r['network']}\n{r['default_ms']:.1f} ms default" for r in rows])
    ax.set_ylabel("speedup over the default model")
    ax.set_title(f"End to end, batch 1, {torch.get_num_threads()} torch threads")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max([2.0] + [v * 1.15 for _, vals in bars for v in vals if v]))
    fig.tight_layout()
    save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="fewer end-to-end rounds")
    ap.add_argument("--networks", default=NETWORKS)
    ap.add_argument("--records", action="append", default=[],
                    help="tuning records (JSON lines) for the MACO column; repeatable")
    ap.add_argument("--rounds", type=int, default=None, help="end-to-end rounds (default 7, quick 3)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    missing = [p for p in args.records if not Path(p).is_file()]
    if missing:
        ap.error(f"records file(s) not found: {', '.join(missing)}")
    records = None
    if args.records:
        from maco.tune.records import best_in_files
        from maco.core.target import Target

        records = best_in_files(args.records, Target.host())
    out = out_dir(args)
    rows = [run_network(n.strip(), rounds, records) for n in args.networks.split(",") if n.strip()]
    write_csv(out / "fig18_end_to_end.csv", rows, COLUMNS, floats=".5g")
    plot(rows, out / "fig18_end_to_end.png")
    print(f"wrote {out / 'fig18_end_to_end.csv'} and .png ({rounds} interleaved rounds)")
    for r in rows:
        maco = f"{r['speedup_maco']:.2f}x" if r["speedup_maco"] != "" else "-"
        print(f"  {r['network']:9s} default {r['default_ms']:.2f} ms; planned torch "
              f"{r['speedup_torch']:.2f}x; planned MACO {maco}; paper {r['paper_speedup']}x; "
              f"outputs equal {r['outputs_equal']}; {r['note']}")
    return 0 if all(r["outputs_equal"] for r in rows) else 1


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network, the planned model's speedup with torch's convs and with MACO's."""
    parts = []
    for r in rows:
        maco = (f", with MACO kernels in {r['maco_convs']} conv(s) {num(r, 'speedup_maco'):.2f}x"
                if r.get("speedup_maco") else f" ({r.get('note', '')})")
        parts.append(f"{r['network']}: planned torch {num(r, 'speedup_torch'):.2f}x{maco}")
    return "; ".join(parts) + " (outputs equal: " + ", ".join(r["outputs_equal"] for r in rows) + ")"


if __name__ == "__main__":
    raise SystemExit(main())
