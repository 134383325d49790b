"""Do measurements repeat an hour later, in another process (issue 20)? Two things are timed twice:

- the predictor's labels: the test convs of its split (fig13's), timed by `maco collect`;
- tuning records: 50 uniform draws of the pruned space of one layer (and its default schedule),
  measured by the tuner's worker, then re-measured by `maco tune --retime` (which keeps the first
  timing as history).

    python experiments/repeatability.py --phase first     # a few minutes
    python experiments/repeatability.py --phase second    # >= --gap hours later: times them again
    python experiments/repeatability.py --phase report     # compares the two (also done by second)

For labels, three are compared, each as the second timing "predicted" by the first: torch's seconds;
the ratio to the reference timed in the same rounds (the FMA loop doing the conv's flops,
maco.core.timing), which is what a label that repeats across spells should be; and the first ratio
turned back into seconds with the reference measured in the second run (what a planner that
predicts ratios would use); and, for each of seconds and ratio, the fastest repeat instead of the
median (a slow spell lengthens the median, seldom the fastest). The reference is maco collect's
(layouts.dataset.REFERENCE); both runs must use the same one. Per label: R2 on latency and the
share of convs within +-5%. For records: the Spearman rank correlation of the two timings, on
seconds and on the ratio to the reference. Writes <out>/label_repeat_first.csv and _second.csv (data
sets), label_repeat.csv (one row per conv and layout) and .png, records_repeat.jsonl (the records,
with their history) and records_repeat.csv.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np

from scipy.stats import spearmanr

from maco import kernels

from maco.space import schedules as space
from maco.core.errors import MacoError
from maco.experiments.common import Figure, num, out_dir, parser, pyplot, save_plot, write_csv, write_env
from maco.layouts.canary import SETTLED_LOAD
from maco.layouts.collection import collect
from maco.layouts.dataset import Dataset, load_rows, reference_of
from maco.layouts.predictor_metrics import split_by_spec
from maco.tune.measure import Measurer
from maco.tune.records import RecordFile, make_record
from maco.core.spec import ConvSpec
from maco.tune.tuning import retime

FIGURE = Figure(
    "repeat", "(not in the paper) labels re-timed an hour later: R2 >= 0.99, >= 95% within +-5%; "
    "records: Spearman >= 0.95 (issue 20)", "two runs at least an hour apart in separate processes; "
    "run by hand", csv=("label_repeat.csv",), quick=False, in_all=False)
RECORDS_LAYER = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")  # ResNet-18 layer1

COLUMNS = ["spec", "layout", "first_s", "second_s", "first_ratio", "second_ratio", "second_reference_s",
           "first_min_s", "second_min_s", "first_reference_s", "first_load", "second_load", "hours_apart"]
LABELS = {"seconds": "torch seconds", "ratio": "ratio to the reference",
          "rescaled": "first ratio x second reference", "fastest": "fastest repeat (seconds)",
          "fastest_ratio": "fastest repeat / reference"}


def test_convs(data: str, count: int, seed: int) -> list[tuple[str, object]]:
    """The predictor's test convs (fig13's split of `data`), `count` of them with both layouts."""
    rows = [r for r in load_rows(data) if r.device == "cpu" and r.quiet]
    specs = [r.spec for r in rows]
    _, te = split_by_spec(specs, 0.2, seed)
    both: dict[str, list] = {}
    for i in te:
        both.setdefault(str(rows[i].spec), []).append(rows[i])
    chosen = sorted(s for s, rs in both.items() if len(rs) == 2)
    random.Random(seed).shuffle(chosen)
    return [("label-repeat", both[s][0].spec) for s in chosen[:count]]


def r2(measured: np.ndarray, predicted: np.ndarray) -> float:
    return float(1 - ((measured - predicted) ** 2).sum() / ((measured - measured.mean()) ** 2).sum())


def compare(first: Path, second: Path) -> list[dict[str, object]]:
    a = {r.key: r for r in load_rows(first)}
    b = {r.key: r for r in load_rows(second)}
    kinds = {path.name: {reference_of(envs, r) for r in rows.values()}
             for path, rows in ((first, a), (second, b)) for envs in [Dataset(path).environments()]}
    if len(set().union(*kinds.values())) > 1:
        raise MacoError(f"the two runs' ratios are to different references ({kinds}): run --phase first again, "
                        "then second")
    out = []
    for key in sorted(a.keys() & b.keys()):
        ra, rb = a[key], b[key]
        if ra.ratio is None or rb.ratio is None:
            continue
        out.append({"spec": key[0], "layout": key[1], "first_s": ra.seconds, "second_s": rb.seconds,
                    "first_ratio": ra.ratio, "second_ratio": rb.ratio,
                    "second_reference_s": rb.timing.reference, "first_min_s": ra.timing.min,
                    "second_min_s": rb.timing.min, "first_reference_s": ra.timing.reference,
                    "first_load": ra.load, "second_load": rb.load,
                    "hours_apart": round((rb.time - ra.time) / 3600, 2)})
    return out


def pairs(rows: list[dict[str, object]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per label: (second run, first run), the second as the first predicts it; the fastest-repeat
    labels only where the rows have them (label_repeat.csv from before they existed has not)."""
    col = lambda name: np.array([float(r[name]) for r in rows])  # noqa: E731

    out = {"seconds": (col("second_s"), col("first_s")),
           "ratio": (col("second_ratio"), col("first_ratio")),
           "rescaled": (col("second_s"), col("first_ratio") * col("second_reference_s"))}
    if all(r.get("first_min_s") not in (None, "") for r in rows):
        out["fastest"] = (col("second_min_s"), col("first_min_s"))
        out["fastest_ratio"] = (col("second_min_s") / col("second_reference_s"),
                                col("first_min_s") / col("first_reference_s"))
    return out


def scores(rows: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    settled = np.array([max(float(r["first_load"]), float(r["second_load"])) <= SETTLED_LOAD for r in rows])
    out = {}
    for label, (m, p) in pairs(rows).items():
        error = np.abs(p / m - 1)
        out[label] = {"r2": r2(m, p), "within5": float(np.mean(error <= 0.05)),
                      "median_error": float(np.median(error)), "settled": float(settled.mean()),
                      "within5_settled": float(np.mean(error[settled] <= 0.05)) if settled.any() else 0.0}
    return out


def plot(rows: list[dict[str, object]], path: Path) -> None:
    plt = pyplot()
    s = scores(rows)
    labels = pairs(rows)
    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels), 4.2), squeeze=False)
    for ax, (label, (second, first)) in zip(axes[0], labels.items()):
        x, y = list(first), list(second)
        ax.loglog(x, y, ".", ms=4)
        lo, hi = min(x + y), max(x + y)
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.5)
        ax.set_title(f"{LABELS[label]}: R2 {s[label]['r2']:.3f}, {s[label]['within5']:.0%} within 5%", fontsize=9)
        ax.set_xlabel("first run")
        ax.set_ylabel("second run")
    fig.suptitle(f"{len(rows)} conv-layouts, {float(rows[0]['hours_apart']):.1f} h apart")
    fig.tight_layout()
    save_plot(fig, path)


def first_records(path: Path, count: int, seed: int) -> None:
    """`count` uniform draws of the pruned space of RECORDS_LAYER and its defaults, measured."""
    target = kernels.host_target()
    schedules = list(dict.fromkeys(
        [kernels.default_schedule(RECORDS_LAYER, target, lay) for lay in ("NCHW", "NHWC")]
        + space.sample_many(RECORDS_LAYER, target, count, seed, pruned=True)))
    with Measurer(target) as measure:
        results = measure(RECORDS_LAYER, schedules, target)
    RecordFile(path).append(make_record(RECORDS_LAYER, target, s, t, e)
                            for s, (t, e) in zip(schedules, results))


def compare_records(path: Path) -> list[dict[str, object]]:
    out = []
    for r in RecordFile(path).load():
        if r.ok and r.history and r.referenced:
            old = r.history[-1]["timing"]
            if "ratio" in old:
                out.append({"schedule": r.schedule.describe(), "first_s": old["median"], "second_s": r.seconds,
                            "first_ratio": old["ratio"], "second_ratio": r.timing.ratio})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--phase", choices=("first", "second", "report"), required=True)
    ap.add_argument("--data", default="results/dataset_cpu.csv", help="the predictor's data set")
    ap.add_argument("--convs", type=int, default=60, help="test convs to time (default 60)")
    ap.add_argument("--records", type=int, default=50, help="schedules of the records layer (default 50)")
    ap.add_argument("--gap", type=float, default=1.0, help="hours the second run waits for (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = out_dir(args)
    first, second = out / "label_repeat_first.csv", out / "label_repeat_second.csv"
    if args.phase in ("first", "second"):
        path = first if args.phase == "first" else second
        if args.phase == "second":
            rows = load_rows(first)
            waited = (time.time() - max(r.time for r in rows)) / 3600
            if waited < args.gap:
                raise MacoError(f"the first run ended {waited:.2f} h ago; the second waits {args.gap:g} h")
        summary = collect(path, test_convs(args.data, args.convs, args.seed))
        print(f"{args.phase} run: {summary}")
        records = out / "records_repeat.jsonl"
        if args.phase == "first":
            first_records(records, args.records, args.seed)
            return 0
        print(retime(records, kernels.host_target(), top=args.records + 2))
    rows = compare(first, second)
    if not rows:
        raise MacoError(f"no conv timed with a reference in both {first} and {second}")
    csv_path = out / "label_repeat.csv"
    write_csv(csv_path, rows, COLUMNS)
    write_env(csv_path)
    plot(rows, csv_path.with_suffix(".png"))
    for label, s in scores(rows).items():
        print(f"{LABELS[label]:>32}: R2 {s['r2']:.4f}, within +-5% {s['within5']:.1%}, "
              f"median error {s['median_error']:.2%}; of the {s['settled']:.0%} timed settled in both runs "
              f"(canary <= {SETTLED_LOAD}), {s['within5_settled']:.1%} within +-5%")
    recs = compare_records(out / "records_repeat.jsonl")
    if recs:
        write_csv(out / "records_repeat.csv", recs)
        for key in ("s", "ratio"):
            rho = spearmanr([r[f"first_{key}"] for r in recs], [r[f"second_{key}"] for r in recs]).statistic
            print(f"records ({len(recs)} schedules of {RECORDS_LAYER}): Spearman on "
                  f"{'seconds' if key == 's' else 'the ratio to the reference'}: {rho:.3f}")
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    s = scores(rows)  # type: ignore[arg-type]
    return (f"{len(rows)} conv-layouts re-timed {num(rows[0], 'hours_apart'):.1f} h later: " + "; ".join(
        f"{LABELS[k]} R2 {v['r2']:.3f}, {v['within5']:.0%} within 5%" for k, v in s.items())
        + f"; the {s['ratio']['settled']:.0%} timed settled in both runs: ratio {s['ratio']['within5_settled']:.0%}"
        f" within 5%")


if __name__ == "__main__":
    sys.exit(main())
