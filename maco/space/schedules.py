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

This module dispatches per target: the CPU tables and draws are maco.space.cpu, the GPU ones
maco.space.gpu (both on maco.space.tables); the compute-in-memory sketch "PSB" (cores, outer loops
in any order, block) is counted and drawn by maco.space.cim, and its pruning is maco.space.prune_cim.

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
from functools import lru_cache

from maco.core.errors import MacoError
from maco.core.schedule import UNROLL_STEPS, Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.space import cim as space_cim, cpu as space_cpu, gpu as space_gpu, prune


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
    return (space_cpu.tables if target.kind == "cpu" else space_gpu.tables)(spec, target, rules).size


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
        return space_cpu.sample(spec, target, space_cpu.tables(spec, target, rules), rng)
    return space_gpu.sample(spec, target, space_gpu.tables(spec, target, rules), rules, rng)


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
    out += (space_cpu.why_not(schedule, target) if schedule.kind == "cpu"
            else space_gpu.why_not(schedule))
    if out or not pruned:
        return out
    return prune.reasons(schedule, spec, target, prune_plan(spec, target, config))

