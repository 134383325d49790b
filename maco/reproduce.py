"""`maco reproduce`: run the experiment scripts behind the paper's figures and write REPORT.md,
each figure's measured summary beside the paper's number for it.

Scripts run as subprocesses from the checkout's experiments/ folder (one failing figure does
not stop the others; each one's output goes to a log beside its CSV). GPU figures run only
where a GPU is usable; otherwise the report cites the GPU results already in the folder.
"""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from maco.errors import MacoError

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "results" / "records_cpu.jsonl"  # tuning records of the machine that made results/


@dataclass(frozen=True)
class Figure:
    name: str
    script: str
    paper: str  # what the paper reports for it
    why: str = ""  # why our number differs from the paper's, where it does
    gpu: bool = False
    quick: bool = True  # the script takes --quick
    in_all: bool = True  # `all` runs it (peers needs the optional extra and an hour)
    records: bool = False  # gets --records RECORDS when the tuning records exist


FIGURES = [
    Figure("bounds", "bounds_table.py", "eq. (8): Q >= kh*kw*C*Ho*Wo*K / (4*sqrt(2*R*S)); optimal "
           "tiles x*y = R*z, x*y*z = S/Np", "exact arithmetic, no measurement: a ratio above 1 is "
           "the price of integer, edge-clipped tiles against a bound that allows any schedule",
           quick=False),
    Figure("fig03", "fig03_layouts_per_layer.py", "AlexNet: the faster layout differs from layer "
           "to layer (no single layout is best)", "the paper timed GPU kernels; on this CPU "
           "oneDNN's channels_last path is the faster one on most layers, so the per-layer choice "
           "matters less than on the paper's GPU"),
    Figure("fig06", "fig06_space_size.py", "AlexNet's schedule spaces reach tens of millions; "
           "pruning keeps a small fraction", "counts of our own sketch (SSRSRS on CPU, SSSRRSRS "
           "on GPU) with its annotations, not TVM's, so absolute sizes differ; the reduction is "
           "what to compare", quick=False),
    Figure("kernels_cpu", "kernels_cpu.py", "(CPU) MACO kernels vs oneDNN; the paper reports GPU "
           "kernels only", "a 2-core CPU VM that runs in faster and slower spells of seconds: the FMA "
           "peak and the register-tile ceiling are timed on each layer's flops in the same rounds as "
           "the kernels, and fractions and speedups are medians of per-round ratios (the best peak "
           "ever seen here is kept beside them); the 1x1 stride-2 layers, where oneDNN is slow at "
           "batch 1, lift the mean", records=True),
    Figure("ceiling", "register_ceiling.py", "(not in the paper) how close a direct-conv register "
           "tile's loads and FMAs get to the FMA peak on this CPU, the ceiling of every fraction-of-peak "
           "number", "each weight-vector load and input broadcast adds ~0.15 cycles beyond the FMAs on "
           "this Intel core; DESIGN.md's 93-98% were measured on an AMD Zen 5", quick=False),
    Figure("fig12", "fig12_layout_plan.py", "planned hybrid layouts 1.28x / 1.32x / 1.29x over the "
           "default (ResNet-18 / AlexNet / VGG-11)", "oneDNN's NHWC convs win almost every layer "
           "here, so the plan is nearly all-NHWC with conversions at the ends; the paper's GPU "
           "made more layers prefer NCHW"),
    Figure("fig13", "fig13_predictor_r2.py", "NAS predictor R2 = 0.998 on latency (GBRT 0.90, "
           "linear 0.31, SVR 0.16)", "the labels come from a shared 2-core VM: re-timing the same "
           "convs reproduces them only to the R2 of the re-measure row, and no predictor can beat "
           "the noise of its own labels"),
    Figure("fig14", "fig14_error_threshold.py", "few wrong-layout picks, at small cost",
           "pairs whose layouts differ by under 5% are coin flips under this machine's noise; "
           "the columns by gap show the picks that matter"),
    Figure("fig15", "fig15_kernels_gpu.py", "MACO kernels 2.24x faster than cuDNN on average",
           "strict fp32 on an H100 against cuDNN's best algorithm (benchmark mode); the paper's "
           "GPU and cuDNN version differ", gpu=True),
    Figure("fig16", "fig16_search.py", "the pruned space finds better kernels in far fewer trials "
           "than Ansor's full space", "both searches use MACO's own generator, cost model and "
           "evolution here (the paper compared with Ansor in TVM), so the difference is the "
           "space alone; the two spaces take turns seed by seed, so the VM's clock drift hits both; "
           "the best-so-far is the fastest single measurement, so a lucky timing can lift either curve"),
    Figure("fig17", "fig17_cache.py", "MACO kernels hit L1 more often than cuDNN's",
           "MACO's CUDA kernels stage tiles through shared memory with cp.async, which bypasses "
           "L1: their reuse happens in shared memory and never counts as an L1 hit, while "
           "cuDNN's kernels read through L1", gpu=True, quick=False),
    Figure("fig18", "fig18_end_to_end.py", "end to end 1.07x / 1.62x / 1.34x (ResNet-18 / AlexNet / "
           "VGG-11)", "batch 1 on a 2-core CPU with oneDNN as the baseline; the paper ran its "
           "GPU kernels", records=True),
    Figure("planners", "planner_runtime.py", "(not in the paper) Algorithm 1's backtracking "
           "against the exact planners", "backtracking is exponential in the free layers; the "
           "exact planners stay in milliseconds"),
    Figure("peers", "peers_cpu.py", "(not in the paper) the tuners a user would pick instead: "
           "Halide's autoschedulers and TVM MetaSchedule", "needs `pip install -e .[peers]`; "
           "TVM tunes for about two minutes a layer", in_all=False),
]
NAMES = [f.name for f in FIGURES]


def experiments_dir() -> Path:
    path = ROOT / "experiments"
    if not path.is_dir():
        raise MacoError(f"maco reproduce runs the scripts in a source checkout's experiments/ "
                        f"folder; {path} does not exist (install MACO from a checkout with pip -e)")
    return path


def select(names: list[str]) -> list[Figure]:
    if not names or "all" in names:
        return [f for f in FIGURES if f.in_all] + [f for f in FIGURES if not f.in_all and f.name in names]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise MacoError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(NAMES)} or all")
    return [f for f in FIGURES if f.name in names]


def run_figures(figures: list[Figure], out: Path, quick: bool, log: Callable[[str], None] = print,
                gpu: bool | None = None) -> dict[str, str]:
    """Run each figure's script; returns name -> status ("ok", "failed (rc N)", "skipped: ...")."""
    if gpu is None:
        from maco.kernels.cuda import gpu_available

        gpu = gpu_available()
    folder = experiments_dir()
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for i, fig in enumerate(figures, 1):
        if fig.gpu and not gpu:
            status[fig.name] = "skipped: no usable GPU here (the report cites earlier GPU results if any)"
            log(f"[{i}/{len(figures)}] {fig.name}: {status[fig.name]}")
            continue
        script = folder / fig.script
        if not script.is_file():
            status[fig.name] = f"missing: {script.name} is not in this checkout"
            log(f"[{i}/{len(figures)}] {fig.name}: {status[fig.name]}")
            continue
        args = [sys.executable, str(script), "--out", str(out)] + (["--quick"] if quick and fig.quick else [])
        if fig.records and RECORDS.is_file():  # records of another machine are ignored by target
            args += ["--records", str(RECORDS)]
        log(f"[{i}/{len(figures)}] {fig.name}: {' '.join(args[1:])}")
        start = time.perf_counter()
        with open(out / f"reproduce_{fig.name}.log", "w") as fh:
            rc = subprocess.run(args, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
        status[fig.name] = "ok" if rc == 0 else f"failed (exit code {rc}, see reproduce_{fig.name}.log)"
        log(f"      {status[fig.name]} in {time.perf_counter() - start:.0f} s")
    return status


# -- the report --------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _geo(values: list[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def _find(out: Path, *patterns: str) -> Path | None:
    """The first file matching a pattern, in this run's folder first, then in results/."""
    for folder in (out, ROOT / "results"):
        for pattern in patterns:
            hits = sorted(folder.glob(pattern)) if folder.is_dir() else []
            if hits:
                return hits[0]
    return None


def _f(row: dict[str, str], key: str) -> float:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return float("nan")


def _bounds(rows: list[dict[str, str]]) -> str:
    ratios = {lvl: sorted(_f(r, "ratio_best") for r in rows if r["level"] == lvl) for lvl in ("L1", "L2")}
    parts = [f"{lvl}: dataflow I/O of the chosen tile / best lower bound min {v[0]:.2f}, median "
             f"{v[len(v) // 2]:.2f}, max {v[-1]:.2f}" for lvl, v in ratios.items() if v]
    return f"{len(rows)} (layer, level) pairs; " + "; ".join(parts)


def _fig03(rows: list[dict[str, str]]) -> str:
    nhwc = sum(r["faster"] == "NHWC" for r in rows)
    ratio = [_f(r, "nchw_over_nhwc") for r in rows]
    return (f"{rows[0]['network']}: NHWC faster on {nhwc} of {len(rows)} conv layers; NCHW time / "
            f"NHWC time from {min(ratio):.2f} to {max(ratio):.2f}")


def _fig06(rows: list[dict[str, str]]) -> str:
    parts = []
    for tgt in sorted({r["target"] for r in rows}):
        sub = [r for r in rows if r["target"] == tgt]
        biggest = max(sub, key=lambda r: int(r["unpruned"]))
        parts.append(f"{tgt}: geomean reduction {_geo([_f(r, 'ratio') for r in sub]):,.0f}x over "
                     f"{len(sub)} layers; largest space {int(biggest['unpruned']):.3g} "
                     f"({biggest['network']} {biggest['layer']}) -> {int(biggest['pruned']):,}")
    return "; ".join(parts)


def _kernels_cpu(rows: list[dict[str, str]]) -> str:
    tuned = sum(r.get("schedule") == "tuned" for r in rows)
    text = (f"{len(rows)} layers (the faster of the default and the best record: {tuned} tuned, "
            f"{len(rows) - tuned} default schedules): geomean "
            f"{_geo([_f(r, 'speedup') for r in rows]):.2f}x over torch's faster layout")
    three = [r for r in rows if r["kernel"] == "3x3"]
    if three:
        text += (f"; 3x3 layers at {100 * _geo([_f(r, 'fraction_of_peak') for r in three]):.0f}% of the FMA "
                 "peak timed in the same rounds")
        ceiling = _geo([_f(r, "fraction_of_ceiling") for r in three])
        if math.isfinite(ceiling):  # no register-tile ceiling on hosts without intrinsics
            text += f", {100 * ceiling:.0f}% of the register-tile ceiling"
        if "fraction_of_best_peak" in three[0]:
            text += (f", {100 * _geo([_f(r, 'fraction_of_best_peak') for r in three]):.0f}% of the best peak "
                     f"measured here ({_f(three[0], 'best_peak_gflops'):.0f} GFLOP/s) (geomeans)")
    return text


def _ceiling(rows: list[dict[str, str]]) -> str:
    fits = [r for r in rows if r["fits_registers"] == "True"]
    best = max(fits, key=lambda r: _f(r, "fraction_of_fma"))
    shapes = ", ".join(f"{r['weight_vectors']}x{r['points']} {_f(r, 'fraction_of_fma'):.0%}" for r in fits)
    return (f"best register tile {best['weight_vectors']}x{best['points']}: {_f(best, 'fraction_of_fma'):.1%} "
            f"of the FMA loop in the same rounds ({shapes})")


def _fig12(rows: list[dict[str, str]]) -> str:
    parts = [f"{r['network']} {_f(r, 'measured_speedup'):.2f}x ({r['nhwc_convs']}/{r['convs']} convs NHWC)"
             for r in rows if r["latency"] == "measure"]
    pred = [f"{r['network']} {_f(r, 'measured_speedup'):.2f}x" for r in rows if r["latency"] == "predict"]
    return ("planned from measured latencies: " + ", ".join(parts) +
            ("; planned from the predictor: " + ", ".join(pred) if pred else "") + " (measured end to end)")


def _fig13(rows: list[dict[str, str]]) -> str:
    by = {(r["model"], r["target"]): r for r in rows}
    nas = by.get(("NAS-MLP", "log"))
    parts = [f"NAS-MLP R2 {_f(nas, 'r2'):.3f} (log {_f(nas, 'r2_log'):.3f}), wrong layout "
             f"{100 * _f(nas, 'wrong_picks'):.1f}% of pairs"] if nas else []
    for model in ("GBRT", "linear", "SVR"):
        raw, log = by.get((model, "raw")), by.get((model, "log"))
        if raw and log:
            parts.append(f"{model} {_f(raw, 'r2'):.2f} raw / {_f(log, 'r2'):.2f} log target")
    rem = by.get(("re-measure", "-"))
    if rem:
        parts.append(f"re-timing {rem['pairs']} test convs: R2 {_f(rem, 'r2'):.3f}")
    return "; ".join(parts)


def _fig14(rows: list[dict[str, str]]) -> str:
    by = {r["model"]: r for r in rows}
    nas = by.get("NAS-MLP_log") or by.get("NAS-MLP")
    if not nas:
        return f"{len(rows)} models"
    return (f"NAS-MLP: {100 * _f(nas, 'within_0.1'):.0f}% of test convs within 10%, median error "
            f"{100 * _f(nas, 'median_rel_error'):.0f}%; wrong picks {100 * _f(nas, 'wrong_picks_gap_0'):.0f}% "
            f"of all pairs, {100 * _f(nas, 'wrong_picks_gap_0.05'):.0f}% where the layouts differ by >5%, "
            f"{100 * _f(nas, 'wrong_picks_gap_0.2'):.0f}% where they differ by >20%")


def _fig15(rows: list[dict[str, str]]) -> str:
    parts = []
    for r in rows:
        if r["network"] == "all":  # the geomean over every layer and layout of that batch
            parts.append(f"batch {r['batch']} ({r['layers']} (layer, layout) pairs): geomean over cuDNN's best "
                         f"{_f(r, 'search_vs_best'):.2f}x (default schedule {_f(r, 'default_vs_best'):.2f}x)")
    return "; ".join(parts) + " (strict fp32)"


def _fig16(rows: list[dict[str, str]]) -> str:
    parts = []
    for r in rows:
        full = _f(r, "full_trials_to_same")
        parts.append(f"{r['layer']}: pruned best {_f(r, 'pruned_final_gflops'):.0f} vs full "
                     f"{_f(r, 'full_final_gflops'):.0f} GFLOP/s; pruned reaches 95% of its best in "
                     f"{_f(r, 'pruned_trials_to_95pct'):.0f} trials, full " +
                     (f"in {full:.0f}" if math.isfinite(full) else "never within the budget"))
    return "; ".join(parts)


def _fig17(rows: list[dict[str, str]]) -> str:
    hit = {impl: [_f(r, "l1tex__t_sector_hit_rate.pct") for r in rows if r["impl"] == impl]
           for impl in ("maco", "cudnn")}
    time_ = {impl: [_f(r, "duration_us") for r in rows if r["impl"] == impl] for impl in ("maco", "cudnn")}
    if not hit["maco"] or not hit["cudnn"]:
        return f"{len(rows)} profiles"
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return (f"{len(hit['maco'])} layers: L1 hit rate MACO {mean(hit['maco']):.0f}% vs cuDNN "
            f"{mean(hit['cudnn']):.0f}% (mean); kernel time MACO/cuDNN geomean "
            f"{_geo([a / b for a, b in zip(time_['maco'], time_['cudnn'])]):.2f}")


def _fig18(rows: list[dict[str, str]]) -> str:
    parts = []
    for r in rows:
        maco = (f", with MACO kernels in {r['maco_convs']} conv(s) {_f(r, 'speedup_maco'):.2f}x"
                if r.get("speedup_maco") else f" ({r.get('note', '')})")
        parts.append(f"{r['network']}: planned torch {_f(r, 'speedup_torch'):.2f}x{maco}")
    return "; ".join(parts) + " (outputs equal: " + ", ".join(r["outputs_equal"] for r in rows) + ")"


def _planners(rows: list[dict[str, str]]) -> str:
    nets = [f"{g} {1e3 * _f(r, 'seconds'):.0f} ms" for g in ("resnet18", "alexnet", "vgg11")
            for r in rows if r["graph"] == g and r["method"] == "mincut"]
    text = "exact min cut on " + ", ".join(nets)
    back = {r["graph"]: r for r in rows if r["graph"] == "resnet18" and r["method"] == "backtrack"}
    if back:
        text += f" (backtracking on resnet18: {back['resnet18']['status']})"
    for graph in sorted({r["graph"] for r in rows if r["depth"]}):
        runs = [r for r in rows if r["graph"] == graph and r["method"] == "backtrack"]
        solved = [int(r["depth"]) for r in runs if r["status"] == "optimal"]
        timeout = [int(r["depth"]) for r in runs if r["status"] == "timeout"]
        text += (f"; {graph}: backtracking solves depth <= {max(solved, default=0)}" +
                 (f", times out at {min(timeout)}" if timeout else ""))
    agree = all(r["agrees"] == "True" for r in rows)
    return text + ("; every finished method agrees" if agree else "; METHODS DISAGREE")


def _peers(rows: list[dict[str, str]]) -> str:
    parts = []
    for layer in dict.fromkeys(r["layer"] for r in rows):
        sub = {r["tuner"]: r for r in rows if r["layer"] == layer}
        halide = max((r for t, r in sub.items() if t.startswith("halide")), key=lambda r: _f(r, "gflops"),
                     default=None)
        bits = [f"{t} {_f(sub[t], 'gflops'):.0f}" + (f" in {_f(sub[t], 'tuning_seconds'):.0f} s"
                                                     if _f(sub[t], "tuning_seconds") else "")
                for t in ("maco", "tvm-ms") if t in sub]
        if halide:
            bits.append(f"best Halide {_f(halide, 'gflops'):.0f}")
        parts.append(f"{layer}: " + ", ".join(bits) + " GFLOP/s")
    return "; ".join(parts)


# figure -> (the CSV files it writes, newest name first; the summary of their rows)
SUMMARIES: dict[str, tuple[tuple[str, ...], Callable[[list[dict[str, str]]], str]]] = {
    "bounds": (("bounds_table.csv",), _bounds),
    "fig03": (("fig03_layouts_per_layer.csv",), _fig03),
    "fig06": (("fig06_space_size.csv",), _fig06),
    "kernels_cpu": (("kernels_cpu_tuned.csv", "kernels_cpu_tuned_quick.csv", "kernels_cpu.csv",
                     "kernels_cpu_quick.csv"), _kernels_cpu),
    "ceiling": (("register_ceiling.csv",), _ceiling),
    "fig12": (("fig12_layout_plan.csv",), _fig12),
    "fig13": (("fig13_predictor_r2.csv",), _fig13),
    "fig14": (("fig14_error_threshold.csv",), _fig14),
    "fig15": (("fig15_summary*.csv",), _fig15),
    "fig16": (("fig16_summary.csv",), _fig16),
    "fig17": (("fig17_cache_*.csv",), _fig17),
    "fig18": (("fig18_end_to_end.csv",), _fig18),
    "planners": (("planner_runtime.csv",), _planners),
    "peers": (("peers_cpu.csv",), _peers),
}


def summarize(name: str, out: Path) -> tuple[str, str]:
    """(what was measured, from which file) for one figure; a file that cannot be read says so."""
    patterns, summary = SUMMARIES[name]
    path = _find(out, *patterns)
    if path is None:
        return "not measured yet", ""
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    try:
        rows = _rows(path)
        return (summary(rows) if rows else "the file is empty"), where
    except (KeyError, ValueError, IndexError, ZeroDivisionError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})", where


def write_report(out: Path, status: dict[str, str], path: Path | None = None) -> Path:
    """REPORT.md in `out` (or `path`): per figure, the paper's number, ours, why they differ."""
    from maco.timing import environment

    env = environment()
    lines = ["# MACO: reproduced figures", "",
             f"Written by `maco reproduce` on {time.strftime('%Y-%m-%d %H:%M')}: {env.get('cpu')} "
             f"({env.get('isa')}, {env.get('cores')} cores), torch {env.get('torch')}, gcc "
             f"{env.get('gcc')}, MACO {env.get('maco')}" + (f", GPU {env['gpu']}" if env.get("gpu") else
                                                           ", no GPU") + ".", "",
             "Each row summarises the CSV named under it: this run's when it wrote one, else the "
             "one kept in results/ (its `.env.json` sidecar or the figure's log names the machine; "
             "GPU files carry the GPU in their name).", "",
             "| figure | the paper | measured | why it differs | run now |", "|---|---|---|---|---|"]
    for fig in FIGURES:
        measured, where = summarize(fig.name, out)
        cell = f"{measured}<br>`{where}`" if where else measured
        lines.append(f"| {fig.name} | {fig.paper} | {cell} | {fig.why} | {status.get(fig.name, 'not run now')} |")
    lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    path = path or out / "REPORT.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
    return path
