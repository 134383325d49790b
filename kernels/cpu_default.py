"""The default CPU schedule: MACO's tiles mapped onto the "SSRSRS" factors, no search.

  * S3 (register tile): the vector axis k when the group has a multiple of the SIMD width of
    filters (weight vector x input broadcast), else ow (input row vector x weight broadcast);
    the tile that keeps both FMA pipes busy with the fewest loads per FMA and no spills.
  * S2 / S1: the I/O-optimal output tiles x*y*z of maco.bounds (x*y = R*z) for L1 and L2,
    snapped to divisors of the extents and to multiples of the tile inside them.
  * S0: what is left, with factors moved out of S1/S2 until every core gets the same number of
    tiles; `parallel` fuses the leading S0 loops that carry them.
  * R0 = 1: each register tile reduces over all channels and taps in registers, unless the
    filters outgrow half of L2: then channel chunks slide by (R0 > 1) while the outputs wait in
    L2, the bounds' dataflow one level up (inside the filter blocks when the input is small,
    outside them, the core's outputs as the L2 tile, when neither fits; NHWC only).
"""
from __future__ import annotations

from math import prod

from maco.bounds import optimal_tile
from maco.core.errors import MacoError
from maco.core.axes import SPATIAL_AXES, axis_extents
from maco.core.schedule import LAYOUTS, Schedule
from maco.core.sketch_cpu import free_registers, vector_width
from maco.core.factors import divisors
from maco.core.spec import ConvSpec
from maco.core.target import Target


def _register_tiles(spec: ConvSpec, target: Target, layout: str):
    """(score, tile dict, vector axis, width, loads a step) of every register tile worth considering."""
    W = target.simd_width
    nregs = target.level("registers").elements // W
    free = free_registers(target)
    kpg, oh, ow = spec.k_per_group, spec.out_h, spec.out_w
    fast_ow = layout == "NCHW" and spec.stride[1] == 1 and target.isa in ("avx512", "avx2")
    # the k vectors: the widest that divides the filters (AVX2's 8 floats for 24 or 40 filters on an
    # AVX-512 CPU), scored at its share of the full width's FMAs
    kw = vector_width(target, kpg)
    out = []
    for y in divisors(oh):
        for x in divisors(ow):
            # vector axis k: kv weight vectors, x*y broadcasts per reduction step
            if kw > 1:
                for kv in divisors(kpg // kw):
                    acc = kv * x * y
                    if acc > free:
                        continue
                    loads = kv + x * y
                    regs = acc + kv + 1
                    score = _score(acc, loads, regs, nregs) * kw / W
                    out.append((score, dict(k=kv * kw, oh=y, ow=x), "k", kw, loads))
            # vector axis ow: x/W input vectors, k3 weight broadcasts per step
            if fast_ow and x % W == 0:
                for k3 in divisors(kpg):
                    acc = k3 * y * x // W
                    if acc > free:
                        continue
                    loads = k3 + y * x // W
                    regs = acc + y * x // W + 1
                    out.append((_score(acc, loads, regs, nregs), dict(k=k3, oh=y, ow=x), "ow", W, loads))
    return out


def _score(acc: int, loads: int, regs: int, nregs: int) -> float:
    """Fraction of FMA peak one reduction step can reach: 2 FMAs and 2 loads per cycle, an
    accumulator waits 4 cycles for its last FMA, spills cost a load and a store each."""
    spill = max(0, regs - nregs)
    cycles = max(acc / 2, (loads + 2 * spill) / 2, 4.0)
    return acc / 2 / cycles + 0.001 * acc


def _tile_preference(spec: ConvSpec, score: float, tile: dict[str, int], vaxis: str, loads: int) -> tuple:
    """Best score first; among equals, for input broadcasts (vector axis k) the fewest distinct
    input elements per output (the register tile's own x*y vs R*z trade: 2x7 outputs read a
    4x9 window at 3x3, 1x14 a 3x16 one; measured 1.05x on average, up to 1.4x on ResNet-18's
    7x7 stem), then the fewest loads a step (filter vectors plus broadcasts: on a 1x1 conv 7
    pixels x 4 filter vectors take 11 where 14 x 2 take 16, and the broadcasts of 14 pixels of a
    deep NHWC input, 4 KiB apart at 1024 channels, share one set of L1), then the wider row
    (ow vectors: rows are separate vector loads)."""
    x, y = tile["ow"], tile["oh"]
    if vaxis != "k":
        return round(score, 9), -1.0, 0, x
    window = (_distinct(x, spec.stride[1], spec.kw, spec.dilation[1])
              * _distinct(y, spec.stride[0], spec.kh, spec.dilation[0])) / (x * y)
    return round(score, 9), -round(window, 9), -loads, x


def _distinct(outputs: int, stride: int, taps: int, dilation: int) -> int:
    """Input positions along one axis that `outputs` consecutive outputs read."""
    return len({i * stride + j * dilation for i in range(outputs) for j in range(taps)})


def _scalar_tile(spec: ConvSpec, target: Target) -> dict[str, int]:
    free = free_registers(target)
    best = (0, {})
    for y in divisors(spec.out_h):
        for x in divisors(spec.out_w):
            for k in divisors(spec.k_per_group):
                if x * y * k <= free and x * y * k > best[0]:
                    best = (x * y * k, dict(k=k, oh=y, ow=x))
    return best[1]


def _snap(extent: int, inner: int, want: int) -> int:
    """The multiple of `inner` dividing `extent` closest to `want` from below (at least inner)."""
    ok = [d for d in divisors(extent) if d % inner == 0 and d <= max(want, inner)]
    return max(ok)


def default_schedule(spec: ConvSpec, target: Target | None = None, layout: str = "NCHW") -> Schedule:
    """A fast schedule for `spec` on a CPU target (the host when None) without any search."""
    target = target or Target.host()
    if target.kind != "cpu":
        raise MacoError(f"default_schedule for the CPU backend needs a cpu Target, got {target.name!r}")
    if layout not in LAYOUTS:
        raise MacoError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ext = axis_extents(spec)
    tiles = _register_tiles(spec, target, layout)
    if tiles:
        _, reg, vaxis, width, _ = max(tiles, key=lambda t: _tile_preference(spec, *t[:3], t[4]))
    else:
        reg, vaxis, width = _scalar_tile(spec, target), "k", 1
    t3 = {"n": 1, "g": 1, **reg}
    t1, t2, c1, split, sliding = _cache_tiles(spec, target, layout, ext, t3)
    _share_cores(ext, t1, t2, t3, split, target.cores)
    if sliding:
        c1 = _sliding_chunk(spec, target, ext, t2, t3)
    spatial = tuple((ext[a] // t1[a], t1[a] // t2[a], t2[a] // t3[a], t3[a]) for a in SPATIAL_AXES)
    s0 = [f[0] for f in spatial]
    parallel = max((i + 1 for i, f in enumerate(s0) if f > 1), default=0)
    reduction = ((ext["c"] // c1, c1), (1, ext["kh"]), (1, ext["kw"]))
    order = ("c", "kh", "kw") if layout == "NCHW" else ("kh", "kw", "c")
    return Schedule(kind="cpu", spatial=spatial, reduction=reduction, parallel=parallel,
                    vector_axis=vaxis, vector_width=width, unroll=0, inner_order=order,
                    layout=layout, weight_packing="blocked").validate(spec, target)


def _cache_tiles(spec: ConvSpec, target: Target, layout: str, ext: dict[str, int],
                 t3: dict[str, int]) -> tuple[dict[str, int], dict[str, int], int, tuple[str, ...], bool]:
    """The L2 tile t1, the L1 tile t2, the channel chunk c1, the order in which cores split the
    tiles, and whether channel chunks slide past L2-resident outputs (NHWC, neither filters nor
    input fit L2)."""
    # S1 = the L2 tile (per core) of the bounds: its z filters stay in L2 while the tile's
    # positions go by; S2 = all k blocks of that tile at one register tile's positions, so the
    # input window (and a border patch) stays in L1 while the filters go by.
    t1 = dict(t3)
    try:
        best = optimal_tile(spec, target.level("L2").elements, target.level("L2").processors)
        for axis, want in (("ow", best.x), ("oh", best.y), ("k", best.z)):
            t1[axis] = _snap(ext[axis], t3[axis], want)
    except MacoError:
        pass
    t2 = dict(t3, k=t1["k"])
    c1 = ext["c"]
    taps = spec.kh * spec.kw
    l2 = target.level_bytes("L2", 1 << 20)
    split = ("n", "g", "oh", "k", "ow")
    weight_bytes = spec.k_per_group * ext["c"] * taps * 4
    input_bytes = spec.out_h * spec.out_w * ext["c"] * 4
    sliding = layout == "NHWC" and weight_bytes > l2 // 2 and input_bytes >= l2 // 2
    if sliding:
        # neither filters nor input fit L2: the bounds' L2 dataflow. Each core's outputs stay
        # in L2 (S1 = 1, S2 = the core's share) while channel chunks slide by (R0 outermost),
        # each chunk's filters read once and serving every position (S2: filter blocks outside
        # positions); the chunk is sized by _sliding_chunk, once the core's share is known. Measured on
        # VGG-11's 56x56 and 28x28 layers: 1.10-1.13x over R0 = 1 in NHWC; in NCHW a chunk's
        # input spans as many channel planes and it lost (0.73-0.79x), so NCHW keeps R0 = 1.
        t1 = dict(t3, k=spec.k_per_group, oh=spec.out_h, ow=spec.out_w)
        t2 = dict(t1)
    elif weight_bytes > l2 // 2 and input_bytes < l2 // 2:
        # filters outweigh the input (deep layers): walk the filters once, slide over channel
        # chunks (R0; partial sums stay in the L2-resident outputs) and revisit the small input
        t1 = dict(t3, k=spec.k_per_group, oh=spec.out_h, ow=spec.out_w)
        t2 = dict(t3, oh=spec.out_h, ow=spec.out_w)
        # the largest chunk whose block of one register tile's filters fills at most a quarter of
        # L2 (the rest holds the input and the outputs); an eighth cost AlexNet's 5x5 layer 3%
        c1 = max(d for d in divisors(ext["c"]) if d == 1 or t3["k"] * d * taps * 4 <= l2 // 4)
        # cores split by rows where they share out evenly (NHWC; each core then keeps half the
        # input in its L2: 1.07-1.08x on VGG-11's features.11), else by filters (NCHW measured
        # 0.91-1.00x by rows)
        if layout == "NCHW" or (spec.out_h // t3["oh"]) % target.cores:
            split = ("n", "g", "k", "oh", "ow")
    return t1, t2, c1, split, sliding


def _share_cores(ext: dict[str, int], t1: dict[str, int], t2: dict[str, int], t3: dict[str, int],
                 split: tuple[str, ...], cores: int) -> None:
    """S0, the rest: split the L2 tile further (in place) until the cores share the tiles evenly,
    images first, then groups, then rows or filters as `split` orders them."""
    def outer() -> int:
        return prod(ext[a] // t1[a] for a in SPATIAL_AXES)

    for _ in range(64):
        if outer() % cores == 0:
            break
        for axis in split:
            ds = [d for d in divisors(t1[axis]) if d % t3[axis] == 0 and d < t1[axis]]
            if ds:
                t1[axis] = max(ds)
                t2[axis] = _snap(t1[axis], t3[axis], min(t2[axis], t1[axis]))
                break
        else:
            break  # nothing left to split: accept the imbalance


def _sliding_chunk(spec: ConvSpec, target: Target, ext: dict[str, int], t2: dict[str, int],
                   t3: dict[str, int]) -> int:
    """S1 = 1 for sliding chunks: the core's share is its L2 tile, unless it outgrows half of L2
    (t2 shrunk in place), and the channel chunk that fits beside it."""
    l2, taps = target.level_bytes("L2", 1 << 20), spec.kh * spec.kw
    for axis in ("oh", "ow"):
        while prod(t2.values()) * 4 > l2 // 2:
            ds = [d for d in divisors(t2[axis]) if d % t3[axis] == 0 and d < t2[axis]]
            if not ds:
                break
            t2[axis] = max(ds)
    # the largest chunk whose input patch and one filter block, beside the outputs, fill at
    # most 3/4 of L2 (the footprint x*y*z + c1*(x'*y' + z*kh*kw)); chunks sized to half of
    # L1 instead ran 4-5% slower on VGG-11's features.8 and .13
    ih = (t2["oh"] - 1) * spec.stride[0] + spec.dilated_kh
    iw = (t2["ow"] - 1) * spec.stride[1] + spec.dilated_kw
    return max(d for d in divisors(ext["c"])
               if d == 1 or 4 * (prod(t2.values()) + d * (ih * iw + t3["k"] * taps)) <= l2 * 3 // 4)
