"""The collection campaign behind the latency data set: every conv timed in every layout here
(beside the canary, timed again at the end where a spell slowed it) or on a Ray cluster, its
rows appended as it finishes, so an interrupted run resumes where it stopped."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.core.timing import Timing, environment
from maco.layouts.canary import QUIET_LOAD, SETTLED_LOAD, Canary
from maco.layouts.collection_cluster import collect_on_cluster
from maco.layouts.conv_timing import time_spec
from maco.layouts.dataset import REFERENCE, Dataset, Row, best_rows
from maco.layouts.latency import LAYOUTS, check_device, check_layout

SETTLE_PASSES = 2  # a spec timed above SETTLED_LOAD is timed again at the end, up to this often,
# each time once the canary reads settled (or `patience` ran out): spells last seconds to minutes,
# longer than the immediate attempts wait.

Todo = list[tuple[str, ConvSpec, list[str]]]  # (source, spec, layouts) still to time


@dataclass
class CollectSummary:
    measured: int  # specs timed now (all their layouts)
    skipped: int  # specs whose layouts were all already present (and quiet enough)
    retimed: int  # of `measured`, specs timed again because their rows were noisy or loaded
    deferred: int  # of `measured`, specs timed again at the end, having been timed in a spell
    unsettled: int  # of `measured`, specs never timed settled (canary within SETTLED_LOAD)
    loaded: int  # of `measured`, specs whose best attempt still ran beside a busy neighbour
    rows: int  # distinct (spec, layout, device) rows in the file afterwards
    bad_lines: int
    seconds: float


def collect(path: str | os.PathLike[str], specs: Sequence[tuple[str, ConvSpec]],
            layouts: Sequence[str] = LAYOUTS, device: str = "cpu", *, rounds: int = 3,
            repeats: int = 3, min_run_time: float = 1e-3, tolerance: float = 0.1,
            attempts: int = 3, retime_noisy: bool = False, threads: int | None = None,
            patience: float = 30.0, progress: bool = True, cluster: str | None = None) -> CollectSummary:
    """Time every (source, spec) in every layout (interleaved, see measure_layouts) and append
    the rows; keys already in the file are skipped, so an interrupted run resumes.

    A spec whose timing rounds disagree by more than `tolerance` (stdev / median of the round
    medians), or beside a busy neighbour (see Canary; collection first backs off up to
    `patience` seconds), is timed again, up to `attempts` times, keeping the best attempt; one timed
    in a spell (canary above SETTLED_LOAD) is timed again at the end of the run once the canary
    settles (SETTLE_PASSES passes; a pass stops where a spell outlasts `patience`). With
    `retime_noisy`, specs whose rows in the file are noisy or loaded are timed again too (new
    rows are appended; load_rows keeps the best). `threads` sets torch's intra-op threads.
    `cluster` (a Ray address) times the specs on that cluster's machines of this one's kind, one
    spec at a time per machine, each row naming its machine's environment."""
    start = time.perf_counter()
    layouts = [check_layout(lay) for lay in layouts]
    dev = str(check_device(device))
    if threads is not None:
        if threads <= 0:
            raise MacoError(f"threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    if cluster is not None:
        from maco.tune.cluster import check_address

        cluster = check_address(cluster)
    ds = Dataset(path)
    todo, skipped, retimed = _todo(ds, specs, layouts, dev, retime_noisy, tolerance)
    params = dict(rounds=rounds, repeats=repeats, min_run_time=min_run_time, tolerance=tolerance,
                  attempts=attempts, patience=patience)
    from tqdm import tqdm

    kept = _Kept(ds, dev, tqdm(total=len(todo), desc="collect", unit="conv", disable=not progress))
    with kept.bar:
        if cluster is None:
            _collect_here(kept, todo, params)
        elif todo:
            collect_on_cluster(cluster, ds, todo, dev, params, kept.keep)
    rows = best_rows(ds.load())
    loads = kept.loads.values()
    return CollectSummary(measured=len(todo), skipped=skipped, retimed=retimed, deferred=len(kept.again),
                          unsettled=sum(load > SETTLED_LOAD for load in loads),
                          loaded=sum(load > QUIET_LOAD for load in loads), rows=len(rows),
                          bad_lines=len(ds.bad_lines), seconds=time.perf_counter() - start)


def _todo(ds: Dataset, specs: Sequence[tuple[str, ConvSpec]], layouts: list[str], dev: str,
          retime_noisy: bool, tolerance: float) -> tuple[Todo, int, int]:
    """(what to time, how many distinct specs are skipped, how many are timed again): a spec with a
    layout missing from the file, or with `retime_noisy` one whose rows are noisy or loaded."""
    have = {row.key: row for row in best_rows(ds.load())}
    todo: Todo = []
    seen: set[ConvSpec] = set()
    retimed = 0
    for source, spec in specs:
        if spec in seen:
            continue
        seen.add(spec)
        old = [have.get((str(spec), lay, dev)) for lay in layouts]
        if any(r is None for r in old):
            todo.append((source, spec, layouts))
        elif retime_noisy and any(r.noise > tolerance or not r.quiet for r in old if r):
            todo.append((source, spec, layouts))
            retimed += 1
    return todo, len(seen) - len(todo), retimed


class _Kept:
    """Appends a timed spec's rows as soon as it finishes (a crash loses no finished spec) and
    remembers the lowest canary load each spec was timed at."""

    def __init__(self, ds: Dataset, dev: str, bar: Any):
        self.ds, self.dev, self.bar = ds, dev, bar
        self.loads: dict[ConvSpec, float] = {}
        self.again: set[ConvSpec] = set()  # specs timed again at the end, having been timed in a spell

    def keep(self, source: str, spec: ConvSpec, lays: list[str], timings: dict[str, Timing], load: float,
             env_id: str) -> None:
        self.loads[spec] = min(load, self.loads.get(spec, math.inf))
        now = time.time()
        self.ds.append(Row(spec, lay, self.dev, source, timings[lay], env_id, now, load) for lay in lays)
        self.bar.update()


def _collect_here(kept: _Kept, todo: Todo, params: dict[str, Any]) -> None:
    """`todo` timed on this machine beside one canary, then the specs timed in a spell again."""
    env_id = kept.ds.record_environment({**environment(), "torch_threads": torch.get_num_threads(),
                                         "reference": REFERENCE})
    canary = Canary(kept.dev) if todo else None
    for source, spec, lays in todo:
        kept.keep(source, spec, lays, *time_spec(canary, spec, lays, kept.dev, **params), env_id)
    for _ in range(SETTLE_PASSES):
        pending = [item for item in todo if kept.loads[item[1]] > SETTLED_LOAD]
        kept.bar.total += len(pending)
        for n, (source, spec, lays) in enumerate(pending):  # best_rows keeps the settled row
            timings, load = time_spec(canary, spec, lays, kept.dev, settle=True, **dict(params, attempts=1))
            kept.keep(source, spec, lays, timings, load, env_id)
            kept.again.add(spec)
            if load > SETTLED_LOAD:  # the spell outlasted `patience`: on to the next pass
                kept.bar.update(len(pending) - n - 1)
                break
