"""I/O of a schedule's whole loop nest at every level of a memory hierarchy, and what each level
must reach so that it is not the bottleneck.

The one-level bounds (maco.bounds.conv, .tiles) treat a level as the only fast memory in front
of DRAM, and its optimum tile balances x*y = R*z at footprint S. In a CPU nest every level sits
between two others: the register tile below it already reuses each weight x_r*y_r times and each
input z_r times, so a cache level only has to supply its operands at the rate the cores consume
them. Two statements follow:

1. Traffic of a nest at a level of S elements (`nest_traffic`): walking the loops from the
   innermost out, the first loop body whose footprint (inputs + weights + outputs it touches)
   exceeds S bounds the reuse. Inside it everything is reused; each tensor is loaded once per
   visit of that body, except across the directly enclosing loops that do not index it (the
   tensor stays while they run: filters while positions go by, outputs while channels slide).
   Outputs are loaded and stored per visit after the first. This is the red-blue game at that
   level with the nest's own tiles as the computation order; tests check it against the
   exact replay of the nest through an LRU cache (maco.bounds.simulate) on small layers.

2. A level is no bottleneck when the flops per element crossing its boundary reach the
   machine's balance there: F / Q_level >= peak flop rate / the level's bandwidth
   (`level_balance`, sympy). The one-level optimum (x*y = R*z) is the most a level can reach;
   a level whose balance is far below that has slack, and any tile meeting the balance is as
   good as the optimum for speed. The bound-derived default schedules reach 89-99% of the FMA
   peak, so they meet every level's balance, which a condition that asks for the optimum at
   every level (the one-level pruning rules) does not accept.

3. Per tile level (`tile_conditions`, `chunk_intensity`, `nominal_balance`): the traffic of a
   level is its own tile's as channel chunks slide past it, so statement 2 becomes one condition
   per tile level and chunk, which maco.space.prune checks and maco.space.schedules counts exactly. A pass of the
   reduction need not hold the whole kernel window: with the window split (kh0, kw0 > 1) a tile
   makes c0*kh0*kw0 passes of c1 channels by kh1 x kw1 taps, and `window_split` derives what that
   costs: the outputs cross once per pass (as for a shallower chunk), the weights not at all more,
   and the inputs (kh0 - 1)*((oh - 1)*s - d + 1) more rows per channel (likewise columns): nothing
   for a tile one output row high at unit dilation (the register tiles of the defaults), a loss of
   the window's input reuse for a tall one. So a split is one more way of choosing a pass, and the
   level conditions judge it like any other: it is not excluded in itself.

4. The register tile's FMA issue ceiling (`register_ceiling`): a step of the reduction issues one
   FMA per accumulator vector; an accumulator's next FMA waits for its last one (FMA_LATENCY
   cycles), so a tile of A vectors issues at most A/(L*P) of the peak of P pipes. That is a lower
   limit on accumulators grounded in the core (L*P = 8 on 2 pipes of latency 4), replacing the
   "half of the free registers" floor: a tile of 4 vectors can reach half the peak, one of 28
   spills nothing more than one of 8 does.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import sympy as sp

from maco.bounds.simulate import schedule_loops
from maco.core.errors import MacoError
from maco.core.factors import divisors
from maco.core.geometry import input_window
from maco.core.axes import INPUT_AXES, SPATIAL_AXES, WEIGHT_AXES
from maco.core.schedule import Schedule
from maco.core.spec import DTYPE_BYTES, ConvSpec
from maco.core.target import Target

OUTPUT_AXES = SPATIAL_AXES


@dataclass(frozen=True)
class Traffic:
    """Elements crossing a level's boundary: loads of inputs and weights, loads + stores of outputs."""

    inputs: float
    weights: float
    outputs: float

    @property
    def total(self) -> float:
        return self.inputs + self.weights + self.outputs


def _spans(spec: ConvSpec, loops: list[tuple[str, int, int]]) -> list[dict[str, int]]:
    """spans[j][axis]: the index range each axis covers inside loops[j:] (clipped to the layer)."""
    extent = {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h, "ow": spec.out_w,
              "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}
    span = {a: 1 for a in extent}
    out = [dict(span)]
    for axis, count, step in reversed(loops):
        span[axis] = min(extent[axis], span[axis] + (count - 1) * step)
        out.append(dict(span))
    return out[::-1]


def footprints(spec: ConvSpec, span: dict[str, int]) -> dict[str, int]:
    """Elements of each tensor that a loop body with these index spans touches."""
    ih, iw = input_window(spec, span["oh"], span["ow"], span["kh"], span["kw"])
    return {"outputs": prod(span[a] for a in OUTPUT_AXES),
            "weights": prod(span[a] for a in WEIGHT_AXES),
            "inputs": span["n"] * span["g"] * span["c"] * min(spec.h, ih) * min(spec.w, iw)}


def nest_traffic(spec: ConvSpec, schedule: Schedule, S: float) -> Traffic:
    """Elements the schedule's loop nest moves across the boundary of a level of S elements
    (statement 1 of the module docstring). S is what one core has of the level (S / Np)."""
    if not S > 0:
        raise MacoError(f"level size must be positive, got {S!r}")
    loops = [loop for loop in schedule_loops(spec, schedule) if loop[1] > 1]
    spans = _spans(spec, loops)
    fits = next((j for j, span in enumerate(spans) if sum(footprints(spec, span).values()) <= S), len(loops))
    visits = prod(count for _, count, _ in loops[:fits])
    fp = footprints(spec, spans[fits])
    moved = {}
    for name, axes in (("inputs", INPUT_AXES), ("weights", WEIGHT_AXES), ("outputs", OUTPUT_AXES)):
        stays = 1
        for axis, count, _ in reversed(loops[:fits]):
            if axis in axes:
                break
            stays *= count
        moved[name] = fp[name] * visits / stays
    outputs = max(float(spec.output_elems), 2 * moved["outputs"] - spec.output_elems)
    return Traffic(float(moved["inputs"]), float(moved["weights"]), outputs)


def intensity(spec: ConvSpec, schedule: Schedule, S: float) -> float:
    """Multiply-adds per element crossing the level's boundary (higher: more reuse)."""
    return spec.macs / nest_traffic(spec, schedule, S).total


# -- statement 2: the balance a level must reach ------------------------------------------------
x, y, z, R, S_, beta = sp.symbols("x y z R S beta", positive=True)
#: multiply-adds per element moved by an output tile x*y*z sliding over channels (one level):
#: each channel step loads ~x*y inputs (R-fold reuse of a window) and z*R weights for x*y*z*R MACs
TILE_INTENSITY = (x * y * z * R) / (x * y + z * R)


def level_balance() -> dict[str, sp.Expr]:
    """The one-level optimum and the balance condition, derived with sympy:

    optimum     maximise TILE_INTENSITY at footprint x*y*z = S: x*y = R*z, intensity sqrt(R*S)/2
    condition   TILE_INTENSITY >= beta (the machine balance of the level, MACs per element):
                the tiles that keep the level off the critical path, a region around the optimum
                that is wide where sqrt(R*S)/2 >> beta
    """
    p = sp.symbols("p", positive=True)  # p = x*y
    on_capacity = TILE_INTENSITY.subs(x * y, p).subs(z, S_ / p)
    best_p = sp.solve(sp.diff(on_capacity, p), p)[0]
    best = sp.simplify(on_capacity.subs(p, best_p))
    return {"optimal_xy": best_p, "optimal_intensity": best,
            "condition": sp.Ge(TILE_INTENSITY, beta)}


# -- statement 3: the tile conditions per level (what maco.space.prune checks) ------------------------
# A CPU nest S0 S1 R0 S2 R1 S3 slides channel chunks (R0, c1 channels each) past its tiles:
#   registers <- L1: the register tile S3 reduces one chunk, then its accumulators go back to L1
#   L1 <- L2:       the register tile sweeps the S2 tile within a chunk; L1 has to hold that
#                   chunk's inputs and weights for the sweep, plus the S2 tile's outputs
#   L2 <- L3:       the core's tile S1, past whose outputs the chunks slide
# On a GPU the thread tile is in registers (fed by shared memory) and the block tile in shared
# memory (fed by L2); both keep their outputs in registers for the whole reduction.
# Each level's traffic is its tile's: every chunk brings its inputs and weights once, and the
# outputs cross once if the level holds them between chunks, else once per chunk (load + store,
# the first chunk only stores). Reuse across tiles of the same level is not credited: the loops
# around a tile visit the other tiles' data before they come back (tests check the model against
# the replayed nest, tests/test_hierarchy.py).
P, Z, Wt, C, c, Q, Bt = sp.symbols("P Z W C c Q beta", positive=True)
#: elements crossing a level per tile: C channels of Q inputs and Z*W weights, P*Z outputs kept
KEPT_TRAFFIC = C * (Q + Z * Wt) + P * Z
#: the same when the outputs go out and come back for every chunk of c channels
RELOADED_TRAFFIC = C * (Q + Z * Wt) + P * Z * (2 * C / c - 1)


def tile_conditions() -> dict[str, sp.Expr]:
    """The per-level conditions, derived with sympy (P pixels, Z filters, W = kh*kw taps, C channels
    in chunks of c, Q input patch per channel, beta the level's balance, MACs per element):

    kept        intensity P*Z*W*C / KEPT_TRAFFIC, independent of the chunk: a level that holds the
                tile's outputs and one chunk is fed at the tile's own reuse
    one_level   its limit for many channels with Q = P*W/R: TILE_INTENSITY (level_balance), the
                one-level optimum's quantity: the one-level rules asked for its maximum at every
                level, a level that is no bottleneck only needs it >= beta
    reloaded    intensity P*Z*W*C / RELOADED_TRAFFIC: grows with the chunk, equals kept at c = C
    least_chunk the smallest chunk with reloaded >= beta (where the tile's operands alone reach
                beta): a level that cannot hold the outputs needs chunks at least this deep
    condition   intensity >= beta: the level is the bottleneck otherwise
    """
    macs = P * Z * Wt * C
    kept = macs / KEPT_TRAFFIC
    reloaded = macs / RELOADED_TRAFFIC
    R = sp.symbols("R", positive=True)
    one_level = sp.limit(kept.subs(Q, P * Wt / R), C, sp.oo)
    least = sp.solve(sp.Eq(reloaded, Bt), c)[0]
    return {"kept": kept, "one_level": sp.simplify(one_level), "reloaded": reloaded,
            "least_chunk": sp.simplify(least), "condition": sp.Ge(sp.Symbol("I", positive=True), Bt)}


def window_split() -> dict[str, sp.Expr]:
    """What splitting the kernel window costs a tile, along one axis (derived with sympy): o
    outputs at stride s and dilation d read (o - 1)*s + (t - 1)*d + 1 input rows per channel for t
    taps; split into t0 passes of t1 taps (t = t0*t1, consecutive taps per pass) they read t0 times
    (o - 1)*s + (t1 - 1)*d + 1.

    excess      split minus whole: (t0 - 1)*((o - 1)*s - d + 1), zero for t0 = 1 and for a tile one
                output high at d = 1, positive for a taller one at d <= s (the window's reuse lost)
    passes      the outputs cross once per pass: c0*kh0*kw0 passes of c1*kh1*kw1 steps each, the
                same count as channel chunks of that depth (chunk_intensity takes both)
    """
    o, s_, d, t0, t1 = sp.symbols("o s d t0 t1", positive=True)
    whole = (o - 1) * s_ + (t0 * t1 - 1) * d + 1
    split = t0 * ((o - 1) * s_ + (t1 - 1) * d + 1)
    c0, k0, w0 = sp.symbols("c0 kh0 kw0", positive=True)
    return {"whole": whole, "split": split, "excess": sp.factor(sp.expand(split - whole)),
            "passes": c0 * k0 * w0}


def _patch(spec: ConvSpec, oh: Any, ow: Any, kh: Any = None, kw: Any = None) -> Any:
    """Input rows x columns one channel of an oh x ow output block reads over kh x kw taps (the
    whole window by default; padding not stored)."""
    ih, iw = input_window(spec, oh, ow, kh, kw)
    return np.minimum(ih, spec.h) * np.minimum(iw, spec.w)


def tile_footprint(spec: ConvSpec, n: Any, g: Any, k: Any, oh: Any, ow: Any, chunk: Any,
                   kh1: Any = None, kw1: Any = None) -> Any:
    """Elements a level holds for a tile and one pass: its outputs, the pass's inputs and weights
    (`chunk` channels by kh1 x kw1 taps, the whole window by default)."""
    kh1 = spec.kh if kh1 is None else kh1
    kw1 = spec.kw if kw1 is None else kw1
    return g * (n * k * oh * ow + chunk * (n * _patch(spec, oh, ow, kh1, kw1) + k * kh1 * kw1))


def chunk_intensity(spec: ConvSpec, n: Any, g: Any, k: Any, oh: Any, ow: Any, chunk: Any,
                    kept: Any, kh1: Any = None, kw1: Any = None) -> Any:
    """MACs per element crossing a level whose tile is n images x g groups x k filters x oh x ow
    outputs sliding over the channels in chunks of `chunk` (and over the window in kh1 x kw1 taps
    per pass, the whole window by default: window_split); `kept`: the level holds the outputs
    between passes (tile_conditions' kept and reloaded, numpy-friendly)."""
    kh1 = spec.kh if kh1 is None else kh1
    kw1 = spec.kw if kw1 is None else kw1
    cg, taps = spec.c_per_group, spec.kh * spec.kw
    splits = (spec.kh // kh1) * (spec.kw // kw1)  # passes over the window per chunk
    outputs = n * g * k * oh * ow
    passes = np.where(kept, 1.0, 2.0 * splits * cg / chunk - 1.0)
    inputs = n * _patch(spec, oh, ow, kh1, kw1) * splits
    return outputs * cg * taps / (g * cg * (inputs + k * taps) + outputs * passes)


def best_tile_intensity(spec: ConvSpec, max_outputs: int) -> float:
    """The most a tile of at most `max_outputs` outputs (one image and group) reaches with its
    outputs kept: what the layer allows a level whose tiles must leave every processor work."""
    k, oh, ow = np.meshgrid(*[np.array(divisors(e)) for e in (spec.k_per_group, spec.out_h, spec.out_w)],
                            indexing="ij")
    fits = k * oh * ow <= max(1, max_outputs)
    return float(np.max(np.where(fits, chunk_intensity(spec, 1, 1, k, oh, ow, spec.c_per_group, True), 0)))


#: bytes per cycle each level is fed with from the next level out, per core (CPU) or per SM (GPU):
#: nominal figures of current cores (two vector loads a cycle from L1; a 64-byte line a cycle from
#: L2, half a line from L3, a quarter from DRAM) and of the H100 (128 B a cycle from shared memory
#: into registers, ~32 B a cycle per SM from L2, about what 5.5 TB/s over 132 SMs at 1.98 GHz gives).
#: A real machine is often slower, so its balance is higher: maco.space.prune divides by its tolerance.
FEED_BYTES = {"cpu": (64.0, 32.0, 16.0, 8.0), "cuda": {"shared": 32.0, "L2": 16.0}}


def nominal_balance(target: Target) -> dict[str, float]:
    """MACs per element each level must receive for the cores to run at their FMA peak: the
    core's (or SM's) multiply-adds per cycle over the elements per cycle the next level out feeds
    it (FEED_BYTES). A property of the target, not a measurement, so pruning repeats; the
    measured one is kernels.cpu_peak.machine_balance (2-core Zen 4/5 VMs with 16 lanes: L1
    1.2-1.5, L2 2.3-3, where these give 2 and 4)."""
    macs = target.fma_units * target.simd_width
    out: dict[str, float] = {}
    if target.kind == "cpu":
        out["registers"] = macs / (2.0 * target.simd_width)  # two vector loads a cycle
        caches = [lvl.name for lvl in target.levels if lvl.name != "registers"]
        for name, feed in zip(caches, FEED_BYTES["cpu"] + (FEED_BYTES["cpu"][-1],) * len(caches)):
            out[name] = macs / (feed / DTYPE_BYTES)
    elif target.kind == "cuda":
        out["registers"] = macs / (128.0 / DTYPE_BYTES)
        for lvl in target.levels:
            if lvl.name in FEED_BYTES["cuda"]:
                out[lvl.name] = macs / (FEED_BYTES["cuda"][lvl.name] / DTYPE_BYTES)
    return out


# -- statement 4: the register tile's FMA issue ceiling -------------------------------------------
#: cycles from an FMA's issue to its result, which the next FMA on the same accumulator waits for:
#: 4 on the cores the project runs on (AMD Zen 4/5, Intel Golden Cove / Sapphire Rapids, Skylake-X)
FMA_LATENCY = 4


def register_ceiling() -> dict[str, sp.Expr]:
    """The share of the FMA peak a register tile can issue, derived with sympy. One step of the
    reduction issues A FMAs (one per accumulator vector) on P pipes and loads k_v weight vectors
    and b input broadcasts (A = k_v*b) on two load ports; each accumulator's FMA waits L cycles
    for the previous one on it:

    cycles      max(A/P, (k_v + b)/2, L) per step
    share       A/P / cycles
    latency     the share with the loads left out: min(1, A/(L*P)); the chains hide the latency
                only from A = L*P vectors on
    loads_floor k_v + b <= A + 1 (a product of positive integers), so the loads alone never hold
                two pipes below A/(A + 1) >= 1/2 of the peak: on such a core the accumulators'
                count, not the loads, decides how far below the peak a tile can fall
    least       the fewest vectors for a share of at least 1/tau: A >= L*P/tau (tau the
                pruning's tolerance, as for every level's balance)
    """
    A, P_, L, kv, b, tau = sp.symbols("A P L k_v b tau", positive=True)
    cycles = sp.Max(A / P_, (kv + b) / 2, L)
    latency = sp.Min(1, A / (L * P_))
    loads_floor = sp.simplify((A / 2) / ((A + 1) / 2))
    least = sp.solve(sp.Eq(A / (L * P_), 1 / tau), A)[0]
    return {"cycles": cycles, "share": (A / P_) / cycles, "latency": latency, "loads_floor": loads_floor,
            "least": least}


def accumulators_needed(fma_units: int, tolerance: float, allows: float, latency: int = FMA_LATENCY) -> int:
    """The fewest accumulator vectors a register tile needs (register_ceiling's least): enough
    independent FMA chains to keep the core within `tolerance` of its peak, min(L*P, what the
    layer allows) / tolerance (a layer whose tiles have fewer vectors is not asked for more)."""
    from math import ceil

    return max(1, ceil(min(latency * fma_units, allows) / tolerance - 1e-9))


def register_share(simd_width: int, fma_units: int, n: Any, g: Any, k: Any, oh: Any, ow: Any,
                   vector_axis: str, contiguous: Any, latency: int = FMA_LATENCY) -> Any:
    """register_ceiling's share in numbers (numpy-friendly) for a CPU register tile of n x g x k x
    oh x ow outputs: vectors along `vector_axis` ("k": weight vectors times input broadcasts; "ow":
    input vectors times weight broadcasts), scalar where that axis' factor is not a multiple of
    the lanes (one lane per FMA, a load per weight and per input). `contiguous`: the vector
    operand's lanes are adjacent in memory; where they are not, a vector takes one load per lane
    (a gather costs the load ports as much)."""
    W, P = simd_width, fma_units
    outputs = n * g * k * oh * ow
    if vector_axis == "k":
        vectorised, vectors, broadcasts = k % W == 0, g * (k // W), n * g * oh * ow
    else:
        vectorised, vectors, broadcasts = ow % W == 0, n * g * oh * (ow // W), g * k
    fmas = np.where(vectorised, outputs // W, outputs)
    loads = np.where(vectorised, vectors * np.where(contiguous, 1, W) + broadcasts, g * k + n * g * oh * ow)
    cycles = np.maximum(np.maximum(fmas / P, loads / 2.0), latency)
    return outputs / (P * W * cycles)
