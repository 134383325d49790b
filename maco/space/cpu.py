"""The CPU part of the schedule space (sketch "SSRSRS", maco.core.sketch_cpu): its exact count
and uniform draws, table by table (see maco.space.schedules for the method)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from maco.core.axes import SPATIAL_AXES, axis_extents
from maco.core.factors import divisors
from maco.core.schedule import LAYOUTS, UNROLL_STEPS, WEIGHT_PACKINGS, Schedule
from maco.core.sketch_cpu import free_registers, vector_width, vector_widths
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.space import prune
from maco.space.tables import broadcast_grid, choice_index, inner_orders, level_mask, window_extents

CPU_VECTOR_AXES = ("k", "ow")
CPU_PARALLEL = tuple(range(len(SPATIAL_AXES) + 1))


@dataclass
class CpuTables:
    divs: list[np.ndarray]
    div_of: list[np.ndarray]  # div_of[a][i, j]: divs[a][i] divides divs[a][j]
    vec: np.ndarray  # (2 or 8, grid): register tile + vector axis (and layout, packing: combos) choice valid
    c1: tuple[int, ...]  # the chunks (R1 factor of c)
    passes: tuple[tuple[int, int, int], ...]  # (c1, kh1, kw1) of each table below; the tables
    #                      are per pass, or one table for every pass where no rule looks at it
    n3: list[np.ndarray]
    n2: list[np.ndarray]
    n1: list[np.ndarray]
    kh1: tuple[int, ...]
    kw1: tuple[int, ...]
    layout_orders: tuple[tuple[str, tuple[str, ...]], ...]  # (layout, inner order) pairs
    size: int
    combos: tuple[tuple[str, str, str], ...] = ()  # (vector axis, layout, weight packing) rows of vec, if any
    combo_w: np.ndarray | None = None  # inner orders per combo (its layout's)
    rules: object = None
    parallel_ok: np.ndarray | None = None  # (parallel, grid) where rules keep every core busy


def _up(x: np.ndarray, div_of: list[np.ndarray]) -> np.ndarray:
    """y[j] = sum over i dividing j (per axis) of x[i]."""
    for ax, m in enumerate(div_of):
        x = np.moveaxis(np.tensordot(m.T.astype(np.int64), np.moveaxis(x, ax, 0), axes=1), 0, ax)
    return x


def _vector_width(target: Target, t: np.ndarray) -> np.ndarray:
    """sketch_cpu.vector_width of each register factor in `t`."""
    out = np.ones_like(t)
    for w in reversed(vector_widths(target)):
        out = np.where(t % w == 0, w, out)
    return out


@lru_cache(maxsize=64)
def tables(spec: ConvSpec, target: Target, rules) -> CpuTables:
    ext = axis_extents(spec)
    divs = [np.array(divisors(ext[a]), dtype=np.int64) for a in SPATIAL_AXES]
    div_of = [(d[None, :] % d[:, None] == 0) for d in divs]
    g = broadcast_grid(divs)
    outputs = g[0] * g[1] * g[2] * g[3] * g[4]
    free = free_registers(target)
    # with a register share rule the vector axis, the layout and the weight packing decide the
    # loads of a step (maco.space.prune.cpu_share): the tables then run over those triples, weighted by
    # the inner orders each layout allows; else over the vector axis alone
    shares = rules is not None and rules.registers is not None and bool(rules.registers.share_min)
    combos = tuple((a, lay, pk) for a in CPU_VECTOR_AXES for lay in LAYOUTS for pk in WEIGHT_PACKINGS) if shares else ()
    vec = []
    for axis, lay, packing in combos or [(a, None, None) for a in CPU_VECTOR_AXES]:
        acc = -(-outputs // _vector_width(target, g[SPATIAL_AXES.index(axis)]))
        ok = acc <= free
        if rules is not None and rules.registers is not None:
            share = (prune.cpu_share(spec, target, *g, axis, lay, packing, rules.registers.latency)
                     if shares else None)
            ok = ok & rules.registers.ok(acc, share=share)
        vec.append(ok)
    vec = np.stack(vec).astype(np.int64)
    combo_w = np.array([len(inner_orders(rules, "cpu", lay)) for _, lay, _ in combos], dtype=np.int64)
    c1 = tuple(divisors(ext["c"]))
    kh1, kw1 = window_extents(spec.kh, rules), window_extents(spec.kw, rules)
    busy = rules is not None and bool(rules.cores)
    parallel_ok = _parallel_ok(spec, g, rules.cores) if busy else None
    n3, n2, n1 = [], [], []
    # the level rules see the pass (chunk and taps), so each pass has its own tables (one for all
    # without them)
    passes = tuple((c, h, w) for c in c1 for h in kh1 for w in kw1) if rules is not None and rules.levels else ()
    for c, h, w in passes or ((None, None, None),):
        window = (h, w) if c is not None else (None, None)
        base = np.tensordot(combo_w, vec, axes=1) if combos else vec.sum(axis=0)
        n3.append(base * level_mask(rules, "S3", spec, g, c, window))
        n2.append(_up(n3[-1], div_of) * level_mask(rules, "S2", spec, g, c, window))
        n1.append(_up(n2[-1], div_of) * level_mask(rules, "S1", spec, g, c, window))
    if busy:  # the S1 tiles weighted by the parallel annotations that keep every core busy
        n1 = [n * parallel_ok.sum(axis=0) for n in n1]
    layout_orders = tuple((lay, o) for lay in LAYOUTS for o in inner_orders(rules, "cpu", lay))
    annotations = ((1 if busy else len(CPU_PARALLEL)) * len(UNROLL_STEPS)
                   * (1 if combos else len(WEIGHT_PACKINGS) * len(layout_orders)))
    tilings = sum(int(n.sum()) for n in n1) * (1 if passes else len(c1) * len(kh1) * len(kw1))
    size = tilings * annotations
    return CpuTables(divs, div_of, vec, c1, passes, n3, n2, n1, kh1, kw1, layout_orders, size, combos, combo_w, rules,
                parallel_ok)


def _parallel_ok(spec: ConvSpec, grid: list[np.ndarray], cores: int) -> np.ndarray:
    """(len(CPU_PARALLEL), grid): whether `parallel` = p fuses loops of at least `cores` iterations
    over an S1 tile of this size (the S0 factors are the extents over the S1 tile; maco.space.prune)."""
    ext = axis_extents(spec)
    iterations = np.ones([1] * len(grid), dtype=np.int64)
    out = []
    for p in CPU_PARALLEL:
        out.append(np.broadcast_to(iterations >= cores, np.broadcast_shapes(*(x.shape for x in grid))))
        if p < len(SPATIAL_AXES):
            iterations = iterations * (ext[SPATIAL_AXES[p]] // grid[p])
    return np.stack(out).astype(np.int64)


def sample(spec: ConvSpec, target: Target, t: CpuTables, rng: random.Random) -> Schedule:
    # per pass tables: the pass first; one table for all passes: the chunk and taps after the
    # tiles, as the space drew before the level rules (seeded draws of the full space stay the same)
    j = choice_index(np.array([int(n.sum()) for n in t.n1], dtype=np.int64), rng) if t.passes else 0
    n1, n2, n3 = t.n1[j], t.n2[j], t.n3[j]
    shape = n1.shape
    i1 = np.unravel_index(choice_index(n1, rng), shape)

    def below(weights: np.ndarray, upper: tuple) -> tuple:
        mask = np.ones(shape, dtype=bool)
        for ax, i in enumerate(upper):
            mask = mask & t.div_of[ax][:, i].reshape([-1 if a == ax else 1 for a in range(len(shape))])
        return np.unravel_index(choice_index(weights * mask, rng), shape)

    i2 = below(n2, i1)
    i3 = below(n3, i2)
    if t.combos:  # vector axis, layout and weight packing together, weighted by the layout's orders
        vaxis, layout, packing = t.combos[choice_index(t.combo_w * t.vec[(slice(None),) + i3], rng)]
    else:
        axes = [a for a, ok in zip(CPU_VECTOR_AXES, t.vec[(slice(None),) + i3]) if ok]
        vaxis = axes[rng.randrange(len(axes))]
    ext = axis_extents(spec)
    spatial = []
    for ax, a in enumerate(SPATIAL_AXES):
        t1, t2, t3 = (int(t.divs[ax][i[ax]]) for i in (i1, i2, i3))
        spatial.append((ext[a] // t1, t1 // t2, t2 // t3, t3))
    if t.passes:
        c1, kh1, kw1 = t.passes[j]
    else:
        c1 = rng.choice(t.c1)
        kh1, kw1 = (rng.choice(x) for x in (t.kh1, t.kw1))
    reduction = ((ext["c"] // c1, c1), (spec.kh // kh1, kh1), (spec.kw // kw1, kw1))
    width = vector_width(target, spatial[SPATIAL_AXES.index(vaxis)][3])
    if t.parallel_ok is not None:  # uniform over the parallel annotations this S1 tile allows
        parallel = CPU_PARALLEL[choice_index(t.parallel_ok[(slice(None),) + i1], rng)]
    else:
        parallel = rng.choice(CPU_PARALLEL)
    unroll = rng.choice(UNROLL_STEPS)
    if t.combos:
        order = rng.choice(inner_orders(t.rules, "cpu", layout))
    else:
        layout, order = rng.choice(t.layout_orders)
        packing = rng.choice(WEIGHT_PACKINGS)
    return Schedule(kind="cpu", spatial=tuple(spatial), reduction=reduction,
                    parallel=parallel, vector_axis=vaxis, vector_width=width,
                    unroll=unroll, inner_order=order,
                    layout=layout, weight_packing=packing)


def why_not(schedule: Schedule, target: Target) -> list[str]:
    """The annotations of a valid CPU schedule that the space never draws."""
    out = []
    if schedule.vector_axis not in CPU_VECTOR_AXES:
        out.append(f"vector axis {schedule.vector_axis!r} not in {CPU_VECTOR_AXES}")
    else:
        inner = schedule.factors(schedule.vector_axis)[-1]
        width = vector_width(target, inner)
        if schedule.vector_width != width:
            out.append(f"vector width {schedule.vector_width}: the space uses {width} for a "
                       f"register factor {inner} of {schedule.vector_axis}")
    if schedule.parallel not in CPU_PARALLEL:
        out.append(f"parallel {schedule.parallel} not in {CPU_PARALLEL}")
    if schedule.extra:
        out.append(f"the CPU space has no extra knobs, got {dict(schedule.extra)}")
    return out
