"""Latency sources: the timed conv computes torch's result in either layout, conversions move
data correctly, and the conversion model recovers a known size law."""
import math

import numpy as np
import pytest
import torch

from maco.core.errors import MacoError
from maco.layouts.latency import (LAYOUTS, ConversionModel, check_device, check_layout,
                                  conv_callable, measure_conv, measure_conversion,
                                  measure_layouts, pool_timings, predict_conversion)
from maco.core.spec import ConvSpec
from maco.core.timing import Timing

SMALL = ConvSpec.parse("n1_c8_h12_w12_k16_r3_s2_p1")


@pytest.mark.parametrize("text", ["n2_c8_h12_w12_k16_r3_s2_p1", "n1_c8_h10_w9_k8_r3_p2_d2_g8",
                                  "n1_c12_h7_w7_k6_r1x3_p0x1_g3"])
def test_conv_in_each_layout_matches_reference(text):
    spec = ConvSpec.parse(text)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(spec.input_shape, generator=gen), torch.randn(spec.weight_shape, generator=gen)
    ref = torch.nn.functional.conv2d(x, w, None, spec.stride, spec.padding, spec.dilation, spec.groups)
    for layout in LAYOUTS:
        out = conv_callable(spec, layout)()
        assert out.shape == spec.output_shape
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
        assert out.is_contiguous(memory_format=torch.channels_last) == (layout == "NHWC")


def test_measure_conv_and_layouts_give_positive_timings():
    for layout in ("nchw", "NHWC"):
        t = measure_conv(SMALL, layout, repeats=3, min_run_time=1e-4)
        assert t.median > 0 and t.min <= t.median <= t.max and t.repeats == 3
    both = measure_layouts(SMALL, rounds=2, repeats=2, min_run_time=1e-4)
    assert set(both) == set(LAYOUTS) and all(t.repeats == 4 and t.median > 0 for t in both.values())


def test_pool_timings_takes_median_of_rounds_and_extremes():
    ts = [Timing(1.0, 0.9, 1.2, 0, 3, 5), Timing(3.0, 2.0, 4.0, 0, 3, 7), Timing(2.0, 1.5, 2.5, 0, 3, 6)]
    p = pool_timings(ts)
    assert (p.median, p.min, p.max, p.repeats, p.number) == (2.0, 0.9, 4.0, 9, 7)
    assert math.isclose(p.stdev, np.std([1.0, 3.0, 2.0]))


def test_bad_layout_device_and_shape_are_named():
    with pytest.raises(MacoError, match="'NCWH'"):
        check_layout("NCWH")
    with pytest.raises(MacoError, match="'tpu'"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(MacoError, match="cuda"):
            measure_conv(SMALL, "NCHW", device="cuda")
    with pytest.raises(MacoError, match=r"\(1, 2, 3\)"):
        measure_conversion((1, 2, 3), "NCHW", "NHWC")


def test_conversion_measurement():
    assert measure_conversion((1, 16, 8, 8), "NCHW", "NCHW").median == 0.0
    t = measure_conversion((1, 16, 32, 32), "NCHW", "NHWC", repeats=3, min_run_time=1e-4)
    assert t.median > 0 and t.repeats == 3


def _law(shape, src, dst):
    """A made-up cost: 2 us + bytes at 5 GB/s, NHWC->NCHW slower the more channels it gathers
    (as measured: ~2.5x from 16 to 1024 channels)."""
    n, c, h, w = shape
    slow = (c / 16) ** 0.22 if src == "NHWC" else 1.0
    return 2e-6 + slow * 4 * n * c * h * w / 5e9


def test_conversion_model_recovers_a_size_law_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    shapes = [(1, int(c), int(s), int(s)) for c in (3, 16, 64, 128, 256, 512) for s in (7, 14, 28, 56, 112)]
    pairs = [("NCHW", "NHWC"), ("NHWC", "NCHW")]
    samples = [(sh, a, b, _law(sh, a, b) * math.exp(rng.normal(0, 0.03))) for sh in shapes for a, b in pairs]
    samples[3] = (samples[3][0], samples[3][1], samples[3][2], samples[3][3] * 20)  # one spike
    model = ConversionModel.fit(samples)
    for sh in [(1, 96, 40, 40), (1, 384, 14, 14), (2, 64, 56, 56), (1, 32, 100, 100)]:
        for a, b in pairs:
            assert model.predict(sh, a, b) == pytest.approx(_law(sh, a, b), rel=0.25), (sh, a, b)
    big = (8, 512, 112, 112)  # beyond the data: time grows as bytes
    assert model.predict(big, "NCHW", "NHWC") == pytest.approx(_law(big, "NCHW", "NHWC"), rel=0.3)
    assert model.predict((1, 64, 8, 8), "NHWC", "NHWC") == 0.0
    assert model.predict((1, 1, 8, 8), "NCHW", "NHWC") == 0.0  # same memory order
    model.save(tmp_path / "conv.json")
    again = ConversionModel.load(tmp_path / "conv.json")
    assert again.predict((1, 96, 40, 40), "NHWC", "NCHW") == model.predict((1, 96, 40, 40), "NHWC", "NCHW")
    only_one = ConversionModel.fit([s for s in samples if s[1] == "NCHW"])
    with pytest.raises(MacoError, match="NHWC->NCHW"):
        only_one.predict((1, 8, 8, 8), "NHWC", "NCHW")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(MacoError, match="not a conversion model"):
        ConversionModel.load(tmp_path / "bad.json")


def test_calibrated_conversion_model_tracks_measurement():
    shapes = [(1, c, s, s) for c in (16, 64, 256) for s in (14, 28, 56)]
    model = ConversionModel.calibrate(shapes=shapes, min_run_time=2e-4)
    shape = (1, 64, 56, 56)
    measured = measure_conversion(shape, "NCHW", "NHWC").median
    # a loose band: the machine is shared, but a wrong model is off by orders of magnitude
    assert measured / 4 < model.predict(shape, "NCHW", "NHWC") < measured * 4
    assert predict_conversion(shape, "NCHW", "NHWC", model=model) == model.predict(shape, "NCHW", "NHWC")


def test_steady_allocator_keeps_big_tensors_on_the_heap():
    """After steady_allocator, a 64 MiB tensor comes from the heap (reused across calls), not
    from a fresh mmap that is page-faulted in every time."""
    import ctypes
    import ctypes.util

    from maco.core.timing import steady_allocator

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    assert steady_allocator() is True and steady_allocator() is True  # idempotent
    before = libc.mallinfo2().hblkhd
    x = torch.empty(16 << 20)  # 64 MiB of fp32, over the largest dynamic mmap threshold
    assert libc.mallinfo2().hblkhd - before < 64 << 20  # not an mmap'ed block
    del x


def test_write_atomic_replaces_whole_and_honours_the_umask(tmp_path):
    import os

    from maco.core.files import write_atomic

    path = tmp_path / "sub" / "result.csv"
    write_atomic(path, b"a,b\n")
    write_atomic(path, b"c,d\n")
    assert path.read_bytes() == b"c,d\n" and [p.name for p in path.parent.iterdir()] == ["result.csv"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
