"""A chain bound for fused blocks: two or three convs computed together with the intermediates
kept in the fast memory (1x1 -> depthwise -> 1x1 of an inverted residual, 3x3 -> 3x3 of a basic
block, 1x1 -> 3x3 -> 1x1 of a bottleneck), against the same convs run one kernel at a time.

Notation (fp32 elements, batch 1; S: the fast memory a fused tile lives in)
    chain      convs j = 1..k, conv j reads the whole output of conv j-1 (conv 1 reads X, the
               block's input) and nothing else reads it; W_j weights, A_j = K_j*Ho_j*Wo_j outputs,
               A_k the block's output; r_j the dilated kernel extent, s_j the stride
    tile       x*y pixels of the block's output; conv j computes the region x_j*y_j the later
               convs need: x_k = x, x_{j-1} = min(Wo_{j-1}, (x_j - 1)*s_j + r_j), likewise y;
               x_0*y_0 is the tile's input region (C_1 channels), halos included

Statements (tests/test_chain_bound.py checks 1 and 2 against an exact pebbling found by brute
force, and that the tiled cost of 3 is a pebbling's cost)

1. One kernel at a time (every conv finished before the next starts, nothing recomputed): the
   live-set argument of bounds/network.py (statement 2) at each boundary gives
       Q_unfused >= X + A_k + sum_j W_j + 2 * sum_{j<k} max(0, A_j - S).
   Separate kernels that keep no intermediate on chip move the full 2 * sum_{j<k} A_j
   (`q_separate`): that is what fusion can save, and all it can save.
2. Fused, any schedule (recomputation included): Q >= X + A_k + sum_j W_j (compulsory).
3. Fused by output tiles (what a fused kernel runs; a schedule, so its cost is achievable): per
   tile the input region is loaded, the outputs are stored, the intermediates stay on chip, and
   the weights are loaded once when they fit beside the tile's working set, else once per tile:
       F(x, y) = C_1*x_0*y_0 + sum_{j<k} K_j*x_j*y_j + K_k*x*y       (the tile's working set)
       T       = ceil(Ho_k / y) * ceil(Wo_k / x)                       (tiles)
       Q(x, y) = T*C_1*x_0*y_0 + A_k + sum_j W_j * (1 if F + sum_j W_j <= S else T)
   halos recompute T*sum_{j<k} K_j*x_j*y_j - sum_{j<k} A_j intermediate elements. The fused tile
   is the (x, y) with F <= S of least Q (then least recompute). Fusion pays in traffic where that
   Q is below q_separate; it can pay at all only where statement 2 is below statement 1's
   separate-kernel traffic, and its price is the recompute flops, which this module reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil
from typing import Sequence

import sympy as sp

from maco.bounds.network import NetLayer
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec


@dataclass(frozen=True)
class ChainDerivation:
    """Statement 3 as sympy expressions of the tile (x, y), for two convs of unit stride."""

    footprint: sp.Expr
    q_tiled: sp.Expr
    symbols: dict[str, sp.Symbol]


@lru_cache(maxsize=1)
def derive_chain() -> ChainDerivation:
    """The tiled cost of conv 1 (C -> M, r1 x r1) then conv 2 (M -> K, r2 x r2), stride 1, on an
    H x W map, with whole tiles (x | W, y | H) and the weights resident."""
    x, y, H, W, C, M, K, r1, r2, w = sp.symbols("x y H W C M K r1 r2 W_sum", positive=True)
    x1, y1 = x + r2 - 1, y + r2 - 1  # conv 1's region for conv 2's tile
    x0, y0 = x1 + r1 - 1, y1 + r1 - 1
    footprint = C * x0 * y0 + M * x1 * y1 + K * x * y
    q = (H / y) * (W / x) * C * x0 * y0 + K * H * W + w
    return ChainDerivation(sp.expand(footprint), sp.simplify(q),
                           {s.name: s for s in (x, y, H, W, C, M, K, r1, r2, w)})


@dataclass(frozen=True)
class ChainBound:
    """The bounds of one chain at fast memory S (elements), and its fused tile."""

    names: tuple[str, ...]
    specs: tuple[ConvSpec, ...]
    S: int
    q_unfused: int  # statement 1, a lower bound for one kernel at a time
    q_separate: int  # separate kernels, no intermediate kept on chip
    q_fused_floor: int  # statement 2
    tile: tuple[int, int] | None  # (x, y) of the block's output; None: no tile fits in S
    q_tiled: int | None  # statement 3 at that tile
    weights_resident: bool | None
    recompute: int | None  # intermediate elements computed more than once
    recompute_flops: int | None
    priced: bool = False  # the tile was chosen by time: traffic over `bandwidth` plus recompute over `peak`
    saved_s: float | None = None  # priced: seconds the fused tile saves against separate kernels

    @property
    def kind(self) -> str:
        return " -> ".join("dw" if s.groups == s.c == s.k and s.groups > 1 else f"{s.kh}x{s.kw}" for s in self.specs)

    @property
    def pays(self) -> bool:
        """Whether the fused tile beats separate kernels: in modelled time where priced (the
        traffic it saves at the bandwidth against its recompute at the peak), else in traffic."""
        if self.q_tiled is None:
            return False
        return self.saved_s > 0 if self.priced else self.q_tiled < self.q_separate

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.specs)


def _regions(specs: Sequence[ConvSpec], x: int, y: int) -> list[tuple[int, int]]:
    """(x_j, y_j) for j = 0..k: the regions each conv computes for an x*y output tile (index 0:
    the input region), clipped to the maps."""
    out = [(x, y)]
    for s in reversed(specs):
        px, py = out[0]
        out.insert(0, (min(s.w, (px - 1) * s.stride[1] + s.dilated_kw), min(s.h, (py - 1) * s.stride[0] + s.dilated_kh)))
    return out


def check_chain(specs: Sequence[ConvSpec]) -> None:
    if not 2 <= len(specs) <= 3:
        raise MacoError(f"a chain has 2 or 3 convs, got {len(specs)}")
    for a, b in zip(specs, specs[1:]):
        if a.output_shape != b.input_shape:
            raise MacoError(f"{b} does not read {a}'s output (shape {a.output_shape}, it reads {b.input_shape})")
    if any(s.n != 1 for s in specs):
        raise MacoError("the chain bound is for batch 1")


def chain_bound(specs: Sequence[ConvSpec], S: int, names: Sequence[str] = (), *,
                peak: float | None = None, bandwidth: float | None = None) -> ChainBound:
    """Statements 1-3 for the chain `specs` at fast memory S (elements). With `peak` (flop/s) and
    `bandwidth` (bytes/s) the fused tile is the one of least modelled time, 4*Q/bandwidth plus
    the recompute flops over the peak (compute and memory not overlapped: the halos' flops are
    extra work, whatever else overlaps), not of least traffic."""
    check_chain(specs)
    if S < 1:
        raise MacoError(f"S must be a positive number of elements, got {S!r}")
    priced = peak is not None and bandwidth is not None
    if priced and not (peak > 0 and bandwidth > 0):
        raise MacoError(f"peak and bandwidth must be positive, got {peak!r} and {bandwidth!r}")
    first, last = specs[0], specs[-1]
    X, out = first.input_elems, last.output_elems
    weights = sum(s.weight_elems for s in specs)
    mids = [s.output_elems for s in specs[:-1]]
    q_unfused = X + out + weights + 2 * sum(max(0, a - S) for a in mids)
    best = None
    for x in range(1, last.out_w + 1):
        for y in range(1, last.out_h + 1):
            regions = _regions(specs, x, y)
            footprint = first.c * regions[0][0] * regions[0][1] + sum(
                s.k * rx * ry for s, (rx, ry) in zip(specs, regions[1:]))
            if footprint > S:
                continue
            tiles = ceil(last.out_h / y) * ceil(last.out_w / x)
            resident = footprint + weights <= S
            q = tiles * first.c * regions[0][0] * regions[0][1] + out + weights * (1 if resident else tiles)
            computed = [tiles * s.k * rx * ry for s, (rx, ry) in zip(specs[:-1], regions[1:-1])]
            recompute = sum(computed) - sum(mids)
            flops = sum(2 * (c - a) * s.c_per_group * s.kh * s.kw for s, c, a in zip(specs[:-1], computed, mids))
            key = ((4 * q / bandwidth + flops / peak) if priced else q, recompute, -x * y)
            if best is None or key < best[0]:
                best = (key, (x, y), q, resident, recompute, flops)
    separate = X + out + weights + 2 * sum(mids)
    if best is None:
        return ChainBound(tuple(names), tuple(specs), S, q_unfused, separate, X + out + weights,
                          None, None, None, None, None, priced)
    _, (x, y), q, resident, recompute, flops = best
    saved = 4 * (separate - q) / bandwidth - flops / peak if priced else None
    return ChainBound(tuple(names), tuple(specs), S, q_unfused, separate, X + out + weights, (x, y), q,
                      resident, recompute, flops, priced, saved)


def chains(layers: Sequence[NetLayer], lengths: tuple[int, ...] = (3, 2)) -> list[tuple[NetLayer, ...]]:
    """The fusable chains of a network's DAG: runs of convs where each reads only the one before,
    which nothing else reads; the longest first (3 convs, else 2), no conv in two chains."""
    readers: dict[str, list[str]] = {}
    for layer in layers:
        for name in layer.inputs:
            readers.setdefault(name, []).append(layer.name)
    by_name = {layer.name: layer for layer in layers}

    def follows(a: NetLayer, b: NetLayer) -> bool:
        return (a.kind == b.kind == "conv" and b.inputs == (a.name,) and readers.get(a.name) == [b.name])

    taken: set[str] = set()
    found: list[tuple[NetLayer, ...]] = []
    for n in sorted(lengths, reverse=True):
        for layer in layers:
            run = [layer]
            while len(run) < n:
                nxt = readers.get(run[-1].name, [])
                if len(nxt) != 1 or not follows(run[-1], by_name[nxt[0]]):
                    break
                run.append(by_name[nxt[0]])
            if len(run) == n and not taken & {r.name for r in run}:
                found.append(tuple(run))
                taken |= {r.name for r in run}
    order = {layer.name: i for i, layer in enumerate(layers)}
    return sorted(found, key=lambda run: order[run[0].name])


__all__ = ["ChainBound", "ChainDerivation", "chain_bound", "chains", "check_chain", "derive_chain"]
