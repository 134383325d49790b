"""Default GPU schedules: a structured set of candidates, ranked by a small roofline model.

Why a model and not the MACO tile alone: at batch 1 the tile that minimises shared-memory
traffic (x*y*z = S/Np with x*y = R*z) leaves most of the 132 SMs idle, so the block tile is the
MACO tile capped by the parallelism the layer has. The model charges, per SM: instruction issue
(FMAs, shared loads with the kw-reuse of a register row, global->shared copies), the shared-memory
pipe, L2->SM traffic (the paper's reads formula, per block), wave quantisation and latency that
too few warps cannot hide. The top candidates are what a measured search starts from.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from math import sqrt

import numpy as np

from maco.core.errors import MacoError
from maco.core.geometry import paper_reuse
from maco.kernels.cuda_codegen import SM_MAX_BLOCKS, SM_MAX_THREADS, CudaPlan
from maco.core.axes import REDUCTION_AXES, axis_extents
from maco.core.schedule import UNROLL_STEPS, Schedule
from maco.core.sketch_cuda import gpu_max_shared_bytes
from maco.core.spec import ConvSpec
from maco.space.schedules import why_not
from maco.core.target import Target

# H100-class per-SM machine model (cycles); the Target supplies SMs, clock and shared memory.
ISSUE_PER_CLK = 4  # warp instructions per cycle per SM (4 schedulers)
LDS_PER_CLK = 1  # shared-memory wavefronts per cycle per SM (128 B/clk)
WARP_IPC = 0.5  # instructions per cycle one warp sustains (dependent loads, FMA latency)
MEM_LATENCY = 800  # cycles from issuing a global->shared copy to its arrival (L2 hit)
BARRIER = 40  # cycles per __syncthreads
COPY_INSTR = 14  # instructions per element copied global -> shared (index decode + cp.async)
REGS_SM = 65536
DRAM_BYTES_PER_S = 3.0e12
L2_BYTES_PER_S = 5.5e12
LAUNCH_SECONDS = 2e-6
PARTIAL_WRITE = 7  # cost factor of output sectors written in halves (see predict)
KEEP = 4000  # ranked candidates kept per layer
# FMAs one unrolled body of the reduction may hold: above it, an H200 ran the same kernels faster
# with the R2 loops alone unrolled (results/gpu_1127/README.md, "Instruction fetch")
MAX_UNROLLED_FMAS = 2048
AXES = ("n", "g", "k", "oh", "ow")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def maco_tile(spec: ConvSpec, target: Target) -> tuple[float, float, float]:
    """(x, y, z): the continuous MACO output tile along ow, oh, k at shared memory, x*y = R*z and
    x*y*z = S/Np. Continuous on purpose: it caps a whole block (all groups and images), so the
    per-group integer tile of maco.bounds.optimal_tile would be too small for depthwise layers."""
    # x*y = R*z and x*y*z = S/Np  =>  R*z^2 = S/Np  =>  z = sqrt(S/(Np R)), x*y = sqrt(R S/Np)
    r = paper_reuse(spec)
    s = target.level("shared").elements_per_processor
    xy = sqrt(r * s)
    return sqrt(xy), sqrt(xy), sqrt(s / r)


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
    ds = [d for d in divisors(cg) if d <= 64]
    return sorted({d for d in ds if d >= min(8, ds[-1])} | {ds[-1]})


RAW = ("tn", "rn", "tg", "rg", "tk", "rk", "toh", "roh", "tow", "row", "cc", "split", "buf")


def predict(spec: ConvSpec, target: Target, layout: str, v: dict[str, np.ndarray]
            ) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, feasible) for arrays of raw candidates `v` (keys RAW): a per-SM cycle model.

    Per stage a block issues its FMAs, shared loads and global->shared copies; co-resident
    blocks share the SM's 4 schedulers, one warp alone issues at most WARP_IPC per cycle, and a
    stage cannot be shorter than the load latency the other buffers hide. Blocks run in rounds
    of `blocks per SM` (wave quantisation); DRAM and L2 bandwidth bound the whole launch."""
    sh, sw = spec.stride
    dh, dw = spec.dilation
    cc, split, buf = v["cc"], v["split"], v["buf"]
    b = {a: v["t" + a] * v["r" + a] for a in AXES}
    nt = v["tn"] * v["tg"] * v["tk"] * v["toh"] * v["tow"] * split
    acc = v["rn"] * v["rg"] * v["rk"] * v["roh"] * v["row"]
    tb = b["n"] * b["g"] * b["k"] * b["oh"] * b["ow"]
    ph = (b["oh"] - 1) * sh + (spec.kh - 1) * dh + 1
    pw = (b["ow"] - 1) * sw + (spec.kw - 1) * dw + 1
    plane = ph * pw + ((ph * pw % 2 == 0) & (layout == "NHWC"))
    in_elems = b["n"] * b["g"] * cc * ph * pw
    w_stage = b["g"] * cc * spec.kh * spec.kw * b["k"]
    stage = -(-(b["n"] * b["g"] * cc * plane) // 4) * 4 + -(-w_stage // 4) * 4
    smem = 4 * np.maximum(buf * stage, np.where(split > 1, split * tb, 0))
    ok = (nt <= 1024) & (nt >= 32) & (acc <= 64) & (cc % split == 0) & ((split == 1) | (nt <= 512))
    ok &= smem <= gpu_max_shared_bytes(target)
    stages = spec.c_per_group // cc
    blocks = spec.n * spec.groups * spec.k_per_group * spec.out_h * spec.out_w // tb
    row_len = (v["row"] - 1) * sw + (spec.kw - 1) * dw + 1
    x_lds = v["rn"] * v["rg"] * v["roh"] * np.where(sw == 1, -(-row_len // 2), row_len)
    w_lds = v["rg"] * spec.kw * np.where(v["rk"] % 4 == 0, v["rk"] // 4,
                                         np.where(v["rk"] % 2 == 0, v["rk"] // 2, v["rk"]))
    steps = cc // split * spec.kh  # (c, kh) steps of one thread per stage
    wflat = (b["k"] % 4 == 0) & (b["g"] == 1)
    copy = (in_elems * COPY_INSTR + np.where(wflat, w_stage, w_stage * COPY_INSTR)) / nt
    instr = steps * (acc * spec.kw + x_lds + w_lds + 2) + copy  # per thread per stage
    warps = -(-nt // 32)
    regs = np.minimum(255, -(-(24 + acc + v["rg"] * v["rk"] + v["rn"] * v["roh"] * row_len) // 8) * 8)
    bps = _blocks_per_sm(target, nt, warps, smem, regs)
    ok &= bps >= 1
    bps = np.maximum(bps, 1)
    store, out_bytes = _store_cost(spec, layout, v, tb)

    def block_cycles(m: np.ndarray) -> np.ndarray:
        stage_c = np.maximum.reduce([m * warps * instr / ISSUE_PER_CLK, instr / WARP_IPC,
                                     MEM_LATENCY / (buf - 1),
                                     m * warps * steps * (x_lds + w_lds) / LDS_PER_CLK])
        return stages * (stage_c + BARRIER) + MEM_LATENCY + m * store

    per_sm = -(-blocks // target.cores)
    full, rem = per_sm // bps, per_sm % bps
    cycles = full * block_cycles(bps) + np.where(rem > 0, block_cycles(np.maximum(rem, 1)), 0)
    hz = (target.freq_ghz or 1.5) * 1e9
    dram = (spec.input_bytes + spec.weight_bytes + out_bytes) / DRAM_BYTES_PER_S
    l2 = blocks * (in_elems + w_stage) * stages * 4 / L2_BYTES_PER_S
    seconds = np.maximum.reduce([cycles / hz, dram, l2]) + LAUNCH_SECONDS
    return seconds, ok


def _blocks_per_sm(target: Target, nt: np.ndarray, warps: np.ndarray, smem: np.ndarray,
                   regs: np.ndarray) -> np.ndarray:
    """Blocks resident on one SM at once: the least of what the block slots, threads, shared memory
    and registers allow (0 when one block does not fit, which makes the candidate infeasible)."""
    with np.errstate(divide="ignore"):
        return np.minimum.reduce([np.full_like(nt, SM_MAX_BLOCKS), SM_MAX_THREADS // (warps * 32),
                                  target.level("shared").capacity // (smem + 1024),
                                  REGS_SM // (warps * 32 * regs)])


def _store_cost(spec: ConvSpec, layout: str, v: dict[str, np.ndarray], tb: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(store instructions' issue cycles per block, output bytes to DRAM) of the epilogue.

    Lanes next to each other run along the layout's innermost axis (ow for NCHW, k for NHWC).
    A 32-byte sector that one warp instruction only half writes costs a read-modify-write in
    DRAM (ECC granule): measured ~7x slower on an H100, so such shapes are all but excluded."""
    split = v["split"]
    t_in = v["tk"] if layout == "NHWC" else v["tow"]
    r_in = v["rk"] if layout == "NHWC" else v["row"]
    inner_ext = spec.k if layout == "NHWC" else spec.out_w
    vec = np.where((split == 1) & (r_in % 4 == 0) & (inner_ext % 4 == 0), 4, 1)
    lanes = np.minimum(t_in, 32)
    contiguous = (split > 1) | (r_in == vec) | (r_in == 1)
    span = np.where(split > 1, 128, np.where(contiguous, lanes * vec * 4, vec * 4))  # bytes per run
    partial = span < 32
    sectors = np.where(contiguous, (32 // np.where(split > 1, 32, lanes)) * -(-span // 32), 32)
    ineff = sectors / (4 * np.where(split > 1, 1, vec)) * np.where(partial, PARTIAL_WRITE, 1)
    store = tb / 32 * ineff * 2 + np.where(split > 1, tb * split / 32 * 2, 0)
    out_bytes = spec.output_bytes * np.where(partial, PARTIAL_WRITE, 1)
    return store, out_bytes


@lru_cache(maxsize=256)
def _ranked(spec: ConvSpec, target: Target, layout: str) -> list[tuple[float, tuple[int, ...]]]:
    """The structured candidates with their predicted seconds, best first, as raw tuples (RAW
    order). Vectorised over the spatial choices; one pass per (stage channels, split, buffers)."""
    opts = _options(spec)
    grids = np.meshgrid(*[np.arange(len(opts[a])) for a in AXES], indexing="ij")
    base: dict[str, np.ndarray] = {}
    for i, a in enumerate(AXES):
        o = np.array(opts[a], dtype=np.int64)
        base["t" + a], base["r" + a] = o[grids[i].ravel(), 0], o[grids[i].ravel(), 1]
    nts = base["tn"] * base["tg"] * base["tk"] * base["toh"] * base["tow"]
    acc = base["rn"] * base["rg"] * base["rk"] * base["roh"] * base["row"]
    tb = nts * acc
    x, y, z = maco_tile(spec, target)
    least = min(64, spec.n * spec.groups * spec.k_per_group * spec.out_h * spec.out_w)  # a tiny layer: all of it
    pre = (acc <= 64) & (nts <= 1024) & (tb >= least) & (tb <= max(x * y * z, least))  # the MACO tile caps the block
    base = {k: a[pre] for k, a in base.items()}
    r = paper_reuse(spec)
    ratio = np.abs(np.log(base["tn"] * base["rn"] * base["toh"] * base["roh"] * base["tow"] * base["row"]
                          / (r * base["tg"] * base["rg"] * base["tk"] * base["rk"])))
    found: list[tuple[np.ndarray, np.ndarray]] = []
    for cc in _stage_channels(spec.c_per_group):
        for split in (1, 2, 4, 8, 16):
            if cc % split:
                continue
            for buf in (2, 3):
                v = dict(base, cc=np.full_like(base["tn"], cc), split=np.full_like(base["tn"], split),
                         buf=np.full_like(base["tn"], buf))
                sec, ok = predict(spec, target, layout, v)
                sec = sec * (1 + 0.01 * ratio)  # tie-break toward the MACO ratio x*y = R*z
                keep = np.flatnonzero(ok)
                keep = keep[np.argsort(sec[keep], kind="stable")[:KEEP]]
                found.append((sec[keep], np.stack([v[k][keep] for k in RAW], axis=1)))
    if not found:
        return []
    secs = np.concatenate([f[0] for f in found])
    raws = np.concatenate([f[1] for f in found])
    order = np.argsort(secs, kind="stable")[:KEEP]
    return [(float(secs[i]), tuple(int(c) for c in raws[i])) for i in order]


def _schedule(spec: ConvSpec, layout: str, raw: tuple[int, ...]) -> Schedule:
    """The schedule of a raw candidate. Its unroll step is 64 unless that unrolls more than
    MAX_UNROLLED_FMAS FMAs into one body, then 16 (the R2 loops alone): such kernels' warps wait
    on instruction fetch."""
    tn, rn, tg, rg, tk, rk, th, rh, tw, rw, cc, split, buf = raw
    e = dict(n=spec.n, g=spec.groups, k=spec.k_per_group, oh=spec.out_h, ow=spec.out_w)

    def sp(axis: str, t: int, r: int) -> tuple[int, ...]:
        return (e[axis] // (t * r), 1, t, 1, r)

    sch = Schedule(kind="cuda",
                   spatial=(sp("n", tn, rn), sp("g", tg, rg), sp("k", tk, rk), sp("oh", th, rh),
                            sp("ow", tw, rw)),
                   reduction=((spec.c_per_group // cc, cc, 1), (1, 1, spec.kh), (1, 1, spec.kw)),
                   unroll=64, layout=layout, weight_packing="blocked",
                   extra=((("split_c", split),) if split > 1 else ()) + ((("buffers", buf),) if buf != 2 else ()))
    return sch if CudaPlan(spec, sch).unrolled_fmas <= MAX_UNROLLED_FMAS else replace(sch, unroll=16)


def candidates(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW",
               limit: int = 16) -> list[Schedule]:
    """The model's `limit` best schedules with distinct block/thread shapes (best first)."""
    target = target or Target.h100()
    out: list[Schedule] = []
    seen: set[tuple[int, ...]] = set()
    for _, raw in _ranked(spec, target, layout):
        shape = raw[:10]  # threads and register tile; stage depth and buffers may repeat
        if shape in seen:
            continue
        seen.add(shape)
        out.append(_schedule(spec, layout, raw))
        if len(out) >= limit:
            break
    return out


def default_schedule(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW") -> Schedule:
    """The model's best schedule for `spec` on `target` (the H100 when None) among those the
    pruned space keeps (its best overall where none of its 16 best is kept): the tuner starts
    from the default, and the search never leaves the pruned space."""
    target = target or Target.h100()
    best = candidates(spec, target, layout, limit=16)
    if not best:
        raise MacoError(f"no CUDA schedule of the default family fits {spec} on {target.name}")
    return next((s for s in best if not why_not(s, spec, target, pruned=True)), best[0])


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
