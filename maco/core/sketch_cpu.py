"""The CPU sketch "SSRSRS": the rules a CPU schedule's fields follow beyond the shared ones.

Every spatial axis is split into 4 levels and every reduction axis into 2, nested as

    S0 (fused, parallel)  S1  R0  S2  R1  S3 (register tile)

`parallel` fuses that many outermost S0 loops (in SPATIAL_AXES order) into one parallel loop; the
register tile is vectorised on `vector_axis` and must fit the vector registers left free.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from maco.core.axes import SPATIAL_AXES
from maco.core.files import short
from maco.core.spec import ConvSpec
from maco.core.target import Target

if TYPE_CHECKING:
    from maco.core.schedule import Schedule

NAME = "SSRSRS"
LEVELS = (4, 2)  # (spatial levels, reduction levels)
KNOBS: dict[str, type] = {}  # the CPU backend reads no `extra` knobs
REGISTER_RESERVE = 4  # vector registers left for input broadcasts and weights (32-register ISAs)
# With 16 vector registers (AVX2) the FMAs take the weight vectors from L1 as memory operands, so
# the input broadcast and one temporary are all a tile needs beside its accumulators: 14 of them
# (2 vectors x 7 pixels, which divide the 7x7 to 112x112 maps) beat the 8 that a reserve of 4
# leaves on 1x1 and 3x3 convs alike (results/pointwise_cpu.md)
REGISTER_RESERVE_16 = 2


def vector_widths(target: Target) -> tuple[int, ...]:
    """The vector widths (floats) a CPU schedule may use on `target`, widest first: its SIMD width,
    half of it where the ISA also has those vectors (AVX2's 8 floats on an AVX-512 CPU: 24 or 40
    filters are three or five of them, not a whole number of 16), and scalar."""
    half = (target.simd_width // 2,) if target.isa == "avx512" else ()
    return (target.simd_width, *half, 1)


def vector_width(target: Target, extent: int) -> int:
    """The widest of vector_widths(target) that divides a register tile's `extent` on its vector axis."""
    return next(w for w in vector_widths(target) if extent % w == 0)


def free_registers(target: Target) -> int:
    """Vector registers a register tile's accumulators may take on `target`."""
    regs = target.level("registers").elements // target.simd_width
    return regs - (REGISTER_RESERVE_16 if regs <= 16 else REGISTER_RESERVE)


def field_problems(schedule: Schedule) -> list[str]:
    """Only cim schedules order their outer loops."""
    if schedule.loop_order:
        return [f"only cim schedules have a loop_order, got {short(schedule.loop_order)}"]
    return []


def problems(schedule: Schedule, spec: ConvSpec) -> list[str]:
    if not 0 <= schedule.parallel <= len(SPATIAL_AXES):
        return [f"parallel must be in 0..{len(SPATIAL_AXES)}, got {schedule.parallel}"]
    return []


def target_problems(schedule: Schedule, spec: ConvSpec, target: Target) -> list[str]:
    """The vector width is one of vector_widths(target) and the accumulators fit."""
    out = []
    if schedule.vector_width not in vector_widths(target):
        out.append(f"vector_width must be one of {vector_widths(target)} on {target.isa}, "
                   f"got {schedule.vector_width}")
    regs, free = target.level("registers").elements // target.simd_width, free_registers(target)
    if schedule.accumulators > free:
        out.append(f"register tile needs {schedule.accumulators} accumulators but only "
                   f"{free} of {regs} vector registers are free")
    return out


def describe(schedule: Schedule) -> str:
    return schedule.loop_annotations()
