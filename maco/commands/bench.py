"""`maco bench`: compile MACO's CPU kernel for a layer (default schedule or a saved one), check it
against torch, and time it beside torch's conv2d in NCHW and channels_last, interleaved."""
from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from maco.commands.common import positive_int, print_table, resolve_layers
from maco.errors import MacoError
from maco.files import load_json_file
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import Target, require_memory

CHECK_RTOL = 1e-4


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


@dataclass
class BenchRow:
    name: str
    spec: ConvSpec
    rounds: dict[str, list[float]]  # candidate name -> seconds per call in each interleaved round
    error: float  # max |maco - torch| / max |torch| over the MACO candidates

    @property
    def seconds(self) -> dict[str, float]:
        """Median seconds per call of each candidate."""
        return {k: statistics.median(v) for k, v in self.rounds.items()}

    def gflops(self, which: str) -> float:
        return self.spec.flops / statistics.median(self.rounds[which]) / 1e9

    def speedup(self, which: str, over: tuple[str, ...] = ("torch NCHW", "torch NHWC")) -> float:
        """Median over rounds of (fastest of `over` in that round) / `which` in that round. The VM
        switches between faster and slower spells lasting seconds; neighbours in one round share
        the spell, so this ratio spreads far less than a ratio of medians."""
        return statistics.median(min(self.rounds[o][i] for o in over) / t
                                 for i, t in enumerate(self.rounds[which]))


def torch_conv(spec: ConvSpec, x: Any, w: Any, layout: str) -> Callable[[], Any]:
    """torch's conv2d in one layout, its input and weight converted once."""
    import torch

    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    xl, wl = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)

    def fn() -> Any:
        with torch.no_grad():
            return torch.nn.functional.conv2d(xl, wl, None, spec.stride, spec.padding, spec.dilation,
                                              spec.groups)
    return fn


def bench_layer(name: str, spec: ConvSpec, schedules: dict[str, Schedule], target: Target,
                repeats: int = 5, min_run_time: float = 0.02, ceilings: bool = False) -> BenchRow:
    """Time each MACO schedule and torch (NCHW, NHWC) in `repeats` interleaved rounds; every
    kernel is checked against torch first (MacoError when it is wrong). `ceilings` adds the
    layer's flops done by the FMA-peak loop ("FMA peak") and the register-tile mix ("microkernel
    ceiling", ISAs with intrinsics) to each round: `speedup(label, over=("FMA peak",))` is then
    the label's fraction of the peak in the same spell of the machine."""
    import torch

    from maco import kernels
    from maco.layouts.latency import steady_allocator
    from maco.timing import time_callable

    torch.set_num_threads(target.cores)
    steady_allocator()  # torch allocates its output per call: from the heap, as the tuner's worker
    g = torch.Generator().manual_seed(0)
    x = torch.randn(spec.input_shape, generator=g)
    w = torch.randn(spec.weight_shape, generator=g)
    ref = torch_conv(spec, x, w, "NCHW")()
    scale = max(float(ref.abs().max()), 1e-30)
    fns: dict[str, Callable[[], Any]] = {}
    error = 0.0
    built = kernels.build_many(spec, list(schedules.values()), target)
    for (label, schedule), kernel in zip(schedules.items(), built):
        if isinstance(kernel, Exception):
            raise kernel
        fmt = torch.channels_last if schedule.layout == "NHWC" else torch.contiguous_format
        out = torch.empty_like(ref, memory_format=fmt)
        fn = kernel.bind(w).prepare(x.contiguous(memory_format=fmt), None, out)
        fn()
        err = float((out - ref).abs().max()) / scale
        if not err <= CHECK_RTOL:
            raise MacoError(f"{name}: the MACO kernel ({label}) is wrong: max error {err:.3g} of the "
                            f"output's magnitude (limit {CHECK_RTOL:g})")
        error = max(error, err)
        fns[label] = fn
    fns["torch NCHW"] = torch_conv(spec, x, w, "NCHW")
    fns["torch NHWC"] = torch_conv(spec, x, w, "NHWC")
    if ceilings:
        from maco.kernels.cpu_codegen import ISA
        from maco.kernels.cpu_peak import flops_runner

        for label, kind in (("FMA peak", "fma"), ("microkernel ceiling", "microkernel")):
            if kind == "fma" or target.isa in ISA:
                fns[label] = functools.partial(flops_runner(target, kind), spec.flops)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max(1, repeats)):
        for label, fn in fns.items():
            t = time_callable(fn, repeats=1, min_run_time=min_run_time, warmup=2)
            samples[label].append(t.median)
    return BenchRow(name, spec, samples, error)


def run(args: argparse.Namespace) -> int:
    from maco import kernels

    target = Target.host()
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
        rows.append((name, schedule.layout, r.gflops("maco"), f"{r.speedup('maco', over=('FMA peak',)):.0%}",
                     r.gflops("FMA peak"), r.gflops("torch NCHW"), r.gflops("torch NHWC"),
                     f"{r.speedup('maco'):.2f}x", f"{r.error:.1e}"))
    print_table(f"MACO CPU kernels on {target.model} ({target.isa}, {target.cores} threads; "
                "the FMA peak timed in the same rounds)",
                ["layer", "layout", "MACO GFLOP/s", "of peak", "peak GFLOP/s", "torch NCHW", "torch NHWC",
                 "speedup", "max err"], rows)
    return 0
