"""Which tuned kernels run in the model: each best record re-timed beside torch in this process,
as the model will run it, and kept only where it still wins."""
from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from maco.kernels.baselines import torch_conv
from maco.kernels.linear import MAX_BATCH
from maco.layouts.maco_modules import MacoConv2d, MacoLinear, call_sites, escapes, swap_module
from maco.records import Record
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import Target
from maco.timing import interleaved_rounds, steady_allocator

MIN_GAIN = 1.02  # a MACO kernel replaces torch's conv only when this much faster in process
Chosen = dict[ConvSpec, dict[str, Schedule]]  # spec -> layout -> schedule
Ratios = dict[ConvSpec, dict[str, float]]  # spec -> layout -> torch's time over MACO's
LinearRatios = dict[str, float]  # module path -> torch's time over MACO's


def faster_kernels(torch_seconds: dict[tuple[ConvSpec, str], float],
                   best: Mapping[tuple[ConvSpec, str], Record | Schedule],
                   target: Target) -> tuple[dict[tuple[ConvSpec, str], float], Chosen, Ratios]:
    """Per (spec, layout) of torch_seconds: the latency table for the planner (the faster of
    torch and MACO's best record or candidate schedule), the MACO schedules to run (spec ->
    layout -> schedule) and their in-process ratios. On a CPU every candidate is re-timed beside
    torch in this process and chosen when it wins by MIN_GAIN; its table entry is torch's time
    over that ratio, so both entries share this process's clock (records taken in a slower or
    faster spell of the machine would otherwise be compared with torch timed now). On a GPU the
    records are trusted as they are (a bare schedule, untimed, is not chosen there)."""
    table = dict(torch_seconds)
    cpu = target.kind == "cpu"
    candidates: Chosen = {}
    for (spec, layout), torch_s in torch_seconds.items():
        rec = best.get((spec, layout))
        if isinstance(rec, Schedule) and cpu:
            candidates.setdefault(spec, {})[layout] = rec
        elif isinstance(rec, Record) and (cpu or rec.seconds < torch_s):
            candidates.setdefault(spec, {})[layout] = rec.schedule
    ratios = confirm_in_process(candidates, target) if cpu else {}
    chosen: Chosen = {}
    for spec, by_layout in candidates.items():
        for layout, schedule in by_layout.items():
            ratio = ratios.get(spec, {}).get(layout, math.inf)
            if ratio >= MIN_GAIN:
                chosen.setdefault(spec, {})[layout] = schedule
                table[(spec, layout)] = (torch_seconds[(spec, layout)] / ratio if cpu
                                         else best[(spec, layout)].seconds)
    return table, chosen, ratios


def confirm_in_process(chosen: Chosen, target: Target, rounds: int = 3) -> Ratios:
    """torch's time over MACO's for each chosen kernel, timed here as the model runs it (output
    allocated per call, heap allocator, torch's conv in the same layout), in interleaved rounds.
    The tuner's worker times kernels on a preallocated output in another process; this is the
    check that the gain survives where the kernel will actually run."""
    steady_allocator()
    ratios: Ratios = {}
    gen = torch.Generator().manual_seed(0)
    for spec, by_layout in chosen.items():
        conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                         spec.groups, bias=False).eval()
        for layout, schedule in by_layout.items():
            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
            x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=fmt)
            maco = MacoConv2d(conv, spec, schedule, target)
            runs = {"torch": torch_conv(spec, x, conv.weight.detach(), layout), "maco": lambda: maco(x)}
            with torch.inference_mode():
                for fn in runs.values():
                    fn()
                timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=5e-3, warmup=2)
            # the fastest repeat of each: the least disturbed by anything else running
            ratios.setdefault(spec, {})[layout] = statistics.median(
                t.min / m.min for t, m in zip(timed["torch"], timed["maco"]))
    return ratios


def faster_linears(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> LinearRatios:
    """Swap (in place) each Linear of `gm` that a generated kernel (kernels.linear) runs at least
    MIN_GAIN faster than torch's, both timed here on the input the layer sees in the model, in
    interleaved rounds; returns module path -> torch's time over MACO's for every linear tried."""
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    seen: dict[str, tuple[nn.Linear, torch.Tensor]] = {}

    def keep(path: str) -> Callable[[nn.Module, tuple], None]:
        def hook(mod: nn.Module, args: tuple) -> None:
            seen.setdefault(path, (mod, args[0].detach().clone()))
        return hook

    calls = call_sites(gm)
    hooks = [gm.get_submodule(path).register_forward_pre_hook(keep(path)) for path in calls
             if isinstance(gm.get_submodule(path), nn.Linear)]
    try:
        with torch.inference_mode():
            gm(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    steady_allocator()
    ratios: LinearRatios = {}
    for path, (linear, x) in seen.items():
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] > MAX_BATCH:
            continue
        maco = MacoLinear(linear, x.shape[0], target)
        runs = {"torch": lambda linear=linear, x=x: linear(x), "maco": lambda maco=maco, x=x: maco(x)}
        with torch.inference_mode():
            for fn in runs.values():
                fn()
            timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=5e-3, warmup=2)
        ratios[path] = statistics.median(t.min / m.min for t, m in zip(timed["torch"], timed["maco"]))
        if ratios[path] >= MIN_GAIN:
            sites = calls[path]
            swap_module(gm, path, MacoLinear(linear, x.shape[0], target,
                                             preallocate=len(sites) == 1 and not escapes(gm, sites[0])))
    return ratios
