"""`maco tune`: search the (pruned) schedule space of one conv layer or of a network's distinct
conv layers, measuring candidates for real, with a progress bar and a closing table."""
from __future__ import annotations

import argparse
import math

from maco.commands.common import (NETWORKS_TEXT, add_cluster_argument, nonnegative_int, positive_float,
                                  positive_int, print_table, resolve_layers)
from maco.core.errors import MacoError
from maco.core.files import check_writable
from maco.core.target import Target
from maco.kernels.cpu_peak import peak_share_note
from maco.tune.tuning import LayerResult, tune_layers

DEFAULT_RECORDS = "maco_records.jsonl"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="tune conv kernels: evolutionary search in the MACO-pruned schedule space",
        description="Search the schedule space of each distinct conv layer (Ansor-style evolution "
        "guided by an XGBoost cost model, trials spread over layers by a task scheduler), timing "
        "every candidate in a worker process. Records are appended to --records; running the same "
        "command again resumes (records already there count towards --trials).")
    p.add_argument("layer", nargs="?", help=f"a network ({NETWORKS_TEXT}) "
                   "or a layer spec such as n1_c64_h56_w56_k64_r3_p1 (not with --retime)")
    p.add_argument("--retime", action="store_true",
                   help="instead of tuning, measure the best --top records per layer and layout of "
                   "--records again beside the reference and rewrite them in place (atomically; each "
                   "keeps its old timing as history), so records of another day rank on today's scale")
    p.add_argument("--top", type=positive_int, default=3, help="records re-timed per layer and layout (default 3)")
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
    add_cluster_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.retime:
        return run_retime(args)
    if not args.layer:
        raise MacoError("give a network or a layer spec to tune (or --retime to re-time --records)")
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    bad = [x for x in layouts if x not in ("NCHW", "NHWC")]
    if bad or not layouts:
        raise MacoError(f"--layouts must name NCHW and/or NHWC, got {args.layouts!r}")
    from maco.kernels import resolve_target

    target = resolve_target(args.target)
    check_writable(args.records, "--records")
    results = tune_layers(resolve_layers(args.layer, args.batch), target, args.trials,
                          records=args.records, pruned=not args.no_prune, seed=args.seed,
                          round_size=args.round_size, layouts=layouts, timeout=args.timeout,
                          baselines=not args.no_baseline, cluster=args.cluster)
    print_results(results, target, f"tuned {args.layer} on {target.name} "
                  f"({'full' if args.no_prune else 'MACO-pruned'} space, records: {args.records})")
    return 0


def run_retime(args: argparse.Namespace) -> int:
    from maco.kernels import resolve_target
    from maco.tune.measure import MeasureConfig
    from maco.tune.tuning import retime

    if args.layer:
        raise MacoError("--retime re-times the records of --records; it takes no layer")
    check_writable(args.records, "--records")
    target = resolve_target(args.target)
    s = retime(args.records, target, top=args.top, config=MeasureConfig(timeout=args.timeout))
    print(f"re-timed {s.retimed} records of {args.records} on {target.name} ({s.unreferenced} had no "
          f"reference before; {s.failed} failed and were kept as they were); new / old seconds: "
          f"median {s.change:.3f}")
    return 0


def print_results(results: list[LayerResult], target: Target, title: str) -> None:
    """The table of a tuning run. "of peak" is the FMA loop's speed on the layer's flops timed in
    the same rounds as the kernel (its record's reference), so it holds in any spell of the machine;
    a record from before the reference (or a GPU's) gets the nominal peak, marked with a "~". A
    figure that cannot be believed says why beside it (peak_column)."""
    rows, speedups = [], []
    for r in results:
        gf = lambda s: r.spec.flops / s / 1e9 if s else None  # noqa: E731
        best_s = r.best.seconds if r.best else None
        torch_best = min((s for s in (r.torch_nchw, r.torch_nhwc) if s), default=None)
        speedup = torch_best / best_s if best_s and torch_best else None
        if speedup:
            speedups.append(speedup)
        of_peak = peak_column(r, target)
        rows.append((r.name, r.best.schedule.layout if r.best else "-", gf(best_s) or "-", of_peak,
                     gf(r.torch_nchw) or "-",
                     gf(r.torch_nhwc) or "-", f"{speedup:.2f}x" if speedup else "-", r.trials))
    print_table(title, ["layer", "layout", "GFLOP/s", "of peak", "torch NCHW", "torch NHWC",
                        "speedup", "trials"], rows)
    if speedups:
        geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"geometric-mean speedup over torch's faster layout: {geo:.2f}x ({len(speedups)} layers)")


def peak_column(r: LayerResult, target: Target) -> str:
    """The "of peak" cell of a layer: the best record's fraction of the FMA peak timed in the same
    rounds (1 / its ratio to the reference), else "~" and its fraction of the nominal peak, with a
    note beside it where it is over 100% (impossible: the FMA loop read slow in those rounds and the
    kernel did not, a busy machine) or where the kernel's own times in those rounds lay more than
    BUSY_SPREAD apart (the record keeps only the reference's median, so its times stand for it)."""
    best = r.best
    if best is None or not best.ok:
        return "-"
    if best.referenced:
        share, mark = 1 / best.timing.ratio, ""
    elif target.peak_gflops:
        share, mark = best.gflops / target.peak_gflops, "~"
    else:
        return "-"
    t = best.timing
    busy = t.max / t.min if t.min > 0 and t.repeats > 1 else None
    return f"{mark}{100 * share:.0f}%" + peak_share_note(share, busy, spread_of="its times")
