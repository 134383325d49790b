"""Exact event counts of a CIM schedule, in closed form over the loop nest (no per-pixel walk).

The semantics are maco.core.schedule's CIM sketch. What makes closed forms exact:
- consecutive iterations of the outer nest, taken down to the innermost loop of a set of axes that
  has more than one trip, always differ in one of those axes' indices (the innermost one steps, or
  it wraps from its last index to its first). So a weight block is loaded once per iteration of the
  loops down to the innermost weight axis with trips, and an input window likewise;
- the union of every core's tiles of an axis is the axis' whole tiling, so summing windows over
  cores and outer indices is summing over all tiles (times the cores bound to axes the window does
  not depend on);
- every window and output box is a product of index ranges, so its contiguous runs in a row-major
  layout follow from which of its innermost dimensions are whole.
kernels/cim_sim.py executes the same schedules element by element; the tests hold the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from math import prod

import numpy as np

from maco.core.errors import MacoError
from maco.core.geometry import input_span
from maco.core.axes import INPUT_AXES, WEIGHT_AXES
from maco.core.schedule import Schedule
from maco.core import sketch_cim
from maco.core.spec import ConvSpec
from maco.core.target import CimArch, Target


@dataclass(frozen=True)
class CimCost:
    """Events of one layer on the whole chip (summed over cores) and the peaks of one core."""

    weight_loads: int  # block writes (one per core and block change)
    weight_cells: int  # cells written
    crossbar_writes: int  # crossbars rewritten
    input_loads: int
    input_elements: int
    input_transactions: int
    output_elements: int
    output_transactions: int
    mvms: int  # crossbar activations
    peak_input_bytes: int
    peak_psums: int
    crossbars_used: int  # per block
    cores_used: int

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


MAX_SIDE = 16_384  # input rows or columns of a layer the CIM model counts (maco cim: < 1 s at the cap)
MAX_PIXELS = 1 << 22  # input rows x columns: the DMA count holds an array of every window's pair


def check_size(spec: ConvSpec) -> None:
    """MacoError, one line naming the value and the cap, for a layer too large to count: the
    schedules' checks and the closed forms walk every output row and column window (a layer of
    h = 1e9 took hours, and h x w arrays of windows outgrow memory long before)."""
    for axis, size in (("h", spec.h), ("w", spec.w)):
        if size > MAX_SIDE:
            raise MacoError(f"{spec}: {axis} = {size} is over the CIM model's cap of {MAX_SIDE} input "
                            f"{'rows' if axis == 'h' else 'columns'} (counting walks every window along it)")
    if spec.h * spec.w > MAX_PIXELS:
        raise MacoError(f"{spec}: h x w = {spec.h * spec.w} is over the CIM model's cap of {MAX_PIXELS} input "
                        "pixels per channel (counting holds every pair of row and column windows)")


def _loads(order: tuple[str, ...], trips: dict[str, int], axes: tuple[str, ...]) -> int:
    """Iterations at which the indices of `axes` change: the trips of every loop down to the
    innermost of `axes` with more than one trip (1 when none has)."""
    inner = max((i for i, a in enumerate(order) if a in axes and trips[a] > 1), default=-1)
    return prod(trips[a] for a in order[:inner + 1])


def _runs(layout: str, dims: dict[str, int], box: dict[str, np.ndarray], ranges: int,
          range_len: int, elem_bytes: int, burst: int) -> np.ndarray:
    """DMA transactions of boxes of a row-major tensor: `box` holds the images, rows and columns
    taken (rows and columns may be arrays), the channels come in `ranges` runs of `range_len`
    each; a run whose inner dimensions are all whole merges with its neighbours."""
    full_h, full_w = box["h"] == dims["h"], box["w"] == dims["w"]
    full_c = ranges == 1 and range_len == dims["c"]
    n, h, w = box["n"], box["h"], box["w"]

    def txn(count, length):
        return count * -(-(length * elem_bytes) // burst)

    if layout == "NCHW":
        ch = ranges * range_len
        out = np.where(~full_w, txn(n * ch * h, w),
                       np.where(~full_h, txn(n * ch, h * dims["w"]),
                                txn(n * ranges, range_len * dims["h"] * dims["w"]) if not full_c
                                else txn(1, n * dims["c"] * dims["h"] * dims["w"])))
    else:
        out = (txn(n * h * w * ranges, range_len) if not full_c else
               np.where(~full_w, txn(n * h, w * dims["c"]),
                        np.where(~full_h, txn(n, h * dims["w"] * dims["c"]),
                                 txn(1, n * dims["h"] * dims["w"] * dims["c"]))))
    return np.where((h > 0) & (w > 0), out, 0)


def _channel_runs(groups: int, per_group: int, total_per_group: int) -> tuple[int, int]:
    """(runs, channels per run) of `groups` consecutive groups taking `per_group` channels each."""
    return (1, groups * per_group) if per_group == total_per_group else (groups, per_group)


def _spans(spec: ConvSpec, axis: str, outputs: int, taps: int) -> np.ndarray:
    """Lengths of the clipped input spans of every (output tile, tap block) along `axis`."""
    n_out = spec.out_h if axis == "h" else spec.out_w
    n_taps = spec.kh if axis == "h" else spec.kw
    spans = [input_span(spec, axis, o, outputs, t, taps)
             for o in range(0, n_out, outputs) for t in range(0, n_taps, taps)]
    return np.array([max(0, hi - lo) for lo, hi in spans], dtype=np.int64)


def cim_cost(spec: ConvSpec, schedule: Schedule, target: Target) -> CimCost:
    """Exact counts of `schedule` for `spec` on the CIM `target`; MacoError if it is invalid
    (names the buffer that overflows)."""
    if target.kind != "cim":
        raise MacoError(f"cim_cost needs a cim target, got {target.kind!r}")
    check_size(spec)
    schedule.validate(spec, target)
    arch: CimArch = target.cim_arch
    order, trips, b = schedule.loop_order, sketch_cim.trips(schedule), sketch_cim.block(schedule)
    cores = sketch_cim.cores(schedule)
    use = sketch_cim.footprint(schedule, spec, arch)
    rows, cols, xbars = use["weight_rows"], use["weight_columns"], use["crossbars"]
    loads = cores * _loads(order, trips, WEIGHT_AXES)
    in_loads_core = _loads(order, trips, INPUT_AXES)
    # windows: every tile of the input axes once per core bound to k, and once per trip of the k
    # loop where it runs outside the innermost input loop with trips
    inner_in = max((i for i, a in enumerate(order) if a in INPUT_AXES and trips[a] > 1), default=-1)
    k_repeat = trips["k"] if "k" in order[:inner_in + 1] else 1
    rlen = _spans(spec, "h", b["oh"], b["kh"])
    clen = _spans(spec, "w", b["ow"], b["kw"])
    tiles_nc = (spec.n // b["n"]) * (spec.groups // b["g"]) * (spec.c_per_group // b["c"])
    ranges, run_len = _channel_runs(b["g"], b["c"], spec.c_per_group)
    in_txn = _runs(schedule.layout, {"c": spec.c, "h": spec.h, "w": spec.w},
                   {"n": b["n"], "h": rlen[:, None], "w": clen[None, :]},
                   ranges, run_len, arch.input_bytes, arch.dma_burst)
    repeat = schedule.factors("k")[0] * k_repeat
    out_ranges, out_len = _channel_runs(b["g"], b["k"], spec.k_per_group)
    out_tiles = prod(e // b[a] for a, e in (("n", spec.n), ("g", spec.groups), ("k", spec.k_per_group),
                                            ("oh", spec.out_h), ("ow", spec.out_w)))
    out_txn = _runs(schedule.layout, {"c": spec.k, "h": spec.out_h, "w": spec.out_w},
                    {"n": b["n"], "h": np.asarray(b["oh"]), "w": np.asarray(b["ow"])},
                    out_ranges, out_len, arch.psum_bytes, arch.dma_burst)
    pixels = b["n"] * b["oh"] * b["ow"]
    return CimCost(
        weight_loads=loads, weight_cells=loads * rows * cols * arch.cells_per_weight,
        crossbar_writes=loads * xbars, input_loads=cores * in_loads_core,
        input_elements=repeat * spec.n * spec.c * int(rlen.sum()) * int(clen.sum()),
        input_transactions=repeat * tiles_nc * int(in_txn.sum()),
        output_elements=spec.n * spec.k * spec.out_h * spec.out_w,
        output_transactions=out_tiles * int(out_txn),
        mvms=cores * prod(trips.values()) * pixels * xbars,
        peak_input_bytes=use["input_bytes"], peak_psums=use["psums"],
        crossbars_used=xbars, cores_used=cores)
