"""Where a plan's seconds come from: one `Costs` per latency source a user can name.

    costs = latency_source("measure")                  # torch on this machine
    costs = latency_source("predict")                  # the trained predictor (default: shipped)
    costs = latency_source(RecordFile(path))           # tuning records measured on this machine
    costs = latency_source({"conv1": {"NCHW": s, ...}})  # or {(spec, layout): s}, or (spec, layout) -> s
    costs.conv([(name, spec), ...], ["NCHW", "NHWC"]), costs.conversion(shape, "NCHW", "NHWC")
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from maco.core.errors import MacoError
from maco.core.files import load_json_file
from maco.tune.records import Record, RecordFile, best_per_layout
from maco.core.spec import ConvSpec
from maco.core.target import Target

from maco.layouts.latency import ConversionModel, measure_conversion, measure_layouts, predict_conversion
from maco.layouts.predictor import LatencyPredictor
from maco.layouts.problem import ConversionCost

# The predictors trained on this repository's data sets, one per CPU that timed the labels, shipped
# inside the package so that a non-editable install finds them too (results/predictor_cpu* is where
# experiments retrain them). The default, for a CPU none was trained on: the Intel Xeon VM's.
DEFAULT_PREDICTOR = str(Path(__file__).resolve().with_name("predictor_cpu"))

# How "measure" times each distinct conv: interleaved rounds of both layouts, each by the protocol.
MEASURE = {"rounds": 3, "repeats": 3, "min_run_time": 2e-3}

# Seconds per layout of each named conv: {name: {layout: seconds}}, for all convs at once.
ConvSource = Callable[[list[tuple[str, ConvSpec]], Sequence[str]], dict[str, dict[str, float]]]


@dataclass
class Costs:
    """Per-layer conv seconds and per-tensor conversion seconds for one model, and where they
    came from. `conv` is filled by a source for a list of (name, spec) at once (measuring
    interleaves layouts; predicting batches); `conversion` is asked per distinct shape."""

    describe: str
    conv: ConvSource
    conversion: ConversionCost


def _measure_convs(device: str, progress: bool) -> ConvSource:
    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        from tqdm import tqdm  # only for a progress bar

        by_spec: dict[ConvSpec, dict[str, float]] = {}
        specs = list(dict.fromkeys(spec for _, spec in convs))
        for spec in tqdm(specs, desc="measuring convs", unit="conv", disable=not progress, leave=False):
            timings = measure_layouts(spec, layouts, device, **MEASURE)
            by_spec[spec] = {lay: t.median for lay, t in timings.items()}
        return {name: by_spec[spec] for name, spec in convs}
    return run


def _measure_conversion(device: str) -> ConversionCost:
    cache: dict[tuple, float] = {}

    def run(shape: tuple[int, ...], src: str, dst: str) -> float:
        key = (tuple(shape), src, dst)
        if key not in cache:
            cache[key] = measure_conversion(shape, src, dst, device, repeats=3).median
        return cache[key]
    return run


# The FMA loop's work when a ratio predictor's reference is timed now: ~2-5 ms on 2 cores.
REFERENCE_FLOPS = 1e9


def at_speed_now(predictor: LatencyPredictor) -> LatencyPredictor:
    """A predictor trained on ratios to the FMA reference gives seconds at the reference's speed
    measured now (median of 7 runs), so a spell of a slow VM slows its predictions alike. Warns
    when the predictor's labels were timed on another CPU."""
    if why := predictor.foreign_to(Target.host().model):
        warnings.warn(why, stacklevel=2)
    if predictor.label != "ratio" or predictor.device != "cpu":
        return predictor
    import torch

    from maco.kernels.cpu_peak import fma_reference
    from maco.core.timing import time_callable

    run = fma_reference(REFERENCE_FLOPS, Target.host(torch.get_num_threads()))
    seconds = time_callable(run, repeats=7, min_run_time=1e-3).median
    return predictor.at_speed(REFERENCE_FLOPS / seconds / 1e9)


def _predicted_convs(predictor: LatencyPredictor) -> ConvSource:
    now: list[LatencyPredictor] = []

    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        pairs = [(name, spec, lay) for name, spec in convs for lay in layouts]
        if pairs and not now:
            now.append(at_speed_now(predictor))
        secs = now[0].predict_many([s for _, s, _ in pairs], [lay for _, _, lay in pairs]) if pairs else []
        out: dict[str, dict[str, float]] = {}
        for (name, _, lay), sec in zip(pairs, secs):
            out.setdefault(name, {})[lay] = float(sec)
        return out
    return run


def _table_convs(lookup: Callable[[str, ConvSpec, str], float | None], what: str) -> ConvSource:
    def run(convs: list[tuple[str, ConvSpec]], layouts: Sequence[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, spec in convs:
            for lay in layouts:
                sec = lookup(name, spec, lay)
                if sec is None:
                    raise MacoError(f"{what}: no latency for conv layer {name!r} ({spec}) in {lay}")
                out.setdefault(name, {})[lay] = float(sec)
        return out
    return run


def shipped_predictor(cpu: str | None = None) -> str:
    """The shipped predictor whose labels were timed on `cpu` (default: this host's), else
    DEFAULT_PREDICTOR: the faster layout of a conv differs from CPU to CPU."""
    cpu = cpu or Target.host().model
    for folder in sorted(Path(DEFAULT_PREDICTOR).parent.glob("predictor_cpu*")):
        doc = load_json_file(folder / "predictor.json", "latency predictor")
        meta = doc.get("meta") if isinstance(doc, dict) else None
        if isinstance(meta, dict) and cpu in (meta.get("cpus") or []):
            return str(folder)
    return DEFAULT_PREDICTOR


def load_predictor(predictor: LatencyPredictor | str | os.PathLike[str] | None = None) -> LatencyPredictor:
    """A LatencyPredictor: the one given, one loaded from a path, or the default
    ($MACO_PREDICTOR, else the shipped one for this CPU, shipped_predictor)."""
    if isinstance(predictor, LatencyPredictor):
        return predictor
    path = predictor or os.environ.get("MACO_PREDICTOR") or shipped_predictor()
    if not (Path(path) / "predictor.json").exists():
        raise MacoError(f"no trained latency predictor at {str(path)!r}; train one with "
                        "`python -m maco.layouts.predictor_cli results/dataset_cpu.csv results/predictor_cpu` "
                        "and pass predictor=PATH or set $MACO_PREDICTOR")
    return LatencyPredictor.load(path)


def _conversion_source(conversion: Any, device: str, predictor: LatencyPredictor | None = None) -> ConversionCost:
    if conversion is None or conversion == "measure":
        return _measure_conversion(device)
    if conversion == "predict":
        if predictor is not None:
            return predictor.predict_conversion
        return lambda shape, a, b: predict_conversion(shape, a, b, device)
    if isinstance(conversion, ConversionModel):
        return conversion.predict
    if isinstance(conversion, Mapping):
        def lookup(shape: tuple[int, ...], a: str, b: str) -> float:
            for key in ((tuple(shape), a, b), (a, b)):
                if key in conversion:
                    return float(conversion[key])
            raise MacoError(f"the conversion table has no entry for shape {tuple(shape)} {a}->{b}")
        return lookup
    if callable(conversion):
        return lambda shape, a, b: float(conversion(tuple(shape), a, b))
    raise MacoError(f"conversion must be 'measure', 'predict', a ConversionModel, a dict or a "
                    f"callable (shape, src, dst) -> seconds; got {conversion!r}")


def device_target(device: str) -> Target:
    """The Target whose tuning records describe `device`: the host CPU, or the H100 for cuda."""
    return Target.h100() if str(device).startswith("cuda") else Target.host()


def latency_source(latency: Any, *, predictor: LatencyPredictor | str | os.PathLike[str] | None = None,
                   conversion: Any = None, device: str = "cpu", target: Target | None = None,
                   progress: bool = False) -> Costs:
    """Costs from `latency`: "measure" (torch, this machine), "predict" (a LatencyPredictor),
    a LatencyPredictor, tuning records (a RecordFile or Records: the best per spec and layout
    among those measured on `target`, by default device_target(device)), a dict ({layer name:
    {layout: s}} or {(ConvSpec, layout): s}) or a callable (spec, layout) -> s. Conversions:
    measured for "measure", the predictor's for "predict", else `conversion` ("measure" by
    default, "predict", a ConversionModel, a dict or a callable)."""
    if isinstance(latency, str):
        if latency == "measure":
            return Costs(f"measured with torch on {device}", _measure_convs(device, progress),
                         _conversion_source(conversion or "measure", device))
        if latency == "predict":
            pred = load_predictor(predictor)
            return Costs("predicted by the latency predictor", _predicted_convs(pred),
                         _conversion_source(conversion or "predict", device, pred))
        raise MacoError(f"unknown latency source {latency!r}; use 'measure', 'predict', a "
                        "predictor, records, a dict or a callable")
    conv_cost = _conversion_source(conversion, device)
    if isinstance(latency, LatencyPredictor):
        return Costs("predicted by the latency predictor", _predicted_convs(latency),
                     _conversion_source(conversion or "predict", device, latency))
    if isinstance(latency, (RecordFile, list, tuple)) and (
            isinstance(latency, RecordFile) or all(isinstance(r, Record) for r in latency)):
        records = latency.load() if isinstance(latency, RecordFile) else list(latency)
        target = target or device_target(device)
        best = best_per_layout(records, target)

        def best_seconds(name: str, spec: ConvSpec, lay: str) -> float | None:
            return best[(spec, lay)].seconds if (spec, lay) in best else None
        return Costs(f"{len(records)} tuning records",
                     _table_convs(best_seconds, f"the records measured on target {target.name!r}"), conv_cost)
    if isinstance(latency, Mapping):
        def lookup(name: str, spec: ConvSpec, lay: str) -> float | None:
            if name in latency and isinstance(latency[name], Mapping):
                return latency[name].get(lay)
            return latency.get((spec, lay))
        return Costs("a latency table", _table_convs(lookup, "the latency table"), conv_cost)
    if callable(latency):
        return Costs(f"the function {getattr(latency, '__name__', 'latency')}",
                     _table_convs(lambda name, spec, lay: latency(spec, lay), "the latency function"),
                     conv_cost)
    raise MacoError(f"unsupported latency source {latency!r}")


__all__ = ["Costs", "ConvSource", "latency_source", "load_predictor", "at_speed_now", "device_target",
           "DEFAULT_PREDICTOR", "MEASURE", "shipped_predictor"]
