"""MACO pruning: keep the schedules in which no memory level is the bottleneck.

A level is the bottleneck when the tile it serves moves fewer multiply-adds per element across
its boundary than the cores need to run at their FMA peak there (the level's balance). The
conditions are derived in maco.bounds.hierarchy (statement 3): every level sits between the tile
below it and the level above, so what matters at a level is the reuse of its own tile as channel
chunks slide past it, not how close that tile is to the one-level optimum x*y = R*z (the rules
before this module asked for that optimum at L1 and L2 as if each were the only fast memory, and
dropped the bound-derived defaults, which run at ~93% of the FMA peak).

Which tile sits in which level (CPU nest S0 S1 R0 S2 R1 S3, c1 channels per R0 chunk):
  registers <- L1  S3, the register tile: it reduces one pass (a chunk of channels by the window's
                   taps in the pass), then its accumulators go back to L1 (the outputs cross once
                   per pass). Its accumulators must also fit the free vector registers (a hard
                   limit of the space) and issue FMAs fast enough (maco.bounds.hierarchy statement
                   4, register_ceiling): a step issues one FMA per accumulator vector on P pipes,
                   each waiting L cycles (`fma_latency`) for its chain's last one, and loads its
                   vector operands and broadcasts on two load ports, a vector whose lanes are not
                   adjacent in memory (filters not packed in vector blocks, an NHWC or strided
                   input row) one lane at a time. Where the layer has whole vectors of filters
                   per group the tile's share of the FMA peak (register_share) must reach
                   1/tolerance of the best share a tile of one image and group reaches: at least
                   L*P/tolerance = 4 vectors on 2 pipes of latency 4, fewer only in tiles no load
                   limits. (This replaces "half of the free registers", 14..28 on AVX-512, a floor
                   from no property of the core.) Where the layer has no whole vectors of
                   filters (depthwise and 24-filter layers on 16 lanes: the default's tile is
                   scalar there), the accumulators themselves count, at least min(L*P, the most a
                   tile of one image and group can have)/tolerance.
  L1 <- L2         S2: the register tile sweeps it within a chunk; L1 keeps its outputs between
                   chunks when they and one chunk's inputs and weights fit L1's share.
  L2 <- L3         S2 again: R0 sits between S1 and S2, so the outputs the chunks slide past are
                   the S2 tile's (the defaults that slide chunks make it the core's whole share);
                   S1 only orders the S2 tiles.
  L3 and further   the whole layer split over the cores: fixed by the spec, not used.
A level that holds its tile with every channel is not judged: the loops around the tile may then
reuse its data across tiles, which the tile alone does not bound. Otherwise the tile's traffic is
within about 2.2x of the exact replay of the nest through an LRU cache, at most 1.2x in 90% of random
schedules (tests/test_hierarchy.py), so the condition is necessary up to about the tolerance.
GPU nest (block, vthread, thread, inner, inner):
  registers <- shared  the thread tile (outputs in registers all along), at most
                       gpu_accumulators[1] accumulators (nvcc spills past ~64).
  shared <- L2         the block tile (outputs in the threads' registers all along).
  L2                   the whole grid: fixed by the spec, not used.

The condition at a level: intensity(tile, chunk) >= min(balance, what the layer allows) /
tolerance, where the balance is maco.bounds.hierarchy.nominal_balance(target) (a property of the
target, so pruning repeats) and "what the layer allows" is the intensity of the best tile small
enough to give every processor work (every core, every resident block and thread slot of the
GPU): a level is not asked for more than the layer can give it. `tolerance` (2) covers machines
slower than the nominal feeds: the measured balances of the project's hosts lie below the
nominal ones by less than that.

The processors (CPU, `busy_cores`): the multi-processor bound shares the work among all P cores,
each bounded with its share S/P of the cache (x*y*z ~ S/Np), so a nest whose fused parallel loop
runs fewer than P iterations leaves cores idle and cannot reach it; the loop must run >= P
iterations (on batch 1, `parallel` 0-2 fuses only n and g: one iteration). A layer with fewer
than MIN_MACS_PER_CORE multiply-adds per core (the SE convs on 1x1 inputs of EfficientNet and
MobileNetV3) is exempt: its share would take about as long as forking and joining the threads.

And for the whole nest, the paper's alpha = 1 (`alpha_one` on the GPU, `alpha_cpu` on the CPU):
every tile slides over the input channels one at a time with the whole kh x kw window
per channel, i.e. the kernel window is not split by the outer reduction level (kh0 = kw0 = 1), and
the innermost reduction loops take the channels in the layout's unit (`alpha_order_ok`): c
outermost where a channel's window is whole rows of one plane (NCHW, and the GPU kernels'
shared-memory windows), c innermost where channels are the contiguous axis (CPU NHWC). Neither is
a condition of the bounds: the order of the reduction loops does not change what any level holds
or moves (a red-blue game counts elements, not strides), and a window split is one more way to
cut the reduction into passes (maco.bounds.hierarchy.window_split: the outputs cross once per pass
like a shallower chunk; the inputs lose the window's reuse only in tiles taller or wider than one
output), which the level conditions judge with the pass's taps. So with `alpha_cpu` off the levels judge
splits on the CPU and no order is asked for; it stays on by default for now (measured:
alpha = 1 drops about a third of the top-5% schedules of a uniform sample and cuts the space
8x; experiments/pruning_recall.py reports both).

Every condition looks at one tile level and the pass (chunk c1, taps kh1 x kw1), or at the register
tile with its vector axis, layout and weight packing, so maco.space.schedules still counts the pruned space
exactly and samples it uniformly (per pass and annotation combination, over the divisor grids).

Relaxation (maco.space.schedules.prune_plan, which counts the space under each try), so that a valid conv
never gets an empty pruned space: if the conditions of one level alone leave nothing, that level
is relaxed step by step (its need /2, register lower bounds /2, the warp rule dropped); after
`max_relax` steps the level is dropped. If all levels together still leave nothing, levels are
relaxed the same way from the outermost inwards. The plan says what was relaxed (PrunePlan.notes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil, prod
from typing import Any

import numpy as np

from maco.bounds.conv import best_lower_bound
from maco.bounds.hierarchy import (FMA_LATENCY, accumulators_needed, best_tile_intensity, chunk_intensity, intensity,
                                   nominal_balance, register_share, tile_footprint)
from maco.core.errors import MacoError
from maco.core.factors import divisors
from maco.core.axes import SPATIAL_AXES
from maco.core.schedule import Schedule
from maco.core import sketch_cuda
from maco.core.sketch_cpu import free_registers
from maco.core.sketch_cuda import GPU_MAX_THREADS, gpu_max_accumulators
from maco.core.spec import ConvSpec
from maco.core.target import Target

WARP = 32
# ~1 us of one AVX2 core at its FMA peak (2 FMAs x 8 lanes a cycle at ~2 GHz), the order of an
# OpenMP fork and join across the cores: below it per core, splitting a layer cannot pay.
MIN_MACS_PER_CORE = 1 << 15


@dataclass(frozen=True)
class PruneConfig:
    """Tolerances of the pruning conditions (see the module docstring)."""

    tolerance: float = 2.0  # a level's tile may fall short of its nominal balance by this factor
    fma_latency: int = FMA_LATENCY  # CPU: cycles an accumulator's FMA chain waits; the register tile
    #                                 needs fma_latency * fma_units / tolerance vectors (0: no floor)
    gpu_accumulators: tuple[int, int] = (1, 64)  # GPU: accumulators per thread (nvcc spills past ~64)
    warp: bool = False  # GPU: threads per block a multiple of the warp size (the batch-1 defaults
    #                     use 7-, 14- and 28-wide rows, so whole warps are not asked by default)
    alpha_one: bool = True  # GPU: one channel at a time, whole window (kh0 = kw0 = 1; alpha_order_ok)
    alpha_cpu: bool = True  # the same on the CPU (off: the level rules judge window splits, no order
    #                         asked: what the bounds derive, see the module docstring)
    busy_cores: bool = True  # CPU: the fused parallel loop gives every core an iteration
    min_macs_per_core: int = MIN_MACS_PER_CORE  # CPU: ... in layers with this many MACs per core
    max_relax: int = 3  # relaxation steps of a level before it is dropped

    def __post_init__(self) -> None:
        if not self.tolerance >= 1.0:
            raise MacoError(f"PruneConfig.tolerance must be >= 1, got {self.tolerance}")
        if not (isinstance(self.fma_latency, int) and self.fma_latency >= 0):
            raise MacoError(f"PruneConfig.fma_latency must be an int >= 0 (cycles), got {self.fma_latency!r}")
        lo, hi = self.gpu_accumulators
        if not 1 <= lo <= hi:
            raise MacoError(f"PruneConfig.gpu_accumulators must be 1 <= lo <= hi, got {self.gpu_accumulators}")
        if self.max_relax < 0:
            raise MacoError(f"PruneConfig.max_relax must be >= 0, got {self.max_relax}")
        if not (isinstance(self.min_macs_per_core, int) and self.min_macs_per_core >= 0):
            raise MacoError(f"PruneConfig.min_macs_per_core must be an int >= 0, got {self.min_macs_per_core!r}")


@dataclass(frozen=True)
class LevelRule:
    """A memory level must not be the bottleneck: its tile, sliding over channel chunks, moves at
    least `need` multiply-adds per element across the level's boundary (maco.bounds.hierarchy)."""

    level: str
    tile: str  # "S3" (register tile), "S2", "S1" on CPU; "thread", "block" on GPU
    need: float  # MACs per element: min(balance, what the layer allows) / tolerance, relaxed
    capacity: float  # elements of the level per processor: the tile keeps its outputs there
    #                  between chunks when they and one chunk fit (0: never, the registers)
    balance: float  # the level's nominal balance (for messages)
    relaxed: int = 0

    def intensity(self, spec: ConvSpec, n: Any, g: Any, k: Any, oh: Any, ow: Any, chunk: Any,
                  kh1: Any = None, kw1: Any = None) -> Any:
        """`chunk` channels by kh1 x kw1 taps per pass (the whole window by default)."""
        kept = tile_footprint(spec, n, g, k, oh, ow, chunk, kh1, kw1) <= self.capacity
        return chunk_intensity(spec, n, g, k, oh, ow, chunk, kept, kh1, kw1)

    def holds_all(self, spec: ConvSpec, n: Any, g: Any, k: Any, oh: Any, ow: Any) -> Any:
        """The level holds the tile with every channel: the loops around it may reuse its data
        across tiles, which the tile alone does not bound, so the level is not judged."""
        return tile_footprint(spec, n, g, k, oh, ow, spec.c_per_group) <= self.capacity

    def ok(self, spec: ConvSpec, n: Any, g: Any, k: Any, oh: Any, ow: Any, chunk: Any,
           kh1: Any = None, kw1: Any = None) -> Any:
        return (self.holds_all(spec, n, g, k, oh, ow)
                | (self.intensity(spec, n, g, k, oh, ow, chunk, kh1, kw1) >= self.need * (1 - 1e-9)))

    def why(self, spec: ConvSpec, t: dict[str, int], chunk: int, kh1: int | None = None,
            kw1: int | None = None) -> list[str]:
        return list(_level_why(self, spec, tuple(t[a] for a in SPATIAL_AXES), chunk, kh1, kw1))


@lru_cache(maxsize=1 << 16)
def _level_why(rule: LevelRule, spec: ConvSpec, tile: tuple[int, ...], chunk: int, kh1: int | None,
               kw1: int | None) -> tuple[str, ...]:
    """LevelRule.why, remembered: the schedules of one space share their tiles many times over
    (they differ in loop orders, layouts and packings), so judging a whole space is mostly lookups."""
    n, g, k, oh, ow = tile
    if rule.ok(spec, n, g, k, oh, ow, chunk, kh1, kw1):
        return ()
    have = float(rule.intensity(spec, n, g, k, oh, ow, chunk, kh1, kw1))
    shape = "x".join(str(v) for v in tile)
    taps = "" if (kh1 in (None, spec.kh) and kw1 in (None, spec.kw)) else f" by {kh1}x{kw1} taps"
    return (f"{rule.level}: {rule.tile} tile {shape} (n g k oh ow) in chunks of {chunk} channels{taps} moves "
            f"{have:.3g} MACs per element across it, below the {rule.need:.3g} needed "
            f"(balance {rule.balance:.3g})",)


@dataclass(frozen=True)
class RegisterRule:
    """Accumulators of the register (CPU) or thread (GPU) tile; optionally whole warps; on the CPU
    where the layer has whole vectors of filters, the share of the FMA peak the tile can issue
    (maco.bounds.hierarchy.register_share) instead of an accumulator floor."""

    acc_min: int
    acc_max: int
    warp: int = 0  # threads per block must be a multiple of this (0: no rule)
    relaxed: int = 0
    share_min: float = 0.0  # CPU: register_share >= this (0: not asked)
    latency: int = FMA_LATENCY  # CPU: the FMA latency register_share assumes

    def ok(self, acc: Any, threads: Any = None, share: Any = None) -> Any:
        good = (acc >= self.acc_min) & (acc <= self.acc_max)
        if self.share_min and share is not None:
            good = good & (share >= self.share_min * (1 - 1e-9))
        if self.warp and threads is not None:
            good = good & (threads % self.warp == 0)
        return good


def contiguous(spec: ConvSpec, vector_axis: str, layout: str, weight_packing: str) -> bool:
    """Whether a CPU register tile's vector operand is adjacent in memory (what the kernels load
    with one vector load): filters packed in blocks of the vector (vector axis k, weights
    "blocked"; in torch's (K, C, kh, kw) order a filter vector's lanes lie C*kh*kw apart), a row of
    an NCHW input read at stride 1 (ow); else (unpacked filters, an NHWC or strided row) each lane
    is a load of its own."""
    if vector_axis == "k":
        return weight_packing == "blocked"
    return layout == "NCHW" and spec.stride[1] == 1


def cpu_share(spec: ConvSpec, target: Target, n: Any, g: Any, k: Any, oh: Any, ow: Any, vector_axis: str,
              layout: str, weight_packing: str, latency: int = FMA_LATENCY) -> Any:
    """maco.bounds.hierarchy.register_share of a CPU register tile with these annotations."""
    return register_share(target.simd_width, target.fma_units, n, g, k, oh, ow, vector_axis,
                          contiguous(spec, vector_axis, layout, weight_packing), latency)


@lru_cache(maxsize=1 << 14)
def _register_share(spec: ConvSpec, target: Target, tile: tuple[int, ...], vector_axis: str, layout: str,
                    weight_packing: str, latency: int) -> float:
    """cpu_share of one register tile (n, g, k, oh, ow), remembered as _level_why is."""
    return float(cpu_share(spec, target, *tile, vector_axis, layout, weight_packing, latency))


def _best_share(spec: ConvSpec, target: Target, free: int, latency: int) -> float:
    """The most register_share a register tile of one image and group within `free` accumulators
    reaches (the best vector axis and annotations): what the layer allows the register level."""
    W, best = target.simd_width, 0.0
    for k in divisors(spec.k_per_group):
        for oh in divisors(spec.out_h):
            for ow in divisors(spec.out_w):
                for axis, lanes in (("k", k), ("ow", ow)):
                    if -(-k * oh * ow // (W if lanes % W == 0 else 1)) <= free:
                        share = cpu_share(spec, target, 1, 1, k, oh, ow, axis, "NCHW", "blocked", latency)
                        best = max(best, float(share))
    return best


def _one_group_accumulators(spec: ConvSpec, free: int, lanes: int = 1) -> int:
    """The most accumulators (<= free) a register tile of one image and group can have, of `lanes`
    lanes each (its filters a multiple of them)."""
    tiles = [k // lanes * oh * ow for k in divisors(spec.k_per_group) if k % lanes == 0
             for oh in divisors(spec.out_h) for ow in divisors(spec.out_w)]
    return max([t for t in tiles if t <= free], default=1)


@dataclass(frozen=True)
class PrunePlan:
    """The conditions in force for one conv on one target, after any relaxation."""

    registers: RegisterRule | None
    levels: tuple[LevelRule, ...]
    alpha_one: bool
    notes: tuple[str, ...] = field(default=())
    cores: int = 0  # CPU: the fused parallel loop runs at least this many iterations (0: not asked)

    @property
    def relaxed(self) -> bool:
        return bool(self.notes)

    def describe(self) -> str:
        parts = []
        if self.registers:
            parts.append(f"registers: {self.registers.acc_min}..{self.registers.acc_max} accumulators"
                         + (f" issuing >= {self.registers.share_min:.2f} of the FMA peak (latency "
                            f"{self.registers.latency})" if self.registers.share_min else "")
                         + (f", threads % {self.registers.warp}" if self.registers.warp else ""))
        for r in self.levels:
            parts.append(f"{r.level}: {r.tile} tile moves >= {r.need:.3g} MACs per element "
                         f"(balance {r.balance:.3g})")
        if self.cores:
            parts.append(f"parallel: the fused parallel loop runs >= {self.cores} iterations (every core busy)")
        if self.alpha_one:
            parts.append("alpha = 1 (kh0 = kw0 = 1, c in the layout's unit: outermost NCHW, innermost CPU NHWC)")
        return "; ".join(parts + list(self.notes))


# -- building the plan -----------------------------------------------------------------------
def levels(spec: ConvSpec, target: Target) -> list[tuple[str, str]]:
    """(memory level, tile) pairs that pruning checks, innermost first."""
    names = [lvl.name for lvl in target.levels if lvl.name != "registers"]
    if target.kind == "cpu":
        return [("registers", "S3")] + [(name, "S2") for name in names[:2]]
    return [("registers", "thread")] + ([("shared", "block")] if "shared" in names else [])


def _slots(target: Target, tile: str) -> int:
    """Tiles of this level that run at once: one per core, or per resident block / thread of a GPU."""
    if target.kind == "cpu":
        return target.cores
    resident = target.level("shared").processors if any(l.name == "shared" for l in target.levels) else 1
    return target.cores * resident * (GPU_MAX_THREADS if tile == "thread" else 1)


def rules(spec: ConvSpec, target: Target, config: PruneConfig, steps: dict[str, int]) -> PrunePlan:
    """The conditions with each level relaxed `steps[level]` times (past max_relax: dropped)."""
    notes = []
    balance = nominal_balance(target)
    outputs = spec.n * spec.groups * spec.k_per_group * spec.out_h * spec.out_w
    registers, found = None, []
    for name, tile in levels(spec, target):
        s = steps.get(name, 0)
        if s > config.max_relax:
            notes.append(f"{name} conditions dropped (nothing satisfied them)")
            continue
        if s:
            notes.append(f"{name} conditions relaxed {s} step(s)")
        if name == "registers":
            if target.kind == "cpu":
                free = free_registers(target)
                if not config.fma_latency:
                    registers = RegisterRule(1, free, 0, s)
                elif spec.k_per_group % target.simd_width == 0:  # the tile's issue share
                    share = min(1.0, _best_share(spec, target, free, config.fma_latency))
                    registers = RegisterRule(1, free, 0, s, share / config.tolerance / 2 ** s, config.fma_latency)
                else:  # registers counted as accumulators, no more than one image and group allow
                    floor = accumulators_needed(target.fma_units, config.tolerance,
                                                _one_group_accumulators(spec, free), config.fma_latency)
                    registers = RegisterRule(max(1, ceil(floor / 2 ** s)), free, 0, s)
            else:
                lo, hi = config.gpu_accumulators
                registers = RegisterRule(max(1, lo >> s), min(gpu_max_accumulators(target), hi << s),
                                         WARP if (config.warp and s == 0) else 0, s)
        most = outputs // _slots(target, tile)
        if name == "registers":  # and no more than the register tile can hold
            most = min(most, registers.acc_max * (target.simd_width if target.kind == "cpu" else 1))
        allows = best_tile_intensity(spec, most)
        need = min(balance[name], allows) / config.tolerance / 2.0 ** s
        capacity = 0 if name == "registers" or target.kind != "cpu" else target.level(name).elements_per_processor
        found.append(LevelRule(name, tile, need, capacity, balance[name], s))
    alpha = config.alpha_cpu if target.kind == "cpu" else config.alpha_one
    busy = target.kind == "cpu" and config.busy_cores and spec.macs >= target.cores * config.min_macs_per_core
    cores = min(target.cores, outputs) if busy else 0
    return PrunePlan(registers, tuple(found), alpha, tuple(notes), cores)


# -- membership of one schedule --------------------------------------------------------------
def parallel_iterations(schedule: Schedule) -> int:
    """Iterations of a CPU schedule's fused parallel loop: its first `parallel` S0 factors."""
    return prod(schedule.spatial[i][0] for i in range(schedule.parallel))


def alpha_c_index(kind: str, layout: str) -> int:
    """Where alpha = 1 puts c in the innermost reduction order, in the unit the layout stores
    channels in: first (outermost) for NCHW and on the GPU, last (innermost) for CPU NHWC (c
    outermost there strides C floats per step, and measured 5-6% slower on ResNet-18's layer1 and
    layer3, which kept every NHWC kernel of the pruned space below the default schedule)."""
    return -1 if (kind, layout) == ("cpu", "NHWC") else 0


def alpha_order_ok(order: tuple[str, ...], kind: str, layout: str) -> bool:
    """Whether the innermost reduction order slides over channels as alpha = 1 asks."""
    return order[alpha_c_index(kind, layout)] == "c"


def reasons(schedule: Schedule, spec: ConvSpec, target: Target, p: PrunePlan) -> list[str]:
    """Why the conditions of `p` (maco.space.schedules.prune_plan) drop `schedule` (empty if they keep it).
    Assumes a valid schedule."""
    out = []
    if p.alpha_one:
        red = {a: schedule.factors(a) for a in ("kh", "kw")}
        if red["kh"][0] != 1 or red["kw"][0] != 1:
            out.append(f"alpha = 1: the kernel window is split at R0 (kh {red['kh']}, kw {red['kw']})")
        if not alpha_order_ok(schedule.inner_order, schedule.kind, schedule.layout):
            where = "innermost" if alpha_c_index(schedule.kind, schedule.layout) else "outermost"
            out.append(f"alpha = 1: inner_order {schedule.inner_order} does not visit c {where} "
                       f"({schedule.layout})")
    iterations = parallel_iterations(schedule) if schedule.kind == "cpu" else p.cores
    if iterations < p.cores:
        out.append(f"parallel: the {schedule.parallel} fused parallel loop(s) run {iterations} "
                   f"iteration(s) for {p.cores} cores, so cores sit idle")
    if schedule.kind == "cpu":
        tiles = {f"S{lvl}": schedule.spatial_tile(lvl) for lvl in (1, 2, 3)}
        chunk, acc, threads = schedule.factors("c")[1], schedule.accumulators, None
        window = (schedule.factors("kh")[1], schedule.factors("kw")[1])
        latency = FMA_LATENCY if p.registers is None else p.registers.latency
        share = _register_share(spec, target, tuple(tiles["S3"].values()), schedule.vector_axis,
                                schedule.layout, schedule.weight_packing, latency)
    else:
        tiles = {"thread": sketch_cuda.thread_tile(schedule), "block": sketch_cuda.block_tile(schedule)}
        chunk = spec.c_per_group  # the outputs stay in registers for the whole reduction
        window = (None, None)
        acc = int(np.prod(list(tiles["thread"].values())))
        threads, share = sketch_cuda.threads(schedule), None
    if p.registers is not None:
        if not p.registers.ok(acc, threads, share):
            if p.registers.share_min and share is not None and share < p.registers.share_min * (1 - 1e-9):
                out.append(f"registers: {acc} accumulators ({schedule.vector_axis} vectors, {schedule.layout}, "
                           f"weights {schedule.weight_packing}) "
                           f"issue at most {share:.2f} of the FMA peak, below the {p.registers.share_min:.2f} asked")
            if not p.registers.acc_min <= acc <= p.registers.acc_max:
                out.append(f"registers: {acc} accumulators, outside {p.registers.acc_min}..{p.registers.acc_max}")
        if p.registers.warp and threads % p.registers.warp:
            out.append(f"registers: {threads} threads per block are not whole warps of {p.registers.warp}")
    for rule in p.levels:
        out += rule.why(spec, tiles[rule.tile], chunk, *window)
    return out


def balance_reasons(schedule: Schedule, spec: ConvSpec, target: Target, balance: dict[str, float],
                    tolerance: float = 2.0) -> list[str]:
    """The cache levels that would be the schedule's bottleneck (maco.bounds.hierarchy): its whole
    nest crosses the level's outer boundary with fewer multiply-adds per element than the cores
    need there to run at their peak (`balance`: measured, kernels.cpu_peak.machine_balance, or
    nominal, maco.bounds.hierarchy.nominal_balance over the tolerance), or, where the
    layer itself cannot reach that (its I/O lower bound at this level's size), fewer than
    1/`tolerance` of what the bound allows. Empty: no level is."""
    out = []
    for lvl in target.levels:
        if lvl.name not in balance:
            continue
        S = lvl.elements_per_processor
        need = min(balance[lvl.name], spec.macs / best_lower_bound(spec, S) / tolerance)
        have = intensity(spec, schedule, S)
        if have < need:
            out.append(f"{lvl.name}: {have:.3g} MACs per element cross it, below the {need:.3g} "
                       "the cores need (or the bound allows)")
    return out
