"""From per-layer latencies to the model handed back, shared by `maco optimize` and the
torch.compile backend: fold and fuse, plan layouts, swap in the MACO kernels (convs, Winograd
and depthwise convs, linear and pooling layers) that win in this process, then time every variant in the same
rounds and keep the fastest whose output is right."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

from maco.deploy.kernel_choice import (MIN_GAIN, Chosen, Ratios, faster_depthwise, faster_kernels, faster_linears,
                                faster_pools, faster_winograd, with_winograd)
from maco.layouts.deploy import plan as plan_layouts
from maco.layouts.end_to_end import ModelTimes, time_models
from maco.layouts.fusion import fuse
from maco.layouts.layout_plan import LayoutPlan
from maco.layouts.maco_modules import MacoConv2d, MacoDepthwise2d, MacoWinograd2d, use_maco_kernels
from maco.tune.records import Record
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target

OUTPUT_RTOL = 1e-4  # a variant is handed back only if its output equals the model's to this


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


def build_variants(model: nn.Module, example_input: Any, target: Target,
                   torch_seconds: dict[tuple[ConvSpec, str], float],
                   candidates: Mapping[tuple[ConvSpec, str], Record | Schedule], *,
                   layouts: tuple[str, ...] = ("NCHW", "NHWC"), device: str = "cpu",
                   log: Callable[[str], Any] = print, exact: bool = False) -> Variants:
    """The default, fused, planned (torch convs) and planned MACO variants of `model`: the
    candidates are re-timed beside torch here (kernel_choice), the plan is made from the faster
    of each, and the planned MACO model gets the kernels and the linear layers that won.
    exact=True leaves Winograd out: its fp32 error is larger than a direct conv's (docs/exactness.md)."""
    table, chosen, ratios = faster_kernels(torch_seconds, candidates, target)
    cpu = target.kind == "cpu"
    if cpu and not exact and "NHWC" in layouts:  # the plan keeps a conv in NHWC where Winograd would run it fastest
        table, planned_winograd = with_winograd(table, torch_seconds, target)
        if planned_winograd:
            log(f"      Winograd beats torch in NHWC on {sum(r >= MIN_GAIN for r in planned_winograd.values())} "
                f"of {len(planned_winograd)} distinct 3x3/5x5 stride-1 convs; the planner sees its times")
    fused = fuse(model, example_input)
    log("      planning layouts with the measured latencies (conversions measured)")
    plan = plan_layouts(fused, example_input, layouts=layouts, latency=table, device=device, target=target)
    models: dict[str, Any] = {"default": model, "fused": fused, "planned_torch": plan.apply(fused)}
    planned_maco = plan.apply(fused)
    swapped = use_maco_kernels(planned_maco, plan, chosen, target) if cpu else []
    linears = faster_linears(planned_maco, example_input, target) if cpu else {}
    pools = faster_pools(planned_maco, example_input, target) if cpu else {}
    depthwise = faster_depthwise(planned_maco, example_input, target) if cpu else {}
    winograd = faster_winograd(planned_maco, example_input, target) if cpu and not exact else {}
    if swapped or any(r >= MIN_GAIN for r in (*linears.values(), *pools.values(), *depthwise.values(),
                                              *winograd.values())):
        models["planned_maco"] = planned_maco
    swapped = [path for path, mod in planned_maco.named_modules()
               if isinstance(mod, (MacoConv2d, MacoWinograd2d, MacoDepthwise2d))]
    return Variants(models, plan, chosen, ratios, swapped, linears, pools, depthwise, winograd)


def fastest(models: Mapping[str, Any], example_input: Any, rounds: int = 3) -> tuple[str, ModelTimes]:
    """The label of the fastest model whose output equals the first's, timed in the same rounds."""
    times = time_models(models, example_input, rounds=rounds)
    return times.fastest(OUTPUT_RTOL), times
