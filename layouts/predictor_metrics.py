"""How well a layout predictor does on rows it has not seen: spec-grouped splits, R2 on latency
and log latency, and how often (and how dearly) its picks of a conv's faster layout go wrong."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec


def split_by_spec(specs: Sequence[ConvSpec], test_fraction: float = 0.2,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test) with every layout of a conv on the same side, so a test conv
    is unseen and its layouts can be compared."""
    if not 0 < test_fraction < 1:
        raise MacoError(f"test fraction must lie in (0, 1), got {test_fraction}")
    distinct = sorted({str(s) for s in specs})
    random.Random(seed).shuffle(distinct)
    test = set(distinct[:max(1, int(round(len(distinct) * test_fraction)))])
    is_test = np.array([str(s) in test for s in specs])
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


@dataclass
class Metrics:
    """How well predicted seconds match measured ones, and what a planner would lose."""

    r2: float  # on seconds
    r2_log: float  # on log seconds
    median_rel_error: float
    wrong_picks: float  # fraction of convs whose predicted-faster layout is the slower one
    wrong_picks_5pct: float  # the same, counting only convs whose layouts differ by > 5%
    pick_cost: float  # extra seconds of the wrong picks / seconds of the best layouts
    pairs: int  # convs with every layout measured
    within_10pct: float = float("nan")  # share of rows predicted within +-10%
    wrong_clear: float = float("nan")  # wrong picks among the convs whose layouts differ by > 5%
    clear_pairs: int = 0  # those convs
    rel_errors: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if k != "rel_errors"}


def r2_score(y: np.ndarray, p: np.ndarray) -> float:
    ss_res = float(np.sum((y - p) ** 2))
    ss_tot = float(np.sum((y - np.mean(y)) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def evaluate(specs: Sequence[ConvSpec], layouts: Sequence[str], measured: np.ndarray,
             predicted: np.ndarray) -> Metrics:
    measured, predicted = np.asarray(measured, float), np.asarray(predicted, float)
    safe = np.maximum(predicted, 1e-12)  # a raw-target model can predict <= 0
    errors = np.abs(predicted - measured) / measured
    by_spec: dict[str, dict[str, tuple[float, float]]] = {}
    for s, lay, m, p in zip(specs, layouts, measured, predicted):
        by_spec.setdefault(str(s), {})[lay] = (m, p)
    wrong = wrong5 = pairs = clear = 0
    extra = best_total = 0.0
    for d in by_spec.values():
        if len(d) < 2:
            continue
        pairs += 1
        best = min(d, key=lambda k: d[k][0])
        chosen = min(d, key=lambda k: d[k][1])
        best_total += d[best][0]
        clear += max(m for m, _ in d.values()) > 1.05 * d[best][0]
        if chosen != best:
            wrong += 1
            extra += d[chosen][0] - d[best][0]
            wrong5 += d[chosen][0] > 1.05 * d[best][0]
    return Metrics(r2=r2_score(measured, predicted),
                   r2_log=r2_score(np.log(measured), np.log(safe)),
                   median_rel_error=float(np.median(errors)),
                   wrong_picks=wrong / pairs if pairs else float("nan"),
                   wrong_picks_5pct=wrong5 / pairs if pairs else float("nan"),
                   pick_cost=extra / best_total if best_total else float("nan"), pairs=pairs,
                   within_10pct=float(np.mean(errors <= 0.10)) if len(errors) else float("nan"),
                   wrong_clear=wrong5 / clear if clear else float("nan"), clear_pairs=clear,
                   rel_errors=errors)
