"""The compute-in-memory sketch "PSB" (kind "cim", see maco.core.target.CimArch): the rules a cim
schedule's fields follow beyond the shared ones.

Spatial axes are split into 3 levels (core, outer loop, tile), reduction axes into 2 (outer loop,
block):

    P (cores)   S (outer loops, all 8 axes in `loop_order`)   B (the block)

The level-0 factors of the spatial axes bind them across the cores (core index in SPATIAL_AXES
order, mixed radix); every core runs the same nest over its part. One iteration of the outer loops
keeps one weight block in the crossbars: the im2col matrix of its t_g groups (block-diagonal),
rows = t_g * b_c * b_kh * b_kw, columns = t_g * t_k, on ceil(rows / arch.rows) * ceil(columns /
arch.weight_columns) crossbars; it loads the input window of the tile (t_n images, the block's
channels, the rows and columns the t_oh x t_ow outputs read with the block's taps, clipped to the
input) into the input buffer, and streams the tile's pixels through the crossbars, accumulating
the tile's partial sums in the psum buffer. Counting (maco.kernels.cim_cost):
- a weight update whenever the block differs from the previous iteration's (and the first);
- an input window load whenever the window differs from the previous iteration's;
- partial sums of an output live from its first to its last reduction step, so the buffer holds
  the tile times the trips of the spatial loops inside the outermost reduction loop with trips > 1;
- an output tile is written back when its last reduction step ends.

A cim schedule has no parallel, vector, unroll, inner order or weight packing knobs.
"""
from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

from maco.core.axes import ALL_AXES, REDUCTION_AXES, SPATIAL_AXES
from maco.core.files import short
from maco.core.geometry import max_input_span
from maco.core.spec import ConvSpec
from maco.core.target import Target

if TYPE_CHECKING:
    from maco.core.schedule import Schedule

NAME = "PSB"
LEVELS = (3, 2)  # (spatial levels, reduction levels)
KNOBS: dict[str, type] = {}  # the CIM backend reads no `extra` knobs


def cim_crossbars(arch: Any, rows: Any, columns: Any) -> Any:
    """Crossbars a rows x columns weight block takes (ints or numpy arrays)."""
    return -(-rows // arch.rows) * -(-columns // arch.weight_columns)


def cim_live_psums(tile_outputs: int, loop_order: tuple[str, ...], trips: dict[str, int]) -> int:
    """Partial sums alive at once: the tile's outputs times the trips of the spatial loops inside
    the outermost reduction loop that has more than one trip."""
    live, inside = tile_outputs, False
    for axis in loop_order:
        if axis in REDUCTION_AXES and trips[axis] > 1:
            inside = True
        elif inside and axis in SPATIAL_AXES:
            live *= trips[axis]
    return live


def trips(schedule: Schedule) -> dict[str, int]:
    """Trips of each axis's outer loop (level 1)."""
    return {a: f[1] if a in SPATIAL_AXES else f[0]
            for a, f in zip(ALL_AXES, schedule.spatial + schedule.reduction)}


def block(schedule: Schedule) -> dict[str, int]:
    """Per axis, the extent one iteration covers: the spatial tile and the reduction block."""
    return {a: f[-1] for a, f in zip(ALL_AXES, schedule.spatial + schedule.reduction)}


def cores(schedule: Schedule) -> int:
    """Cores the schedule binds (product of the spatial level-0 factors)."""
    return prod(f[0] for f in schedule.spatial)


def footprint(schedule: Schedule, spec: ConvSpec, arch: Any) -> dict[str, int]:
    """What one core's crossbars and buffers must hold at their peak: crossbars of the weight
    block, bytes of the largest (clipped) input window, partial sums alive at once."""
    b = block(schedule)
    rows, columns = b["g"] * b["c"] * b["kh"] * b["kw"], b["g"] * b["k"]
    window = (b["n"] * b["g"] * b["c"] * max_input_span(spec, "h", b["oh"], b["kh"])
              * max_input_span(spec, "w", b["ow"], b["kw"]))
    tile = b["n"] * b["g"] * b["k"] * b["oh"] * b["ow"]
    return {"crossbars": cim_crossbars(arch, rows, columns), "weight_rows": rows,
            "weight_columns": columns, "input_bytes": window * arch.input_bytes,
            "psums": cim_live_psums(tile, schedule.loop_order, trips(schedule))}


def field_problems(schedule: Schedule) -> list[str]:
    """All 8 outer loops are ordered, and the CPU/GPU knobs stay at their defaults."""
    s, out = schedule, []
    if sorted(s.loop_order) != sorted(ALL_AXES):
        out.append(f"loop_order must be a permutation of {ALL_AXES}, got {short(s.loop_order)}")
    knobs = (s.parallel, s.vector_axis, s.vector_width, s.unroll, s.inner_order, s.weight_packing)
    if knobs != (1, "k", 1, 0, REDUCTION_AXES, "blocked"):
        out.append("a cim schedule has no parallel, vector, unroll, inner_order or "
                   "weight_packing knobs (leave them at their defaults)")
    return out


def problems(schedule: Schedule, spec: ConvSpec) -> list[str]:
    return []


def target_problems(schedule: Schedule, spec: ConvSpec, target: Target) -> list[str]:
    """The cores, crossbars, input buffer and psum buffer of the chip hold what the schedule uses."""
    arch = target.cim_arch
    out = []
    if cores(schedule) > arch.cores:
        out.append(f"binds {cores(schedule)} cores, the chip has {arch.cores}")
    use = footprint(schedule, spec, arch)
    if use["crossbars"] > arch.crossbars:
        out.append(f"weight block of {use['weight_rows']}x{use['weight_columns']} needs "
                   f"{use['crossbars']} crossbars, a core has {arch.crossbars}")
    if use["input_bytes"] > arch.input_buffer:
        out.append(f"input window of {use['input_bytes']} B overflows the {arch.input_buffer} B "
                   "input buffer")
    if use["psums"] * arch.psum_bytes > arch.psum_buffer:
        out.append(f"{use['psums']} live partial sums ({use['psums'] * arch.psum_bytes} B) "
                   f"overflow the {arch.psum_buffer} B psum buffer")
    return out


def describe(schedule: Schedule) -> str:
    return f"loops={','.join(schedule.loop_order)}"
