"""One conv timed in its layouts for the latency data set: attempts until the rounds agree and the
canary reads quiet, each beside the FMA reference the conv's label is a ratio to."""
from __future__ import annotations

from typing import Any

import torch

from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing
from maco.kernels.cpu_peak import fma_reference
from maco.layouts.canary import QUIET_LOAD, SETTLED_LOAD, Canary
from maco.layouts.latency import measure_layouts


def _noise(timings: dict[str, Timing]) -> float:
    return max(t.stdev / t.median for t in timings.values())


def time_spec(canary: Canary, spec: ConvSpec, lays: list[str], dev: str, *, rounds: int, repeats: int,
              min_run_time: float, tolerance: float, attempts: int, patience: float,
              settle: bool = False) -> tuple[dict[str, Timing], float]:
    """One conv in `lays`, timed up to `attempts` times until settled and agreeing; the best
    attempt's timings and the canary's load around it. Each attempt first backs off while the
    canary reads a busy neighbour (QUIET_LOAD), or with `settle` while it reads a spell."""
    best: tuple[tuple[bool, bool, float], dict[str, Timing], float] | None = None
    for _ in range(max(attempts, 1)):
        before = canary.wait_quiet(patience, SETTLED_LOAD if settle else QUIET_LOAD)
        timings = measure_layouts(spec, lays, dev, rounds=rounds, repeats=repeats,
                                  min_run_time=min_run_time, reference=_reference(spec, dev))
        load = max(before, canary.load())
        score = (load > QUIET_LOAD, load > SETTLED_LOAD, _noise(timings))
        if best is None or score < best[0]:
            best = (score, timings, load)
        if not any(best[0][:2]) and best[0][2] <= tolerance:
            break
    return best[1], best[2]


def _reference(spec: ConvSpec, dev: str) -> Any:
    """On the CPU, the FMA loop (dataset.REFERENCE; the label that repeats is the conv's seconds
    over it, maco.core.timing); on a GPU, none."""
    if dev.startswith("cuda"):
        return None
    return fma_reference(spec.flops, Target.host(torch.get_num_threads()))
