"""Evolutionary search over the schedule space with a learned cost model (Ansor section 5.1).

Each round: retrain the cost model on everything measured so far, evolve a population that
starts from fresh samples of the (pruned or full) space plus the best measured schedules,
pick the top candidates by predicted fitness with epsilon-greedy exploration, and measure
them for real, after the seeds and a few register reshapes of the best one so far (a local
step the cost model cannot rank). Measuring goes through a `MeasureFunction`
(maco.tune.measure.Measurer in practice), so the search never times anything itself.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Protocol, Sequence

from maco.space import schedules as space
from maco.core.errors import MacoError
from maco.space.prune import alpha_c_index, alpha_order_ok
from maco.tune.records import Claims, Entry, Interrupted, Record, RecordFile, make_record, normalized
from maco.core.axes import SPATIAL_AXES
from maco.core.schedule import UNROLL_STEPS, Schedule
from maco.core.sketch_cpu import vector_width
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing


RESHAPES = 2  # of the best schedule's register reshapes (register_reshapes), measured each round


class MeasureFunction(Protocol):
    """Times schedules of one conv; returns one (timing, error) pair per schedule, in order, or
    (timing, error, env) where another machine measured (env: its environment). Ctrl-C during
    the batch may raise records.Interrupted with the results finished before it."""

    def __call__(self, spec: ConvSpec, schedules: Sequence[Schedule],
                 target: Target) -> list[tuple[Timing | None, str | None]]: ...


class ScheduleRanker(Protocol):
    """What the search asks of a cost model (maco.tune.cost_model.CostModel in practice): a
    predicted fitness per schedule, higher is better. Fitting it is the caller's job."""

    def predict(self, spec: ConvSpec, schedules: Sequence[Schedule]) -> Iterable[float]: ...


@dataclass
class SearchConfig:
    batch: int = 16  # schedules measured per round
    population: int = 128
    generations: int = 4
    elite: int = 16  # best measured schedules seeded into each population
    eps_greedy: float = 0.1  # share of each batch drawn at random from the space
    mutation_prob: float = 0.85  # the rest of the offspring come from crossover
    pruned: bool = True
    allowed_layouts: tuple[str, ...] = ("NCHW", "NHWC")

    def __post_init__(self) -> None:
        if self.batch < 1 or self.population < 2 or self.generations < 0:
            raise MacoError(f"bad search config: batch={self.batch}, population={self.population}, "
                            f"generations={self.generations}")
        if not 0.0 <= self.eps_greedy <= 1.0:
            raise MacoError(f"eps_greedy must be in [0, 1], got {self.eps_greedy}")


@dataclass
class TaskState:
    """What the search knows about one conv: every record so far, best first on demand."""

    spec: ConvSpec
    records: list[Record] = field(default_factory=list)

    @property
    def measured(self) -> set[Schedule]:
        """Schedules not to measure again: all but those whose only record is one transient failure."""
        return {r.schedule for r in self.records} - set(self.retries())

    def retries(self) -> list[Schedule]:
        """Schedules that failed once for a passing reason (timeout, dead worker) and nothing else."""
        count: dict[Schedule, int] = {}
        for r in self.records:
            count[r.schedule] = count.get(r.schedule, 0) + (1 if r.retryable else 2)
        return [s for s, c in count.items() if c == 1]

    @property
    def best(self) -> Record | None:
        """The fastest record, ranked by records.normalized (across spells and days)."""
        ok = [r for r in self.records if r.ok]
        return min(zip(normalized(ok), ok), key=lambda x: x[0], default=(0.0, None))[1]

    def best_seconds(self) -> float:
        best = self.best
        return best.seconds if best else math.inf


# -- the space as the search sees it ---------------------------------------------------------
def _is_allowed(schedule: Schedule, spec: ConvSpec, target: Target, config: SearchConfig) -> bool:
    if schedule.layout not in config.allowed_layouts or schedule.problems(spec, target):
        return False
    return not config.pruned or space.contains(schedule, spec, target, pruned=True)


def with_layout(s: Schedule, layout: str) -> Schedule:
    """`s` in another layout; an inner order that slides over channels as alpha = 1 asks in the old
    layout is moved to do so in the new one (c first in NCHW, last in CPU NHWC), so the pruned
    space keeps it."""
    out = replace(s, layout=layout)
    if alpha_order_ok(s.inner_order, s.kind, s.layout):
        rest = tuple(a for a in s.inner_order if a != "c")
        out = replace(out, inner_order=rest + ("c",) if alpha_c_index(s.kind, layout) else ("c",) + rest)
    return out


def _sample(spec: ConvSpec, target: Target, rng: random.Random, n: int,
            config: SearchConfig) -> list[Schedule]:
    out: list[Schedule] = []
    tries = 0
    while len(out) < n and tries < 20 * n + 20:
        tries += 1
        s = space.sample(spec, target, rng, pruned=config.pruned)
        if s.layout not in config.allowed_layouts:
            s = with_layout(s, rng.choice(config.allowed_layouts))
            if not _is_allowed(s, spec, target, config):
                continue
        out.append(s)
    return out


# -- mutations (each returns a candidate; validity is checked by the caller) -----------------
def _move_factor(factors: tuple[int, ...], rng: random.Random) -> tuple[int, ...]:
    """Divide one level by a prime factor of it and multiply another level by it."""
    sources = [i for i, f in enumerate(factors) if f > 1]
    if not sources or len(factors) < 2:
        return factors
    src = rng.choice(sources)
    primes = _prime_factors(factors[src])
    p = rng.choice(primes)
    dst = rng.choice([i for i in range(len(factors)) if i != src])
    out = list(factors)
    out[src] //= p
    out[dst] *= p
    return tuple(out)


def _prime_factors(n: int) -> list[int]:
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    if n > 1:
        out.append(n)
    return out


def mutate_tile(s: Schedule, rng: random.Random) -> Schedule:
    axes = [i for i, f in enumerate(s.spatial) if math.prod(f) > 1]
    raxes = [i for i, f in enumerate(s.reduction) if math.prod(f) > 1]
    if raxes and (not axes or rng.random() < 0.25):
        i = rng.choice(raxes)
        red = list(s.reduction)
        red[i] = _move_factor(red[i], rng)
        return replace(s, reduction=tuple(red))
    if not axes:
        return s
    i = rng.choice(axes)
    sp = list(s.spatial)
    sp[i] = _move_factor(sp[i], rng)
    return replace(s, spatial=tuple(sp))


def mutate_annotation(s: Schedule, rng: random.Random, target: Target,
                      config: SearchConfig) -> Schedule:
    choice = rng.choice(["parallel", "unroll", "order", "vector", "layout"])
    if choice == "parallel" and s.kind == "cpu":
        return replace(s, parallel=max(0, min(len(SPATIAL_AXES), s.parallel + rng.choice((-1, 1)))))
    if choice == "unroll":
        return replace(s, unroll=rng.choice([u for u in UNROLL_STEPS if u != s.unroll]))
    if choice == "order":
        order = list(s.inner_order)
        rng.shuffle(order)
        return replace(s, inner_order=tuple(order))
    if choice == "vector" and s.kind == "cpu":
        axis = "ow" if s.vector_axis == "k" else "k"
        inner = s.factors(axis)[-1]
        width = vector_width(target, inner)
        return replace(s, vector_axis=axis, vector_width=width)
    if choice == "layout" and len(config.allowed_layouts) > 1:
        return with_layout(s, rng.choice([l for l in config.allowed_layouts if l != s.layout]))
    return s


def register_reshapes(s: Schedule) -> list[Schedule]:
    """A CPU schedule with its register tile's outputs split another way between the vector axis
    and one other spatial axis: a prime factor moved from one's register factor to the other's
    (the vector axis keeping whole vectors), each axis's next level out taking the inverse, so
    the accumulators and every outer tile stay the same. The fewest loads a step first (vectors
    of the vector operand plus broadcasts of the other). The cost model prices such tiles alike
    (register_share: the FMAs bind both), yet timing them apart can matter (14 pixels x 2 filter
    vectors against 7 x 4 on a 1x1 conv: 16 loads a step against 11), and mutate_tile, which
    moves a factor between the levels of one axis, reaches them only in two lucky steps. Validity
    is the caller's to check."""
    if s.kind != "cpu":
        return []
    v = SPATIAL_AXES.index(s.vector_axis)
    out: dict[Schedule, int] = {}
    for o in range(len(s.spatial)):
        if o == v:
            continue
        for src, dst in ((o, v), (v, o)):
            reg = s.spatial[src][-1] // (s.vector_width if src == v else 1)
            for p in dict.fromkeys(_prime_factors(reg)):
                if s.spatial[dst][-2] % p:
                    continue  # the next level out of the growing axis cannot give the factor back
                sp = [list(f) for f in s.spatial]
                sp[src][-1] //= p
                sp[src][-2] *= p
                sp[dst][-1] *= p
                sp[dst][-2] //= p
                t = replace(s, spatial=tuple(tuple(f) for f in sp))
                tile = t.register_tile()
                vectors = tile[s.vector_axis] // max(1, s.vector_width)
                out[t] = vectors + math.prod(tile.values()) // max(1, tile[s.vector_axis])
    return sorted(out, key=out.__getitem__)


def crossover(a: Schedule, b: Schedule, rng: random.Random) -> Schedule:
    """Node-based crossover: each axis's tiling and each annotation from either parent."""
    spatial = tuple(rng.choice((fa, fb)) for fa, fb in zip(a.spatial, b.spatial))
    reduction = tuple(rng.choice((fa, fb)) for fa, fb in zip(a.reduction, b.reduction))
    pick = lambda name: getattr(rng.choice((a, b)), name)  # noqa: E731
    vec = rng.choice((a, b))
    return replace(a, spatial=spatial, reduction=reduction, parallel=pick("parallel"),
                   unroll=pick("unroll"), inner_order=pick("inner_order"), layout=pick("layout"),
                   weight_packing=pick("weight_packing"), vector_axis=vec.vector_axis,
                   vector_width=vec.vector_width)


def evolve(spec: ConvSpec, target: Target, population: list[Schedule],
           fitness: Callable[[list[Schedule]], list[float]], rng: random.Random,
           config: SearchConfig) -> list[Schedule]:
    """`config.generations` rounds of fitness-proportional selection, mutation and crossover.
    Returns every distinct valid schedule seen, for the caller to rank."""
    seen: dict[Schedule, None] = dict.fromkeys(population)
    pop = list(population)
    for _ in range(config.generations):
        if len(pop) < 2:
            break
        scores = fitness(pop)
        low = min(scores)
        weights = [s - low + 1e-9 for s in scores]
        children: list[Schedule] = []
        attempts = 0
        while len(children) < config.population and attempts < 6 * config.population:
            attempts += 1
            if rng.random() < config.mutation_prob:
                parent = rng.choices(pop, weights)[0]
                child = (mutate_tile(parent, rng) if rng.random() < 0.6
                         else mutate_annotation(parent, rng, target, config))
            else:
                a, b = rng.choices(pop, weights, k=2)
                child = crossover(a, b, rng)
            if child not in seen and _is_allowed(child, spec, target, config):
                seen[child] = None
                children.append(child)
        pop = children or pop
    return list(seen)


# -- one task's tuning rounds ------------------------------------------------------------------
def search_round(state: TaskState, target: Target, model: ScheduleRanker, measurer: MeasureFunction,
                 rng: random.Random, config: SearchConfig, n: int | None = None,
                 records: RecordFile | None = None, seeds: Sequence[Schedule] = (),
                 refresh: Callable[[], object] | None = None) -> list[Record]:
    """Pick and measure one batch of new schedules for `state.spec` ranked by `model` (already
    fitted by the caller, which may train it on every task); returns the new records. `seeds`
    not measured yet go first (the bound-derived default: a search never starts from nothing).
    With `records`, other runs may share the file: the batch is claimed (records.Claims) and
    checked against the file's new tail (`refresh`, by default `follow` of this state) before
    it is measured, so a schedule another run measured or is measuring is replaced by the next
    candidate."""
    spec, n = state.spec, n or config.batch
    retries = state.retries()
    measured = state.measured | set(retries)
    first = (retries + [s for s in dict.fromkeys(seeds) if s not in measured and s.layout
                        in config.allowed_layouts and not s.problems(spec, target)])[:n]
    ranked = sorted((x for x in zip(normalized(state.records), state.records) if x[1].ok), key=lambda x: x[0])
    if ranked:  # the best's register tile split the other ways: RESHAPES of them a round
        reshaped = [s for s in register_reshapes(ranked[0][1].schedule)
                    if s not in measured and s not in first and _is_allowed(s, spec, target, config)]
        first = (first + reshaped[:RESHAPES])[:n]
    elites = [r.schedule for _, r in ranked[:config.elite] if r.schedule.layout in config.allowed_layouts]
    init = _sample(spec, target, rng, max(config.population - len(elites), 2), config) + elites
    fitness = lambda pop: list(model.predict(spec, pop))  # noqa: E731
    candidates = [s for s in evolve(spec, target, init, fitness, rng, config) if s not in measured]
    candidates = [s for s in candidates if s not in first]
    n_random = min(n - len(first), int(round(n * config.eps_greedy)))
    ranked = sorted(zip(fitness(candidates), range(len(candidates))), reverse=True) if candidates else []
    picked = first + [candidates[i] for _, i in ranked[:n - len(first) - n_random]]
    extra = [s for s in _sample(spec, target, rng, 3 * n, config) if s not in measured and s not in picked]
    spare = [candidates[i] for _, i in ranked[n - len(first) - n_random:]] + extra[n - len(picked):]
    picked += extra[:n - len(picked)]
    if records is None:
        return _measure(state, target, measurer, picked, None) if picked else []
    with records.claims() as claims:
        picked = _claim(state, target, claims, picked + spare, len(picked),
                        refresh or (lambda: follow(records, [state], target)))
        return _measure(state, target, measurer, picked, records) if picked else []


def _claim(state: TaskState, target: Target, claims: Claims, candidates: list[Schedule], n: int,
           refresh: Callable[[], object]) -> list[Schedule]:
    """Up to `n` of `candidates`, in order, that this run holds the claim of and that no run has
    measured: claimed first, then checked against the records as they are now (a run that
    released a claim had appended its record before)."""
    got: list[Schedule] = []
    pool = iter(dict.fromkeys(candidates))
    while True:
        measured = state.measured
        while len(got) < n and (s := next(pool, None)) is not None:
            if s not in measured and claims.take(state.spec, target, s):
                got.append(s)
        refresh()
        measured = state.measured
        done = [s for s in got if s in measured]
        if not done:
            return got
        for s in done:
            claims.release(state.spec, target, s)
            got.remove(s)


def _measure(state: TaskState, target: Target, measurer: MeasureFunction, picked: list[Schedule],
             records: RecordFile | None) -> list[Record]:
    spec = state.spec
    try:
        results = measurer(spec, picked, target)
    except Interrupted as stop:  # keep what was measured, then stop
        _keep(state, records, [_record(spec, target, s, r) for s, r in zip(picked, stop.results) if r])
        raise KeyboardInterrupt from None
    new = [_record(spec, target, s, r) for s, r in zip(picked, results)]
    _keep(state, records, new)
    return new


def follow(records: RecordFile, states: Sequence[TaskState], target: Target) -> list[int]:
    """Bring `states` up to date with `records` (RecordFile.read_new: the whole file the first
    time, then what other runs appended since). Returns the indices of the states that changed."""
    return take(*records.read_new(), states, target)


def take(entries: Sequence[Entry], whole: bool, states: Sequence[TaskState], target: Target) -> list[int]:
    """Add to each state the records of its conv measured on `target` among `entries` (in place
    of the ones it had, where `entries` is the `whole` file). Returns the states that changed."""
    fingerprint = target.fingerprint()
    index: dict[ConvSpec, list[int]] = {}
    for i, state in enumerate(states):
        index.setdefault(state.spec, []).append(i)
    changed: set[int] = set()
    if whole:
        changed = {i for i, state in enumerate(states) if state.records}
        for state in states:
            state.records = []
    for e in entries:
        if isinstance(e, Record) and e.target == fingerprint:
            for i in index.get(e.spec, ()):
                states[i].records.append(e)
                changed.add(i)
    return sorted(changed)


def _record(spec: ConvSpec, target: Target, schedule: Schedule, result: tuple) -> Record:
    timing, error, *env = result
    return make_record(spec, target, schedule, timing, error, env=env[0] if env else None)


def _keep(state: TaskState, records: RecordFile | None, new: list[Record]) -> None:
    if records is not None:
        records.append(new)
    state.records.extend(new)
