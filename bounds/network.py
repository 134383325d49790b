"""A network-level floor at batch 1: the red-blue pebble game over a whole network's DAG with the
last-level cache as the fast memory and DRAM as the slow one, and the time it implies.

Per layer, at L1 and L2, the compulsory traffic is already the best lower bound of a batch-1 conv
(results/bounds_table.csv): eq. (7) cannot say more. The time of a batch-1 inference goes across
layers: every weight crosses from DRAM (ResNet-18 46 MB, ResNet-50 102 MB, against 32 MiB of L3),
and an activation crosses too when the live set at a layer boundary does not fit. This module
states that as a bound on the whole network and turns it into a floor in time.

Notation (elements of fp32; S: the fast memory, every on-chip cache together)
    network        layers j = 1..n in a topological order; layer j has w_j weights, produces a
                   tensor of a_j elements and reads the tensors of `inputs` (X: the image);
                   a "heavy" layer is a conv or a linear (a 1x1 conv on a 1x1 image), the other
                   layers (pool, add, cat, ...) have no weights and count no flops
    Y              the network's output: the tensors no layer reads
    L_b            live set before heavy layer b: the elements of every tensor produced before b
                   and read by b or a later layer (the image excluded)

Statements (proof sketches; tests/test_network_bound.py checks them against an exact pebbling
found by brute force on small networks):

1. Compulsory, any schedule (recomputation included): every weight and every image element
   starts in slow memory and is read, so it is loaded at least once; every output element is
   stored.  Q_cold >= sum_j w_j + X + Y.  Warm (a previous inference may leave up to S elements
   in the cache): Q_warm >= max(0, sum_j w_j + X - S) + Y.
2. Live set, for schedules that compute every vertex once (the red-blue-white game of Elango et
   al., SPAA 2014: no recomputation) and run the network a layer at a time at the heavy layers
   (at the moment heavy layer b starts, every layer ordered before it is done and none from it
   on has begun; elementwise epilogues may be fused anywhere): at that moment at most S
   elements are red, so at least L_b - S live elements are only in slow memory. Each was
   stored (it is not an input) and will be loaded (it cannot be recomputed), two moves that
   no compulsory term counts. Boundaries whose live sets share no tensor charge distinct
   elements, so the largest sum of max(0, L_b - S) over boundaries with pairwise disjoint live
   sets (`spill`: a tensor's lifetime is an interval of the order, so a dynamic program finds
   it exactly) adds 2 * spill to both bounds. Fusion that recomputes an activation (tiles with
   halos across layers) is outside this game: for it only statement 1 holds, which the report
   gives beside the floor (`q_any`). At batch 1 on a 32 MiB cache no live set of the built-in
   networks exceeds S, so both coincide there.
3. Arithmetic: a layer needs at least the multiply-adds of the cheapest algorithm MACO has for
   it: direct (kh*kw*C/g*Ho*Wo*K), or Winograd F(m x m, r x r) where it applies (r x r filters in
   `winograd`, stride 1, no dilation or groups, padding r // 2), whose element-wise stage takes
   ceil(Ho/m)*ceil(Wo/m)*(m + r - 1)^2*C*K multiply-adds; transforms are not counted (they only
   add). Each multiply-add is an FMA, 2 flops, as the FMA peak counts them.
4. Time: with a measured FMA peak P (flop/s) and DRAM bandwidth B (bytes/s), and memory allowed
   to overlap compute across the whole network,  t >= max(F / P, 4*Q / B),  F the flops of (3)
   summed, Q the warm bound of (1)+(2). The per-layer floors max(F_j / P, 4*Q_j / B) (with
   layer j's weights, the image if it reads it, the output if it writes it and the spill charged
   at its boundary) add up to a larger number that holds only for engines that overlap nothing
   across layers; the network floor is the smaller, sound one.

`derive_network()` writes these as sympy expressions; `network_floor()` evaluates them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil
from typing import Any, Mapping, Sequence

import sympy as sp

from maco.core.errors import MacoError
from maco.core.spec import DTYPE_BYTES, ConvSpec

INPUT = "input"  # the name a layer lists among its inputs for the network's image
# r -> the output tile sizes m of MACO's Winograd F(m x m, r x r) (kernels/winograd.py TILE_SIZES;
# bounds/ cannot import kernels/, so the data is repeated here and a test checks they agree)
WINOGRAD_TILES: Mapping[int, tuple[int, ...]] = {3: (2, 4), 5: (2, 4)}


def tile_label(m: int, r: int) -> str:
    """How reports name a Winograd tile size: F(m x m, r x r) written F(4x4,3x3)."""
    return f"F({m}x{m},{r}x{r})"


# -- the symbolic derivation -----------------------------------------------------------------
@dataclass(frozen=True)
class NetworkDerivation:
    """The floor's pieces as sympy expressions (symbols in `symbols`)."""

    macs_direct: sp.Expr
    macs_winograd: sp.Expr
    winograd_ratio: sp.Expr  # direct / Winograd multiply-adds for whole tiles, m | Ho, Wo
    q_cold: sp.Expr
    q_warm: sp.Expr
    spill_boundary: sp.Expr
    t_floor: sp.Expr
    symbols: dict[str, sp.Symbol] = field(default_factory=dict)


@lru_cache(maxsize=1)
def derive_network() -> NetworkDerivation:
    C, K, Ho, Wo, r, m = sp.symbols("C K H_o W_o r m", positive=True, integer=True)
    Wt, X, Y, S, Sp, L = sp.symbols("W X Y S Spill L_b", nonnegative=True)
    F, P, B = sp.symbols("F P B", positive=True)
    macs_direct = Ho * Wo * K * C * r**2
    macs_wino = sp.ceiling(Ho / m) * sp.ceiling(Wo / m) * (m + r - 1)**2 * C * K
    ratio = sp.simplify(macs_direct / (Ho / m * Wo / m * (m + r - 1)**2 * C * K))
    spill_b = sp.Max(0, L - S)
    q_cold = Wt + X + Y + 2 * Sp
    q_warm = sp.Max(0, Wt + X - S) + Y + 2 * Sp
    t = sp.Max(F / P, DTYPE_BYTES * q_warm / B)
    syms = {str(s): s for s in (C, K, Ho, Wo, r, m, Wt, X, Y, S, Sp, L, F, P, B)}
    return NetworkDerivation(macs_direct, macs_wino, ratio, q_cold, q_warm, spill_b, t, syms)


# -- the network as plain values -------------------------------------------------------------
@dataclass(frozen=True)
class NetLayer:
    """One node of a network's DAG: a conv or linear (`spec`; a linear is a 1x1 conv on a 1x1
    image) or a light op (spec None: pool, add, cat, ...) producing `out_elems` elements from
    the tensors of `inputs` (layer names, INPUT for the image)."""

    name: str
    inputs: tuple[str, ...]
    out_elems: int
    spec: ConvSpec | None = None
    kind: str = "conv"

    def __post_init__(self) -> None:
        if not isinstance(self.out_elems, int) or self.out_elems < 0:
            raise MacoError(f"layer {self.name!r}: out_elems must be a non-negative int, got {self.out_elems!r}")
        if self.spec is not None and not isinstance(self.spec, ConvSpec):
            raise MacoError(f"layer {self.name!r}: spec must be a ConvSpec, got {type(self.spec).__name__}")

    @property
    def weights(self) -> int:
        return self.spec.weight_elems if self.spec is not None else 0


def winograd_applies(spec: ConvSpec, tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES) -> bool:
    """MACO's shape rule for Winograd (kernels/winograd.py winograd_can_run without its vector
    width conditions: a floor may assume the cheaper algorithm wherever the shape allows it)."""
    r = spec.kh
    return (spec.kw == r and r in tiles and spec.stride == (1, 1) and spec.dilation == (1, 1)
            and spec.groups == 1 and spec.padding == (r // 2, r // 2))


def layer_macs(spec: ConvSpec, tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES) -> dict[str, int]:
    """Multiply-adds of each algorithm MACO has for `spec`: "direct", and "F(m,r)" per tile size
    where Winograd applies (derive_network's expressions, evaluated exactly)."""
    out = {"direct": spec.macs}
    if winograd_applies(spec, tiles):
        r = spec.kh
        for m in tiles[r]:
            out[tile_label(m, r)] = (spec.n * ceil(spec.out_h / m) * ceil(spec.out_w / m)
                                     * (m + r - 1) ** 2 * spec.c * spec.k)
    return out


def cheapest(spec: ConvSpec, tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES) -> tuple[str, int]:
    """(algorithm, multiply-adds) of the cheapest algorithm for `spec`."""
    macs = layer_macs(spec, tiles)
    name = min(macs, key=macs.__getitem__)
    return name, macs[name]


def _check_rates(peak: float | None, bandwidth: float | None) -> None:
    """A given FMA peak (flop/s) and DRAM bandwidth (bytes/s) are finite positive numbers."""
    for name, v in (("peak", peak), ("bandwidth", bandwidth)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise MacoError(f"{name} must be a positive number, got {v!r}")


def conv_floor(spec: ConvSpec, peak: float, bandwidth: float,
               tiles: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES) -> tuple[str, float]:
    """(algorithm, seconds): one conv's floor with its weights coming from memory, memory
    overlapping compute: max(2 * multiply-adds of the cheapest algorithm / peak, weight bytes /
    bandwidth) (statements 1, 3 and 4 for one layer, its activations in cache). A kernel's time
    over it says how far that kernel runs from what the host allows."""
    _check_rates(peak, bandwidth)
    algorithm, macs = cheapest(spec, tiles)
    return algorithm, max(2 * macs / peak, DTYPE_BYTES * spec.weight_elems / bandwidth)


# -- the floor -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerFloor:
    name: str
    kind: str
    spec: ConvSpec | None
    weights: int  # elements
    act_in: int  # elements of the tensors it reads (the image included)
    act_out: int
    live: int | None  # live set before it (heavy layers), elements
    resident: bool | None  # live <= S
    spill: int  # elements of this boundary's excess that the floor charges (twice: store + load)
    q: int  # elements its floor charges: weights, image, output, 2 * spill
    algorithm: str
    flops_direct: int
    flops: int  # of the cheapest algorithm
    t_compute: float | None = None  # seconds, where a peak was given
    t_memory: float | None = None

    @property
    def t(self) -> float | None:
        return None if self.t_compute is None else max(self.t_compute, self.t_memory or 0.0)

    @property
    def binds(self) -> str:
        if self.t_compute is None or self.t_memory is None:
            return ""
        return "compute" if self.t_compute >= self.t_memory else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "spec": str(self.spec) if self.spec else None,
                "weights": self.weights, "act_in": self.act_in, "act_out": self.act_out,
                "live": self.live, "resident": self.resident, "spill": self.spill, "q": self.q,
                "algorithm": self.algorithm, "flops_direct": self.flops_direct, "flops": self.flops,
                "t_compute": self.t_compute, "t_memory": self.t_memory, "t": self.t, "binds": self.binds}


@dataclass(frozen=True)
class NetworkFloor:
    S: int  # elements
    layers: tuple[LayerFloor, ...]
    weights: int
    image: int
    output: int
    spill: int  # elements; the floor moves each twice
    max_live: int
    flops: int
    flops_direct: int
    peak: float | None = None  # flop/s
    bandwidth: float | None = None  # bytes/s

    @property
    def q_any(self) -> int:
        """Statement 1, cold: a bound for every schedule."""
        return self.weights + self.image + self.output

    @property
    def q_cold(self) -> int:
        return self.q_any + 2 * self.spill

    @property
    def q_warm(self) -> int:
        return max(0, self.weights + self.image - self.S) + self.output + 2 * self.spill

    @property
    def t_compute(self) -> float | None:
        return None if self.peak is None else self.flops / self.peak

    @property
    def t_memory(self) -> float | None:
        return None if self.bandwidth is None else DTYPE_BYTES * self.q_warm / self.bandwidth

    @property
    def t_memory_cold(self) -> float | None:
        return None if self.bandwidth is None else DTYPE_BYTES * self.q_cold / self.bandwidth

    @property
    def t(self) -> float | None:
        """The floor in seconds: max(F / P, bytes / B), memory overlapping compute."""
        if self.t_compute is None or self.t_memory is None:
            return None
        return max(self.t_compute, self.t_memory)

    @property
    def binds(self) -> str:
        if self.t_compute is None or self.t_memory is None:
            return ""
        return "compute" if self.t_compute >= self.t_memory else "memory"

    @property
    def t_layers(self) -> float | None:
        """Sum of the per-layer floors: a floor only for engines that overlap nothing across layers."""
        ts = [lf.t for lf in self.layers]
        return None if any(t is None for t in ts) else sum(t for t in ts if t is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"S": self.S, "weights": self.weights, "image": self.image, "output": self.output,
                "spill": self.spill, "max_live": self.max_live, "flops": self.flops,
                "flops_direct": self.flops_direct, "q_any": self.q_any, "q_cold": self.q_cold,
                "q_warm": self.q_warm, "peak": self.peak, "bandwidth": self.bandwidth,
                "t_compute": self.t_compute, "t_memory": self.t_memory,
                "t_memory_cold": self.t_memory_cold, "t": self.t, "binds": self.binds,
                "t_layers": self.t_layers, "layers": [lf.to_dict() for lf in self.layers]}


def _check(layers: Sequence[NetLayer]) -> dict[str, int]:
    if not layers:
        raise MacoError("a network floor needs at least one layer")
    index: dict[str, int] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, NetLayer):
            raise MacoError(f"network layers must be NetLayer values, got {type(layer).__name__}")
        if layer.name in index or layer.name == INPUT:
            raise MacoError(f"layer name {layer.name!r} is repeated or reserved")
        for src in layer.inputs:
            if src != INPUT and src not in index:
                raise MacoError(f"layer {layer.name!r} reads {src!r}, which is not an earlier layer "
                                "(layers must come in a topological order)")
        index[layer.name] = i
    return index


def live_sets(layers: Sequence[NetLayer]) -> tuple[dict[int, int], list[tuple[int, int, int]]]:
    """({position of each heavy layer: elements live before it}, [(produced at, last read at, elements)]
    of each tensor that some later layer reads)."""
    index = _check(layers)
    last: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for src in layer.inputs:
            if src != INPUT:
                last[src] = max(last.get(src, -1), i)
    tensors = [(index[name], end, layers[index[name]].out_elems) for name, end in last.items()]
    live = {p: sum(a for born, end, a in tensors if born < p <= end)
            for p, layer in enumerate(layers) if layer.spec is not None}
    return live, tensors


def spill(layers: Sequence[NetLayer], S: int) -> tuple[int, dict[int, int]]:
    """Statement 2: the largest sum of max(0, L_b - S) over heavy-layer boundaries whose live sets
    share no tensor, and the excess charged at each boundary of that choice."""
    live, tensors = live_sets(layers)
    bounds = sorted(live)
    excess = [max(0, live[p] - S) for p in bounds]

    def disjoint(p: int, q: int) -> bool:  # p < q: no tensor alive at both
        return not any(born < p and end >= q for born, end, _ in tensors)

    best = [0] * (len(bounds) + 1)  # best[k]: over the first k boundaries
    take: list[tuple[bool, int]] = [(False, 0)] * (len(bounds) + 1)
    for k in range(1, len(bounds) + 1):
        q = bounds[k - 1]
        prev = k - 1
        while prev > 0 and not disjoint(bounds[prev - 1], q):  # disjointness is monotone in p
            prev -= 1
        with_it = excess[k - 1] + best[prev]
        best[k], take[k] = (with_it, (True, prev)) if with_it > best[k - 1] else (best[k - 1], (False, k - 1))
    charged: dict[int, int] = {}
    k = len(bounds)
    while k > 0:
        used, prev = take[k]
        if used:
            charged[bounds[k - 1]] = excess[k - 1]
            k = prev
        else:
            k -= 1
    return best[-1], charged


def network_floor(layers: Sequence[NetLayer], S: int, image: int, *,
                  winograd: Mapping[int, tuple[int, ...]] = WINOGRAD_TILES,
                  peak: float | None = None, bandwidth: float | None = None) -> NetworkFloor:
    """The floor of a network (`layers` in the order it runs) with S elements of fast memory, an
    image of `image` elements, and optionally the host's FMA peak (flop/s) and DRAM bandwidth
    (bytes/s) for the floor in time. `winograd`: r -> tile sizes m ({} for direct only)."""
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise MacoError(f"fast memory S must be a positive int of elements, got {S!r}")
    if isinstance(image, bool) or not isinstance(image, int) or image < 0:
        raise MacoError(f"image must be a non-negative int of elements, got {image!r}")
    _check_rates(peak, bandwidth)
    live, _ = live_sets(layers)
    total_spill, charged = spill(layers, S)
    read = {src for layer in layers for src in layer.inputs}
    sizes = {layer.name: layer.out_elems for layer in layers}
    out_rows = []
    for i, layer in enumerate(layers):
        act_in = sum(image if src == INPUT else sizes[src] for src in dict.fromkeys(layer.inputs))
        is_output = layer.name not in read
        if layer.spec is not None:
            algo, macs = cheapest(layer.spec, winograd)
            direct = 2 * layer.spec.macs
            flops = 2 * macs
        else:
            algo, direct, flops = "-", 0, 0
        q = (layer.weights + (image if INPUT in layer.inputs else 0)
             + (layer.out_elems if is_output else 0) + 2 * charged.get(i, 0))
        lv = live.get(i)
        t_c = flops / peak if peak else None
        t_m = DTYPE_BYTES * q / bandwidth if bandwidth else None
        out_rows.append(LayerFloor(layer.name, layer.kind, layer.spec, layer.weights, act_in,
                                   layer.out_elems, lv, None if lv is None else lv <= S,
                                   charged.get(i, 0), q, algo, direct, flops, t_c, t_m))
    output = sum(layer.out_elems for layer in layers if layer.name not in read)
    return NetworkFloor(S, tuple(out_rows), sum(lf.weights for lf in out_rows), image if any(
        INPUT in layer.inputs for layer in layers) else 0, output, total_spill,
        max(live.values(), default=0), sum(lf.flops for lf in out_rows),
        sum(lf.flops_direct for lf in out_rows), peak, bandwidth)
