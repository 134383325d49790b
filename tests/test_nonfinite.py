"""NaN and infinities land where eager torch puts them, in every generated CPU kernel family: direct
conv (NCHW and NHWC, each epilogue, the intrinsics and the portable micro-kernels), Winograd
(F(2x2) and F(4x4), 3x3 and 5x5), depthwise, linear and pooling. A tool that replaces torch's
kernels must never be silently wrong: a fused ReLU that turns NaN into 0, or a Winograd transform
that turns an infinity into NaN (inf - inf) over a whole output tile, hides a broken input."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from maco import ConvSpec, MemoryLevel, Target, kernels
from maco.kernels.cpu_codegen import CpuPlan
from maco.kernels.epilogue import ACTIVATIONS, torch_activation
from maco.kernels.linear import compile_linear
from maco.kernels.winograd import filter_vectors
from maco.layouts.fusion import FusedConv2d
from maco.layouts.maco_modules import MacoDepthwise2d, MacoPool2d, MacoWinograd2d
from tests.targets import GENERIC

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HOST = kernels.host_target()
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}
ACT = {act: partial(torch_activation, act) for act in ACTIVATIONS}
NAN, INF = float("nan"), float("inf")
AVX512 = Target("avx512-test", "cpu", (MemoryLevel("registers", 32 * 16 * 4, 1, 16),
                                       MemoryLevel("L1", 48 << 10, 1, 16), MemoryLevel("L2", 2 << 20, 1, 16)),
                cores=2, simd_width=16, isa="avx512")


def poison(t: torch.Tensor, spots: list[tuple[tuple[int, ...], float]]) -> torch.Tensor:
    """A copy of t with the given values (NaN, +-inf) at the given positions."""
    t = t.clone()
    for index, value in spots:
        t[index] = value
    return t


def conv_spots(c: int, h: int, w: int) -> list[tuple[tuple[int, ...], float]]:
    """NaN, +inf and -inf in an NCHW input: at a corner, at the border, inside; a +inf and a -inf
    whose windows overlap (NaN or an infinity where both reach an output)."""
    return [((0, 1 % c, 0, 0), NAN), ((0, 2 % c, h // 2, w // 2), INF), ((0, 3 % c, h // 2 + 1, w // 2 + 2), -INF),
            ((0, 0, h - 1, 1), -INF), ((0, 4 % c, 2, w - 1), INF), ((0, 5 % c, h - 2, w - 3), NAN)]


def residual_spots(k: int, h: int, w: int) -> list[tuple[tuple[int, ...], float]]:
    return [((0, 1 % k, 1, 1), NAN), ((0, 2 % k, h - 1, w - 1), INF), ((0, 3 % k, 0, w - 2), -INF)]


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> None:
    """NaN, +inf and -inf in exactly want's positions; the finite values close (relative to the
    largest finite one)."""
    assert got.shape == want.shape
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        g, w = test(got), test(want)
        assert torch.equal(g, w), f"{test.__name__}: {int(g.sum())} got, {int(w.sum())} in torch, " \
                                  f"{int((g != w).sum())} positions differ"
    finite = torch.isfinite(want)
    scale = float(want[finite].abs().max()) if finite.any() else 1.0
    torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=rtol * scale)


# -- direct conv -----------------------------------------------------------------------------------
DIRECT = "n1_c16_h12_w16_k32_r3_p1"  # NCHW: intrinsics along ow; NHWC: along k (blocked weights)
EPILOGUES = [(act, bias, residual) for act in ACT for bias in (False, True) for residual in (False, True)]
# other micro-kernels: intrinsics along k in NCHW (the epilogue through a lane array), portable C
OTHERS = [("n1_c16_h10_w10_k32_r3_p1", "NCHW", HOST), (DIRECT, "NCHW", GENERIC), (DIRECT, "NHWC", GENERIC),
          ("n1_c8_h9_w11_k16_r3x3_s2_p1", "NHWC", HOST)]


def _direct_jobs():
    jobs = [(DIRECT, layout, HOST, epi) for layout in FORMATS for epi in EPILOGUES]
    return jobs + [(text, layout, target, ("relu6", True, True)) for text, layout, target in OTHERS] + [
        (text, layout, target, ("relu", False, True)) for text, layout, target in OTHERS[:1]]


@pytest.fixture(scope="module")
def direct_kernels():
    """Every direct kernel of this file, built two at a time (gcc runs outside the GIL)."""
    def build(job):
        text, layout, target, (act, bias, residual) = job
        spec = ConvSpec.parse(text)
        return kernels.compile(spec, kernels.default_schedule(spec, target, layout), target, bias=bias,
                               activation=act, residual=residual)

    jobs = _direct_jobs()
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(jobs, pool.map(build, jobs)))


@pytest.mark.parametrize("job", _direct_jobs(), ids=lambda j: f"{j[0]}-{j[1]}-{j[2].isa}-{'-'.join(map(str, j[3]))}")
def test_direct_conv_keeps_nan_and_infinities(direct_kernels, job):
    text, layout, _, (act, bias, residual) = job
    spec, kernel = ConvSpec.parse(text), direct_kernels[job]
    gen = torch.Generator().manual_seed(0)
    x = poison(torch.randn(spec.input_shape, generator=gen), conv_spots(spec.c, spec.h, spec.w))
    w = torch.randn(spec.weight_shape, generator=gen) / 4
    b = torch.randn(spec.k, generator=gen) if bias else None
    r = poison(torch.randn(spec.output_shape, generator=gen) * 4, residual_spots(spec.k, spec.out_h, spec.out_w))
    want = F.conv2d(x, w, b, spec.stride, spec.padding)
    want = ACT[act](want + r if residual else want)
    fmt = FORMATS[layout]
    got = kernel.bind(w, b)(x.contiguous(memory_format=fmt), r.contiguous(memory_format=fmt) if residual else None)
    assert want.isnan().any() and (act != "none" or want.isneginf().any())
    assert_same_nonfinite(got, want)


def test_relu_keeps_nan_in_every_intrinsics_flavour():
    """The vector max and min return their second operand where either is NaN: the epilogue
    passes v second (AVX-512's source is checked here; the host runs AVX2's above)."""
    for layout, text in (("NHWC", DIRECT), ("NCHW", "n1_c16_h12_w32_k32_r3_p1")):
        spec = ConvSpec.parse(text)
        plan = CpuPlan(spec, kernels.default_schedule(spec, AVX512, layout), AVX512, True, "relu6", True)
        assert plan.intrinsics == "avx512" and "_mm512_max_ps(zero, a0)" in plan.source
        assert "_mm512_min_ps(_mm512_set1_ps(6.f), a0)" in plan.source
        assert ", zero)" not in plan.source


# -- Winograd --------------------------------------------------------------------------------------
WINOGRAD = [(3, 2, "relu", True, True), (3, 4, "relu", True, True), (5, 2, "relu", True, True),
            (5, 4, "relu", True, True), (3, 2, "relu6", True, False), (3, 4, "none", False, False)]


def _winograd(r: int, m: int, act: str, bias: bool, residual: bool, h: int = 11, w: int = 10):
    lanes = HOST.simd_width
    # as many filters as one register block holds: 16 with AVX2's 8 lanes, 64 with AVX-512's 16
    conv = nn.Conv2d(lanes, lanes * filter_vectors(lanes), r, padding=r // 2, bias=bias).eval()
    with torch.no_grad():
        conv.weight.mul_(4)
    fused = FusedConv2d(conv, conv.weight.detach(), None if conv.bias is None else conv.bias.detach(), act,
                        "before" if residual else "none").eval()
    spec = ConvSpec.from_module(fused, (1, lanes, h, w))
    return fused, spec, MacoWinograd2d(fused, spec, HOST, m=m)


@pytest.mark.parametrize("r,m,act,bias,residual", WINOGRAD)
def test_winograd_keeps_nan_and_infinities_where_torch_has_them(r, m, act, bias, residual):
    """Eager's infinities would come out of the transforms as NaN (inf - inf) and one NaN would
    fill its whole output tile: the kernel reports the non-finite outputs, and the module
    recomputes that call directly."""
    fused, spec, mod = _winograd(r, m, act, bias, residual)
    nl = torch.channels_last
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=nl)
    res = torch.randn(spec.output_shape, generator=gen).contiguous(memory_format=nl) if residual else None
    args = (x, res) if residual else (x,)
    with torch.inference_mode():
        assert mod._kernel(x, mod._weight, mod._bias, res, torch.empty_like(fused(*args)))  # finite: all finite
        assert_same_nonfinite(mod(*args), fused(*args))
        cases = [[spot] for spot in conv_spots(spec.c, spec.h, spec.w)] + [conv_spots(spec.c, spec.h, spec.w)]
        for spots in cases:
            xp = poison(x, spots).contiguous(memory_format=nl)
            got, want = mod(xp, res) if residual else mod(xp), fused(*((xp, res) if residual else (xp,)))
            assert act == "relu6" or not torch.isfinite(want).all()  # relu6 clamps infinities
            assert not mod._kernel(xp, mod._weight, mod._bias, res, torch.empty_like(want))
            assert_same_nonfinite(got, want)
        if residual:  # a non-finite residual is added output by output: the kernel's own result stands
            rp = poison(res, residual_spots(spec.k, spec.h, spec.w)).contiguous(memory_format=nl)
            assert mod._kernel(x, mod._weight, mod._bias, rp, torch.empty_like(rp))
            assert_same_nonfinite(mod(x, rp), fused(x, rp))


def test_winograd_with_non_finite_weights_runs_torch_conv():
    fused, spec, mod = _winograd(3, 4, "relu", True, False, 8, 8)
    with torch.no_grad():
        fused.weight[3, 2, 0, 1] = INF
        fused.weight[5, 1, 1, 1] = NAN
    mod = MacoWinograd2d(fused, spec, HOST, m=4)
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        assert_same_nonfinite(mod(x), fused(x))


# -- depthwise, linear, pooling --------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(FORMATS))
@pytest.mark.parametrize("act", list(ACT))
def test_depthwise_keeps_nan_and_infinities(layout, act):
    conv = nn.Conv2d(16, 16, 3, 1, 1, groups=16).eval()
    fused = FusedConv2d(conv, conv.weight.detach() * 4, conv.bias.detach(), act, "none").eval()
    spec = ConvSpec.from_module(fused, (1, 16, 9, 12))
    x = poison(torch.randn(spec.input_shape), conv_spots(16, 9, 12) + [((0, 2, 4, 6), -INF)])
    x = x.contiguous(memory_format=FORMATS[layout])
    with torch.inference_mode():
        want = ACT[act](F.conv2d(x, fused.weight, fused.bias, padding=1, groups=16))
        assert want.isnan().any()
        assert_same_nonfinite(MacoDepthwise2d(fused, spec, layout, HOST)(x), want)


@pytest.mark.parametrize("act", list(ACT))
def test_linear_keeps_nan_and_infinities(act):
    """Batch rows: one with a NaN, one with +inf, one with +inf and -inf, one finite; 30 outputs
    (the last two past the kernel's steps of four rows)."""
    gen = torch.Generator().manual_seed(2)
    x = poison(torch.randn(4, 64, generator=gen), [((0, 5), NAN), ((1, 17), INF), ((2, 3), INF), ((2, 40), -INF)])
    w, b = torch.randn(30, 64, generator=gen), torch.randn(30, generator=gen)
    y = torch.empty(4, 30)
    compile_linear(4, 64, 30, activation=act)(x, w, b, y)
    want = ACT[act](F.linear(x, w, b))
    assert want.isnan().any() and (act == "relu6" or want.isposinf().any())
    assert_same_nonfinite(y, want)


@pytest.mark.parametrize("layout", list(FORMATS))
@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), nn.AdaptiveAvgPool2d(2),
                                  nn.AdaptiveMaxPool2d(3)], ids=repr)
def test_pooling_keeps_nan_and_infinities(pool, layout):
    """Max pooling keeps a NaN (torch does); average pooling sums infinities (NaN where a window
    holds both signs)."""
    shape = (1, 8, 9, 10)
    x = poison(torch.randn(shape), conv_spots(8, 9, 10) + [((0, 6, 4, 4), -INF), ((0, 6, 4, 5), -INF),
                                                          ((0, 6, 5, 4), -INF), ((0, 6, 5, 5), -INF)])
    x = x.contiguous(memory_format=FORMATS[layout])
    assert_same_nonfinite(MacoPool2d(pool, shape, layout, HOST)(x), pool(x), rtol=1e-5)
