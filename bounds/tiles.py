"""Output tiles of the alpha = 1 dataflow: exact I/O, the I/O-optimal integer tile, tiles per memory level.

The dataflow (the paper's Fig. 5): for every image and group, the outputs are cut into tiles of
x (along ow) by y (along oh) by z (output channels of the group), edge tiles clipped. A tile's
outputs stay in fast memory while it slides over the group's input channels one at a time; for
each channel it loads

  * the input positions the tile reads (padding is not loaded; a strided or dilated tile that
    skips a row or column does not load it either), and
  * the weights of its z filters at the taps that read a real input for some output of the tile,

and when the channels are done it stores its outputs once. `dataflow_io` counts exactly that.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import sqrt
from typing import Any, Callable

import numpy as np

from maco.bounds.axis import spec_axes
from maco.bounds.conv import _check_S, max_reuse
from maco.core.errors import MacoError
from maco.core.geometry import footprint, input_extent
from maco.core.spec import ConvSpec
from maco.core.target import Target

CHUNK = 1 << 19  # (x, y) pairs optimal_tile scores at once (~50 MB of numpy temporaries)
PIECES = 1 << 18  # about the most row pieces optimal_tile bounds (~20 MB of arrays)


@dataclass(frozen=True)
class Tile:
    """An output tile: x along ow, y along oh, z output channels within a group.

    continuous: the paper's real-valued optimum (x*y = R*z, x*y*z = S/Np, x = y) when the tile
    came from optimal_tile; fits: False when even a 1x1x1 tile overflows the memory it was
    sized for (the tile is then 1x1x1, the least footprint). Tiles compare by x, y, z, fits."""

    x: int
    y: int
    z: int
    continuous: tuple[float, float, float] | None = field(default=None, compare=False)
    fits: bool = True

    def __post_init__(self) -> None:
        for name in ("x", "y", "z"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise MacoError(f"Tile.{name} must be a positive int, got {v!r}")
            object.__setattr__(self, name, int(v))

    def clipped(self, spec: ConvSpec) -> "Tile":
        """The tile with each side cut to the layer's extent (a larger side covers the axis once)."""
        return Tile(min(self.x, spec.out_w), min(self.y, spec.out_h), min(self.z, spec.k_per_group),
                    self.continuous, self.fits)

    def footprint(self, spec: ConvSpec) -> int:
        """x*y*z outputs + the x' by y' input patch of one channel + z*kh*kw weights of one channel."""
        return footprint(spec, self.x, self.y, self.z)

    def to_dict(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y, "z": self.z, "fits": self.fits,
                "continuous": list(self.continuous) if self.continuous else None}

    def __str__(self) -> str:
        return f"{self.x}x{self.y}x{self.z}"


def dataflow_loads(spec: ConvSpec, tile: Tile) -> int:
    """Input and weight loads of the dataflow (module docstring), summed over all tiles."""
    t = tile.clipped(spec)
    rows, cols = spec_axes(spec)
    in_rows, taps_rows = rows.blocks(t.y)
    in_cols, taps_cols = cols.blocks(t.x)
    kg = spec.k_per_group
    k_blocks = -(-kg // t.z)
    per_channel = (k_blocks * int(in_rows) * int(in_cols) + kg * int(taps_rows) * int(taps_cols))
    return spec.n * spec.groups * spec.c_per_group * per_channel


def dataflow_io(spec: ConvSpec, tile: Tile) -> int:
    """Exact loads + stores of the alpha=1 dataflow with this tile, edge tiles clipped: the
    loads of `dataflow_loads` plus one store per output."""
    if not isinstance(tile, Tile):
        raise MacoError(f"dataflow_io needs a maco.bounds.Tile, got {type(tile).__name__}")
    return dataflow_loads(spec, tile) + spec.output_elems


def continuous_tile(spec: ConvSpec, S: float, Np: int = 1) -> tuple[float, float, float]:
    """The paper's optimum: z = sqrt(S/(Np*R)), x = y = sqrt(R*z), so x*y = R*z and x*y*z = S/Np."""
    cap = _check_S(S) / Np
    r = max(max_reuse(spec), 1.0)
    z = sqrt(cap / r)
    side = sqrt(r * z)
    return (side, side, z)


def optimal_tile(spec: ConvSpec, S: float, Np: int = 1) -> Tile:
    """The integer tile with footprint <= S/Np that minimises dataflow_io.

    For fixed (x, y) the I/O only falls as z grows, so z is the largest that fits (at most the
    group's filters, then shrunk to the least z with the same number of filter blocks). Only
    the (x, y) that fit are scored, so the work follows S/Np, not out_h * out_w: rows y are cut
    into pieces of x with a lower bound on their loads, and scored with numpy, about CHUNK pairs
    at a time, best bound first, until the bounds left exceed the best loads found. Ties go to
    the smaller footprint, then the squarer tile, the smaller y, the smaller x."""
    s = _check_S(S)
    if isinstance(Np, bool) or not isinstance(Np, int) or Np <= 0:
        raise MacoError(f"Np (processors sharing the memory) must be a positive int, got {Np!r}")
    cap = min(int(s // Np), 1 << 62)  # far more than any layer needs, and no int64 overflow
    cont = continuous_tile(spec, s, Np)
    kg, window = spec.k_per_group, spec.kh * spec.kw
    (sh, sw), eh, ew = spec.stride, spec.dilated_kh, spec.dilated_kw
    # z filters fit beside x by y iff x*(yin*sw + z*y) <= cap - z*window - yin*(ew - sw),
    # with yin = (y-1)*sh + eh input rows: that gives the largest y (x = z = 1) and x
    y_max = min(spec.out_h, (cap - window - (eh - sh) * ew) // (sh * ew + 1))
    if y_max < 1:
        return Tile(1, 1, 1, cont, fits=False)
    ys = np.arange(1, y_max + 1, dtype=np.int64)
    yins = input_extent(ys, spec.kh, sh, spec.dilation[0])

    def x_fits(z: int) -> np.ndarray:  # per y, the largest x beside z filters (0: none)
        return np.clip((cap - z * window - yins * (ew - sw)) // (yins * sw + z * ys), 0, spec.out_w)

    rows, cols = spec_axes(spec)
    in_rows, taps_rows = rows.blocks(ys)
    in_cols, taps_cols = (np.concatenate(([0], a))  # indexed by x
                          for a in cols.blocks(np.arange(1, x_fits(1).max() + 1, dtype=np.int64)))
    most = int(in_rows.max()) * int(in_cols.max()) + int(taps_rows.max()) * int(taps_cols.max())
    if kg * most >= 2**63:
        raise MacoError(f"{spec}: loads too large to score exactly in int64")
    row, lo, hi, low_blocks = _row_pieces(kg, y_max, x_fits)
    # a piece's loads are at least `low`: its blocks >= low_blocks, in_cols[x] >= least_in[hi - 1]
    least_in, least_taps = (np.minimum.accumulate(a[1:]) for a in (in_cols, taps_cols))
    low = low_blocks * in_rows[row] * least_in[hi - 1] + kg * taps_rows[row] * least_taps[hi - 1]
    order = np.argsort(low)
    ends = np.cumsum((hi - lo + 1)[order])
    best: tuple[int, ...] | None = None  # (loads, footprint, |y-x|, y, x, z)
    first, size = 0, CHUNK >> 7  # small first chunks find a good bound early
    while first < order.size and (best is None or low[order[first]] <= best[0]):
        scored = int(ends[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(ends, scored + size, "right")))
        size = min(2 * size, CHUNK)
        chunk = order[first:last]
        first = last
        if best is not None:
            chunk = chunk[low[chunk] <= best[0]]
        cand = _best_of_pieces(spec, cap, ys, yins, (in_rows, taps_rows), (in_cols, taps_cols),
                               row[chunk], lo[chunk], hi[chunk])
        best = cand if best is None else min(best, cand)
    assert best is not None
    return Tile(best[4], best[3], best[5], cont)


def _best_of_pieces(spec: ConvSpec, cap: int, ys: np.ndarray, yins: np.ndarray,
                    rows_io: tuple[np.ndarray, np.ndarray], cols_io: tuple[np.ndarray, np.ndarray],
                    row: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[int, ...]:
    """Score every x = lo..hi of the row pieces (row indexes ys) at once with numpy and return the
    best (loads, footprint, |y-x|, y, x, z): z is the most filters that fit beside x by y in
    `cap`, shrunk to the least z with as few filter blocks. rows_io and cols_io are the
    (input, taps) block loads per row and per x."""
    kg, window, sw = spec.k_per_group, spec.kh * spec.kw, spec.stride[1]
    (in_rows, taps_rows), (in_cols, taps_cols) = rows_io, cols_io
    count = hi - lo + 1
    r = np.repeat(row, count)
    x = np.arange(r.size, dtype=np.int64) - np.repeat(np.cumsum(count) - count - lo, count)
    y, yin, xin = ys[r], yins[r], input_extent(x, spec.kw, sw, spec.dilation[1])
    blocks = -(-kg // np.minimum((cap - yin * xin) // (y * x + window), kg))
    loads = blocks * in_rows[r] * in_cols[x] + kg * taps_rows[r] * taps_cols[x]
    pick = np.flatnonzero(loads == loads.min())
    x, y, z = x[pick], y[pick], -(-kg // blocks[pick])  # least z with the same blocks
    foot = footprint(spec, x, y, z)
    pick = np.flatnonzero(foot == foot.min())
    i = pick[np.lexsort((x[pick], y[pick], np.abs(y[pick] - x[pick])))[0]]
    xi, yi = int(x[i]), int(y[i])
    return (int(loads.min()), int(foot[i]), abs(yi - xi), yi, xi, int(z[i]))


def _row_pieces(kg: int, y_max: int, x_fits: Callable[[int], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the rows y = 1..y_max into pieces x = lo..hi with a lower bound on their filter blocks.

    A level z takes, per row, the x that fit z filters but not the previous (larger) level's, so
    there z <= previous level - 1 and the blocks ceil(kg/z) are at least kg/(previous - 1). The
    levels are the z where the blocks step, or a geometric subset of them on tall layers, to
    keep the pieces near PIECES. Returns (row index, lo, hi, least blocks) per piece."""
    levels = np.unique(-(-kg // np.arange(1, kg + 1, dtype=np.int64)))[::-1]
    keep = np.geomspace(1, levels.size, min(levels.size, max(2, PIECES // y_max)))
    levels = levels[np.unique(keep.round().astype(np.int64)) - 1].tolist()
    row, lo, hi, blocks = [], [], [], []
    done = np.zeros(y_max, dtype=np.int64)
    for level, z in enumerate(levels):
        upto = x_fits(z)
        new = np.flatnonzero(upto > done)
        row.append(new)
        lo.append(done[new] + 1)
        hi.append(upto[new])
        blocks.append(np.full(new.size, 1 if level == 0 else -(-kg // (levels[level - 1] - 1))))
        done = np.maximum(done, upto)
    return tuple(np.concatenate(a) for a in (row, lo, hi, blocks))  # type: ignore[return-value]


def tiles_for_target(spec: ConvSpec, target: Target) -> dict[str, Tile]:
    """The optimal tile at every memory level: S = the level's elements, Np = processors sharing it."""
    return {lvl.name: optimal_tile(spec, lvl.elements, lvl.processors) for lvl in target.levels}
