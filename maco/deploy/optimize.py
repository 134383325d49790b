"""The main job: tune every distinct conv of a model, plan its layouts with the tuned latencies,
run it with MACO's kernels where they beat torch, and measure it end to end against the model
as torch runs it by default. `maco optimize` is the command; `optimize()` the same in Python."""
from __future__ import annotations

import math
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from maco.deploy import deployment
from maco.deploy.engines import ENGINES, Job, compare
from maco.core.errors import MacoError
from maco.core.files import check_writable
from maco.deploy.kernel_choice import MIN_GAIN, POOLS
from maco.kernels.cpu_peak import depthwise_ceiling, measure_ceilings, winograd_ceilings
from maco.layouts.end_to_end import ConvShare, conv_share
from maco.layouts.maco_modules import MacoLinear, MacoLinearAsConv, MacoPool2d, MacoWinograd2d
from maco.layouts.network_floor import ModelFloor, model_floor
from maco.layouts.networks import NETWORKS, example_input, load_model
from maco.deploy.optimize_report import (LayerRow, OptimizeResult, end_to_end_rows, hold_output_folder,
                                  one_run_per_output_folder, save_output, write_outputs)
from maco.deploy.pipeline import PipelineRun, Tuning, Variants, distinct_layers, run_pipeline
from maco.tune.records import Record, RecordStore
from maco.kernels import resolve_target
from maco.core.spec import ConvSpec
from maco.core.target import Target, require_memory
from maco.tune.tuning import BUDGETS, budget_trials

DEFAULT_INPUT_SHAPE = (1, 3, 224, 224)


@one_run_per_output_folder
def optimize(model_text: str = "resnet18", *, target: str = "cpu", budget: str = "quick",
             out: str | Path = "maco-out", records: str | Path | None = None, seed: int = 0,
             input_shape: tuple[int, ...] | None = None, batch: int | None = None,
             save: str | Path | None = None, log: Callable[[str], Any] = print,
             cluster: str | None = None, engines: Sequence[str] = (), exact: bool = False) -> OptimizeResult:
    """The main job (module docstring). Kernels are tuned for `batch` images (default: the input
    shape's first size, else 1) and torch's thread count; `save` writes the model it hands back to
    one file (maco.deploy.deployment: reload it with maco.load, no tuning). `cluster` (a Ray address)
    tunes on that cluster's machines of this one's kind; the rest runs here. `engines` (of
    maco.deploy.engines.ENGINES but maco) are timed beside the model handed back, each in its own process
    (CPU only), and the report compares them. `exact` leaves Winograd out (docs/exactness.md)."""
    start = time.perf_counter()
    cluster = _check_choices(engines, cluster, budget)
    tgt = resolve_target(target)
    if tgt.kind == "cuda":
        from maco.kernels.cuda import require_gpu

        require_gpu()
    out = check_writable(out, "output folder", folder=True)
    hold_output_folder(out)  # one run writes there at a time (until this call ends)
    records = check_writable(records or out / "records.jsonl", "records file")
    if save:
        check_writable(save, "--save file")
    name, model = load_model(model_text)
    model.eval()
    device = tgt.device
    x = _example_input(model_text, input_shape, batch)
    model, x = model.to(device), x.to(device)
    layers = distinct_layers(model, x)
    if not layers:
        raise MacoError(f"{name} has no Conv2d layers to tune")
    log(f"[1/4] tuning {len(layers)} distinct conv layers of {name} (batch {x.shape[0]}) on {tgt.name}"
        + (f" with {tgt.cores} threads" if tgt.kind == "cpu" else "")
        + f": {budget_trials(budget, len(layers))} measurements ({budget} budget), records in {records}")
    # torch's seconds: the records' baselines where present, else the tuner's fresh timings, which
    # it appends there (tuning.measure_baselines): the torch.compile backend plans from the same numbers
    store = RecordStore([records], tgt)
    run = run_pipeline(model, x, tgt, store, layers=layers, device=device, exact=exact, log=log,
                       tuning=Tuning(budget, records, every_layer=True, seed=seed, cluster=cluster),
                       on_tuned=lambda: log("[2/4] re-timing the kernels that beat torch in this process; "
                                            "folding BatchNorm, fusing epilogues, planning layouts"),
                       on_variants=lambda built: _variants_built(built, out, log))
    built, pick = run.built, run.pick
    rows = _layer_rows(run, store.best)
    share = conv_share(built.models[pick], x) if pick != "default" else None
    floor = _floor(model, x, share, tgt, log) if share is not None and tgt.kind == "cpu" else None
    result = OptimizeResult(name, out, rows, built.plan, end_to_end_rows(run.times, pick),
                            time.perf_counter() - start, built.models[pick], pick, x, share, tgt, floor=floor)
    if save:
        deployment.save(result, save)
        log(f"      saved the {pick} model to {save} (maco.load({str(save)!r}, model) rebuilds it)")
    if engines and tgt.kind == "cpu":
        result.engines = beside_engines(result, model_text, model, save, list(engines), log)
    elif engines:
        log("      the other engines run on the CPU: none timed beside a CUDA model")
    write_outputs(result, tgt, records, built.swapped)
    return result


def _floor(model: torch.nn.Module, x: torch.Tensor, share: ConvShare, target: Target,
           log: Callable[[str], None]) -> ModelFloor | None:
    """The model's network floor and each kernel's own on this host's best FMA peak and DRAM read
    bandwidth (kernels.cpu_peak.measure_ceilings, timed now; the best this host has shown, as
    `maco bound --network` takes them), with both rates as timed now (ModelFloor.busy_note) and
    the reach of MACO's kernel families at the shares of the peak timed now; None,
    with one line saying why, where none comes out. A report line: whatever goes wrong here (a
    graph the floor cannot read, a peak that cannot be timed) must not cost the user the model the
    job found, so every error is caught."""
    try:
        ceilings = measure_ceilings(target, 3)
        floor = model_floor(model, x, share.specs, target, ceilings["fma_gflops_best"] * 1e9,
                            ceilings["read_gbs_best"] * 1e9, winograd_ceilings(target, 3),
                            depthwise_ceiling(target, 3))
        floor.peak_now, floor.bandwidth_now = ceilings["fma_gflops"] * 1e9, ceilings["read_gbs"] * 1e9
        floor.spread_now = max(ceilings["fma_spread"], ceilings["read_spread"])
        return floor
    except Exception as exc:  # noqa: BLE001 -- see the docstring
        log(f"      no network floor for this model ({type(exc).__name__}: {exc})")
        return None


def _check_choices(engines: Sequence[str], cluster: str | None, budget: str) -> str | None:
    """The named engines and budget exist; the cluster address, checked."""
    unknown = [e for e in engines if e not in ENGINES or e == "maco"]
    if unknown:
        raise MacoError(f"unknown engine {unknown[0]!r}; choose from {', '.join(e for e in ENGINES if e != 'maco')}")
    if cluster is not None:
        from maco.tune.cluster import check_address

        cluster = check_address(cluster)
    if budget not in BUDGETS:
        raise MacoError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)}")
    return cluster


def _example_input(model_text: str, input_shape: tuple[int, ...] | None, batch: int | None) -> torch.Tensor:
    """The input to tune and time on: `input_shape` (a custom model's default otherwise) with
    `batch` images, or a named network's own example input."""
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise MacoError(f"batch must be a positive int, got {batch!r}")
    if not input_shape and model_text in NETWORKS:
        return example_input(batch or 1)
    shape = tuple(input_shape or DEFAULT_INPUT_SHAPE)
    if not shape or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
        raise MacoError(f"input_shape must be positive ints, got {input_shape!r}")
    shape = (batch or shape[0], *shape[1:])
    require_memory(16 * 4 * math.prod(shape), f"an input of shape {shape}")
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _variants_built(built: Variants, out: Path, log: Callable[[str], Any]) -> None:
    """The plan written and the kernels counted, before the variants are timed end to end."""
    save_output(out, "plan.json", built.plan.to_json())
    planned = built.models.get("planned_maco")
    layers = "".join(f", {ran} of {ran + left} {kind}" for kind, (ran, left) in _linears_and_pools(planned).items()
                     if ran + left)
    kinds = {"depthwise convs": built.depthwise, "3x3/5x5 convs tried with Winograd": built.winograd,
             "inverted residuals tried as one kernel": built.blocks}
    others = layers + "".join(f", {sum(r >= MIN_GAIN for r in ratios.values())} of {len(ratios)} {kind}"
                              for kind, ratios in kinds.items() if ratios)
    if built.squeeze:
        others += f", {built.squeeze} squeeze-excitations as one kernel each"
    log(f"[3/4] {len(built.swapped)} of {len(built.plan.convs)} convs{others} run MACO kernels")
    tiles = Counter(mod.m for mod in built.models.get("planned_maco", torch.nn.Module()).modules()
                    if isinstance(mod, MacoWinograd2d))
    if tiles:  # each the bound's predicted tile unless timing found the other 2% faster (kernel_choice.tile_order)
        log("      Winograd tile sizes: " + ", ".join(f"F({m}x{m}) on {n} conv{'s' * (n > 1)}"
                                                   for m, n in sorted(tiles.items(), reverse=True)))
    log(f"[4/4] timing {', '.join(built.models)} end to end in the same rounds; the fastest is handed back")


def _linears_and_pools(model: torch.nn.Module | None) -> dict[str, tuple[int, int]]:
    """Linear and pooling layers of the model handed on: (on a MACO kernel, left to torch). Counted
    in the model, not from the per-layer timings: the model with a kernel in every conv makes its
    own choices (a linear that ties torch's joins a run of kernels)."""
    if model is None:
        return {}
    graph = getattr(model, "graph", None)
    called = [model.get_submodule(str(n.target)) for n in graph.nodes if n.op == "call_module"] if graph else []
    mods = list(model.modules())
    return {"linear layers": (sum(isinstance(m, (MacoLinear, MacoLinearAsConv)) for m in mods),
                              sum(isinstance(m, torch.nn.Linear) for m in called)),
            "pooling layers": (sum(isinstance(m, MacoPool2d) for m in mods), sum(isinstance(m, POOLS) for m in called))}


def _layer_rows(run: PipelineRun, best: dict[tuple[ConvSpec, str], Record]) -> list[LayerRow]:
    """A report row per tuned conv: its best records, torch's seconds, and what the plan made of it."""
    built = run.built
    maco_specs = {spec for mod in built.models["planned_maco"].modules()
                  for spec in getattr(mod, "specs", (getattr(mod, "spec", None),))} if built.swapped else set()
    rows = []
    for r in run.tuned:
        layouts = {lp.layout for lp in built.plan.convs if lp.spec == str(r.spec)}
        rows.append(LayerRow(r.name, r.spec, r.weight, r.trials,
                             maco={lay: best[(r.spec, lay)].seconds for lay in ("NCHW", "NHWC")
                                   if (r.spec, lay) in best},
                             torch={k: v for k, v in (("NCHW", r.torch_nchw), ("NHWC", r.torch_nhwc)) if v},
                             in_process=built.ratios.get(r.spec, {}), planned="/".join(sorted(layouts)),
                             uses_maco=r.spec in maco_specs))
    return rows


def beside_engines(result: OptimizeResult, model_text: str, model: Any, saved: str | Path | None,
                   engines: list[str], log: Callable[[str], Any]) -> list[dict[str, Any]]:
    """The handed-back model (from `saved`, or a temporary file) and `engines`, each in its own
    process beside torch eager NCHW (maco.deploy.engines): a row each, MACO's last."""
    with tempfile.TemporaryDirectory(prefix="maco_engines_") as tmp:
        if not saved:
            saved = Path(tmp) / "model.maco"
            deployment.save(result, saved)
        weights = Path(tmp) / "weights.pt"  # the worker builds the model again: with these weights
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights)
        job = Job(model_text, tuple(result.example.shape), str(weights), str(saved))
        log(f"[+] timing the handed-back model beside {', '.join(engines)}, each in its own process "
            "alternating with torch eager NCHW")
        return compare(job, [*engines, "maco"], log=log)
