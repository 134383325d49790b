"""Exact counts along one spatial axis of a convolution.

Which input positions an output row reads is a property of one axis (size, output size, taps,
stride, dilation, padding), and every 2-D count MACO needs is a product of the two axes' counts:
a (output, tap) pair reads a real input exactly when both its row and its column are in range.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from maco.spec import ConvSpec


@dataclass(frozen=True)
class Axis:
    size: int  # input extent (h or w)
    out: int  # output extent (out_h or out_w)
    taps: int  # kernel extent (kh or kw)
    stride: int
    dilation: int
    padding: int

    @property
    def positions(self) -> np.ndarray:
        """(out, taps) input index read by output o at tap i, -1 where it is padding."""
        return _positions(self)

    @property
    def products(self) -> int:
        """(output, tap) pairs that read a real input."""
        return int((self.positions >= 0).sum())

    @property
    def inputs_read(self) -> int:
        """Distinct input positions read at all."""
        pos = self.positions
        return int(np.unique(pos[pos >= 0]).size)

    @property
    def taps_used(self) -> int:
        """Taps that read a real input for some output."""
        return int((self.positions >= 0).any(axis=0).sum())

    @property
    def outputs_reading(self) -> int:
        """Outputs with at least one tap on a real input."""
        return int((self.positions >= 0).any(axis=1).sum())

    @property
    def max_reuse(self) -> int:
        """Most (output, tap) pairs that read one input position: the true maximal reuse."""
        pos = self.positions
        pos = pos[pos >= 0]
        return int(np.bincount(pos, minlength=1).max()) if pos.size else 0

    def block_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """For every block length t = 1..out (index t), over the blocks [0,t), [t,2t), ... clipped
        to `out`: the summed count of distinct inputs the blocks read, and of taps they use."""
        return _block_tables(self)


def spec_axes(spec: ConvSpec) -> tuple[Axis, Axis]:
    """(rows, columns) of a conv."""
    return (Axis(spec.h, spec.out_h, spec.kh, spec.stride[0], spec.dilation[0], spec.padding[0]),
            Axis(spec.w, spec.out_w, spec.kw, spec.stride[1], spec.dilation[1], spec.padding[1]))


@lru_cache(maxsize=512)
def _positions(ax: Axis) -> np.ndarray:
    pos = (np.arange(ax.out)[:, None] * ax.stride + np.arange(ax.taps)[None, :] * ax.dilation
           - ax.padding)
    pos[(pos < 0) | (pos >= ax.size)] = -1
    pos.setflags(write=False)
    return pos


@lru_cache(maxsize=512)
def _block_tables(ax: Axis) -> tuple[np.ndarray, np.ndarray]:
    pos = ax.positions
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
    inputs.setflags(write=False)
    taps_sum.setflags(write=False)
    return inputs, taps_sum
