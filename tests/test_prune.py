"""MACO pruning: the conditions on hand-computed tiles, tolerances as parameters, relaxation, and
that pruned samples really satisfy x*y ~ R*z and the fill bounds at every level."""
import random
from math import prod

import pytest

from tests.targets import AVX2
from maco import geometry
from maco import prune, space
from maco.errors import MacoError
from maco.prune import CacheRule, PruneConfig, RegisterRule
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
def test_the_bounds_optimal_tiles_pass_the_ratio_condition(text, target):
    """The I/O-optimal integer tile of maco.bounds at each level satisfies x*y ~ R*z as pruning
    checks it (one-sided where the tile spans the layer)."""
    bounds = pytest.importorskip("maco.bounds")
    if not hasattr(bounds, "optimal_tile"):
        pytest.skip("maco.bounds.optimal_tile not built yet")
    spec = ConvSpec.parse(text)
    plan = space.prune_plan(spec, target)
    for rule in plan.caches:
        level = target.level(rule.level)
        t = bounds.optimal_tile(spec, level.elements, level.processors)
        why = rule.why(spec, plan.reuse, dict(n=1, g=1, k=t.z, oh=t.y, ow=t.x))
        assert not [w for w in why if "x*y/(R*z)" in w], (rule.level, str(t), why)


def test_cache_rule_by_hand():
    spec = RESNET_3X3
    rule = CacheRule("L1", "S2", capacity=8192, floor=2048, tolerance=2.0)
    # x*y = 8*14 = 112, R*z = 9*16 = 144: ratio 0.78 within [0.5, 2]; footprint 1792+160*... in range
    fp = geometry.footprint(spec, 8, 14, 16, images=1, groups=1)
    assert 2048 <= fp <= 8192 and rule.ok(spec, 9.0, 1, 1, 16, 14, 8)
    assert not rule.ok(spec, 9.0, 1, 1, 32, 14, 8)  # ratio 112/288 < 1/2
    # one-sided where the tile spans the layer: all 64 filters may take x*y > 2*R*z ...
    wide = CacheRule("L2", "S1", capacity=131072, floor=0, tolerance=2.0)
    assert wide.ok(spec, 9.0, 1, 1, 64, 28, 56) and not wide.ok(spec, 9.0, 1, 1, 32, 28, 56)
    # ... and a tile of every output pixel may take x*y < R*z/2
    small = ConvSpec.parse("n1_c64_h7_w7_k512_r3_p1")
    assert wide.ok(small, 9.0, 1, 1, 128, 7, 7) and not wide.ok(small, 9.0, 1, 1, 128, 7, 1)
    assert not rule.ok(spec, 9.0, 1, 1, 2, 4, 4)  # ratio fine (16/18) but footprint far below the floor
    assert rule.why(spec, 9.0, dict(n=1, g=1, k=64, oh=14, ow=8))[0].startswith("L1: S2 tile has x*y/(R*z)")
    regs = RegisterRule(6, 12, warp=32)
    assert regs.ok(6) and regs.ok(12) and not regs.ok(5) and not regs.ok(13)
    assert regs.ok(8, 64) and not regs.ok(8, 48)


def _levels_hold(s: Schedule, spec: ConvSpec, target: Target, plan) -> None:
    """Recompute every condition of the plan by hand for one schedule."""
    r = plan.reuse
    if s.kind == "cpu":
        tiles = {"S2": {a: s.tile(a, 2) for a in SPATIAL_AXES}, "S1": {a: s.tile(a, 1) for a in SPATIAL_AXES}}
        acc = s.accumulators
    else:
        tiles = {"block": s.gpu_block_tile()}
        acc = prod(s.gpu_thread_tile().values())
        if plan.registers.warp:
            assert s.gpu_threads % 32 == 0
    assert plan.registers.acc_min <= acc <= plan.registers.acc_max
    for rule in plan.caches:
        t = tiles[rule.tile]
        ratio = t["n"] * t["oh"] * t["ow"] / (r * t["k"])
        all_pixels = t["n"] * t["oh"] * t["ow"] == spec.n * spec.out_h * spec.out_w
        all_filters = t["k"] == spec.k_per_group
        assert 1 / rule.tolerance <= ratio or all_pixels
        assert ratio <= rule.tolerance or all_filters
        ih = (t["oh"] - 1) * spec.stride[0] + (spec.kh - 1) * spec.dilation[0] + 1
        iw = (t["ow"] - 1) * spec.stride[1] + (spec.kw - 1) * spec.dilation[1] + 1
        fp = t["g"] * (t["n"] * t["k"] * t["oh"] * t["ow"] + t["n"] * ih * iw + t["k"] * spec.kh * spec.kw)
        assert rule.floor <= fp <= rule.capacity
    assert s.factors("kh")[0] == 1 and s.factors("kw")[0] == 1
    # alpha = 1 in the layout's unit: c innermost in CPU NHWC, else outermost
    assert s.inner_order.index("c") == (2 if (s.kind, s.layout) == ("cpu", "NHWC") else 0)


@pytest.mark.parametrize("target", [HOST, H100])
def test_pruned_samples_meet_every_condition(target):
    spec = RESNET_3X3
    plan = space.prune_plan(spec, target)
    assert not plan.relaxed  # the paper's default tolerances are satisfiable on this layer
    names = {c.level for c in plan.caches}
    assert names == ({"L1", "L2"} if target.kind == "cpu" else {"shared"})
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
    sizes = [space.space_size(RESNET_3X3, HOST, pruned=True, config=PruneConfig(tolerance=t))
             for t in (1.5, 2.0, 4.0, 16.0)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    loose = PruneConfig(fill_low=0.0, register_fill=0.0, tolerance=1e9, alpha_one=False)
    # with every condition wide open, pruning keeps all but the cache capacity limits
    assert space.space_size(RESNET_3X3, HOST, pruned=True, config=loose) < space.space_size(RESNET_3X3, HOST)
    fills = [space.space_size(RESNET_3X3, HOST, pruned=True, config=PruneConfig(fill_low=f))
             for f in (0.5, 0.25, 0.0)]
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
    strict = PruneConfig(tolerance=1.0, fill_low=1.0, register_fill=1.0, gpu_accumulators=(64, 64),
                         max_relax=2)
    assert space.space_size(spec, target, pruned=True, config=strict) > 0
    s = space.sample(spec, target, 0, pruned=True, config=strict)
    assert space.contains(s, spec, target, pruned=True, config=strict)


def test_relaxation_widens_by_documented_steps():
    # x*y = 9*z exactly is impossible with divisors of 56 (no factor 3): L1 must widen once to 2
    plan = space.prune_plan(RESNET_3X3, HOST, PruneConfig(tolerance=1.0))
    l1 = next(rule for rule in plan.caches if rule.level == "L1")
    assert l1.relaxed == 1 and l1.tolerance == pytest.approx(2.0) and l1.capacity == 2 * 8192
    assert "L1 conditions relaxed 1 step(s)" in plan.notes
    # 12 accumulators exactly is impossible on 7x7x512 (no factor 3): the register floor halves
    spec = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")
    plan = space.prune_plan(spec, HOST, PruneConfig(register_fill=1.0))
    assert plan.registers.relaxed == 1 and plan.registers.acc_min == 6
    # and with the default tolerances these layers need no relaxation at all
    assert not space.prune_plan(spec, HOST).relaxed and not space.prune_plan(RESNET_3X3, HOST).relaxed


def test_a_level_that_can_never_hold_is_dropped():
    # an 11x11 window's weights alone overflow a 1 KiB L1 share: every tile fails that level
    tiny = Target("tiny", "cpu", (HOST.level("registers"), MemoryLevel("L1", 256), MemoryLevel("L2", 1 << 20)),
                  cores=1, simd_width=HOST.simd_width)
    spec = ConvSpec.parse("n1_c3_h64_w64_k64_r11_s4_p2")
    plan = space.prune_plan(spec, tiny, PruneConfig(max_relax=1))
    assert [c.level for c in plan.caches] == ["L2"] and "L1 conditions dropped" in plan.describe()
    assert space.space_size(spec, tiny, pruned=True, config=PruneConfig(max_relax=1)) > 0


@pytest.mark.parametrize("kwargs", [dict(tolerance=0.5), dict(fill_low=1.5), dict(register_fill=-1),
                                    dict(gpu_accumulators=(9, 4)), dict(max_relax=-1)])
def test_bad_config_names_the_value(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(MacoError, match=name):
        PruneConfig(**kwargs)
