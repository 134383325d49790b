"""The GPU part of the schedule space (sketch "SSSRRSRS", maco.core.sketch_cuda): its exact count
and uniform draws over block tiles and stages (see maco.space.schedules for the method)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from math import prod

import numpy as np

from maco.core.axes import SPATIAL_AXES, axis_extents
from maco.core.errors import MacoError
from maco.core.factors import divisors, factorizations, n_factorizations
from maco.core.schedule import LAYOUTS, UNROLL_STEPS, WEIGHT_PACKINGS, Schedule
from maco.core.sketch_cuda import (GPU_BUFFERS, GPU_MAX_THREADS, gpu_max_accumulators, gpu_max_shared_bytes,
                                   gpu_shared_bytes)
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.space.tables import choice_index, inner_orders, level_mask, window_extents

GPU_SPLITS = (1, 2, 4, 8, 16)
GPU_STAGE_OUT = (False, True)


@dataclass
class GpuTables:
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
def tables(spec: ConvSpec, target: Target, rules) -> GpuTables:
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
    thread_ok = np.asarray(level_mask(rules, "thread", spec, [p[m, 1] for p, m in zip(pairs, mesh)],
                                       spec.c_per_group), dtype=bool) & np.ones(len(acc), bool)
    block_w = {split: np.bincount(block, weights=weight * _thread_ok(target, rules, threads, acc, split,
                                                                     thread_ok),
                                  minlength=n_blocks).astype(np.int64) for split in GPU_SPLITS}
    mesh = [m.astype(np.int16 if len(p) < 2 ** 15 else np.int32) for m, p in zip(mesh, pairs)]
    bd = [b.ravel() for b in np.meshgrid(*[np.array(d, dtype=np.int64) for d in divs], indexing="ij")]
    bdict = dict(zip(SPATIAL_AXES, bd))
    shared_ok = np.asarray(level_mask(rules, "block", spec, bd, spec.c_per_group), dtype=bool) \
        & np.ones(n_blocks, bool)
    limit = gpu_max_shared_bytes(target)
    combos, combo_w = [], []
    khs, kws = window_extents(spec.kh, rules), window_extents(spec.kw, rules)
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
    orders = inner_orders(rules, "cuda", "NCHW")  # the GPU rule does not depend on the layout
    size = sum(combo_w) * len(UNROLL_STEPS) * len(orders) * len(WEIGHT_PACKINGS)
    joint = dict(zip(SPATIAL_AXES, mesh))
    return GpuTables(pairs, joint, starts, weight, threads.astype(np.int32), acc.astype(np.int32), thread_ok, bd, combos,
                combo_w, block_w, orders, size)


def sample(spec: ConvSpec, target: Target, t: GpuTables, rules, rng: random.Random) -> Schedule:
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
    ok = (smem <= gpu_max_shared_bytes(target)) & np.asarray(level_mask(rules, "block", spec, t.block_dims,
                                                                          spec.c_per_group))
    b = choice_index(t.block_w[split] * ok, rng)
    lo, hi = t.starts[b], t.starts[b + 1]
    seg = [t.joint[a][lo:hi] for a in SPATIAL_AXES]
    j = choice_index(t.weight[lo:hi] * _thread_ok(target, rules, t.threads[lo:hi].astype(np.int64),
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


def why_not(schedule: Schedule) -> list[str]:
    """The annotations of a valid GPU schedule that the space never draws, and knobs not in the
    space's canonical form (defaults left out)."""
    out = []
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
    return out
