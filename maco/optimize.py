"""The main job: tune every distinct conv of a model, plan its layouts with the tuned latencies,
run it with MACO's kernels where they beat torch, and measure it end to end against the model
as torch runs it by default. `maco optimize` is the command; `optimize()` the same in Python."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from maco.errors import MacoError
from maco.files import check_writable
from maco.records import best_in_files
from maco.spec import ConvSpec
from maco.target import Target, require_memory
from maco.tuning import BUDGETS, tune_layers

MIN_GAIN = 1.02  # a MACO kernel replaces torch's conv only when this much faster in process
DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)


# -- models ------------------------------------------------------------------------------------
def load_model(text: str) -> tuple[str, nn.Module]:
    """A built-in network name, or `path/to/file.py:ClassName` (built with no arguments)."""
    from maco.layouts.networks import NETWORKS, build

    if text in NETWORKS:
        return text, build(text)
    if ":" not in text:
        raise MacoError(f"unknown model {text!r}: give a built-in network ({', '.join(NETWORKS)}) "
                        "or path/to/file.py:ClassName")
    path, cls_name = text.rsplit(":", 1)
    if not Path(path).is_file():
        raise MacoError(f"model file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"maco_user_model_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:
        raise MacoError(f"importing {path!r} failed: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise MacoError(f"{path!r} has no {cls_name!r}")
    try:
        model = cls()
    except Exception as exc:
        raise MacoError(f"building {cls_name}() from {path!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise MacoError(f"{cls_name}() from {path!r} is a {type(model).__name__}, not a torch.nn.Module")
    return cls_name, model


# -- MACO kernels inside a torch model ------------------------------------------------------------
class MacoConv2d(nn.Module):
    """A Conv2d whose forward runs a compiled MACO kernel for the one input shape it was tuned
    for (any other shape falls back to torch's conv, with the same weights)."""

    def __init__(self, conv: nn.Conv2d, spec: ConvSpec, schedule: Any, target: Target):
        super().__init__()
        from maco import kernels

        self.spec, self.layout = spec, schedule.layout
        self.weight, self.bias = conv.weight, conv.bias
        self._kernel = kernels.compile(spec, schedule, target=target, bias=conv.bias is not None)
        self._conv = self._kernel.bind(conv.weight.detach(), None if conv.bias is None else conv.bias.detach())
        self._format = torch.channels_last if self.layout == "NHWC" else torch.contiguous_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if tuple(x.shape) != (s.n, s.c, s.h, s.w) or x.dtype != torch.float32 or x.device.type != "cpu":
            return torch.nn.functional.conv2d(x, self.weight, self.bias, s.stride, s.padding,
                                              s.dilation, s.groups)
        return self._conv.run_tensor(x.contiguous(memory_format=self._format))

    def extra_repr(self) -> str:
        return f"{self.spec}, layout={self.layout}"


def use_maco_kernels(gm: nn.Module, plan: Any, chosen: dict[str, Any], target: Target) -> list[str]:
    """Swap the planned convs whose layer has a chosen MACO schedule in the plan's layout for
    MacoConv2d modules (in place); returns the module paths swapped."""
    swapped = []
    for layer in plan.convs:
        schedule = chosen.get(layer.spec, {}).get(layer.layout) if layer.spec else None
        if schedule is None or layer.target in swapped:
            continue
        conv = gm.get_submodule(layer.target)
        parent_name, _, child = layer.target.rpartition(".")
        parent = gm.get_submodule(parent_name) if parent_name else gm
        setattr(parent, child, MacoConv2d(conv, ConvSpec.parse(layer.spec), schedule, target))
        swapped.append(layer.target)
    return swapped


# -- the job -------------------------------------------------------------------------------------
@dataclass
class LayerRow:
    name: str
    spec: ConvSpec
    count: int
    trials: int
    maco: dict[str, float] = field(default_factory=dict)  # layout -> best seconds
    torch: dict[str, float] = field(default_factory=dict)
    planned: str = ""
    uses_maco: bool = False
    in_process: dict[str, float] = field(default_factory=dict)  # layout -> torch time / MACO time


@dataclass
class OptimizeResult:
    model: str
    out: Path
    rows: list[LayerRow]
    plan: Any
    end_to_end: dict[str, Any]
    seconds: float


def optimize(model_text: str = "resnet18", *, target: str = "cpu", budget: str = "quick",
             out: str | Path = "maco-out", records: str | Path | None = None, seed: int = 0,
             input_shape: tuple[int, ...] | None = None, log=print) -> OptimizeResult:
    from maco.layouts.deploy import compare_end_to_end, plan as plan_layouts
    from maco.layouts.networks import NETWORKS, conv_layers, distinct_convs, example_input

    start = time.perf_counter()
    if budget not in BUDGETS:
        raise MacoError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)}")
    tgt = Target.named(target)
    if tgt.kind == "cuda":
        from maco.kernels.cuda import require_gpu

        require_gpu()
    out = check_writable(out, "output folder", folder=True)
    records = check_writable(records or out / "records.jsonl", "records file")
    name, model = load_model(model_text)
    model.eval()
    device = "cuda" if tgt.kind == "cuda" else "cpu"
    if input_shape:
        require_memory(4 * 4 * math.prod(input_shape), f"an input of shape {input_shape}")
        x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(0))
    else:
        x = example_input(1) if model_text in NETWORKS else torch.randn(*DEFAULT_INPUT_SHAPE)
    model, x = model.to(device), x.to(device)
    groups = distinct_convs(conv_layers(model, x))
    if not groups:
        raise MacoError(f"{name} has no Conv2d layers to tune")
    layers = [(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})", spec)
              for spec, names in groups]
    trials = BUDGETS[budget] * len(layers)
    log(f"[1/4] tuning {len(layers)} distinct conv layers of {name} on {tgt.name}: {trials} "
        f"measurements ({budget} budget), records in {records}")
    tuned = tune_layers(layers, tgt, trials, records=records, seed=seed,
                        weights=[len(names) for _, names in groups])
    best = best_in_files([records], tgt)
    rows = [LayerRow(r.name, r.spec, r.weight, r.trials,
                     maco={lay: best[(r.spec, lay)].seconds for lay in ("NCHW", "NHWC") if (r.spec, lay) in best},
                     torch={k: v for k, v in (("NCHW", r.torch_nchw), ("NHWC", r.torch_nhwc)) if v})
            for r in tuned]
    torch_seconds = {(row.spec, lay): s for row in rows for lay, s in row.torch.items()}
    log("      re-timing the kernels that beat torch in this process")
    table, chosen, ratios = faster_kernels(torch_seconds, best, tgt)
    for row in rows:
        row.in_process = ratios.get(str(row.spec), {})
    log("[2/4] planning layouts with the tuned latencies (conversions measured)")
    plan = plan_layouts(model, x, latency=table, device=device)
    plan.save(out / "plan.json")
    for row in rows:
        layouts = {lp.layout for lp in plan.convs if lp.spec == str(row.spec)}
        row.planned = "/".join(sorted(layouts))
        row.uses_maco = any(lay in chosen.get(str(row.spec), {}) for lay in layouts)
    log("[3/4] applying the plan (torch convs) and swapping in MACO kernels where they are faster")
    planned_torch = plan.apply(model)
    planned_maco = plan.apply(model)
    swapped = use_maco_kernels(planned_maco, plan, chosen, tgt) if tgt.kind == "cpu" else []
    log(f"      {len(swapped)} of {len(plan.convs)} convs run MACO kernels")
    log("[4/4] timing end to end against the default model (interleaved rounds)")
    e2e: dict[str, Any] = {}
    for key, planned in (("planned_torch", planned_torch), ("planned_maco", planned_maco)):
        if key == "planned_maco" and not swapped:
            continue
        res = compare_end_to_end(model, planned, x, rounds=3)
        e2e[key] = {"default_s": res.default.median, "planned_s": res.planned.median,
                    "speedup": res.speedup, "max_abs_diff": res.max_abs_diff}
    result = OptimizeResult(name, out, rows, plan, e2e, time.perf_counter() - start)
    write_outputs(result, tgt, records, swapped)
    return result


def faster_kernels(torch_seconds: dict[tuple[ConvSpec, str], float], best: dict[tuple[ConvSpec, str], Any],
                   target: Target) -> tuple[dict, dict, dict]:
    """Per (spec, layout) of torch_seconds: the latency table for the planner (the faster of
    torch and MACO's best record), the MACO schedules to run (str(spec) -> layout -> schedule)
    and their in-process ratios. On a CPU every best record is re-timed beside torch in this
    process and chosen when it wins by MIN_GAIN; its table entry is torch's time over that ratio,
    so both entries share this process's clock (records taken in a slower or faster spell of
    the machine would otherwise be compared with torch timed now). On a GPU the records are
    trusted as they are."""
    table = dict(torch_seconds)
    cpu = target.kind == "cpu"
    candidates: dict[str, dict[str, Any]] = {}
    for (spec, layout), torch_s in torch_seconds.items():
        rec = best.get((spec, layout))
        if rec is not None and (cpu or rec.seconds < torch_s):
            candidates.setdefault(str(spec), {})[layout] = rec.schedule
    ratios = confirm_in_process(candidates, target) if cpu else {}
    chosen: dict[str, dict[str, Any]] = {}
    for text, by_layout in candidates.items():
        spec = ConvSpec.parse(text)
        for layout, schedule in by_layout.items():
            ratio = ratios.get(text, {}).get(layout, math.inf)
            if ratio >= MIN_GAIN:
                chosen.setdefault(text, {})[layout] = schedule
                table[(spec, layout)] = (torch_seconds[(spec, layout)] / ratio if cpu
                                         else best[(spec, layout)].seconds)
    return table, chosen, ratios


def confirm_in_process(chosen: dict[str, dict[str, Any]], target: Target,
                       rounds: int = 3) -> dict[str, dict[str, float]]:
    """torch's time over MACO's for each chosen kernel, timed here as the model runs it (output
    allocated per call, heap allocator, torch's conv in the same layout), in interleaved rounds.
    The tuner's worker times kernels on a preallocated output in another process; this is the
    check that the gain survives where the kernel will actually run."""
    import statistics

    from maco.kernels.baselines import torch_conv
    from maco.timing import steady_allocator
    from maco.timing import time_callable

    steady_allocator()
    ratios: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for text, by_layout in chosen.items():
        spec = ConvSpec.parse(text)
        conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                         spec.groups, bias=False).eval()
        for layout, schedule in by_layout.items():
            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
            x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=fmt)
            maco = MacoConv2d(conv, spec, schedule, target)
            runs = (torch_conv(spec, x, conv.weight.detach(), layout), lambda: maco(x))
            per_round = []
            with torch.inference_mode():
                for fn in runs:
                    fn()
                for _ in range(rounds):
                    # the fastest repeat of each: the least disturbed by anything else running
                    t_torch, t_maco = (time_callable(fn, repeats=3, min_run_time=5e-3).min
                                       for fn in runs)
                    per_round.append(t_torch / t_maco)
            ratios.setdefault(text, {})[layout] = statistics.median(per_round)
    return ratios


# -- outputs ---------------------------------------------------------------------------------
def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(result: OptimizeResult, target: Target, records: Path, swapped: list[str]) -> None:
    out = result.out
    gf = lambda spec, s: spec.flops / s / 1e9 if s else None  # noqa: E731
    header = ["layer", "spec", "layers", "trials", "maco_nchw_gflops", "maco_nhwc_gflops",
              "torch_nchw_gflops", "torch_nhwc_gflops", "in_process_nchw", "in_process_nhwc",
              "planned_layout", "uses_maco"]
    lines = []
    for r in result.rows:
        lines.append([r.name, str(r.spec), r.count, r.trials,
                      *(_fmt(gf(r.spec, d.get(lay))) for d in (r.maco, r.torch) for lay in ("NCHW", "NHWC")),
                      *(_fmt(r.in_process.get(lay)) for lay in ("NCHW", "NHWC")), r.planned,
                      int(r.uses_maco)])
    tmp = out / "layers.csv.tmp"
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(lines)
    os.replace(tmp, out / "layers.csv")
    _plot(result, out / "layers.png")
    _write_text(out / "end_to_end.json", json.dumps(result.end_to_end, indent=2))
    _write_text(out / "report.md", report_markdown(result, target, records, swapped))


def _ratios(by_layout: dict[str, float]) -> str:
    return ", ".join(f"{lay} {v:.2f}x" for lay, v in sorted(by_layout.items())) or "-"


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def _plot(result: OptimizeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = result.rows
    idx = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    bars = [("MACO NCHW", lambda r: r.maco.get("NCHW")), ("MACO NHWC", lambda r: r.maco.get("NHWC")),
            ("torch NCHW", lambda r: r.torch.get("NCHW")), ("torch NHWC", lambda r: r.torch.get("NHWC"))]
    for i, (label, get) in enumerate(bars):
        vals = [r.spec.flops / get(r) / 1e9 if get(r) else 0 for r in rows]
        ax.bar(idx + (i - 1.5) * 0.2, vals, 0.2, label=label)
    ax.set_xticks(idx, [r.name.split(" ")[0] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"{result.model}: best kernel per layer and layout")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def report_markdown(result: OptimizeResult, target: Target, records: Path, swapped: list[str]) -> str:
    from maco.timing import environment

    env = environment()
    lines = [f"# MACO optimize: {result.model} on {target.name}", "",
             f"Machine: {env.get('cpu')} ({env.get('isa')}, {env.get('cores')} cores), torch "
             f"{env.get('torch')}. Took {result.seconds:.0f} s.", "",
             "## Per conv layer (GFLOP/s, best measured)", "",
             "| layer | spec | trials | MACO NCHW | MACO NHWC | torch NCHW | torch NHWC | in process | planned | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gf = lambda spec, s: f"{spec.flops / s / 1e9:.1f}" if s else "-"  # noqa: E731
    for r in result.rows:
        lines.append(f"| {r.name} | `{r.spec}` | {r.trials} | {gf(r.spec, r.maco.get('NCHW'))} | "
                     f"{gf(r.spec, r.maco.get('NHWC'))} | {gf(r.spec, r.torch.get('NCHW'))} | "
                     f"{gf(r.spec, r.torch.get('NHWC'))} | {_ratios(r.in_process)} | {r.planned} | "
                     f"{'MACO' if r.uses_maco else 'torch'} |")
    plan = result.plan
    lines += ["", f"GFLOP/s are the tuner's (worker process, preallocated output). *in process*: torch's "
              f"time over MACO's, re-timed here as the model runs the kernel (interleaved rounds); a "
              f"kernel replaces torch's conv only above {MIN_GAIN:.2f}x.", "",
              "## Layout plan", "",
              f"{sum(1 for c in plan.convs if c.layout == 'NHWC')} of {len(plan.convs)} convs in NHWC, "
              f"{len(plan.conversions)} conversions; planner ({plan.method}) predicts "
              f"{plan.cost * 1e3:.2f} ms" + (f" vs {plan.default_cost * 1e3:.2f} ms all-NCHW"
                                             if plan.default_cost else "") + ".", "",
              "## End to end (batch 1, measured, interleaved rounds)", ""]
    for key, label in (("planned_torch", "planned layouts, torch convs"),
                       ("planned_maco", f"planned layouts, MACO kernels in {len(swapped)} convs")):
        e = result.end_to_end.get(key)
        if e:
            lines.append(f"- {label}: {e['planned_s'] * 1e3:.2f} ms vs default {e['default_s'] * 1e3:.2f} ms "
                         f"= **{e['speedup']:.2f}x** (max |diff| {e['max_abs_diff']:.2g})")
    if "planned_maco" not in result.end_to_end:
        lines.append("- no MACO kernel beat torch in its planned layout: the planned model runs torch convs only")
    lines += ["", f"Files: `plan.json` (apply with `maco.layouts.LayoutPlan.load(...).apply(model)`), "
              f"`layers.csv`, `layers.png`, `end_to_end.json`; records: `{records}`.", ""]
    return "\n".join(lines)
