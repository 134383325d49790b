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


@dataclass(frozen=True)
class Figure:
    name: str
    script: str
    paper: str  # what the paper reports for it
    gpu: bool = False
    quick: bool = True  # the script takes --quick


FIGURES = [
    Figure("bounds", "bounds_table.py", "eq. (8): Q >= kh*kw*C*Ho*Wo*K / (4*sqrt(2*R*S)); optimal "
           "tiles x*y = R*z, x*y*z = S/Np", quick=False),
    Figure("fig03", "fig03_layouts_per_layer.py", "AlexNet: the faster layout differs from layer "
           "to layer (no single layout is best)"),
    Figure("fig06", "fig06_space_size.py", "AlexNet's schedule spaces reach tens of millions; "
           "pruning keeps a small fraction", quick=False),
    Figure("kernels_cpu", "kernels_cpu.py", "(CPU) MACO kernels vs oneDNN; the paper reports GPU "
           "kernels only"),
    Figure("fig12", "fig12_layout_plan.py", "planned hybrid layouts 1.28x / 1.32x / 1.29x over the "
           "default (ResNet-18 / AlexNet / VGG-11)"),
    Figure("fig13", "fig13_predictor_r2.py", "NAS predictor R2 = 0.998 on latency"),
    Figure("fig14", "fig14_error_threshold.py", "few wrong-layout picks, at small cost"),
    Figure("fig15", "fig15_kernels_gpu.py", "MACO kernels 2.24x faster than cuDNN on average", gpu=True),
    Figure("fig16", "fig16_search.py", "the pruned space finds better kernels in far fewer trials "
           "than Ansor's full space"),
    Figure("fig17", "fig17_cache.py", "MACO kernels hit L1 more often than cuDNN's", gpu=True,
           quick=False),
    Figure("fig18", "fig18_end_to_end.py", "end to end 1.07x / 1.62x / 1.34x (ResNet-18 / AlexNet / "
           "VGG-11)"),
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
        return list(FIGURES)
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


def _find(out: Path, *names: str) -> Path | None:
    for name in names:
        for folder in (out, ROOT / "results"):
            if (folder / name).is_file():
                return folder / name
    return None


def _bounds(out: Path) -> str | None:
    p = _find(out, "bounds_table.csv")
    if not p:
        return None
    rows = _rows(p)
    ratios = {lvl: sorted(float(r["ratio_best"]) for r in rows if r["level"] == lvl) for lvl in ("L1", "L2")}
    parts = [f"{lvl}: dataflow I/O of the chosen tile / best lower bound min {v[0]:.2f}, median "
             f"{v[len(v) // 2]:.2f}, max {v[-1]:.2f}" for lvl, v in ratios.items() if v]
    return f"{len(rows)} (layer, level) pairs; " + "; ".join(parts)


def _fig06(out: Path) -> str | None:
    p = _find(out, "fig06_space_size.csv")
    if not p:
        return None
    rows = _rows(p)
    parts = []
    for tgt in sorted({r["target"] for r in rows}):
        sub = [r for r in rows if r["target"] == tgt]
        biggest = max(sub, key=lambda r: int(r["unpruned"]))
        parts.append(f"{tgt}: geomean reduction {_geo([float(r['ratio']) for r in sub]):,.0f}x over "
                     f"{len(sub)} layers; largest space {int(biggest['unpruned']):.3g} "
                     f"({biggest['network']} {biggest['layer']}) -> {int(biggest['pruned']):,}")
    return "; ".join(parts)


def _fig15(out: Path) -> str | None:
    p = _find(out, "fig15_summary_h100.csv", "fig15_summary.csv")
    if not p:
        return None
    rows = _rows(p)
    parts = []
    for batch in sorted({r["batch"] for r in rows}):
        sub = [r for r in rows if r["batch"] == batch]
        parts.append(f"batch {batch}: geomean over cuDNN's best {_geo([float(r['search_vs_best']) for r in sub]):.2f}x "
                     f"(default schedule {_geo([float(r['default_vs_best']) for r in sub]):.2f}x)")
    return f"{p.name}: " + "; ".join(parts) + " (strict fp32)"


def _fig16(out: Path) -> str | None:
    p = _find(out, "fig16_summary.csv")
    if not p:
        return None
    parts = []
    for r in _rows(p):
        full = r["full_trials_to_same"]
        parts.append(f"{r['layer']}: pruned best {float(r['pruned_final_gflops']):.0f} vs full "
                     f"{float(r['full_final_gflops']):.0f} GFLOP/s; pruned reaches 95% of its best in "
                     f"{float(r['pruned_trials_to_95pct']):.0f} trials, full " +
                     (f"in {float(full):.0f}" if full != "inf" else "never within the budget"))
    return "; ".join(parts)


def _generic(name: str) -> Callable[[Path], str | None]:
    def summary(out: Path) -> str | None:
        for folder in (out, ROOT / "results"):
            hits = sorted(folder.glob(f"{name}*.csv"))
            if hits:
                return "see " + ", ".join(h.name for h in hits[:3])
        return None
    return summary


SUMMARIES: dict[str, Callable[[Path], str | None]] = {"bounds": _bounds, "fig06": _fig06,
                                                       "fig15": _fig15, "fig16": _fig16}


def write_report(out: Path, status: dict[str, str], path: Path | None = None) -> Path:
    """REPORT.md in `out` (or `path`): a table of figure, paper, measured, status."""
    from maco.timing import environment

    env = environment()
    lines = ["# MACO: reproduced figures", "",
             f"Machine: {env.get('cpu')} ({env.get('isa')}, {env.get('cores')} cores), torch "
             f"{env.get('torch')}, gcc {env.get('gcc')}, MACO {env.get('maco')}; "
             f"{time.strftime('%Y-%m-%d %H:%M')}. Made by `maco reproduce`.", "",
             "| figure | the paper | measured here | run |", "|---|---|---|---|"]
    for fig in FIGURES:
        measured = (SUMMARIES.get(fig.name) or _generic(fig.name))(out) or "not measured yet"
        lines.append(f"| {fig.name} | {fig.paper} | {measured} | {status.get(fig.name, 'not run now')} |")
    lines += ["", "Why numbers differ from the paper: see the notes under each experiment's "
              "docstring; the paper measured other hardware (a server CPU with more cores and a "
              "V100/A100-class GPU) with TVM-generated kernels, and GPU numbers here are strict fp32.", ""]
    out.mkdir(parents=True, exist_ok=True)
    path = path or out / "REPORT.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
    return path
