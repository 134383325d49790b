"""MACO pruning: the level conditions on hand-computed tiles, tolerances as parameters, relaxation,
that pruned samples really meet every level's balance, exact counts and uniform draws where the
level rules bite (against brute force), and that the bound-derived defaults are kept."""
import random
from dataclasses import replace
from math import prod

import pytest

from tests.targets import AVX2
from maco.core import geometry
from maco.core import sketch_cuda
from maco.space import prune, schedules as space
from maco.core.errors import MacoError
from maco.kernels import default_schedule
from maco.space.prune import LevelRule, PruneConfig, RegisterRule
from maco.core.axes import SPATIAL_AXES
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import Target

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
        tiles = {"thread": sketch_cuda.thread_tile(s), "block": sketch_cuda.block_tile(s)}
        acc, chunk = prod(tiles["thread"].values()), spec.c_per_group
        if plan.registers.warp:
            assert sketch_cuda.threads(s) % 32 == 0
    assert plan.registers.acc_min <= acc <= plan.registers.acc_max
    if s.kind == "cpu" and plan.registers.share_min:  # the issue share, by hand: cycles per step
        t, W = tiles["S3"], target.simd_width
        outputs = prod(t.values())
        if s.vector_axis == "k":
            per_vector = 1 if s.weight_packing == "blocked" else W  # unpacked filters: a load per lane
            loads = t["g"] * t["k"] // W * per_vector + t["n"] * t["g"] * t["oh"] * t["ow"]
        else:
            per_vector = 1 if (s.layout == "NCHW" and spec.stride[1] == 1) else W
            loads = t["g"] * t["k"] + t["n"] * t["g"] * t["oh"] * t["ow"] // W * per_vector
        cycles = max(outputs / W / target.fma_units, loads / 2, 4)
        assert s.vector_width == W and outputs / (target.fma_units * W * cycles) >= plan.registers.share_min * (1 - 1e-9)
    if s.kind == "cpu":  # the fused parallel loop: its S0 factors, every core busy
        assert prod(s.spatial[i][0] for i in range(s.parallel)) >= plan.cores == target.cores
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
    """A tile of scalar accumulators fits the register count yet issues one lane per FMA (1/8 of
    the peak on 8 lanes at best), so pruning drops it where vector tiles exist (they ran 10-40x
    faster); with fma_latency 0 the register tile is not judged."""
    s = space.sample(RESNET_3X3, HOST, 4, pruned=True)
    tile = {"n": 1, "g": 1, "k": 2, "oh": 1, "ow": 4}  # 8 outputs: 8 scalar accumulators
    spatial = tuple((prod(f) // tile[a], 1, 1, tile[a]) for a, f in zip(SPATIAL_AXES, s.spatial))
    scalar = Schedule(**{**s.__dict__, "spatial": spatial, "vector_axis": "k", "vector_width": 1})
    assert scalar.problems(RESNET_3X3, HOST) == [] and scalar.accumulators == 8
    assert any(w.startswith("registers") and "of the FMA peak" in w
               for w in prune.reasons(scalar, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    assert not any(w.startswith("registers")
                   for w in prune.reasons(scalar, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST, PruneConfig(fma_latency=0))))
    assert all(x.vector_width == HOST.simd_width
               for x in space.sample_many(RESNET_3X3, HOST, 100, random.Random(3), pruned=True))


def test_unpacked_filter_vectors_are_loaded_lane_by_lane():
    """Statement 4 charges a vector whose lanes are not adjacent one load per lane: a filter vector
    in torch's (K, C, kh, kw) order has its lanes C*kh*kw apart (the kernels then run portable C,
    not intrinsics: 0.07x of the best on the Xeon's pruning data), so the default's tile with
    unpacked weights issues below its peak, and is dropped where that falls under the plan's
    minimum share (8 accumulators, not the 14 AVX2 now takes); packed, it is kept."""
    checked = 0
    for text in ("n1_c64_h56_w56_k64_r3_p1", "n1_c256_h14_w14_k256_r3_p1"):
        spec = ConvSpec.parse(text)
        for layout in ("NCHW", "NHWC"):
            s = default_schedule(spec, HOST, layout)
            assert space.contains(s, spec, HOST, pruned=True)
            if s.vector_axis != "k":  # an NCHW row vector: the weights are broadcast, packing or not
                continue
            checked += 1
            assert s.weight_packing == "blocked"
            unpacked = replace(s, weight_packing="none")
            why = space.why_not(unpacked, spec, HOST, pruned=True)
            k, oh, ow = (s.factors(a)[3] for a in ("k", "oh", "ow"))
            lanes = k // HOST.simd_width * HOST.simd_width  # a load per lane, then a broadcast per pixel
            want = min(1.0, (k // HOST.simd_width * oh * ow / HOST.fma_units) / ((lanes + oh * ow) / 2))
            assert float(prune.cpu_share(spec, HOST, 1, 1, k, oh, ow, "k", layout, "none")) == pytest.approx(want)
            dropped = want < space.prune_plan(spec, HOST).registers.share_min
            assert any("weights none" in w and "of the FMA peak" in w for w in why) == dropped, why
    assert checked >= 2
    share = {pk: float(prune.cpu_share(RESNET_3X3, HOST, 1, 1, 16, 1, 6, "k", "NHWC", pk))
             for pk in ("blocked", "none")}
    # 12 FMAs on 2 pipes: 6 cycles; unpacked, 16 + 6 loads on 2 ports: 11 cycles
    assert share["blocked"] == 1.0 and share["none"] == pytest.approx(6 / 11)


def test_tolerance_is_a_parameter_and_monotone():
    spec = ConvSpec.parse("n1_c256_h14_w14_k512_r1_s2")  # 1x1: shallow chunks starve a level
    sizes = [space.space_size(spec, HOST, pruned=True, config=PruneConfig(tolerance=t))
             for t in (1.0, 2.0, 4.0, 16.0)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    loose = space.prune_plan(spec, HOST, PruneConfig(fma_latency=0, tolerance=1e9, alpha_cpu=False))
    # with the levels' needs wide open, they drop nothing
    assert space.count_with(spec, HOST, loose) == space.count_with(spec, HOST, replace(loose, levels=()))
    # an FMA latency asks for a share of the peak relative to the best tile the layer allows: past
    # what the free accumulators can hide, a longer latency asks a smaller share; none asks none
    plans = {f: space.prune_plan(spec, HOST, PruneConfig(fma_latency=f)) for f in (16, 8, 4, 0)}
    mins = [plans[f].registers.share_min for f in (16, 8, 4)]
    assert mins == sorted(mins) and mins[0] < mins[-1] and not plans[0].registers.share_min
    fills = [space.space_size(spec, HOST, pruned=True, config=PruneConfig(fma_latency=f)) for f in (4, 0)]
    assert fills[0] < fills[1]


def test_alpha_one_prunes_window_splits_and_channel_inner_orders():
    s = space.sample(RESNET_3X3, HOST, 4, pruned=True)
    split = Schedule(**{**s.__dict__, "reduction": (s.reduction[0], (3, 1), s.reduction[2])})
    assert any("kernel window" in w for w in prune.reasons(split, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    order = Schedule(**{**s.__dict__, "inner_order": ("kh", "c", "kw")})
    assert any("inner_order" in w for w in prune.reasons(order, RESNET_3X3, HOST, space.prune_plan(RESNET_3X3, HOST)))
    no_alpha = PruneConfig(alpha_cpu=False)  # the CPU's switch; alpha_one is the GPU's
    plan = space.prune_plan(RESNET_3X3, HOST, no_alpha)
    assert not plan.alpha_one and space.prune_plan(RESNET_3X3, H100, no_alpha).alpha_one
    assert not prune.reasons(order, RESNET_3X3, HOST, plan)
    assert space.space_size(RESNET_3X3, HOST, True, no_alpha) > space.space_size(RESNET_3X3, HOST, True)


def test_without_alpha_the_levels_judge_a_window_split():
    """With alpha = 1 off, a split window is a pass of fewer taps: kept where the levels' balance
    holds with it, and dropped by a level (not by alpha) where the pass is too shallow."""
    no_alpha = PruneConfig(alpha_cpu=False)
    plan = space.prune_plan(RESNET_3X3, HOST, no_alpha)
    draws = space.sample_many(RESNET_3X3, HOST, 300, random.Random(4), pruned=True, config=no_alpha)
    splits = [s for s in draws if s.factors("kh")[0] > 1 or s.factors("kw")[0] > 1]
    assert splits and all(not prune.reasons(s, RESNET_3X3, HOST, plan) for s in splits)
    # a 1x1-tap pass of one channel: 9 output passes per channel, the register level starves
    s = draws[0]
    shallow = Schedule(**{**s.__dict__, "reduction": ((64, 1), (3, 1), (3, 1))})
    why = prune.reasons(shallow, RESNET_3X3, HOST, plan)
    assert why and all("kernel window" not in w for w in why) and any("1x1 taps" in w for w in why)


@pytest.mark.parametrize("text", ["n1_c512_h7_w7_k512_r3_p1", "n1_c3_h7_w5_k1_r7x5", "n1_c1_h1_w1_k1_r1",
                                  "n1_c4_h300_w2_k3_r1", "n1_c3_h17_w13_k5_r3_s2_d3_p1"])
@pytest.mark.parametrize("target", [HOST, H100])
def test_even_extreme_tolerances_leave_a_non_empty_pruned_space(text, target):
    spec = ConvSpec.parse(text)
    strict = PruneConfig(tolerance=1.0, fma_latency=16, gpu_accumulators=(64, 64), warp=True,
                         max_relax=2)
    assert space.space_size(spec, target, pruned=True, config=strict) > 0
    s = space.sample(spec, target, 0, pruned=True, config=strict)
    assert space.contains(s, spec, target, pruned=True, config=strict)


def test_relaxation_widens_by_documented_steps():
    # the register rule asks for what the layer allows, so it is met without relaxing; a relaxed
    # step (as prune_plan takes where levels together leave nothing) halves its share and the
    # register level's need
    spec = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")
    config = PruneConfig()
    assert not space.prune_plan(spec, HOST).relaxed and not space.prune_plan(RESNET_3X3, HOST).relaxed
    plain = prune.rules(spec, HOST, config, {})
    step = prune.rules(spec, HOST, config, {"registers": 1})
    assert step.registers.relaxed == 1 and step.registers.share_min == pytest.approx(plain.registers.share_min / 2)
    assert "registers conditions relaxed 1 step(s)" in step.notes
    regs = [next(r for r in p.levels if r.level == "registers") for p in (plain, step)]
    assert regs[1].relaxed == 1 and regs[1].need == pytest.approx(regs[0].need / 2)
    # where the layer has no whole vectors of filters, the accumulators count and halve
    odd = ConvSpec.parse("n1_c24_h14_w14_k20_r3_p1")  # 20 filters on 8 lanes
    plain, step = (prune.rules(odd, HOST, config, {"registers": s}) for s in (0, 1))
    assert plain.registers.share_min == 0 and plain.registers.acc_min == 4  # L*P / tolerance
    assert step.registers.acc_min == 2


def test_a_level_that_can_never_hold_is_dropped():
    spec = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")
    config = PruneConfig(max_relax=0)
    plan = prune.rules(spec, HOST, config, {"registers": 1})  # past max_relax: dropped
    assert plan.registers is None and "registers conditions dropped" in plan.describe()
    assert [r.level for r in plan.levels] == ["L1", "L2"]
    assert space.count_with(spec, HOST, plan) > 0


@pytest.mark.parametrize("kwargs", [dict(tolerance=0.5), dict(fma_latency=-1),
                                    dict(gpu_accumulators=(9, 4)), dict(max_relax=-1)])
def test_bad_config_names_the_value(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(MacoError, match=name):
        PruneConfig(**kwargs)


def test_every_core_gets_an_iteration_of_the_parallel_loop():
    """A batch-1 nest with parallel 0-2 fuses only n and g (one iteration): one core works. Such
    schedules measured at most 0.51x of the best on the Xeon's pruning data (8 kept before this
    rule, none near the best); the rule drops them, keeps the default, and can be turned off."""
    spec = RESNET_3X3
    s = default_schedule(spec, HOST, "NHWC")
    assert prune.parallel_iterations(s) >= HOST.cores and space.contains(s, spec, HOST, pruned=True)
    idle = replace(s, parallel=2)
    assert prune.parallel_iterations(idle) == 1
    assert any(w.startswith("parallel:") and "idle" in w for w in space.why_not(idle, spec, HOST, pruned=True))
    off = PruneConfig(busy_cores=False)
    assert space.prune_plan(spec, HOST, off).cores == 0
    plan_off = space.prune_plan(spec, HOST, off)
    assert not any(w.startswith("parallel:") for w in prune.reasons(idle, spec, HOST, plan_off))
    assert space.space_size(spec, HOST, pruned=True) < space.space_size(spec, HOST, pruned=True, config=off)
    assert all(prune.parallel_iterations(x) >= HOST.cores
               for x in space.sample_many(spec, HOST, 300, random.Random(5), pruned=True))
