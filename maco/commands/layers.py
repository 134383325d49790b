"""`maco layers`: the conv layers of a network (or one layer spec), with shapes and FLOPs."""
from __future__ import annotations

import argparse

from maco.commands.common import NETWORKS_TEXT, positive_int, print_table, resolve_layers


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layers", help="list the distinct conv layers of a network",
                       description="List the distinct conv layers of a built-in network "
                       f"({NETWORKS_TEXT}) or parse one layer spec.")
    p.add_argument("network", help="network name or layer spec, e.g. resnet18 or n1_c64_h56_w56_k64_r3_p1")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    layers = resolve_layers(args.network, args.batch)
    print_table(f"{args.network}: {len(layers)} distinct conv layers",
                ["layer", "spec", "out", "GFLOP"],
                [(name, str(spec), f"{spec.k}x{spec.out_h}x{spec.out_w}", spec.flops / 1e9)
                 for name, spec in layers])
    return 0
