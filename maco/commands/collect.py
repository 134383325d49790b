"""`maco collect`: build or extend the latency data set (random convs plus network layers, each
timed in each layout by the measurement protocol); rerunning resumes where it stopped."""
from __future__ import annotations

import argparse

from maco.commands.common import (add_cluster_argument, nonnegative_float, nonnegative_int,
                                  positive_float, positive_int, print_table)
from maco.core.errors import MacoError
from maco.core.files import check_writable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="time random and network convs in each layout into a CSV data set",
                       description="Time random conv configurations and every distinct conv layer of "
                       "built-in networks in each layout (torch: oneDNN on CPU, cuDNN on GPU), appending "
                       "one CSV row per (spec, layout, device). Rows already in the file are skipped, so "
                       "an interrupted run resumes; the environment goes to <out>.env.json.")
    p.add_argument("--out", default=None, help="CSV file (default results/dataset_<device>.csv)")
    p.add_argument("--random", type=nonnegative_int, default=400, metavar="N",
                   help="random configurations (default 400; the same seed and a larger N extend the set)")
    p.add_argument("--networks", default="resnet18,alexnet,vgg11",
                   help="comma-separated built-in networks whose layers to add ('' for none)")
    p.add_argument("--batch", default="1", help="batch sizes of the network layers, comma-separated (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random configurations (default 0)")
    p.add_argument("--layouts", default="NCHW,NHWC", help="layouts to time (default NCHW,NHWC)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--max-gflop", type=positive_float, default=2.0,
                   help="cap on a random configuration's GFLOP, which bounds its timing cost (default 2)")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds per layout (default 3)")
    p.add_argument("--tolerance", type=positive_float, default=0.1,
                   help="re-time a conv whose rounds disagree by more than this (stdev/median, default 0.1)")
    p.add_argument("--attempts", type=positive_int, default=3, help="timing attempts per conv at most (default 3)")
    p.add_argument("--retime-noisy", action="store_true",
                   help="also re-time convs already in the file whose rows are noisy or were timed "
                   "beside a busy neighbour")
    p.add_argument("--patience", type=nonnegative_float, default=30.0,
                   help="seconds to wait for quiet cores before timing a conv anyway, and, for a conv "
                   "timed in a spell, for the spell to pass before it is timed again at the end (default 30)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cluster_argument(p)
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise MacoError(f"--{what} must be comma-separated ints, got {text!r}") from None
    if not values or min(values) <= 0:
        raise MacoError(f"--{what} must list positive ints, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from maco.layouts.collection import collect
    from maco.layouts.random_convs import network_specs, random_specs
    from maco.layouts.latency import check_device

    device = check_device(args.device).type
    out = args.out or f"results/dataset_{device}.csv"
    check_writable(out, "--out")
    networks = [n.strip() for n in args.networks.split(",") if n.strip()]
    specs = [(src, spec) for b in _ints(args.batch, "batch") for src, spec in network_specs(networks, b)]
    specs += [("random", s) for s in random_specs(args.random, args.seed, max_flops=args.max_gflop * 1e9)]
    layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    summary = collect(out, specs, layouts, args.device, rounds=args.rounds, tolerance=args.tolerance,
                      attempts=args.attempts, retime_noisy=args.retime_noisy, threads=args.threads,
                      patience=args.patience, progress=not args.no_progress, cluster=args.cluster)
    print_table(f"maco collect -> {out}",
                ["measured", "retimed", "in a spell (timed again at the end)", "never settled", "under load",
                 "skipped", "rows", "bad lines", "seconds"],
                [(summary.measured, summary.retimed, summary.deferred, summary.unsettled, summary.loaded,
                  summary.skipped, summary.rows, summary.bad_lines, summary.seconds)])
    return 0
