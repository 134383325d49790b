"""A functional simulator of a compute-in-memory (CIM) schedule, written to be checked against.

`simulate` executes a "cim" Schedule (see maco.core.schedule) on the chip of a `Target.cim` with integer
numpy arithmetic: it writes each weight block into crossbar cells, loads input windows into the
input buffer, streams the tile's pixels through the crossbars and accumulates partial sums, and it
counts the events (weight updates, DMA transactions, buffer peaks) as they happen. It is a
brute-force walker on purpose, independent of the closed-form cost model (maco.kernels.cim_cost):
its output must equal a quantised reference conv exactly, and its counts must equal the model's.
Numpy only vectorises the work inside one iteration (the tile's pixels, the crossbars of a block).

Choices where the hardware description leaves room:
- Cell encodings (`cell_encoding`): "offset" when cells_per_weight is the fewest cells that hold a
  weight (ceil(weight_bits / cell_bits)): u = w + 2**(weight_bits-1) in base 2**cell_bits digits,
  least significant first; the MVM removes the offset as 2**(weight_bits-1) * sum(inputs).
  "differential" when cells_per_weight is twice that: w+ = max(w, 0) in the first
  cells_per_weight // 2 cells, w- = max(-w, 0) in the rest; the MVM subtracts the two halves.
  maco.core.target.CimArch refuses any other cell count.
- Inputs are applied as signed input_bits-bit ints, one activation per pixel and crossbar
  (a bit-serial drive would give the same sums).
- A window is fetched whenever its index (the tile's images and pixels, the block's channels and
  taps) differs from the previous iteration's: the DMA engine is told a box, it does not compare
  contents. A box that reads only padding is a fetch of 0 elements and 0 transactions.
- Partial sums are kept in int64 but must fit psum_bytes * 8 signed bits, else MacoError.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from maco.core.errors import MacoError
from maco.core.geometry import input_span
from maco.core.axes import SPATIAL_AXES
from maco.core import sketch_cim
from maco.core.schedule import Schedule
from maco.core.spec import ConvSpec
from maco.core.target import CimArch, Target

_CACHE_LIMIT = 256  # encoded blocks kept for reuse (a reload writes the same cells again)
_MEMO_LIMIT = 1 << 16  # transaction counts of windows and output tiles kept for reuse


@dataclass(frozen=True)
class SimCounts:
    """Events of one execution, summed over the cores (max_core_*: the busiest core)."""

    weight_loads: int
    weight_cells: int
    crossbar_writes: int
    input_loads: int
    input_elements: int
    input_transactions: int
    output_elements: int
    output_transactions: int
    mvms: int
    peak_input_bytes: int
    peak_psums: int
    max_core_weight_cells: int
    max_core_mvms: int


@dataclass(frozen=True)
class SimResult:
    output: np.ndarray  # int64, NCHW, spec.output_shape, no bias
    counts: SimCounts


def quantize(x: Any, bits: int) -> tuple[np.ndarray, float]:
    """Symmetric per-tensor quantisation: ints in [-(2**(bits-1)-1), 2**(bits-1)-1] and the scale
    with x ~ ints * scale (scale 1.0 for an all-zero tensor)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 32:
        raise MacoError(f"quantize: bits must be an int in 2..32, got {bits!r}")
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise MacoError("quantize: the tensor holds NaN or infinite values")
    top = 2 ** (bits - 1) - 1
    amax = float(np.max(np.abs(a))) if a.size else 0.0
    scale = amax / top if amax > 0 else 1.0
    return np.clip(np.rint(a / scale), -top, top).astype(np.int64), scale


def cell_encoding(arch: CimArch) -> str:
    """"offset" (the fewest cells that hold a weight) or "differential" (twice that: CimArch
    allows only these two mappings)."""
    return "offset" if arch.cells_per_weight == -(-arch.weight_bits // arch.cell_bits) else "differential"


def _weight_range(arch: CimArch) -> tuple[int, int]:
    return -(2 ** (arch.weight_bits - 1)), 2 ** (arch.weight_bits - 1) - 1


def _digits(u: np.ndarray, cells: int, cell_bits: int) -> np.ndarray:
    """Base-2**cell_bits digits of non-negative ints, least significant first, on a new last axis."""
    shifts = cell_bits * np.arange(cells, dtype=np.int64)
    return (u[..., None] >> shifts) & ((1 << cell_bits) - 1)


def _cell_weights(arch: CimArch) -> np.ndarray:
    """What each cell of a weight is worth when the column sums are combined (the shifts; negative
    for the w- half of a differential pair)."""
    cpw, cb = arch.cells_per_weight, arch.cell_bits
    if cell_encoding(arch) == "offset":
        return np.int64(1) << (cb * np.arange(cpw, dtype=np.int64))
    half = cpw // 2
    place = np.concatenate([np.arange(half), np.arange(cpw - half)]).astype(np.int64)
    sign = np.where(np.arange(cpw) < half, 1, -1).astype(np.int64)
    return sign * (np.int64(1) << (cb * place))


def encode_cells(w_q: Any, arch: CimArch) -> np.ndarray:
    """Cells of each weight (int64 in [0, 2**cell_bits)), on a new last axis of cells_per_weight."""
    w = _check_ints(w_q, "w_q", *_weight_range(arch))
    if cell_encoding(arch) == "offset":
        return _digits(w + 2 ** (arch.weight_bits - 1), arch.cells_per_weight, arch.cell_bits)
    half = arch.cells_per_weight // 2
    rest = arch.cells_per_weight - half
    return np.concatenate([_digits(np.maximum(w, 0), half, arch.cell_bits),
                           _digits(np.maximum(-w, 0), rest, arch.cell_bits)], axis=-1)


def decode_cells(cells: np.ndarray, arch: CimArch) -> np.ndarray:
    """The weights the cells hold (inverse of encode_cells)."""
    value = (np.asarray(cells, dtype=np.int64) * _cell_weights(arch)).sum(-1)
    return value - 2 ** (arch.weight_bits - 1) if cell_encoding(arch) == "offset" else value


def _check_ints(a: Any, name: str, lo: int, hi: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.asarray(a)
    if shape is not None and arr.shape != shape:
        raise MacoError(f"{name} must have shape {shape}, got {arr.shape}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise MacoError(f"{name} must hold ints, got dtype {arr.dtype}")
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise MacoError(f"{name} must lie in [{lo}, {hi}], got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64)


def _transactions(offsets: np.ndarray, elem_bytes: int, burst: int) -> int:
    """DMA transactions of a set of elements: each maximal run of consecutive offsets, split by
    the burst."""
    if offsets.size == 0:
        return 0
    o = np.sort(offsets, axis=None)
    ends = np.flatnonzero(np.diff(o) != 1) + 1
    lengths = np.diff(np.concatenate(([0], ends, [o.size])))
    return int(np.sum(-(-(lengths * elem_bytes) // burst)))


def _offsets(sizes: tuple[int, ...], index: list[np.ndarray], layout: str) -> np.ndarray:
    """Linear offsets of a box (index arrays per logical dim N, C, H, W) in the row-major tensor
    of `layout` (NCHW, or NHWC where C is innermost)."""
    order = (0, 1, 2, 3) if layout == "NCHW" else (0, 2, 3, 1)
    strides, step = [0] * 4, 1
    for d in reversed(order):
        strides[d] = step
        step *= sizes[d]
    return sum(_along(i, d) * s for d, (i, s) in enumerate(zip(index, strides)))


def _along(index: np.ndarray, dim: int) -> np.ndarray:
    """`index` shaped to broadcast along dim `dim` of 4 (np.ix_ without its checks)."""
    shape = [1, 1, 1, 1]
    shape[dim] = index.size
    return index.reshape(shape)


def _box(index: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    return tuple(_along(i, d) for d, i in enumerate(index))


class _Core:
    """One core's state and counts: resident block and window, live partial-sum tiles."""

    def __init__(self) -> None:
        self.block: Any = None
        self.xbars: np.ndarray | None = None
        self.columns = 0
        self.window: Any = None
        self.buffer: np.ndarray | None = None
        self.psums: dict[tuple[int, ...], list[Any]] = {}  # tile -> [psum array, steps done]
        self.c = dict.fromkeys(("weight_loads", "weight_cells", "crossbar_writes", "input_loads",
                                "input_elements", "input_transactions", "output_elements",
                                "output_transactions", "mvms", "peak_input_bytes", "peak_psums"), 0)


def simulate(spec: ConvSpec, schedule: Schedule, target: Target, x_q: Any, w_q: Any, *,
             validate: bool = True) -> SimResult:
    """Execute `schedule` on the chip of `target` with integer inputs x_q (NCHW, spec.input_shape,
    signed input_bits ints) and weights w_q (spec.weight_shape, signed weight_bits ints).

    With validate=False the schedule's static checks against the target are skipped (only its
    shape is checked) and the overflows the execution observes raise MacoError on their own,
    which lets tests check Schedule.problems against the execution."""
    if not isinstance(target, Target) or target.kind != "cim":
        raise MacoError("simulate needs a cim target (Target.cim), got "
                        f"{getattr(target, 'name', target)!r}")
    arch = target.cim_arch
    if not isinstance(schedule, Schedule) or schedule.kind != "cim":
        raise MacoError(f"simulate needs a cim schedule, got kind {getattr(schedule, 'kind', schedule)!r}")
    problems = schedule.problems(spec, target if validate else None)
    if problems:
        raise MacoError(f"invalid schedule for {spec}: " + "; ".join(problems))
    encoding = cell_encoding(arch)
    top = 2 ** (arch.input_bits - 1)
    x = _check_ints(x_q, "x_q", -top, top - 1, spec.input_shape)
    w = _check_ints(w_q, "w_q", *_weight_range(arch), spec.weight_shape)
    if sketch_cim.cores(schedule) > arch.cores:
        raise MacoError(f"the schedule binds {sketch_cim.cores(schedule)} cores, the chip has {arch.cores}")

    trips, blk = sketch_cim.trips(schedule), sketch_cim.block(schedule)
    order = schedule.loop_order
    steps_total = prod(trips[a] for a in ("c", "kh", "kw"))
    out = np.zeros(spec.output_shape, dtype=np.int64)
    written = np.zeros(spec.output_shape, dtype=bool)
    cache: dict[tuple[int, ...], tuple[np.ndarray, int, int]] = {}
    memo: dict[tuple[Any, ...], Any] = {}  # transaction counts, gather positions, cell places
    cores = []
    for core_index in itertools.product(*(range(schedule.factors(a)[0]) for a in SPATIAL_AXES)):
        base = {a: i * trips[a] * blk[a] for a, i in zip(SPATIAL_AXES, core_index)}
        core = _Core()
        for js in itertools.product(*(range(trips[a]) for a in order)):
            start = {a: base.get(a, 0) + j * blk[a] for a, j in zip(order, js)}
            _iteration(spec, arch, encoding, schedule.layout, x, w, blk, start, steps_total,
                       core, cache, memo, out, written)
        if core.psums:
            raise MacoError(f"internal: {len(core.psums)} output tiles never completed")
        cores.append(core.c)
    if not written.all():
        raise MacoError("internal: the schedule left outputs unwritten")
    totals = {name: sum(c[name] for c in cores) for name in cores[0]}
    totals["peak_input_bytes"] = max(c["peak_input_bytes"] for c in cores)
    totals["peak_psums"] = max(c["peak_psums"] for c in cores)
    return SimResult(out, SimCounts(**totals, max_core_weight_cells=max(c["weight_cells"] for c in cores),
                                    max_core_mvms=max(c["mvms"] for c in cores)))


def _iteration(spec: ConvSpec, arch: CimArch, encoding: str, layout: str, x: np.ndarray,
               w: np.ndarray, blk: dict[str, int], s: dict[str, int], steps_total: int, core: _Core,
               cache: dict, memo: dict, out: np.ndarray, written: np.ndarray) -> None:
    """One iteration of the outer loops on one core: update weights and window if they changed,
    run the tile's pixels through the crossbars, accumulate, write back a completed tile."""
    _load_weights(arch, w, blk, s, spec, core, cache)
    hlo, wlo = _load_window(spec, arch, layout, x, blk, s, core, memo)
    tile = (s["n"], s["g"], s["k"], s["oh"], s["ow"])
    entry = _tile_psums(arch, blk, tile, core)

    # -- compute: gather the block's input vector per pixel from the buffer, one MVM per crossbar
    xv = _gather(spec, core.buffer, s, blk, hlo, wlo, memo)  # (pixels, rows)
    place = _memo(memo, ("place",), lambda: _cell_weights(arch))
    entry[0] += _mvm(arch, encoding, place, core.xbars, xv, core.columns)
    core.c["mvms"] += xv.shape[0] * core.xbars.shape[0] * core.xbars.shape[1]
    limit = 2 ** (8 * arch.psum_bytes - 1)
    if entry[0].size and (entry[0].min() < -limit or entry[0].max() >= limit):
        raise MacoError(f"a partial sum overflows the {arch.psum_bytes}-byte psum format")
    entry[1] += 1

    if entry[1] == steps_total:
        _write_back(spec, arch, layout, blk, tile, entry, core, memo, out, written)


def _load_weights(arch: CimArch, w: np.ndarray, blk: dict[str, int], s: dict[str, int],
                  spec: ConvSpec, core: _Core, cache: dict) -> None:
    """Make the iteration's weight block the core's resident one: when it is not, every cell of the
    block is rewritten (and counted), the crossbars a reload would encode again come from cache."""
    block = (s["g"], s["k"], s["c"], s["kh"], s["kw"])
    if block == core.block:
        return
    if block not in cache:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[block] = _crossbars(arch, w, blk, s, spec.c_per_group, spec.k_per_group)
    xbars, rows, columns = cache[block]
    used = xbars.shape[0] * xbars.shape[1]
    if used > arch.crossbars:
        raise MacoError(f"weight block of {rows}x{columns} needs {used} crossbars, a core has "
                        f"{arch.crossbars}")
    core.block, core.xbars, core.columns = block, xbars, columns
    core.c["weight_loads"] += 1
    core.c["weight_cells"] += rows * columns * arch.cells_per_weight
    core.c["crossbar_writes"] += used


def _load_window(spec: ConvSpec, arch: CimArch, layout: str, x: np.ndarray, blk: dict[str, int],
                 s: dict[str, int], core: _Core, memo: dict) -> tuple[int, int]:
    """Load the clipped input box the tile reads with the block's taps into the input buffer when
    its index changed (the DMA engine is told a box, it does not compare contents). Returns the
    box's first row and column, which the gather of the pixels' input vectors is relative to."""
    tn, tg = blk["n"], blk["g"]
    cpg = spec.c_per_group
    hlo, hhi = input_span(spec, "h", s["oh"], blk["oh"], s["kh"], blk["kh"])
    wlo, whi = input_span(spec, "w", s["ow"], blk["ow"], s["kw"], blk["kw"])
    chans = np.array([g * cpg + c for g in range(s["g"], s["g"] + tg)
                      for c in range(s["c"], s["c"] + blk["c"])])
    window = (s["n"], s["g"], s["c"], s["oh"], s["kh"], s["ow"], s["kw"])
    if window == core.window:
        return hlo, wlo
    core.window = window
    core.c["input_loads"] += 1
    if hhi <= hlo or whi <= wlo:  # the box reads only padding: a fetch of nothing
        core.buffer = None
        return hlo, wlo
    index = [np.arange(s["n"], s["n"] + tn), chans, np.arange(hlo, hhi), np.arange(wlo, whi)]
    nbytes = tn * chans.size * (hhi - hlo) * (whi - wlo) * arch.input_bytes
    if nbytes > arch.input_buffer:
        raise MacoError(f"input window of {nbytes} B overflows the {arch.input_buffer} B "
                        "input buffer")
    core.buffer = x[_box(index)]
    core.c["input_elements"] += core.buffer.size
    core.c["input_transactions"] += _memo(memo, ("in", hlo, hhi, wlo, whi) + window[:3], lambda: _transactions(
        _offsets(spec.input_shape, index, layout), arch.input_bytes, arch.dma_burst))
    core.c["peak_input_bytes"] = max(core.c["peak_input_bytes"], nbytes)
    return hlo, wlo


def _tile_psums(arch: CimArch, blk: dict[str, int], tile: tuple[int, ...], core: _Core) -> list:
    """The tile's [partial sums, reduction steps done]: alive from its first reduction step to its
    last, so a new one must fit the psum buffer beside those still alive."""
    if tile not in core.psums:
        core.psums[tile] = [np.zeros((blk["n"] * blk["oh"] * blk["ow"], blk["g"] * blk["k"]),
                                     dtype=np.int64), 0]
        live = sum(p[0].size for p in core.psums.values())
        if live * arch.psum_bytes > arch.psum_buffer:
            raise MacoError(f"{live} live partial sums ({live * arch.psum_bytes} B) overflow the "
                            f"{arch.psum_buffer} B psum buffer")
        core.c["peak_psums"] = max(core.c["peak_psums"], live)
    return core.psums[tile]


def _write_back(spec: ConvSpec, arch: CimArch, layout: str, blk: dict[str, int],
                tile: tuple[int, ...], entry: list, core: _Core, memo: dict, out: np.ndarray,
                written: np.ndarray) -> None:
    """Write a completed tile's sums to the output (once only: a second write is a walker bug) and
    free its partial sums."""
    tn, tg, tk, toh, tow = (blk[a] for a in SPATIAL_AXES)
    n, g0, k0, oh, ow = tile
    kpg = spec.k_per_group
    del core.psums[tile]
    index = [np.arange(n, n + tn),
             np.array([g * kpg + k for g in range(g0, g0 + tg) for k in range(k0, k0 + tk)]),
             np.arange(oh, oh + toh), np.arange(ow, ow + tow)]
    box = _box(index)
    if written[box].any():
        raise MacoError("internal: an output was written back twice")
    out[box] = entry[0].reshape(tn, toh, tow, tg * tk).transpose(0, 3, 1, 2)
    written[box] = True
    core.c["output_elements"] += entry[0].size
    core.c["output_transactions"] += _memo(memo, ("out",) + tile, lambda: _transactions(
        _offsets(spec.output_shape, index, layout), arch.psum_bytes, arch.dma_burst))


def _memo(memo: dict, key: tuple[Any, ...], count: Any) -> int:
    """count() once per key: a window loaded again costs what it cost the first time."""
    if key not in memo:
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[key] = count()
    return memo[key]


def _crossbars(arch: CimArch, w: np.ndarray, blk: dict[str, int], s: dict[str, int], cpg: int,
               kpg: int) -> tuple[np.ndarray, int, int]:
    """The cells of one block on its crossbars, (row tiles, column tiles, arch.rows, arch.columns),
    with the block's rows and columns. The block matrix is block-diagonal over its groups: rows
    (g, c, kh, kw), columns (g, k); a weight spans cells_per_weight adjacent cells of its row."""
    tg, tk, bc, bkh, bkw = blk["g"], blk["k"], blk["c"], blk["kh"], blk["kw"]
    per = bc * bkh * bkw
    rows, columns = tg * per, tg * tk
    mat = np.zeros((rows, columns), dtype=np.int64)
    for i in range(tg):
        k0 = (s["g"] + i) * kpg + s["k"]
        part = w[k0:k0 + tk, s["c"]:s["c"] + bc, s["kh"]:s["kh"] + bkh, s["kw"]:s["kw"] + bkw]
        mat[i * per:(i + 1) * per, i * tk:(i + 1) * tk] = part.reshape(tk, per).T
    wc, cpw = arch.weight_columns, arch.cells_per_weight
    rt, ct = -(-rows // arch.rows), -(-columns // wc)
    cells = encode_cells(mat, arch)  # (rows, columns, cpw)
    padded = np.zeros((rt * arch.rows, ct * wc, cpw), dtype=np.int64)
    padded[:rows, :columns] = cells
    xbars = np.zeros((rt, ct, arch.rows, arch.columns), dtype=np.int64)
    xbars[..., :wc * cpw] = padded.reshape(rt, arch.rows, ct, wc * cpw).transpose(0, 2, 1, 3)
    return xbars, rows, columns


def _gather(spec: ConvSpec, buffer: np.ndarray | None, s: dict[str, int], blk: dict[str, int],
            hlo: int, wlo: int, memo: dict) -> np.ndarray:
    """Input vectors of the tile's pixels (n, oh, ow) over the block's rows (g, c, kh, kw), read
    from the input buffer; zero where the window position is padding."""
    tn, toh, tow = blk["n"], blk["oh"], blk["ow"]
    rows = blk["g"] * blk["c"] * blk["kh"] * blk["kw"]
    if buffer is None:
        return np.zeros((tn * toh * tow, rows), dtype=np.int64)
    key = ("gather", s["oh"], s["kh"], s["ow"], s["kw"], hlo, wlo) + buffer.shape[2:]
    bh, bw, mask = _memo(memo, key, lambda: _positions(spec, s, blk, hlo, wlo, buffer.shape[2:]))
    v = buffer[:, :, bh[:, :, None, None], bw[None, None]] * mask  # (n, gc, oh, kh, ow, kw)
    return v.transpose(0, 2, 4, 1, 3, 5).reshape(tn * toh * tow, rows)


def _positions(spec: ConvSpec, s: dict[str, int], blk: dict[str, int], hlo: int, wlo: int,
               held: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Buffer rows (oh, kh) and columns (ow, kw) the tile reads, and where they are not padding;
    a read outside the held window would be a bug in the window, so it raises."""
    (sh, sw), (ph, pw), (dh, dw) = spec.stride, spec.padding, spec.dilation
    ih = (s["oh"] + np.arange(blk["oh"]))[:, None] * sh - ph + (s["kh"] + np.arange(blk["kh"]))[None] * dh
    iw = (s["ow"] + np.arange(blk["ow"]))[:, None] * sw - pw + (s["kw"] + np.arange(blk["kw"]))[None] * dw
    mh, mw = (ih >= 0) & (ih < spec.h), (iw >= 0) & (iw < spec.w)
    bh, bw = ih - hlo, iw - wlo
    if np.any(mh & ((bh < 0) | (bh >= held[0]))) or np.any(mw & ((bw < 0) | (bw >= held[1]))):
        raise MacoError("internal: the input window misses a position the tile reads")
    return np.where(mh, bh, 0), np.where(mw, bw, 0), mh[:, :, None, None] & mw[None, None]


def _mvm(arch: CimArch, encoding: str, place: np.ndarray, xbars: np.ndarray, xv: np.ndarray,
         columns: int) -> np.ndarray:
    """Every pixel's input vector through every crossbar of the block: column sums of the cells,
    combined per weight by shifts (offset removed or differential halves subtracted), summed over
    the row tiles: (pixels, columns), the block's columns in (g, k) order. `place` is what each
    cell of a weight is worth (_cell_weights)."""
    rt, ct = xbars.shape[:2]
    pixels = xv.shape[0]
    wc, cpw = arch.weight_columns, arch.cells_per_weight
    xp = np.zeros((pixels, rt * arch.rows), dtype=np.int64)
    xp[:, :xv.shape[1]] = xv
    xt = xp.reshape(pixels, rt, arch.rows).transpose(1, 0, 2)  # (rt, pixels, rows)
    sums = np.matmul(xt[:, None], xbars)[..., :wc * cpw]  # (rt, ct, pixels, cells)
    value = (sums.reshape(rt, ct, pixels, wc, cpw) * place).sum(-1)
    if encoding == "offset":
        value -= 2 ** (arch.weight_bits - 1) * xt.sum(-1)[:, None, :, None]
    result = value.sum(0).transpose(1, 0, 2).reshape(pixels, ct * wc)
    return result[:, :columns]


