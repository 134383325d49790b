"""Issue 18 part 5: the model MACO hands back beside the engines a deployment engineer would try
instead, whole networks at batch 1, fp32, on this CPU (not a figure of the paper).

The engines and the protocol are maco.deploy.engines' (each engine in its own process, alternating round
by round with torch eager NCHW there; speedup = median of the per-round ratios): channels_last,
inductor (torch.compile with freezing), onnxruntime (ORT_ENABLE_ALL), openvino (fp32 forced) and
maco, the model `maco optimize --budget B` hands back for the network, tuned here first (records
from --records copied, never appended to; its tuning time is the row's compile_s) and timed from
the file it saves. Each worker, and the tuning, runs under `flock --lock` so that two timing jobs
never share the cores.

    pip install -e '.[engines]'      # ONNX Runtime, ONNX and OpenVINO
    python experiments/engines_cpu.py --quick                   # ResNet-18, 3 rounds
    python experiments/engines_cpu.py [--networks resnet18,vgg11] [--engines inductor,maco]
                                      [--records results/records_cpu.jsonl] [--rounds 7]

Writes <out>/engines_cpu.csv, .png and .env.json (engine versions).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from maco.deploy.engines import ENGINES, Job, run_engine, version
from maco.experiments.common import (RESULTS, Figure, num, out_dir, parser, print_table, pyplot, save_plot,
                                     write_csv, write_env)

FIGURE = Figure(
    "engines", "(not in the paper: it compares MACO with cuDNN/oneDNN kernels, not with inference engines)",
    "whole networks at batch 1 on one CPU against torch.compile, ONNX Runtime and OpenVINO "
    "(`pip install -e .[engines]`; a missing engine is a row with a note)",
    csv=("engines_cpu.csv",), records=True)

NETWORKS = "resnet18,alexnet,vgg11,resnet50,mobilenet_v2"
COLUMNS = ["network", "engine", "eager_ms", "engine_ms", "speedup", "speedup_min", "speedup_max", "rounds",
           "compile_s", "max_abs_diff", "max_rel_err", "outputs_ok", "load", "note"]
LOCK = "/tmp/maco-bench.lock"
DEFAULT_RECORDS = RESULTS / "records_cpu.jsonl"
VERSIONS = ("torch", "onnxruntime", "onnx", "openvino")


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    """Hold `flock path` (as the workers do) while this process times something itself."""
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_network(net: str, engines: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each engine's row for one network; MACO's model is tuned here first and timed from its file."""
    job = Job(net, rounds=args.rounds, repeats=args.repeats, min_run_time=args.min_run_time, warmup=args.warmup,
              patience=args.patience, inductor_mode=args.inductor_mode)
    rows = []
    with tempfile.TemporaryDirectory(prefix="engines_cpu_") as tmp:
        for engine in engines:
            print(f"{net} / {engine} ...", flush=True)
            tuned = None
            if engine == "maco":
                try:
                    tuned = _optimize(net, args, Path(tmp))
                except Exception as exc:  # noqa: BLE001 -- a failing engine is a row, not a crash
                    rows.append({"network": net, "engine": engine,
                                 "note": f"maco optimize failed: {type(exc).__name__}: {exc}"[:400]})
                    continue
                job.saved = str(Path(tmp) / "model.maco")
            row = {"network": net, **run_engine(engine, job, lock=args.lock or None, timeout=args.timeout)}
            if tuned:  # the tuning is MACO's compile step
                row["compile_s"], row["note"] = tuned[0], f"{tuned[1]}; {row.get('note', '')}"
            rows.append(row)
    return rows


def _optimize(net: str, args: argparse.Namespace, tmp: Path) -> tuple[float, str]:
    """`maco optimize` on the network (under the lock), its model saved to tmp/model.maco."""
    from maco.deploy.optimize import optimize

    records = tmp / "records_cpu.jsonl"
    if args.records and Path(args.records).is_file():
        shutil.copyfile(args.records, records)  # tuning appends: never to the file given
        given = f"records copied from {args.records}"
    else:
        given = "no records given: tuned from scratch"
    with _locked(args.lock), contextlib.redirect_stdout(sys.stderr):
        start = time.perf_counter()
        result = optimize(net, budget=args.budget, out=tmp / "maco-out", records=records, save=tmp / "model.maco",
                          log=lambda line: print(line, file=sys.stderr))
        seconds = time.perf_counter() - start
    return round(seconds, 2), f"maco optimize --budget {args.budget} handed back '{result.chosen}'; {given}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: each engine's speedup over torch eager NCHW, per network."""
    plt = pyplot()
    nets = list(dict.fromkeys(r["network"] for r in rows))
    seen = list(dict.fromkeys(r["engine"] for r in rows))
    engines = [e for e in ENGINES if e in seen] + [e for e in seen if e not in ENGINES]
    width = 0.8 / max(len(engines), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(nets) + 2), 4.6))
    top = max([num(r, "speedup") for r in rows if num(r, "speedup") > 0] + [1.0])
    for j, engine in enumerate(engines):
        for i, net in enumerate(nets):
            r = next((r for r in rows if r["network"] == net and r["engine"] == engine), None)
            if r is None:
                continue
            s = num(r, "speedup")
            ok = s > 0
            xpos = i - 0.4 + width * (j + 0.5)
            ax.bar(xpos, s if ok else 0.0, width, color=plt.get_cmap("tab10")(j), label=engine if i == 0 else None,
                   hatch="" if str(r.get("outputs_ok")) in ("True", "") else "//")
            ax.text(xpos, (s if ok else 0.0) + top * 0.01, f"{s:.2f}" if ok else "n/a", ha="center",
                    va="bottom", fontsize=7, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="torch eager NCHW")
    eager = {n: statistics.median(ms) for n in nets
             if (ms := [num(r, "eager_ms") for r in rows if r["network"] == n and num(r, "eager_ms") > 0])}
    ax.set_xticks(range(len(nets)), [f"{n}\n{eager[n]:.1f} ms eager" if n in eager else n for n in nets])
    ax.set_ylabel("speedup over torch eager NCHW (median of per-round ratios)")
    ax.set_ylim(0, top * 1.35)
    ax.set_title("Inference engines, batch 1, fp32, this CPU (hatched: outputs differ from eager)", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network, each engine's speedup over eager NCHW, the fastest, MACO's rank."""
    parts = []
    for net in dict.fromkeys(r["network"] for r in rows):
        mine = [r for r in rows if r["network"] == net]
        timed = sorted((r for r in mine if num(r, "speedup") > 0), key=lambda r: -num(r, "speedup"))
        cells = [f"{r['engine']} {num(r, 'speedup'):.2f}x" + ("" if r.get("outputs_ok") == "True" else " (outputs differ)")
                 for r in timed] + [f"{r['engine']} failed" for r in mine if r not in timed]
        text = f"{net}: " + ", ".join(cells)
        if timed:
            text += f"; fastest {timed[0]['engine']}"
        rank = next((i for i, r in enumerate(timed, 1) if r["engine"] == "maco"), None)
        if rank:
            text += f", MACO {rank} of {len(timed)}"
        parts.append(text)
    return "; ".join(parts) + " (speedup over torch eager NCHW, same rounds)"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="ResNet-18 only, 3 rounds")
    ap.add_argument("--networks", default=NETWORKS, help=f"comma-separated (default {NETWORKS})")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default all)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine and round (default 3)")
    ap.add_argument("--min-run-time", type=float, default=0.05, help="seconds one timed run lasts at least")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each before the rounds")
    ap.add_argument("--patience", type=float, default=30.0, help="seconds to wait for quiet cores first")
    ap.add_argument("--records", type=Path, default=DEFAULT_RECORDS if DEFAULT_RECORDS.is_file() else None,
                    help="tuning records copied for MACO (default results/records_cpu.jsonl where present)")
    ap.add_argument("--budget", default="quick", help="MACO's tuning budget (default quick)")
    ap.add_argument("--inductor-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--lock", default=LOCK, help=f"flock file around each worker (default {LOCK}; '' for none)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker (default 3600)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    if args.records and not Path(args.records).is_file():
        ap.error(f"records file not found: {args.records}")
    nets = ["resnet18"] if args.quick else [n.strip() for n in args.networks.split(",") if n.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    out = out_dir(args)
    rows = [row for net in nets for row in run_network(net, engines, args)]
    path = out / "engines_cpu.csv"
    write_csv(path, rows, COLUMNS, floats=".5g")
    write_env(path, engines=engines, rounds=args.rounds, inductor_mode=args.inductor_mode, budget=args.budget,
              records=str(args.records or ""), **{f"{d}_version": version(d) for d in VERSIONS})
    plot(rows, out / "engines_cpu.png")
    print_table(f"speedup over torch eager NCHW ({args.rounds} rounds)", ["network", "engine", "eager ms",
                "engine ms", "speedup", "compile s", "rel err", "note"],
                [[r["network"], r["engine"], _fmt(r.get("eager_ms")), _fmt(r.get("engine_ms")),
                  _fmt(r.get("speedup"), ".2f"), _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("max_rel_err"), ".1e"),
                  r.get("note", "")] for r in rows])
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"wrote {path}, {path.with_suffix('.png').name} and {path.with_suffix('.env.json').name}")
    return 0


def _fmt(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    raise SystemExit(main())
