"""The learned cost model: XGBoost on schedule features, trained on normalised throughput.

Features describe what MACO's bounds say matters: tile sizes per level, footprints per
memory level, the dataflow I/O each level's tile implies and its ratio to the lower bound,
register accumulators, vector use, arithmetic intensity and parallel work per core. Before a
conv has measurements of its own, a prior ranks it: the same regression trained on other convs'
measured schedules (shipped for AVX-512 CPUs; trained by maco.tune.cost_prior_train). Without
one, an analytic estimate from the same I/O numbers does, its ties broken by the register tile's
reuse per pass.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from maco.core.files import load_json, read_bytes
from maco.core.geometry import footprint
from maco.kernels import default_schedule
from maco.kernels.cpu_codegen import intrinsics_isa
from maco.tune.records import Record, normalized
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.schedule import LAYOUTS, SKETCHES, UNROLL_STEPS, Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.xgb_check import booster_from_doc, check_checksum

MIN_TRAINING_RECORDS = 8  # below this, the prior or the analytic estimate ranks better than a tiny model
PRIOR_FILE = Path(__file__).with_name("cost_prior_cpu.json")  # rebuilt by `python -m maco.tune.cost_prior_train`


def level_tiles(schedule: Schedule, spec: ConvSpec) -> list[tuple[int, int, int, int]]:
    """(x, y, z, c) tile per spatial level, outermost first: the output tile along ow, oh, k
    that one iteration of that level covers, and the input-channel chunk reduced inside it
    (the product of the c factors of the reduction levels the sketch nests below it)."""
    sketch = SKETCHES[schedule.kind]
    c_factors = schedule.factors("c")
    out, s_level, r_level = [], 0, 0
    for pos, token in enumerate(sketch):
        if token == "R":
            r_level += 1
            continue
        inner_r = sketch[pos + 1:].count("R")
        c_chunk = math.prod(c_factors[len(c_factors) - inner_r:]) if inner_r else 1
        out.append((schedule.tile("ow", s_level), schedule.tile("oh", s_level),
                    schedule.tile("k", s_level), c_chunk))
        s_level += 1
    return out


@lru_cache(maxsize=4096)
def _lower_bound(spec: ConvSpec, elements: int) -> float:
    from maco import bounds  # sympy: 0.7 s to import, paid by the analytic estimate only

    return max(bounds.best_lower_bound(spec, elements), 1.0)


def _dataflow_io(spec: ConvSpec, x: int, y: int, z: int) -> float:
    from maco import bounds

    return float(bounds.dataflow_io(spec, bounds.Tile(x, y, z)))


def register_intensity(spec: ConvSpec, schedule: Schedule) -> float:
    """MACs per element crossing between the register tile and the level under it
    (maco.bounds.hierarchy.chunk_intensity): the accumulators cross once per pass of the innermost
    channel chunk by its taps, so shallow passes move more per MAC. Nominal balances leave most
    of a pruned space compute-bound alike; this is the reuse that still tells them apart."""
    from maco.bounds.hierarchy import chunk_intensity

    t = schedule.register_tile()
    return float(chunk_intensity(spec, t["n"], t["g"], t["k"], t["oh"], t["ow"], schedule.factors("c")[-1], False,
                                 schedule.factors("kh")[-1], schedule.factors("kw")[-1]))


def features(spec: ConvSpec, target: Target, schedule: Schedule) -> list[float]:
    """One fixed-length feature vector; every size enters as log2 so trees split on ratios."""
    lg = lambda v: math.log2(max(float(v), 1.0))  # noqa: E731
    f: list[float] = [lg(v) for v in axis_extents(spec).values()]
    f += [lg(v) for factors in schedule.spatial + schedule.reduction for v in factors]
    tiles = level_tiles(schedule, spec)
    levels = target.levels
    for i, (x, y, z, c) in enumerate(tiles):
        mem = levels[min(len(levels) - 1, len(tiles) - 1 - i)]  # innermost tile <-> fastest level
        fp = footprint(spec, x, y, z, channels=c)
        io = _dataflow_io(spec, x, y, z)
        f += [lg(fp), fp / mem.elements_per_processor, lg(io),
              io / _lower_bound(spec, mem.elements_per_processor), lg(x * y), lg(z),
              math.log((x * y) / (spec.kh * spec.kw / (spec.stride[0] * spec.stride[1]) * z) + 1e-9)]
    reg = schedule.register_tile()
    outputs = math.prod(reg.values())
    xin = (reg["ow"] - 1) * spec.stride[1] + 1
    f += [schedule.accumulators, schedule.vector_width / target.simd_width,
          outputs / (reg["k"] + xin * reg["oh"]),  # register-tile arithmetic intensity, one tap
          lg(register_intensity(spec, schedule)),  # ... and per pass, the accumulators' crossings counted
          float(SPATIAL_AXES.index(schedule.vector_axis)), lg(schedule.factors(schedule.vector_axis)[-1])]
    par = math.prod(f0[0] for f0 in schedule.spatial[:schedule.parallel]) if schedule.kind == "cpu" \
        else math.prod(f0[0] for f0 in schedule.spatial)
    cores = max(target.cores, 1)
    f += [lg(par), par / cores, par / (math.ceil(par / cores) * cores), float(schedule.parallel)]
    f += [float(UNROLL_STEPS.index(schedule.unroll)) if schedule.unroll in UNROLL_STEPS else 0.0,
          float(LAYOUTS.index(schedule.layout)), float(schedule.weight_packing == "blocked"),
          float(_fast_micro_kernel(spec, target, schedule))]
    f += [float(REDUCTION_AXES.index(a)) for a in schedule.inner_order]
    return f


def _fast_micro_kernel(spec: ConvSpec, target: Target, schedule: Schedule) -> bool:
    """Whether the generated micro-kernel is vector intrinsics (CPU) rather than portable C,
    which measures 10-40x slower on the same tiles."""
    if schedule.kind != "cpu":
        return True
    return intrinsics_isa(spec, schedule, target) is not None


def analytic_seconds(spec: ConvSpec, target: Target, schedule: Schedule) -> float:
    """A roofline guess: the slower of compute at peak (scaled by vector and core use; a
    portable micro-kernel counts as scalar) and the dataflow I/O of the L1/L2-level tiles at
    rough per-level bandwidths."""
    peak = (target.peak_gflops or 100.0) * 1e9
    vec = (schedule.vector_width if _fast_micro_kernel(spec, target, schedule) else 1) / target.simd_width
    tiles = level_tiles(schedule, spec)
    par = math.prod(f0[0] for f0 in schedule.spatial[:max(schedule.parallel, 1)])
    core_use = min(par, target.cores) / target.cores
    latency_hiding = min(1.0, schedule.accumulators / (2 * target.fma_units * 2))  # FMA latency ~4
    compute = spec.flops / (peak * vec * max(core_use, 1 / target.cores) * latency_hiding)
    io = sum(_dataflow_io(spec, x, y, z) for x, y, z, _ in tiles[1:3]) * 4
    return max(compute, io / (100e9 * target.cores))


def analytic_score(spec: ConvSpec, target: Target, schedule: Schedule) -> float:
    """Higher is better: 1 / analytic_seconds, ties (a roofline leaves most of a pruned space
    compute-bound alike) broken by the register tile's reuse per pass (register_intensity)."""
    return (1.0 + 1e-3 * math.tanh(math.log(register_intensity(spec, schedule)))) / analytic_seconds(
        spec, target, schedule)


def training_rows(groups: dict[tuple[ConvSpec, Target], list[Record]]) -> tuple[list[list[float]], list[float]]:
    """Features and speed over the best of the same conv on the same machine (errors: 0)."""
    rows, ys = [], []
    for (spec, target), recs in groups.items():
        speed = [1.0 / v if v < math.inf else 0.0 for v in normalized(recs)]
        best = max(speed)
        if best <= 0:
            continue
        for r, v in zip(recs, speed):
            rows.append(features(spec, target, r.schedule))
            ys.append(v / best)
    return rows, ys


def train_booster(rows: list[list[float]], ys: list[float], seed: int, rounds: int):
    """Ansor's regression: weighted towards fast programs, which are the ones a search ranks."""
    import xgboost as xgb

    y = np.asarray(ys)
    dtrain = xgb.DMatrix(np.asarray(rows, dtype=np.float64), label=y, weight=np.maximum(y, 0.05))
    params = {"max_depth": 6, "eta": 0.2, "subsample": 0.9, "min_child_weight": 1,
              "objective": "reg:squarederror", "seed": seed, "nthread": 1, "verbosity": 0}
    return xgb.train(params, dtrain, num_boost_round=rounds)


MAX_PRIOR_BYTES = 64 << 20  # ~1 MB shipped


def load_prior(path: str | os.PathLike[str] = PRIOR_FILE):
    """A prior booster from its file, checked before XGBoost reads it: its sha256 (the learner
    attribute `sha256`, which `python -m maco.tune.cost_prior_train` writes) must match its
    content, so a damaged file is named, and its trees must be proper trees (maco.core.xgb_check),
    so a crafted one is refused with one line rather than crashing XGBoost's native code."""
    what = f"cost-model prior {str(path)!r}"
    doc = load_json(read_bytes(path, "cost-model prior", MAX_PRIOR_BYTES), what, MAX_PRIOR_BYTES)
    check_checksum(doc, f"{what} (rebuild it with `python -m maco.tune.cost_prior_train`)")
    return booster_from_doc(doc, what)  # one thread, as the fitted model: no OpenMP pool in the tuner


@lru_cache(maxsize=1)
def shipped_prior():
    """The prior shipped with MACO (PRIOR_FILE), or None where the file is absent."""
    if not PRIOR_FILE.is_file():
        return None
    return load_prior(PRIOR_FILE)


def prior_fits(booster, target: Target) -> bool:
    """Whether `booster` was trained on `target`'s ISA with today's feature vector."""
    isas = (booster.attr("isas") or "").split(",")
    if target.kind != "cpu" or target.isa not in isas:
        return False
    spec = ConvSpec(n=1, c=16, h=8, w=8, k=16, kh=3, kw=3, padding=(1, 1))
    return booster.num_features() == len(features(spec, target, default_schedule(spec, target, "NHWC")))


class CostModel:
    """XGBoost regression on features -> throughput normalised per task, weighted towards fast
    programs (Ansor). One model per target; `predict` returns higher-is-better scores.
    A conv with fewer than MIN_TRAINING_RECORDS measurements of its own is ranked by the prior
    (a model trained on other convs' measurements, `prior`: True for the shipped one where it fits
    the target, False for none, or a booster from train_prior), else by the analytic estimate."""

    def __init__(self, target: Target, seed: int = 0, rounds: int = 200, prior=True):
        self.target, self.seed, self.rounds = target, seed, rounds
        self.booster = None
        self.trained_on: set[ConvSpec] = set()  # convs with enough own records in the fit
        if prior is True:
            prior = shipped_prior() if target.kind == "cpu" else None
        self.prior = prior if prior is not None and prior is not False and prior_fits(prior, target) else None

    def fit(self, records: Sequence[Record]) -> "CostModel":
        fingerprint = self.target.fingerprint()
        groups: dict[tuple[ConvSpec, Target], list[Record]] = {}
        for r in records:
            if r.target == fingerprint and not r.retryable:  # a timeout says nothing of speed
                groups.setdefault((r.spec, self.target), []).append(r)
        rows, ys = training_rows(groups)
        self.trained_on = {spec for (spec, _), recs in groups.items() if len(recs) >= MIN_TRAINING_RECORDS}
        if len(rows) < MIN_TRAINING_RECORDS or not self.trained_on:
            self.booster = None
            return self
        self.booster = train_booster(rows, ys, self.seed, self.rounds)
        return self

    def predict(self, spec: ConvSpec, schedules: Sequence[Schedule]) -> np.ndarray:
        if not schedules:
            return np.zeros(0)
        booster = self.booster if self.booster is not None and spec in self.trained_on else self.prior
        if booster is None:
            return np.asarray([analytic_score(spec, self.target, s) for s in schedules])
        import xgboost as xgb

        x = np.asarray([features(spec, self.target, s) for s in schedules], dtype=np.float64)
        return booster.predict(xgb.DMatrix(x))

