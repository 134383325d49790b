"""`maco tune`: search the (pruned) schedule space of one conv layer or of a network's distinct
conv layers, measuring candidates for real, with a progress bar and a closing table."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from maco.commands.common import (nonnegative_int, positive_float, positive_int, print_table,
                                  resolve_layers)
from maco.errors import MacoError
from maco.files import check_writable
from maco.spec import ConvSpec
from maco.target import Target, require_memory

DEFAULT_RECORDS = "maco_records.jsonl"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="tune conv kernels: evolutionary search in the MACO-pruned schedule space",
        description="Search the schedule space of each distinct conv layer (Ansor-style evolution "
        "guided by an XGBoost cost model, trials spread over layers by a task scheduler), timing "
        "every candidate in a worker process. Records are appended to --records; running the same "
        "command again resumes (records already there count towards --trials).")
    p.add_argument("layer", help="a network (resnet18, alexnet, vgg11, resnet50, mobilenet_v2) or "
                   "a layer spec such as n1_c64_h56_w56_k64_r3_p1")
    p.add_argument("--trials", type=nonnegative_int, default=64,
                   help="measurements in total over all layers (default 64)")
    p.add_argument("--no-prune", action="store_true",
                   help="search the full space instead of the MACO-pruned one")
    p.add_argument("--records", default=DEFAULT_RECORDS,
                   help=f"tuning records, JSON lines (default {DEFAULT_RECORDS})")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--target", default="cpu", help="cpu (this machine, default) or cuda (H100 model)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size of the layers (default 1)")
    p.add_argument("--round", type=positive_int, default=16, dest="round_size",
                   help="schedules measured per search round (default 16)")
    p.add_argument("--layouts", default="NCHW,NHWC",
                   help="activation layouts the search may pick (default NCHW,NHWC)")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="seconds one measurement may take before it counts as failed (default 120)")
    p.add_argument("--no-baseline", action="store_true", help="skip timing torch for the table")
    p.set_defaults(func=run)


@dataclass
class LayerResult:
    name: str
    spec: ConvSpec
    weight: int
    best: object  # maco.records.Record | None
    trials: int
    torch_nchw: float | None  # seconds
    torch_nhwc: float | None


def run(args: argparse.Namespace) -> int:
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    bad = [x for x in layouts if x not in ("NCHW", "NHWC")]
    if bad or not layouts:
        raise MacoError(f"--layouts must name NCHW and/or NHWC, got {args.layouts!r}")
    target = Target.named(args.target)
    check_writable(args.records, "--records")
    results = tune_layers(resolve_layers(args.layer, args.batch), target, args.trials,
                          records=args.records, pruned=not args.no_prune, seed=args.seed,
                          round_size=args.round_size, layouts=layouts, timeout=args.timeout,
                          baselines=not args.no_baseline)
    print_results(results, target, f"tuned {args.layer} on {target.name} "
                  f"({'full' if args.no_prune else 'MACO-pruned'} space, records: {args.records})")
    return 0


def default_seeds(spec: ConvSpec, target: Target, layouts: tuple[str, ...]) -> tuple:
    """The bound-derived default schedule of each layout: measured first by every search."""
    from maco import kernels

    seeds = []
    for layout in layouts:
        try:
            if target.kind == "cuda":
                from maco.kernels import cuda

                seeds.append(cuda.default_schedule(spec, target, layout))
            else:
                seeds.append(kernels.default_schedule(spec, target, layout))
        except MacoError:
            pass  # no default for this layout: the search starts from samples alone
    return tuple(seeds)


def tune_layers(layers: list[tuple[str, ConvSpec]], target: Target, trials: int, *,
                records: str | Path, pruned: bool = True, seed: int = 0, round_size: int = 16,
                layouts: tuple[str, ...] = ("NCHW", "NHWC"), timeout: float = 120.0,
                baselines: bool = True, weights: list[int] | None = None) -> list[LayerResult]:
    """Tune `layers` with a shared budget of `trials` measurements; returns one result per layer."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from maco.measure import MeasureConfig, Measurer
    from maco.search import SearchConfig
    from maco.tune import Task, tune

    weights = weights or [_weight(name) for name, _ in layers]
    if target.kind == "cpu":
        for name, spec in layers:
            require_memory(spec.working_bytes, f"measuring {name} ({spec})")
    tasks = [Task(name, spec, w, default_seeds(spec, target, layouts))
             for (name, spec), w in zip(layers, weights)]
    config = SearchConfig(batch=round_size, pruned=pruned, allowed_layouts=layouts)
    with Measurer(target, MeasureConfig(timeout=timeout)) as measurer, Progress(
            TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), transient=False) as bar:
        job = bar.add_task("", total=trials)

        def progress(done: int, total: int, task: Task, state) -> None:
            best = state.best
            gf = f"{best.gflops:.1f} GFLOP/s" if best else "no valid kernel yet"
            bar.update(job, completed=min(done, total), description=f"{task.name}: {gf}")

        result = tune(tasks, target, trials, measurer, records=records, config=config, seed=seed,
                      progress=progress)
        bar.update(job, completed=trials)
        out = []
        for task, state in zip(tasks, result.states):
            nchw = nhwc = None
            if baselines:
                bar.update(job, description=f"timing torch on {task.name}")
                nchw = _seconds(measurer.baseline(task.spec, "NCHW"))
                nhwc = _seconds(measurer.baseline(task.spec, "NHWC"))
            out.append(LayerResult(task.name, task.spec, task.weight, state.best, len(state.records),
                                   nchw, nhwc))
    return out


def _weight(name: str) -> int:
    """'layer3.0.conv2 (+2)' stands for 3 layers."""
    if name.endswith(")") and "(+" in name:
        try:
            return 1 + int(name[name.rindex("(+") + 2:-1])
        except ValueError:
            pass
    return 1


def _seconds(result) -> float | None:
    timing, _ = result
    return timing.median if timing else None


def peak_gflops(target: Target) -> float:
    """The measured FMA peak on CPU when the kernels package can measure it, else the nominal."""
    if target.kind == "cpu":
        from maco import kernels

        measure = getattr(kernels, "measure_peak", None)
        if measure is not None:
            return float(measure(target))
    return target.peak_gflops


def print_results(results: list[LayerResult], target: Target, title: str) -> None:
    peak = peak_gflops(target)
    rows, speedups = [], []
    for r in results:
        gf = lambda s: r.spec.flops / s / 1e9 if s else None  # noqa: E731
        best_s = r.best.seconds if r.best else None
        torch_best = min((s for s in (r.torch_nchw, r.torch_nhwc) if s), default=None)
        speedup = torch_best / best_s if best_s and torch_best else None
        if speedup:
            speedups.append(speedup)
        rows.append((r.name, r.best.schedule.layout if r.best else "-", gf(best_s) or "-",
                     f"{100 * gf(best_s) / peak:.0f}%" if best_s else "-", gf(r.torch_nchw) or "-",
                     gf(r.torch_nhwc) or "-", f"{speedup:.2f}x" if speedup else "-", r.trials))
    print_table(title, ["layer", "layout", "GFLOP/s", "of peak", "torch NCHW", "torch NHWC",
                        "speedup", "trials"], rows)
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"geometric-mean speedup over torch's faster layout: {geo:.2f}x "
              f"({len(speedups)} layers; peak {peak:.0f} GFLOP/s)")
