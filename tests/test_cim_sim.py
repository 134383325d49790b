"""The CIM functional simulator (maco.kernels.cim_sim): its output equals a quantised reference conv
exactly on random layers and random valid schedules, for both cell encodings; its counts match
hand counts on tiny schedules; overflows raise; its observed overflows agree with Schedule.problems."""
import random

import numpy as np
import pytest
import torch

from maco.core.errors import MacoError
from maco.kernels.cim_sim import cell_encoding, decode_cells, encode_cells, quantize, simulate
from maco.core.axes import ALL_AXES, REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.schedule import Schedule
from maco.core import sketch_cim
from maco.core.spec import ConvSpec
from maco.core.target import CimArch, Target

ORDER = ("n", "g", "k", "oh", "ow", "c", "kh", "kw")  # reduction innermost
SMALL = {"cores": 2, "crossbars": 4, "rows": 8, "columns": 8, "cell_bits": 2, "input_buffer": 512,
         "psum_buffer": 1024, "dma_burst": 8}
ARCHES = {  # (weight_bits, cells_per_weight): offset binary and differential pairs
    "offset4": CimArch(weight_bits=4, **SMALL), "offset8": CimArch(weight_bits=8, **SMALL),
    "diff4": CimArch(weight_bits=4, cells_per_weight=4, **SMALL),
    "diff8": CimArch(weight_bits=8, cells_per_weight=8, **{**SMALL, "columns": 16}),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorization(rng: random.Random, n: int, parts: int) -> tuple[int, ...]:
    """A random ordered factorization of n into `parts` factors."""
    out = []
    for _ in range(parts - 1):
        d = rng.choice(_divisors(n))
        out.append(d)
        n //= d
    return tuple(out + [n])


def random_schedule(rng: random.Random, spec: ConvSpec, cores: int) -> Schedule:
    ext = axis_extents(spec)
    spatial = []
    for a in SPATIAL_AXES:
        f = _factorization(rng, ext[a], 3)
        if rng.random() < 0.6:  # keep most schedules on few cores
            f = (1, f[0] * f[1], f[2])
        spatial.append(f)
    while np.prod([f[0] for f in spatial]) > cores:
        i = rng.randrange(len(spatial))
        spatial[i] = (1, spatial[i][0] * spatial[i][1], spatial[i][2])
    # half the reduction axes whole in the block, so that blocks often span several crossbars
    reduction = tuple((1, ext[a]) if rng.random() < 0.5 else _factorization(rng, ext[a], 2)
                      for a in REDUCTION_AXES)
    order = list(ALL_AXES)
    rng.shuffle(order)
    return Schedule(kind="cim", spatial=tuple(spatial), reduction=reduction, loop_order=tuple(order),
                    layout=rng.choice(("NCHW", "NHWC")))


def random_spec(rng: random.Random) -> ConvSpec:
    while True:
        groups = rng.choice((1, 1, 2, "dw"))
        c = rng.choice((2, 3, 4)) if groups != "dw" else rng.choice((2, 3))
        g = c if groups == "dw" else groups
        c = c * (2 if g == 2 and c % 2 else 1)
        k = c if groups == "dw" else g * rng.choice((1, 2, 3))
        try:
            return ConvSpec(n=rng.choice((1, 2)), c=c, h=rng.randint(3, 8), w=rng.randint(3, 8), k=k,
                            kh=rng.randint(1, 3), kw=rng.randint(1, 3), stride=rng.choice((1, 2)),
                            padding=rng.randint(0, 2), dilation=rng.choice((1, 1, 2)), groups=g)
        except MacoError:
            continue


def reference(spec: ConvSpec, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    bound = int(np.abs(x).max()) * int(np.abs(w).max()) * spec.c_per_group * spec.kh * spec.kw
    assert bound < 2 ** 53  # float64 sums stay exact
    xt, wt = torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64)
    y = torch.nn.functional.conv2d(xt, wt, stride=spec.stride, padding=spec.padding,
                                   dilation=spec.dilation, groups=spec.groups)
    return torch.round(y).to(torch.int64).numpy()


def random_data(rng: np.random.Generator, spec: ConvSpec, arch: CimArch) -> tuple[np.ndarray, np.ndarray]:
    top_x, top_w = 2 ** (arch.input_bits - 1), 2 ** (arch.weight_bits - 1)
    x = rng.integers(-top_x, top_x, size=spec.input_shape)
    w = rng.integers(-top_w, top_w, size=spec.weight_shape)  # the full range, -2**(b-1) included
    return x, w


def valid_schedules(rng: random.Random, spec: ConvSpec, target: Target, count: int) -> list[Schedule]:
    out = []
    for _ in range(400):
        s = random_schedule(rng, spec, target.cim_arch.cores)
        if not s.problems(spec, target):
            out.append(s)
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("arch_name", list(ARCHES))
def test_output_matches_quantised_reference(arch_name):
    arch = ARCHES[arch_name]
    target = Target.cim(arch)
    rng, nrng = random.Random(arch_name), np.random.default_rng(len(arch_name) + arch.weight_bits)
    drawn, spans = 0, set()
    for _ in range(25):
        spec = random_spec(rng)
        x, w = random_data(nrng, spec, arch)
        ref = reference(spec, x, w)
        for s in valid_schedules(rng, spec, target, 4):
            res = simulate(spec, s, target, x, w)
            assert res.output.dtype == np.int64 and res.output.shape == spec.output_shape
            assert np.array_equal(res.output, ref), (spec, s.describe())
            c = res.counts
            assert c.output_elements == spec.output_elems
            assert c.weight_loads >= sketch_cim.cores(s) and c.input_loads >= sketch_cim.cores(s)
            assert c.peak_psums <= arch.psum_buffer // arch.psum_bytes
            assert c.peak_input_bytes <= arch.input_buffer
            drawn += 1
            b = sketch_cim.block(s)
            spans.add((b["g"] * b["c"] * b["kh"] * b["kw"] > arch.rows,
                       b["g"] * b["k"] > arch.weight_columns))
    assert drawn >= 40  # the generator found enough valid schedules to mean something
    assert spans >= {(True, False), (False, True), (False, False)}  # blocks over several crossbars


def test_quantize_then_simulate_float_tensors():
    spec = ConvSpec(n=1, c=4, h=6, w=5, k=4, kh=3, kw=3, padding=1, groups=2)
    arch = ARCHES["offset8"]
    rng = np.random.default_rng(1)
    x, sx = quantize(rng.standard_normal(spec.input_shape), 8)
    w, _ = quantize(rng.standard_normal(spec.weight_shape), 8)
    assert x.dtype == np.int64 and np.abs(x).max() == 127 and sx > 0
    s = valid_schedules(random.Random(3), spec, Target.cim(arch), 1)[0]
    y = simulate(spec, s, Target.cim(arch), x, w).output
    assert np.array_equal(y, reference(spec, x, w))
    assert quantize(np.zeros(3), 8)[1] == 1.0


@pytest.mark.parametrize("arch_name", list(ARCHES))
def test_cells_round_trip(arch_name):
    arch = ARCHES[arch_name]
    lo, hi = -(2 ** (arch.weight_bits - 1)), 2 ** (arch.weight_bits - 1)
    w = np.arange(lo, hi)
    cells = encode_cells(w, arch)
    assert cells.shape == (w.size, arch.cells_per_weight)
    assert cells.min() >= 0 and cells.max() < 2 ** arch.cell_bits
    assert np.array_equal(decode_cells(cells, arch), w)
    expected = "differential" if arch_name.startswith("diff") else "offset"
    assert cell_encoding(arch) == expected
    if expected == "offset":  # u = w + 2**(b-1), least significant digit first
        assert list(encode_cells(np.array(-(2 ** (arch.weight_bits - 1)) + 6), arch)[:2]) == [2, 1]
    else:  # w+ in the first half, w- in the second
        half = arch.cells_per_weight // 2
        assert encode_cells(np.array(-5), arch)[:half].sum() == 0
        assert list(encode_cells(np.array(-5), arch)[half:half + 2]) == [1, 1]


def test_unrepresentable_mapping_and_bad_inputs_are_refused():
    with pytest.raises(MacoError, match="not 3"):
        CimArch(weight_bits=4, cells_per_weight=3, **SMALL)
    arch = ARCHES["offset4"]
    with pytest.raises(MacoError, match=r"w_q must lie in \[-8, 7\]"):
        encode_cells(np.array([8]), arch)
    spec = ConvSpec(n=1, c=2, h=3, w=3, k=2, kh=1, kw=1)
    s = _one_block(spec)
    t = Target.cim(arch)
    x, w = np.zeros(spec.input_shape, np.int64), np.zeros(spec.weight_shape, np.int64)
    with pytest.raises(MacoError, match="x_q must have shape"):
        simulate(spec, s, t, x[:, :1], w)
    with pytest.raises(MacoError, match="x_q must hold ints"):
        simulate(spec, s, t, x.astype(np.float32), w)
    with pytest.raises(MacoError, match=r"x_q must lie in \[-128, 127\]"):
        simulate(spec, s, t, x + 128, w)
    with pytest.raises(MacoError, match="cim target"):
        simulate(spec, s, Target.h100(), x, w)


def _one_block(spec: ConvSpec, layout: str = "NCHW") -> Schedule:
    """Everything in one tile and one block on one core."""
    ext = axis_extents(spec)
    return Schedule(kind="cim", spatial=tuple((1, 1, ext[a]) for a in SPATIAL_AXES),
                    reduction=tuple((1, ext[a]) for a in REDUCTION_AXES), loop_order=ORDER, layout=layout)


def test_counts_block_resident_across_tiles():
    """Reduction and k fit one block; the 4x4 output is split over 2 cores (oh) and 2x2 outer
    tiles of 1x2: each core writes its block once and reuses it for every tile."""
    spec = ConvSpec(n=1, c=2, h=4, w=4, k=2, kh=3, kw=3, padding=1)
    arch = CimArch(cores=2, crossbars=4, rows=32, columns=8, cell_bits=2, weight_bits=4,
                   dma_burst=8, input_buffer=512, psum_buffer=1024)  # 4 weight columns
    s = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)),
                 reduction=((1, 2), (1, 3), (1, 3)), loop_order=ORDER)
    x, w = random_data(np.random.default_rng(0), spec, arch)
    res = simulate(spec, s, Target.cim(arch), x, w)
    assert np.array_equal(res.output, reference(spec, x, w))
    c = res.counts
    assert (c.weight_loads, c.crossbar_writes) == (2, 2)
    assert c.weight_cells == 2 * 18 * 2 * 2 and c.max_core_weight_cells == 18 * 2 * 2
    assert (c.mvms, c.max_core_mvms) == (16, 8)  # one crossbar per pixel
    assert c.input_loads == 8 and c.output_elements == 32
    assert c.peak_psums == 4  # one tile of 1x2 pixels x 2 filters; reduction in one step
    # output tiles: 2 filters x 1 row x 2 columns, NCHW: 2 runs of 2 int32 = 8 B, one burst each
    assert c.output_transactions == 8 * 2
    # the tile (oh, ow..ow+1) reads rows oh-1..oh+1 (clipped) and 4 columns (clipped to 3 at the
    # sides... ow in {0, 2}: columns -1..2 -> 0..2 and 1..4 -> 1..3), for 2 channels
    rows = {0: 2, 1: 3, 2: 3, 3: 2}
    assert c.input_elements == sum(rows[oh] * 3 * 2 for oh in range(4) for _ in range(2))
    assert c.peak_input_bytes == 3 * 3 * 2


def test_counts_per_pixel_reduction_innermost():
    """Per-pixel tiles, reduction innermost in blocks of one tap and one channel: every iteration
    loads a new block, loads = pixels * blocks, and every pixel's window is a single element."""
    spec = ConvSpec(n=1, c=2, h=3, w=3, k=2, kh=2, kw=2)
    arch = ARCHES["offset4"]
    s = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 1)),
                 reduction=((2, 1), (2, 1), (2, 1)), loop_order=ORDER, layout="NHWC")
    x, w = random_data(np.random.default_rng(1), spec, arch)
    res = simulate(spec, s, Target.cim(arch), x, w)
    assert np.array_equal(res.output, reference(spec, x, w))
    c = res.counts
    pixels, blocks = 4, 8
    assert c.weight_loads == pixels * blocks == c.crossbar_writes
    assert c.weight_cells == pixels * blocks * 1 * 2 * arch.cells_per_weight
    assert c.input_loads == pixels * blocks and c.input_elements == pixels * blocks
    assert c.input_transactions == pixels * blocks and c.mvms == pixels * blocks
    assert c.peak_psums == 2 and c.peak_input_bytes == 1
    # NHWC: a pixel's 2 filters are adjacent, 8 B = one burst
    assert c.output_elements == 8 and c.output_transactions == 4


def test_window_in_padding_counts_nothing():
    """A 1x1 input with padding 1: of the 3x3 per-pixel windows only the centre holds an element.
    Every pixel is a new window index, so 9 fetches, 8 of them of padding only (0 elements)."""
    spec = ConvSpec(n=1, c=1, h=1, w=1, k=1, kh=1, kw=1, padding=1)
    arch = ARCHES["offset8"]
    s = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 3, 1), (1, 3, 1)),
                 reduction=((1, 1), (1, 1), (1, 1)), loop_order=ORDER)
    x, w = np.array([[[[-7]]]]), np.array([[[[3]]]])
    res = simulate(spec, s, Target.cim(arch), x, w)
    assert res.output[0, 0].tolist() == [[0, 0, 0], [0, -21, 0], [0, 0, 0]]
    c = res.counts
    assert (c.input_elements, c.input_transactions, c.input_loads) == (1, 1, 9)
    assert c.mvms == 9 and c.weight_loads == 1  # padded pixels still run through the crossbar
    # a tile entirely in the padding: the window of outputs (0, 0..2) reads row -1 only
    s_row = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 3, 1), (1, 1, 3)),
                     reduction=((1, 1), (1, 1), (1, 1)), loop_order=ORDER)
    c = simulate(spec, s_row, Target.cim(arch), x, w).counts
    assert (c.input_loads, c.input_elements, c.input_transactions) == (3, 1, 1)


@pytest.mark.parametrize("layout, input_tx, output_tx", [("NCHW", 2, 5), ("NHWC", 9, 9)])
def test_transactions_by_layout(layout, input_tx, output_tx):
    """Blocks of one channel over the whole 3x3 plane (1-byte inputs, 8-byte bursts): in NCHW a
    window's 9 elements are one run (2 bursts), in NHWC 9 runs of 1 (the 2 channels interleave).
    An output tile is one filter's 3x3 int32 outputs: one run of 36 B in NCHW (5 bursts), 9 runs
    of 4 B in NHWC (the 2 filters interleave)."""
    spec = ConvSpec(n=1, c=2, h=3, w=3, k=2, kh=1, kw=1)
    arch = ARCHES["offset8"]
    s = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 2, 1), (1, 1, 3), (1, 1, 3)),
                 reduction=((2, 1), (1, 1), (1, 1)), loop_order=ORDER, layout=layout)
    x, w = random_data(np.random.default_rng(2), spec, arch)
    res = simulate(spec, s, Target.cim(arch), x, w)
    assert np.array_equal(res.output, reference(spec, x, w))
    c = res.counts
    assert c.input_loads == 4 and c.input_elements == 36  # k outer: each channel's window twice
    assert c.input_transactions == 4 * input_tx
    assert c.output_elements == 18 and c.output_transactions == 2 * output_tx


def test_overflows_raise_naming_the_buffer():
    spec = ConvSpec(n=1, c=2, h=8, w=8, k=8, kh=1, kw=1)  # 512 outputs
    arch = ARCHES["offset4"]  # 256 partial sums, 512 B input buffer
    target = Target.cim(arch)
    x, w = random_data(np.random.default_rng(3), spec, arch)
    # 2 k tiles of 4 x 64 outputs, one after the other: 256 partial sums and a 128 B window fit
    fits = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 2, 4), (1, 1, 8), (1, 1, 8)),
                    reduction=((1, 2), (1, 1), (1, 1)), loop_order=ORDER)
    assert np.array_equal(simulate(spec, fits, target, x, w).output, reference(spec, x, w))
    # c outermost with 2 trips keeps both k tiles alive: 512 partial sums
    s = Schedule(kind="cim", spatial=fits.spatial, reduction=((2, 1), (1, 1), (1, 1)),
                 loop_order=("c",) + ORDER[:5] + ("kh", "kw"))
    assert any("psum buffer" in p for p in s.problems(spec, target))
    with pytest.raises(MacoError, match="psum buffer"):
        simulate(spec, s, target, x, w)
    with pytest.raises(MacoError, match="512 live partial sums .* psum buffer"):
        simulate(spec, s, target, x, w, validate=False)
    small_in = Target.cim(CimArch(weight_bits=4, **{**SMALL, "input_buffer": 100}))
    with pytest.raises(MacoError, match="input window of 128 B overflows the 100 B input buffer"):
        simulate(spec, fits, small_in, x, w, validate=False)
    # 8 filters on a chip whose crossbar holds 2 weight columns: 4 crossbars, the core has 1
    wide = Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (1, 1, 8), (2, 4, 1), (1, 8, 1)),
                    reduction=((1, 2), (1, 1), (1, 1)), loop_order=ORDER)
    few_xbars = Target.cim(CimArch(weight_bits=8, **{**SMALL, "crossbars": 1}))
    with pytest.raises(MacoError, match="needs 4 crossbars"):
        simulate(spec, wide, few_xbars, *random_data(np.random.default_rng(4), spec, few_xbars.cim_arch),
                 validate=False)
    one_core = Target.cim(CimArch(weight_bits=4, **{**SMALL, "cores": 1}))
    with pytest.raises(MacoError, match="binds 2 cores"):
        simulate(spec, wide, one_core, x, w, validate=False)


def test_observed_overflows_agree_with_schedule_problems():
    """Executing a schedule overflows (crossbars, input or psum buffer, cores) exactly when
    Schedule.problems says it is invalid: the static footprint is what the execution reaches."""
    rng, nrng = random.Random(11), np.random.default_rng(11)
    seen = {True: 0, False: 0}
    for arch in (ARCHES["offset4"], ARCHES["diff8"]):
        target = Target.cim(arch)
        for _ in range(40):
            spec = random_spec(rng)
            x, w = random_data(nrng, spec, arch)
            for _ in range(3):
                s = random_schedule(rng, spec, arch.cores + 1)
                problems = s.problems(spec, target)
                try:
                    simulate(spec, s, target, x, w, validate=False)
                    raised = None
                except MacoError as e:
                    raised = str(e)
                assert (raised is not None) == bool(problems), (spec, s.describe(), problems, raised)
                seen[bool(problems)] += 1
    assert seen[True] >= 10 and seen[False] >= 10


def test_default_chip_example_layer_is_fast():
    """n1_c16_h12_w12_k32_r3_p1 on the default chip (4 cores, 9 crossbars of 64x64 2-bit cells)."""
    import time
    spec = ConvSpec(n=1, c=16, h=12, w=12, k=32, kh=3, kw=3, padding=1)
    target = Target.cim()
    x, w = random_data(np.random.default_rng(5), spec, target.cim_arch)
    ref = reference(spec, x, w)
    for s in (Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (2, 1, 16), (2, 1, 6), (1, 1, 12)),
                       reduction=((1, 16), (1, 3), (1, 3)), loop_order=ORDER),
              Schedule(kind="cim", spatial=((1, 1, 1), (1, 1, 1), (2, 1, 16), (2, 3, 2), (1, 3, 4)),
                       reduction=((2, 8), (3, 1), (1, 3)), loop_order=ORDER, layout="NHWC")):
        t0 = time.perf_counter()
        res = simulate(spec, s, target, x, w)
        assert time.perf_counter() - t0 < 1.0
        assert np.array_equal(res.output, ref)
    assert res.counts.weight_loads == 4 * 9 * 6  # per core: 9 tiles x 6 blocks, reduction innermost
