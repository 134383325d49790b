"""The schedule space: exact counts against brute-force enumeration, uniform sampling (chi-square),
membership, and agreement with the CUDA backend's own validity rules."""
import random
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from itertools import permutations, product

import pytest
from scipy.stats import chisquare

from tests.targets import AVX2
from maco.space import prune, schedules as space
from maco.core.errors import MacoError
from maco.core.factors import divisors, factorizations, n_factorizations
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.schedule import LAYOUTS, UNROLL_STEPS, WEIGHT_PACKINGS, Schedule
from maco.core.sketch_cuda import GPU_BUFFERS
from maco.core import sketch_cuda
from maco.core.spec import ConvSpec
from maco.core.target import MemoryLevel, Target
from maco.space.cpu import CPU_PARALLEL

HOST = AVX2  # fixed, so that expectations do not move with the machine
H100 = Target.h100()
# A small CPU (4 lanes, 8 vector registers -> 4 free accumulators, 1 KiB L1, 8 KiB L2) so that
# the register limit and the pruning conditions bite on specs small enough to enumerate.
TINY_CPU = Target("tiny", "cpu", (MemoryLevel("registers", 8 * 4 * 4, 1, 4), MemoryLevel("L1", 1024),
                                  MemoryLevel("L2", 8192), MemoryLevel("L3", 65536, 2)),
                  cores=2, simd_width=4, isa="generic")
# A small GPU: 8 registers per thread (4 accumulators), 256 B of shared memory.
TINY_GPU = Target("tinygpu", "cuda", (MemoryLevel("registers", 8 * 4), MemoryLevel("shared", 256, 1, 32),
                                      MemoryLevel("L2", 1 << 16, 4, 32)), cores=4, simd_width=32)


def _all_factors(n, parts):
    """Ordered factorisations by trial division (independent of maco.space.schedules.factorizations)."""
    if parts == 1:
        return [(n,)]
    return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in _all_factors(n // d, parts - 1)]


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def _brute_cpu(spec, target, pruned):
    plan = space.prune_plan(spec, target)
    kept = [s for s in _valid_cpu(spec, target) if not pruned or not prune.reasons(s, spec, target, plan)]
    return _with_parallel(kept, plan.cores if pruned else 0)


def _with_parallel(points, cores):
    """Each schedule (enumerated at parallel 5, its most iterations) with every parallel value
    whose fused loops (its first p S0 factors) run at least `cores` iterations."""
    return [replace(s, parallel=p) for s in points for p in CPU_PARALLEL
            if _prod(s.spatial[i][0] for i in range(p)) >= cores]


@lru_cache(maxsize=None)
def _valid_cpu(spec, target):
    """Every valid CPU schedule at unroll 0 and parallel 5. Unroll never interacts with validity
    or pruning, so the space is the count times len(UNROLL_STEPS); parallel only with the
    busy-core rule, which fewer fused loops meet less (_with_parallel expands it); inner orders,
    layouts (alpha = 1 pairs them) and weight packings (the register rule judges filter vectors by
    them) are enumerated."""
    ext = axis_extents(spec)
    tiles = [_all_factors(ext[a], 4) for a in SPATIAL_AXES]
    reds = [_all_factors(ext[a], 2) for a in REDUCTION_AXES]
    kept = []
    for sp in product(*tiles):
        for vaxis in ("k", "ow"):
            inner = sp[SPATIAL_AXES.index(vaxis)][3]
            width = target.simd_width if inner % target.simd_width == 0 else 1
            base = Schedule("cpu", tuple(sp), ((1, ext["c"]), (1, spec.kh), (1, spec.kw)),
                            parallel=1, vector_axis=vaxis, vector_width=width)
            if base.problems(spec, target):  # validity does not depend on the reduction split
                continue
            for red in product(*reds):
                for order, layout, packing in product(permutations(REDUCTION_AXES), LAYOUTS, WEIGHT_PACKINGS):
                    s = Schedule("cpu", tuple(sp), tuple(red), parallel=len(SPATIAL_AXES), vector_axis=vaxis,
                                 vector_width=width, inner_order=order, layout=layout,
                                 weight_packing=packing)
                    assert not s.problems(spec, target)
                    kept.append(s)
    return kept


CPU_ANNOTATIONS = len(UNROLL_STEPS)


@pytest.mark.parametrize("spec,target", [
    (ConvSpec.parse("n1_c2_h4_w4_k4_r3"), HOST),
    (ConvSpec.parse("n1_c2_h4_w4_k4_r3"), TINY_CPU),
    (ConvSpec.parse("n2_c4_h5_w4_k4_r2x1_s1x2_g2"), TINY_CPU),
    (ConvSpec.parse("n1_c2_h6_w6_k8_r3_s2_p1_d2"), TINY_CPU),
])
@pytest.mark.parametrize("pruned", [False, True])
def test_cpu_count_matches_brute_force(spec, target, pruned):
    kept = _brute_cpu(spec, target, pruned)
    assert space.space_size(spec, target, pruned=pruned) == len(kept) * CPU_ANNOTATIONS
    assert kept, "the pruned space must never be empty"
    if pruned:
        assert all(s.inner_order.index("c") == (2 if s.layout == "NHWC" else 0) and s.factors("kh")[0] == 1
                   for s in kept)


def test_register_limit_bites_on_the_tiny_target():
    spec = ConvSpec.parse("n1_c2_h4_w4_k4_r3")
    ext = axis_extents(spec)
    tilings = _prod(len(_all_factors(ext[a], 4)) for a in SPATIAL_AXES) * 2
    tilings *= _prod(len(_all_factors(ext[a], 2)) for a in REDUCTION_AXES) * 6 * len(LAYOUTS)
    tilings *= len(WEIGHT_PACKINGS) * len(CPU_PARALLEL) * CPU_ANNOTATIONS
    assert space.space_size(spec, TINY_CPU) < space.space_size(spec, HOST) < tilings


def _brute_gpu(spec, target, pruned):
    points = _valid_gpu(spec, target)
    return [s for s in points if not pruned or not prune.reasons(s, spec, target, space.prune_plan(spec, target))]


@lru_cache(maxsize=None)
def _valid_gpu(spec, target):
    """Every GPU schedule with unroll/packing fixed; layout, buffers, split/stage_out and inner
    order enumerated (they change shared memory or pruning)."""
    ext = axis_extents(spec)
    tiles = [_all_factors(ext[a], 5) for a in SPATIAL_AXES]
    reds = [_all_factors(ext[a], 3) for a in REDUCTION_AXES]
    extras = [()] + [(("buffers", b),) for b in GPU_BUFFERS if b != 2]
    kept = []
    for sp in product(*tiles):
        for red in product(*reds):
            for layout in LAYOUTS:
                for ex in extras:
                    knobs = [ex, tuple(sorted(ex + (("stage_out", True),)))]
                    knobs += [tuple(sorted(ex + (("split_c", s),))) for s in (2, 4, 8, 16)
                              if red[0][1] % s == 0]
                    for knob in knobs:
                        s = Schedule("cuda", tuple(sp), tuple(red), layout=layout, extra=knob)
                        if s.problems(spec, target):
                            continue
                        for order in permutations(REDUCTION_AXES):
                            kept.append(Schedule("cuda", tuple(sp), tuple(red), layout=layout,
                                                 extra=knob, inner_order=order))
    return kept


GPU_ANNOTATIONS = len(UNROLL_STEPS) * len(WEIGHT_PACKINGS)


@pytest.mark.parametrize("spec", [ConvSpec.parse("n1_c2_h2_w2_k4_r1"), ConvSpec.parse("n1_c1_h3_w3_k2_r2")])
@pytest.mark.parametrize("pruned", [False, True])
def test_gpu_count_matches_brute_force(spec, pruned):
    kept = _brute_gpu(spec, TINY_GPU, pruned)
    assert kept
    assert space.space_size(spec, TINY_GPU, pruned=pruned) == len(kept) * GPU_ANNOTATIONS


def test_gpu_limits_bite_on_the_tiny_target():
    spec = ConvSpec.parse("n1_c2_h2_w2_k4_r1")
    big = Target("big", "cuda", (MemoryLevel("registers", 255 * 4), MemoryLevel("shared", 228 << 10, 2, 32)),
                 cores=4, simd_width=32)
    assert space.space_size(spec, TINY_GPU) < space.space_size(spec, big)


def _chi2(draws, space_points, key):
    """p-value of the draws' `key` counts against the counts a uniform draw from the enumerated
    space implies (each projected cell weighted by how many points of the space it holds)."""
    expected = Counter(key(s) for s in space_points)
    observed = Counter(key(s) for s in draws)
    assert set(observed) <= set(expected), set(observed) - set(expected)
    cells = sorted(expected, key=repr)
    total = sum(expected.values())
    f_exp = [expected[c] * len(draws) / total for c in cells]
    return chisquare([observed[c] for c in cells], f_exp).pvalue


def _tiles(s):
    return (s.spatial, s.reduction)


@pytest.mark.parametrize("target,pruned", [(TINY_CPU, False), (TINY_CPU, True), (HOST, True)])
def test_cpu_sampling_is_uniform(target, pruned):
    spec = ConvSpec.parse("n1_c2_h4_w4_k4_r3")
    points = _brute_cpu(spec, target, pruned)
    assert len(points) == len(set(points))
    draws = space.sample_many(spec, target, 4000, random.Random(7), pruned=pruned)
    assert all(space.contains(s, spec, target, pruned=pruned) for s in draws[:300])
    assert _chi2(draws, points, _tiles) > 1e-3
    assert _chi2(draws, points, lambda s: (s.vector_axis, s.inner_order, s.layout, s.weight_packing,
                                           s.factors("k")[3])) > 1e-3
    assert _chi2(draws, points, lambda s: (s.parallel, s.spatial[2][0] * s.spatial[3][0] * s.spatial[4][0])) > 1e-3
    # the annotation that the enumeration fixed is uniform and independent of the rest
    fixed = [s for s in draws if s.vector_axis == "k"]
    for name, choices in (("unroll", UNROLL_STEPS),):
        observed = Counter(getattr(s, name) for s in fixed)
        assert chisquare([observed[c] for c in choices]).pvalue > 1e-3, name


@pytest.mark.parametrize("pruned", [False, True])
def test_gpu_sampling_is_uniform(pruned):
    spec = ConvSpec.parse("n1_c1_h3_w3_k2_r2")
    points = _brute_gpu(spec, TINY_GPU, pruned)
    draws = space.sample_many(spec, TINY_GPU, 4000, 11, pruned=pruned)
    assert _chi2(draws, points, _tiles) > 1e-3
    assert _chi2(draws, points, lambda s: (s.layout, s.extra, s.inner_order)) > 1e-3
    assert _chi2(draws, points, lambda s: (sketch_cuda.threads(s), s.factors("k")[1], s.reduction[1])) > 1e-3


LAYERS = ["n1_c3_h224_w224_k64_r11_s4_p2", "n1_c64_h56_w56_k64_r3_p1", "n1_c512_h7_w7_k512_r3_p1",
          "n8_c32_h28_w28_k32_r3_p1_g32", "n1_c64_h56_w56_k256_r1", "n1_c3_h7_w5_k1_r7x5",
          "n1_c16_h9_w9_k16_r3_s2_d2_p2"]


@pytest.mark.parametrize("text", LAYERS)
@pytest.mark.parametrize("target", [HOST, H100, TINY_CPU])
def test_samples_are_valid_and_pruned_space_not_empty(text, target):
    spec = ConvSpec.parse(text)
    full, pruned = space.space_size(spec, target), space.space_size(spec, target, pruned=True)
    assert 0 < pruned < full
    rng = random.Random(3)
    for s in space.sample_many(spec, target, 30, rng, pruned=True):
        assert not s.problems(spec, target)
        assert space.contains(s, spec, target, pruned=True)
        assert Schedule.from_json(s.to_json()) == s
    for s in space.sample_many(spec, target, 30, rng):
        assert space.contains(s, spec, target) and not s.problems(spec, target)


def test_samples_agree_with_the_cuda_backend():
    codegen = pytest.importorskip("maco.kernels.cuda_codegen")
    rng = random.Random(5)
    for text in LAYERS[:4]:
        spec = ConvSpec.parse(text)
        for pruned in (False, True):
            for s in space.sample_many(spec, H100, 40, rng, pruned=pruned):
                plan = codegen.CudaPlan(spec, s)
                assert plan.problems() == []
                # the backend may pad the sketch's layout against bank conflicts, never so far
                # that an SM holds fewer blocks at once
                least = sketch_cuda.shared_bytes(s, spec)
                assert plan.smem_bytes >= least
                cap = min(codegen.SM_MAX_BLOCKS, codegen.SM_MAX_THREADS // (-(-plan.threads // 32) * 32))
                per_sm = lambda b: min(cap, codegen.SM_SHARED_BYTES // (b + 1024))  # noqa: E731
                assert per_sm(plan.smem_bytes) == per_sm(least) or not any(plan.padding)
                assert plan.threads == sketch_cuda.threads(s)


def test_contains_rejects_points_outside_the_space():
    spec = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")
    s = space.sample(spec, HOST, 1)
    assert space.contains(s, spec, HOST)
    bad_width = Schedule(**{**s.__dict__, "vector_width": 1 if s.vector_width != 1 else HOST.simd_width})
    assert not space.contains(bad_width, spec, HOST)
    assert not space.contains(Schedule(**{**s.__dict__, "extra": (("x", 1),)}), spec, HOST)
    g = space.sample(spec, H100, 2)
    explicit_default = Schedule(**{**g.__dict__, "extra": tuple(sorted(g.extra + (("stage_out", False),)))})
    if "stage_out" not in g.option and "split_c" not in g.option:
        assert not space.contains(explicit_default, spec, H100)  # one canonical form per point
    assert not space.contains(s, spec, H100)  # a CPU schedule on a GPU target


def test_exact_count_of_a_hand_computed_space():
    # 1x1 conv, one output pixel, k=1, c=1: every spatial tiling is (1,1,1,1); the reduction has
    # one split per axis; the register tile holds 1 output, so both vector axes are scalar.
    spec = ConvSpec(1, 1, 1, 1, 1, 1, 1)
    assert space.space_size(spec, HOST) == 2 * 6 * 4 * 6 * 2 * 2
    # on GPU: one tiling, 3 buffer counts x (stage_out or not), 2 layouts, 4 unrolls, 6 orders, 2 packings
    assert space.space_size(spec, H100) == 3 * 2 * 2 * 4 * 6 * 2


def test_number_theory_helpers():
    for n in (1, 2, 12, 36, 97, 360):
        for parts in (1, 2, 3, 4, 5):
            brute = _all_factors(n, parts)
            assert len(brute) == n_factorizations(n, parts)
            assert sorted(factorizations(n, parts)) == sorted(brute)
        assert list(divisors(n)) == [d for d in range(1, n + 1) if n % d == 0]


def test_bad_input_is_a_maco_error():
    spec = ConvSpec.parse("n1_c4_h4_w4_k4_r3")
    with pytest.raises(MacoError, match="ConvSpec"):
        space.space_size("n1_c4", HOST)
    with pytest.raises(MacoError, match="rng"):
        space.sample(spec, HOST, rng="seed")
    with pytest.raises(MacoError, match="n must be"):
        space.sample_many(spec, HOST, -1)
