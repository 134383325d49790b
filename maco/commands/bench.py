"""`maco bench`: compile MACO's CPU kernel for a layer (default schedule or a saved one), check it
against torch, and time it beside torch's conv2d in NCHW and channels_last, interleaved."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from maco.commands.common import positive_int, print_table, resolve_layers
from maco.core.files import load_json_file
from maco.core.schedule import Schedule
from maco.core.target import require_memory

if TYPE_CHECKING:
    from maco.tune.benchmark import BenchRow


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="time MACO's CPU kernel against torch conv2d (NCHW and channels_last)",
        description="Compile the CPU kernel of each layer (the default MACO-tiled schedule unless "
        "--schedule), check it against torch, then time it and torch's conv2d in both layouts in "
        "interleaved rounds on this machine, beside the FMA-peak loop doing the same flops. GFLOP/s, "
        "fraction of that peak (median of per-round ratios), and the "
        "speedup over torch's faster layout.")
    p.add_argument("layer", help="a network (resnet18, alexnet, vgg11, ...) or a layer spec "
                   "such as n1_c64_h56_w56_k64_r3_p1")
    p.add_argument("--schedule", help="JSON file of a Schedule (as Schedule.to_json writes it)")
    p.add_argument("--layout", choices=("NCHW", "NHWC"), default="NCHW",
                   help="layout of the default schedule (default NCHW; --schedule carries its own)")
    p.add_argument("--repeats", type=positive_int, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from maco import kernels
    from maco.tune.benchmark import bench_layer

    target = kernels.host_target()
    layers = resolve_layers(args.layer, args.batch)
    fixed = None
    if args.schedule:
        fixed = Schedule.from_dict(load_json_file(args.schedule, "schedule file"))
    for name, spec in layers:
        require_memory(spec.working_bytes, f"benchmarking {name}" + (f" ({spec})" if name != str(spec) else ""))
    rows = []
    for name, spec in layers:
        schedule = fixed or kernels.default_schedule(spec, target, args.layout)
        r = bench_layer(name, spec, {"maco": schedule}, target, repeats=args.repeats, ceilings=True)
        if r.peak_note("maco"):  # once more: a busy spell may have passed (a second or so per layer)
            r = bench_layer(name, spec, {"maco": schedule}, target, repeats=args.repeats, ceilings=True)
        rows.append(table_row(r, schedule.layout))
    print_table(f"MACO CPU kernels on {target.model} ({target.isa}, {target.cores} threads; "
                "the FMA peak timed in the same rounds)",
                ["layer", "layout", "MACO GFLOP/s", "of peak", "peak GFLOP/s", "torch NCHW", "torch NHWC",
                 "speedup", "max err"], rows)
    return 0


def table_row(r: BenchRow, layout: str) -> tuple:
    """A layer's row of the table; "of peak" carries a note where the figure is impossible or the
    FMA loop timed in the same rounds says the machine was busy (BenchRow.peak_note)."""
    return (r.name, layout, r.gflops("maco"), f"{r.speedup('maco', over=('FMA peak',)):.0%}{r.peak_note('maco')}",
            r.gflops("FMA peak"), r.gflops("torch NCHW"), r.gflops("torch NHWC"), f"{r.speedup('maco'):.2f}x",
            f"{r.error:.1e}")
