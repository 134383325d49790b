"""Exact counts along one spatial axis of a convolution.

Which input positions an output row reads is a property of one axis (size, output size, taps,
stride, dilation, padding), and every 2-D count MACO needs is a product of the two axes' counts:
a (output, tap) pair reads a real input exactly when both its row and its column are in range.

No count sweeps the axis (a layer can be 8192 or more wide): output o reads o*stride +
i*dilation - padding at tap i, so each tap's outputs form one interval, and a run of outputs
reads a union of arithmetic progressions with one step, which residue classes turn into unions
of evenly spaced intervals (`Axis.count`). A count is numpy work over the taps, residues or
change points (at most taps * stride), independent of the axis size.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

import numpy as np

from maco.core.errors import MacoError
from maco.core.spec import ConvSpec


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

    def tap_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """Per tap, the first and last output that reads a real input there (first > last: none)."""
        offset = np.arange(self.taps, dtype=np.int64) * self.dilation - self.padding
        first = np.maximum(-(offset // self.stride), 0)  # ceil(-offset / stride)
        last = np.minimum((self.size - 1 - offset) // self.stride, self.out - 1)
        return first, last

    @property
    def products(self) -> int:
        """(output, tap) pairs that read a real input."""
        first, last = self.tap_outputs()
        return int(np.maximum(last - first + 1, 0).sum())

    @property
    def inputs_read(self) -> int:
        """Distinct input positions read at all."""
        return int(self.count(self.out, self.padding, self.size - 1 + self.padding))

    @property
    def taps_used(self) -> int:
        """Taps that read a real input for some output."""
        first, last = self.tap_outputs()
        return int((first <= last).sum())

    @property
    def outputs_reading(self) -> int:
        """Outputs with at least one tap on a real input: the union of the taps' output intervals."""
        first, last = self.tap_outputs()
        total, reach = 0, -1
        for a, b in sorted(zip(first.tolist(), last.tolist())):
            if a <= b:
                total += max(0, b - max(a, reach + 1) + 1)
                reach = max(reach, b)
        return total

    @property
    def max_reuse(self) -> int:
        """Most (output, tap) pairs that read one input position: the true maximal reuse."""
        return _max_reuse(self)

    def count(self, length: np.ndarray | int, lo: np.ndarray | int,
              hi: np.ndarray | int) -> np.ndarray:
        """Distinct values of o*stride + i*dilation in [lo, hi] over 0 <= o < length, 0 <= i < taps.

        With g = gcd(stride, dilation), s = stride/g, d = dilation/g, the taps i = r + m*s
        (m = 0..m_last) give s*(o + m*d) + r*d: for each residue r the quotients o + m*d fill the
        intervals [m*d, m*d + length), whose points up to Q have a closed form (`_upto`)."""
        g = gcd(self.stride, self.dilation)
        s, d = self.stride // g, self.dilation // g
        length = np.asarray(length, dtype=np.int64)
        lo = -(-np.asarray(lo, dtype=np.int64) // g)  # only multiples of g occur
        hi = np.asarray(hi, dtype=np.int64) // g
        total = np.zeros(np.broadcast(length, lo, hi).shape, dtype=np.int64)
        for r in range(min(s, self.taps)):
            m_last = (self.taps - 1 - r) // s
            q_lo = -(-(lo - r * d) // s)
            q_hi = (hi - r * d) // s
            total += np.maximum(_upto(q_hi, length, m_last, d) - _upto(q_lo - 1, length, m_last, d), 0)
        return total

    def blocks(self, t: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """For each block length t, over the blocks [0,t), [t,2t), ... clipped to `out`: the summed
        count of distinct inputs the blocks read, and of taps they use.

        A block whose outputs read no padding is a translate of any other such block, so those
        are counted once and multiplied; blocks of outputs that read only padding count 0, and
        only the few blocks left at the borders (about 2 + 2*taps*dilation/(stride*t)) are
        counted one by one."""
        t = np.asarray(t, dtype=np.int64)
        shape, t = t.shape, t.ravel()
        first, last = self.tap_outputs()
        reads = first <= last
        if not reads.any():
            return np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        n_blocks = -(-self.out // t)
        first_in = -(-self.padding // self.stride)  # first output whose taps all read real inputs
        last_in = (self.size - 1 + self.padding - (self.taps - 1) * self.dilation) // self.stride
        j_lo = np.minimum(-(-first_in // t), n_blocks)  # blocks j_lo .. j_hi-1 read no padding
        j_hi = np.maximum((last_in + 1) // t, j_lo)
        inner = j_hi - j_lo
        inputs = inner * self.count(t, 0, (t - 1) * self.stride + (self.taps - 1) * self.dilation)
        taps = inner * self.taps
        # border blocks: those holding an output from first[reads].min() .. last[reads].max()
        left = j_lo - np.minimum(first[reads].min() // t, j_lo)
        right = np.maximum(np.minimum(last[reads].max() // t + 1, n_blocks), j_hi) - j_hi
        edge = left + right
        owner = np.repeat(np.arange(t.size), edge)
        ends = np.cumsum(edge)
        nth = np.arange(owner.size) - np.repeat(ends - edge, edge)  # n-th border block of its t
        j = np.where(nth < left[owner], j_lo[owner] - left[owner] + nth, j_hi[owner] + nth - left[owner])
        start = j * t[owner]
        length = np.minimum(t[owner], self.out - start)
        edge_inputs = self.count(length, self.padding - start * self.stride,
                                 self.size - 1 + self.padding - start * self.stride)
        end = start + length - 1
        edge_taps = np.maximum(start[:, None], first) <= np.minimum(end[:, None], last)
        inputs = inputs + _segment_sums(edge_inputs, ends, edge)
        taps = taps + _segment_sums(edge_taps.sum(axis=1), ends, edge)
        return inputs.reshape(shape), taps.reshape(shape)

    def block_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """`blocks` at every t = 1..out (index t; index 0 holds 0), for small axes and tests."""
        return _block_tables(self)


def _upto(q: np.ndarray, length: np.ndarray, m: int, d: int) -> np.ndarray:
    """Points q' <= q in the union of [k*d, k*d + length) for k = 0..m (all q' >= 0)."""
    step = np.minimum(length, d)  # the first m intervals, each cut where the next begins
    j = np.maximum(q, -1) // d
    whole = np.clip(j, 0, m) * step
    part = np.where((j >= 0) & (j < m), np.minimum(q - j * d + 1, step), 0)
    return whole + part + np.clip(q - m * d + 1, 0, length)


def _segment_sums(values: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of `values` with the given sizes (empty runs sum to 0)."""
    cum = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    return cum[ends] - cum[ends - sizes]


MAX_AXIS_STEP = 1024  # kernel taps, stride and dilation along one axis: counts cost ~ their product


def spec_axes(spec: ConvSpec) -> tuple[Axis, Axis]:
    """(rows, columns) of a conv; MacoError for kernels, strides or dilations past MAX_AXIS_STEP,
    whose counts would take minutes (no CNN comes near: large-kernel ones use 51x51)."""
    for name, values in (("kernel", (spec.kh, spec.kw)), ("stride", spec.stride),
                         ("dilation", spec.dilation)):
        if max(values) > MAX_AXIS_STEP:
            raise MacoError(f"{spec}: a {name} of {max(values)} is past the {MAX_AXIS_STEP} "
                            "that MACO's bounds handle along an axis")
    return (Axis(spec.h, spec.out_h, spec.kh, spec.stride[0], spec.dilation[0], spec.padding[0]),
            Axis(spec.w, spec.out_w, spec.kw, spec.stride[1], spec.dilation[1], spec.padding[1]))


@lru_cache(maxsize=512)
def _max_reuse(ax: Axis) -> int:
    """Which taps can reach input u = r + padding changes only where some tap's first or last
    output does; between those points the count depends on r mod stride alone, so `stride`
    positions after each change point (and after 0) hold every value the count takes. At each
    candidate the count is closed-form: taps i with i*dilation = u (mod stride) form one residue
    class mod stride/g (g = gcd), counted inside the window u - last_o <= i*dilation <= u."""
    s, d = ax.stride, ax.dilation
    g = gcd(s, d)
    s1 = s // g
    inv = pow(d // g, -1, s1) if s1 > 1 else 0
    offset = np.arange(ax.taps, dtype=np.int64) * d - ax.padding
    last_o = (ax.out - 1) * s
    starts = np.concatenate(([0], offset, offset + last_o + 1))
    r = (starts[:, None] + np.arange(s)).ravel()
    u = np.unique(r[(r >= 0) & (r < ax.size)]) + ax.padding
    u = u[u % g == 0]
    if not u.size:
        return 0
    i0 = (u // g) * inv % s1
    lo = np.maximum(-((last_o - u) // d), 0)  # ceil((u - last_o) / d)
    hi = np.minimum(u // d, ax.taps - 1)
    count = np.where(hi >= lo, (hi - i0) // s1 - (lo - 1 - i0) // s1, 0)
    return int(count.max())


@lru_cache(maxsize=512)
def _positions(ax: Axis) -> np.ndarray:
    pos = (np.arange(ax.out)[:, None] * ax.stride + np.arange(ax.taps)[None, :] * ax.dilation
           - ax.padding)
    pos[(pos < 0) | (pos >= ax.size)] = -1
    pos.setflags(write=False)
    return pos


@lru_cache(maxsize=512)
def _block_tables(ax: Axis) -> tuple[np.ndarray, np.ndarray]:
    inputs, taps = ax.blocks(np.arange(1, ax.out + 1))
    inputs, taps = np.concatenate(([0], inputs)), np.concatenate(([0], taps))
    inputs.setflags(write=False)
    taps.setflags(write=False)
    return inputs, taps
