"""CUDA backend: every generated variant is checked three ways.

1. Host emulation (the kernel's own index arithmetic run on the CPU) against torch's conv in fp64.
2. nvcc -arch=sm_90 compiles every variant (skipped with a reason if nvcc is absent).
3. On a GPU with CuPy (marked gpu, skipped otherwise): the real kernel against torch's conv on
   the GPU, on torch CUDA tensors and on CuPy arrays, output poisoned with NaN beforehand.
"""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from maco import ConvSpec, MacoError, Schedule, Target
from maco.kernels import cuda_build, cuda_emulate
from maco.kernels.cuda_codegen import CudaPlan, plan
from maco.kernels.cuda_schedule import candidates, default_schedule, maco_tile, random_schedule

SPECS = [
    ConvSpec(1, 16, 8, 8, 32, 1, 1),                                  # 1x1
    ConvSpec(1, 8, 12, 12, 16, 3, 3, padding=1),                     # 3x3 same
    ConvSpec(2, 8, 13, 11, 12, 3, 3, stride=2, padding=1),           # stride 2, batch, odd sizes
    ConvSpec(1, 4, 14, 14, 8, 5, 5, padding=4, dilation=2),          # dilation
    ConvSpec(1, 16, 10, 10, 8, 3, 3, padding=1, groups=4),           # grouped
    ConvSpec(1, 16, 9, 9, 16, 3, 3, stride=2, padding=1, groups=16),  # depthwise
    ConvSpec(3, 3, 20, 20, 8, 7, 7, stride=2, padding=3),            # ResNet stem, batch 3
    ConvSpec(1, 6, 9, 10, 4, 1, 3, stride=(2, 1), padding=(0, 1)),   # non-square kernel/stride
    ConvSpec(2, 3, 35, 35, 16, 11, 11, stride=4, padding=2),         # AlexNet stem
    ConvSpec(4, 32, 7, 7, 64, 1, 1, stride=2),                       # strided 1x1, batch 4
]
EPILOGUES = [(False, False, False), (True, True, True), (True, False, False), (False, True, True)]


def _variants() -> list[CudaPlan]:
    """Per spec and layout: the default schedule with the full epilogue, and two random
    schedules of the whole sketch with other epilogues. Seeded: the same set everywhere."""
    rng = np.random.default_rng(5)
    out = []
    for i, spec in enumerate(SPECS):
        for layout in ("NCHW", "NHWC"):
            out.append(plan(spec, default_schedule(spec, layout=layout), bias=True, relu=True, residual=True))
            for j in range(2):
                ep = EPILOGUES[(i + j) % len(EPILOGUES)]
                out.append(plan(spec, random_schedule(spec, rng, layout), bias=ep[0], relu=ep[1], residual=ep[2]))
    return out + _hand_made()


def _hand_made() -> list[CudaPlan]:
    """Schedules that certainly take the vector-store, 16-byte weight copy, vthread and
    3-4 buffer paths (random draws reach them rarely)."""
    a = ConvSpec(2, 16, 8, 16, 32, 3, 3, padding=1)
    b = ConvSpec(1, 16, 6, 8, 32, 3, 3, padding=1, groups=2)
    nchw = Schedule(kind="cuda", spatial=((2, 1, 1, 1, 1), (1, 1, 1, 1, 1), (2, 2, 4, 1, 2), (2, 1, 4, 1, 1),
                                          (1, 1, 2, 2, 4)),
                    reduction=((4, 2, 2), (1, 1, 3), (1, 3, 1)), unroll=16, extra=(("buffers", 3),))
    nhwc = Schedule(kind="cuda", spatial=((1, 1, 2, 1, 1), (1, 1, 1, 1, 1), (1, 2, 2, 1, 8), (4, 1, 2, 1, 1),
                                          (2, 1, 8, 1, 1)),
                    reduction=((8, 2, 1), (1, 1, 3), (1, 1, 3)), layout="NHWC", unroll=64,
                    extra=(("buffers", 4),))
    grouped = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (2, 1, 1, 1, 1), (1, 1, 4, 1, 4), (3, 1, 2, 1, 1),
                                             (1, 1, 8, 1, 1)),
                       reduction=((2, 2, 2), (1, 1, 3), (1, 1, 3)), layout="NHWC", extra=(("buffers", 3),))
    out = [plan(a, nchw, bias=True, relu=True, residual=True), plan(a, nchw),
           plan(a, nhwc, bias=True, relu=True, residual=True), plan(a, nhwc, residual=True),
           plan(b, grouped, bias=True, residual=True), plan(b, grouped)]
    for p in out:
        assert p.vec_store == 4 and p.weight_flat and p.buffers >= 3, _ids(p)
    return out + _padded()


def _padded() -> list[CudaPlan]:
    """Schedules whose warps would hit one bank many times, so that the generator pads the patch
    rows (lanes along oh, rows 16 floats apart) or skews the weight rows (lanes along k, runs of 8
    of a 64-wide row), with the 16-byte weight copy and without it."""
    rows = ConvSpec(1, 8, 16, 16, 64, 1, 1)
    pad = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (2, 1, 8, 1, 4), (4, 1, 4, 1, 1),
                                         (1, 1, 1, 1, 16)), reduction=((2, 4, 1), (1, 1, 1), (1, 1, 1)))
    ks = ConvSpec(1, 8, 8, 8, 64, 3, 3, padding=1)
    spatial = ((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 1, 8, 1, 8), (2, 1, 4, 1, 1), (1, 1, 1, 1, 8))
    flat = Schedule(kind="cuda", spatial=spatial, reduction=((2, 4, 1), (1, 1, 3), (1, 1, 3)))
    split = Schedule(kind="cuda", spatial=spatial, reduction=((8, 1, 1), (3, 1, 1), (1, 1, 3)))
    # split_c: a warp spans two thread groups reading other channels, so the generator pads the
    # stride between channels (patch planes, weight channels) too
    one = ConvSpec(1, 64, 7, 7, 16, 1, 1)
    ch = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 2, 1, 1, 8), (7, 1, 1, 1, 1),
                                        (7, 1, 1, 1, 1)), reduction=((8, 4, 2), (1, 1, 1), (1, 1, 1)), unroll=16,
                  weight_packing="none", extra=(("split_c", 2), ("buffers", 3)))
    both = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (2, 1, 1, 2, 4), (7, 1, 1, 1, 1),
                                          (1, 1, 7, 1, 1)), reduction=((8, 2, 4), (1, 1, 1), (1, 1, 1)),
                    extra=(("split_c", 2), ("buffers", 4)))
    plane = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (4, 1, 2, 2, 1), (1, 1, 4, 2, 1),
                                           (1, 2, 2, 1, 2)), reduction=((8, 2, 2), (1, 1, 3), (1, 1, 3)), unroll=0,
                     extra=(("split_c", 2),))
    three = ConvSpec(1, 32, 8, 8, 16, 3, 3, padding=1)
    out = [plan(rows, pad, bias=True, relu=True, residual=True), plan(ks, flat, bias=True, residual=True),
           plan(ks, split, relu=True), plan(one, ch, bias=True), plan(one, both, relu=True, residual=True),
           plan(three, plane, bias=True, relu=True)]
    pads = [p.padding for p in out]
    assert pads[0][0] and pads[1][2] and pads[2][2] and pads[3][3] and pads[4][0] and pads[4][3] and pads[5][1], pads
    assert [p.weight_flat for p in out[1:5]] == [True, False, False, True], [p.weight_flat for p in out]
    return out


VARIANTS = _variants()


def _ids(p: CudaPlan) -> str:
    return f"{p.spec}-{p.schedule.layout}-b{int(p.bias)}r{int(p.relu)}s{int(p.residual)}-{p.source_hash[:6]}"


def _reference(p: CudaPlan, gen: torch.Generator):
    """Random inputs (torch layout) and the fp64 torch result."""
    s = p.spec
    x = torch.randn(s.input_shape, generator=gen)
    w = torch.randn(s.weight_shape, generator=gen)
    b = torch.randn(s.k, generator=gen) if p.bias else None
    r = torch.randn(s.output_shape, generator=gen) if p.residual else None
    y = torch.nn.functional.conv2d(x.double(), w.double(), None if b is None else b.double(),
                                   s.stride, s.padding, s.dilation, s.groups)
    if r is not None:
        y = y + r.double()
    if p.relu:
        y = torch.relu(y)
    return x, w, b, r, y


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# -- 1. host emulation ---------------------------------------------------------------------------
def _emulate_one(p: CudaPlan) -> tuple[str, float]:
    gen = torch.Generator().manual_seed(hash(p.source_hash) % 2**31)
    x, w, b, r, ref = _reference(p, gen)
    nhwc = p.schedule.layout == "NHWC"
    phys = (lambda t: t.permute(0, 2, 3, 1).contiguous().numpy()) if nhwc else (lambda t: t.numpy())
    y = cuda_emulate.run(p, phys(x), w.numpy(), None if b is None else b.numpy(),
                         None if r is None else phys(r))
    y = torch.from_numpy(y.copy())
    y = y.permute(0, 3, 1, 2) if nhwc else y
    assert not torch.isnan(y).any(), f"{_ids(p)}: unwritten outputs"
    return _ids(p), _rel_err(y, ref)


def test_emulated_kernels_match_torch():
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(_emulate_one, VARIANTS))
    bad = [(name, err) for name, err in results if not err < 1e-5]
    assert not bad, f"{len(bad)} of {len(results)} variants disagree with torch: {bad}"


# -- 2. nvcc -------------------------------------------------------------------------------------
@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="nvcc is not installed")
def test_every_variant_compiles_with_nvcc_for_sm90(tmp_path):
    built = cuda_build.build(VARIANTS, tmp_path, arch="sm_90", per_unit=16, jobs=2)
    assert set(built) == {p.source_hash for p in VARIANTS}
    for p in VARIANTS:
        info = built[p.source_hash]
        assert info.cubin.stat().st_size > 0
        assert info.registers is not None and info.registers <= 255, (_ids(p), info)
    for p in VARIANTS[:60:3]:  # the defaults must not spill (random schedules may)
        assert built[p.source_hash].spill_bytes == 0, f"{_ids(p)} spills"



# -- schedules, plans and errors (no GPU) ----------------------------------------------------------
def test_model_sizes_agree_with_the_plan_and_defaults_are_valid():
    from maco.kernels.cuda_schedule import _ranked, _schedule

    spec = ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1)
    for layout in ("NCHW", "NHWC"):
        for _, raw in _ranked(spec, Target.h100(), layout)[:50]:
            p = CudaPlan(spec, _schedule(spec, layout, raw)).validate()
            assert p.threads <= 1024 and p.accumulators <= 64
            assert p.block_outputs <= Target.h100().level("shared").elements_per_processor
    from maco.layouts.networks import distinct_convs, network_convs

    for name in ("resnet18", "alexnet", "vgg11"):
        for spec, _ in distinct_convs(network_convs(name, 1)):
            p = CudaPlan(spec, default_schedule(spec, Target.h100())).validate()
            assert p.blocks >= 100, f"{spec}: only {p.blocks} blocks for 132 SMs"


def test_maco_tile_conditions():
    spec = ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1)
    x, y, z = maco_tile(spec, Target.h100())
    s_np = Target.h100().level("shared").elements_per_processor
    assert x * y == pytest.approx(9 * z, rel=0.05)  # x*y = R*z
    assert x * y * z == pytest.approx(s_np, rel=0.25)  # x*y*z ~ S/Np


def test_candidates_are_distinct_and_valid():
    spec = ConvSpec(1, 128, 28, 28, 128, 3, 3, padding=1)
    cands = candidates(spec, layout="NHWC", limit=8)
    assert len(cands) == 8 and len(set(cands)) == 8
    for sch in cands:
        assert sch.layout == "NHWC" and CudaPlan(spec, sch).problems() == []


def test_checking_a_schedule_leaves_the_bank_model_alone():
    # random_schedule and the space check thousands of schedules; the padding model costs
    # milliseconds each, so only a plan that is built (its source, its launch) runs it
    spec = ConvSpec(1, 64, 28, 28, 64, 3, 3, padding=1)
    p = CudaPlan(spec, default_schedule(spec))
    assert p.problems() == [] and "padding" not in p.__dict__
    p.source()
    assert "padding" in p.__dict__ and p.smem_bytes >= 4 * p._padded_smem_floats(0, 0, 0, 0)


def test_candidates_unroll_less_where_the_body_would_grow_too_long():
    from dataclasses import replace

    from maco.kernels.cuda_schedule import MAX_UNROLLED_FMAS

    seen = set()
    for spec in (ConvSpec(8, 256, 28, 28, 512, 3, 3, padding=1), ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1),
                 ConvSpec(8, 128, 28, 28, 256, 1, 1, stride=2)):
        for sch in candidates(spec, layout="NCHW", limit=16):
            full = CudaPlan(spec, replace(sch, unroll=64)).unrolled_fmas
            assert sch.unroll == (64 if full <= MAX_UNROLLED_FMAS else 16), (spec, sch.describe(), full)
            assert CudaPlan(spec, sch).unrolled_fmas <= MAX_UNROLLED_FMAS
            seen.add(sch.unroll)
    assert seen == {16, 64}


def test_bad_schedules_raise_naming_the_problem():
    spec = ConvSpec(1, 8, 12, 12, 16, 3, 3, padding=1)
    good = default_schedule(spec)
    cpu = Schedule(kind="cpu", spatial=((1, 1, 1, 1),) * 2 + ((1, 1, 2, 8), (12, 1, 1, 1), (1, 12, 1, 1)),
                   reduction=((2, 4), (1, 3), (3, 1)))
    with pytest.raises(MacoError, match="'cuda' schedule"):
        plan(spec, cpu)
    wrong = Schedule(**{**good.__dict__, "spatial": ((1, 1, 1, 1, 1),) * 2 + ((1, 1, 1, 1, 3),) + good.spatial[3:]})
    with pytest.raises(MacoError, match="multiply to 3, not the extent 16"):
        plan(spec, wrong)
    c1 = good.reduction[0][1]
    with pytest.raises(MacoError, match="split_c 3 must be a positive int dividing"):
        plan(spec, Schedule(**{**good.__dict__, "extra": (("split_c", 3),) if c1 % 3 else (("split_c", 5),)}))
    with pytest.raises(MacoError, match="needs stage_out"):
        plan(spec, Schedule(**{**good.__dict__, "reduction": ((1, 8, 1), (1, 1, 3), (1, 1, 3)),
                               "extra": (("split_c", 2), ("stage_out", False))}))
    with pytest.raises(MacoError, match="unknown CUDA schedule knob"):
        plan(spec, Schedule(**{**good.__dict__, "extra": (("warp_shuffle", 1),)}))
    big = Schedule(kind="cuda", spatial=((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 1, 16, 1, 1), (1, 1, 12, 1, 1),
                                         (1, 1, 12, 1, 1)), reduction=((1, 8, 1), (1, 1, 3), (1, 1, 3)))
    with pytest.raises(MacoError, match="2304 threads per block exceed 1024"):
        plan(spec, big)


def test_import_never_needs_cupy_and_running_without_it_says_so():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import maco, maco.kernels, maco.kernels.cuda as kc\n"
        "from maco import ConvSpec, MacoError\n"
        "k = kc.compile_cuda(ConvSpec(1, 8, 12, 12, 16, 3, 3, padding=1))\n"
        "assert 'maco_conv' in k.source\n"
        "try:\n"
        "    k.bind(__import__('numpy').zeros((16, 8, 3, 3), 'float32'))\n"
        "except MacoError as e:\n"
        "    assert 'CuPy' in str(e), e; print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_source_is_cached_by_hash_and_depends_on_the_epilogue():
    spec = SPECS[1]
    sch = default_schedule(spec)
    a, b = plan(spec, sch), plan(spec, sch, relu=True)
    assert a.source_hash == plan(spec, sch).source_hash != b.source_hash
    assert "#define HAS_RELU 1" in b.source() and "#define HAS_RELU 0" in a.source()


# -- 3. on the GPU ---------------------------------------------------------------------------------
def _gpu_ready() -> str | None:
    from maco.kernels.cuda import cupy_module

    try:
        cupy_module()
    except MacoError as exc:
        return str(exc)
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    return None


_NO_GPU = _gpu_ready()
gpu = pytest.mark.skipif(_NO_GPU is not None, reason=f"no GPU for the CUDA kernels: {_NO_GPU}")


@pytest.fixture(scope="module")
def strict_fp32():
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("p", VARIANTS, ids=_ids)
def test_gpu_kernel_matches_torch(p, strict_fp32):
    import cupy

    from maco.kernels.cuda import CudaKernel

    gen = torch.Generator().manual_seed(int(p.source_hash[:6], 16))
    x, w, b, r, ref = _reference(p, gen)
    nhwc = p.schedule.layout == "NHWC"
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    conv = CudaKernel(p).bind(w.cuda(), None if b is None else b.cuda())
    xt = x.cuda().contiguous(memory_format=fmt)
    rt = None if r is None else r.cuda().contiguous(memory_format=fmt)
    out = torch.full(p.spec.output_shape, float("nan"), device="cuda").contiguous(memory_format=fmt)
    y = conv(xt, rt, out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any(), "unwritten outputs"
    assert _rel_err(y.cpu(), ref) < 1e-5
    # CuPy arrays in the layout's physical shape give the same result
    phys = (lambda t: t.permute(0, 2, 3, 1).contiguous()) if nhwc else (lambda t: t.contiguous())
    yc = conv(cupy.asarray(phys(x).numpy()), None if r is None else cupy.asarray(phys(r).numpy()))
    yc = torch.from_numpy(cupy.asnumpy(yc))
    assert _rel_err(yc.permute(0, 3, 1, 2) if nhwc else yc, ref) < 1e-5


@pytest.mark.gpu
@gpu
def test_gpu_prebuilt_cubins_and_errors(tmp_path):
    from maco.kernels.cuda import CudaKernel, prebuild

    if cuda_build.find_nvcc() is None:
        pytest.skip("nvcc is not installed on this GPU machine")
    plans = VARIANTS[:6]
    built = prebuild(plans, tmp_path)
    for p in plans:
        k = CudaKernel(p)
        k.build()
        gen = torch.Generator().manual_seed(1)
        x, w, b, r, ref = _reference(p, gen)
        fmt = torch.channels_last if p.schedule.layout == "NHWC" else torch.contiguous_format
        y = k.bind(w, b)(x.cuda().contiguous(memory_format=fmt),
                         None if r is None else r.cuda().contiguous(memory_format=fmt))
        assert _rel_err(y.cpu(), ref) < 1e-5
        assert built[p.source_hash].cubin.exists()
    k = CudaKernel(plan(SPECS[1], default_schedule(SPECS[1])))
    conv = k.bind(torch.randn(SPECS[1].weight_shape))
    with pytest.raises(MacoError, match="CPU tensor"):
        conv(torch.randn(SPECS[1].input_shape))
    with pytest.raises(MacoError, match="float32"):
        conv(torch.randn(SPECS[1].input_shape, device="cuda", dtype=torch.float64))
    with pytest.raises(MacoError, match="expected \\(1, 8, 12, 12\\)"):
        conv(torch.randn(1, 8, 12, 13, device="cuda"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_gpu_model_module_runs_in_and_out_of_a_cuda_graph(layout, strict_fp32):
    """The whole-network path: a MacoConv2d on CUDA (bias and relu fused, preallocated output)
    equals torch's conv called directly and replayed from a CUDA graph; another input shape,
    or a CPU input, runs torch's conv."""
    from maco.layouts.fusion import FusedConv2d
    from maco.layouts.maco_modules import MacoConv2d

    spec = SPECS[1]
    conv = torch.nn.Conv2d(spec.c, spec.k, 3, padding=1).cuda().eval()
    fused = FusedConv2d(conv, conv.weight.detach(), conv.bias.detach(), activation="relu")
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    mod = MacoConv2d(fused, spec, default_schedule(spec, layout=layout), Target.h100(), preallocate=True)
    x = torch.randn(spec.input_shape, device="cuda").contiguous(memory_format=fmt)
    with torch.inference_mode():
        want = torch.relu(conv(x))
        assert _rel_err(mod(x).cpu(), want.cpu()) < 1e-5
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mod(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = mod(static_x)
        x2 = torch.randn_like(x)
        static_x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(static_y.cpu(), torch.relu(conv(x2)).cpu()) < 1e-5
        other = torch.randn(1, spec.c, spec.h + 1, spec.w, device="cuda")
        assert _rel_err(mod(other).cpu(), torch.relu(conv(other)).cpu()) < 1e-5
        cpu_mod, xc = mod.cpu(), x.cpu()
        assert _rel_err(cpu_mod(xc), torch.relu(conv.cpu()(xc))) < 1e-5
