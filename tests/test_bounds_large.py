"""Axis counts and optimal tiles without sweeping the axis (issue 16): the closed forms against a
copy of the earlier brute-force code, optimal_tile against a copy of the earlier full (x, y)
scoring, and `maco bound`'s analysis of an 8192 x 8192 layer in well under 5 s."""
from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest

from maco.core import geometry
from maco import ConvSpec, MacoError, Target
from maco import bounds
from maco.bounds import Tile, tiles
from maco.bounds.axis import Axis, spec_axes
from maco.bounds.report import analyse_levels

HUGE = "n1_c100000_h8192_w8192_k64_r3x3_p1"


# -- references: the code these replace, kept verbatim apart from names -------------------------
def ref_positions(ax: Axis) -> np.ndarray:
    pos = (np.arange(ax.out)[:, None] * ax.stride + np.arange(ax.taps)[None, :] * ax.dilation
           - ax.padding)
    pos[(pos < 0) | (pos >= ax.size)] = -1
    return pos


def ref_block_tables(ax: Axis) -> tuple[np.ndarray, np.ndarray]:
    pos = ref_positions(ax)
    reads = np.zeros((ax.out, ax.size), dtype=bool)  # reads[o, r]: output o reads input r
    rows, taps = np.nonzero(pos >= 0)
    reads[rows, pos[rows, taps]] = True
    uses = pos >= 0  # uses[o, i]: output o reads a real input at tap i
    inputs = np.zeros(ax.out + 1, dtype=np.int64)
    taps_sum = np.zeros(ax.out + 1, dtype=np.int64)
    for t in range(1, ax.out + 1):
        starts = np.arange(0, ax.out, t)
        inputs[t] = np.logical_or.reduceat(reads, starts, axis=0).sum()
        taps_sum[t] = np.logical_or.reduceat(uses, starts, axis=0).sum()
    return inputs, taps_sum


def ref_counts(ax: Axis) -> tuple[int, int, int, int, int]:
    pos = ref_positions(ax)
    real = pos[pos >= 0]
    return (int((pos >= 0).sum()), int(np.unique(real).size), int((pos >= 0).any(axis=0).sum()),
            int((pos >= 0).any(axis=1).sum()),
            int(np.bincount(real, minlength=1).max()) if real.size else 0)


def ref_optimal_tile(spec: ConvSpec, S: float, Np: int = 1, tables=ref_block_tables,
                     rows_at_once: int | None = None) -> tuple[int, int, int, bool]:
    """The earlier optimal_tile: every (x, y) scored with numpy, ties to the smaller footprint,
    then |y - x|, then the first in row-major order. `rows_at_once` scores the same keys a band
    of rows at a time, so a large layer fits in memory; `tables` gives the block tables."""
    cap = int(float(S) // Np)
    rows, cols = spec_axes(spec)
    in_rows, taps_rows = tables(rows)
    in_cols, taps_cols = tables(cols)
    kg, window = spec.k_per_group, spec.kh * spec.kw
    best = None
    step = rows_at_once or spec.out_h
    for y0 in range(1, spec.out_h + 1, step):
        ys = np.arange(y0, min(y0 + step, spec.out_h + 1), dtype=np.int64)[:, None]
        xs = np.arange(1, spec.out_w + 1, dtype=np.int64)[None, :]
        yin = (ys - 1) * spec.stride[0] + (spec.kh - 1) * spec.dilation[0] + 1
        xin = (xs - 1) * spec.stride[1] + (spec.kw - 1) * spec.dilation[1] + 1
        zmax = (cap - yin * xin) // (ys * xs + window)
        fits = zmax >= 1
        if not fits.any():
            continue
        z = np.clip(zmax, 1, kg)
        k_blocks = -(-kg // z)
        loads = (k_blocks * in_rows[ys] * in_cols[xs] + kg * taps_rows[ys] * taps_cols[xs]).astype(float)
        loads[~fits] = np.inf
        z = -(-kg // k_blocks)  # same blocks, least footprint
        foot = ys * xs * z + yin * xin + z * window
        order = np.lexsort((np.abs(ys - xs).ravel(), foot.ravel(), loads.ravel()))
        by, bx = np.unravel_index(order[0], loads.shape)
        key = (loads[by, bx], foot[by, bx], abs(int(ys[by, 0]) - int(xs[0, bx])), int(ys[by, 0]),
               int(xs[0, bx]), int(z[by, bx]))
        best = key if best is None else min(best, key)
    return (1, 1, 1, False) if best is None else (best[4], best[3], best[5], True)


def ref_dataflow_io(spec: ConvSpec, tile: Tile) -> int:
    t = tile.clipped(spec)
    rows, cols = spec_axes(spec)
    in_rows, taps_rows = ref_block_tables(rows)
    in_cols, taps_cols = ref_block_tables(cols)
    kg = spec.k_per_group
    per_channel = (-(-kg // t.z) * int(in_rows[t.y]) * int(in_cols[t.x])
                   + kg * int(taps_rows[t.y]) * int(taps_cols[t.x]))
    return spec.n * spec.groups * spec.c_per_group * per_channel + spec.output_elems


# -- (a) axis counts ------------------------------------------------------------------------------
def small_axes(stride: int, dilation: int):
    for size, taps, padding in itertools.product(range(1, 41), range(1, 8), range(0, 5)):
        extent = (taps - 1) * dilation + 1
        if extent <= size + 2 * padding:
            yield Axis(size, (size + 2 * padding - extent) // stride + 1, taps, stride, dilation, padding)


@pytest.mark.parametrize("stride,dilation", list(itertools.product(range(1, 5), range(1, 4))))
def test_axis_counts_against_brute_force(stride, dilation):
    """Every axis of size 1-40, taps 1-7, padding 0-4 at this stride and dilation, every t."""
    for ax in small_axes(stride, dilation):
        assert (ax.products, ax.inputs_read, ax.taps_used, ax.outputs_reading,
                ax.max_reuse) == ref_counts(ax), ax
        inputs, taps = ref_block_tables(ax)
        got_inputs, got_taps = ax.block_tables()
        assert got_inputs.tolist() == inputs.tolist(), ax
        assert got_taps.tolist() == taps.tolist(), ax


def test_axis_counts_with_padding_beyond_the_input():
    """Most outputs read only padding: those blocks count 0 and are not visited."""
    for size, taps, stride, dilation, padding in itertools.product(
            (1, 2, 5), (1, 3, 7), (1, 3), (1, 2), (37, 120)):
        ax = Axis(size, (size + 2 * padding - (taps - 1) * dilation - 1) // stride + 1, taps, stride,
                  dilation, padding)
        assert (ax.products, ax.inputs_read, ax.taps_used, ax.outputs_reading,
                ax.max_reuse) == ref_counts(ax), ax
        inputs, taps_sum = ref_block_tables(ax)
        got_inputs, got_taps = ax.block_tables()
        assert got_inputs.tolist() == inputs.tolist() and got_taps.tolist() == taps_sum.tolist(), ax


def test_blocks_takes_scalars_and_arrays():
    ax = Axis(37, 19, 5, 2, 1, 3)
    inputs, taps = ref_block_tables(ax)
    t = np.array([[1, 4], [19, 7]])
    got_inputs, got_taps = ax.blocks(t)
    assert got_inputs.shape == t.shape and (got_inputs == inputs[t]).all() and (got_taps == taps[t]).all()
    assert [int(v) for v in ax.blocks(6)] == [inputs[6], taps[6]]


def test_count_against_a_set():
    rng = random.Random(5)
    for _ in range(300):
        ax = Axis(50, 50, rng.randint(1, 7), rng.randint(1, 5), rng.randint(1, 4), 0)
        length, lo = rng.randint(1, 30), rng.randint(-20, 60)
        hi = lo + rng.randint(-3, 80)
        values = {o * ax.stride + i * ax.dilation for o in range(length) for i in range(ax.taps)}
        assert int(ax.count(length, lo, hi)) == sum(lo <= v <= hi for v in values)


def test_axis_counts_do_not_grow_with_the_axis():
    """A 10^9-wide axis: translates of one interior block, counted in closed form."""
    ax = Axis(10**9, 10**9, 3, 1, 1, 1)
    assert (ax.products, ax.inputs_read, ax.taps_used, ax.outputs_reading, ax.max_reuse) == \
        (3 * 10**9 - 2, 10**9, 3, 10**9, 3)
    inputs, taps = ax.blocks(np.array([1, 10**9]))
    assert inputs.tolist() == [3 * 10**9 - 2, 10**9] and taps.tolist() == [3 * 10**9 - 2, 3]


# -- (b) optimal tiles and dataflow I/O -----------------------------------------------------------
def shapes(count: int, seed: int, max_hw: int = 40) -> list[ConvSpec]:
    """Strides 1-3, dilation 1-2, padding 0-3, kernels 1-7, rectangular, some grouped."""
    rng = random.Random(seed)
    out: list[ConvSpec] = []
    while len(out) < count:
        g = rng.choice([1, 1, 1, 2, 4])
        try:
            out.append(ConvSpec(rng.choice([1, 2]), g * rng.randint(1, 3), rng.randint(1, max_hw),
                                rng.randint(1, max_hw), g * rng.randint(1, 24), rng.randint(1, 7),
                                rng.randint(1, 7), (rng.randint(1, 3), rng.randint(1, 3)),
                                (rng.randint(0, 3), rng.randint(0, 3)),
                                (rng.randint(1, 2), rng.randint(1, 2)), g))
        except MacoError:
            continue
    return out


def memories(spec: ConvSpec) -> list[tuple[float, int]]:
    """(S, Np): too small for any tile, the usual range, and enough for the whole layer."""
    whole = geometry.footprint(spec, spec.out_w, spec.out_h, spec.k_per_group)
    return [(1, 1), (30, 1), (100, 3), (500, 1), (2500.5, 2), (20000, 1), (whole, 1),
            (whole - 1, 1), (3 * whole, 3), (10**9, 1)]


@pytest.mark.parametrize("seed", range(6))
def test_optimal_tile_is_the_earlier_one(seed):
    for spec in shapes(20, seed):
        for S, Np in memories(spec):
            tile = bounds.optimal_tile(spec, S, Np)
            assert (tile.x, tile.y, tile.z, tile.fits) == ref_optimal_tile(spec, S, Np), (spec, S, Np)
            assert bounds.dataflow_io(spec, tile) == ref_dataflow_io(spec, tile)


def test_optimal_tile_in_small_chunks_and_few_pieces(monkeypatch):
    """Tiny chunks and few row pieces take the pruning and the coarse-level paths."""
    monkeypatch.setattr(tiles, "CHUNK", 1 << 7)
    monkeypatch.setattr(tiles, "PIECES", 4)
    for spec in shapes(25, seed=10, max_hw=60):
        for S, Np in memories(spec):
            tile = bounds.optimal_tile(spec, S, Np)
            assert (tile.x, tile.y, tile.z, tile.fits) == ref_optimal_tile(spec, S, Np), (spec, S, Np)


@pytest.mark.parametrize("seed", range(2))
def test_dataflow_io_is_the_earlier_one(seed):
    for spec in shapes(25, seed + 20):
        ow, oh, kg = spec.out_w, spec.out_h, spec.k_per_group
        for tile in {Tile(1, 1, 1), Tile(ow, oh, kg), Tile(ow + 3, oh + 2, kg + 1),
                     Tile(max(1, ow // 3), min(oh, 5), max(1, kg // 2)), Tile(min(ow, 7), 1, 1)}:
            assert bounds.dataflow_io(spec, tile) == ref_dataflow_io(spec, tile), (spec, tile)


@pytest.mark.parametrize("text", ["n1_c64_h1024_w1024_k64_r3x3_p1", "n1_c32_h700_w900_k96_r5x3_s2x1_p2x1"])
def test_optimal_tile_at_scale(text):
    """Layers too large for the old tables: the earlier scoring, a band of rows at a time, on
    block tables checked against the brute force above, at register to L3-sized memories."""
    spec = ConvSpec.parse(text)
    for S, Np in [(512, 1), (8192, 1), (262144, 1), (8388608, 2)]:
        tile = bounds.optimal_tile(spec, S, Np)
        ref = ref_optimal_tile(spec, S, Np, tables=Axis.block_tables, rows_at_once=64)
        assert (tile.x, tile.y, tile.z, tile.fits) == ref, (S, Np)


# -- (c) what `maco bound` computes, on layers that used to take minutes --------------------------
@pytest.mark.parametrize("text", [HUGE, "n1_c64_h2048_w2048_k64_r3x3_p1",
                                  "n100000_c100000_h224_w224_k100000_r3x3_p1",
                                  "n1_c1024_h4096_w4096_k1024_r3_p1_g1024", "n8_c512_h3000_w5000_k2048_r7_s2_p3"])
def test_bound_analysis_is_fast(text):
    spec = ConvSpec.parse(text)
    levels = Target.host().levels
    t0 = time.perf_counter()
    results = analyse_levels(spec, levels)
    elapsed = time.perf_counter() - t0
    print(f"{text}: analyse_levels over {len(levels)} host levels in {elapsed:.3f} s")
    assert elapsed < 5.0, f"{elapsed:.2f} s"
    for r in results:
        assert r.tile.fits and r.footprint <= r.S
        assert r.io >= r.bound.best  # a lower bound stays below the dataflow's exact I/O


def test_huge_layer_by_hand():
    """8192 x 8192, 3x3, pad 1: every input is read, each tap by 8192*8191 outputs per axis."""
    spec = ConvSpec.parse(HUGE)
    rows, cols = spec_axes(spec)
    assert (rows.inputs_read, rows.products, rows.max_reuse) == (8192, 3 * 8192 - 2, 3)
    assert bounds.compulsory_io(spec) == spec.input_elems + spec.weight_elems + spec.output_elems
    # a 256 x 128 tile: 32 x 64 blocks of 258 x 130 inputs, less the padding at the borders;
    # every block uses all 3 x 3 taps (its second row and column read the first real inputs)
    tile = Tile(256, 128, 64)
    inputs = (64 * 130 - 2) * (32 * 258 - 2)
    taps = (64 * 3) * (32 * 3)
    assert bounds.dataflow_io(spec, tile) == 100000 * (inputs + 64 * taps) + spec.output_elems
