"""Tuning one conv or a whole network: the task scheduler (Ansor section 6) hands rounds of the
evolutionary search (maco.tune.search) to the layers that matter most for end-to-end time, and
`tune_layers` wires it to the measuring worker, the default seeds and a progress bar."""
from __future__ import annotations

import math
import random
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from maco import kernels
from maco.tune.cost_model import CostModel
from maco.core.errors import MacoError
from maco.tune.measure import MeasureConfig, Measurer, Runner
from maco.tune.records import Baseline, Entry, Record, RecordFile, RecordStore, latest_baselines, make_baseline, normalized
from maco.core.schedule import LAYOUTS
from maco.tune.search import MeasureFunction, SearchConfig, TaskState, follow, search_round, take
from maco.core.spec import ConvSpec
from maco.core.target import Target, require_memory
from maco.core.timing import environment

# Measurements per distinct conv layer. quick: the two bound-derived defaults plus a short search.
BUDGETS = {"quick": 24, "normal": 48, "thorough": 128}
# quick is a first look: at most this many measurements in all, however many distinct convs a
# network has (EfficientNet-B0 has 46); the task scheduler spends them where the time is.
BUDGET_CAPS = {"quick": 320}
# A conv with less than this share of the network's conv work (weights counted) takes
# microseconds, where no schedule gains what a search costs: its defaults are measured, no more.
SEARCH_MIN_SHARE = 1e-3
PLAIN_EVERY_S = 10.0  # where stdout is no terminal (a log), a progress line at most this often


@dataclass
class Task:
    """A distinct conv of a network; `weight` is how many layers share it."""

    name: str
    spec: ConvSpec
    weight: int = 1
    seeds: tuple = ()  # schedules to measure first (e.g. the bound-derived default)


@dataclass
class TaskScheduler:
    """Gradient-based allocation of search rounds over tasks (Ansor 6). The objective is the
    end-to-end time sum_i w_i * g_i (g_i the task's best latency); each round goes to the task
    whose objective is predicted to fall fastest, from its recent gain and an optimistic guess."""

    alpha: float = 0.2  # weight of the backward (observed) gradient vs the optimistic one
    window: int = 3  # rounds over which the recent gain is measured
    history: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # (trials, best)

    def record(self, index: int, trials: int, best_seconds: float) -> None:
        self.history.setdefault(index, []).append((trials, best_seconds))

    def gradient(self, index: int, task: Task) -> float:
        hist = self.history.get(index, [])
        if not hist:
            return -math.inf  # every task gets a first round
        trials, best = hist[-1]
        if not math.isfinite(best):
            return -math.inf if trials < 64 else 0.0  # keep trying a task with no valid schedule a while
        back = 0.0
        if len(hist) > self.window:
            t0, g0 = hist[-1 - self.window]
            if math.isfinite(g0) and trials > t0:
                back = (best - g0) / (trials - t0)
        optimistic = -best / max(trials, 1)
        return task.weight * (self.alpha * back + (1 - self.alpha) * optimistic)

    def next_task(self, tasks: Sequence[Task]) -> int:
        return min(range(len(tasks)), key=lambda i: (self.gradient(i, tasks[i]), i))


@dataclass
class TuneResult:
    tasks: list[Task]
    states: list[TaskState]
    trials: int  # measurements taken in this run

    def best(self, index: int):
        return self.states[index].best


def budget_trials(budget: str, layers: int) -> int:
    """Measurements in all for `layers` distinct convs on `budget` (BUDGETS, BUDGET_CAPS)."""
    if budget not in BUDGETS:
        raise MacoError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)}")
    return min(BUDGETS[budget] * layers, BUDGET_CAPS.get(budget, BUDGETS[budget] * layers))


def tune(tasks: Sequence[Task], target: Target, trials: int, measurer: MeasureFunction,
         records: str | Path | RecordFile | None = None, config: SearchConfig | None = None, seed: int = 0,
         progress: Callable[[int, int, Task, TaskState], None] | None = None, prior=True,
         known: Sequence[Entry] | None = None) -> TuneResult:
    """Spend `trials` measurements over `tasks`. Records already in the file count towards
    the budget of their task, so re-running the same command resumes where it stopped. Runs may
    share the file: before each round this one reads what the others appended (search.follow),
    which counts towards the budget too, and it never measures a schedule another run measured
    or is measuring (search_round's claims). `prior`: the cost model's ranking of a conv
    without records (CostModel). `known`: the file's entries as the caller read them through
    `records` (a RecordFile that goes on from that read, RecordStore.resume), so it is not read
    again. A task below SEARCH_MIN_SHARE of the tasks' work gets its seeds measured and no search."""
    if trials < 0:
        raise MacoError(f"trials must be >= 0, got {trials}")
    if not tasks:
        raise MacoError("nothing to tune: no conv layers given")
    config = config or SearchConfig()
    rng = random.Random(seed)
    store = records if isinstance(records, RecordFile) else RecordFile(records) if records else None
    states = [TaskState(t.spec) for t in tasks]
    sched = TaskScheduler()
    work = sum(t.weight * t.spec.flops for t in tasks)
    seeds_only = [t.weight * t.spec.flops < SEARCH_MIN_SHARE * work for t in tasks]

    def count(changed: Sequence[int]) -> None:
        for j in changed:
            if states[j].records and sched.history.get(j, [(0, 0)])[-1][0] < 10**9:
                sched.record(j, len(states[j].records), states[j].best_seconds())

    def refresh() -> None:  # the records other runs appended since (all of them the first time)
        count(follow(store, states, target) if store else ())

    if known is not None:
        count(take(known, True, states, target))
    refresh()
    model = CostModel(target, seed=seed, prior=prior)
    done, measured = sum(len(s.records) for s in states), 0
    while done < trials:
        i = sched.next_task(tasks)
        state = states[i]
        if seeds_only[i] and state.records:
            new = []  # its defaults measured (now or by an earlier run): no search
        else:
            model.fit([r for s in states for r in s.records])
            n = max(len(tasks[i].seeds), 1) if seeds_only[i] else \
                _round_size(i, sched, len(tasks), config.batch, trials - done)
            new = search_round(state, target, model, measurer, rng, config, n=min(n, trials - done),
                               records=store, seeds=tasks[i].seeds, refresh=refresh)
        if not new:  # the space of this task is exhausted (or every candidate left is another run's)
            sched.record(i, 10**9, state.best_seconds())
            if all(sched.history.get(j, [(0, 0)])[-1][0] >= 10**9 for j in range(len(tasks))):
                break
            continue
        measured += len(new)
        refresh()
        done = sum(len(s.records) for s in states)
        sched.record(i, len(state.records), state.best_seconds())
        if progress:
            progress(done, trials, tasks[i], state)
    return TuneResult(list(tasks), states, measured)


def _round_size(index: int, sched: TaskScheduler, n_tasks: int, batch: int, left: int) -> int:
    """A full batch, except in a task's first round, which takes only its fair share of what is
    left, so that a budget smaller than batch * tasks still measures every task."""
    if index in sched.history:
        return min(batch, left)
    unvisited = sum(1 for j in range(n_tasks) if j not in sched.history)
    return max(1, min(batch, left // max(unvisited, 1)))


@dataclass
class LayerResult:
    name: str
    spec: ConvSpec
    weight: int
    best: Record | None
    trials: int
    torch_nchw: float | None  # seconds
    torch_nhwc: float | None


def default_seeds(spec: ConvSpec, target: Target, layouts: tuple[str, ...]) -> tuple:
    """The bound-derived default schedule of each layout: measured first by every search."""
    seeds = []
    for layout in layouts:
        try:
            seeds.append(kernels.default_schedule(spec, target, layout))
        except MacoError:
            pass  # no default for this layout: the search starts from samples alone
    return tuple(seeds)


def tune_layers(layers: list[tuple[str, ConvSpec]], target: Target, trials: int, *,
                records: str | Path, pruned: bool = True, seed: int = 0, round_size: int = 16,
                layouts: tuple[str, ...] = ("NCHW", "NHWC"), timeout: float = 120.0,
                baselines: bool = True, weights: list[int] | None = None,
                cluster: str | None = None, store: RecordStore | None = None) -> list[LayerResult]:
    """Tune `layers` with a shared budget of `trials` measurements; returns one result per layer.
    `cluster` (a Ray address, maco.tune.cluster.ADDRESSES) builds on every node of that cluster and
    measures on its machines of `target`; without it nothing imports Ray. `store`: the records as
    the caller read them (`records` one of its files): the tuner resumes from that read and the
    baselines from its refresh, so the file is not read again."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    weights = weights or [_weight(name) for name, _ in layers]
    if target.kind == "cpu":
        for name, spec in layers:
            require_memory(spec.working_bytes, f"measuring {name} ({spec})")
    tasks = [Task(name, spec, w, default_seeds(spec, target, layouts))
             for (name, spec), w in zip(layers, weights)]
    config = SearchConfig(batch=round_size, pruned=pruned, allowed_layouts=layouts)
    with ExitStack() as stack:
        measurer = stack.enter_context(_measurer(target, MeasureConfig(timeout=timeout), cluster, stack))
        bar = stack.enter_context(Progress(
            TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.description}"), transient=False))
        job = bar.add_task("", total=trials)

        plain, last = not bar.console.is_terminal, [time.monotonic()]  # a log file sees no live bar

        def progress(done: int, total: int, task: Task, state: TaskState) -> None:
            best = state.best
            gf = f"{best.gflops:.1f} GFLOP/s" if best else "no valid kernel yet"
            bar.update(job, completed=min(done, total), description=f"{task.name}: {gf}")
            if plain and (time.monotonic() - last[0] >= PLAIN_EVERY_S or done >= total):
                last[0] = time.monotonic()
                bar.console.print(f"tuning {min(done, total)}/{total} measurements; {task.name}: {gf}")

        file, known = store.resume(records) if store is not None else (records, None)
        result = tune(tasks, target, trials, measurer, records=file, config=config, seed=seed,
                      progress=progress, known=known)
        bar.update(job, completed=trials)
        torch_s = {}
        if baselines:
            bar.update(job, description="timing torch's conv (layers without a baseline in the records)")
            stored = None
            if store is not None:
                store.refresh()
                stored = store.baselines_in(records)
            torch_s = measure_baselines([t.spec for t in tasks], target, records, measurer=measurer, stored=stored)
        out = [LayerResult(task.name, task.spec, task.weight, state.best, len(state.records),
                           torch_s.get((task.spec, "NCHW")), torch_s.get((task.spec, "NHWC")))
               for task, state in zip(tasks, result.states)]
    return out


def measure_baselines(specs: Sequence[ConvSpec], target: Target, records: str | Path,
                      layouts: Sequence[str] = LAYOUTS, measurer: Any = None,
                      stored: Mapping[tuple[ConvSpec, str], Baseline] | None = None
                      ) -> dict[tuple[ConvSpec, str], float]:
    """torch's seconds per (spec, layout) for planning: the records' baseline where they have one
    (records.latest_baselines), else timed by the tuner's worker (`measurer`, or one started here
    only if something is missing) and appended to `records` as a baseline. So `maco optimize` and
    the torch.compile backend, reading the same file, plan with the same numbers. A layout torch
    fails to time is left out. `stored`: the records' latest baselines, when the caller read them
    already (records.RecordStore), so the file is not read again."""
    file = RecordFile(records)
    have = latest_baselines(file.load_baselines(), target) if stored is None else stored
    todo = [(spec, layout) for spec in dict.fromkeys(specs) for layout in layouts if (spec, layout) not in have]
    new = []
    if todo:
        with ExitStack() as stack:
            measurer = measurer or stack.enter_context(Measurer(target))
            for spec, layout in todo:
                timing, _, *env = measurer.baseline(spec, layout)
                if timing is not None:
                    new.append(make_baseline(spec, target, layout, timing, env=env[0] if env else None))
        file.append(new)
    seconds = {key: b.seconds for key, b in have.items() if key[0] in specs and key[1] in layouts}
    return seconds | {(b.spec, b.layout): b.seconds for b in new}


def _measurer(target: Target, config: MeasureConfig, cluster: str | None, stack: ExitStack) -> Runner:
    """This machine's measuring worker, or the cluster's (its connection closed with `stack`)."""
    if cluster is None:
        return Measurer(target, config)
    from maco.tune.cluster import Cluster
    from maco.tune.cluster_measure import ClusterMeasurer

    return ClusterMeasurer(stack.enter_context(Cluster(cluster)), target, config)


def _weight(name: str) -> int:
    """'layer3.0.conv2 (+2)' stands for 3 layers."""
    if name.endswith(")") and "(+" in name:
        try:
            return 1 + int(name[name.rindex("(+") + 2:-1])
        except ValueError:
            pass
    return 1


@dataclass
class RetimeSummary:
    retimed: int  # records measured again and rewritten
    failed: int  # records whose new measurement failed (kept as they were)
    unreferenced: int  # of `retimed`, records that had no reference before
    change: float  # median of new seconds / old seconds over `retimed`


def retime(records: str | Path, target: Target, top: int = 3, config: MeasureConfig | None = None,
           progress: bool = True) -> RetimeSummary:
    """Measure the `top` best records per (spec, layout) of `records` made on `target` again,
    beside the reference (maco.core.timing), and rewrite them in place, atomically: each keeps its
    earlier timing in `history`; every other line stays as it was. A record from before the
    reference gets one, so records of different days rank on one scale afterwards."""
    from rich.progress import Progress

    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise MacoError(f"top must be a positive int, got {top!r}")
    file = RecordFile(records)
    if not file.path.is_file():
        raise MacoError(f"records file {str(file.path)!r} does not exist")
    fingerprint = target.fingerprint()
    mine = [(n, r) for n, r in file.load_numbered() if r.ok and r.target == fingerprint]
    groups: dict[tuple[ConvSpec, str], list[tuple[float, int, Record]]] = {}
    for rank, (n, r) in zip(normalized([r for _, r in mine]), mine):
        groups.setdefault((r.spec, r.schedule.layout), []).append((rank, n, r))
    chosen: dict[ConvSpec, list[tuple[int, Record]]] = {}
    for key, ranked in groups.items():
        for _, n, r in sorted(ranked, key=lambda x: x[0])[:top]:
            chosen.setdefault(key[0], []).append((n, r))
    updates: dict[int, Record] = {}
    failed, unreferenced, changes = 0, 0, []
    with Measurer(target, config) as measurer, Progress(transient=not progress) as bar:
        job = bar.add_task("re-timing", total=sum(len(v) for v in chosen.values()))
        for spec, items in chosen.items():
            for (n, old), (timing, error) in zip(items, measurer(spec, [r.schedule for _, r in items])):
                bar.advance(job)
                if timing is None:
                    failed += 1
                    continue
                updates[n] = replace(old, timing=timing, env=environment(), time=time.time(),
                                     history=old.history + ({"timing": old.timing.to_dict(), "time": old.time},))
                unreferenced += not old.referenced
                changes.append(timing.median / old.seconds)
    if updates:
        file.replace(updates)
    return RetimeSummary(len(updates), failed, unreferenced,
                         statistics.median(changes) if changes else float("nan"))
