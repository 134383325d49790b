"""CPU kernel generator: every flavour (AVX-512, AVX2, portable) against torch's conv2d, default
and random schedules, the epilogue, the array plumbing, errors, the build cache and `maco bench`."""
from __future__ import annotations

import dataclasses
import random
import re
import shutil

import numpy as np
import pytest
import torch

from maco import ConvSpec, MacoError, MemoryLevel, Schedule, Target, kernels
from maco.space.schedules import sample
from tests.busy import holds_unless_busy
from tests.targets import AVX2, GENERIC

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HOST = Target.host()
AVX512 = Target("avx512-test", "cpu", (MemoryLevel("registers", 32 * 16 * 4, 1, 16),
                                       MemoryLevel("L1", 48 << 10, 1, 16), MemoryLevel("L2", 2 << 20, 1, 16)),
                cores=2, simd_width=16, isa="avx512")
needs_avx2 = pytest.mark.skipif(HOST.isa not in ("avx2", "avx512"), reason="host has no AVX2+FMA")
needs_avx512 = pytest.mark.skipif(HOST.isa != "avx512", reason="host has no AVX-512")

SPECS = [
    "n1_c16_h9_w9_k32_r3x3_p1",            # k path, odd size
    "n2_c8_h7_w11_k16_r3x3_s2_p1",         # batch 2, stride 2, non-square
    "n1_c6_h10_w10_k6_r3x3_p1_g3",         # groups 3
    "n1_c16_h12_w12_k16_r3x3_p1_g16",      # depthwise
    "n1_c3_h27_w27_k16_r11x11_s4_p2",      # 11x11, stride 4
    "n1_c8_h13_w12_k16_r5x5_p3_d2",        # dilation 2, padding 3
    "n8_c16_h6_w6_k32_r1x1",               # 1x1, batch 8
    "n1_c8_h9_w14_k16_r1x7_p0x3",          # non-square kernel
    "n1_c8_h8_w32_k8_r3x3_p1",             # few filters: the ow path
    "n1_c16_h10_w10_k32_r2x2_s2",          # 2x2 stride 2, no padding
]


def reference(spec: ConvSpec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.input_shape, generator=g)
    w = torch.randn(spec.weight_shape, generator=g)
    b = torch.randn(spec.k, generator=g)
    r = torch.randn(spec.output_shape, generator=g)
    y = torch.nn.functional.conv2d(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)
    return x, w, b, r, torch.relu(y + r), torch.nn.functional.conv2d(
        x, w, None, spec.stride, spec.padding, spec.dilation, spec.groups)


def run_kernel(kernel, spec: ConvSpec, data, epilogue: bool) -> float:
    """Relative max error of the kernel on torch tensors in its layout."""
    x, w, b, r, ref_epi, ref = data
    fmt = torch.channels_last if kernel.layout == "NHWC" else torch.contiguous_format
    if epilogue:
        y = kernel.bind(w, b)(x.contiguous(memory_format=fmt), r.contiguous(memory_format=fmt))
        want = ref_epi
    else:
        y = kernel.bind(w)(x.contiguous(memory_format=fmt))
        want = ref
    assert y.is_contiguous(memory_format=fmt)
    return float((y - want).abs().max()) / float(want.abs().max())


def check_batch(spec: ConvSpec, schedules: list[Schedule], target: Target, epilogue: bool) -> None:
    flags = dict(bias=True, relu=True, residual=True) if epilogue else {}
    built = kernels.build_many(spec, schedules, target, **flags)
    data = reference(spec)
    for schedule, kernel in zip(schedules, built):
        assert not isinstance(kernel, Exception), f"{schedule.to_json()}: {kernel}"
        err = run_kernel(kernel, spec, data, epilogue)
        assert err < 1e-4, f"{spec} {kernel.flavour} {schedule.to_json()}: error {err:.3g}"


# -- default schedules ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", SPECS)
def test_default_schedules_match_torch(text):
    spec = ConvSpec.parse(text)
    schedules = [kernels.default_schedule(spec, HOST, layout) for layout in ("NCHW", "NHWC")]
    for s in schedules:
        assert s.problems(spec, HOST) == []
    check_batch(spec, schedules, HOST, epilogue=text.endswith("p1"))


def test_default_schedule_uses_the_fast_path_and_both_cores():
    spec = ConvSpec.parse("n1_c64_h56_w56_k64_r3x3_p1")
    for target in (AVX2, AVX512):
        for layout in ("NCHW", "NHWC"):
            s = kernels.default_schedule(spec, target, layout)
            k = kernels.api.resolve_target(target)
            from maco.kernels.cpu_codegen import CpuPlan
            plan = CpuPlan(spec, s, k)
            assert plan.intrinsics == target.isa
            assert s.vector_axis in ("k", "ow") and s.vector_width == target.simd_width
            assert s.accumulators >= 8  # enough independent FMA chains
            fused = np.prod([f[0] for f in s.spatial[:s.parallel]])
            assert s.parallel > 0 and fused % target.cores == 0


def test_default_register_tile_reads_the_smallest_input_window():
    """Equal-scoring register tiles: a 3x3 conv takes 2 rows x 7 columns (a 4x9 input window)
    over 1 x 14 (3x16); a 1x1 stride-2 conv reads the same inputs either way and keeps the row."""
    for text, rows in (("n1_c64_h56_w56_k64_r3x3_p1", 2), ("n1_c64_h56_w56_k128_r1x1_s2", 1)):
        spec = ConvSpec.parse(text)
        tile = kernels.default_schedule(spec, AVX512, "NHWC").register_tile()
        assert tile["oh"] == rows and tile["oh"] * tile["ow"] * tile["k"] // 16 == 28, (text, tile)


def test_default_register_tile_of_a_pointwise_conv_takes_the_fewest_loads():
    """A 1x1 conv reads one input per output whatever the tile: of the 28-accumulator tiles,
    7 pixels x 4 filter vectors (11 loads a step) over 14 x 2 (16 loads)."""
    for text in ("n1_c1024_h14_w14_k256_r1x1", "n1_c64_h56_w56_k256_r1x1"):
        spec = ConvSpec.parse(text)
        for layout in ("NHWC", "NCHW"):
            tile = kernels.default_schedule(spec, AVX512, layout).register_tile()
            assert (tile["oh"] * tile["ow"], tile["k"]) == (7, 64), (text, layout, tile)


@pytest.mark.parametrize("text", ["n1_c7_h13_w17_k11_r3x3_p1", "n1_c5_h11_w11_k13_r5x5_s2_p2",
                                  "n3_c4_h5_w5_k2_r3x3_p2_d2"])
def test_default_schedule_valid_on_primes(text):
    spec = ConvSpec.parse(text)
    for target in (HOST, AVX2, GENERIC):
        for layout in ("NCHW", "NHWC"):
            assert kernels.default_schedule(spec, target, layout).problems(spec, target) == []


# -- random schedules of the (pruned) space, every flavour -------------------------------------
RANDOM_SPECS = ["n1_c16_h9_w9_k32_r3x3_p1", "n2_c8_h8_w8_k16_r3x3_s2_p1", "n1_c8_h10_w16_k16_r5x5_p2_d2",
                "n1_c8_h8_w8_k8_r3x3_p1_g2"]


@pytest.mark.parametrize("text", RANDOM_SPECS)
def test_random_schedules_match_torch(text):
    spec = ConvSpec.parse(text)
    rng = random.Random(1234)
    schedules = [sample(spec, HOST, rng) for _ in range(6)] + [sample(spec, HOST, rng, pruned=True)
                                                              for _ in range(4)]
    assert len({s.to_json() for s in schedules}) > 5
    check_batch(spec, schedules, HOST, epilogue=True)


@needs_avx2
def test_avx2_path_on_any_x86_host():
    spec = ConvSpec.parse("n1_c8_h9_w16_k16_r3x3_p1")
    rng = random.Random(7)
    schedules = [kernels.default_schedule(spec, AVX2, layout) for layout in ("NCHW", "NHWC")]
    schedules += [sample(spec, AVX2, rng, pruned=True) for _ in range(6)]
    ow = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (2, 1, 2, 4), (3, 1, 3, 1), (1, 1, 1, 16)),
                  ((2, 4), (1, 3), (3, 1)), parallel=4, vector_axis="ow", vector_width=8,
                  layout="NCHW", weight_packing="none")
    schedules.append(ow)
    from maco.kernels.cpu_codegen import CpuPlan
    flavours = {CpuPlan(spec, s, AVX2).intrinsics for s in schedules}
    assert "avx2" in flavours
    check_batch(spec, schedules, AVX2, epilogue=True)
    assert "__m256" in kernels.build_many(spec, [ow], AVX2)[0].source



def test_blocked_weights_are_prefetched_ahead_of_the_stream():
    """Inside a model a layer's weights come from memory: the intrinsics micro-kernel prefetches
    its blocked weights (one contiguous stream) a fixed distance ahead, a line per k3 / 16 floats,
    and nothing where the weights are in torch's order (no single stream to run ahead of)."""
    from maco.kernels.cpu_codegen import WEIGHT_PREFETCH_AHEAD, CpuPlan
    spec = ConvSpec.parse("n1_c32_h8_w8_k32_r3x3_p1")
    blocked = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 32), (2, 1, 4, 1), (1, 1, 4, 2)),
                       ((1, 32), (1, 3), (1, 3)), parallel=2, vector_axis="k", vector_width=8,
                       layout="NHWC", weight_packing="blocked")
    plan = CpuPlan(spec, blocked, AVX2)
    assert plan.intrinsics == "avx2"
    lines = re.findall(r"_mm_prefetch\(\(const char \*\)\(wq \+ (\d+)\)", plan.source)
    assert [int(x) for x in lines] == [WEIGHT_PREFETCH_AHEAD, WEIGHT_PREFETCH_AHEAD + 16]
    torch_order = dataclasses.replace(blocked, vector_axis="ow", layout="NCHW", weight_packing="none",
                                      spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 4, 8), (2, 1, 4, 1),
                                               (1, 1, 1, 8)))
    plan = CpuPlan(spec, torch_order, AVX2)
    assert plan.intrinsics == "avx2" and "_mm_prefetch" not in plan.source
    check_batch(spec, [blocked, torch_order], AVX2, epilogue=True)

@needs_avx512
def test_avx512_path():
    spec = ConvSpec.parse("n1_c16_h9_w16_k32_r3x3_s1_p1")
    rng = random.Random(8)
    schedules = [kernels.default_schedule(spec, AVX512, layout) for layout in ("NCHW", "NHWC")]
    schedules += [sample(spec, AVX512, rng, pruned=True) for _ in range(4)]
    ow = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (4, 1, 2, 4), (3, 1, 1, 3), (1, 1, 1, 16)),
                  ((4, 4), (3, 1), (1, 3)), parallel=3, vector_axis="ow", vector_width=16,
                  layout="NCHW", weight_packing="blocked", unroll=16)
    schedules.append(ow)
    kern = kernels.build_many(spec, [ow], AVX512)[0]
    assert kern.flavour == "avx512" and "__m512" in kern.source
    check_batch(spec, schedules, AVX512, epilogue=True)


@pytest.mark.parametrize("text", ["n1_c96_h14_w14_k24_r1x1", "n1_c48_h7_w7_k40_r1x1",
                                  "n1_c16_h9_w9_k24_r3x3_p1", "n1_c24_h10_w12_k40_r3x3_s2_p1"])
def test_filters_in_half_vectors_run_avx2_intrinsics_on_avx512(text):
    """24 or 40 filters are no whole number of AVX-512's 16 lanes: the default schedule takes AVX2's
    8-lane vectors, which the same CPU runs (sketch_cpu.vector_widths), in either layout, and the
    space can draw them (a register tile of 8 or 24 filters); every output equals torch's,
    epilogue included."""
    spec = ConvSpec.parse(text)
    rng = random.Random(3)
    schedules = [kernels.default_schedule(spec, AVX512, layout) for layout in ("NCHW", "NHWC")]
    for s in schedules:
        assert (s.vector_axis, s.vector_width) == ("k", 8) and s.problems(spec, AVX512) == []
    drawn = [sample(spec, AVX512, rng) for _ in range(200)]
    halves = [s for s in drawn if s.vector_width == 8]
    assert halves and all(s.problems(spec, AVX512) == [] for s in drawn)
    assert all(s.factors(s.vector_axis)[-1] % 8 == 0 for s in halves)
    built = kernels.build_many(spec, schedules[:1], AVX512)
    assert built[0].flavour == "avx2" and "__m256" in built[0].source and "__m512" not in built[0].source
    if HOST.isa == "avx512":
        check_batch(spec, schedules + halves[:3], AVX512, epilogue=True)
    on_avx2 = kernels.default_schedule(spec, AVX2, "NHWC")
    assert on_avx2.vector_width == 8 and kernels.build_many(spec, [on_avx2], AVX2)[0].flavour == "avx2"
    assert "vector_width must be one of (8, 1)" in "; ".join(
        Schedule.from_dict({**on_avx2.to_dict(), "vector_width": 4}).problems(spec, AVX2))


def portable_schedules() -> tuple[ConvSpec, list[Schedule]]:
    """A grouped conv and schedules of every vector axis (n, g, oh never run intrinsics), width 1."""
    spec = ConvSpec.parse("n4_c8_h8_w12_k8_r3x3_p1_g4")  # 4 groups of 2 channels / 2 filters
    sp = lambda n, g, k, oh, ow: tuple(tuple(f) for f in (n, g, k, oh, ow))  # noqa: E731
    red = ((2, 1), (1, 3), (3, 1))
    schedules = [
        Schedule("cpu", sp((1, 1, 1, 4), (1, 1, 1, 4), (2, 1, 1, 1), (4, 1, 2, 1), (3, 2, 1, 2)), red,
                 parallel=3, vector_axis="n", vector_width=4, layout="NCHW", weight_packing="blocked"),
        Schedule("cpu", sp((2, 1, 1, 2), (1, 1, 1, 4), (1, 1, 2, 1), (2, 2, 1, 2), (6, 1, 1, 2)), red,
                 parallel=1, vector_axis="g", vector_width=4, layout="NHWC", weight_packing="none",
                 inner_order=("kw", "c", "kh")),
        Schedule("cpu", sp((4, 1, 1, 1), (1, 2, 1, 2), (1, 1, 1, 2), (1, 2, 1, 4), (2, 2, 3, 1)), red,
                 parallel=0, vector_axis="oh", vector_width=4, layout="NCHW", weight_packing="blocked",
                 unroll=64),
        Schedule("cpu", sp((1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 2, 1), (2, 2, 1, 2), (3, 1, 1, 4)), red,
                 parallel=5, vector_axis="ow", vector_width=4, layout="NHWC", weight_packing="blocked",
                 unroll=512),
        Schedule("cpu", sp((1, 1, 4, 1), (2, 1, 2, 1), (1, 1, 1, 2), (1, 1, 4, 2), (2, 1, 2, 3)),
                 ((1, 2), (3, 1), (1, 3)), parallel=2, vector_axis="k", vector_width=1, layout="NCHW",
                 weight_packing="none"),
    ]
    return spec, schedules


def test_portable_path_every_vector_axis():
    """Every vector axis, width 1, isa generic: the portable C."""
    spec, schedules = portable_schedules()
    for s in schedules:
        assert s.problems(spec, GENERIC) == [], s.problems(spec, GENERIC)
    kerns = kernels.build_many(spec, schedules, GENERIC)
    assert all(not isinstance(k, Exception) and k.flavour == "portable" for k in kerns), kerns
    check_batch(spec, schedules, GENERIC, epilogue=True)


def test_partial_sums_across_r0_steps():
    """R0 > 1 on c, kh and kw: partial sums go through the output, epilogue only at the end."""
    spec = ConvSpec.parse("n1_c16_h9_w9_k32_r3x3_p1")
    s = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 16),
                         (3, 1, 3, 1), (1, 3, 1, 3)), ((4, 4), (3, 1), (3, 1)), parallel=4,
                 vector_axis="k", vector_width=HOST.simd_width if HOST.isa != "generic" else 1,
                 layout="NHWC")
    assert s.problems(spec, HOST) == [], s.problems(spec, HOST)
    check_batch(spec, [s, dataclasses.replace(s, layout="NCHW")], HOST, epilogue=True)


@needs_avx2
@pytest.mark.parametrize("l2", [2 << 20, 8 << 10])
def test_border_register_tiles_share_a_patch_of_their_s2_window(l2):
    """Filter blocks outside the positions (S2 = k blocks x rows x columns, R0 = c, kh and kw
    chunks): each R0 step's window patch is built once and serves every border register tile in
    it; with a small L2 each register tile gets its own patch. Batch and groups inside S2; both
    layouts match torch."""
    target = dataclasses.replace(HOST, levels=tuple(
        dataclasses.replace(lvl, capacity=l2) if lvl.name == "L2" else lvl for lvl in HOST.levels))
    spec = ConvSpec.parse("n2_c16_h9_w10_k64_r3x3_p2_d2_g2")
    width = HOST.simd_width
    s = Schedule("cpu", ((1, 1, 2, 1), (1, 1, 2, 1), (1, 1, 32 // width, width), (3, 1, 3, 1), (1, 1, 2, 5)),
                 ((2, 4), (3, 1), (1, 3)), parallel=4, vector_axis="k", vector_width=width, layout="NHWC")
    assert s.problems(spec, target) == [], s.problems(spec, target)
    from maco.kernels.cpu_codegen import CpuPlan
    plan = CpuPlan(spec, s, target)
    assert (plan.patch_level, plan.patch_slots) == ((2, 6) if l2 > 1 << 20 else (3, 1))
    check_batch(spec, [s, dataclasses.replace(s, layout="NCHW")], target, epilogue=True)


def test_unrolled_intrinsics_bodies_stay_small_enough_to_build():
    """unroll 512 fully unrolled a 144-step reduction of 28 accumulators (4032 FMAs): gcc took
    up to 160 s, past the tuner's 30 s build limit. The unrolled body is capped."""
    import re

    from maco.kernels.cpu_codegen import CpuPlan

    spec = ConvSpec.parse("n1_c64_h56_w56_k64_r3x3_p1")
    s = Schedule("cpu", ((1, 1, 1, 1), (1, 1, 1, 1), (1, 4, 1, 16), (2, 2, 7, 2), (1, 4, 1, 14)),
                 ((4, 16), (1, 3), (1, 3)), parallel=5, vector_axis="k", vector_width=16, unroll=512)
    plan = CpuPlan(spec, s, AVX512)
    assert plan.intrinsics == "avx512" and s.accumulators == 28
    unrolled = np.prod([int(n) for n in re.findall(r"#pragma GCC unroll (\d+)", plan.source)])
    assert 1 < unrolled * 28 <= 1024  # such bodies build in 1-3 s


# -- plumbing and errors ------------------------------------------------------------------------------
def test_numpy_in_numpy_out_torch_in_torch_out():
    spec = ConvSpec.parse("n1_c8_h6_w7_k16_r3x3_p1")
    x, w, _, _, _, ref = reference(spec)
    for layout in ("NCHW", "NHWC"):
        conv = kernels.compile(spec, kernels.default_schedule(spec, None, layout)).bind(w.numpy())
        xn = x.numpy() if layout == "NCHW" else np.ascontiguousarray(x.numpy().transpose(0, 2, 3, 1))
        yn = conv(xn)
        assert isinstance(yn, np.ndarray) and yn.dtype == np.float32
        want = ref.numpy() if layout == "NCHW" else ref.numpy().transpose(0, 2, 3, 1)
        np.testing.assert_allclose(yn, want, rtol=1e-4, atol=1e-4)
        yt = conv(x)  # a contiguous NCHW tensor is converted once for an NHWC kernel
        assert isinstance(yt, torch.Tensor) and tuple(yt.shape) == spec.output_shape
        torch.testing.assert_close(yt, ref, rtol=1e-4, atol=1e-4)
        out = torch.empty_like(ref, memory_format=torch.channels_last if layout == "NHWC"
                               else torch.contiguous_format)
        fn = conv.prepare(x, out=out)
        out.zero_()
        assert fn() is None
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_errors_name_the_bad_value():
    spec = ConvSpec.parse("n1_c8_h6_w7_k16_r3x3_p1")
    good = kernels.default_schedule(spec, None, "NCHW")
    bad = dataclasses.replace(good, spatial=((1, 1, 1, 1),) + good.spatial[1:-1] + ((1, 1, 1, 6),))
    with pytest.raises(MacoError, match="axis ow: factors"):
        kernels.compile(spec, bad)
    with pytest.raises(MacoError, match="vector_width"):
        kernels.compile(spec, dataclasses.replace(good, vector_width=3))
    conv = kernels.compile(spec, good).bind(torch.randn(spec.weight_shape))
    with pytest.raises(MacoError, match=r"input has shape \(1, 8, 6, 6\)"):
        conv(np.zeros((1, 8, 6, 6), np.float32))
    with pytest.raises(MacoError, match="float32, got float64"):
        conv(np.zeros(spec.input_shape))
    with pytest.raises(MacoError, match="weight has shape"):
        kernels.compile(spec, good).bind(torch.randn(16, 8, 3, 2))
    with pytest.raises(MacoError, match="bias=False"):
        kernels.compile(spec, good).bind(torch.randn(spec.weight_shape), torch.randn(16))
    with pytest.raises(MacoError, match="bias=True but bind\\(\\) got no bias"):
        kernels.compile(spec, good, bias=True).bind(torch.randn(spec.weight_shape))
    with pytest.raises(MacoError, match=r"bias has shape \(15,\), expected \(16,\)"):
        kernels.compile(spec, good, bias=True).bind(torch.randn(spec.weight_shape), torch.randn(15))
    with pytest.raises(MacoError, match="residual=False"):
        conv(torch.randn(spec.input_shape), residual=torch.randn(spec.output_shape))
    with pytest.raises(MacoError, match="out must be contiguous NCHW"):
        conv(torch.randn(spec.input_shape),
             out=torch.empty(spec.output_shape).contiguous(memory_format=torch.channels_last))
    with pytest.raises(MacoError, match="unknown target"):
        kernels.compile(spec, good, target="tpu")


def test_compile_error_is_a_maco_error(tmp_path, monkeypatch):
    from maco.kernels import cpu_build

    monkeypatch.setenv("MACO_CACHE", str(tmp_path))
    with pytest.raises(MacoError, match="(?s)gcc failed.*error"):
        cpu_build.build("int f( { return 0; }", cpu_build.flags_for(HOST))
    assert not list(tmp_path.glob("*.so"))  # nothing half-built left behind


def test_a_build_past_its_timeout_is_killed_with_its_compiler(tmp_path, monkeypatch):
    import subprocess

    from maco.kernels import cpu_build

    monkeypatch.setenv("MACO_CACHE", str(tmp_path))
    source = "\n".join(f"float f{i}(float x) {{ return x * {i}.5f + {i}; }}" for i in range(20000))
    with pytest.raises(MacoError, match="gcc took longer than 0.05 s"):
        cpu_build.build(source, cpu_build.flags_for(HOST), timeout=0.05)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip()  # cc1 went with the gcc driver
    assert not list(tmp_path.iterdir())  # no source or half-built object left behind


def test_cache_reuses_built_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("MACO_CACHE", str(tmp_path))
    spec = ConvSpec.parse("n1_c4_h5_w5_k8_r3x3_p1")
    s = kernels.default_schedule(spec, GENERIC, "NHWC")
    first = kernels.build_many(spec, [s, s], GENERIC)
    sos = list(tmp_path.glob("*.so"))
    assert len(sos) == 1 and first[0].so == first[1].so == sos[0]
    mtime = sos[0].stat().st_mtime_ns
    again = kernels.compile(spec, s, target=GENERIC)
    assert again.so == sos[0] and sos[0].stat().st_mtime_ns == mtime
    relu = kernels.compile(spec, s, target=GENERIC, relu=True)  # another source, another file
    assert relu.so != sos[0] and len(list(tmp_path.glob("*.so"))) == 2


def test_build_many_reports_invalid_schedules_in_place():
    spec = ConvSpec.parse("n1_c4_h5_w5_k8_r3x3_p1")
    good = kernels.default_schedule(spec, HOST, "NCHW")
    bad = dataclasses.replace(good, unroll=7)
    out = kernels.build_many(spec, [bad, good], HOST)
    assert isinstance(out[0], MacoError) and "unroll" in str(out[0])
    assert not isinstance(out[1], Exception)


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, maco.kernels; assert 'cupy' not in sys.modules; "
            "assert 'maco.kernels.cpu' not in sys.modules; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_measure_peak_is_positive_and_cached():
    a = kernels.measure_peak(HOST)
    assert a > 0 and kernels.measure_peak(HOST) == a


def test_microkernel_ceiling_lies_below_the_fma_peak():
    """Loads share the core with the FMAs: the register-tile mix never outruns the FMA loop, both
    timed on the same flops in the same rounds (peaks cached from another moment can disagree)."""
    if HOST.isa not in ("avx512", "avx2"):
        pytest.skip(f"the microkernel ceiling needs AVX2 or AVX-512 intrinsics; this host is {HOST.isa}")
    from maco.kernels.cpu_peak import flops_runner
    from maco.core.timing import interleaved_rounds

    assert kernels.measure_peak(HOST, kind="microkernel") > 0
    fma, micro, flops = flops_runner(HOST, "fma"), flops_runner(HOST, "microkernel"), 1e8

    def check() -> str:
        t = interleaved_rounds({"fma": lambda: fma(flops), "micro": lambda: micro(flops)}, 5, repeats=3,
                               min_run_time=2e-3)
        ratio = sorted(f.min / m.min for f, m in zip(t["fma"], t["micro"]))[2]  # micro's speed over fma's
        return "" if 0 < ratio <= 1.05 else f"the microkernel ran {ratio:.2f}x the FMA loop's speed"
    holds_unless_busy(check)
    with pytest.raises(MacoError, match="unknown peak kind 'gpu'"):
        kernels.measure_peak(HOST, kind="gpu")
    flops_runner(HOST, "microkernel", (3, 8))(1e6)  # another register-tile shape builds and runs
    with pytest.raises(MacoError, match=r"register tile shape must be positive.*\(0, 8\)"):
        flops_runner(HOST, "microkernel", (0, 8))


def test_the_fma_peak_is_timed_beside_the_kernel_on_the_layers_flops():
    """The VM runs in faster and slower spells: the fraction of peak compares the kernel with the
    FMA loop doing the same flops in the same rounds, not with the best peak ever seen."""
    from maco.kernels.cpu_peak import best_gflops, flops_runner
    from maco.tune.benchmark import bench_layer

    spec = ConvSpec.parse("n1_c32_h14_w14_k64_r3x3_p1")

    def check() -> str:
        r = bench_layer("x", spec, {"maco": kernels.default_schedule(spec, HOST, "NHWC")}, HOST, repeats=3,
                        min_run_time=0.005, ceilings=True)
        assert len(r.rounds["FMA peak"]) == 3
        assert ("microkernel ceiling" in r.rounds) == (HOST.isa in ("avx512", "avx2"))
        # the peak now, not the one cached on disk: one cached while the host was busy reads low for good
        peak, beside = best_gflops(flops_runner(HOST, "fma"), 1e8, 5), r.gflops("FMA peak")
        if not 0.2 * peak < beside < 1.5 * peak:
            return f"the FMA loop beside the kernel read {beside:.0f} GFLOP/s, alone just before {peak:.0f}"
        # Below 1 up to the VM's noise; a flop count off by 2 reads twice the kernel's share.
        share = r.speedup("maco", over=("FMA peak",))
        return "" if 0 < share < 1.5 else f"the kernel ran {share:.2f}x the FMA loop on the layer's flops"
    holds_unless_busy(check)


def test_bench_layer_times_winograd_in_each_tile_size_and_checks_it():
    from maco.tune.benchmark import bench_layer

    spec = ConvSpec.parse("n1_c16_h10_w10_k64_r5_p2")
    r = bench_layer("x", spec, {"maco": kernels.default_schedule(spec, HOST, "NHWC")}, HOST, repeats=1,
                    min_run_time=0.001, winograd=True)
    assert {"winograd F2", "winograd F4"} <= set(r.rounds) and r.error < 1e-4
    assert "winograd F2" not in bench_layer("x", ConvSpec.parse("n1_c16_h10_w10_k64_r3_s2_p1"), {}, HOST, repeats=1,
                                            min_run_time=0.001, winograd=True).rounds  # stride 2: none


def test_bench_cli(capsys):
    from maco.cli import main

    assert main(["bench", "n1_c8_h10_w10_k16_r3x3_p1", "--repeats", "1", "--layout", "NHWC"]) == 0
    out = capsys.readouterr().out
    assert "MACO GFLOP/s" in out and "torch NHWC" in out and "n1_c8_h10_w10_k16_r3x3_p1" in out
    assert main(["bench", "n1_c8_h10_w10_k16_r3x3_p1", "--repeats", "0"]) == 2


def test_bench_speedup_compares_within_rounds():
    """The machine's fast and slow spells hit neighbours in a round alike: a kernel 1.2x faster
    than torch's faster layout in every round is 1.2x, whichever spell each round fell in."""
    from maco.tune.benchmark import BenchRow

    spell = [1.0, 1.0, 1.3, 1.3, 1.3]
    row = BenchRow("x", ConvSpec.parse("n1_c8_h10_w10_k16_r3x3_p1"),
                   {"maco": [s / 1.2 for s in spell],
                    "torch NCHW": [s if i % 2 else 1.5 * s for i, s in enumerate(spell)],
                    "torch NHWC": [1.5 * s if i % 2 else s for i, s in enumerate(spell)]}, 0.0)
    assert row.speedup("maco") == pytest.approx(1.2)
    assert row.seconds["maco"] == pytest.approx(1.3 / 1.2)
    assert row.speedup("torch NHWC", ("torch NCHW",)) == pytest.approx(1.5)  # 3 rounds of 5


def test_bench_times_torch_with_the_steady_allocator():
    """torch allocates its output on every call; timed with mmap'ed outputs it measured up to
    20% slow, which flattered MACO. bench_layer must put glibc in the tuner's steady state."""
    import subprocess
    import sys

    code = ("from maco import ConvSpec, Target, kernels; from maco.tune.benchmark import bench_layer; "
            "import maco.core.timing as L; s = ConvSpec.parse('n1_c8_h10_w10_k16_r3x3_p1'); "
            "bench_layer('x', s, {'NCHW': kernels.default_schedule(s, Target.host())}, Target.host(), "
            "repeats=1); print(L._STEADY)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_default_schedule_for_filter_heavy_layers_slides_over_channel_chunks():
    """With a small L2 the filters outweigh the input: channel chunks (R0 > 1), split by filters."""
    small = dataclasses.replace(HOST, levels=tuple(
        dataclasses.replace(lvl, capacity=64 << 10) if lvl.name == "L2" else lvl for lvl in HOST.levels))
    spec = ConvSpec.parse("n1_c64_h5_w5_k64_r3x3_p1")
    schedules = [kernels.default_schedule(spec, small, layout) for layout in ("NCHW", "NHWC")]
    assert all(s.factors("c")[0] > 1 for s in schedules)
    for s in schedules:  # the largest chunk whose filter block (one register tile's k) fits L2 / 4
        block = s.register_tile()["k"] * 9 * 4
        assert block * s.factors("c")[1] <= (64 << 10) // 4 < block * 2 * s.factors("c")[1]
    check_batch(spec, schedules, small, epilogue=True)


def test_filter_heavy_default_splits_cores_by_rows_in_nhwc_where_rows_share_out_evenly():
    """NHWC by rows (each core keeps half the input in L2), NCHW by filters; an odd number of
    rows stays split by filters in both. On the AVX-512 target it was written for (on AVX2 the
    register tile leaves NCHW out of the filter-heavy branch); its kernels run where the host has it."""
    small = dataclasses.replace(AVX512, levels=tuple(
        dataclasses.replace(lvl, capacity=64 << 10) if lvl.name == "L2" else lvl for lvl in AVX512.levels))
    spec = ConvSpec.parse("n1_c64_h8_w8_k64_r3x3_p1")
    nhwc, nchw = (kernels.default_schedule(spec, small, layout) for layout in ("NHWC", "NCHW"))
    assert nhwc.factors("c")[0] > 1 and nchw.factors("c")[0] > 1  # the filter-heavy branch
    assert (nhwc.factors("oh")[0], nhwc.factors("k")[0]) == (2, 1)
    assert (nchw.factors("oh")[0], nchw.factors("k")[0]) == (1, 2)
    odd = ConvSpec.parse("n1_c64_h7_w7_k128_r3x3_p1")
    assert kernels.default_schedule(odd, small, "NHWC").factors("k")[0] == 2
    if HOST.isa == "avx512":
        check_batch(spec, [nhwc, nchw], dataclasses.replace(small, name=HOST.name, model=HOST.model), epilogue=True)


def test_packed_weights_and_outputs_start_on_a_cache_line():
    """numpy promises 16 bytes; misaligned weight vectors straddle two cache lines and made the
    same kernel up to 9% slower in one process than in another."""
    from maco.core.timing import steady_allocator

    steady_allocator()  # the timers' allocator state, where numpy's arrays land 16 bytes apart
    spec = ConvSpec.parse("n1_c8_h6_w7_k32_r3x3_p1")
    x, w, _, _, _, _ = reference(spec)
    for layout in ("NCHW", "NHWC"):
        kernel = kernels.compile(spec, kernels.default_schedule(spec, None, layout))
        for _ in range(8):
            conv = kernel.bind(w.numpy())
            assert conv.weight.ctypes.data % 64 == 0
            xn = x.numpy() if layout == "NCHW" else np.ascontiguousarray(x.numpy().transpose(0, 2, 3, 1))
            assert conv(xn).ctypes.data % 64 == 0


def test_every_kernel_family_packs_its_weights_on_a_cache_line():
    """Winograd's U, the depthwise, block and squeeze-excitation packings are read as vectors too:
    a misaligned packing made MobileNetV2's block kernels 6-13% slower."""
    from maco.core.timing import steady_allocator
    from maco.kernels.depthwise import DepthwisePlan
    from maco.kernels.inverted_residual import BlockPlan
    from maco.kernels.squeeze_excite import SqueezePlan
    from maco.kernels.winograd import WinogradPlan

    steady_allocator()
    rng = np.random.default_rng(0)
    conv = ConvSpec.parse("n1_c16_h8_w8_k64_r3x3_p1")
    dw = ConvSpec.parse("n1_c24_h8_w8_k24_r3x3_p1_g24")
    block = BlockPlan(n=1, c=8, h=6, w=6, m=24, k=8)
    squeeze = SqueezePlan(n=1, c=24, h=4, w=4, squeeze=8)
    for _ in range(8):
        packs = [WinogradPlan(conv, m=m).pack_weight(rng.standard_normal(conv.weight_shape)) for m in (2, 4)]
        packs.append(DepthwisePlan(dw).pack_weight(rng.standard_normal(dw.weight_shape).astype(np.float32)))
        packs.append(block.pack((rng.standard_normal((24, 8)), None), (rng.standard_normal((24, 9)), None),
                                (rng.standard_normal((8, 24)), None)))
        packs.extend(squeeze.pack(rng.standard_normal((8, 24)), None, rng.standard_normal((24, 8)), None))
        for packed in packs:
            assert packed.dtype == np.float32 and packed.flags.c_contiguous
            assert packed.ctypes.data % 64 == 0


def test_default_schedule_keeps_outputs_in_l2_while_channel_chunks_slide_by():
    """Filters and input both outgrow half of L2: in NHWC the core's outputs are its L2 tile
    (S1 = 1) and channel chunks slide by outside the filter blocks (R0 > 1), the largest chunk
    whose input patch and one filter block fit beside the outputs in 3/4 of L2; NCHW keeps
    R0 = 1. Both match torch."""
    small = dataclasses.replace(HOST, levels=tuple(
        dataclasses.replace(lvl, capacity=64 << 10) if lvl.name == "L2" else lvl for lvl in HOST.levels))
    spec = ConvSpec.parse("n1_c32_h16_w16_k64_r3x3_p1")
    nhwc, nchw = (kernels.default_schedule(spec, small, layout) for layout in ("NHWC", "NCHW"))
    c0, c1 = nhwc.factors("c")
    assert c0 > 1 and nchw.factors("c")[0] == 1
    assert all(nhwc.factors(a)[1] == 1 for a in ("n", "g", "k"))
    l2_tile = {a: int(np.prod(nhwc.factors(a)[2:])) for a in ("n", "g", "k", "oh", "ow")}
    outputs = int(np.prod(list(l2_tile.values())))
    assert outputs * 4 <= (64 << 10) // 2

    def fits(chunk: int) -> bool:
        patch = (l2_tile["oh"] + 2) * (l2_tile["ow"] + 2)
        return 4 * (outputs + chunk * (patch + nhwc.register_tile()["k"] * 9)) <= (64 << 10) * 3 // 4
    assert fits(c1) and not fits(2 * c1)
    check_batch(spec, [nhwc, nchw], small, epilogue=True)
