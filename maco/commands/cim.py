"""`maco cim`: a network's convs on a ReRAM compute-in-memory chip: weight updates of the chip
compiler's template, of MACO's bound-derived schedule, and the lower bound, with DMA and buffer use."""
from __future__ import annotations

import argparse
import json

from maco.commands.common import NETWORKS_TEXT, positive_int, print_table, resolve_layers
from maco.core.files import check_writable, write_atomic
from maco.core.target import CIM_FIELDS, CimArch, Target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cim", help="weight updates of a network on a compute-in-memory (ReRAM crossbar) chip",
        description="Schedule every conv layer on a weight-rewritable ReRAM compute-in-memory chip "
        "(default: 4 cores x 9 crossbars of 64x64 2-bit cells, 8-bit weights) and count, per layer, "
        "the crossbar cells the chip compiler's default template writes, those MACO's bound-derived "
        "schedule writes (no search), the lower bound on any schedule, the input DMA transactions "
        "and the buffers' peaks. Counts are exact (a closed form checked against a functional "
        "simulator).")
    p.add_argument("model", help=f"{NETWORKS_TEXT}, a layer spec such "
                   "as n1_c128_h28_w28_k256_r3_p1, or path/to/file.py:ClassName")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    defaults = CimArch()
    for name in CIM_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None, dest=name,
                       help=f"chip size (default {getattr(defaults, name)})")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maco.kernels.cim_report import analyse, total_reduction

    sizes = {name: getattr(args, name) for name in CIM_FIELDS if getattr(args, name) is not None}
    target = Target.cim(**sizes)
    if args.json:
        check_writable(args.json, "--json")
    rows = analyse(resolve_layers(args.model, args.batch, every=True), target)
    arch = target.cim_arch
    print_table(
        f"{args.model} on a CIM tile of {arch.cores} cores x {arch.crossbars} crossbars "
        f"{arch.rows}x{arch.columns} ({arch.rows}x{arch.weight_columns} weights), input buffer "
        f"{arch.input_buffer} B, psum buffer {arch.psum_buffer} B per core: crossbar cells written",
        ["layer", "template", "MACO", "bound", "MACO/bound", "saved", "DMA txn template", "DMA txn MACO",
         "crossbars", "input B", "psums"],
        [(r.layer, f"{r.template_cells:,}", f"{r.maco_cells:,}", f"{r.bound_cells:,}", f"{r.over_bound:.2f}",
          f"{r.reduction:.1%}", f"{r.template_transactions:,}", f"{r.maco_transactions:,}", r.crossbars,
          r.input_bytes, r.psums) for r in rows])
    total = sum(r.maco_cells for r in rows)
    print(f"total: template {sum(r.template_cells for r in rows):,} cells, MACO {total:,} "
          f"({total_reduction(rows):.1%} fewer), lower bound {sum(r.bound_cells for r in rows):,}; "
          f"MACO / bound {max(r.over_bound for r in rows):.2f} on its worst layer")
    if args.json:
        write_atomic(args.json, json.dumps({"target": target.to_dict(),
                                            "layers": [r.to_dict() for r in rows]}, indent=1))
        print(f"wrote {args.json}")
    return 0
