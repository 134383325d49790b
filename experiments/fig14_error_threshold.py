"""Figure 14: how wrong the latency predictors are on the test convs, and what it costs a planner.

Left: for each error threshold, the fraction of test rows whose |predicted - measured| / measured
is below it. Right: how often each model picks the slower layout of a test conv, counting only
convs whose two layouts differ (measured) by more than a gap threshold, and what the wrong
picks cost (extra seconds over the faster layouts' seconds). A wrong pick between layouts 1%
apart costs nothing that matters; one across a 2x gap does.

Reads the test predictions fig13 wrote (OUT/fig13_test_predictions.csv; run
experiments/fig13_predictor_r2.py first), so both figures describe the same models and split.
Writes fig14_error_threshold.csv / .png.

    python experiments/fig14_error_threshold.py [--out results] [--predictions FILE]
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_table

FIGURE = Figure(
    "fig14", "few wrong-layout picks, at small cost", "pairs whose layouts differ by under 5% are coin "
    "flips under the VM's noise; the columns by gap show the picks that matter",
    csv=("fig14_error_threshold.csv",),
    hosts={"fig14_error_threshold.csv": ("83751245a491065b", "Intel Xeon (avx512, 2 cores)")})

THRESHOLDS = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
GAPS = [0.0, 0.02, 0.05, 0.1, 0.2, 0.5]  # measured slower/faster - 1 of a conv's two layouts


def read_predictions(path: Path) -> tuple[list[str], list[str], np.ndarray, dict[str, np.ndarray]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    if header[:3] != ["spec", "layout", "measured"] or not body:
        raise SystemExit(f"{path} is not a fig13 test-prediction file (or it is empty)")
    measured = np.array([float(r[2]) for r in body])
    preds = {m: np.array([float(r[3 + j]) for r in body]) for j, m in enumerate(header[3:])}
    return [r[0] for r in body], [r[1] for r in body], measured, preds


def pick_stats(specs: list[str], measured: np.ndarray, predicted: np.ndarray
               ) -> dict[float, tuple[float, float, int]]:
    """gap -> (wrong-pick fraction, extra seconds / best seconds, convs) over the convs whose
    layouts differ by more than the gap."""
    by_spec: dict[str, list[tuple[float, float]]] = {}
    for s, m, p in zip(specs, measured, predicted):
        by_spec.setdefault(s, []).append((m, p))
    out = {}
    for gap in GAPS:
        wrong = n = 0
        extra = best = 0.0
        for pairs in by_spec.values():
            if len(pairs) < 2:
                continue
            ms = [m for m, _ in pairs]
            if max(ms) <= (1 + gap) * min(ms) and gap > 0:
                continue
            chosen = min(range(len(pairs)), key=lambda i: pairs[i][1])
            n += 1
            best += min(ms)
            if ms[chosen] > min(ms):
                wrong += 1
                extra += ms[chosen] - min(ms)
        out[gap] = (wrong / n if n else float("nan"), extra / best if best else float("nan"), n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="accepted for `maco reproduce --quick` (this figure is cheap)")
    ap.add_argument("--predictions", default=None, help="default OUT/fig13_test_predictions.csv")
    args = ap.parse_args(argv)
    out = Path(args.out)
    path = Path(args.predictions) if args.predictions else out / "fig13_test_predictions.csv"
    if not path.exists():
        raise SystemExit(f"{path} not found: run experiments/fig13_predictor_r2.py --out {out} first")
    specs, _, measured, preds = read_predictions(path)
    errors = {m: np.abs(p - measured) / measured for m, p in preds.items()}
    picks = {m: pick_stats(specs, measured, p) for m, p in preds.items()}
    out = out_dir(args)
    header = ["model", *[f"within_{t:g}" for t in THRESHOLDS], "median_rel_error", "p90_rel_error", "rows",
              *[f"wrong_picks_gap_{g:g}" for g in GAPS], *[f"pick_cost_gap_{g:g}" for g in GAPS],
              *[f"convs_gap_{g:g}" for g in GAPS]]
    write_table(out / "fig14_error_threshold.csv", header, [
        [m, *[f"{np.mean(e <= t):.4f}" for t in THRESHOLDS], f"{np.median(e):.4g}", f"{np.quantile(e, 0.9):.4g}",
         len(e), *[f"{picks[m][g][0]:.4f}" for g in GAPS], *[f"{picks[m][g][1]:.5f}" for g in GAPS],
         *[picks[m][g][2] for g in GAPS]] for m, e in errors.items()])
    print(f"{'model':12s} " + " ".join(f"<={t:<5g}" for t in THRESHOLDS))
    for m, e in errors.items():
        print(f"{m:12s} " + " ".join(f"{np.mean(e <= t):6.3f}" for t in THRESHOLDS))
    print(f"\nwrong layout picks (cost, % of the best layouts' time) among test convs whose layouts "
          f"differ by more than:\n{'model':12s} " + " ".join(f"{'>' + format(g * 100, 'g') + '%':>16s}" for g in GAPS))
    for m, st in picks.items():
        print(f"{m:12s} " + " ".join(f"{st[g][0] * 100:6.1f}% ({st[g][1] * 100:5.2f}%)" for g in GAPS))
    print("convs:       " + " ".join(f"{next(iter(picks.values()))[g][2]:>16d}" for g in GAPS))
    plot(errors, picks, out / "fig14_error_threshold.png")
    return 0


def plot(errors: dict[str, np.ndarray], picks: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    grid = np.logspace(-3, 1, 200)
    for m, e in errors.items():
        style = dict(lw=2.5, color="k") if m.startswith("NAS") else dict(lw=1.2)
        ax.plot(grid * 100, [np.mean(e <= g) for g in grid], label=m.replace("_", " "), **style)
    for t in (0.05, 0.1, 0.2):
        ax.axvline(t * 100, color="gray", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("error threshold: |predicted - measured| / measured, %")
    ax.set_ylabel("fraction of test rows within")
    ax.set_title("Prediction error distribution (test convs, both layouts)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    xs = np.arange(len(GAPS))
    width = 0.8 / max(len(picks), 1)
    for j, (m, st) in enumerate(picks.items()):
        style = dict(color="k") if m.startswith("NAS") else {}
        bx.bar(xs + (j - (len(picks) - 1) / 2) * width, [st[g][0] * 100 for g in GAPS], width,
               label=m.replace("_", " "), **style)
    bx.axhline(3, color="r", lw=0.8, ls="--", label="target 3%")
    first = next(iter(picks.values()))
    bx.set_xticks(xs, [f">{g * 100:g}%\n({first[g][2]} convs)" if g else f"all\n({first[g][2]} convs)"
                       for g in GAPS])
    bx.set_xlabel("test convs whose layouts differ (measured) by more than")
    bx.set_ylabel("wrong layout picks, %")
    bx.set_title("How often the slower layout is picked")
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: the NAS predictor's error spread and its wrong picks by how far apart the layouts
    are (its column: NAS-MLP_log or NAS-trees_log, as the search chose)."""
    nas = next((r for r in rows if r["model"].startswith("NAS")), None)
    if not nas:
        return f"{len(rows)} models"
    return (f"{nas['model'].removesuffix('_log')}: {100 * num(nas, 'within_0.1'):.0f}% of test convs within 10%, "
            f"median error {100 * num(nas, 'median_rel_error'):.0f}%; "
            f"wrong picks {100 * num(nas, 'wrong_picks_gap_0'):.0f}% "
            f"of all pairs, {100 * num(nas, 'wrong_picks_gap_0.05'):.0f}% where the layouts differ by >5%, "
            f"{100 * num(nas, 'wrong_picks_gap_0.2'):.0f}% where they differ by >20%")


if __name__ == "__main__":
    raise SystemExit(main())
