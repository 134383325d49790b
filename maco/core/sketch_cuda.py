"""The CUDA sketch "SSSRRSRS": the rules a GPU schedule's fields follow beyond the shared ones.

Spatial axes are split into 5 levels (block, virtual thread, thread, two inner), reduction axes
into 3, nested as

    S0 (blockIdx)  S1 (vthread)  S2 (threadIdx)  R0  R1  S3  R2  S4

`extra` holds the backend's knobs: "split_c" (threads that split the stage's channels),
"stage_out" (outputs staged through shared memory) and "buffers" (shared-memory stages in
flight). A block must fit the backend's limits on threads, per-thread accumulators and shared
memory (see maco.kernels.cuda_codegen).
"""
from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any

import numpy as np

from maco.core.axes import SPATIAL_AXES
from maco.core.files import short
from maco.core.geometry import input_window
from maco.core.spec import ConvSpec
from maco.core.target import Target

if TYPE_CHECKING:
    from maco.core.schedule import Schedule

NAME = "SSSRRSRS"
LEVELS = (5, 3)  # (spatial levels, reduction levels)
KNOBS: dict[str, type] = {"split_c": int, "stage_out": bool, "buffers": int}
# limits: threads per block, accumulators per thread (at most half the per-thread registers),
# dynamic shared memory one block may opt into on sm_80/sm_90 (the CUDA backend's limits).
GPU_MAX_THREADS = 1024
GPU_MAX_ACCUMULATORS = 128
GPU_MAX_SMEM_BYTES = 227 << 10
GPU_BUFFERS = (2, 3, 4)  # shared-memory stages in flight (2 = double buffering)


def gpu_max_accumulators(target: Target) -> int:
    """Accumulators one GPU thread may hold: half its registers (the rest for operands), <= 128."""
    return min(GPU_MAX_ACCUMULATORS, target.level("registers").elements // 2)


def gpu_max_shared_bytes(target: Target) -> int:
    return min(GPU_MAX_SMEM_BYTES, target.level("shared").capacity)


def _round4(n: Any) -> Any:
    return -(-n // 4) * 4


def gpu_shared_bytes(spec: ConvSpec, block: dict[str, Any], cc: Any, khc: Any, kwc: Any,
                     layout: str, buffers: int, stage_out: bool, split: int = 1) -> Any:
    """Shared bytes of one block from its block tile and stage sizes (ints or numpy arrays), as
    maco.kernels.cuda_codegen.CudaPlan lays them out."""
    ph, pw = input_window(spec, block["oh"], block["ow"], khc, kwc)
    plane = ph * pw
    if layout == "NHWC":
        plane = plane + (plane % 2 == 0)
    stage = (_round4(block["n"] * block["g"] * cc * plane)
             + _round4(block["g"] * cc * khc * kwc * block["k"]))
    floats = buffers * stage
    if stage_out:
        out = split * block["n"] * block["g"] * block["k"] * block["oh"] * block["ow"]
        floats = np.maximum(floats, out)
    return 4 * floats


def thread_tile(schedule: Schedule) -> dict[str, int]:
    """Outputs one thread owns per axis: vthread x the two inner factors (f1*f3*f4)."""
    return {a: f[1] * f[3] * f[4] for a, f in zip(SPATIAL_AXES, schedule.spatial)}


def block_tile(schedule: Schedule) -> dict[str, int]:
    """Outputs one thread block owns per axis (f1*f2*f3*f4)."""
    return {a: prod(f[1:]) for a, f in zip(SPATIAL_AXES, schedule.spatial)}


def threads(schedule: Schedule) -> int:
    """Threads per block: the thread-level factors times the channel split (split_c)."""
    return prod(f[2] for f in schedule.spatial) * int(schedule.option.get("split_c", 1))


def shared_bytes(schedule: Schedule, spec: ConvSpec) -> int:
    """Dynamic shared memory of one block, as the CUDA backend lays it out: `buffers` stages
    of (input patch of the stage's channels + their weights), each rounded to 4 floats, the
    NHWC patch plane padded to odd; or the staged outputs when stage_out is on."""
    opt = schedule.option
    split = int(opt.get("split_c", 1))
    stage_out = bool(opt.get("stage_out", split > 1))
    return int(gpu_shared_bytes(spec, block_tile(schedule), prod(schedule.factors("c")[1:]),
                                prod(schedule.factors("kh")[1:]), prod(schedule.factors("kw")[1:]),
                                schedule.layout, int(opt.get("buffers", 2)), stage_out, split))


def field_problems(schedule: Schedule) -> list[str]:
    """Only cim schedules order their outer loops."""
    if schedule.loop_order:
        return [f"only cim schedules have a loop_order, got {short(schedule.loop_order)}"]
    return []


def problems(schedule: Schedule, spec: ConvSpec) -> list[str]:
    return []


def target_problems(schedule: Schedule, spec: ConvSpec, target: Target) -> list[str]:
    """The knobs are in range and one block fits the target's threads, registers and shared memory."""
    out = []
    opt = schedule.option
    split, buffers = opt.get("split_c", 1), opt.get("buffers", 2)
    c1 = schedule.factors("c")[1]
    if not isinstance(split, int) or split < 1 or c1 % split:
        return [f"split_c {split!r} must be a positive int dividing the c1 factor {c1}"]
    if buffers not in GPU_BUFFERS:
        return [f"buffers must be one of {GPU_BUFFERS}, got {buffers!r}"]
    if threads(schedule) > GPU_MAX_THREADS:
        out.append(f"{threads(schedule)} threads per block exceed {GPU_MAX_THREADS}")
    acc, acc_max = prod(thread_tile(schedule).values()), gpu_max_accumulators(target)
    if acc > acc_max:
        out.append(f"thread tile of {acc} accumulators exceeds {acc_max} "
                   f"(half of {target.name}'s per-thread registers, at most {GPU_MAX_ACCUMULATORS})")
    smem, smem_max = shared_bytes(schedule, spec), gpu_max_shared_bytes(target)
    if smem > smem_max:
        out.append(f"shared memory {smem} B per block exceeds {smem_max} B")
    return out


def describe(schedule: Schedule) -> str:
    return schedule.loop_annotations()
