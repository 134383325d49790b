"""Issue 39 part 4: MACO on every core of this CPU beside the engines, with the protocol of
experiments/engines_cpu.py (maco.deploy.engines: each engine in its own process, alternating round
by round with torch eager NCHW there; speedup = median of per-round ratios), at this process's
core count (run it under `taskset -c 0-1` for 2 cores: torch's threads and MACO's follow the
cores a process may use).

MACO's model here is built without tuning (no time for it on a borrowed machine): every conv on
its bound-derived default schedule for this core count, re-timed beside torch here and kept
where it wins, layouts planned, the fastest variant saved (maco.deploy.deployment) and timed from
that file like any `maco optimize --save` model.

    python experiments/threads_cpu.py --out results [--networks resnet18,resnet50]
    taskset -c 0-1 python experiments/threads_cpu.py --out results

Writes (appends rows to) <out>/threads_cpu.csv: network, cores, engine, eager_ms, engine_ms,
speedup, outputs_ok, compile_s, note; and <out>/threads_cpu_split_<cores>.csv: how evenly each
conv's default direct schedule and each of its Winograd tile sizes fill the cores.
"""
from __future__ import annotations

import csv
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from maco.core.target import Target
from maco.deploy.deployment import describe, save
from maco.deploy.engines import Job, compare
from maco.deploy.pipeline import run_pipeline
from maco.experiments.common import Figure, num, out_dir, parser, write_csv
from maco.layouts.networks import example_input, load_model
from maco.tune.records import RecordStore

FIGURE = Figure(
    "threads", "(not in the paper) MACO beside the engines at 2 cores and at every core of a larger host",
    "run by hand on a many-core host (twice: under `taskset -c 0-1` and on every core); MACO on its "
    "default schedules", csv=("threads_cpu.csv", "threads_cpu_xeon*.csv"), quick=False, in_all=False)

COLUMNS = ["network", "cores", "engine", "eager_ms", "engine_ms", "speedup", "outputs_ok", "max_rel_err",
           "compile_s", "note"]


def save_default_model(net: str, path: Path) -> tuple[str, float]:
    """The model maco optimize would hand back on default schedules, saved to `path`: its variant
    and the seconds it took to build."""
    start = time.perf_counter()
    target = Target.host()
    torch.set_num_threads(target.cores)
    x = example_input(1)
    _, model = load_model(net)
    run = run_pipeline(model.eval(), x, target, RecordStore([], target), log=lambda m: None)
    save(describe(run.built.models[run.pick], run.pick, x, target, run.built.plan), path)
    return run.pick, time.perf_counter() - start


def split_balance(net: str, target: Target) -> list[dict[str, Any]]:
    """Per distinct conv of `net` and kernel: the parallel work items of its default NHWC direct
    schedule on `target` (the product of the fused outer S0 loops), and of each Winograd tile size
    where Winograd applies (blocks of tiles times parts of the filters), and how evenly they fill
    its cores: items over whole waves of `cores` items (1.0: every core busy to the end)."""
    import math

    from maco import kernels
    from maco.bounds.network import tile_label
    from maco.core.axes import SPATIAL_AXES
    from maco.core.errors import MacoError
    from maco.kernels.winograd import TILE_SIZES, WinogradPlan, winograd_can_run
    from maco.layouts.networks import conv_layers, distinct_convs

    _, model = load_model(net)
    rows = []

    def row(spec: Any, names: list[str], kernel: str, items: int, axes: str) -> dict[str, Any]:
        waves = math.ceil(items / target.cores)
        return dict(network=net, cores=target.cores, spec=str(spec), kernel=kernel, layers=len(names),
                    gmacs=spec.flops / 2e9 * len(names), chunks=items, parallel_axes=axes,
                    balance=items / (waves * target.cores))

    for spec, names in distinct_convs(conv_layers(model.eval(), example_input(1))):
        try:
            sched = kernels.default_schedule(spec, target, "NHWC")
        except MacoError:
            continue  # a conv the generated kernels leave to torch (depthwise on its own kernel)
        rows.append(row(spec, names, "direct", math.prod(sched.spatial[i][0] for i in range(sched.parallel)),
                        "".join(SPATIAL_AXES[:sched.parallel])))
        if winograd_can_run(spec, target.simd_width):
            for m in TILE_SIZES[spec.kh]:
                split = WinogradPlan(spec, threads=target.cores, lanes=target.simd_width, m=m).split
                rows.append(row(spec, names, tile_label(m, spec.kh), split.blocks * split.k_parts, "tiles,k"))
    return rows


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per network and core count, each engine's milliseconds; MACO's scaling."""
    parts = []
    for net in dict.fromkeys(r["network"] for r in rows):
        by_cores: dict[str, dict[str, float]] = {}
        for r in rows:
            if r["network"] == net and num(r, "engine_ms") > 0:
                by_cores.setdefault(r["cores"], {})[r["engine"]] = num(r, "engine_ms")
        cells = [f"{cores} cores: " + ", ".join(f"{e} {ms:.2f} ms" for e, ms in sorted(t.items(), key=lambda kv: kv[1]))
                 for cores, t in by_cores.items()]
        lo, hi = min(by_cores, key=int, default=None), max(by_cores, key=int, default=None)
        if lo != hi and "maco" in by_cores[lo] and "maco" in by_cores[hi]:
            gain = by_cores[lo]["maco"] / by_cores[hi]["maco"]
            cells.append(f"MACO {gain:.2f}x from {lo} to {hi} cores ({gain * int(lo) / int(hi):.0%} per core)")
        parts.append(f"{net}: " + "; ".join(cells))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--networks", default="resnet18")
    ap.add_argument("--engines", default="inductor,onnxruntime,maco")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per engine's worker")
    args = ap.parse_args(argv)
    out = out_dir(args)
    path = out / "threads_cpu.csv"
    rows: list[dict[str, Any]] = []
    if path.is_file():
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    cores = Target.host().cores
    split = []
    for net in args.networks.split(","):
        split += split_balance(net, Target.host())
        for family in ("direct", "Winograd"):
            mine = [r for r in split if r["network"] == net
                    and ("direct" if r["kernel"] == "direct" else "Winograd") == family]
            if mine:
                weighted = sum(r["balance"] * r["gmacs"] for r in mine) / sum(r["gmacs"] for r in mine)
                print(f"{net}: {family} kernels' parallel split on {cores} cores, MAC-weighted balance "
                      f"{weighted:.3f} (worst {min(r['balance'] for r in mine):.2f})", flush=True)
        write_csv(out / f"threads_cpu_split_{cores}.csv", split)
    for net in args.networks.split(","):
        with tempfile.TemporaryDirectory(prefix="maco_threads_") as tmp:
            saved = Path(tmp) / f"{net}.maco"
            engines = args.engines.split(",")
            note = ""
            if "maco" in engines:
                pick, secs = save_default_model(net, saved)
                note = f"default schedules, variant {pick}, built in {secs:.0f} s"
                print(f"{net} on {cores} cores: MACO {note}", flush=True)
            job = Job(net, saved=str(saved), rounds=args.rounds, patience=5.0)
            for row in compare(job, engines, lock=None, timeout=args.timeout,
                               log=lambda m: print(m, flush=True)):
                row = dict(network=net, cores=cores, **row)
                if row["engine"] == "maco":
                    row["note"] = f"{note}; {row.get('note', '')}"
                print(f"  {row['engine']:12s} " + ", ".join(f"{k}={row.get(k)}" for k in COLUMNS[3:]), flush=True)
                rows.append(row)
                write_csv(path, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
