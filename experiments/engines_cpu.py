"""The model MACO hands back beside the engines a deployment engineer would try instead, whole
networks at batch 1 (and 8 with --batches 1,8), fp32, on this CPU (not a figure of the paper).

The engines and the protocol are maco.deploy.engines' (each engine in its own process, alternating round
by round with torch eager NCHW there; speedup = median of the per-round ratios): channels_last,
inductor (torch.compile with freezing), onnxruntime (ORT_ENABLE_ALL), openvino (fp32 forced) and
maco, the model `maco optimize --budget B` hands back for the network, tuned here first (records
from --records copied, never appended to; its tuning time is the row's compile_s) and timed from
the file it saves. Each worker, and the tuning, runs under `flock --lock` so that two timing jobs
never share the cores.

Eager's own time moves between processes (a slow spell of the VM, the engine's threads), so the
ratio and the milliseconds can rank close engines differently. Every engine therefore runs in
--passes back-to-back passes over the engine list (A B C A B C): its row gives the median over
passes of both its milliseconds and its ratio, and the report names the fastest by each.

    pip install -e '.[engines]'      # ONNX Runtime, ONNX and OpenVINO
    python experiments/engines_cpu.py --quick                   # ResNet-18, 3 rounds
    python experiments/engines_cpu.py [--networks resnet18,vgg11] [--engines inductor,maco]
                                      [--batches 1,8] [--passes 2]
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
from maco.layouts.networks import NETWORKS as BUILT_IN
from maco.experiments.common import (RESULTS, Figure, num, out_dir, parser, print_table, pyplot, save_plot,
                                     write_csv, write_env)

FIGURE = Figure(
    "engines", "(not in the paper: it compares MACO with cuDNN/oneDNN kernels, not with inference engines)",
    "whole networks at batch 1 on one CPU against torch.compile, ONNX Runtime and OpenVINO "
    "(`pip install -e .[engines]`; a missing engine is a row with a note)",
    csv=("engines_cpu.csv",), records=True)

NETWORKS = ",".join(BUILT_IN)
COLUMNS = ["network", "batch", "engine", "eager_ms", "engine_ms", "speedup", "speedup_min", "speedup_max", "rounds",
           "passes", "engine_ms_passes", "speedup_passes", "compile_s", "max_abs_diff", "max_rel_err", "outputs_ok",
           "load", "note"]
LOCK = "/tmp/maco-timing.lock"
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


def run_network(net: str, batch: int, engines: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each engine's row for one network at one batch size, over `args.passes` passes (A B A B);
    MACO's model is tuned here first, once, and timed from its file in every pass."""
    job = Job(net, input_shape=(batch, 3, 224, 224), rounds=args.rounds, repeats=args.repeats,
              min_run_time=args.min_run_time, warmup=args.warmup, patience=args.patience,
              inductor_mode=args.inductor_mode)
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    tuned: tuple[float, str] | None = None
    failed: dict[str, str] = {}
    kept = Path(args.keep) / f"{net}_b{batch}" if args.keep else None  # MACO's records and model outlive the run
    if kept:
        kept.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(str(kept)) if kept else tempfile.TemporaryDirectory(prefix="engines_cpu_") as tmp:
        for pass_ in range(args.passes):
            for engine in engines:
                if engine in failed:
                    continue
                print(f"{net} batch {batch} / {engine} (pass {pass_ + 1} of {args.passes}) ...", flush=True)
                if engine == "maco" and tuned is None:
                    try:
                        tuned = _optimize(net, batch, args, Path(tmp))
                    except Exception as exc:  # noqa: BLE001 -- a failing engine is a row, not a crash
                        failed[engine] = f"maco optimize failed: {type(exc).__name__}: {exc}"[:400]
                        continue
                    job.saved = str(Path(tmp) / "model.maco")
                runs[engine].append(run_engine(engine, job, lock=args.lock or None, timeout=args.timeout))
    rows = []
    for engine in engines:
        row = {"network": net, "batch": batch, **passes_row(engine, runs[engine], failed.get(engine))}
        if engine == "maco" and tuned:  # the tuning is MACO's compile step
            row["compile_s"], row["note"] = tuned[0], f"{tuned[1]}; {row.get('note', '')}"
        rows.append(row)
    return rows


def passes_row(engine: str, runs: list[dict[str, Any]], failed: str | None = None) -> dict[str, Any]:
    """One engine's row from its passes: the medians over the passes that timed it, of its
    milliseconds, eager's and the ratio, each pass's beside them; the first pass's row where none
    timed it (its note says why)."""
    timed = [r for r in runs if isinstance(r.get("engine_ms"), (int, float)) and isinstance(r.get("speedup"), (int, float))]
    if failed or not timed:
        note = failed or (runs[0].get("note", "no pass ran") if runs else "no pass ran")
        return {"engine": engine, "passes": 0, "note": note}
    row = dict(timed[-1])  # versions, compile time, errors: the last pass's
    for key in ("engine_ms", "eager_ms", "speedup"):
        row[key] = statistics.median(r[key] for r in timed)
    row["speedup_min"] = min(r.get("speedup_min", r["speedup"]) for r in timed)
    row["speedup_max"] = max(r.get("speedup_max", r["speedup"]) for r in timed)
    row["rounds"] = sum(int(r.get("rounds", 0)) for r in timed)
    row["passes"] = len(timed)
    row["engine_ms_passes"] = " ".join(f"{r['engine_ms']:.3f}" for r in timed)
    row["speedup_passes"] = " ".join(f"{r['speedup']:.3f}" for r in timed)
    row["outputs_ok"] = all(r.get("outputs_ok") is True for r in timed)
    row["max_rel_err"] = max(float(r.get("max_rel_err", 0.0)) for r in timed)
    row["max_abs_diff"] = max(float(r.get("max_abs_diff", 0.0)) for r in timed)
    return row


def _optimize(net: str, batch: int, args: argparse.Namespace, tmp: Path) -> tuple[float, str]:
    """`maco optimize` on the network (under the lock), its model saved to tmp/model.maco."""
    from maco.deploy.optimize import optimize

    records = tmp / "records_cpu.jsonl"
    if records.is_file():  # --keep from an earlier run: its tuning goes on
        given = f"records kept in {records}"
    elif args.records and Path(args.records).is_file():
        shutil.copyfile(args.records, records)  # tuning appends: never to the file given
        given = f"records copied from {args.records}"
    else:
        given = "no records given: tuned from scratch"
    with _locked(args.lock), contextlib.redirect_stdout(sys.stderr):
        start = time.perf_counter()
        result = optimize(net, budget=args.budget, out=tmp / "maco-out", records=records, save=tmp / "model.maco", batch=batch,
                          log=lambda line: print(line, file=sys.stderr))
        seconds = time.perf_counter() - start
    return round(seconds, 2), f"maco optimize --budget {args.budget} handed back '{result.chosen}'; {given}"


def _case(row: dict[str, Any]) -> str:
    """The network and, past batch 1, its batch size: one group of bars, one report clause."""
    batch = str(row.get("batch", "") or "1")
    return row["network"] if batch == "1" else f"{row['network']} b{batch}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: each engine's speedup over torch eager NCHW, per network (and batch), with
    its milliseconds written on the bar."""
    plt = pyplot()
    cases = list(dict.fromkeys(_case(r) for r in rows))
    seen = list(dict.fromkeys(r["engine"] for r in rows))
    engines = [e for e in ENGINES if e in seen] + [e for e in seen if e not in ENGINES]
    width = 0.8 / max(len(engines), 1)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(cases) + 2), 4.6))
    top = max([num(r, "speedup") for r in rows if num(r, "speedup") > 0] + [1.0])
    for j, engine in enumerate(engines):
        for i, case in enumerate(cases):
            r = next((r for r in rows if _case(r) == case and r["engine"] == engine), None)
            if r is None:
                continue
            s, ms = num(r, "speedup"), num(r, "engine_ms")
            ok = s > 0
            xpos = i - 0.4 + width * (j + 0.5)
            ax.bar(xpos, s if ok else 0.0, width, color=plt.get_cmap("tab10")(j), label=engine if i == 0 else None,
                   hatch="" if str(r.get("outputs_ok")) in ("True", "") else "//")
            ax.text(xpos, (s if ok else 0.0) + top * 0.01, f"{s:.2f}x {ms:.1f} ms" if ok else "n/a", ha="center",
                    va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="torch eager NCHW")
    eager = {c: statistics.median(ms) for c in cases
             if (ms := [num(r, "eager_ms") for r in rows if _case(r) == c and num(r, "eager_ms") > 0])}
    ax.set_xticks(range(len(cases)), [f"{c}\n{eager[c]:.1f} ms eager" if c in eager else c for c in cases],
                  fontsize=7)
    ax.set_ylabel("speedup over torch eager NCHW (median of per-round ratios)")
    ax.set_ylim(0, top * 1.5)
    ax.set_title("Inference engines, fp32, this CPU: speedup and milliseconds (medians over passes; "
                 "hatched: outputs differ from eager)", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network (and batch), each engine's speedup over eager NCHW and milliseconds,
    the fastest by each, and MACO's rank by the ratio."""
    parts = []
    for case in dict.fromkeys(_case(r) for r in rows):
        mine = [r for r in rows if _case(r) == case]
        timed = sorted((r for r in mine if num(r, "speedup") > 0), key=lambda r: -num(r, "speedup"))
        cells = [f"{r['engine']} {num(r, 'speedup'):.2f}x" + (f" {num(r, 'engine_ms'):.2f} ms" if num(r, "engine_ms") > 0 else "")
                 + ("" if r.get("outputs_ok") == "True" else " (outputs differ)")
                 for r in timed] + [f"{r['engine']} failed" for r in mine if r not in timed]
        text = f"{case}: " + ", ".join(cells)
        if timed:
            by_ratio = timed[0]["engine"]
            with_ms = [r for r in timed if num(r, "engine_ms") > 0]
            by_ms = min(with_ms, key=lambda r: num(r, "engine_ms"))["engine"] if with_ms else by_ratio
            text += (f"; fastest {by_ratio}" if by_ms == by_ratio
                     else f"; fastest by ratio {by_ratio}, by ms {by_ms}")
        rank = next((i for i, r in enumerate(timed, 1) if r["engine"] == "maco"), None)
        if rank:
            text += f", MACO {rank} of {len(timed)}"
        parts.append(text)
    return "; ".join(parts) + " (speedup over torch eager NCHW, same rounds; ms: medians over passes)"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="ResNet-18 only, 3 rounds")
    ap.add_argument("--networks", default=NETWORKS, help=f"comma-separated (default {NETWORKS})")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default all)")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1), e.g. 1,8")
    ap.add_argument("--passes", type=int, default=None,
                    help="back-to-back passes over the engines, A B A B (default 2, quick 1)")
    ap.add_argument("--keep", default="", help="a folder that keeps MACO's tuned records and saved model "
                    "(NET_bBATCH/records_cpu.jsonl, model.maco) for later runs; default: a temporary folder")
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
    args.passes = args.passes or (1 if args.quick else 2)
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError(args.batches)
    except ValueError:
        ap.error(f"--batches takes comma-separated positive integers, got {args.batches!r}")
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, got {args.passes}")
    if args.records and not Path(args.records).is_file():
        ap.error(f"records file not found: {args.records}")
    nets = ["resnet18"] if args.quick else [n.strip() for n in args.networks.split(",") if n.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    out = out_dir(args)
    unknown = [n for n in nets if n not in BUILT_IN and ":" not in n]  # path/to/file.py:Class also runs
    if unknown:
        ap.error(f"unknown network(s) {', '.join(unknown)}; choose from {NETWORKS}")
    path, rows = out / "engines_cpu.csv", []
    write_env(path, engines=engines, rounds=args.rounds, passes=args.passes, batches=batches, inductor_mode=args.inductor_mode, budget=args.budget,
              records=str(args.records or ""), **{f"{d}_version": version(d) for d in VERSIONS})
    for batch in batches:
        for net in nets:
            rows += run_network(net, batch, engines, args)
            write_csv(path, rows, COLUMNS, floats=".5g")  # after each network: a run cut short keeps what it timed
    plot(rows, out / "engines_cpu.png")
    print_table(f"speedup over torch eager NCHW ({args.rounds} rounds, medians over {args.passes} passes)",
                ["network", "batch", "engine", "eager ms", "engine ms", "speedup", "compile s", "rel err", "note"],
                [[r["network"], str(r.get("batch", "")), r["engine"], _fmt(r.get("eager_ms")), _fmt(r.get("engine_ms")),
                  _fmt(r.get("speedup"), ".2f"), _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("max_rel_err"), ".1e"),
                  r.get("note", "")] for r in rows])
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"wrote {path}, {path.with_suffix('.png').name} and {path.with_suffix('.env.json').name}")
    return 0


def _fmt(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    raise SystemExit(main())
