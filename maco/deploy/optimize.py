"""The main job: tune every distinct conv of a model, plan its layouts with the tuned latencies,
run it with MACO's kernels where they beat torch, and measure it end to end against the model
as torch runs it by default. `maco optimize` is the command; `optimize()` the same in Python."""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from maco.deploy import deployment
from maco.deploy.engines import ENGINES, Job, compare
from maco.core.errors import MacoError
from maco.core.files import check_writable
from maco.deploy.kernel_choice import MIN_GAIN
from maco.layouts.end_to_end import conv_share
from maco.layouts.networks import NETWORKS, conv_layers, distinct_convs, example_input, load_model
from maco.deploy.optimize_report import (LayerRow, OptimizeResult, end_to_end_rows, hold_output_folder,
                                  one_run_per_output_folder, save_output, write_outputs)
from maco.deploy.pipeline import build_variants, fastest
from maco.tune.records import best_in_files
from maco.kernels import resolve_target
from maco.core.target import require_memory
from maco.tune.tuning import BUDGETS, tune_layers

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
    unknown = [e for e in engines if e not in ENGINES or e == "maco"]
    if unknown:
        raise MacoError(f"unknown engine {unknown[0]!r}; choose from {', '.join(e for e in ENGINES if e != 'maco')}")
    if cluster is not None:
        from maco.tune.cluster import check_address

        cluster = check_address(cluster)
    if budget not in BUDGETS:
        raise MacoError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)}")
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
    device = "cuda" if tgt.kind == "cuda" else "cpu"
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise MacoError(f"batch must be a positive int, got {batch!r}")
    if input_shape or model_text not in NETWORKS:
        shape = tuple(input_shape or DEFAULT_INPUT_SHAPE)
        if not shape or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
            raise MacoError(f"input_shape must be positive ints, got {input_shape!r}")
        shape = (batch or shape[0], *shape[1:])
        require_memory(16 * 4 * math.prod(shape), f"an input of shape {shape}")
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    else:
        x = example_input(batch or 1)
    model, x = model.to(device), x.to(device)
    groups = distinct_convs(conv_layers(model, x))
    if not groups:
        raise MacoError(f"{name} has no Conv2d layers to tune")
    layers = [(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})", spec)
              for spec, names in groups]
    trials = BUDGETS[budget] * len(layers)
    log(f"[1/4] tuning {len(layers)} distinct conv layers of {name} (batch {x.shape[0]}) on {tgt.name}"
        + (f" with {tgt.cores} threads" if tgt.kind == "cpu" else "")
        + f": {trials} measurements ({budget} budget), records in {records}")
    tuned = tune_layers(layers, tgt, trials, records=records, seed=seed,
                        weights=[len(names) for _, names in groups], cluster=cluster)
    best = best_in_files([records], tgt)
    rows = [LayerRow(r.name, r.spec, r.weight, r.trials,
                     maco={lay: best[(r.spec, lay)].seconds for lay in ("NCHW", "NHWC") if (r.spec, lay) in best},
                     torch={k: v for k, v in (("NCHW", r.torch_nchw), ("NHWC", r.torch_nhwc)) if v})
            for r in tuned]
    # the records' torch baselines where present, else the tuner's fresh timings, which it appended
    # there (tuning.measure_baselines): the torch.compile backend plans from the same file's numbers
    torch_seconds = {(row.spec, lay): s for row in rows for lay, s in row.torch.items()}
    log("[2/4] re-timing the kernels that beat torch in this process; folding BatchNorm, fusing "
        "epilogues, planning layouts")
    built = build_variants(model, x, tgt, torch_seconds, best, device=device, log=log, exact=exact)
    plan, swapped, variants = built.plan, built.swapped, built.models
    save_output(out, "plan.json", plan.to_json())
    kinds = {"linear layers": built.linears, "pooling layers": built.pools, "depthwise convs": built.depthwise,
             "3x3/5x5 convs tried with Winograd": built.winograd}
    others = "".join(f", {sum(r >= MIN_GAIN for r in ratios.values())} of {len(ratios)} {kind}"
                     for kind, ratios in kinds.items() if ratios)
    log(f"[3/4] {len(swapped)} of {len(plan.convs)} convs{others} run MACO kernels")
    maco_specs = {variants["planned_maco"].get_submodule(path).spec for path in swapped}
    for row in rows:
        row.in_process = built.ratios.get(row.spec, {})
        layouts = {lp.layout for lp in plan.convs if lp.spec == str(row.spec)}
        row.planned = "/".join(sorted(layouts))
        row.uses_maco = row.spec in maco_specs
    log(f"[4/4] timing {', '.join(variants)} end to end in the same rounds; the fastest is handed back")
    pick, times = fastest(variants, x)
    e2e = end_to_end_rows(times, pick)
    share = conv_share(variants[pick], x, target=tgt if tgt.kind == "cpu" else None) if pick != "default" else None
    result = OptimizeResult(name, out, rows, plan, e2e, time.perf_counter() - start, variants[pick], pick,
                            x, share, tgt)
    if save:
        deployment.save(result, save)
        log(f"      saved the {pick} model to {save} (maco.load({str(save)!r}, model) rebuilds it)")
    if engines and tgt.kind == "cpu":
        result.engines = beside_engines(result, model_text, model, save, list(engines), log)
    elif engines:
        log("      the other engines run on the CPU: none timed beside a CUDA model")
    write_outputs(result, tgt, records, swapped)
    return result


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
