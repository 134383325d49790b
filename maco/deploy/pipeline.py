"""The one pipeline behind `maco optimize` and the torch.compile backend (`run_pipeline`): the
distinct convs of a model, tuning what the records lack, torch's seconds and the candidate
kernels per conv and layout, then fold and fuse, plan layouts, swap in the MACO kernels (convs,
Winograd and depthwise convs, linear and pooling layers) that win in this process, run each run of
consecutive kernels as one call (layouts.segments), time every variant in the same rounds and keep
the fastest whose output is right."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import nn

from maco import kernels
from maco.core.errors import MacoError
from maco.deploy.kernel_choice import (MIN_GAIN, OUTPUT_RTOL, Chosen, Ratios, end_to_end_gain, faster_blocks,
                                       faster_depthwise, faster_input_reads, faster_kernels, faster_linears,
                                       faster_pools, faster_squeeze, faster_winograd, kernels_everywhere,
                                       tile_order, with_depthwise, with_winograd)
from maco.layouts.cuda_graph import CudaGraphed
from maco.layouts.deploy import plan as plan_layouts
from maco.layouts.end_to_end import ModelTimes, time_models
from maco.layouts.fusion import fuse
from maco.layouts.latency import measure_layouts
from maco.layouts.layout_plan import LayoutPlan
from maco.layouts.maco_modules import (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual, MacoSqueezeExcite,
                                       MacoWinograd2d, use_maco_kernels)
from maco.layouts.networks import conv_layers, distinct_convs
from maco.layouts.segments import use_segments
from maco.tune.records import Baseline, Record, RecordStore
from maco.tune.tuning import LayerResult, budget_trials, measure_baselines, tune_layers
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target



@dataclass
class Variants:
    """The models one run builds from one model, and what went into them."""

    models: dict[str, Any]  # default, fused, planned_torch, planned_maco (when a kernel won)
    plan: LayoutPlan
    chosen: Chosen  # MACO schedules chosen per spec and layout
    ratios: Ratios  # their in-process speedups over torch
    swapped: list[str] = field(default_factory=list)  # conv paths running MACO kernels (direct, Winograd, depthwise)
    linears: dict[str, float] = field(default_factory=dict)  # linear path -> torch time / MACO time
    pools: dict[str, float] = field(default_factory=dict)  # pooling path -> torch time / MACO time
    depthwise: dict[str, float] = field(default_factory=dict)  # depthwise conv path -> its time / MACO's
    winograd: dict[str, float] = field(default_factory=dict)  # conv path -> its time / Winograd's
    blocks: dict[str, float] = field(default_factory=dict)  # block's last conv path -> its kernels' time / one's
    squeeze: int = 0  # squeeze-excitations run as one kernel


def build_variants(model: nn.Module, example_input: Any, target: Target,
                   torch_seconds: dict[tuple[ConvSpec, str], float],
                   candidates: Mapping[tuple[ConvSpec, str], Record | Schedule], *,
                   layouts: tuple[str, ...] = ("NCHW", "NHWC"), device: str = "cpu",
                   log: Callable[[str], Any] = print, exact: bool = False, segments: bool = True) -> Variants:
    """The default, fused, planned (torch convs) and planned MACO variants of `model`: the
    candidates are re-timed beside torch here (kernel_choice), the plan is made from the faster
    of each, and the planned MACO model gets the kernels and the linear layers that won.
    exact=True leaves Winograd out: its fp32 error is larger than a direct conv's (docs/exactness.md).
    segments=True (CPU) runs each run of consecutive kernel modules as one call (layouts.segments)."""
    table, chosen, ratios = faster_kernels(torch_seconds, candidates, target)
    cpu = target.kind == "cpu"
    if cpu and not exact and "NHWC" in layouts:  # the plan keeps a conv in NHWC where Winograd would run it fastest
        table, planned_winograd = with_winograd(table, torch_seconds, target)
        if planned_winograd:
            log(f"      Winograd beats torch in NHWC on {sum(r >= MIN_GAIN for r in planned_winograd.values())} "
                f"of {len(planned_winograd)} distinct 3x3/5x5 stride-1 convs; the planner sees its times")
    if cpu and "NHWC" in layouts:  # and a depthwise conv in the layout its kernel runs fastest in
        table = with_depthwise(table, torch_seconds, target)
    fused = fuse(model, example_input)
    log("      planning layouts with the measured latencies (conversions measured)")
    plan = plan_layouts(fused, example_input, layouts=layouts, latency=table, device=device, target=target)
    models: dict[str, Any] = {"default": model, "fused": fused, "planned_torch": plan.apply(fused)}
    planned_maco = plan.apply(fused)
    swapped = use_maco_kernels(planned_maco, plan, chosen, target)  # CPU or CUDA kernels
    linears = faster_linears(planned_maco, example_input, target) if cpu else {}
    pools = faster_pools(planned_maco, example_input, target) if cpu else {}
    depthwise = faster_depthwise(planned_maco, example_input, target) if cpu else {}
    order = tile_order(target)  # one pricing of the host for both faster_winograd calls
    winograd = faster_winograd(planned_maco, example_input, target, order=order) if cpu and not exact else {}
    blocks = faster_blocks(planned_maco, example_input, target) if cpu else {}
    squeeze = faster_squeeze(planned_maco, example_input, target) if cpu else 0
    if cpu:
        _log_input_reads(faster_input_reads(planned_maco, example_input, target), log)
    if swapped or squeeze or any(r >= MIN_GAIN for r in (*linears.values(), *pools.values(), *depthwise.values(),
                                              *winograd.values(), *blocks.values())):
        models["planned_maco"] = planned_maco
    if cpu and segments:
        use_segments(planned_maco, target)  # each run of kernel modules as one call
    if cpu:
        everywhere = _everywhere_if_faster(model, example_input, target, models.get("planned_maco", models["planned_torch"]),
                                           segments, exact, log, order)
        if everywhere is not None:
            planned_maco, plan, blocks, squeeze = everywhere
            models["planned_torch"], models["planned_maco"] = plan.apply(fused), planned_maco
    swapped = _maco_convs(planned_maco)
    if device == "cuda":  # every variant, torch's too, replayed from a CUDA graph (layouts.cuda_graph)
        models = {label: CudaGraphed(m) for label, m in models.items()}
    return Variants(models, plan, chosen, ratios, swapped, linears, pools, depthwise, winograd, blocks, squeeze)


def _maco_convs(model: nn.Module) -> list[str]:
    """The paths of the convs a MACO kernel runs in `model` (each conv of a block run as one kernel)."""
    ones = [mod for mod in model.modules() if isinstance(mod, MacoInvertedResidual)]
    inside = {p for mod in ones for p in (mod.paths or ()) if p is not None}
    inside |= {p for mod in model.modules() if isinstance(mod, MacoSqueezeExcite) for p in (mod.paths or ())[1:3]}
    return sorted(inside | {path for path, mod in model.named_modules()
                            if isinstance(mod, (MacoConv2d, MacoWinograd2d, MacoDepthwise2d)) and path not in inside})


def _everywhere_if_faster(model: nn.Module, example_input: Any, target: Target, chosen: nn.Module,
                          segments: bool, exact: bool, log: Callable[[str], Any],
                          order: Callable[[ConvSpec], tuple[int, ...]] | None = None
                          ) -> tuple[nn.Module, LayoutPlan, dict[str, float], int] | None:
    """The model with a MACO kernel on its default schedule wherever one runs (all NHWC,
    kernel_choice.kernels_everywhere), Winograd where it beats that kernel in the model (not
    `exact`), inverted residuals as one kernel where that beats their three and squeeze-excitation
    as one where the model gains, with its plan, the blocks' ratios and the squeeze-excitations
    kept, where it runs at least MIN_GAIN faster end to end than `chosen`, the
    model built from the per-layer choices; else None. Each layer's choice is timed alone, and a
    conv left to torch can cost its neighbours more than it saves: it splits a run of kernels and
    brings layout conversions (results/segments_cpu.md, §5). `order`: the per-layer choices'
    tile_order, so that the host is priced once."""
    everywhere, plan = kernels_everywhere(model, example_input, target, portable=False)
    faster_linears(everywhere, example_input, target)
    if not exact:
        won = faster_winograd(everywhere, example_input, target, order=order)
        log(f"      every conv on a MACO kernel: Winograd beats the direct kernel in the model on "
            f"{sum(r >= MIN_GAIN for r in won.values())} of {len(won)} 3x3/5x5 stride-1 convs")
    blocks = faster_blocks(everywhere, example_input, target)
    if blocks:
        log(f"      one kernel beats the three of an inverted residual on {sum(r >= MIN_GAIN for r in blocks.values())} "
            f"of {len(blocks)} blocks")
    squeeze = faster_squeeze(everywhere, example_input, target)
    if squeeze:
        log(f"      {squeeze} squeeze-excitations run as one kernel each")
    _log_input_reads(faster_input_reads(everywhere, example_input, target), log)
    if segments:
        use_segments(everywhere, target)
    gain, taken = end_to_end_gain(everywhere, chosen, example_input)
    log(f"      a MACO kernel in every conv (default schedules, all NHWC{'' if exact else ', Winograd where it won'}) runs {gain:.2f}x the per-layer choices "
        f"end to end: {'taken' if taken else 'the per-layer choices kept'}")
    return (everywhere, plan, blocks, squeeze) if taken else None


def _log_input_reads(ratios: Mapping[str, float], log: Callable[[str], Any]) -> None:
    for path, ratio in ratios.items():
        log(f"      conv {path} reading its NCHW input itself runs {ratio:.2f}x its conversion and conv: "
            f"{'taken' if ratio >= MIN_GAIN else 'the conversion kept'}")


def fastest(models: Mapping[str, Any], example_input: Any, rounds: int = 3) -> tuple[str, ModelTimes]:
    """The label of the fastest model whose output equals the first's, timed in the same rounds."""
    times = time_models(models, example_input, rounds=rounds)
    return times.fastest(OUTPUT_RTOL), times


@dataclass(frozen=True)
class Layer:
    """A distinct conv of a model: a name for it and how many of the model's convs it stands for."""

    name: str
    spec: ConvSpec
    weight: int


def distinct_layers(model: nn.Module, example_input: Any) -> list[Layer]:
    """The distinct convs of `model` on `example_input`, each named after its first conv."""
    return [Layer(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})", spec, len(names))
            for spec, names in distinct_convs(conv_layers(model, example_input))]


@dataclass(frozen=True)
class Tuning:
    """How the pipeline tunes into `records` (one of the store's files) before it plans.
    every_layer (`maco optimize`): the distinct convs share `budget`'s measurements
    (tuning.budget_trials; records already there count), and the plan uses what the tuner
    recorded: its kernels and its torch baselines. Otherwise (the backend): only convs without a
    kernel in the records are tuned, each weighing 1, and torch baselines the records lack are
    timed by the tuner's worker."""

    budget: str
    records: Path
    every_layer: bool = False
    seed: int = 0
    cluster: str | None = None


@dataclass
class PipelineRun:
    """What one pipeline run hands its front door."""

    layers: list[Layer]
    tuned: list[LayerResult]  # one per tuned layer (every_layer), else those the backend tuned
    built: Variants
    pick: str  # the fastest variant whose output is right
    times: ModelTimes


def run_pipeline(model: nn.Module, example_input: Any, target: Target, store: RecordStore, *,
                 tuning: Tuning | None = None, layers: list[Layer] | None = None,
                 layouts: tuple[str, ...] = ("NCHW", "NHWC"), device: str = "cpu", exact: bool = False,
                 log: Callable[[str], Any] = print, on_tuned: Callable[[], Any] | None = None,
                 on_variants: Callable[[Variants], Any] | None = None) -> PipelineRun:
    """From a model to its fastest right variant (module docstring). `layers`: its distinct convs,
    when the caller has them already. Without `tuning`, or tuning only the missing convs, a conv
    the records have no kernel for runs its default schedule, and torch's seconds are
    `planning_seconds`. `on_tuned` runs before the variants are built, `on_variants` before they
    are timed end to end (a front door's progress lines and files)."""
    layers = distinct_layers(model, example_input) if layers is None else layers
    if tuning is not None and tuning.every_layer:
        tuned = _tune_every_layer(layers, target, store, tuning)
        torch_seconds = {(r.spec, lay): s for r in tuned
                         for lay, s in (("NCHW", r.torch_nchw), ("NHWC", r.torch_nhwc)) if s}
        candidates: Mapping[tuple[ConvSpec, str], Record | Schedule] = store.best
    else:
        specs = [layer.spec for layer in layers]
        tuned = _tune_missing(specs, target, store, tuning, layouts) if tuning is not None else []
        torch_seconds = planning_seconds(specs, layouts, store.baselines, device)
        candidates = _with_defaults(specs, layouts, store.best, target)
    if on_tuned is not None:
        on_tuned()
    built = build_variants(model, example_input, target, torch_seconds, candidates, layouts=layouts,
                           device=device, log=log, exact=exact)
    if on_variants is not None:
        on_variants(built)
    pick, times = fastest(built.models, example_input)
    return PipelineRun(layers, tuned, built, pick, times)


def _tune_every_layer(layers: list[Layer], target: Target, store: RecordStore, tuning: Tuning) -> list[LayerResult]:
    """Each layer's budget, its torch baselines from the records or the tuner's worker."""
    tuned = tune_layers([(layer.name, layer.spec) for layer in layers], target,
                        budget_trials(tuning.budget, len(layers)),
                        records=tuning.records, seed=tuning.seed, weights=[layer.weight for layer in layers],
                        cluster=tuning.cluster, store=store)
    store.refresh()
    return tuned


def _tune_missing(specs: list[ConvSpec], target: Target, store: RecordStore, tuning: Tuning,
                  layouts: tuple[str, ...]) -> list[LayerResult]:
    """Tune the convs the records have no kernel for (their torch baselines timed by the same
    worker), then have the worker time torch for convs tuned before baselines were recorded."""
    missing = [spec for spec in specs if not any(key[0] == spec for key in store.best)]
    tuned = []
    if missing:
        tuned = tune_layers([(str(s), s) for s in missing], target, budget_trials(tuning.budget, len(missing)),
                            records=tuning.records, layouts=layouts, store=store)
        store.refresh()
    unbased = [spec for spec in specs if any((spec, lay) not in store.baselines for lay in layouts)]
    if unbased:
        measure_baselines(unbased, target, tuning.records, layouts, stored=store.baselines_in(tuning.records))
        store.refresh()
    return tuned


def _with_defaults(specs: list[ConvSpec], layouts: tuple[str, ...], best: Mapping[tuple[ConvSpec, str], Record],
                   target: Target) -> dict[tuple[ConvSpec, str], Record | Schedule]:
    """The best record per conv and layout, else its bound-derived default schedule (none where
    the layout has no default: torch runs it)."""
    candidates: dict[tuple[ConvSpec, str], Record | Schedule] = {}
    for spec in specs:
        for layout in layouts:
            try:
                candidates[(spec, layout)] = best.get((spec, layout)) or kernels.default_schedule(spec, target, layout)
            except MacoError:
                pass
    return candidates


def planning_seconds(specs: list[ConvSpec], layouts: tuple[str, ...],
                     stored: Mapping[tuple[ConvSpec, str], Baseline],
                     device: str = "cpu") -> dict[tuple[ConvSpec, str], float]:
    """torch's seconds per (spec, layout) to plan with: the records' baseline seconds as stored,
    exactly what `maco optimize` plans with from the same file (its tuner's worker timed them;
    timing torch here, right after MACO kernels ran, read up to 1.5x slower and moved the plan).
    Stored seconds, not rescaled by the reference: rescaling would need the reference timed in
    this process, the very timing avoided. A spec without a baseline in every layout is timed
    here in all of them, so its layouts are compared on one clock (the fastest of 9 runs: medians
    of a few short runs at compile time strayed up to 2x), on `device`, where the model runs."""
    seconds = {}
    for spec in specs:
        if all((spec, layout) in stored for layout in layouts):
            seconds.update({(spec, layout): stored[(spec, layout)].seconds for layout in layouts})
            continue
        timed = measure_layouts(spec, layouts, device, rounds=3, repeats=3, min_run_time=2e-3)
        seconds.update({(spec, layout): timed[layout].min for layout in layouts})
    return seconds
