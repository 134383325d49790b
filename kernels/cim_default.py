"""Two CIM schedules built without search: the chip compiler's default template, and MACO's
bound-derived default (maco.bounds.cim, maco.space.prune_cim).

The template splits the output channels by the MVM unit (arch.rows, 64 by default), binds the
outer part across the cores, and finishes each output pixel before it moves on: for every pixel
it runs every channel block through the crossbars, so a layer whose reduction spans several blocks
rewrites them at every pixel.

MACO's default meets the bound's conditions: cores bound to output channels (no weight written on
two cores), the loops over pixels inside the weight loops so that each block is written once per
sweep, and the sweep cut into as few chunks as the psum buffer forces (one when the reduction fits
the crossbars). Within that it fills the crossbars (the widest block of output channels that keeps
the chunk count, the most reduction rows) and keeps each window whole input rows, so that in NCHW a
window's rows are one DMA transaction.
"""
from __future__ import annotations

from itertools import product

from maco.core.errors import MacoError
from maco.core.factors import divisors
from maco.space.prune_cim import cim_rules, one_block_fits
from maco.core.schedule import Schedule
from maco.core.sketch_cim import cim_crossbars
from maco.core.spec import ConvSpec
from maco.core.target import CimArch, Target

TEMPLATE_ORDER = ("g", "k", "n", "oh", "ow", "c", "kh", "kw")


def _largest(n: int, ok) -> int:
    """The largest divisor of n that `ok` accepts (1 if none does)."""
    return max((d for d in divisors(n) if ok(d)), default=1)


def reduction_block(spec: ConvSpec, arch: CimArch, columns: int) -> tuple[int, int, int]:
    """(c, kh, kw) of the tallest block of the reduction that fits the crossbars beside `columns`
    weight columns: the whole window with as many channels as fit, else part of the window."""
    def fits(rows: int) -> bool:
        return cim_crossbars(arch, rows, columns) <= arch.crossbars

    window = spec.kh * spec.kw
    if fits(window):
        return _largest(spec.c_per_group, lambda c: fits(c * window)), spec.kh, spec.kw
    if fits(spec.kw):
        return 1, _largest(spec.kh, lambda h: fits(h * spec.kw)), spec.kw
    if fits(1):
        return 1, 1, _largest(spec.kw, fits)
    raise MacoError(f"{columns} output channels do not fit {arch.crossbars} crossbars of "
                    f"{arch.weight_columns} weight columns")


def _schedule(spec: ConvSpec, cores: dict[str, int], tile: dict[str, int],
              order: tuple[str, ...]) -> Schedule:
    extents = {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h, "ow": spec.out_w,
               "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}
    spatial = tuple((cores.get(a, 1), extents[a] // (cores.get(a, 1) * tile[a]), tile[a])
                    for a in ("n", "g", "k", "oh", "ow"))
    reduction = tuple((extents[a] // tile[a], tile[a]) for a in ("c", "kh", "kw"))
    return Schedule(kind="cim", spatial=spatial, reduction=reduction, layout="NCHW", loop_order=order)


def _check(spec: ConvSpec, target: Target) -> CimArch:
    from maco.kernels.cim_cost import check_size

    if target.kind != "cim":
        raise MacoError(f"a CIM schedule needs a cim target, got {target.kind!r}")
    check_size(spec)
    return target.cim_arch


def template_schedule(spec: ConvSpec, target: Target) -> Schedule:
    """The chip compiler's default: output channels in blocks of the MVM unit bound across the
    cores, each output pixel finished (every channel block) before the next."""
    arch = _check(spec, target)
    kt = _largest(spec.k_per_group, lambda k: k <= arch.rows
                  and cim_crossbars(arch, 1, k) <= arch.crossbars)
    cores_k = _largest(spec.k_per_group // kt, lambda p: p <= arch.cores)
    c, kh, kw = reduction_block(spec, arch, kt)
    tile = {"n": 1, "g": 1, "k": kt, "oh": 1, "ow": 1, "c": c, "kh": kh, "kw": kw}
    return _schedule(spec, {"k": cores_k}, tile, TEMPLATE_ORDER).validate(spec, target)


def default_schedule(spec: ConvSpec, target: Target) -> Schedule:
    """MACO's bound-derived default (see the module docstring)."""
    arch = _check(spec, target)
    cores_k = _largest(spec.k_per_group, lambda p: p <= arch.cores)
    cores_g = _largest(spec.groups, lambda p: p <= arch.cores // cores_k)
    k_core = spec.k_per_group // cores_k
    cap = arch.psum_capacity
    if one_block_fits(spec, target):
        chunks = {"n": 1, "oh": 1, "ow": 1}
        kt = _largest(k_core, lambda k: cim_crossbars(arch, spec.c_per_group * spec.kh * spec.kw, k)
                      <= arch.crossbars)
    else:  # the fewest chunks, then the widest block of output channels that keeps them
        fewest = cim_rules(spec, target).max_chunks
        best = None
        for on, oh, ow in product(divisors(spec.n), divisors(spec.out_h), divisors(spec.out_w)):
            pixels = (spec.n // on) * (spec.out_h // oh) * (spec.out_w // ow)
            if on * oh * ow != fewest or pixels > cap:
                continue
            kt = _largest(k_core, lambda k: pixels * k <= cap
                          and cim_crossbars(arch, 1, k) <= arch.crossbars)
            key = (kt, -ow, -oh)  # prefer whole rows, then whole images
            if best is None or key > best[0]:
                best = (key, {"n": on, "oh": oh, "ow": ow})
        if best is None:
            raise MacoError(f"no chunking of {spec} fits the psum buffer of {cap} partial sums")
        kt, chunks = best[0][0], best[1]
    c, kh, kw = reduction_block(spec, arch, kt)
    tile = {"g": 1, "k": kt, "c": c, "kh": kh, "kw": kw}
    extent = {"n": spec.n, "oh": spec.out_h, "ow": spec.out_w}
    for axis in ("n", "oh", "ow"):  # a chunked axis's tile is its chunk; the others stream
        tile[axis] = extent[axis] // chunks[axis] if chunks[axis] > 1 else extent[axis]
    order = tuple(a for a in ("n", "oh", "ow") if chunks[a] > 1) + ("g", "k", "c", "kh", "kw") \
        + tuple(a for a in ("n", "oh", "ow") if chunks[a] == 1)
    # shrink the streamed tile (images first, then rows, then columns) until it fits the buffers
    cores = {"k": cores_k, "g": cores_g}
    for axis in (a for a in ("n", "oh", "ow") if chunks[a] == 1):
        while tile[axis] > 1:
            schedule = _schedule(spec, cores, tile, order)
            if not schedule.problems(spec, target):
                return schedule
            tile[axis] = max(d for d in divisors(extent[axis]) if d < tile[axis])
    return _schedule(spec, cores, tile, order).validate(spec, target)
