"""Replay a conv loop nest's exact element accesses through a fully associative cache.

The machine: a fast memory of S elements in front of a slow one, in elements, no lines. Every
multiply-add whose input is not padding reads its weight, then its input, then updates its
output, in that order. Inputs and weights are clean: a miss loads them, eviction is free. An
output's first access allocates it without a load (it starts at zero); from then on it is dirty,
so evicting it stores it and touching it again after that loads it back. At the end the dirty
outputs are stored, and an output no multiply-add touches (it reads only padding) is stored
once as a zero. Policies: "lru", and "opt" (Belady: evict the element used furthest ahead),
which needs the fewest loads of any policy on the same access sequence.

A loop nest is a list of loops (axis, trip count, step), outermost first; an axis' index is the
sum of trip index * step over its loops, and iterations past an axis' extent are skipped (edge
tiles). A Tile gives the alpha=1 dataflow nest: tile loops in `order` (channel c last by
default), then kh, kw and the tile's own k, oh, ow loops. A Schedule gives its sketch's full nest.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np

from maco.bounds.tiles import Tile
from maco.core.errors import MacoError
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES
from maco.core.schedule import LEVELS, SKETCHES, Schedule
from maco.core.spec import ConvSpec

DATAFLOW_ORDER = ("n", "g", "k", "oh", "ow", "c")  # tile loops, outermost first
INNER_ORDER = ("kh", "kw", "k", "oh", "ow")  # loops inside one tile and channel
POLICIES = ("lru", "opt")
MAX_ITERATIONS = 20_000_000  # multiply-adds (edge-tile overhang included) one simulation may replay

Loop = tuple[str, int, int]  # (axis, trip count, step)


@dataclass(frozen=True)
class IOCounts:
    """Loads and stores (elements) of one simulated run."""

    loads: int
    stores: int
    accesses: int  # accesses replayed (consecutive repeats of one element merged)
    S: int
    policy: str

    @property
    def total(self) -> int:
        return self.loads + self.stores


def tile_loops(spec: ConvSpec, tile: Tile, order: Sequence[str] = DATAFLOW_ORDER,
               inner_order: Sequence[str] = INNER_ORDER) -> list[Loop]:
    """The alpha=1 dataflow's loop nest for a tile, with the tile loops in `order`."""
    if sorted(order) != sorted(DATAFLOW_ORDER):
        raise MacoError(f"order must be a permutation of {DATAFLOW_ORDER}, got {tuple(order)}")
    if sorted(inner_order) != sorted(INNER_ORDER):
        raise MacoError(f"inner_order must be a permutation of {INNER_ORDER}, got {tuple(inner_order)}")
    t = tile.clipped(spec)
    outer = {"n": ("n", spec.n, 1), "g": ("g", spec.groups, 1),
             "k": ("k", -(-spec.k_per_group // t.z), t.z), "oh": ("oh", -(-spec.out_h // t.y), t.y),
             "ow": ("ow", -(-spec.out_w // t.x), t.x), "c": ("c", spec.c_per_group, 1)}
    inner = {"kh": ("kh", spec.kh, 1), "kw": ("kw", spec.kw, 1), "k": ("k", t.z, 1),
             "oh": ("oh", t.y, 1), "ow": ("ow", t.x, 1)}
    return [outer[a] for a in order] + [inner[a] for a in inner_order]


def schedule_loops(spec: ConvSpec, schedule: Schedule) -> list[Loop]:
    """The full loop nest of a schedule's sketch (e.g. CPU S0 S1 R0 S2 R1 S3)."""
    schedule.validate(spec)
    loops: list[Loop] = []
    levels = {"S": 0, "R": 0}
    n_reduction = LEVELS[schedule.kind][1]
    for kind in SKETCHES[schedule.kind]:
        level = levels[kind]
        levels[kind] += 1
        if kind == "S":
            axes: Sequence[str] = SPATIAL_AXES
        else:
            axes = schedule.inner_order if level == n_reduction - 1 else REDUCTION_AXES
        for axis in axes:
            loops.append((axis, schedule.factors(axis)[level], schedule.tile(axis, level + 1)))
    return loops


def _trace(spec: ConvSpec, loops: Sequence[Loop]) -> tuple[np.ndarray, int, int]:
    """Element ids in access order (consecutive repeats merged), the first output id, and how
    many outputs no multiply-add touches."""
    iterations = prod(count for _, count, _ in loops)
    if iterations > MAX_ITERATIONS:
        raise MacoError(f"{spec} with this loop nest replays {iterations} multiply-adds; the "
                        f"simulator takes at most {MAX_ITERATIONS} (use a smaller shape)")
    shape = tuple(count for _, count, _ in loops)
    index = {a: np.zeros(1, dtype=np.int64) for a in SPATIAL_AXES + REDUCTION_AXES}
    for dim, (axis, count, step) in enumerate(loops):
        view = [1] * len(loops)
        view[dim] = count
        index[axis] = index[axis] + (np.arange(count, dtype=np.int64) * step).reshape(view)
    idx = {a: np.broadcast_to(v, shape).ravel() for a, v in index.items()}
    extents = {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h,
               "ow": spec.out_w, "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}
    ih = idx["oh"] * spec.stride[0] + idx["kh"] * spec.dilation[0] - spec.padding[0]
    iw = idx["ow"] * spec.stride[1] + idx["kw"] * spec.dilation[1] - spec.padding[1]
    inside = np.ones(iterations, dtype=bool)
    for axis, extent in extents.items():
        inside &= idx[axis] < extent
    valid = inside & (ih >= 0) & (ih < spec.h) & (iw >= 0) & (iw < spec.w)
    v = {a: arr[valid] for a, arr in idx.items()}
    ih, iw = ih[valid], iw[valid]
    cg, kg = spec.c_per_group, spec.k_per_group
    n_in, n_w = spec.input_elems, spec.weight_elems
    inputs = ((v["n"] * spec.c + v["g"] * cg + v["c"]) * spec.h + ih) * spec.w + iw
    weights = n_in + (((v["g"] * kg + v["k"]) * cg + v["c"]) * spec.kh + v["kh"]) * spec.kw + v["kw"]
    outputs = (n_in + n_w + ((v["n"] * spec.k + v["g"] * kg + v["k"]) * spec.out_h + v["oh"])
               * spec.out_w + v["ow"])
    ids = np.stack((weights, inputs, outputs), axis=1).ravel()
    if ids.size:
        ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
    untouched = spec.output_elems - int(np.unique(outputs).size)
    return ids, n_in + n_w, untouched


def _lru(ids: list[int], S: int, out_base: int, n_out: int) -> tuple[int, int]:
    cache: OrderedDict[int, None] = OrderedDict()
    written = bytearray(n_out)
    loads = stores = 0
    for e in ids:
        if e in cache:
            cache.move_to_end(e)
            continue
        if e >= out_base:
            if written[e - out_base]:
                loads += 1
            else:
                written[e - out_base] = 1
        else:
            loads += 1
        cache[e] = None
        if len(cache) > S:
            old, _ = cache.popitem(last=False)
            if old >= out_base:
                stores += 1
    stores += sum(1 for e in cache if e >= out_base)
    return loads, stores


def _opt(ids: np.ndarray, S: int, out_base: int, n_out: int) -> tuple[int, int]:
    n = ids.size
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    next_use = np.full(n, n, dtype=np.int64)  # n = never again
    same = sorted_ids[1:] == sorted_ids[:-1]
    next_use[order[:-1][same]] = order[1:][same]
    # heap items are -(next_use << 32 | element): one int compares faster than a tuple.
    # Stale items (an element since re-used or evicted) are skipped when popped.
    keys = (-((next_use << 32) | ids)).tolist()
    cache: dict[int, int] = {}
    heap: list[int] = []
    written = bytearray(n_out)
    loads = stores = 0
    push, pop = heapq.heappush, heapq.heappop
    limit = 8 * S + 4096
    for e, key in zip(ids.tolist(), keys):
        if e in cache:
            cache[e] = key
            push(heap, key)
            continue
        if e >= out_base:
            if written[e - out_base]:
                loads += 1
            else:
                written[e - out_base] = 1
        else:
            loads += 1
        if len(cache) >= S:
            while True:
                item = pop(heap)
                victim = (-item) & 0xFFFFFFFF
                if cache.get(victim) == item:
                    break
            del cache[victim]
            if victim >= out_base:
                stores += 1
        cache[e] = key
        push(heap, key)
        if len(heap) > limit:
            heap = list(cache.values())
            heapq.heapify(heap)
    stores += sum(1 for e in cache if e >= out_base)
    return loads, stores


def simulate_io(spec: ConvSpec, tile_or_schedule: Tile | Schedule, S: int, policy: str = "lru",
                order: Sequence[str] = DATAFLOW_ORDER,
                inner_order: Sequence[str] = INNER_ORDER) -> IOCounts:
    """Loads and stores of a tiled conv loop nest through a fully associative cache of S elements.

    A Tile replays the alpha=1 dataflow with its tile loops in `order` and the loops inside a
    tile and channel in `inner_order`; a Schedule replays its own loop nest (order ignored)."""
    if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S < 1:
        raise MacoError(f"cache size S must be a positive int of elements, got {S!r}")
    if policy not in POLICIES:
        raise MacoError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(tile_or_schedule, Tile):
        loops = tile_loops(spec, tile_or_schedule, order, inner_order)
    elif isinstance(tile_or_schedule, Schedule):
        loops = schedule_loops(spec, tile_or_schedule)
    else:
        raise MacoError(f"simulate_io takes a Tile or a Schedule, got {type(tile_or_schedule).__name__}")
    ids, out_base, untouched = _trace(spec, loops)
    if policy == "lru":
        loads, stores = _lru(ids.tolist(), int(S), out_base, spec.output_elems)
    else:
        loads, stores = _opt(ids, int(S), out_base, spec.output_elems)
    return IOCounts(loads, stores + untouched, int(ids.size), int(S), policy)
