"""The Winograd F(2x2,3x3) kernel against torch on many shapes and every epilogue, its refusals and
fallbacks, and a ResNet whose 3x3 convs it runs: chosen by timing in the model, saved, loaded."""
import json
import random
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import maco
from maco import kernels
from maco.deploy.deployment import describe
from maco.core.errors import MacoError
from maco.deploy.kernel_choice import MIN_GAIN, faster_winograd
from maco.kernels.winograd import (BLOCK_BYTES, TILE_SIZES, TILES, Split, WinogradKernel, WinogradPlan, filter_vectors,
                                   transforms, winograd_can_run)
from maco.layouts import fuse
from maco.layouts.deploy import plan
from maco.layouts.fusion import FusedConv2d
from maco.layouts.maco_modules import MacoConv2d, MacoWinograd2d, swap_module, winograd_module_can_run
from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
from maco.core.spec import ConvSpec

HOST = kernels.host_target()
ACT = {"none": lambda y: y, "relu": torch.relu, "relu6": lambda y: y.clamp(0, 6),
       "silu": torch.nn.functional.silu, "hardswish": torch.nn.functional.hardswish, "gelu": torch.nn.functional.gelu}


def _cases(seed: int, count: int):
    """Random eligible shapes: batch 1-2, odd and even sizes down to 1 (a ragged last tile),
    channels in 1-4 vectors, each epilogue."""
    rng = random.Random(seed)
    for _ in range(count):
        lanes = rng.choice([8, 16])
        n, h, w = rng.choice([1, 1, 2]), rng.randint(1, 17), rng.randint(1, 17)
        c, k = lanes * rng.randint(1, 4), lanes * filter_vectors(lanes) * rng.randint(1, 3)
        yield (ConvSpec.parse(f"n{n}_c{c}_h{h}_w{w}_k{k}_r3_p1"), lanes, rng.random() < 0.7,
               rng.choice(["none", "relu", "relu6"]), rng.random() < 0.5)


RESNET = [(s, 16, True, "relu", r) for s, _ in distinct_convs(conv_layers(build("resnet18"), example_input(1)))
          if winograd_can_run(s) for r in (False, True)]


def test_the_transforms_compute_a_correlation_exactly():
    """A^T ((G g) * (B^T d)) = the valid correlation of d with g, for every tile and filter size, in
    exact rational arithmetic (so float64 U and the integer B^T, A^T in C carry no error of their
    own); F(4, 3) is Lavin's."""
    rng = random.Random(3)
    for r, sizes in TILE_SIZES.items():
        for m in sizes:
            t = transforms(m, r)
            a = m + r - 1
            bt, g_t, at = t["BT"], t["G"], t["AT"]
            assert (len(bt), len(g_t), len(at)) == (a, a, m)
            for _ in range(5):
                d = [rng.randint(-9, 9) for _ in range(a)]
                g = [rng.randint(-9, 9) for _ in range(r)]
                u = [sum(g_t[i][q] * g[q] for q in range(r)) for i in range(a)]
                v = [sum(bt[i][q] * d[q] for q in range(a)) for i in range(a)]
                y = [sum(at[i][q] * u[q] * v[q] for q in range(a)) for i in range(m)]
                assert y == [sum(d[i + q] * g[q] for q in range(r)) for i in range(m)], (m, r)
    assert transforms(4, 3)["BT"][0] == (4, 0, -5, 0, 1, 0) and transforms(4, 3)["G"][1] == (Fraction(-1, 6),) * 3
    with pytest.raises(MacoError, match="F\\(9, 5\\)"):
        transforms(9, 5)


CASES = RESNET + list(_cases(0, 24)) + [(ConvSpec.parse(t), 16, True, "relu", False) for t in (
    "n1_c64_h27_w27_k192_r5_p2", "n1_c16_h7_w5_k64_r5_p2", "n2_c32_h3_w9_k128_r5_p2", "n1_c16_h1_w1_k64_r5_p2")] + [
    (ConvSpec.parse("n1_c16_h13_w10_k64_r3_p1"), 16, True, "silu", True),
    (ConvSpec.parse("n2_c16_h9_w7_k32_r3_p1"), 8, False, "hardswish", False),
    (ConvSpec.parse("n1_c16_h11_w9_k64_r5_p2"), 16, True, "silu", False),
    (ConvSpec.parse("n1_c8_h6_w12_k16_r3_p1"), 8, True, "gelu", True),
    # panels of U beyond an L1d, read in chunks of channels (test_wide_panels_are_read_in_chunks)
    (ConvSpec.parse("n1_c144_h13_w9_k64_r3_p1"), 16, True, "relu", True),
    (ConvSpec.parse("n1_c1032_h6_w5_k16_r3_p1"), 8, True, "none", False)]


def test_wide_panels_are_read_in_chunks():
    """A register block's panel of U (C x 64 floats with 16 lanes) larger than an L1d is taken in
    chunks of channels by all of a block's row blocks in turn; one that fits, in one pass."""
    def step(text: str, lanes: int = 16) -> str:
        source = WinogradPlan(ConvSpec.parse(text), lanes=lanes).source
        return source.split(" {  /* a chunk of the panel")[0].rsplit("c0 += ", 1)[1]
    assert step("n1_c512_h7_w7_k512_r3_p1") == "32)"
    assert step("n1_c144_h13_w9_k64_r3_p1") == "16)"  # 144 is not a multiple of 32
    assert step("n1_c1032_h6_w5_k16_r3_p1", lanes=8) == "8)"
    assert step("n1_c128_h28_w28_k128_r3_p1") == "128)"  # 32 KiB: one pass



@pytest.mark.parametrize("text,lanes,chunk,lines", [("n1_c512_h7_w7_k512_r3_p1", 16, 32, 4),
                                                    ("n1_c128_h28_w28_k128_r3_p1", 16, 128, 4),
                                                    ("n1_c1032_h6_w5_k16_r3_p1", 8, 8, 1)])
def test_u_is_prefetched_a_chunk_ahead_shared_out_over_the_register_blocks(text, lanes, chunk, lines):
    """Each register block prefetches its share of the next chunk's lines of U (one chunk ahead,
    g of `groups` blocks), not all of them in the first block's pass: every row of a chunk is
    fetched once by the blocks together, a line at a time. After the last chunk of a part of the
    filters comes the next element's part, not the other part's panel that follows in memory."""
    from maco.kernels.winograd import U_PREFETCH_HINT
    source = WinogradPlan(ConvSpec.parse(text), lanes=lanes).source
    found = re.findall(r"for \(long l = g; l < (\d+); l \+= groups\) "
                       r"__builtin_prefetch\(un \+ cc \* (\d+) \+ l \* 16, 0, (\d)\);", source)
    row = lanes * filter_vectors(lanes)
    assert found and set(found) == {(str(lines), str(row), str(U_PREFETCH_HINT))}
    spec = ConvSpec.parse(text)
    # within a part the next chunk (the part's panels follow each other), after it the next element's part
    assert (f"? ue + {chunk * row} : u + (long)(el + 1) * {spec.c * spec.k} + k1 * {spec.c} - c0 * {row};") in source
    assert len(found) == 6  # one per register block's row count (ROWS = 6)
    assert source.count("__builtin_prefetch") == len(found)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("spec,lanes,bias,activation,residual", CASES)
def test_winograd_equals_torch(spec, lanes, bias, activation, residual, m):
    plan_ = WinogradPlan(spec, bias, activation, residual, HOST.cores, lanes, m=m)
    kernel = WinogradKernel(plan_, HOST)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    w = torch.randn(spec.weight_shape, generator=gen) / (3 * spec.c ** 0.5)
    b = torch.randn(spec.k, generator=gen) if bias else None
    r = torch.randn(spec.output_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    want = torch.nn.functional.conv2d(x, w, b, padding=spec.padding)
    want = ACT[activation](want + r if residual else want)
    y = torch.full(spec.output_shape, float("nan")).contiguous(memory_format=torch.channels_last)
    for _ in range(2):  # the second call reuses the thread's block buffers
        kernel(x, plan_.pack_weight(w.numpy()), None if b is None else b.numpy(), r if residual else None, y)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_filter_transform_is_g_g_gt():
    """U = G g G^T for one filter by hand: a centre tap of 1 gives G[:, 1] G[:, 1]^T."""
    spec = ConvSpec.parse("n1_c16_h4_w4_k128_r3_p1")
    w = np.zeros(spec.weight_shape, np.float32)
    w[67, 5, 1, 1] = 1.0
    u = WinogradPlan(spec).transformed_weight(w)
    assert WinogradPlan(spec, m=4).transformed_weight(w).shape == (36, 16, 128)
    assert u.shape == (16, 16, 128)
    col = np.array([0.0, 0.5, -0.5, 0.0])
    assert np.allclose(u[:, 5, 67].reshape(4, 4), np.outer(col, col))
    assert np.count_nonzero(u) == np.count_nonzero(np.outer(col, col))
    # packed: per element, one contiguous C x 64 panel per register block of 64 filters
    packed = WinogradPlan(spec).pack_weight(w)
    assert packed.shape == (16, 2, 16, 64) and packed.dtype == np.float32
    assert np.array_equal(packed[:, 1, 5, 3], u[:, 5, 67].astype(np.float32))
    assert np.array_equal(packed.transpose(0, 2, 1, 3).reshape(16, 16, 128), u.astype(np.float32))


def test_refusals_name_the_value():
    good = ConvSpec.parse("n1_c16_h8_w8_k64_r3_p1")
    for text in ("n1_c16_h8_w8_k64_r3_s2_p1", "n1_c16_h8_w8_k64_r3x3_s2_p1", "n1_c16_h8_w8_k64_r5_p1",
                 "n1_c16_h8_w8_k64_r7_p3", "n1_c16_h8_w8_k64_r3x5_p1",
                 "n1_c16_h8_w8_k64_r3_p0", "n1_c8_h8_w8_k64_r3_p1", "n1_c16_h8_w8_k32_r3_p1",
                 "n1_c16_h8_w8_k64_r3_p2_d2", "n1_c32_h8_w8_k64_r3_p1_g2"):
        assert not winograd_can_run(ConvSpec.parse(text))
        with pytest.raises(MacoError, match=re.escape(str(ConvSpec.parse(text)))):
            WinogradPlan(ConvSpec.parse(text))
    with pytest.raises(MacoError, match="'gelu'"):
        WinogradPlan(good, activation="mish")
    with pytest.raises(MacoError, match="0"):
        WinogradPlan(good, threads=0)
    with pytest.raises(MacoError, match="vectors of 12"):
        WinogradPlan(good, lanes=12)
    assert winograd_can_run(good) and winograd_can_run(ConvSpec.parse("n1_c8_h8_w8_k16_r3_p1"), lanes=8)
    assert not winograd_module_can_run(nn.Conv2d(16, 64, 3, padding=1, padding_mode="reflect"), good, HOST)


def test_the_work_split_keeps_every_thread_busy():
    """Many tiles: blocks of at most TILES tiles, as many per thread; fewer blocks than threads:
    the filters split into parts (whole register blocks), so each thread reads part of U; still
    fewer work items than threads: smaller blocks."""
    deep = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1")  # 16 tiles: one block
    assert WinogradPlan(deep, threads=2).split == Split(16, 1, 2)
    assert WinogradPlan(deep, threads=4).split == Split(16, 1, 4)
    assert WinogradPlan(deep, threads=1).split == Split(16, 1, 1)
    # one register block of filters: two blocks of tiles for two threads
    assert WinogradPlan(ConvSpec.parse("n1_c64_h8_w8_k64_r3_p1"), threads=2).split == Split(8, 2, 1)
    wide = WinogradPlan(ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1"), threads=2).split
    assert wide.blocks % 2 == 0 and wide.tiles <= TILES[4] and wide.tiles * wide.blocks >= 28 * 28 and wide.k_parts == 1
    assert WinogradPlan(deep, threads=2, tiles_per_block=5, k_parts=4).split == Split(4, 4, 4)
    with pytest.raises(MacoError, match="k_parts=3 does not split 512"):
        WinogradPlan(deep, k_parts=3)
    with pytest.raises(MacoError, match="tiles_per_block must be a positive int, got 0"):
        WinogradPlan(deep, tiles_per_block=0)
    with pytest.raises(MacoError, match="output tiles of 3"):
        WinogradPlan(deep, m=3)
    with pytest.raises(MacoError, match="output tiles of 2.0"):
        WinogradPlan(deep, m=2.0)
    assert WinogradPlan(deep, threads=2, m=4).split == Split(4, 1, 2)  # 7x7 in 4x4 tiles: 2 x 2
    # F(4x4, 3x3) past one block: a thread's share of the tiles in one block, V and M at most BLOCK_BYTES
    assert WinogradPlan(ConvSpec.parse("n1_c128_h28_w28_k128_r3_p1"), threads=2, m=4).split == Split(25, 2, 1)
    big = WinogradPlan(ConvSpec.parse("n1_c256_h56_w56_k256_r3_p1"), threads=2, m=4)
    assert big.split == Split(49, 4, 1) and 4 * big.elements * 49 * (256 + 256) <= BLOCK_BYTES
    assert WinogradPlan(ConvSpec.parse("n1_c256_h14_w14_k256_r3_p1"), threads=2, m=4).split == Split(16, 1, 2)
    assert WinogradPlan(ConvSpec.parse("n1_c128_h28_w28_k128_r5_p2"), threads=2, m=4).split.tiles <= TILES[8]


@pytest.mark.parametrize("m", [2, 4])
def test_sixteen_threads_all_work_on_the_deep_layers(m):
    """On a 16-core host the deep layers' few tiles and whole register blocks of filters left 8 or
    12 of 16 threads idle (7x7x512 in F(2x2): 8 work items; 14x14x256 in F(4x4): 4); now every
    thread has one, and two threads split exactly as before."""
    for text in ("n1_c512_h7_w7_k512_r3_p1", "n1_c256_h14_w14_k256_r3_p1", "n1_c128_h28_w28_k128_r3_p1",
                 "n1_c256_h13_w13_k256_r3_p1", "n1_c512_h14_w14_k512_r3_p1"):
        spec = ConvSpec.parse(text)
        split = WinogradPlan(spec, threads=16, m=m).split
        items = split.blocks * split.k_parts
        assert items >= 14 and (items <= 16 or items % 16 == 0), (text, split)
        assert split.tiles * split.blocks >= spec.n * -(-spec.h // m) * -(-spec.w // m)
    assert WinogradPlan(ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1"), threads=16).split == Split(8, 2, 8)
    assert WinogradPlan(ConvSpec.parse("n1_c256_h14_w14_k256_r3_p1"), threads=16, m=4).split == Split(4, 4, 4)


@pytest.mark.parametrize("spec_text,m", [("n1_c64_h7_w7_k128_r3_p1", 2), ("n1_c64_h14_w14_k128_r3_p1", 4)])
def test_a_sixteen_thread_split_computes_the_same_conv(spec_text, m):
    """Blocks made smaller for 16 threads (run here on whatever cores there are) give torch's conv."""
    spec = ConvSpec.parse(spec_text)
    plan_ = WinogradPlan(spec, True, "relu", False, 16, 16, m=m)
    assert plan_.split.blocks * plan_.split.k_parts == 16 and plan_.split.blocks > 1
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(spec.weight_shape, generator=gen) / 17, torch.randn(spec.k, generator=gen)
    want = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1))
    y = torch.full(spec.output_shape, float("nan")).contiguous(memory_format=torch.channels_last)
    WinogradKernel(plan_, HOST)(x, plan_.pack_weight(w.numpy()), b.numpy(), None, y)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("tiles,parts,m", [(1, 1, 2), (5, 2, 2), (7, 3, 4), (64, 3, 2), (None, 1, 4), (3, 6, 4)])
def test_every_split_computes_the_same_conv(tiles, parts, m):
    spec = ConvSpec.parse("n2_c32_h9_w11_k384_r3_p1")
    plan_ = WinogradPlan(spec, True, "relu", True, 2, 16, tiles_per_block=tiles, k_parts=parts, m=m)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(spec.weight_shape, generator=gen) / 17, torch.randn(spec.k, generator=gen)
    r = torch.randn(spec.output_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    want = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1) + r)
    y = torch.full(spec.output_shape, float("nan")).contiguous(memory_format=torch.channels_last)
    WinogradKernel(plan_, HOST)(x, plan_.pack_weight(w.numpy()), b.numpy(), r, y)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_planner_sees_winograd_where_it_beats_torch(monkeypatch):
    """with_winograd puts Winograd's time into the NHWC entries of the 3x3 stride-1 convs it beats
    torch on (not NCHW, not other convs, not where it loses), so that the plan keeps them NHWC."""
    from maco.deploy import kernel_choice

    ratio = {"value": 2.0}
    monkeypatch.setattr(kernel_choice, "_round_ratios", lambda runs, rounds, before=None: [ratio["value"]] * rounds)
    three, strided = ConvSpec.parse("n1_c16_h8_w8_k64_r3_p1"), ConvSpec.parse("n1_c16_h8_w8_k64_r3_s2_p1")
    torch_s = {(three, "NCHW"): 1.0, (three, "NHWC"): 3.0, (strided, "NHWC"): 3.0}
    table = {**torch_s, (three, "NHWC"): 2.5}  # a MACO direct kernel was faster than torch there
    got, ratios = kernel_choice.with_winograd(table, torch_s, HOST)
    assert ratios == {three: 2.0} and got == {**table, (three, "NHWC"): 1.5}
    ratio["value"] = 1.1  # Winograd beats torch but not the direct kernel: the faster entry stays
    assert kernel_choice.with_winograd(table, torch_s, HOST)[0] == table
    ratio["value"] = 0.9
    assert kernel_choice.with_winograd(table, torch_s, HOST)[0] == table


def test_the_bound_orders_the_tile_sizes_and_prices_once(monkeypatch):
    """tile_order puts the tile size predict_tile prices fastest first: F(2x2) on a deep 7x7x512
    conv (F(4x4)'s U is 4x the weights), F(4x4) on an early 56x56x64 one. The host is priced
    once, at the first conv asked about, never where no conv is."""
    from maco.bounds.winograd import predict_tile
    from maco.deploy import kernel_choice

    calls = []
    monkeypatch.setattr(kernel_choice, "best_prices", lambda target: calls.append("prices") or (300e9, 30e9))
    shares = {(2, 3): 0.8, (4, 3): 0.65, (2, 5): 0.7, (4, 5): 0.5}
    monkeypatch.setattr(kernel_choice, "winograd_ceilings", lambda target, rounds: calls.append("shares") or shares)
    order = kernel_choice.tile_order(HOST)
    assert calls == []
    deep, early = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1"), ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")
    assert order(deep) == (2, 4) and order(early) == (4, 2)
    for spec in (deep, early, ConvSpec.parse("n1_c64_h27_w27_k192_r5_p2")):
        assert order(spec)[0] == predict_tile(spec, 300e9, 30e9, shares)[0]
    assert calls == ["prices", "shares"]

    def cannot(target):
        raise MacoError("could not map 2400000000 bytes per core")
    monkeypatch.setattr(kernel_choice, "best_prices", cannot)
    assert kernel_choice.tile_order(HOST)(early) == (2, 4)  # unpriced: smallest first, timing decides


def test_timing_gets_more_rounds_where_it_and_the_bound_disagree(monkeypatch):
    """faster_winograd times a tile size the bound's model prices DOUBT times slower than the
    predicted one over RETIME times the rounds, never over the short ones (F(4x4) on a deep 7x7x512
    conv: its U is 4x the weights); and it times a conv no tile size won again, over as many rounds,
    where the model prices the best tile DOUBT times faster than a direct kernel (the deep conv,
    not one of 2x2 pixels, where U costs more than it saves). Unpriced, the host gets neither."""
    from maco.deploy import kernel_choice

    monkeypatch.setattr(kernel_choice, "best_prices", lambda target: (300e9, 30e9))
    monkeypatch.setattr(kernel_choice, "winograd_ceilings", lambda target, rounds: {(2, 3): 0.8, (4, 3): 0.65})
    deep, tiny = ConvSpec.parse("n1_c512_h7_w7_k512_r3_p1"), ConvSpec.parse("n1_c512_h2_w2_k512_r3_p1")
    order = kernel_choice.tile_order(HOST)
    assert order(deep) == (2, 4) and order.slowdown(deep, 4) >= kernel_choice.DOUBT and order.slowdown(deep, 2) == 1
    assert order.gain(deep) >= kernel_choice.DOUBT > 1.0 > order.gain(tiny)
    long = 3 * kernel_choice.RETIME

    def timings(spec, f2_wins_when_long, priced=True):
        calls = []
        model = nn.Sequential(nn.Conv2d(spec.c, spec.k, 3, padding=1)).eval()
        x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)

        def fake(gm, x_, types, make, rounds, cold=False):
            made = make(model[0], x, False)  # the conv stays torch's: no tile size is swapped in
            calls.append((rounds, made and made.m))
            if made is None:
                return {}
            return {"0": 1.3 if made.m == 2 and f2_wins_when_long and rounds == long else 0.9}
        monkeypatch.setattr(kernel_choice, "_faster_modules", fake)
        tiles = kernel_choice.tile_order(HOST)
        if not priced:
            tiles._prices, tiles._priced = None, True
        return kernel_choice.faster_winograd(model, x, HOST, rounds=3, order=tiles), calls

    ratios, calls = timings(deep, True)
    assert calls == [(3, 2), (3, None), (long, 4), (long, 2)] and ratios == {"0": 1.3}
    ratios, calls = timings(deep, False)
    assert calls == [(3, 2), (3, None), (long, 4), (long, 2)] and ratios == {"0": 0.9}
    ratios, calls = timings(tiny, True)  # F(4x4) is doubted there too, but no loss is timed again
    assert calls == [(3, 2), (3, None), (long, 4), (long, None)] and ratios == {"0": 0.9}
    ratios, calls = timings(deep, True, priced=False)
    assert calls == [(3, 2), (3, 4), (long, None), (long, None)] and ratios == {"0": 0.9}


def test_the_pipeline_prices_the_host_once_for_both_winograd_passes(monkeypatch):
    """run_pipeline tries Winograd twice (in the per-layer choices, and with a kernel in every
    conv): one tile_order serves both, so the shares are timed once."""
    from maco.deploy import kernel_choice, pipeline
    from maco.tune.records import RecordStore

    calls = []
    monkeypatch.setattr(kernel_choice, "best_prices", lambda target: calls.append("prices") or (300e9, 30e9))
    monkeypatch.setattr(kernel_choice, "winograd_ceilings",
                        lambda target, rounds: calls.append("shares") or {(2, 3): 0.8, (4, 3): 0.7})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).eval()
    x = torch.randn(1, 16, 14, 14)
    run = pipeline.run_pipeline(model, x, HOST, RecordStore([], HOST), log=lambda line: None)
    assert calls == ["prices", "shares"]
    with torch.inference_mode():
        got, want = run.built.models[run.pick](x), model(x)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("first", [(4, 2), (2, 4)])
def test_faster_winograd_tries_the_predicted_tile_first(monkeypatch, first):
    """The predicted tile size is timed against what runs the conv first; the other only then,
    against whatever won: it must beat the predicted one by MIN_GAIN. A conv that already runs a
    tile size is not timed against itself."""
    from maco.deploy import kernel_choice

    conv, spec = nn.Conv2d(16, 64, 3, padding=1).eval(), ConvSpec.parse("n1_c16_h8_w8_k64_r3_p1")
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    class Order:  # the bound's order, doubting no tile size
        def __call__(self, s):
            return first if s == spec else (2, 4)

        def slowdown(self, s, m):
            return 1.0
    monkeypatch.setattr(kernel_choice, "tile_order", lambda target: Order())
    made = []

    def timed(gm, example_input, types, make, rounds, cold):
        assert cold  # U from memory, as in a model
        module = make(conv, x, False)
        made.append(module and module.m)
        made.append(make(MacoWinograd2d(conv, spec, HOST, m=first[0]), x, False))  # already runs it
        return {"conv": 1.05} if module is not None else {}  # each won (a loss is looked at again)
    monkeypatch.setattr(kernel_choice, "_faster_modules", timed)
    assert faster_winograd(nn.Module(), x, HOST) == {"conv": 1.05 * 1.05}
    assert made[:4] == [first[0], None, first[1], made[3]] and made[4:] == [None, None]  # none doubted
    assert made[3] is not None and made[3].m == first[1]


def _fused(c: int, k: int, activation: str, residual: str) -> FusedConv2d:
    conv = nn.Conv2d(c, k, 3, padding=1).eval()
    fused = FusedConv2d(conv, conv.weight.detach(), conv.bias.detach(), activation, residual)
    return fused.eval()


def test_module_runs_the_epilogue_and_falls_back_elsewhere():
    fused = _fused(16, 64, "relu", "before")
    spec = ConvSpec.from_module(fused, (1, 16, 9, 9))
    mod = MacoWinograd2d(fused, spec, HOST, preallocate=True)
    x = torch.randn(1, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    r = torch.randn(1, 64, 9, 9).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        torch.testing.assert_close(mod(x, r), fused(x, r), rtol=1e-4, atol=1e-5)
        assert mod(x, r) is mod(x, r)  # one buffer
        for args in ((torch.randn(1, 16, 9, 9), r), (x, r.contiguous()), (torch.randn(1, 16, 11, 11).contiguous(
                memory_format=torch.channels_last), torch.randn(1, 64, 11, 11))):
            torch.testing.assert_close(mod(*args), fused(*args), rtol=1e-4, atol=1e-5)
    with pytest.raises(MacoError, match="no generated Winograd kernel"):
        MacoWinograd2d(nn.Conv2d(16, 64, 3, stride=2, padding=1), ConvSpec.parse("n1_c16_h9_w9_k64_r3_s2_p1"), HOST)


def test_resnet_picks_winograd_where_it_wins_and_saves_it(tmp_path):
    model, x = build("resnet18"), example_input(1)
    fused = fuse(model, x)
    specs = [s for s, _ in distinct_convs(conv_layers(model, x))]
    p = plan(fused, x, latency={(s, lay): (1.0 if lay == "NHWC" else 2.0) for s in specs for lay in ("NCHW", "NHWC")},
             conversion=lambda shape, a, b: 1e-9)
    gm = p.apply(fused)
    layer1 = ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")
    gm_first = next(path for path, m in gm.named_modules() if isinstance(m, nn.Conv2d)
                    and (m.in_channels, m.out_channels, m.stride) == (64, 64, (1, 1)))
    swap_module(gm, gm_first, MacoConv2d(gm.get_submodule(gm_first), layer1,
                                         kernels.default_schedule(layer1, HOST, "NHWC"), HOST))
    eligible = {path for path, m in gm.named_modules() if isinstance(m, nn.Conv2d) and not path.endswith("torch_conv")
                and m.kernel_size == (3, 3) and m.stride == (1, 1)}
    ratios = faster_winograd(gm, x, HOST, rounds=1)
    assert set(ratios) == eligible | {gm_first} and len(ratios) == 13  # one of them a MacoConv2d
    for path, ratio in ratios.items():
        assert isinstance(gm.get_submodule(path), MacoWinograd2d) == (ratio >= MIN_GAIN), (path, ratio)
    if not any(isinstance(m, MacoWinograd2d) for m in gm.modules()):  # the timing kept none: swap one anyway
        swap_module(gm, gm_first, MacoWinograd2d(gm.get_submodule(gm_first).torch_conv, layer1, HOST))
    dep = describe(gm, "planned_maco", x, HOST, p)
    assert dep.winograd and all(set(v) == {"spec", "tile"} for v in dep.winograd.values())  # load derives buffers
    (tmp_path / "m.maco").write_text(json.dumps(dep.to_dict()))
    loaded = maco.load(tmp_path / "m.maco", build("resnet18"))
    with torch.inference_mode():
        want = model(x)
        for got in (gm(x), loaded(x)):
            assert float((want - got).abs().max() / want.abs().max()) < 1e-4
    assert sum(isinstance(m, MacoWinograd2d) for m in loaded.modules()) == len(dep.winograd)
    assert {p: loaded.get_submodule(p).m for p in dep.winograd} == {p: v["tile"] for p, v in dep.winograd.items()}
    path, saved = next(iter(dep.winograd.items()))
    for tile, fine in ((None, True), (4, True), (3, False), (2.0, False), ("4", False), (True, False)):
        entry = {k: v for k, v in saved.items() if k != "tile"} if tile is None else {**saved, "tile": tile}
        (tmp_path / "t.maco").write_text(json.dumps({**dep.to_dict(), "winograd": {path: entry}}))
        if fine:  # a file from before F(4x4) has no tile size: F(2x2)
            assert maco.load(tmp_path / "t.maco", build("resnet18")).get_submodule(path).m == (tile or 2)
        else:
            with pytest.raises(MacoError, match="output tiles of"):
                maco.load(tmp_path / "t.maco", build("resnet18"))
    path, saved = next(iter(dep.winograd.items()))
    dep.winograd[path] = {**saved, "spec": "n1_c16_h10_w10_k64_r3_p1"}
    (tmp_path / "bad.maco").write_text(json.dumps(dep.to_dict()))
    with pytest.raises(MacoError, match="is not the saved"):
        maco.load(tmp_path / "bad.maco", build("resnet18"))


def test_the_kernel_sum_counts_winograd_convs():
    """conv_share times a Winograd conv's kernel alone (not the torch conv it wraps) and skips it
    in the model's rest."""
    from maco.layouts.end_to_end import conv_share

    conv = nn.Conv2d(16, 64, 3, padding=1).eval()
    spec = ConvSpec.from_module(conv, (1, 16, 20, 20))
    model = nn.Sequential(MacoWinograd2d(conv, spec, HOST), nn.ReLU()).eval()
    x = torch.randn(spec.input_shape).contiguous(memory_format=torch.channels_last)
    share = conv_share(model, x, rounds=1, min_run_time=1e-4)
    assert set(share.per_conv) == {"0"} and share.convs_s > 0
    assert set(share.per_conv_cold) == {"0"} and share.convs_cold_s > 0  # also timed with its weights in memory
    assert share.to_dict()["convs_cold_s"] == share.convs_cold_s
    with torch.inference_mode():
        want = model(x).clone()
        model[0]._out = torch.zeros(spec.output_shape).contiguous(memory_format=torch.channels_last)
        from maco.layouts.end_to_end import _Skipping
        assert float(_Skipping(model).run((x,))().abs().max()) == 0.0  # the kernel did not run
        model[0]._out = None
        torch.testing.assert_close(model(x), want)  # and runs again after


# Winograd's rounding error per output tile and filter, relative to that tile's own scale: the largest
# |x| * |w| conv (float64) over the tile's outputs. Measured on n1_c64_h14_w14_k64 (3x3 and 5x5), randn
# inputs and weights: F(2x2) 8e-8 (3x3) and 7e-7 (5x5), F(4x4) 1.3e-6 at most (C = 16 to 256 alike); in a
# tile that reads an input of 1e6 (among values ~1), F(2x2) <= 6e-6 and F(4x4) <= 2e-5 of that tile's
# scale. That tile's outputs that do not read the 1e6 share its error: relative to their own scale,
# F(4x4, 3x3) measured 1e-2 there (a direct conv keeps each output's error to its own window).
TILE_ERROR = {2: 2e-6, 4: 5e-6}
HOT_TILE_ERROR = {2: 3e-5, 4: 1e-4}


def _per_tile(spec: ConvSpec, m: int, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Winograd output and its error per (filter, tile) over the tile's scale, (K, tiles down, across)."""
    plan_ = WinogradPlan(spec, False, "none", False, HOST.cores, HOST.simd_width, m=m)
    y = torch.empty(spec.output_shape).contiguous(memory_format=torch.channels_last)
    assert WinogradKernel(plan_, HOST)(x, plan_.pack_weight(w.numpy()), None, None, y)
    exact = torch.nn.functional.conv2d(x.double(), w.double(), padding=spec.padding)
    scale = torch.nn.functional.conv2d(x.double().abs(), w.double().abs(), padding=spec.padding)
    tile_max = lambda t: torch.nn.functional.max_pool2d(t, m, m, ceil_mode=True)[0]  # noqa: E731
    return y, tile_max((y.double() - exact).abs()) / tile_max(scale)


@pytest.mark.parametrize("r", [3, 5])
@pytest.mark.parametrize("m", [2, 4])
def test_winograd_error_per_output_tile(r, m):
    """Every tile within TILE_ERROR[m] of its own scale; one input of 1e6 leaves the tiles that do
    not read it bit for bit as they were (within TILE_ERROR), and those that do within
    HOT_TILE_ERROR of their (1e6-sized) scale."""
    spec = ConvSpec.parse(f"n1_c64_h14_w14_k64_r{r}_p{r // 2}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(spec.input_shape, generator=gen).contiguous(memory_format=torch.channels_last)
    w = torch.randn(spec.weight_shape, generator=gen)
    y, rel = _per_tile(spec, m, x, w)
    print(f"F({m}x{m},{r}x{r}) per-tile error: max {float(rel.max()):.2e}, median {float(rel.median()):.2e}")
    assert float(rel.max()) <= TILE_ERROR[m]
    big = x.clone()
    big[0, 5, 6, 6] = 1e6
    y_big, rel_big = _per_tile(spec, m, big, w)
    pad, tiles = r // 2, rel.shape[1]
    reads = torch.tensor([m * t - pad <= 6 <= m * t + m - 1 + pad for t in range(tiles)])
    hot = reads[:, None] & reads[None, :]  # the tiles whose input window holds (6, 6)
    assert 0 < int(hot.sum()) < hot.numel()
    print(f"  with an input of 1e6: tiles reading it {float(rel_big[:, hot].max()):.2e}, "
          f"the others {float(rel_big[:, ~hot].max()):.2e}")
    assert float(rel_big[:, hot].max()) <= HOT_TILE_ERROR[m]
    assert float(rel_big[:, ~hot].max()) <= TILE_ERROR[m]
    cold = ~hot.repeat_interleave(m, 0).repeat_interleave(m, 1)[:spec.h, :spec.w]
    assert torch.equal(y_big[..., cold], y[..., cold])


def _runtime(plan: WinogradPlan):
    """(maco_thread_scratch, maco_scratch_buffers) of the runtime that building `plan`'s kernel loads."""
    import ctypes

    from maco.kernels import cpu_build

    WinogradKernel(plan, HOST)
    runtime = cpu_build._RUNTIME[0]
    scratch, count = runtime.maco_thread_scratch, runtime.maco_scratch_buffers
    scratch.restype, scratch.argtypes, count.restype = ctypes.c_void_p, [ctypes.c_long], ctypes.c_long
    return scratch, count


def test_the_block_buffers_are_each_threads_shared_scratch():
    """Every Winograd kernel takes its block buffers from the runtime's per-thread scratch
    (kernels.cpu_build.RUNTIME), loaded before the first kernel: one buffer per thread, kept and
    grown, so that a model's Winograd layers find it in cache."""
    plan = WinogradPlan(ConvSpec.parse("n1_c16_h6_w6_k64_r3_p1"), threads=HOST.cores)
    scratch, _ = _runtime(plan)
    assert "maco_thread_scratch(" in plan.source and "aligned_alloc" not in plan.source
    small = scratch(1000)
    assert small % 64 == 0 and scratch(10) == small  # kept: a smaller request takes the same buffer
    big = scratch(1 << 20)
    assert big % 64 == 0 and scratch(1000) == big  # grown, and kept at its largest


def test_a_threads_scratch_is_freed_when_the_thread_exits():
    """A thread's scratch is freed by a destructor that runs as its OS thread exits, which can be
    after Python's join returns: the count is read once it settles."""
    import threading
    import time

    scratch, count = _runtime(WinogradPlan(ConvSpec.parse("n1_c16_h6_w6_k64_r3_p1"), threads=HOST.cores))

    def settled(want: int | None = None) -> int:
        last, deadline = count(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = count()
            if (want is None and now == last) or now == want:
                return now
            last = now
        return last

    before, inside = settled(), []
    worker = threading.Thread(target=lambda: inside.append((count(), scratch(1 << 16), scratch(1 << 18), count())))
    worker.start()
    worker.join()
    first, small, big, after = inside[0]
    assert small and big and after == first + 1  # grown: still one buffer
    assert settled(before) == before  # freed with its thread


def test_optimize_says_which_tile_sizes_run(tmp_path):
    """maco optimize's kernel count is followed by the Winograd tile sizes the model runs."""
    from types import SimpleNamespace

    from maco.deploy.optimize import _variants_built

    conv, spec = nn.Conv2d(16, 64, 3, padding=1).eval(), ConvSpec.parse("n1_c16_h8_w8_k64_r3_p1")
    model = nn.Sequential(*(MacoWinograd2d(conv, spec, HOST, m=m) for m in (4, 2, 4)))
    built = SimpleNamespace(plan=SimpleNamespace(to_json=lambda: "{}", convs=[0, 1, 2]), swapped=["a", "b", "c"],
                            models={"default": conv, "planned_maco": model}, linears={}, pools={}, depthwise={},
                            winograd={"a": 1.2, "b": 1.1, "c": 1.3}, blocks={}, squeeze=0)
    said = []
    _variants_built(built, tmp_path, said.append)
    assert said[0] == "[3/4] 3 of 3 convs, 3 of 3 3x3/5x5 convs tried with Winograd run MACO kernels"
    assert said[1] == "      Winograd tile sizes: F(4x4) on 2 convs, F(2x2) on 1 conv"
