"""MACO pruning: the level conditions on hand-computed tiles, tolerances as parameters, relaxation,
that pruned samples really meet every level's balance, exact counts and uniform draws where the
level rules bite (against brute force), and that the bound-derived defaults are kept."""
import random
from dataclasses import replace
from math import prod

import pytest

from tests.targets import AVX2
from maco import geometry
from maco import prune, space
from maco.errors import MacoError
from maco.prune import LevelRule, PruneConfig, RegisterRule
from maco.schedule import SPATIAL_AXES, Schedule
from maco.spec import ConvSpec
from maco.target import MemoryLevel, Target

HOST = AVX2  # fixed, so that expectations do not move with the machine
H100 = Target.h100()
RESNET_3X3 = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")


def test_footprint_by_hand():
    spec = ConvSpec.parse("n1_c8_h10_w10_k16_r3_s2_p1")
    # 2 x 3 outputs (y, x), 4 filters: outputs 24, patch (2-1)*2+3 = 5 by (3-1)*2+3 = 7, weights 4*9
    assert geometry.footprint(spec, 3, 2, 4, images=1, groups=1) == 24 + 35 + 36
    dil = ConvSpec.parse("n2_c8_h10_w10_k16_r3_d2_p2_g2")
    # dilated window 5: patch (2-1)+5 = 6 by (3-1)+5 = 7 per image; two groups double everything
    assert geometry.footprint(dil, 3, 2, 4, images=2, groups=2) == 2 * (2 * 24 + 2 * 42 + 36)


@pytest.mark.parametrize("text,expected", [("n1_c64_h56_w56_k64_r3_p1", 9.0),
                                           ("n1_c3_h224_w224_k64_r11_s4_p2", 121 / 16),
                                           ("n1_c64_h56_w56_k128_r1_s2", 1.0),
                                           ("n1_c64_h56_w56_k128_r3_s2_p1", 2.25),
                                           ("n1_c8_h20_w20_k8_r3_s2_d2_p2", 9.0),
                                           ("n1_c8_h20_w20_k8_r3x1_s1x3_d2", 3.0)])
def test_reuse_is_the_asymptotic_taps_per_input(text, expected):
    spec = ConvSpec.parse(text)
    assert geometry.tile_reuse(spec) == pytest.approx(expected)
    # independent check: products over distinct inputs read by a long run of outputs, per axis
    r = 1.0
    for k, s, d in ((spec.kh, spec.stride[0], spec.dilation[0]), (spec.kw, spec.stride[1], spec.dilation[1])):
        x = 3000
        read = {o * s + i * d for o in range(x) for i in range(k)}
        r *= x * k / len(read)
    assert geometry.tile_reuse(spec) == pytest.approx(r, rel=0.01)


def test_footprint_matches_the_bounds_convention():
    bounds = pytest.importorskip("maco.bounds")
    if not hasattr(bounds, "footprint"):
        pytest.skip("maco.bounds.footprint not built yet")
    for spec in (RESNET_3X3, ConvSpec.parse("n1_c3_h224_w224_k64_r11_s4_p2"),
                 ConvSpec.parse("n1_c8_h10_w10_k16_r3_s2_d2_p2")):
        for x, y, z in ((1, 1, 1), (3, 2, 5), (8, 14, 16)):
            assert geometry.footprint(spec, x, y, z, images=1, groups=1) == geometry.footprint(spec, x, y, z)


@pytest.mark.parametrize("text", ["n1_c64_h56_w56_k64_r3_p1", "n1_c128_h28_w28_k128_r3_p1",
                                  "n1_c256_h14_w14_k256_r3_p1", "n1_c512_h7_w7_k512_r3_p1",
                                  "n1_c64_h56_w56_k128_r3_s2_p1", "n1_c64_h56_w56_k128_r1_s2",
                                  "n1_c64_h27_w27_k192_r5_p2", "n1_c3_h224_w224_k64_r11_s4_p2"])
@pytest.mark.parametrize("target", [HOST, H100])
def test_the_bounds_optimal_tiles_meet_every_level(text, target):
    """The I/O-optimal integer tile of maco.bounds at each cache level, taken as that level's tile
    with whole channels, meets the level's balance: the one-level optimum is one of the tiles a
    level is content with."""
    bounds = pytest.importorskip("maco.bounds")
    spec = ConvSpec.parse(text)
    plan = space.prune_plan(spec, target)
    for rule in plan.levels:
        if rule.level == "registers":
            continue
        level = target.level(rule.level)
        t = bounds.optimal_tile(spec, level.elements, level.processors)
        assert not rule.why(spec, dict(n=1, g=1, k=t.z, oh=t.y, ow=t.x), spec.c_per_group), (rule, str(t))


def test_level_rule_by_hand():
    spec = RESNET_3X3  # 64 channels, 3x3
    # 2 x 7 outputs (oh, ow), 16 filters: patch 4 x 9 = 36 per channel, weights 16*9 = 144
    # per channel; MACs 224 * 64 * 9 = 129024. Outputs kept: 64*180 + 224 = 11744 elements
    # (10.99 MACs per element); chunks of 4 channels, outputs reloaded: 11520 + 224*31 (6.99)
    fp4 = 224 + 4 * (36 + 144)  # outputs + one chunk: 944 elements
    held = LevelRule("L1", "S2", need=8.0, capacity=fp4, balance=16.0)
    spilled = LevelRule("L1", "S2", need=8.0, capacity=fp4 - 1, balance=16.0)
    assert held.intensity(spec, 1, 1, 16, 2, 7, 4) == pytest.approx(129024 / 11744)
    assert spilled.intensity(spec, 1, 1, 16, 2, 7, 4) == pytest.approx(129024 / (11520 + 224 * 31))
    assert held.ok(spec, 1, 1, 16, 2, 7, 4) and not spilled.ok(spec, 1, 1, 16, 2, 7, 4)
    assert spilled.ok(spec, 1, 1, 16, 2, 7, 64)  # whole channels: the outputs cross once
    why = spilled.why(spec, dict(n=1, g=1, k=16, oh=2, ow=7), 4)
    assert len(why) == 1 and why[0].startswith("L1: S2 tile 1x1x16x2x7") and "6.99" in why[0] and "8" in why[0]
    # a level that holds the tile with every channel is not judged (reuse across tiles)
    whole = LevelRule("L2", "S2", need=1e9, capacity=224 + 64 * 180, balance=16.0)
    assert whole.ok(spec, 1, 1, 16, 2, 7, 1) and not whole.ok(spec, 1, 1, 32, 2, 7, 1)
    regs = RegisterRule(6, 12, warp=32)
    assert regs.ok(6) and regs.ok(12) and not regs.ok(5) and not regs.ok(13)
    assert regs.ok(8, 64) and not regs.ok(8, 48)


def _intensity(spec: ConvSpec, t: dict, chunk: int, capacity: float) -> float:
    """MACs per element crossing a level for a tile and chunk, by hand (maco.bounds.hierarchy)."""
    ih = min(spec.h, (t["oh"] - 1) * spec.stride[0] + (spec.kh - 1) * spec.dilation[0] + 1)
    iw = min(spec.w, (t["ow"] - 1) * spec.stride[1] + (spec.kw - 1) * spec.dilation[1] + 1)
    taps, cg, outputs = spec.kh * spec.kw, spec.c_per_group, prod(t.values())
    operands = t["g"] * (t["n"] * ih * iw + t["k"] * taps)  # per channel
    held = outputs + chunk * operands <= capacity
    if outputs + cg * operands <= capacity:
        return float("inf")  # the level holds the tile with every channel: not judged
    return outputs * cg * taps / (cg * operands + outputs * (1 if held else 2 * cg / chunk - 1))


def _levels_hold(s: Schedule, spec: ConvSpec, target: Target, plan) -> None:
    """Recompute every condition of the plan by hand for one schedule."""
    if s.kind == "cpu":
        tiles = {f"S{lvl}": {a: s.tile(a, lvl) for a in SPATIAL_AXES} for lvl in (1, 2, 3)}
        acc, chunk = s.accumulators, s.factors("c")[1]
    else:
        tiles = {"thread": s.gpu_thread_tile(), "block": s.gpu_block_tile()}
        acc, chunk = prod(tiles["thread"].values()), spec.c_per_group
        if plan.registers.warp:
            assert s.gpu_threads % 32 == 0
    assert plan.registers.acc_min <= acc <= plan.registers.acc_max
    for rule in plan.levels:
        assert _intensity(spec, tiles[rule.tile], chunk, rule.capacity) >= rule.need * (1 - 1e-9)
    assert s.factors("kh")[0] == 1 and s.factors("kw")[0] == 1
    # alpha = 1 in the layout's unit: c innermost in CPU NHWC, else outermost
    assert s.inner_order.index("c") == (2 if (s.kind, s.layout) == ("cpu", "NHWC") else 0)


@pytest.mark.parametrize("target", [HOST, H100])
def test_pruned_samples_meet_every_condition(target):
    spec = RESNET_3X3
    plan = space.prune_plan(spec, target)
    assert not plan.relaxed  # the default tolerances are satisfiable on this layer
    names = {(r.level, r.tile) for r in plan.levels}
    assert names == ({("registers", "S3"), ("L1", "S2"), ("L2", "S2")} if target.kind == "cpu"
                     else {("registers", "thread"), ("shared", "block")})
    for s in space.sample_many(spec, target, 200, random.Random(1), pruned=True):
        _levels_hold(s, spec, target, plan)


def test_unpruned_samples_mostly_fail_and_reasons_agree_with_keeps():
    rng = random.Random(2)
    dropped = 0
    for s in space.sample_many(RESNET_3X3, HOST, 200, rng):
        why = prune.reasons(s, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST))
        assert space.contains(s, RESNET_3X3, HOST, pruned=True) == (not why)
        dropped += bool(why)
    assert dropped > 190  # the pruned space is a tiny fraction of the full one


def test_scalar_register_tiles_do_not_fill_the_register_level():
    """The register level holds free registers x lanes elements: a tile of scalar accumulators
    fits the register count yet fills one lane in each, so pruning drops it where vector
    tiles exist (they ran 10-40x faster)."""
    s = space.sample(RESNET_3X3, HOST, 4, pruned=True)
    tile = {"n": 1, "g": 1, "k": 2, "oh": 1, "ow": 4}  # 8 outputs: 8 scalar accumulators
    spatial = tuple((prod(f) // tile[a], 1, 1, tile[a]) for a, f in zip(SPATIAL_AXES, s.spatial))
    scalar = Schedule(**{**s.__dict__, "spatial": spatial, "vector_axis": "k", "vector_width": 1})
    assert scalar.problems(RESNET_3X3, HOST) == [] and scalar.accumulators == 8
    assert any(w.startswith("registers") and "lanes" in w for w in prune.reasons(scalar, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    assert not any(w.startswith("registers")
                   for w in prune.reasons(scalar, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST, PruneConfig(register_fill=0.0))))
    assert all(x.vector_width == HOST.simd_width
               for x in space.sample_many(RESNET_3X3, HOST, 100, random.Random(3), pruned=True))


def test_tolerance_is_a_parameter_and_monotone():
    spec = ConvSpec.parse("n1_c256_h14_w14_k512_r1_s2")  # 1x1: shallow chunks starve a level
    sizes = [space.space_size(spec, HOST, pruned=True, config=PruneConfig(tolerance=t))
             for t in (1.0, 2.0, 4.0, 16.0)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    loose = space.prune_plan(spec, HOST, PruneConfig(register_fill=0.0, tolerance=1e9, alpha_one=False))
    # with the levels' needs wide open, they drop nothing
    assert space.count_with(spec, HOST, loose) == space.count_with(spec, HOST, replace(loose, levels=()))
    fills = [space.space_size(spec, HOST, pruned=True, config=PruneConfig(register_fill=f))
             for f in (0.5, 0.25, 0.0)]  # (0.75 asks for 9 registers, which no tile fills: relaxed)
    assert fills == sorted(fills)


def test_alpha_one_prunes_window_splits_and_channel_inner_orders():
    s = space.sample(RESNET_3X3, HOST, 4, pruned=True)
    split = Schedule(**{**s.__dict__, "reduction": (s.reduction[0], (3, 1), s.reduction[2])})
    assert any("kernel window" in w for w in prune.reasons(split, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    order = Schedule(**{**s.__dict__, "inner_order": ("kh", "c", "kw")})
    assert any("inner_order" in w for w in prune.reasons(order, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    no_alpha = PruneConfig(alpha_one=False)
    assert not prune.reasons(order, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST, no_alpha))
    assert space.space_size(RESNET_3X3, HOST, True, no_alpha) > space.space_size(RESNET_3X3, HOST, True)


@pytest.mark.parametrize("text", ["n1_c512_h7_w7_k512_r3_p1", "n1_c3_h7_w5_k1_r7x5", "n1_c1_h1_w1_k1_r1",
                                  "n1_c4_h300_w2_k3_r1", "n1_c3_h17_w13_k5_r3_s2_d3_p1"])
@pytest.mark.parametrize("target", [HOST, H100])
def test_even_extreme_tolerances_leave_a_non_empty_pruned_space(text, target):
    spec = ConvSpec.parse(text)
    strict = PruneConfig(tolerance=1.0, register_fill=1.0, gpu_accumulators=(64, 64), warp=True,
                         max_relax=2)
    assert space.space_size(spec, target, pruned=True, config=strict) > 0
    s = space.sample(spec, target, 0, pruned=True, config=strict)
    assert space.contains(s, spec, target, pruned=True, config=strict)


def test_relaxation_widens_by_documented_steps():
    # 12 accumulators exactly is impossible on 7x7x512 (no factor 3): the register floor halves
    spec = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")
    plan = space.prune_plan(spec, HOST, PruneConfig(register_fill=1.0))
    assert plan.registers.relaxed == 1 and plan.registers.acc_min == 6
    assert "registers conditions relaxed 1 step(s)" in plan.notes
    regs = next(r for r in plan.levels if r.level == "registers")
    assert regs.relaxed == 1  # the register level's balance relaxes with it (its need halves)
    strict = next(r for r in space.prune_plan(spec, HOST, PruneConfig(tolerance=1.0)).levels
                  if r.level == "registers")
    assert regs.need == pytest.approx(strict.need / 2 / 2)  # tolerance 2, one step
    # and with the default tolerances these layers need no relaxation at all
    assert not space.prune_plan(spec, HOST).relaxed and not space.prune_plan(RESNET_3X3, HOST).relaxed


def test_a_level_that_can_never_hold_is_dropped():
    spec = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")
    plan = space.prune_plan(spec, HOST, PruneConfig(register_fill=1.0, max_relax=0))
    assert plan.registers is None and "registers conditions dropped" in plan.describe()
    assert [r.level for r in plan.levels] == ["L1", "L2"]
    assert space.space_size(spec, HOST, pruned=True, config=PruneConfig(register_fill=1.0, max_relax=0)) > 0


@pytest.mark.parametrize("kwargs", [dict(tolerance=0.5), dict(register_fill=-1),
                                    dict(gpu_accumulators=(9, 4)), dict(max_relax=-1)])
def test_bad_config_names_the_value(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(MacoError, match=name):
        PruneConfig(**kwargs)
