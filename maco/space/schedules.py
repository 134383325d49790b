"""The schedule space of one conv: every Schedule of the target's sketch with every annotation.

CPU sketch "SSRSRS": each spatial axis (n, g, k, oh, ow) in 4 perfect factors, each reduction
axis (c, kh, kw) in 2. Annotations: parallel = how many outermost S0 loops are fused and
parallel (0..5), vector axis k or ow (width = SIMD lanes when the register factor of that axis is
a multiple of them, else 1), unroll (UNROLL_STEPS), inner_order (the 6 orders of c, kh, kw),
layout (NCHW, NHWC), weight packing (none, blocked). Valid: the accumulators fit the free vector
registers (Schedule.problems).

GPU sketch "SSSRRSRS": spatial axes in 5 factors (block, vthread, thread, inner, inner), reduction
axes in 3 (stage, R1, R2). Annotations: unroll, inner_order, layout, weight packing, and in
`extra` the shared-memory stages in flight ("buffers" 2 = double buffering, 3, 4), the channel
split across thread groups ("split_c" 1, 2, 4, 8, 16, dividing c1; it stages outputs through
shared memory) and, without a split, whether outputs go through shared memory ("stage_out").
Valid: <= 1024 threads per block, the thread tile within half the per-thread registers, shared
memory within the block limit (Schedule.problems).

The compute-in-memory sketch "PSB" (cores, outer loops in any order, block) is counted and drawn
by maco.space.cim; its pruning is maco.space.prune_cim.

Counting is exact and never enumerates schedules. A CPU tiling of an axis is a chain of
divisors t3 | t2 | t1 | extent (t_l = product of the factors from level l inwards); the
conditions only look at one level of all axes at a time and at the pass (chunk c1, taps kh1 x kw1), so for each
pass the count is a sum over the joint divisor grids of the three levels, taken level by level
with divisibility matrices (a zeta transform over the product of divisor lattices). On GPU a
spatial axis reduces to (threads t, thread tile r) with multiplicity tau3(r) (the ordered (f1, f3,
f4)); the joint grid of these pairs is bucketed by block tile (t*r per axis) and shared memory is
checked per block tile and stage; the thread tile's level rule is a mask on the joint entries.
Sampling walks the same tables with exact integer weights, so it is uniform over the (pruned)
space without rejection.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations
from math import prod
from typing import Sequence

import numpy as np

from maco.space import cim as space_cim, prune
from maco.core.factors import divisors, factorizations, n_factorizations
from maco.core.errors import MacoError
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.schedule import LAYOUTS, UNROLL_STEPS, WEIGHT_PACKINGS, Schedule
from maco.core.sketch_cpu import REGISTER_RESERVE
from maco.core.sketch_cuda import (GPU_BUFFERS, GPU_MAX_THREADS,
                                   gpu_max_accumulators, gpu_max_shared_bytes, gpu_shared_bytes)
from maco.core.spec import ConvSpec
from maco.core.target import Target

CPU_VECTOR_AXES = ("k", "ow")
CPU_PARALLEL = tuple(range(len(SPATIAL_AXES) + 1))
INNER_ORDERS = tuple(permutations(REDUCTION_AXES))
GPU_SPLITS = (1, 2, 4, 8, 16)
GPU_STAGE_OUT = (False, True)


def _choice(weights: np.ndarray, rng: random.Random) -> int:
    """Index drawn with probability weights[i] / sum (exact integer arithmetic)."""
    cs = np.cumsum(weights.astype(np.int64).ravel())
    total = int(cs[-1]) if cs.size else 0
    if total <= 0:
        raise MacoError("internal: sampling from an empty part of the space")
    return int(np.searchsorted(cs, rng.randrange(total), side="right"))


def _rng(rng: random.Random | int | None) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, int):
        return random.Random(rng)
    raise MacoError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


def _check(spec: ConvSpec, target: Target) -> None:
    if not isinstance(spec, ConvSpec):
        raise MacoError(f"expected a ConvSpec, got {type(spec).__name__}")
    if not isinstance(target, Target):
        raise MacoError(f"expected a Target, got {type(target).__name__}")


def _plan(spec: ConvSpec, target: Target, pruned: bool, config):
    return prune_plan(spec, target, config) if pruned and target.kind != "cim" else None


def _orders(rules, kind: str, layout: str) -> tuple[tuple[str, ...], ...]:
    return tuple(o for o in INNER_ORDERS
                 if rules is None or not rules.alpha_one or prune.alpha_order_ok(o, kind, layout))


def _window(extent: int, rules) -> tuple[int, ...]:
    """Allowed inner extents of kh/kw (the full window only when alpha = 1)."""
    return (extent,) if rules is not None and rules.alpha_one else divisors(extent)


def _grid(values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per-axis 1-D arrays reshaped to broadcast over a 5-D grid."""
    return [v.reshape([-1 if i == j else 1 for j in range(len(values))]) for i, v in enumerate(values)]


def _level_mask(rules, tile: str, spec: ConvSpec, axes: list[np.ndarray], chunk: int,
                window: tuple = (None, None)) -> np.ndarray | bool:
    """Where the level rules on this tile level hold (maco.space.prune.LevelRule), for one pass: `chunk`
    channels by `window` (kh1, kw1) taps (None: the whole window)."""
    if rules is None:
        return True
    mask = True
    for rule in rules.levels:
        if rule.tile == tile:
            mask = mask & rule.ok(spec, *axes, chunk, *window)
    return mask


# -- CPU ---------------------------------------------------------------------------------------
@dataclass
class _Cpu:
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
    return np.where(t % target.simd_width == 0, target.simd_width, 1)


@lru_cache(maxsize=64)
def _cpu(spec: ConvSpec, target: Target, rules) -> _Cpu:
    ext = axis_extents(spec)
    divs = [np.array(divisors(ext[a]), dtype=np.int64) for a in SPATIAL_AXES]
    div_of = [(d[None, :] % d[:, None] == 0) for d in divs]
    g = _grid(divs)
    outputs = g[0] * g[1] * g[2] * g[3] * g[4]
    free = target.level("registers").elements // target.simd_width - REGISTER_RESERVE
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
    combo_w = np.array([len(_orders(rules, "cpu", lay)) for _, lay, _ in combos], dtype=np.int64)
    c1 = tuple(divisors(ext["c"]))
    kh1, kw1 = _window(spec.kh, rules), _window(spec.kw, rules)
    busy = rules is not None and bool(rules.cores)
    parallel_ok = _parallel_ok(spec, g, rules.cores) if busy else None
    n3, n2, n1 = [], [], []
    # the level rules see the pass (chunk and taps), so each pass has its own tables (one for all
    # without them)
    passes = tuple((c, h, w) for c in c1 for h in kh1 for w in kw1) if rules is not None and rules.levels else ()
    for c, h, w in passes or ((None, None, None),):
        window = (h, w) if c is not None else (None, None)
        base = np.tensordot(combo_w, vec, axes=1) if combos else vec.sum(axis=0)
        n3.append(base * _level_mask(rules, "S3", spec, g, c, window))
        n2.append(_up(n3[-1], div_of) * _level_mask(rules, "S2", spec, g, c, window))
        n1.append(_up(n2[-1], div_of) * _level_mask(rules, "S1", spec, g, c, window))
    if busy:  # the S1 tiles weighted by the parallel annotations that keep every core busy
        n1 = [n * parallel_ok.sum(axis=0) for n in n1]
    layout_orders = tuple((lay, o) for lay in LAYOUTS for o in _orders(rules, "cpu", lay))
    annotations = ((1 if busy else len(CPU_PARALLEL)) * len(UNROLL_STEPS)
                   * (1 if combos else len(WEIGHT_PACKINGS) * len(layout_orders)))
    tilings = sum(int(n.sum()) for n in n1) * (1 if passes else len(c1) * len(kh1) * len(kw1))
    size = tilings * annotations
    return _Cpu(divs, div_of, vec, c1, passes, n3, n2, n1, kh1, kw1, layout_orders, size, combos, combo_w, rules,
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


def _sample_cpu(spec: ConvSpec, target: Target, t: _Cpu, rng: random.Random) -> Schedule:
    # per pass tables: the pass first; one table for all passes: the chunk and taps after the
    # tiles, as the space drew before the level rules (seeded draws of the full space stay the same)
    j = _choice(np.array([int(n.sum()) for n in t.n1], dtype=np.int64), rng) if t.passes else 0
    n1, n2, n3 = t.n1[j], t.n2[j], t.n3[j]
    shape = n1.shape
    i1 = np.unravel_index(_choice(n1, rng), shape)

    def below(weights: np.ndarray, upper: tuple) -> tuple:
        mask = np.ones(shape, dtype=bool)
        for ax, i in enumerate(upper):
            mask = mask & t.div_of[ax][:, i].reshape([-1 if a == ax else 1 for a in range(len(shape))])
        return np.unravel_index(_choice(weights * mask, rng), shape)

    i2 = below(n2, i1)
    i3 = below(n3, i2)
    if t.combos:  # vector axis, layout and weight packing together, weighted by the layout's orders
        vaxis, layout, packing = t.combos[_choice(t.combo_w * t.vec[(slice(None),) + i3], rng)]
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
    width = target.simd_width if spatial[SPATIAL_AXES.index(vaxis)][3] % target.simd_width == 0 else 1
    if t.parallel_ok is not None:  # uniform over the parallel annotations this S1 tile allows
        parallel = CPU_PARALLEL[_choice(t.parallel_ok[(slice(None),) + i1], rng)]
    else:
        parallel = rng.choice(CPU_PARALLEL)
    unroll = rng.choice(UNROLL_STEPS)
    if t.combos:
        order = rng.choice(_orders(t.rules, "cpu", layout))
    else:
        layout, order = rng.choice(t.layout_orders)
        packing = rng.choice(WEIGHT_PACKINGS)
    return Schedule(kind="cpu", spatial=tuple(spatial), reduction=reduction,
                    parallel=parallel, vector_axis=vaxis, vector_width=width,
                    unroll=unroll, inner_order=order,
                    layout=layout, weight_packing=packing)


# -- GPU ---------------------------------------------------------------------------------------
@dataclass
class _Gpu:
    pairs: list[np.ndarray]  # per axis: (P, 2) array of (threads, thread tile)
    joint: dict[str, np.ndarray]  # flattened joint grid of pair indices, sorted by block index
    starts: np.ndarray  # joint entries of block b: starts[b]:starts[b+1]
    weight: np.ndarray  # joint entry multiplicity: prod over axes of tau3(thread tile)
    threads: np.ndarray  # joint entry threads per block (without the channel split)
    acc: np.ndarray  # joint entry accumulators per thread
    thread_ok: np.ndarray  # joint entry meets the thread tile's level rule (maco.space.prune)
    block_dims: list[np.ndarray]
    combos: list[tuple]  # (cc, split, khc, kwc, layout, buffers, stage_out, multiplicity)
    combo_w: list[int]
    block_w: dict[int, np.ndarray]  # per split: weighted valid decompositions per block tile
    orders: tuple[tuple[str, ...], ...]
    size: int


def _c_splits(c: int, cc: int, split: int) -> list[tuple[int, int]]:
    """(c1, c2) with c1 * c2 = cc and split | c1."""
    return [(c1, cc // c1) for c1 in divisors(cc) if c1 % split == 0]


def _thread_ok(target: Target, rules, threads: np.ndarray, acc: np.ndarray, split: int,
               level_ok: np.ndarray | bool = True) -> np.ndarray:
    """Thread-level validity (and the register rules of pruning) of joint entries for one split."""
    ok = (acc <= gpu_max_accumulators(target)) & (threads * split <= GPU_MAX_THREADS) & level_ok
    if rules is not None and rules.registers is not None:
        ok = ok & rules.registers.ok(acc, threads * split)
    return ok


@lru_cache(maxsize=8)
def _gpu(spec: ConvSpec, target: Target, rules) -> _Gpu:
    ext = axis_extents(spec)
    divs = [divisors(ext[a]) for a in SPATIAL_AXES]
    pairs, mult, bpos = [], [], []
    for d in divs:
        ps = [(t, r) for b in d for t in divisors(b) for r in (b // t,)]
        pairs.append(np.array(ps, dtype=np.int64))
        mult.append(np.array([n_factorizations(r, 3) for _, r in ps], dtype=np.int64))
        bpos.append(np.array([d.index(t * r) for t, r in ps], dtype=np.int64))
    mesh = [m.ravel() for m in np.meshgrid(*[np.arange(len(p)) for p in pairs], indexing="ij")]
    block = np.ravel_multi_index([bp[m] for bp, m in zip(bpos, mesh)], [len(d) for d in divs])
    order = np.argsort(block, kind="stable")
    mesh = [m[order] for m in mesh]
    block = block[order]
    n_blocks = prod(len(d) for d in divs)
    starts = np.searchsorted(block, np.arange(n_blocks + 1))
    threads = prod(p[m, 0] for p, m in zip(pairs, mesh))
    acc = prod(p[m, 1] for p, m in zip(pairs, mesh))
    weight = prod(w[m] for w, m in zip(mult, mesh))
    thread_ok = np.asarray(_level_mask(rules, "thread", spec, [p[m, 1] for p, m in zip(pairs, mesh)],
                                       spec.c_per_group), dtype=bool) & np.ones(len(acc), bool)
    block_w = {split: np.bincount(block, weights=weight * _thread_ok(target, rules, threads, acc, split,
                                                                     thread_ok),
                                  minlength=n_blocks).astype(np.int64) for split in GPU_SPLITS}
    mesh = [m.astype(np.int16 if len(p) < 2 ** 15 else np.int32) for m, p in zip(mesh, pairs)]
    bd = [b.ravel() for b in np.meshgrid(*[np.array(d, dtype=np.int64) for d in divs], indexing="ij")]
    bdict = dict(zip(SPATIAL_AXES, bd))
    shared_ok = np.asarray(_level_mask(rules, "block", spec, bd, spec.c_per_group), dtype=bool) \
        & np.ones(n_blocks, bool)
    limit = gpu_max_shared_bytes(target)
    combos, combo_w = [], []
    khs, kws = _window(spec.kh, rules), _window(spec.kw, rules)
    for cc in divisors(ext["c"]):
        for split in GPU_SPLITS:
            mc = len(_c_splits(ext["c"], cc, split))
            if not mc or not block_w[split].any():
                continue
            for khc in khs:
                for kwc in kws:
                    m = mc * n_factorizations(khc, 2) * n_factorizations(kwc, 2)
                    for layout in LAYOUTS:
                        for buffers in GPU_BUFFERS:
                            for stage_out in (GPU_STAGE_OUT if split == 1 else (True,)):
                                smem = gpu_shared_bytes(spec, bdict, cc, khc, kwc, layout, buffers,
                                                        stage_out, split)
                                w = int((block_w[split] * (shared_ok & (smem <= limit))).sum())
                                if w:
                                    combos.append((cc, split, khc, kwc, layout, buffers, stage_out, m))
                                    combo_w.append(w * m)
    orders = _orders(rules, "cuda", "NCHW")  # the GPU rule does not depend on the layout
    size = sum(combo_w) * len(UNROLL_STEPS) * len(orders) * len(WEIGHT_PACKINGS)
    joint = dict(zip(SPATIAL_AXES, mesh))
    return _Gpu(pairs, joint, starts, weight, threads.astype(np.int32), acc.astype(np.int32), thread_ok, bd, combos,
                combo_w, block_w, orders, size)


def _sample_gpu(spec: ConvSpec, target: Target, t: _Gpu, rules, rng: random.Random) -> Schedule:
    if not t.combo_w:
        raise MacoError(f"the GPU space of {spec} on {target.name} is empty")
    pick, acc = rng.randrange(sum(t.combo_w)), 0
    for combo, w in zip(t.combos, t.combo_w):
        acc += w
        if pick < acc:
            break
    cc, split, khc, kwc, layout, buffers, stage_out, _ = combo
    bdict = dict(zip(SPATIAL_AXES, t.block_dims))
    smem = gpu_shared_bytes(spec, bdict, cc, khc, kwc, layout, buffers, stage_out, split)
    ok = (smem <= gpu_max_shared_bytes(target)) & np.asarray(_level_mask(rules, "block", spec, t.block_dims,
                                                                          spec.c_per_group))
    b = _choice(t.block_w[split] * ok, rng)
    lo, hi = t.starts[b], t.starts[b + 1]
    seg = [t.joint[a][lo:hi] for a in SPATIAL_AXES]
    j = _choice(t.weight[lo:hi] * _thread_ok(target, rules, t.threads[lo:hi].astype(np.int64),
                                              t.acc[lo:hi].astype(np.int64), split, t.thread_ok[lo:hi]), rng)
    ext = axis_extents(spec)
    spatial = []
    for i, a in enumerate(SPATIAL_AXES):
        threads, tile = (int(v) for v in t.pairs[i][seg[i][j]])
        f1, f3, f4 = rng.choice(factorizations(tile, 3))
        spatial.append((ext[a] // (threads * tile), f1, threads, f3, f4))
    c1, c2 = rng.choice(_c_splits(ext["c"], cc, split))
    kh1, kh2 = rng.choice(factorizations(khc, 2))
    kw1, kw2 = rng.choice(factorizations(kwc, 2))
    reduction = ((ext["c"] // cc, c1, c2), (spec.kh // khc, kh1, kh2), (spec.kw // kwc, kw1, kw2))
    extra = []
    if buffers != 2:
        extra.append(("buffers", buffers))
    if split > 1:
        extra.append(("split_c", split))
    elif stage_out:
        extra.append(("stage_out", True))
    return Schedule(kind="cuda", spatial=tuple(spatial), reduction=reduction,
                    unroll=rng.choice(UNROLL_STEPS), inner_order=rng.choice(t.orders), layout=layout,
                    weight_packing=rng.choice(WEIGHT_PACKINGS), extra=tuple(sorted(extra)))


# -- public API --------------------------------------------------------------------------------
@lru_cache(maxsize=512)
def prune_plan(spec: ConvSpec, target: Target, config: prune.PruneConfig | None = None) -> prune.PrunePlan:
    """MACO's pruning conditions for `spec` on `target` (maco.space.prune), relaxed until the pruned
    space is not empty."""
    config = config or prune.PruneConfig()
    names = [name for name, _ in prune.levels(spec, target)]
    steps = {name: 0 for name in names}
    if count_with(spec, target, prune.rules(spec, target, config, steps)) > 0:
        return prune.rules(spec, target, config, steps)
    for name in names:  # a level that alone leaves nothing is relaxed on its own
        alone = {other: config.max_relax + 1 for other in names}
        while steps[name] <= config.max_relax:
            alone[name] = steps[name]
            if count_with(spec, target, prune.rules(spec, target, config, alone)) > 0:
                break
            steps[name] += 1
    for name in reversed(names):  # then the levels together, from the outermost inwards
        while steps[name] <= config.max_relax:
            if count_with(spec, target, prune.rules(spec, target, config, steps)) > 0:
                return prune.rules(spec, target, config, steps)
            steps[name] += 1
    return prune.rules(spec, target, config, steps)


def count_with(spec: ConvSpec, target: Target, rules=None) -> int:
    """Size of the space under a prune.PrunePlan (None: the full space)."""
    return (_cpu if target.kind == "cpu" else _gpu)(spec, target, rules).size


def space_size(spec: ConvSpec, target: Target, pruned: bool = False, config=None) -> int:
    """Exact number of schedules in the space (pruned: after MACO pruning with `config`)."""
    _check(spec, target)
    if target.kind == "cim":
        return space_cim.size(spec, target, pruned)
    return count_with(spec, target, _plan(spec, target, pruned, config))


def sample(spec: ConvSpec, target: Target, rng: random.Random | int | None = None,
           pruned: bool = False, config=None) -> Schedule:
    """One schedule drawn uniformly from the (pruned) space."""
    _check(spec, target)
    rng = _rng(rng)
    if target.kind == "cim":
        return space_cim.sample(spec, target, rng, pruned)
    rules = _plan(spec, target, pruned, config)
    if target.kind == "cpu":
        return _sample_cpu(spec, target, _cpu(spec, target, rules), rng)
    return _sample_gpu(spec, target, _gpu(spec, target, rules), rules, rng)


def sample_many(spec: ConvSpec, target: Target, n: int, rng: random.Random | int | None = None,
                pruned: bool = False, config=None) -> list[Schedule]:
    """`n` independent uniform draws (duplicates possible, as with any sampling with replacement)."""
    if not isinstance(n, int) or n < 0:
        raise MacoError(f"n must be a non-negative int, got {n!r}")
    rng = _rng(rng)
    return [sample(spec, target, rng, pruned, config) for _ in range(n)]


def contains(schedule: Schedule, spec: ConvSpec, target: Target, pruned: bool = False,
             config=None) -> bool:
    """Whether `schedule` is a point of the (pruned) space of `spec` on `target`."""
    return not why_not(schedule, spec, target, pruned, config)


def why_not(schedule: Schedule, spec: ConvSpec, target: Target, pruned: bool = False,
            config=None) -> list[str]:
    """What keeps `schedule` out of the (pruned) space (empty if it is in)."""
    _check(spec, target)
    out = schedule.problems(spec, target)
    if out:
        return out
    if target.kind == "cim":
        return space_cim.why_not(schedule, spec, target, pruned)
    if schedule.unroll not in UNROLL_STEPS:
        out.append(f"unroll {schedule.unroll} not in {UNROLL_STEPS}")
    if schedule.kind == "cpu":
        if schedule.vector_axis not in CPU_VECTOR_AXES:
            out.append(f"vector axis {schedule.vector_axis!r} not in {CPU_VECTOR_AXES}")
        else:
            inner = schedule.factors(schedule.vector_axis)[-1]
            width = target.simd_width if inner % target.simd_width == 0 else 1
            if schedule.vector_width != width:
                out.append(f"vector width {schedule.vector_width}: the space uses {width} for a "
                           f"register factor {inner} of {schedule.vector_axis}")
        if schedule.parallel not in CPU_PARALLEL:
            out.append(f"parallel {schedule.parallel} not in {CPU_PARALLEL}")
        if schedule.extra:
            out.append(f"the CPU space has no extra knobs, got {dict(schedule.extra)}")
    else:
        if (schedule.parallel, schedule.vector_axis, schedule.vector_width) != (1, "k", 1):
            out.append("GPU schedules keep parallel=1, vector_axis='k', vector_width=1")
        opt = schedule.option
        canonical = []
        if opt.get("buffers", 2) != 2:
            canonical.append(("buffers", opt["buffers"]))
        split = opt.get("split_c", 1)
        if split not in GPU_SPLITS:
            out.append(f"split_c {split!r} not in {GPU_SPLITS}")
        if split != 1:
            canonical.append(("split_c", split))
            if opt.get("stage_out", True) is not True:
                out.append("split_c > 1 stages outputs through shared memory")
        elif opt.get("stage_out", False):
            canonical.append(("stage_out", True))
        if tuple(sorted(schedule.extra)) != tuple(sorted(canonical)) and not out:
            out.append(f"extra {dict(schedule.extra)} is not in the space's canonical form "
                       f"{dict(canonical)} (defaults left out)")
    if out or not pruned:
        return out
    return prune.reasons(schedule, spec, target, prune_plan(spec, target, config))
