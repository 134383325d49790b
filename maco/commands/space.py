"""`maco space`: exact sizes of the schedule space of each conv layer, before and after MACO pruning."""
from __future__ import annotations

import argparse
import json

from maco.commands.common import (NETWORKS_TEXT, nonnegative_int, positive_float, positive_int, print_table,
                                  resolve_layers)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "space", help="schedule-space sizes per conv layer, unpruned and MACO-pruned",
        description="Count the schedule space of each conv layer exactly (perfect tilings times "
        "annotation choices; the CPU sketch SSRSRS or the GPU sketch SSSRRSRS) and the space left "
        "after MACO pruning (the register tile issues FMAs near the peak: accumulators to hide the "
        "FMA latency, loads counted lane by lane where a vector's lanes are not adjacent; each "
        "cache level's tile reaches the level's balance as channel "
        "chunks slide past it, the parallel loop keeps every core busy, alpha = 1), "
        "with the ratio. Pruning that had to be relaxed for a layer is noted.")
    p.add_argument("layer", help=f"a network ({NETWORKS_TEXT}: its "
                   "distinct conv layers) or a layer spec such as n1_c64_h56_w56_k64_r3_p1")
    p.add_argument("--target", default="host", help="host (this CPU, default) or h100 (GPU sketch)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--tolerance", type=positive_float, default=2.0,
                   help="how far a level's tile may fall short of its balance (default 2: a factor of 2)")
    p.add_argument("--samples", type=nonnegative_int, default=0, metavar="N",
                   help="also print N schedules drawn uniformly from the pruned space of each layer, "
                   "one JSON object per line")
    p.add_argument("--seed", type=int, default=0, help="random seed for --samples (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maco.space import prune, schedules as space
    from maco.core.target import Target

    target = Target.named(args.target)
    config = prune.PruneConfig(tolerance=args.tolerance)
    layers = resolve_layers(args.layer, args.batch)
    rows = []
    for name, spec in layers:
        full = space.space_size(spec, target)
        kept = space.space_size(spec, target, pruned=True, config=config)
        note = "; ".join(space.prune_plan(spec, target, config).notes)
        rows.append((name, str(spec), full, kept, full / kept, note))
    print_table(f"schedule space on {target.name} ({target.kind} sketch), batch {args.batch}",
                ["layer", "spec", "unpruned", "pruned", "ratio", "relaxed"], rows)
    for name, spec in layers if args.samples else []:
        for s in space.sample_many(spec, target, args.samples, args.seed, pruned=True, config=config):
            print(json.dumps({"layer": name, "spec": spec.to_dict(), "schedule": s.to_dict()}, sort_keys=True))
    return 0
