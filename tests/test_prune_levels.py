"""The level conditions of MACO pruning (maco.space.prune, derived in maco.bounds.hierarchy): exact counts
and uniform draws where they bite (against brute force), and that the bound-derived default
schedules of every distinct conv of the five networks stay in the pruned space."""
import math
import random
from dataclasses import replace
from functools import lru_cache

import pytest

from maco.space import prune, schedules as space
from maco.kernels import default_schedule
from maco.core.spec import ConvSpec
from maco.core.target import MemoryLevel, Target
from tests.targets import AVX2, GENERIC
from tests.test_space import CPU_ANNOTATIONS, _chi2, _tiles, _valid_cpu, _with_parallel

# A small CPU with 8 FMA pipes: its balance (8 MACs per element into registers, 4 into L1, 8 into
# L2) makes the level rules bite on layers small enough to enumerate.
BITE = Target("bite", "cpu", (MemoryLevel("registers", 8 * 4 * 4, 1, 4), MemoryLevel("L1", 512),
                              MemoryLevel("L2", 4096), MemoryLevel("L3", 65536, 2)),
              cores=2, simd_width=4, isa="generic", fma_units=16)
SMALL = ["n1_c8_h2_w4_k4_r1", "n1_c4_h6_w6_k8_r3_s2_p1", "n1_c8_h3_w3_k8_r1"]


def _brute(spec, target, plan):
    return _with_parallel([s for s in _valid_cpu(spec, target) if not prune.reasons(s, spec, target, plan)],
                          plan.cores)


@pytest.mark.parametrize("text", SMALL)
def test_count_matches_brute_force_where_the_levels_bite(text):
    spec = ConvSpec.parse(text)
    config = prune.PruneConfig(min_macs_per_core=0)  # layers this small are otherwise exempt from the busy-core rule
    plan = space.prune_plan(spec, BITE, config)
    assert not plan.relaxed
    without = replace(plan, levels=())
    assert space.count_with(spec, BITE, plan) < space.count_with(spec, BITE, without)  # they bite
    kept = _brute(spec, BITE, plan)
    assert kept and space.space_size(spec, BITE, pruned=True, config=config) == len(kept) * CPU_ANNOTATIONS
    # and each level alone counts exactly too, and the busy-core rule alone
    for rule in plan.levels:
        alone = replace(without, levels=(rule,))
        assert space.count_with(spec, BITE, alone) == len(_brute(spec, BITE, alone)) * CPU_ANNOTATIONS
    busy = replace(plan, registers=None, levels=(), alpha_one=False)
    assert busy.cores == BITE.cores
    assert space.count_with(spec, BITE, busy) == len(_brute(spec, BITE, busy)) * CPU_ANNOTATIONS
    assert space.count_with(spec, BITE, busy) < space.count_with(spec, BITE, replace(busy, cores=0))


def test_pruning_recall_judges_each_rule_alone():
    from maco.experiments.pruning_recall import ALL, BUSY, rule_plans

    spec = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")
    plans = rule_plans(spec, AVX2)
    assert plans[BUSY].cores == AVX2.cores and not plans[BUSY].levels and plans[BUSY].registers is None
    assert all(p.cores == 0 for name, p in plans.items() if name not in (BUSY, ALL) and "MACO" not in name)
    assert plans[ALL].cores == AVX2.cores


def test_sampling_is_uniform_where_the_levels_bite():
    spec = ConvSpec.parse(SMALL[0])
    points = _brute(spec, BITE, space.prune_plan(spec, BITE))
    draws = space.sample_many(spec, BITE, 4000, random.Random(5), pruned=True)
    assert all(space.contains(s, spec, BITE, pruned=True) for s in draws[:300])
    assert _chi2(draws, points, _tiles) > 1e-3
    assert _chi2(draws, points, lambda s: (s.factors("c")[1], s.layout, s.vector_axis)) > 1e-3


FIVE = ("resnet18", "alexnet", "vgg11", "resnet50", "mobilenet_v2")  # the networks these checks were made on
MODERN = ("efficientnet_b0", "mobilenet_v3_large", "convnext_tiny")


@lru_cache(maxsize=None)
def _network_convs(nets: tuple[str, ...] = FIVE):
    from maco.layouts.networks import distinct_convs, network_convs

    seen = {}
    for net in nets:
        for spec, names in distinct_convs(network_convs(net)):
            seen.setdefault(spec, f"{net}.{names[0]}")
    return list(seen.items())


def test_the_cpu_defaults_of_the_modern_networks_are_in_the_pruned_space():
    """Their SE convs on 1x1 inputs run one core (too little work to split): the busy-core rule
    leaves them free (prune.MIN_MACS_PER_CORE)."""
    dropped = [(name, layout, why) for spec, name in _network_convs(MODERN) for layout in ("NCHW", "NHWC")
               for why in [space.why_not(default_schedule(spec, AVX2, layout), spec, AVX2, pruned=True)] if why]
    assert not dropped, dropped[:3]


def test_the_busy_core_rule_holds_where_a_layer_has_the_work():
    spec = ConvSpec.parse("n1_c1152_h1_w1_k48_r1x1")  # EfficientNet-B0's last SE conv: 55k MACs
    assert spec.macs < AVX2.cores * prune.MIN_MACS_PER_CORE <= ConvSpec.parse("n1_c1152_h2_w1_k48_r1x1").macs
    assert not space.why_not(default_schedule(spec, AVX2), spec, AVX2, pruned=True)
    bigger = ConvSpec.parse("n1_c1152_h2_w1_k48_r1x1")
    serial = replace(default_schedule(bigger, AVX2), parallel=0)
    assert "cores sit idle" in " ".join(space.why_not(serial, bigger, AVX2, pruned=True))


def test_the_gpu_defaults_of_the_modern_networks_are_in_the_pruned_space():
    """The SE convs on 1x1 inputs have fewer than 64 outputs (a block holds all of them), and
    EfficientNet's NHWC depthwise 5x5 takes the model's best block the shared level keeps."""
    from maco.kernels.cuda_schedule import default_schedule as gpu_default

    h100 = Target.h100()
    for spec, name in _network_convs(MODERN):
        for layout in ("NCHW", "NHWC"):
            assert not space.why_not(gpu_default(spec, h100, layout), spec, h100, pruned=True), name


@pytest.mark.parametrize("target", [AVX2, GENERIC, Target.named("host")], ids=lambda t: t.name)
def test_the_cpu_defaults_are_in_the_pruned_space(target):
    """Every distinct conv of resnet18, alexnet, vgg11, resnet50 and mobilenet_v2, both layouts."""
    convs = _network_convs()
    assert len(convs) > 60
    dropped = [(name, layout, why) for spec, name in convs for layout in ("NCHW", "NHWC")
               for why in [space.why_not(default_schedule(spec, target, layout), spec, target, pruned=True)] if why]
    assert not dropped, dropped[:3]


def test_the_gpu_defaults_are_in_the_pruned_space():
    from maco.kernels.cuda_schedule import default_schedule as gpu_default

    h100 = Target.h100()
    dropped = [(name, layout, why) for spec, name in _network_convs() for layout in ("NCHW", "NHWC")
               for why in [space.why_not(gpu_default(spec, h100, layout), spec, h100, pruned=True)] if why]
    assert not dropped, dropped[:3]


@pytest.mark.parametrize("target", [AVX2, Target.named("host")], ids=lambda t: t.name)
def test_the_pruned_space_is_a_hundredth_or_less(target):
    """full / pruned >= 100 (geomean over the distinct convs of the five networks), as the issue
    asked (its recall of 0.9 of the measured top 5% cannot come with it: a space keeping 90% of the
    top 5% holds >= 4.5% of it, <= 22x; experiments/pruning_recall.py reports recall within 20% of
    the best instead). The register rule charging unpacked filter vectors lane by lane and the
    busy-core rule brought it from ~80x to ~250x (AVX2) and ~330x (AVX-512 Xeon)."""
    if target.simd_width < 8:
        pytest.skip(f"{target.name} has {target.simd_width} lanes: fewer register tiles to choose from")
    logs = [math.log(space.space_size(spec, target) / space.space_size(spec, target, pruned=True))
            for spec, _ in _network_convs()]
    assert math.exp(sum(logs) / len(logs)) >= 100
