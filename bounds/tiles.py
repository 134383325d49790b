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
from typing import Any

import numpy as np

from maco.bounds.axis import spec_axes
from maco.bounds.conv import _check_S, reuse
from maco.errors import MacoError
from maco.spec import ConvSpec
from maco.target import Target


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


def footprint(spec: ConvSpec, x: int, y: int, z: int) -> int:
    """x*y*z + x'*y' + z*kh*kw with x' = (x-1)*stride_w + (kw-1)*dilation_w + 1, y' likewise."""
    xin = (x - 1) * spec.stride[1] + (spec.kw - 1) * spec.dilation[1] + 1
    yin = (y - 1) * spec.stride[0] + (spec.kh - 1) * spec.dilation[0] + 1
    return x * y * z + xin * yin + z * spec.kh * spec.kw


def dataflow_loads(spec: ConvSpec, tile: Tile) -> int:
    """Input and weight loads of the dataflow (module docstring), summed over all tiles."""
    t = tile.clipped(spec)
    rows, cols = spec_axes(spec)
    in_rows, taps_rows = rows.block_tables()
    in_cols, taps_cols = cols.block_tables()
    kg = spec.k_per_group
    k_blocks = -(-kg // t.z)
    per_channel = (k_blocks * int(in_rows[t.y]) * int(in_cols[t.x])
                   + kg * int(taps_rows[t.y]) * int(taps_cols[t.x]))
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
    r = max(reuse(spec), 1.0)
    z = sqrt(cap / r)
    side = sqrt(r * z)
    return (side, side, z)


def optimal_tile(spec: ConvSpec, S: float, Np: int = 1) -> Tile:
    """The integer tile with footprint <= S/Np that minimises dataflow_io.

    For fixed (x, y) the I/O only falls as z grows, so z is the largest that fits (at most the
    group's filters, then shrunk to the least z with the same number of filter blocks); every
    (x, y) is scored at once with numpy. Ties go to the smaller footprint, then the squarer tile."""
    s = _check_S(S)
    if isinstance(Np, bool) or not isinstance(Np, int) or Np <= 0:
        raise MacoError(f"Np (processors sharing the memory) must be a positive int, got {Np!r}")
    cap = int(s // Np)
    cont = continuous_tile(spec, s, Np)
    rows, cols = spec_axes(spec)
    in_rows, taps_rows = rows.block_tables()
    in_cols, taps_cols = cols.block_tables()
    kg, window = spec.k_per_group, spec.kh * spec.kw
    ys = np.arange(1, spec.out_h + 1, dtype=np.int64)[:, None]
    xs = np.arange(1, spec.out_w + 1, dtype=np.int64)[None, :]
    yin = (ys - 1) * spec.stride[0] + (spec.kh - 1) * spec.dilation[0] + 1
    xin = (xs - 1) * spec.stride[1] + (spec.kw - 1) * spec.dilation[1] + 1
    zmax = (cap - yin * xin) // (ys * xs + window)
    fits = zmax >= 1
    if not fits.any():
        return Tile(1, 1, 1, cont, fits=False)
    z = np.clip(zmax, 1, kg)
    k_blocks = -(-kg // z)
    loads = (k_blocks * in_rows[ys] * in_cols[xs] + kg * taps_rows[ys] * taps_cols[xs]).astype(float)
    loads[~fits] = np.inf
    z = -(-kg // k_blocks)  # same blocks, least footprint
    foot = ys * xs * z + yin * xin + z * window
    order = np.lexsort((np.abs(ys - xs).ravel(), foot.ravel(), loads.ravel()))
    best = np.unravel_index(order[0], loads.shape)
    return Tile(int(xs[0, best[1]]), int(ys[best[0], 0]), int(z[best]), cont)


def tiles_for_target(spec: ConvSpec, target: Target) -> dict[str, Tile]:
    """The optimal tile at every memory level: S = the level's elements, Np = processors sharing it."""
    return {lvl.name: optimal_tile(spec, lvl.elements, lvl.processors) for lvl in target.levels}
