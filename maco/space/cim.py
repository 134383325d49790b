"""The compute-in-memory schedule space: exact size and uniform draws (maco.space.schedules dispatches here).

A point: per spatial axis an ordered factorisation (cores, outer trips, tile), per reduction axis
(outer trips, block), a permutation of the 8 outer loops, and the layout. Valid (Schedule
.problems): at most arch.cores cores, the block within the crossbars, the largest window within
the input buffer, the live partial sums within the psum buffer.

Only the loops with more than one trip (the active ones) have an order that matters, so the
orders are counted by their active part, times 8! / a! placements of the inactive loops. The psum
rule depends on the order only through B, the active spatial loops inside the outermost active
reduction loop: with A the active spatial loops and r > 0 active reduction loops, the active orders
with a given B number |A - B|! * r * (|B| + r - 1)! (A - B in any order, then the first reduction
loop, then the rest). The pruned space (maco.space.prune_cim) adds the sweep rule: the active image and
pixel loops S split into S_b outside every active weight loop and S_a inside all of them, so its
orders are |S_b|! * |S_a|! * (orders of the weight loops), with X the output-channel loops (g, k)
inside the first reduction loop and B = X + S_a. The sums run over subsets on numpy arrays of all
factor choices; a draw walks the same weights, so it is uniform without rejection.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from math import factorial, prod

import numpy as np

from maco.space import prune_cim
from maco.core.errors import MacoError
from maco.core.factors import factorizations
from maco.core.geometry import max_input_span
from maco.core.axes import ALL_AXES, REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core import sketch_cim
from maco.core.schedule import LAYOUTS, Schedule
from maco.core.sketch_cim import cim_crossbars
from maco.core.spec import ConvSpec
from maco.core.target import Target

STREAM, OUTPUT_BLOCK = prune_cim.STREAM_AXES, prune_cim.OUTPUT_BLOCK_AXES
FACT = np.array([factorial(i) for i in range(len(ALL_AXES) + 1)], dtype=np.int64)


def _subsets(items: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [c for n in range(len(items) + 1) for c in combinations(items, n)]


@dataclass
class _Cim:
    spatial: dict[str, np.ndarray]  # per axis: (cores, trips, tile) of each flattened combination
    reductions: list[tuple[tuple[int, int], ...]]  # (trips, block) of c, kh, kw
    weights: np.ndarray  # (reduction combination, spatial combination): valid orders
    size: int


def _flat_spatial(spec: ConvSpec, cores: int, pruned: bool) -> dict[str, np.ndarray]:
    """Every combination of the spatial factorisations that binds at most `cores` cores (and,
    pruned, binds none of them to images or pixels)."""
    ext = axis_extents(spec)
    facs = {a: np.array(factorizations(ext[a], 3), dtype=np.int64) for a in SPATIAL_AXES}
    if pruned:
        facs.update({a: facs[a][facs[a][:, 0] == 1] for a in STREAM})
    grids = np.meshgrid(*[np.arange(len(facs[a])) for a in SPATIAL_AXES], indexing="ij")
    idx = {a: g.ravel() for a, g in zip(SPATIAL_AXES, grids)}
    used = prod(facs[a][idx[a], 0] for a in SPATIAL_AXES)
    keep = used <= cores
    return {a: facs[a][idx[a][keep]] for a in SPATIAL_AXES}


def _span_table(spec: ConvSpec, axis: str, tiles: np.ndarray, taps: int) -> np.ndarray:
    values = {int(t): max_input_span(spec, axis, int(t), taps) for t in np.unique(tiles)}
    return np.vectorize(values.get, otypes=[np.int64])(tiles)


def _all_active(active: dict[str, np.ndarray], trips: dict[str, np.ndarray], axes: tuple[str, ...],
                start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per spatial combination, whether every loop of `axes` is active (runs more than one trip),
    and `start` times their trips: a loop placed at a position in an order must run there, and
    the product counts the partial sums (or chunks) that position keeps alive."""
    every = np.ones(len(start), dtype=bool)
    product = start
    for a in axes:
        every &= active[a]
        product = product * trips[a]
    return every, product


def _order_weights(sp: dict[str, np.ndarray], r: int, cap: int, max_chunks: int | None) -> np.ndarray:
    """Valid orders of the 8 loops per spatial combination, with r active reduction loops (and,
    when max_chunks is set, the pruned sweep rule)."""
    trips = {a: sp[a][:, 1] for a in SPATIAL_AXES}
    tile = prod(sp[a][:, 2] for a in SPATIAL_AXES)
    active = {a: trips[a] > 1 for a in SPATIAL_AXES}
    n_active = sum(active[a].astype(np.int64) for a in SPATIAL_AXES)
    place = FACT[len(ALL_AXES)] // FACT[n_active + r]  # the inactive loops go anywhere
    total = np.zeros(len(tile), dtype=np.int64)
    if max_chunks is None:
        for b in _subsets(SPATIAL_AXES):
            inside, live = _all_active(active, trips, b, tile)
            if r == 0:
                if b:
                    continue
                count = FACT[n_active]
            else:
                count = FACT[n_active - len(b)] * r * FACT[len(b) + r - 1]
            total += np.where(inside & (live <= cap), count, 0)
        return total * place
    n_stream = sum(active[a].astype(np.int64) for a in STREAM)
    n_out = sum(active[a].astype(np.int64) for a in OUTPUT_BLOCK)
    for before in _subsets(STREAM):
        in_before, chunks = _all_active(active, trips, before, np.ones(len(tile), dtype=np.int64))
        after_live = prod(np.where(active[a], trips[a], 1) for a in STREAM if a not in before)
        n_after = n_stream - len(before)
        stream_orders = FACT[len(before)] * FACT[n_after]
        for x in _subsets(OUTPUT_BLOCK):
            in_x, live = _all_active(active, trips, x, tile * after_live)
            if r == 0:
                if x:
                    continue
                live = tile
                block = FACT[n_out]
            else:
                block = FACT[n_out - len(x)] * r * FACT[len(x) + r - 1]
            ok = in_before & in_x & (chunks <= max_chunks) & (live <= cap)
            total += np.where(ok, stream_orders * block, 0)
    no_block = (n_out == 0) & (r == 0)  # nothing to sweep past: every order of S is in
    total = np.where(no_block, np.where(tile <= cap, FACT[n_stream], 0), total)
    return total * place


@lru_cache(maxsize=32)
def _cim(spec: ConvSpec, target: Target, pruned: bool) -> _Cim:
    arch = target.cim_arch
    sp = _flat_spatial(spec, arch.cores, pruned)
    ext = axis_extents(spec)
    max_chunks = prune_cim.cim_rules(spec, target).max_chunks if pruned else None
    cap = arch.psum_capacity
    by_r = {}
    reductions, weights = [], []
    t = {a: sp[a][:, 2] for a in SPATIAL_AXES}
    for red in [(c, h, w) for c in factorizations(ext["c"], 2) for h in factorizations(ext["kh"], 2)
                for w in factorizations(ext["kw"], 2)]:
        r = sum(o > 1 for o, _ in red)
        if r not in by_r:
            by_r[r] = _order_weights(sp, r, cap, max_chunks)
        (_, bc), (_, bkh), (_, bkw) = red
        xbars = cim_crossbars(arch, t["g"] * bc * bkh * bkw, t["g"] * t["k"])
        window = (t["n"] * t["g"] * bc * _span_table(spec, "h", t["oh"], bkh)
                  * _span_table(spec, "w", t["ow"], bkw) * arch.input_bytes)
        w = np.where((xbars <= arch.crossbars) & (window <= arch.input_buffer), by_r[r], 0)
        if w.any():
            reductions.append(red)
            weights.append(w)
    if not weights:
        return _Cim(sp, [], np.zeros((0, 0), dtype=object), 0)
    table = np.stack(weights)
    return _Cim(sp, reductions, table, int(table.sum()) * len(LAYOUTS))


def size(spec: ConvSpec, target: Target, pruned: bool) -> int:
    return _cim(spec, target, pruned).size


def _pick(weights: np.ndarray, rng: random.Random) -> int:
    """Index drawn with probability weights[i] / sum (exact, Python ints)."""
    total = int(weights.sum())
    if total <= 0:
        raise MacoError("internal: sampling from an empty part of the space")
    x, acc = rng.randrange(total), 0
    for i, w in enumerate(weights):
        acc += int(w)
        if x < acc:
            return i
    raise AssertionError("unreachable")


def _order(trips: dict[str, int], tile: int, cap: int, max_chunks: int | None,
           rng: random.Random) -> tuple[str, ...]:
    """A uniform random order of the 8 loops under the psum (and pruned sweep) rules."""
    active = [a for a in ALL_AXES if trips[a] > 1]
    red = [a for a in REDUCTION_AXES if trips[a] > 1]
    options = []  # (the parts of the active order, how many orders have them)
    sp_active = tuple(a for a in SPATIAL_AXES if trips[a] > 1)
    if max_chunks is None:
        for b in _subsets(sp_active):
            live = tile * prod(trips[a] for a in b)
            if (red and live <= cap) or (not red and not b and tile <= cap):
                rest = [a for a in sp_active if a not in b]
                count = factorial(len(rest)) * (len(red) * factorial(len(b) + len(red) - 1) if red else 1)
                options.append(((rest, b), count))
    else:
        stream = tuple(a for a in STREAM if trips[a] > 1)
        out = tuple(a for a in OUTPUT_BLOCK if trips[a] > 1)
        if not out and not red:
            options.append((((), stream, (), ()), factorial(len(stream)) if tile <= cap else 0))
        else:
            for before in _subsets(stream):
                after = tuple(a for a in stream if a not in before)
                if prod(trips[a] for a in before) > max_chunks:
                    continue
                for x in (_subsets(out) if red else [()]):
                    live = tile * prod(trips[a] for a in after + x) if red else tile
                    if live > cap:
                        continue
                    lead = tuple(a for a in out if a not in x)
                    count = factorial(len(before)) * factorial(len(after)) * factorial(len(lead)) \
                        * (len(red) * factorial(len(x) + len(red) - 1) if red else 1)
                    options.append(((before, lead, x, after), count))
    if not options or not sum(c for _, c in options):
        raise MacoError("internal: no loop order fits the psum buffer")
    choice = options[_pick(np.array([c for _, c in options], dtype=np.int64), rng)][0]

    def shuffled(items) -> list[str]:
        items = list(items)
        rng.shuffle(items)
        return items

    def reduction_part(inside: tuple[str, ...]) -> list[str]:
        if not red:
            return shuffled(inside)
        first = rng.choice(red)
        return [first] + shuffled([a for a in red if a != first] + list(inside))

    if max_chunks is None:
        rest, b = choice
        rel = shuffled(rest) + reduction_part(b)
    else:
        before, lead, x, after = choice
        rel = shuffled(before) + shuffled(lead) + reduction_part(x) + shuffled(after)
    slots = sorted(rng.sample(range(len(ALL_AXES)), len(active)))
    order: list[str | None] = [None] * len(ALL_AXES)
    for slot, axis in zip(slots, rel):
        order[slot] = axis
    inactive = shuffled([a for a in ALL_AXES if trips[a] == 1])
    return tuple(a if a is not None else inactive.pop() for a in order)


def sample(spec: ConvSpec, target: Target, rng: random.Random, pruned: bool) -> Schedule:
    t = _cim(spec, target, pruned)
    if not t.size:
        raise MacoError(f"the CIM space of {spec} on {target.name} is empty")
    i = _pick(t.weights.sum(axis=1), rng)
    j = _pick(t.weights[i], rng)
    spatial = tuple(tuple(int(v) for v in t.spatial[a][j]) for a in SPATIAL_AXES)
    reduction = t.reductions[i]
    sched = Schedule(kind="cim", spatial=spatial, reduction=reduction, loop_order=ALL_AXES)
    trips = sketch_cim.trips(sched)
    tile = prod(f[2] for f in spatial)
    max_chunks = prune_cim.cim_rules(spec, target).max_chunks if pruned else None
    order = _order(trips, tile, target.cim_arch.psum_capacity, max_chunks, rng)
    return Schedule(kind="cim", spatial=spatial, reduction=reduction, loop_order=order,
                    layout=rng.choice(LAYOUTS))


def why_not(schedule: Schedule, spec: ConvSpec, target: Target, pruned: bool) -> list[str]:
    """Schedule.problems already covers the full space; pruned adds maco.space.prune_cim's rules."""
    if not pruned:
        return []
    return prune_cim.cim_reasons(schedule, prune_cim.cim_rules(spec, target))
