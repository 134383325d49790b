"""Which tuned kernels run in the model: each best record re-timed beside torch in this process,
as the model will run it, and kept only where it still wins."""
from __future__ import annotations

import copy
import functools
import math
import statistics
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from maco import kernels
from maco.core.errors import MacoError
from maco.bounds.winograd import layer_reach, predict_tile, ranked
from maco.kernels.baselines import torch_conv
from maco.kernels.cache_flush import Flush
from maco.kernels.cpu_peak import best_prices, winograd_ceilings
from maco.kernels.cpu_codegen import ISA, intrinsics_isa
from maco.kernels.depthwise import is_depthwise
from maco.kernels.inverted_residual import SPLITS
from maco.kernels.linear import MAX_BATCH
from maco.kernels.pool import plan_for
from maco.kernels.winograd import TILE_SIZES
from maco.layouts.maco_modules import (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual, MacoLinear,
                                       MacoLinearAsConv, MacoPool2d, MacoSqueezeExcite, MacoWinograd2d, call_sites,
                                       depthwise_can_run, escapes, fold_input_conversion, input_conversion,
                                       swap_module, use_maco_kernels, winograd_module_can_run)
from maco.layouts.blocks import find_blocks, find_squeeze_excites, use_block, use_squeeze_excite
from maco.layouts.deploy import plan
from maco.layouts.end_to_end import time_models
from maco.layouts.fusion import adds_residual, fuse
from maco.layouts.layout_plan import LayoutPlan
from maco.layouts.segments import find_runs, use_segments
from maco.layouts.networks import conv_layers, distinct_convs
from maco.tune.records import Record
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import interleaved_rounds, steady_allocator

MIN_GAIN = 1.02  # a MACO kernel replaces torch's conv only when this much faster in process
OUTPUT_RTOL = 1e-4  # a model is taken only if its output equals the original's to this
# rounds of an end-to-end check that keeps or drops a whole set of kernels (the median of their
# ratios): with 3, one `maco optimize` run dropped all of MobileNetV2's block kernels, which had won
# alone and passed the same check (1.20x and 1.23x) when it was run again
END_TO_END_ROUNDS = 7
DOUBT = 1.2  # a conv the model prices this much faster in Winograd than direct: a timed loss is timed again,
RETIME = 3  # over this many times the rounds
# ratios this near MIN_GAIN are timed 3x as long in all: at 3 rounds a kernel measured 1.10x and 1.03x in
# two calls a second apart, and 1.01x in optimize (torch kept there); MobileNetV2's late blocks gain
# 2-6% as one kernel, and one busy run kept 12 of its 17
CLOSE = (0.95, 1.1)
Chosen = dict[ConvSpec, dict[str, Schedule]]  # spec -> layout -> schedule
Ratios = dict[ConvSpec, dict[str, float]]  # spec -> layout -> torch's time over MACO's
ModuleRatios = dict[str, float]  # module path -> torch's time over MACO's
POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def faster_kernels(torch_seconds: dict[tuple[ConvSpec, str], float],
                   best: Mapping[tuple[ConvSpec, str], Record | Schedule],
                   target: Target) -> tuple[dict[tuple[ConvSpec, str], float], Chosen, Ratios]:
    """Per (spec, layout) of torch_seconds: the latency table for the planner (the faster of
    torch and MACO's best record or candidate schedule), the MACO schedules to run (spec ->
    layout -> schedule) and their in-process ratios. Every candidate is re-timed beside torch in
    this process (on a CPU as the model calls it, on a GPU its kernel time: confirm_on_gpu) and
    chosen when it wins by MIN_GAIN; its table entry is torch's time over that ratio, so both
    entries share this process's clock (records taken in a slower or faster spell of the
    machine would otherwise be compared with torch timed now)."""
    table = dict(torch_seconds)
    candidates: Chosen = {}
    for (spec, layout), torch_s in torch_seconds.items():
        rec = best.get((spec, layout))
        if rec is not None:
            candidates.setdefault(spec, {})[layout] = rec.schedule if isinstance(rec, Record) else rec
    ratios = confirm_in_process(candidates, target) if target.kind == "cpu" else confirm_on_gpu(candidates, target)
    chosen: Chosen = {}
    for spec, by_layout in candidates.items():
        for layout, schedule in by_layout.items():
            ratio = ratios.get(spec, {}).get(layout, 0.0)
            if ratio >= MIN_GAIN:
                chosen.setdefault(spec, {})[layout] = schedule
                table[(spec, layout)] = torch_seconds[(spec, layout)] / ratio
    return table, chosen, ratios


def confirm_on_gpu(chosen: Chosen, target: Target, rounds: int = 3) -> Ratios:
    """cuDNN's kernel time (strict fp32, its best algorithm) over MACO's for each candidate,
    timed here with CUDA events in interleaved rounds: the time a CUDA-graphed model pays per
    conv (a call's Python is replayed away: layouts.cuda_graph)."""
    from maco.tune.gpu_measure import CudnnConv, GpuTimer

    timer, ratios = GpuTimer(), {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for spec, by_layout in chosen.items():
        x = torch.randn(spec.input_shape, device="cuda", generator=gen)
        w = torch.randn(spec.weight_shape, device="cuda", generator=gen)
        for layout, schedule in by_layout.items():
            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
            conv = kernels.compile(spec, schedule, target).bind(w)
            runs = {"torch": CudnnConv(spec, layout, True).prepare(x, w),
                    "maco": conv.prepare(x.contiguous(memory_format=fmt), out=conv.output())}
            per: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(rounds):
                for k, fn in runs.items():
                    per[k].append(timer.time(fn, repeats=5).median)
            ratios.setdefault(spec, {})[layout] = statistics.median(t / m for t, m in zip(per["torch"], per["maco"]))
    return ratios


def confirm_in_process(chosen: Chosen, target: Target, rounds: int = 3) -> Ratios:
    """torch's time over MACO's for each chosen kernel, timed here as the model runs it (output
    allocated per call, heap allocator, torch's conv in the same layout), in interleaved rounds.
    The tuner's worker times kernels on a preallocated output in another process; this is the
    check that the gain survives where the kernel will actually run. A ratio within CLOSE is timed
    for twice as many rounds again and judged on all of them."""
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
                per_round = _judged_ratios(runs, rounds)["maco"]
            ratios.setdefault(spec, {})[layout] = statistics.median(per_round)
    return ratios


def with_winograd(table: dict[tuple[ConvSpec, str], float], torch_seconds: dict[tuple[ConvSpec, str], float],
                  target: Target, rounds: int = 3) -> tuple[dict[tuple[ConvSpec, str], float], dict[ConvSpec, float]]:
    """The planner's latency table with the Winograd kernel's time in NHWC (its faster tile size)
    wherever it beats the entry there (torch's or a MACO kernel's), and torch's time over
    Winograd's per conv tried.
    Winograd runs only NHWC convs, and is swapped in after planning (faster_winograd): a plan
    made without it would keep such a conv in NCHW wherever torch's NCHW conv is the faster."""
    def make(conv: nn.Conv2d, spec: ConvSpec, layout: str) -> list[nn.Module]:
        if layout != "NHWC" or not winograd_module_can_run(conv, spec, target):
            return []
        return [MacoWinograd2d(conv, spec, target, m=m) for m in TILE_SIZES[spec.kh]]
    table, ratios = _with_generated(table, torch_seconds, target, make, rounds)
    return table, {spec: ratio for (spec, _), ratio in ratios.items()}


def with_depthwise(table: dict[tuple[ConvSpec, str], float], torch_seconds: dict[tuple[ConvSpec, str], float],
                   target: Target, rounds: int = 3) -> dict[tuple[ConvSpec, str], float]:
    """The planner's latency table with the depthwise kernel's time (kernels.depthwise) in each
    layout wherever it beats the entry there. It is swapped in after planning (faster_depthwise):
    a plan made without it kept ConvNeXt-Tiny's first depthwise conv of its last stage in NCHW,
    where torch's depthwise conv is the faster, run by torch in 69 us against the kernel's 20 in
    NHWC, and the conv before it in NCHW with it."""
    def make(conv: nn.Conv2d, spec: ConvSpec, layout: str) -> list[nn.Module]:
        return [MacoDepthwise2d(conv, spec, layout, target)] if depthwise_can_run(conv, spec) else []
    return _with_generated(table, torch_seconds, target, make, rounds)[0]


def _with_generated(table: dict[tuple[ConvSpec, str], float], torch_seconds: dict[tuple[ConvSpec, str], float],
                    target: Target, make: Callable[[nn.Conv2d, ConvSpec, str], list[nn.Module]],
                    rounds: int) -> tuple[dict[tuple[ConvSpec, str], float], dict[tuple[ConvSpec, str], float]]:
    """`table` with the fastest of the modules `make` builds for each (conv, layout) of
    `torch_seconds` where it beats the entry there, each timed beside torch's conv with both
    modules' weights and the input dropped from the caches (as in a model whose weights outgrow
    them); and torch's time over the best module's per (conv, layout) tried."""
    table, ratios = dict(table), {}
    if target.kind != "cpu":
        return table, ratios
    steady_allocator()
    gen = torch.Generator().manual_seed(0)
    for (spec, layout), torch_s in torch_seconds.items():
        conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                         spec.groups, bias=False).eval()
        modules = make(conv, spec, layout)
        if not modules:
            continue
        x = torch.randn(spec.input_shape, generator=gen)
        x = x.contiguous(memory_format=torch.channels_last) if layout == "NHWC" else x
        for module in modules:
            runs = {"torch": torch_conv(spec, x, conv.weight.detach(), layout), "maco": lambda module=module: module(x)}
            with torch.inference_mode():
                for fn in runs.values():
                    fn()
                ratios[(spec, layout)] = max(ratios.get((spec, layout), 0.0),
                                             statistics.median(_round_ratios(runs, rounds, Flush(*runs.values()))))
        if ratios[(spec, layout)] >= MIN_GAIN:
            table[(spec, layout)] = min(table[(spec, layout)], torch_s / ratios[(spec, layout)])
    return table, ratios


def _round_ratios(runs: dict[str, Callable[[], Any]], rounds: int,
                  before: Callable[[], Any] | None = None) -> list[float]:
    """torch's time over MACO's per interleaved round (runs "torch" and "maco", _split_ratios)."""
    return _split_ratios(runs, rounds, before)["maco"]


def _split_ratios(runs: dict[str, Callable[[], Any]], rounds: int,
                  before: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Per interleaved round, "torch"'s time over each other run's, each from the fastest repeat of
    each (the least disturbed by anything else running); `before` runs before each timed call."""
    timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=5e-3, warmup=2, before=before)
    return {name: [t.min / m.min for t, m in zip(timed["torch"], timed[name])] for name in runs if name != "torch"}


def _judged_ratios(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """_split_ratios over `rounds`; where the best run's median lies within CLOSE (a close call),
    twice as many rounds more, every run judged on all of them."""
    per_round = _split_ratios(runs, rounds)
    if CLOSE[0] < max(statistics.median(r) for r in per_round.values()) < CLOSE[1]:
        for name, more in _split_ratios(runs, 2 * rounds).items():
            per_round[name] += more
    return per_round


def faster_linears(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> ModuleRatios:
    """Swap (in place) each Linear of `gm` that a generated kernel runs at least MIN_GAIN faster
    than torch's: kernels.linear on (batch, features) inputs, a 1x1 NHWC conv kernel on
    (N, H, W, C) ones (MacoLinearAsConv), or ties it where that puts it inside a run of kernels
    (_ties_inside_runs); returns module path -> torch's time over MACO's for each tried."""
    def make(linear: nn.Module, x: torch.Tensor, preallocate: bool) -> nn.Module | None:
        if x.dtype != torch.float32:
            return None
        if x.dim() == 4 and x.is_contiguous() and target.kind == "cpu":
            return MacoLinearAsConv(linear, tuple(x.shape), target, preallocate=preallocate)
        if x.dim() != 2 or x.shape[0] > MAX_BATCH or adds_residual(linear):
            return None
        return MacoLinear(linear, x.shape[0], target, preallocate=preallocate)
    ratios = _faster_modules(gm, example_input, (nn.Linear,), make, rounds)
    _ties_inside_runs(gm, example_input, target, ratios, make)
    return ratios


def _ties_inside_runs(gm: fx.GraphModule, example_input: Any, target: Target, ratios: ModuleRatios,
                      make: Callable[[nn.Module, torch.Tensor, bool], nn.Module | None]) -> None:
    """Swap (in place) each module that tied torch's alone (within MIN_GAIN either way) where its
    kernel then joins a run of kernels (layouts.segments.find_runs): the run's one C call takes it
    too, and the model no longer calls torch right after a long C call, which costs more than the
    op itself (torch's dispatch is back in the caches only after its first call)."""
    if MIN_GAIN <= 1:  # every kernel as fast as torch's was taken already
        return
    ties = [path for path, r in ratios.items() if 1 / MIN_GAIN <= r < MIN_GAIN]
    if not ties:
        return
    seen = arguments_seen(gm, example_input, ties, copy=False)
    calls = call_sites(gm)
    for path in ties:
        module, sites = gm.get_submodule(path), calls[path]
        maco = make(module, seen[path][0], len(sites) == 1 and not escapes(gm, sites[0]))
        if maco is None:
            continue
        swap_module(gm, path, maco)
        if not any(node in run for run in find_runs(gm, target) for node in sites):
            swap_module(gm, path, module)


def faster_pools(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> ModuleRatios:
    """Swap (in place) each pooling module of `gm` that a generated kernel (kernels.pool) runs at
    least MIN_GAIN faster than torch's (or ties it inside a run of kernels: _ties_inside_runs),
    in the memory format its input has in the model."""
    def make(pool: nn.Module, x: torch.Tensor, preallocate: bool) -> nn.Module | None:
        layout = _layout(x)
        if layout is None or x.dtype != torch.float32 or plan_for(pool, tuple(x.shape), layout, target.cores) is None:
            return None
        return MacoPool2d(pool, tuple(x.shape), layout, target, preallocate=preallocate)
    ratios = _faster_modules(gm, example_input, POOLS, make, rounds)
    _ties_inside_runs(gm, example_input, target, ratios, make)
    return ratios


def faster_depthwise(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> ModuleRatios:
    """Swap (in place) each depthwise conv of `gm` (run by torch or by a MacoConv2d) that a
    generated depthwise kernel (kernels.depthwise) runs at least MIN_GAIN faster (or as fast,
    inside a run of kernels: _ties_inside_runs), in the memory format its input has in the model."""
    def make(conv: nn.Module, x: torch.Tensor, preallocate: bool) -> nn.Module | None:
        found = _torch_conv_on(conv, x, ("NCHW", "NHWC"))
        if found is None or not depthwise_can_run(*found[:2]):
            return None
        return MacoDepthwise2d(*found, target, preallocate=preallocate)
    ratios = _faster_modules(gm, example_input, (nn.Conv2d, MacoConv2d), make, rounds)
    _ties_inside_runs(gm, example_input, target, ratios, make)
    return ratios


def faster_winograd(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3,
                    order: TileOrder | None = None) -> ModuleRatios:
    """Swap (in place) each 3x3 or 5x5 stride-1 conv of `gm` whose input is channels_last in the model
    (run by torch or by a MacoConv2d) for the Winograd kernel (kernels.winograd) where that runs
    at least MIN_GAIN faster than what runs it now, residual and all: each tile size in turn,
    against what runs the conv by then, the one the bound predicts fastest first (tile_order).
    Where the bound's model and timing disagree by DOUBT or more, timing gets RETIME times the
    rounds: a busy VM's spell can take all of a short measurement. A conv no tile size won whose
    best tile the model prices DOUBT times faster than a direct kernel is timed again (ResNet-18's
    last 512x7x7 conv stayed direct, 1.22x slower, in one run), and a tile size the model prices
    DOUBT times slower than the predicted one is timed that long in the first place (one of
    ResNet-50's 512x7x7 convs ran F(4x4), 989 us in the model against F(2x2)'s 547 on its twin).
    Returns path -> the time of what ran the conv at first over the time of what runs it now
    (below MIN_GAIN where no Winograd kernel won). `order`: a tile_order to share between calls
    (it prices the host once), else a new one."""
    tried: ModuleRatios = {}  # the best ratio timed
    won: ModuleRatios = {}  # the product of the ratios that won: the first module's time over the last's
    order = order or tile_order(target)
    types = (nn.Conv2d, MacoConv2d, MacoWinograd2d)

    def candidate(rank: int, doubted: bool, lost: bool = False) -> Callable[[nn.Module, torch.Tensor, bool],
                                                                            nn.Module | None]:
        """The rank-th tile size's kernel for a conv where the model doubts timing as `doubted` says
        (rank 0 is never doubted); with `lost`, only for a conv no tile size won (it runs no
        Winograd kernel) where the model prices the best tile DOUBT times faster than direct."""
        def make(conv: nn.Module, x: torch.Tensor, preallocate: bool) -> nn.Module | None:
            found = _torch_conv_on(conv, x, ("NHWC",))
            if found is None or not winograd_module_can_run(*found[:2], target):
                return None
            spec, sizes = found[1], order(found[1])
            if (rank >= len(sizes) or getattr(conv, "m", None) == sizes[rank]
                    or (rank > 0 and order.slowdown(spec, sizes[rank]) >= DOUBT) != doubted
                    or (lost and (isinstance(conv, MacoWinograd2d) or order.gain(spec) < DOUBT))):
                return None
            return MacoWinograd2d(*found[:2], target, preallocate=preallocate, m=sizes[rank])
        return make

    def timed(rank: int, n_rounds: int, doubted: bool = False, lost: bool = False) -> None:
        # cold: Winograd's U is 16/9 to 4x the weights, so which kernel wins inside a model whose weights
        # outgrow the caches shows only when each runs with its weights in memory
        for path, ratio in _faster_modules(gm, example_input, types, candidate(rank, doubted, lost), n_rounds,
                                           cold=True).items():
            tried[path] = max(tried.get(path, 0.0), ratio)
            if ratio >= MIN_GAIN:
                won[path] = won.get(path, 1.0) * ratio

    for rank in range(max(len(sizes) for sizes in TILE_SIZES.values())):
        timed(rank, rounds)
        if rank > 0:
            timed(rank, RETIME * rounds, doubted=True)
    if any(path not in won for path in tried):
        timed(0, RETIME * rounds, lost=True)
    return {path: won.get(path, best) for path, best in tried.items()}


class TileOrder:
    """conv -> its Winograd tile sizes, the one the bound predicts fastest on this host first
    (maco.bounds.winograd.predict_tile, priced with this host's best FMA peak and DRAM bandwidth
    and the tile sizes' shares of the peak timed at the first conv asked about; smallest first
    where the host cannot be priced). faster_winograd tries them in this order, so another tile
    size is kept only where timing shows it MIN_GAIN faster than the predicted one. Tried smallest
    first, timing alone kept F(2x2) on ties and noise: one run on a busy VM gave four identical
    56x56 convs of ResNet-18 F(4x4), F(4x4), F(2x2) and F(4x4)."""

    def __init__(self, target: Target):
        self.target = target
        self._prices: tuple[float, float, dict[tuple[int, int], float]] | None = None
        self._priced = False

    def prices(self) -> tuple[float, float, dict[tuple[int, int], float]] | None:
        """(peak, bandwidth, shares), or None where the host cannot be priced."""
        if not self._priced:
            try:
                self._prices = (*best_prices(self.target), winograd_ceilings(self.target, 3))
            except MacoError:  # e.g. no memory for the DRAM read probe: timing alone decides, as before
                self._prices = None
            self._priced = True
        return self._prices

    def __call__(self, spec: ConvSpec) -> tuple[int, ...]:
        times = self._modelled(spec)
        return tuple(TILE_SIZES[spec.kh]) if times is None else ranked(times)

    def slowdown(self, spec: ConvSpec, m: int) -> float:
        """Tile size m's modelled time over the fastest tile size's (1 where the host is unpriced)."""
        times = self._modelled(spec)
        return 1.0 if times is None else times[m] / min(times.values())

    def gain(self, spec: ConvSpec) -> float:
        """A direct kernel's modelled time over the best tile size's (maco.bounds.winograd.layer_reach:
        direct at the full peak, so a gain the model is sure of); 0 where the host is unpriced."""
        times = self._modelled(spec)
        if times is None:
            return 0.0
        peak, bandwidth, _ = self.prices()  # type: ignore[misc]  # priced: times is not None
        return layer_reach(spec, peak, bandwidth, tiles={})[1] / min(times.values())

    def _modelled(self, spec: ConvSpec) -> dict[int, float] | None:
        """{m: modelled seconds} of each tile size (predict_tile), None where the host is unpriced."""
        known = self.prices()
        return None if known is None else predict_tile(spec, *known, TILE_SIZES)[1]


def tile_order(target: Target) -> TileOrder:
    """The order faster_winograd tries a conv's tile sizes in on `target` (TileOrder)."""
    return TileOrder(target)


def faster_blocks(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> ModuleRatios:
    """Run (in place) each inverted residual of `gm` (layouts.blocks: whole, or its front half where
    squeeze-excitation follows) whose input is channels_last in the model as one generated kernel
    (MacoInvertedResidual) where that runs at least MIN_GAIN faster than the modules that run it
    now (their kernels as one segment, as in the model) on the input it gets there, its threads
    sharing the block's rows or its channels, whichever is faster (a gain within CLOSE timed over
    twice the rounds again and judged on all of them); and keep them only if the
    model with them runs MIN_GAIN faster end to end (both as segments) than without. Returns the
    path of each block's last conv -> the modules' time over the one kernel's (at most 1 where
    the model kept none), for each block tried."""
    if target.kind != "cpu":
        return {}
    blocks = find_blocks(gm)
    before = _graph_and_modules(gm)  # the model as it was, to undo the blocks (see the end)
    firsts = {b.paths[0] or b.paths[1]: b for b in blocks}
    seen = arguments_seen(gm, example_input, list(firsts))
    calls = call_sites(gm)
    steady_allocator()
    ratios: ModuleRatios = {}
    for first, block in firsts.items():
        x = seen.get(first, (None,))[0]
        if not isinstance(x, torch.Tensor) or _layout(x) != "NHWC" or x.dtype != torch.float32:
            continue
        mods = [None if p is None else gm.get_submodule(p) for p in block.paths]
        fused = {}  # split -> the one kernel that shares its work that way
        for split in SPLITS[1:]:
            try:
                fused[split] = MacoInvertedResidual(*mods, tuple(x.shape), target, split=split)
            except MacoError:
                pass
        if not fused:
            continue
        chain = block_chain(mods, next(iter(fused.values())).plan.residual, target)
        runs = {"torch": lambda chain=chain, x=x: chain(x), **{split: lambda f=f, x=x: f(x) for split, f in fused.items()}}
        with torch.inference_mode():
            for fn in runs.values():
                fn()
            per_round = _judged_ratios(runs, rounds)
        gains = {split: statistics.median(r) for split, r in per_round.items()}
        split = max(gains, key=gains.get)
        path = str(block.last.target)
        ratios[path] = gains[split]
        if ratios[path] >= MIN_GAIN:
            own = len(calls[path]) == 1 and not escapes(gm, block.last)
            use_block(gm, block, MacoInvertedResidual(*mods, tuple(x.shape), target, preallocate=own, split=split))
    if any(r >= MIN_GAIN for r in ratios.values()) and not _faster_end_to_end(gm, before, example_input, target):
        _restore(gm, before)  # each block won alone, the model with them did not
        ratios = {path: min(r, 1.0) for path, r in ratios.items()}
    return ratios


def faster_input_reads(gm: fx.GraphModule, example_input: Any, target: Target, rounds: int = 3) -> ModuleRatios:
    """Fold (in place) each conversion to NHWC that feeds one NHWC conv kernel alone into the conv,
    which then reads the NCHW tensor itself (maco_modules.fold_input_conversion), where that runs
    at least MIN_GAIN faster than the conversion and the conv: the model's input before its first
    conv. Returns conv path -> (conversion + conv) time over the folded conv's, for each tried.
    Run it after every other swap: the folded conv takes an NCHW input, which the Winograd,
    depthwise and block kernels do not."""
    if target.kind != "cpu":
        return {}
    calls = call_sites(gm)
    paths = [p for p in calls if input_conversion(gm, p, calls) is not None]
    seen = arguments_seen(gm, example_input, paths)
    steady_allocator()
    ratios: ModuleRatios = {}
    for path in paths:
        mod, (x, *rest) = gm.get_submodule(path), seen[path]
        source = x.contiguous()  # what the conversion reads: NCHW
        folded = MacoConv2d(mod.torch_conv, mod.spec, mod._kernel.schedule, target, input_layout="NCHW")
        runs = {"torch": lambda: mod(source.contiguous(memory_format=torch.channels_last), *rest),
                "maco": lambda: folded(source, *rest)}
        with torch.inference_mode():
            for fn in runs.values():
                fn()
            ratios[path] = statistics.median(_round_ratios(runs, rounds))
        if ratios[path] >= MIN_GAIN:
            fold_input_conversion(gm, path, target)
    return ratios


def faster_squeeze(gm: fx.GraphModule, example_input: Any, target: Target) -> int:
    """Run (in place) each squeeze-excitation of `gm` (layouts.blocks) whose pool reads its input
    as it is as one generated kernel (MacoSqueezeExcite), and keep them only if the model with them
    runs MIN_GAIN faster end to end (both as segments) than without. Returns how many it kept."""
    if target.kind != "cpu":
        return 0
    found = find_squeeze_excites(gm)
    before = _graph_and_modules(gm)
    seen = arguments_seen(gm, example_input, [str(se.calls[0].target) for se in found], copy=False)
    calls = call_sites(gm)
    kept = 0
    for se in found:
        x = seen.get(str(se.calls[0].target), (None,))[0]
        if (se.calls[0].args[0] is not se.source or not isinstance(x, torch.Tensor) or x.dtype != torch.float32
                or _layout(x) is None):
            continue
        mods = [gm.get_submodule(p) for p in se.paths]
        gate = str(se.calls[3].target)
        try:
            module = MacoSqueezeExcite(*mods, tuple(x.shape), _layout(x), target,
                                       preallocate=len(calls[gate]) == 1 and not escapes(gm, se.multiply))
        except MacoError:
            continue
        use_squeeze_excite(gm, se, module)
        kept += 1
    if kept and not _faster_end_to_end(gm, before, example_input, target):
        _restore(gm, before)
        kept = 0
    return kept


def _graph_and_modules(gm: fx.GraphModule) -> tuple[fx.Graph, dict[str, Any]]:
    """A copy of gm's graph, and what each of its module calls and attribute reads names."""
    named = {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr"):
            path = str(node.target)
            named[path] = functools.reduce(getattr, path.split("."), gm)
    return copy.deepcopy(gm.graph), named


def _faster_end_to_end(gm: fx.GraphModule, before: tuple[fx.Graph, dict[str, Any]], example_input: Any,
                       target: Target) -> bool:
    """Whether gm, as segments, is taken over the model `before` was, as segments (end_to_end_gain)."""
    models = []
    for graph, named in (before, _graph_and_modules(gm)):
        model = fx.GraphModule(named, copy.deepcopy(graph))
        use_segments(model, target)
        models.append(model)
    return end_to_end_gain(models[1], models[0], example_input)[1]


def end_to_end_gain(new: Callable[..., Any], old: Callable[..., Any], example_input: Any) -> tuple[float, bool]:
    """`new`'s speedup over `old` end to end (the same interleaved rounds), and whether it is taken:
    its output equals old's to OUTPUT_RTOL and it runs at least MIN_GAIN faster."""
    times = time_models({"old": old, "new": new}, example_input, rounds=END_TO_END_ROUNDS)
    gain = times.speedup("new", "old")
    return gain, times.max_rel_diff["new"] <= OUTPUT_RTOL and gain >= MIN_GAIN


def _restore(gm: fx.GraphModule, before: tuple[fx.Graph, dict[str, Any]]) -> None:
    graph, named = before
    for path, mod in named.items():
        if isinstance(mod, nn.Module) and gm.get_submodule(path) is not mod:
            swap_module(gm, path, mod)
    gm.graph = copy.deepcopy(graph)
    gm.recompile()


def block_chain(mods: list[nn.Module | None], residual: bool, target: Target) -> fx.GraphModule:
    """A block's modules (expand or None, depthwise, project or None) called in order as the model
    calls them, its kernels as one segment (layouts.segments): what they cost in the model, not
    three Python calls."""
    graph, root = fx.Graph(), nn.Module()
    x = h = graph.placeholder("x")
    for name, mod in zip(("expand", "depthwise", "project"), mods):
        if mod is not None:
            root.add_module(name, mod)
            h = graph.call_module(name, (h, x) if name == "project" and residual else (h,))
    graph.output(h)
    gm = fx.GraphModule(root, graph)
    use_segments(gm, target)
    return gm


def _torch_conv_on(conv: nn.Module, x: torch.Tensor,
                   layouts: tuple[str, ...]) -> tuple[nn.Conv2d, ConvSpec, str] | None:
    """The torch conv under `conv` (a MacoConv2d keeps the one it replaced), its spec on `x` and
    x's layout; None where x is not float32 in one of `layouts`."""
    layout = _layout(x)
    if layout not in layouts or x.dtype != torch.float32:
        return None
    conv = conv.torch_conv if isinstance(conv, (MacoConv2d, MacoWinograd2d)) else conv
    return conv, ConvSpec.from_module(conv, tuple(x.shape)), layout


def _layout(x: torch.Tensor) -> str | None:
    """The layout a 4-d tensor is stored in (NCHW when both apply), None when neither."""
    if x.dim() != 4:
        return None
    return "NCHW" if x.is_contiguous() else "NHWC" if x.is_contiguous(memory_format=torch.channels_last) else None


def arguments_seen(gm: fx.GraphModule, example_input: Any, paths: list[str],
                   copy: bool = True) -> dict[str, tuple[torch.Tensor, ...]]:
    """The arguments each module at `paths` gets at its first call in one run of `gm`: the input,
    and a fused conv's residual. Copies, unless `copy` is False (enough to read their shapes, and
    no second copy of every activation)."""
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    seen: dict[str, tuple[torch.Tensor, ...]] = {}

    def keep(path: str) -> Callable[[nn.Module, tuple], None]:
        def hook(mod: nn.Module, args: tuple) -> None:  # None: a pre-hook's result would replace args
            seen.setdefault(path, tuple(a.detach().clone(memory_format=torch.preserve_format)
                                        if copy and isinstance(a, torch.Tensor) else a for a in args))
        return hook

    hooks = [gm.get_submodule(path).register_forward_pre_hook(keep(path)) for path in paths]
    try:
        with torch.inference_mode():
            gm(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _faster_modules(gm: fx.GraphModule, example_input: Any, types: tuple[type, ...],
                    make: Callable[[nn.Module, torch.Tensor, bool], nn.Module | None],
                    rounds: int, cold: bool = False) -> ModuleRatios:
    """Each module of `types` called in `gm`, and the generated-kernel module `make` builds for the
    input it sees in the model (None: none fits), timed beside it here in interleaved rounds on
    the arguments it gets there (`cold`: with both modules' weights and the arguments dropped from
    the caches before each timed call, kernels.cache_flush); swapped in place where MACO
    wins by MIN_GAIN (its output preallocated when the module is called once and its output stays
    inside the model)."""
    calls = call_sites(gm)
    seen = arguments_seen(gm, example_input, [p for p in calls if isinstance(gm.get_submodule(p), types)])
    steady_allocator()
    ratios: ModuleRatios = {}
    for path, args in seen.items():
        module = gm.get_submodule(path)
        maco = make(module, args[0], False)
        if maco is None:
            continue
        runs = {"torch": lambda module=module, args=args: module(*args),
                "maco": lambda maco=maco, args=args: maco(*args)}
        with torch.inference_mode():
            for fn in runs.values():
                fn()
            timed = interleaved_rounds(runs, rounds, repeats=3, min_run_time=5e-3, warmup=2,
                                       before=Flush(*runs.values()) if cold else None)
        ratios[path] = statistics.median(t.min / m.min for t, m in zip(timed["torch"], timed["maco"]))
        if ratios[path] >= MIN_GAIN:
            sites = calls[path]
            swap_module(gm, path, make(module, args[0], len(sites) == 1 and not escapes(gm, sites[0])))
    return ratios


def kernels_everywhere(model: nn.Module, x: torch.Tensor, target: Target, *, others: bool = True,
                       winograd: Callable[[int], bool | int] | None = None,
                       portable: bool = True) -> tuple[fx.GraphModule, LayoutPlan]:
    """The planned MACO model without tuning or timing, and its plan: every layer NHWC, every conv
    a direct kernel runs on its bound-derived default schedule, and with `others` the depthwise
    convs and pooling layers on the generated kernels too; `winograd(i)` picks which of the
    Winograd-capable convs (i counts them) run MACO's Winograd instead: True for F(2x2), or the
    output tile size. With `portable` False, a conv that only portable C computes on a host with
    vector intrinsics (its filters not a whole number of the host's vectors: 24 or 40 of
    AVX-512's 16 lanes, at a tenth of torch's speed) stays torch's. What `maco optimize` builds
    before it times anything (portable False): for experiments and tests that need MACO kernels
    everywhere."""
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    fused = fuse(model, x)
    table = {(s, lay): (1.0 if lay == "NHWC" else 2.0) for s in specs for lay in ("NCHW", "NHWC")}
    # a conversion priced by its size: between two free layers (a pool, then flatten) the plan
    # converts the smaller tensor
    p = plan(fused, x, latency=table, conversion=lambda shape, a, b: 1e-12 * math.prod(shape))
    gm = p.apply(fused)
    chosen = {}
    for s in specs:
        if not (others and is_depthwise(s)):
            try:
                schedule = kernels.default_schedule(s, target, "NHWC")
            except MacoError:
                continue  # no direct kernel for it: torch runs it
            if portable or target.isa not in ISA or intrinsics_isa(s, schedule, target) is not None:
                chosen[s] = {"NHWC": schedule}
    use_maco_kernels(gm, p, chosen, target)
    if not others and winograd is None:
        return gm, p
    calls = call_sites(gm)
    capable = 0
    wanted = [p for p in calls if isinstance(gm.get_submodule(p), (nn.Conv2d, MacoConv2d, *POOLS))]
    for path, args in arguments_seen(gm, x, wanted, copy=False).items():
        shape = tuple(args[0].shape)
        mod = gm.get_submodule(path)
        own = len(calls[path]) == 1 and not escapes(gm, calls[path][0])
        conv = mod.torch_conv if isinstance(mod, MacoConv2d) else mod
        if isinstance(conv, nn.Conv2d) and len(shape) == 4:
            spec = ConvSpec.from_module(conv, shape)
            if others and depthwise_can_run(conv, spec):
                swap_module(gm, path, MacoDepthwise2d(conv, spec, "NHWC", target, own))
            elif winograd is not None and winograd_module_can_run(conv, spec, target):
                capable += 1
                tile = winograd(capable - 1)
                if tile:
                    swap_module(gm, path, MacoWinograd2d(conv, spec, target, own, m=2 if tile is True else tile))
        elif (others and isinstance(mod, POOLS) and _layout(args[0]) is not None
              and plan_for(mod, shape, _layout(args[0]), target.cores) is not None):
            swap_module(gm, path, MacoPool2d(mod, shape, _layout(args[0]), target, own))
    return gm, p
