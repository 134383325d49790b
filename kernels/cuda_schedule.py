"""Default GPU schedules: a structured set of candidates, ranked by a small roofline model.

Why a model and not the MACO tile alone: at batch 1 the tile that minimises shared-memory
traffic (x*y*z = S/Np with x*y = R*z) leaves most of the 132 SMs idle, so the block tile is the
MACO tile capped by the parallelism the layer has. The model charges, per SM: instruction issue
(FMAs, shared loads with the kw-reuse of a register row, global->shared copies), the shared-memory
pipe, L2->SM traffic (the paper's reads formula, per block), wave quantisation and latency that
too few warps cannot hide. The top candidates are what a measured search starts from.
"""
from __future__ import annotations

from functools import lru_cache
from math import sqrt

import numpy as np

from maco.errors import MacoError
from maco.kernels.cuda_codegen import MAX_SMEM_BYTES
from maco.schedule import Schedule
from maco.spec import ConvSpec
from maco.target import Target

# H100-class per-SM machine model (cycles); the Target supplies SMs, clock and shared memory.
ISSUE_PER_CLK = 4  # warp instructions per cycle per SM (4 schedulers)
LDS_PER_CLK = 1  # shared-memory wavefronts per cycle per SM (128 B/clk)
L2_BYTES_PER_CLK = 28  # L2 -> SM bytes per cycle per SM, sustained
STAGE_OVERHEAD = 120  # cycles per stage: two barriers and the pipeline refill
COPY_INSTR = 14  # instructions per element copied global -> shared (index decode + cp.async)
MAX_THREADS_SM, MAX_BLOCKS_SM, REGS_SM = 2048, 32, 65536
WARP_IPC = 0.6  # instructions per cycle one warp sustains (dependent loads, FMA latency)
LAUNCH_SECONDS = 2e-6
KEEP = 4000  # ranked candidates kept per layer
AXES = ("n", "g", "k", "oh", "ow")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def maco_tile(spec: ConvSpec, target: Target) -> tuple[float, float, float]:
    """(x, y, z): output tile along ow, oh, k with x*y = R*z and x*y*z = S/Np at shared memory.
    Uses maco.bounds.optimal_tile when the bounds package provides it."""
    shared = target.level("shared")
    try:
        from maco.bounds import optimal_tile  # type: ignore[attr-defined]

        t = optimal_tile(spec, shared.elements, shared.processors)
        return float(t.x), float(t.y), float(t.z)
    except (ImportError, AttributeError, TypeError):
        # x*y = R*z and x*y*z = S/Np  =>  R*z^2 = S/Np  =>  z = sqrt(S/(Np R)), x*y = sqrt(R S/Np)
        r = spec.kh * spec.kw / (spec.stride[0] * spec.stride[1])
        s = shared.elements_per_processor
        z = sqrt(s / r)
        xy = sqrt(r * s)
        return sqrt(xy), sqrt(xy), z


def _options(spec: ConvSpec) -> dict[str, list[tuple[int, int]]]:
    """(threads, register tile) choices per spatial axis; the rest of the extent goes to blocks."""
    ext = dict(n=spec.n, g=spec.groups, k=spec.k_per_group, oh=spec.out_h, ow=spec.out_w)
    caps = dict(n=(4, 4), g=(256, 8), k=(64, 16), oh=(32, 4), ow=(32, 8))  # (max threads, max regs)
    out = {}
    for axis, e in ext.items():
        tmax, rmax = caps[axis]
        out[axis] = [(t, r) for t in divisors(e) if t <= tmax for r in divisors(e // t) if r <= rmax]
    return out


def _stage_channels(cg: int) -> list[int]:
    ds = [d for d in divisors(cg) if d <= 32]
    return sorted({d for d in ds if d >= min(4, ds[-1])} | {ds[-1]})


@lru_cache(maxsize=256)
def _ranked(spec: ConvSpec, target: Target, layout: str) -> list[tuple[float, tuple[int, ...]]]:
    """All structured candidates with their predicted seconds, best first, as raw tuples
    (tn, rn, tg, rg, tk, rk, th, rh, tw, rw, cc, split). Vectorised: a layer has ~1e5 of them."""
    opts = _options(spec)
    ccs = _stage_channels(spec.c_per_group)
    splits = [1, 2, 4, 8, 16]
    grids = np.meshgrid(*[np.arange(len(opts[a])) for a in AXES], np.arange(len(ccs)),
                        np.arange(len(splits)), indexing="ij")
    idx = [g.ravel() for g in grids]
    v = {}
    for i, a in enumerate(AXES):
        o = np.array(opts[a], dtype=np.int64)
        v["t" + a], v["r" + a] = o[idx[i], 0], o[idx[i], 1]
    cc = np.array(ccs, dtype=np.int64)[idx[5]]
    split = np.array(splits, dtype=np.int64)[idx[6]]
    sh, sw = spec.stride
    dh, dw = spec.dilation
    b = {a: v["t" + a] * v["r" + a] for a in AXES}
    nts = v["tn"] * v["tg"] * v["tk"] * v["toh"] * v["tow"]
    nt = nts * split
    acc = v["rn"] * v["rg"] * v["rk"] * v["roh"] * v["row"]
    tb = b["n"] * b["g"] * b["k"] * b["oh"] * b["ow"]
    x, y, z = maco_tile(spec, target)
    ok = (nt <= 1024) & (nt >= 32) & (acc <= 64) & (tb >= 64) & (tb <= x * y * z)
    ok &= (cc % split == 0) & ((split == 1) | (nt <= 512))
    ph = (b["oh"] - 1) * sh + (spec.kh - 1) * dh + 1
    pw = (b["ow"] - 1) * sw + (spec.kw - 1) * dw + 1
    plane = ph * pw + ((ph * pw % 2 == 0) & (layout == "NHWC"))
    in_elems = b["n"] * b["g"] * cc * ph * pw
    w_stage = b["g"] * cc * spec.kh * spec.kw * b["k"]
    stage = b["n"] * b["g"] * cc * plane + w_stage
    smem = 4 * np.maximum(2 * stage, np.where(split > 1, split * tb, 0))
    ok &= smem <= min(MAX_SMEM_BYTES, target.level("shared").capacity)
    stages = spec.c_per_group // cc
    blocks = spec.n * spec.groups * spec.k_per_group * spec.out_h * spec.out_w // tb
    # per (c, kh) step of one thread: the register row of inputs serves all kw taps
    row_len = (v["row"] - 1) * sw + (spec.kw - 1) * dw + 1
    x_loads = v["rn"] * v["rg"] * v["roh"] * row_len
    w_loads = v["rg"] * v["rk"] * spec.kw
    fmas = acc * spec.kw
    steps = spec.c_per_group // split * spec.kh
    warps = -(-nt // 32)
    regs = np.minimum(255, -(-(24 + acc + v["rg"] * v["rk"] + x_loads) // 8) * 8)
    with np.errstate(divide="ignore"):
        bps = np.minimum.reduce([np.full_like(nt, MAX_BLOCKS_SM), MAX_THREADS_SM // (warps * 32),
                                 target.level("shared").capacity // (smem + 1024),
                                 REGS_SM // (warps * 32 * regs)])
    ok &= bps >= 1
    copy = (in_elems + w_stage) * stages
    warp_instr = steps * (fmas + x_loads + w_loads + 2) + copy * COPY_INSTR / nt
    issue = warps * warp_instr / ISSUE_PER_CLK
    lds = warps * steps * (x_loads + w_loads) / LDS_PER_CLK
    l2 = copy * 4 / L2_BYTES_PER_CLK
    latency = warp_instr / WARP_IPC + stages * STAGE_OVERHEAD
    per_sm = -(-blocks // target.cores)
    rounds = -(-per_sm // np.maximum(bps, 1))
    cycles = np.maximum(per_sm * np.maximum.reduce([issue, lds, l2]), rounds * latency)
    seconds = cycles / ((target.freq_ghz or 1.5) * 1e9) + LAUNCH_SECONDS
    # tie-break toward the MACO tile ratio x*y = R*z
    r = spec.kh * spec.kw / (sh * sw)
    seconds = seconds * (1 + 0.01 * np.abs(np.log(b["n"] * b["oh"] * b["ow"] / (r * b["g"] * b["k"]))))
    keep = np.flatnonzero(ok)
    order = keep[np.argsort(seconds[keep], kind="stable")][:KEEP]
    cols = [v["tn"], v["rn"], v["tg"], v["rg"], v["tk"], v["rk"], v["toh"], v["roh"], v["tow"],
            v["row"], cc, split]
    return [(float(seconds[i]), tuple(int(c[i]) for c in cols)) for i in order]


def _schedule(spec: ConvSpec, layout: str, raw: tuple[int, ...]) -> Schedule:
    tn, rn, tg, rg, tk, rk, th, rh, tw, rw, cc, split = raw
    e = dict(n=spec.n, g=spec.groups, k=spec.k_per_group, oh=spec.out_h, ow=spec.out_w)

    def sp(axis: str, t: int, r: int) -> tuple[int, ...]:
        return (e[axis] // (t * r), 1, t, 1, r)

    return Schedule(kind="cuda",
                    spatial=(sp("n", tn, rn), sp("g", tg, rg), sp("k", tk, rk), sp("oh", th, rh),
                             sp("ow", tw, rw)),
                    reduction=((spec.c_per_group // cc, cc, 1), (1, 1, spec.kh), (1, 1, spec.kw)),
                    unroll=64, layout=layout, weight_packing="blocked",
                    extra=(("split_c", split),) if split > 1 else ())


def predicted_seconds(spec: ConvSpec, schedule: Schedule, target: Target | None = None) -> float | None:
    """The model's time for a schedule of the structured family (None if not in it)."""
    target = target or Target.h100()
    for sec, raw in _ranked(spec, target, schedule.layout):
        if _schedule(spec, schedule.layout, raw) == schedule:
            return sec
    return None


def candidates(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW",
               limit: int = 16) -> list[Schedule]:
    """The model's `limit` best schedules with distinct block/thread shapes (best first)."""
    target = target or Target.h100()
    out: list[Schedule] = []
    seen: set[tuple[int, ...]] = set()
    for _, raw in _ranked(spec, target, layout):
        shape = raw[:10:2] + raw[1:10:2]  # threads and register tile; stage depth may repeat
        if shape in seen:
            continue
        seen.add(shape)
        out.append(_schedule(spec, layout, raw))
        if len(out) >= limit:
            break
    return out


def default_schedule(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW") -> Schedule:
    """The model's best schedule for `spec` on `target` (the H100 when None)."""
    best = candidates(spec, target, layout, limit=1)
    if not best:
        raise MacoError(f"no CUDA schedule of the default family fits {spec} on "
                        f"{(target or Target.h100()).name}")
    return best[0]


def _random_factors(extent: int, levels: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A random ordered factorisation of `extent` into `levels` factors."""
    out = [1] * levels
    n, p = extent, 2
    while n > 1:
        while n % p:
            p += 1
        out[int(rng.integers(levels))] *= p
        n //= p
    return tuple(out)


def random_schedule(spec: ConvSpec, rng: np.random.Generator, layout: str = "NCHW",
                    tries: int = 1000) -> Schedule:
    """A random valid schedule of the full GPU sketch (every level, vthreads, split_c, unroll,
    inner order, packing): the test set for code generation."""
    from maco.kernels.cuda_codegen import CudaPlan
    from maco.schedule import REDUCTION_AXES, UNROLL_STEPS, axis_extents

    ext = axis_extents(spec)
    for _ in range(tries):
        spatial = tuple(_random_factors(ext[a], 5, rng) for a in AXES)
        reduction = tuple(_random_factors(ext[a], 3, rng) for a in REDUCTION_AXES)
        c1 = reduction[0][1]
        split = int(rng.choice([d for d in divisors(c1) if d <= 8]))
        extra: tuple = (("split_c", split),) if split > 1 else ()
        if split == 1 and rng.random() < 0.3:
            extra = extra + (("stage_out", bool(rng.random() < 0.5)),)
        if rng.random() < 0.4:
            extra = extra + (("buffers", int(rng.choice([2, 3, 4]))),)
        sch = Schedule(kind="cuda", spatial=spatial, reduction=reduction,
                       unroll=int(rng.choice(UNROLL_STEPS)), layout=layout,
                       inner_order=tuple(rng.permutation(list(REDUCTION_AXES))),
                       weight_packing=str(rng.choice(["blocked", "none"])), extra=extra)
        plan = CudaPlan(spec, sch)
        if not plan.problems() and plan.accumulators <= 32 and plan.threads <= 512 \
                and plan.unrolled_fmas <= 1024:
            return sch
    raise MacoError(f"no random valid CUDA schedule found for {spec} in {tries} tries")
