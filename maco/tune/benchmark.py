"""MACO kernels timed beside torch in this process: each candidate checked against torch's output
first, then all of them (and, if asked, the FMA-peak loop on the same flops) in interleaved
rounds, so that ratios between candidates survive the machine's spells."""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from maco import kernels
from maco.core.errors import MacoError
from maco.kernels.baselines import torch_conv
from maco.kernels.cpu_codegen import ISA
from maco.kernels.cpu_peak import flops_runner, peak_share_note, spread
from maco.kernels.winograd import TILE_SIZES, WinogradKernel, WinogradPlan, winograd_can_run
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import interleaved_rounds, steady_allocator

CHECK_RTOL = 1e-4


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

    def peak_note(self, which: str) -> str:
        """What to print beside `which`'s fraction of the FMA peak (bench_layer with ceilings):
        "" where it can stand bare, else why not (kernels.cpu_peak.peak_share_note: over 100% of
        the peak, or the FMA loop's times spread over the rounds by more than BUSY_SPREAD)."""
        fma = self.rounds["FMA peak"]
        return peak_share_note(self.speedup(which, over=("FMA peak",)), spread(fma) if len(fma) > 1 else None,
                               spread_of="the FMA loop's rounds")


def bench_layer(name: str, spec: ConvSpec, schedules: dict[str, Schedule], target: Target,
                repeats: int = 5, min_run_time: float = 0.02, ceilings: bool = False,
                winograd: bool = False) -> BenchRow:
    """Time each MACO schedule and torch (NCHW, NHWC) in `repeats` interleaved rounds; every
    kernel is checked against torch first (MacoError when it is wrong). `ceilings` adds the
    layer's flops done by the FMA-peak loop ("FMA peak") and the register-tile mix ("microkernel
    ceiling", ISAs with intrinsics) to each round: `speedup(label, over=("FMA peak",))` is then
    the label's fraction of the peak in the same spell of the machine. `winograd` adds the
    Winograd kernel in each of its tile sizes ("winograd F2", "winograd F4", NHWC) where it
    computes the spec."""
    import torch

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
    for m in TILE_SIZES.get(spec.kh, ()) if winograd and winograd_can_run(spec, target.simd_width) else ():
        plan = WinogradPlan(spec, bias=False, threads=target.cores, lanes=target.simd_width, m=m)
        run = WinogradKernel(plan, target)
        xl, u = x.contiguous(memory_format=torch.channels_last), plan.pack_weight(w.numpy())
        out = torch.empty_like(ref, memory_format=torch.channels_last)
        fns[f"winograd F{m}"] = functools.partial(run, xl, u, None, None, out)
        fns[f"winograd F{m}"]()
        err = float((out - ref).abs().max()) / scale
        if not err <= CHECK_RTOL:
            raise MacoError(f"{name}: the Winograd F({m}x{m}) kernel is wrong: max error {err:.3g} of the "
                            "output's magnitude")
        error = max(error, err)
    fns["torch NCHW"] = torch_conv(spec, x, w, "NCHW")
    fns["torch NHWC"] = torch_conv(spec, x, w, "NHWC")
    if ceilings:
        for label, kind in (("FMA peak", "fma"), ("microkernel ceiling", "microkernel")):
            if kind == "fma" or target.isa in ISA:
                fns[label] = functools.partial(flops_runner(target, kind), spec.flops)
    rounds = interleaved_rounds(fns, repeats, min_run_time=min_run_time, warmup=2)
    return BenchRow(name, spec, {label: [t.median for t in ts] for label, ts in rounds.items()}, error)
