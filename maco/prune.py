"""MACO pruning: keep the schedules whose tiles follow the optimal-dataflow conditions of the bounds.

The bounds (maco.bounds, DESIGN.md) say: at a memory level of S elements shared by Np
processors, each processor should own an output tile x*y*z (x along ow, y along oh, z along k)
with x*y = R*z (R: maco.geometry.tile_reuse) and footprint x*y*z + x'*y' + z*kh*kw ~ S/Np, sliding over the
input channels one at a time (alpha = 1). MACO keeps the schedules that satisfy these at every
level:

Which tile sits in which memory level (CPU nest S0 S1 R0 S2 R1 S3):
  registers  <- S3, the register tile: its accumulators must fit the free vector registers
                (a hard limit of the space) and its outputs fill at least `register_fill` of
                their lanes (the level holds registers x lanes elements: a scalar tile of 28
                outputs fills 28 of 448 on AVX-512, and runs 10-40x slower than a vector one).
  L1         <- the tile of one S1 iteration (S2*S3 factors): the block whose outputs stay in
                L1 while the R0 loop streams channel chunks through it.
  L2         <- the tile of one S0 iteration (S1*S2*S3): one parallel work item of a core.
  L3 and any further level <- the S0 level, i.e. the whole layer split over the cores: it is
                fixed by the spec, the schedule has nothing to choose there, so it is not used.
GPU nest (block, vthread, thread, inner, inner):
  registers  <- the thread tile (f1*f3*f4): between gpu_accumulators[0] and [1] accumulators,
                and whole warps (threads per block a multiple of 32).
  shared     <- the block tile (f1*f2*f3*f4), per block (S/Np with Np resident blocks per SM).
  L2         <- the whole grid: fixed by the spec, not used.

Conditions at a cache level, with the per-processor tile of n, g, k=z, oh=y, ow=x outputs:
  ratio   n*y*x / (R*z) within [1/tolerance, tolerance]           (x*y ~ R*z);
          only the lower side when z already spans all K filters of the group, only the upper
          side when n*y*x already spans every output pixel (the tile cannot grow that way)
  fill    fill_low * min(S/Np, F(layer)/cores) <= F(tile) <= S/Np  (F: footprint with alpha = 1;
          a level never needs more than the layer's share of one core or SM)
and for the whole nest, alpha = 1: every tile slides over the input channels one at a time with
the whole kh x kw window per channel, i.e. the kernel window is not split by the outer reduction
level (kh0 = kw0 = 1), and the innermost reduction loops take the channels in the layout's unit
(`alpha_order_ok`): c outermost where a channel's window is whole rows of one plane (NCHW, and
the GPU kernels' shared-memory windows), c innermost where channels are the contiguous axis (CPU
NHWC: a cache line of channels slides by at each tap).

Relaxation (maco.space.prune_plan, which counts the space under each try), so that a valid conv
never gets an empty pruned space: if the conditions of one level alone leave nothing, that level
is relaxed step by step (tolerance x2, lower fill /2,
capacity x2, register lower bounds /2, the warp rule dropped); after `max_relax` steps the level is
dropped. If all levels together still leave nothing, levels are relaxed the same way from the
outermost inwards. The plan says what was relaxed (PrunePlan.notes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil
from typing import Any

import numpy as np

from maco.bounds.conv import best_lower_bound
from maco.bounds.hierarchy import intensity
from maco.errors import MacoError
from maco.geometry import footprint, tile_reuse
from maco.schedule import REGISTER_RESERVE, Schedule, gpu_max_accumulators
from maco.spec import ConvSpec
from maco.target import Target

WARP = 32


@dataclass(frozen=True)
class PruneConfig:
    """Tolerances of the pruning conditions (see the module docstring)."""

    tolerance: float = 2.0  # x*y / (R*z) within [1/tolerance, tolerance]
    fill_low: float = 0.25  # footprint >= fill_low * min(S/Np, layer footprint / cores)
    register_fill: float = 0.5  # CPU: accumulators >= this share of the free vector registers
    gpu_accumulators: tuple[int, int] = (8, 64)  # GPU: accumulators per thread (nvcc spills past ~64)
    warp: bool = True  # GPU: threads per block a multiple of the warp size
    alpha_one: bool = True  # one channel at a time, whole window (kh0 = kw0 = 1; alpha_order_ok)
    max_relax: int = 3  # relaxation steps of a level before it is dropped

    def __post_init__(self) -> None:
        if not self.tolerance >= 1.0:
            raise MacoError(f"PruneConfig.tolerance must be >= 1, got {self.tolerance}")
        if not 0.0 <= self.fill_low <= 1.0:
            raise MacoError(f"PruneConfig.fill_low must be in [0, 1], got {self.fill_low}")
        if not 0.0 <= self.register_fill <= 1.0:
            raise MacoError(f"PruneConfig.register_fill must be in [0, 1], got {self.register_fill}")
        lo, hi = self.gpu_accumulators
        if not 1 <= lo <= hi:
            raise MacoError(f"PruneConfig.gpu_accumulators must be 1 <= lo <= hi, got {self.gpu_accumulators}")
        if self.max_relax < 0:
            raise MacoError(f"PruneConfig.max_relax must be >= 0, got {self.max_relax}")


@dataclass(frozen=True)
class CacheRule:
    """The ratio and fill conditions at one cache level, on one tile level of the nest."""

    level: str
    tile: str  # which tile: "S2" (one S1 iteration), "S1" (one S0 iteration), "block"
    capacity: float  # footprint upper bound, elements (S/Np)
    floor: float  # footprint lower bound, elements
    tolerance: float
    relaxed: int = 0

    def _ratio_ok(self, spec: ConvSpec, r: float, n: Any, k: Any, oh: Any, ow: Any) -> Any:
        """x*y/(R*z) within the tolerance, one-sided where the tile already spans the layer: a tile
        with all filters (z = K) cannot grow z, one with every output pixel cannot grow x*y, so the
        optimum moves past x*y = R*z there (as maco.bounds.optimal_tile does)."""
        pixels = n * oh * ow
        ratio = pixels / (r * k)
        return (((ratio >= 1.0 / self.tolerance) | (pixels >= spec.n * spec.out_h * spec.out_w))
                & ((ratio <= self.tolerance) | (k >= spec.k_per_group)))

    def ok(self, spec: ConvSpec, r: float, n: Any, g: Any, k: Any, oh: Any, ow: Any) -> Any:
        fp = footprint(spec, ow, oh, k, images=n, groups=g)
        return self._ratio_ok(spec, r, n, k, oh, ow) & (fp >= self.floor) & (fp <= self.capacity)

    def why(self, spec: ConvSpec, r: float, t: dict[str, int]) -> list[str]:
        ratio = t["n"] * t["oh"] * t["ow"] / (r * t["k"])
        fp = footprint(spec, t["ow"], t["oh"], t["k"], images=t["n"], groups=t["g"])
        out = []
        if not self._ratio_ok(spec, r, t["n"], t["k"], t["oh"], t["ow"]):
            out.append(f"{self.level}: {self.tile} tile has x*y/(R*z) = {ratio:.3g}, outside "
                       f"[{1 / self.tolerance:.3g}, {self.tolerance:.3g}]")
        if not self.floor <= fp <= self.capacity:
            out.append(f"{self.level}: {self.tile} tile footprint {fp} outside "
                       f"[{self.floor:.0f}, {self.capacity:.0f}] elements")
        return out


@dataclass(frozen=True)
class RegisterRule:
    """Accumulators of the register (CPU) or thread (GPU) tile; optionally whole warps."""

    acc_min: int
    acc_max: int
    warp: int = 0  # threads per block must be a multiple of this (0: no rule)
    relaxed: int = 0

    def ok(self, acc: Any, threads: Any = None, filled: Any = None) -> Any:
        """`filled`: the tile's outputs in units of one register's lanes (CPU; default `acc`)."""
        good = ((acc if filled is None else filled) >= self.acc_min) & (acc <= self.acc_max)
        if self.warp and threads is not None:
            good = good & (threads % self.warp == 0)
        return good


@dataclass(frozen=True)
class PrunePlan:
    """The conditions in force for one conv on one target, after any relaxation."""

    registers: RegisterRule | None
    caches: tuple[CacheRule, ...]
    alpha_one: bool
    reuse: float
    notes: tuple[str, ...] = field(default=())

    @property
    def relaxed(self) -> bool:
        return bool(self.notes)

    def describe(self) -> str:
        parts = []
        if self.registers:
            parts.append(f"registers: {self.registers.acc_min}..{self.registers.acc_max} accumulators"
                         + (f", threads % {self.registers.warp}" if self.registers.warp else ""))
        for c in self.caches:
            parts.append(f"{c.level}: {c.tile} tile, x*y/(R*z) in [1/{c.tolerance:g}, {c.tolerance:g}], "
                         f"footprint {c.floor:.0f}..{c.capacity:.0f}")
        if self.alpha_one:
            parts.append("alpha = 1 (kh0 = kw0 = 1, c in the layout's unit: outermost NCHW, innermost CPU NHWC)")
        return "; ".join(parts + list(self.notes))


# -- building the plan -----------------------------------------------------------------------
def levels(spec: ConvSpec, target: Target) -> list[tuple[str, str]]:
    """(memory level, tile) pairs that pruning uses, innermost first (registers handled apart)."""
    names = [lvl.name for lvl in target.levels if lvl.name != "registers"]
    if target.kind == "cpu":
        return list(zip(names, ("S2", "S1")))
    return [("shared", "block")] if "shared" in names else []


def rules(spec: ConvSpec, target: Target, config: PruneConfig, steps: dict[str, int]) -> PrunePlan:
    """The conditions with each level relaxed `steps[level]` times (past max_relax: dropped)."""
    r = tile_reuse(spec)
    layer = footprint(spec, spec.out_w, spec.out_h, spec.k_per_group, images=spec.n, groups=spec.groups)
    notes = []

    def relax_note(name: str) -> None:
        s = steps.get(name, 0)
        if s > config.max_relax:
            notes.append(f"{name} conditions dropped (nothing satisfied them)")
        elif s:
            notes.append(f"{name} conditions relaxed {s} step(s)")

    registers = None
    s = steps.get("registers", 0)
    relax_note("registers")
    if s <= config.max_relax:
        if target.kind == "cpu":
            free = target.level("registers").elements // target.simd_width - REGISTER_RESERVE
            registers = RegisterRule(max(1, ceil(config.register_fill * free / 2 ** s)), free, 0, s)
        else:
            hard = gpu_max_accumulators(target)
            lo, hi = config.gpu_accumulators
            registers = RegisterRule(max(1, lo >> s), min(hard, hi << s),
                                     WARP if (config.warp and s == 0) else 0, s)
    caches = []
    for name, tile in levels(spec, target):
        s = steps.get(name, 0)
        relax_note(name)
        if s > config.max_relax:
            continue
        lvl = target.level(name)
        share = lvl.elements_per_processor
        floor = config.fill_low * min(share, layer / target.cores)
        caches.append(CacheRule(name, tile, share * 2.0 ** s, floor / 2.0 ** s,
                                config.tolerance * 2.0 ** s, s))
    return PrunePlan(registers, tuple(caches), config.alpha_one, r, tuple(notes))


# -- membership of one schedule --------------------------------------------------------------
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
    """Why the conditions of `p` (maco.space.prune_plan) drop `schedule` (empty if they keep it).
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
    if schedule.kind == "cpu":
        tiles = {"S2": {a: schedule.tile(a, 2) for a in ("n", "g", "k", "oh", "ow")},
                 "S1": {a: schedule.tile(a, 1) for a in ("n", "g", "k", "oh", "ow")}}
        acc, threads = schedule.accumulators, None
        filled = np.prod(list(schedule.register_tile().values())) / target.simd_width
    else:
        tiles = {"block": schedule.gpu_block_tile()}
        acc = int(np.prod(list(schedule.gpu_thread_tile().values())))
        threads, filled = schedule.gpu_threads, None
    if p.registers is not None:
        if not p.registers.ok(acc, filled=filled):
            fill = "" if filled is None or filled == acc else f" filling {filled:g} registers' lanes"
            out.append(f"registers: {acc} accumulators{fill}, outside {p.registers.acc_min}..{p.registers.acc_max}")
        if p.registers.warp and threads % p.registers.warp:
            out.append(f"registers: {threads} threads per block are not whole warps of {p.registers.warp}")
    for rule in p.caches:
        out += rule.why(spec, p.reuse, tiles[rule.tile])
    return out


def balance_reasons(schedule: Schedule, spec: ConvSpec, target: Target, balance: dict[str, float],
                    tolerance: float = 2.0) -> list[str]:
    """The cache levels that would be the schedule's bottleneck (maco.bounds.hierarchy): its whole
    nest crosses the level's outer boundary with fewer multiply-adds per element than the cores
    need there to run at their peak (`balance`, kernels.cpu_peak.machine_balance), or, where the
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
