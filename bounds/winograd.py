"""Winograd F(m x m, r x r) inside the bound (issue 40, item 2): per layer, the multiplies, the
traffic of the transformed filters, input tiles and output tiles, the footprint of a block of
tiles, and from these a model of the tile size that runs fastest on a host.

With alpha = m + r - 1 (the input tile side) and t = ceil(Ho/m)*ceil(Wo/m) tiles per image:

    multiply-adds   t * alpha^2 * C * K                      (the element-wise stage; 2 flops each)
    U (filters)     alpha^2 * C * K elements                 (alpha^2 / r^2 times the weights:
                                                              16/9 for F(2x2, 3x3), 4x for F(4x4, 3x3))
    V (inputs)      alpha^2 * C per tile, M (outputs) alpha^2 * K per tile
    block of T      T * alpha^2 * (C + K) elements: a block's V and M stay in one core's cache
                    while U streams past it, so U crosses into that cache once per block

Inside a model the layer's U does not stay cached between calls (its weights and every other
layer's pass through the last-level cache first), so per call it comes from DRAM once, and
again from the last-level cache for every further block. A tile size's time is modelled as

    max(2 * macs / (e_m * P),  4 * (U + inputs + outputs) / B)

with P the FMA peak, B the DRAM read bandwidth and e_m the share of P the kernel's multiplies
reach in F(m x m) (kernels.cpu_peak.winograd_ceilings, timed once per host on a reference conv:
larger tiles spend more of the core on their transforms). The kernel streams U under its
multiplies (a panel in chunks of channels that every register block takes in turn, prefetched
ahead), so the two overlap and the longer one is the time. The larger tile does fewer multiplies
but reads a larger U: early layers (56x56x64: U of F(4x4) 0.6 MB) take F(4x4); deep ones (7x7x512:
U of F(4x4) 38 MB, of F(2x2) 17 MB) take the smaller tile where F(4x4)'s DRAM time exceeds
F(2x2)'s compute (`crossover`). This is a model to rank tile sizes, not a bound: MACO's
kernel_choice still times each tile size.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil
from typing import Any, Mapping, Sequence

import sympy as sp

from maco.bounds.network import WINOGRAD_TILES, NetLayer, tile_label, winograd_applies
from maco.core.errors import MacoError
from maco.core.spec import DTYPE_BYTES, ConvSpec


@dataclass(frozen=True)
class WinogradCost:
    m: int
    r: int
    tiles: int  # per call (all images)
    macs: int
    u: int  # transformed filter elements
    v_per_tile: int
    m_per_tile: int
    inputs: int
    outputs: int

    @property
    def alpha(self) -> int:
        return self.m + self.r - 1

    def block_footprint(self, tiles_per_block: int) -> int:
        """Elements of a block's input and output tiles (V and M) in one core's cache."""
        return tiles_per_block * (self.v_per_tile + self.m_per_tile)

    def dram(self) -> int:
        """Elements a call moves from DRAM inside a model: U once, inputs and outputs once."""
        return self.u + self.inputs + self.outputs

    def seconds(self, peak: float, bandwidth: float, ceiling: float = 1.0) -> float:
        """max(2 * macs / (ceiling * P), 4 * dram / B): peak in flop/s, bandwidth in bytes/s,
        ceiling the share of the peak this tile size's multiplies reach (1: an ideal kernel)."""
        if not 0 < ceiling <= 1 + 1e-9:
            raise MacoError(f"a Winograd ceiling is a share of the FMA peak in (0, 1], got {ceiling!r}")
        return max(2 * self.macs / (ceiling * peak), DTYPE_BYTES * self.dram() / bandwidth)

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "r": self.r, "tiles": self.tiles, "macs": self.macs, "u": self.u,
                "v_per_tile": self.v_per_tile, "m_per_tile": self.m_per_tile, "inputs": self.inputs,
                "outputs": self.outputs}


def winograd_cost(spec: ConvSpec, m: int) -> WinogradCost:
    """The counts above for `spec` (a conv Winograd applies to) in F(m x m, r x r)."""
    if m not in WINOGRAD_TILES.get(spec.kh, ()) or not winograd_applies(spec):
        raise MacoError(f"Winograd F({m}x{m}, {spec.kh}x{spec.kw}) does not apply to {spec}")
    r = spec.kh
    a = m + r - 1
    tiles = spec.n * ceil(spec.out_h / m) * ceil(spec.out_w / m)
    return WinogradCost(m, r, tiles, tiles * a * a * spec.c * spec.k, a * a * spec.c * spec.k, a * a * spec.c,
                        a * a * spec.k, spec.input_elems, spec.output_elems)


def predict_tile(spec: ConvSpec, peak: float, bandwidth: float,
                 ceilings: Mapping[tuple[int, int], float] | None = None,
                 tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES) -> tuple[int, dict[int, float]]:
    """(the tile size m of the least modelled time, {m: seconds}) for a conv Winograd applies to;
    `ceilings` {(m, r): share of the peak} as kernels.cpu_peak.winograd_ceilings measures them
    (None: every tile size at the full peak)."""
    if not winograd_applies(spec, tiles):
        raise MacoError(f"Winograd does not apply to {spec}")
    ceilings = ceilings or {}
    times = {m: winograd_cost(spec, m).seconds(peak, bandwidth, ceilings.get((m, spec.kh), 1.0))
             for m in tiles[spec.kh]}
    return ranked(times)[0], times


def ranked(times: Mapping[int, float]) -> tuple[int, ...]:
    """The tile sizes of {m: modelled seconds}, fastest first; of two equal, the larger tile."""
    return tuple(sorted(times, key=lambda m: (times[m], -m)))


def layer_reach(spec: ConvSpec, peak: float, bandwidth: float,
                ceilings: Mapping[tuple[int, int], float] | None = None, direct_share: float = 1.0,
                tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES,
                depthwise_share: float = 1.0) -> tuple[str, float]:
    """(algorithm, seconds): the fastest of MACO's kernel families for one conv, each family at its
    measured share of the peak (`ceilings` as predict_tile takes them; a tile size without one at
    the full peak; direct convs at `direct_share` and depthwise ones at `depthwise_share`, 1 by
    default: an optimistic reach) and its filters in the form its kernel reads them, weights or U,
    from DRAM, overlapping the multiplies: max(2 * macs / (share * P), 4 * filters / B).
    Activations stay in cache, as the network floor keeps them. A model of what these kernels can
    reach, not a bound: a kernel that transforms its filters as it reads them, or runs faster than
    its family's reference conv, goes below it."""
    options = ({"depthwise": (spec.macs, spec.weight_elems, depthwise_share)} if spec.is_depthwise
               else {"direct": (spec.macs, spec.weight_elems, direct_share)})
    if winograd_applies(spec, tiles):
        for m in tiles[spec.kh]:
            cost = winograd_cost(spec, m)
            options[tile_label(m, spec.kh)] = (cost.macs, cost.u, (ceilings or {}).get((m, spec.kh), 1.0))
    times = {}
    for name, (macs, filters, share) in options.items():
        if not 0 < share <= 1 + 1e-9:
            raise MacoError(f"{name}'s ceiling is a share of the FMA peak in (0, 1], got {share!r}")
        times[name] = max(2 * macs / (share * peak), DTYPE_BYTES * filters / bandwidth)
    best = min(times, key=times.__getitem__)
    return best, times[best]


def network_reach(layers: Sequence[NetLayer], peak: float, bandwidth: float,
                  ceilings: Mapping[tuple[int, int], float] | None = None, direct_share: float = 1.0,
                  tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES, depthwise_share: float = 1.0) -> float:
    """Seconds: layer_reach summed over a network's convs and linears, one layer at a time. Over
    the network floor it says how far MACO's kernel families at their ceilings stay from it, so
    how much of a model's distance from the floor is theirs rather than the rest of the model's."""
    return sum(layer_reach(layer.spec, peak, bandwidth, ceilings, direct_share, tiles, depthwise_share)[1]
               for layer in layers if layer.spec is not None)


@lru_cache(maxsize=1)
def crossover() -> dict[str, sp.Expr]:
    """F(2x2, 3x3) against F(4x4, 3x3) on an Ho x Wo layer (m | Ho, Wo), all symbolic, with the
    tile sizes' ceilings e_2 and e_4: `t2`, `t4` (each max(compute, memory)) and `area`, the Ho*Wo
    where F(4x4)'s DRAM time (its U, 36*C*K, with the inputs and outputs) equals F(2x2)'s compute,
    144*C*K*e_2*P / (8*C*K*B - 4*(C + K)*e_2*P); `area_limit`, its value for many channels,
    18*e_2*P/B. Where F(4x4) computes faster (16*e_4 > 9*e_2), it wins above the area and F(2x2)
    below it (the deep layers, where the larger U costs more than F(2x2)'s multiplies); where
    not, F(2x2) wins everywhere."""
    C, K, Ho, Wo, P, B, A = sp.symbols("C K H_o W_o P B A", positive=True)
    e = {2: sp.Symbol("e_2", positive=True), 4: sp.Symbol("e_4", positive=True)}
    io = Ho * Wo * (C + K)  # inputs and outputs, stride 1, same padding

    def t(m: int) -> tuple[sp.Expr, sp.Expr]:
        a = m + 2
        return 2 * (Ho / m) * (Wo / m) * a**2 * C * K / (e[m] * P), DTYPE_BYTES * (a**2 * C * K + io) / B
    (c2, m2), (c4, m4) = t(2), t(4)
    area = sp.solve(sp.Eq(m4.subs(Ho * Wo, A).subs(Wo, A / Ho), c2.subs(Wo, A / Ho)), A)
    return {"t2": sp.Max(c2, m2), "t4": sp.Max(c4, m4), "area": sp.simplify(area[0]),
            "area_limit": 18 * e[2] * P / B}
