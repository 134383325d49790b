"""A point of the schedule space: multi-level tile sizes plus annotations.

The sketch follows Ansor's multi-level tiling. On CPU, "SSRSRS": every spatial axis is split
into 4 levels and every reduction axis into 2, nested as

    S0 (fused, parallel)  S1  R0  S2  R1  S3 (register tile)

On GPU, "SSSRRSRS": spatial axes into 5 levels (block, virtual thread, thread, two inner),
reduction axes into 3, nested as

    S0 (blockIdx)  S1 (vthread)  S2 (threadIdx)  R0  R1  S3  R2  S4

On a compute-in-memory chip (kind "cim", see maco.core.target.CimArch), "PSB": spatial axes into 3
levels (core, outer loop, tile), reduction axes into 2 (outer loop, block):

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

Axes: spatial n (batch), g (group), k (filter within the group), oh, ow; reduction c (channel
within the group), kh, kw. Tiles are perfect: the factors of an axis multiply to its extent.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from maco.core.errors import MacoError
from maco.core.files import load_json, short
from maco.core.geometry import input_window, max_input_span
from maco.core.spec import ConvSpec
from maco.core.target import Target

SPATIAL_AXES = ("n", "g", "k", "oh", "ow")
REDUCTION_AXES = ("c", "kh", "kw")
ALL_AXES = SPATIAL_AXES + REDUCTION_AXES
WEIGHT_AXES = ("g", "k", "c", "kh", "kw")  # the axes a weight block depends on
INPUT_AXES = ("n", "g", "c", "kh", "kw", "oh", "ow")  # the axes an input window depends on
SKETCHES = {"cpu": "SSRSRS", "cuda": "SSSRRSRS", "cim": "PSB"}
LEVELS = {"cpu": (4, 2), "cuda": (5, 3), "cim": (3, 2)}  # (spatial levels, reduction levels)
LAYOUTS = ("NCHW", "NHWC")
WEIGHT_PACKINGS = ("none", "blocked")  # blocked: [K/v][C][kh][kw][v], v = vector width
UNROLL_STEPS = (0, 16, 64, 512)
REGISTER_RESERVE = 4  # vector registers left for input broadcasts and weights
# GPU limits: threads per block, accumulators per thread (at most half the per-thread registers),
# dynamic shared memory one block may opt into on sm_80/sm_90 (the CUDA backend's limits).
GPU_MAX_THREADS = 1024
GPU_MAX_ACCUMULATORS = 128
GPU_MAX_SMEM_BYTES = 227 << 10
GPU_BUFFERS = (2, 3, 4)  # shared-memory stages in flight (2 = double buffering)
# backend knobs a schedule's `extra` may hold, with their types; the CPU backend has none
EXTRA_KNOBS: dict[str, dict[str, type]] = {"cpu": {}, "cuda": {"split_c": int, "stage_out": bool,
                                                               "buffers": int}, "cim": {}}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strict_int(name: str, value: Any) -> int:
    """An int from JSON as it is (no float, string or bool coerced: 2.5 must not become 2)."""
    if not _is_int(value):
        raise MacoError(f"schedule field {name} must be an int, got {value!r}")
    return int(value)


def axis_extents(spec: ConvSpec) -> dict[str, int]:
    """Loop extents of the sketch's axes for one conv."""
    return {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h,
            "ow": spec.out_w, "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}


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


@dataclass(frozen=True)
class Schedule:
    """One schedule: `spatial[i]` / `reduction[j]` hold the factors of SPATIAL_AXES[i] /
    REDUCTION_AXES[j] from the outermost level to the innermost."""

    kind: str  # "cpu", "cuda" or "cim"
    spatial: tuple[tuple[int, ...], ...]
    reduction: tuple[tuple[int, ...], ...]
    parallel: int = 1  # CPU: how many outermost S0 loops (in SPATIAL_AXES order) are fused and parallel
    vector_axis: str = "k"  # spatial axis vectorised in the register tile
    vector_width: int = 1  # SIMD lanes used on vector_axis (1 = scalar)
    unroll: int = 0  # max unroll step (Ansor's auto_unroll_max_step)
    inner_order: tuple[str, ...] = REDUCTION_AXES  # order of the innermost reduction loops
    layout: str = "NCHW"  # activation layout (input and output)
    weight_packing: str = "blocked"
    extra: tuple[tuple[str, Any], ...] = field(default=())  # backend-specific knobs, hashable
    loop_order: tuple[str, ...] = ()  # CIM: the outer loops, all 8 axes, outermost first

    # -- accessors -----------------------------------------------------------
    def factors(self, axis: str) -> tuple[int, ...]:
        if axis in SPATIAL_AXES:
            return self.spatial[SPATIAL_AXES.index(axis)]
        if axis in REDUCTION_AXES:
            return self.reduction[REDUCTION_AXES.index(axis)]
        raise MacoError(f"unknown axis {axis!r}; axes are {SPATIAL_AXES + REDUCTION_AXES}")

    def tile(self, axis: str, level: int) -> int:
        """Extent of `axis` covered by one iteration at `level` (product of the deeper factors)."""
        return prod(self.factors(axis)[level:])

    def register_tile(self) -> dict[str, int]:
        """The innermost spatial level: the outputs one micro-kernel call keeps in registers."""
        return {axis: f[-1] for axis, f in zip(SPATIAL_AXES, self.spatial)}

    @property
    def accumulators(self) -> int:
        """Vector registers the register tile needs for its outputs."""
        outputs = prod(self.register_tile().values())
        return -(-outputs // self.vector_width)

    @property
    def option(self) -> dict[str, Any]:
        return dict(self.extra)

    # -- GPU sketch (block, vthread, thread, inner, inner): see maco.kernels.cuda_codegen ----
    def gpu_thread_tile(self) -> dict[str, int]:
        """Outputs one thread owns per axis: vthread x the two inner factors (f1*f3*f4)."""
        return {a: f[1] * f[3] * f[4] for a, f in zip(SPATIAL_AXES, self.spatial)}

    def gpu_block_tile(self) -> dict[str, int]:
        """Outputs one thread block owns per axis (f1*f2*f3*f4)."""
        return {a: prod(f[1:]) for a, f in zip(SPATIAL_AXES, self.spatial)}

    @property
    def gpu_threads(self) -> int:
        """Threads per block: the thread-level factors times the channel split (split_c)."""
        return prod(f[2] for f in self.spatial) * int(self.option.get("split_c", 1))

    def gpu_shared_bytes(self, spec: ConvSpec) -> int:
        """Dynamic shared memory of one block, as the CUDA backend lays it out: `buffers` stages
        of (input patch of the stage's channels + their weights), each rounded to 4 floats, the
        NHWC patch plane padded to odd; or the staged outputs when stage_out is on."""
        opt = self.option
        split = int(opt.get("split_c", 1))
        stage_out = bool(opt.get("stage_out", split > 1))
        return int(gpu_shared_bytes(spec, self.gpu_block_tile(), prod(self.factors("c")[1:]),
                                    prod(self.factors("kh")[1:]), prod(self.factors("kw")[1:]),
                                    self.layout, int(opt.get("buffers", 2)), stage_out, split))

    # -- CIM sketch (cores, outer loop, block): see maco.kernels.cim_cost ----------
    def cim_trips(self) -> dict[str, int]:
        """Trips of each axis's outer loop (level 1)."""
        return {a: f[1] if a in SPATIAL_AXES else f[0]
                for a, f in zip(ALL_AXES, self.spatial + self.reduction)}

    def cim_block(self) -> dict[str, int]:
        """Per axis, the extent one iteration covers: the spatial tile and the reduction block."""
        return {a: f[-1] for a, f in zip(ALL_AXES, self.spatial + self.reduction)}

    @property
    def cim_cores(self) -> int:
        """Cores the schedule binds (product of the spatial level-0 factors)."""
        return prod(f[0] for f in self.spatial)

    def cim_footprint(self, spec: ConvSpec, arch: Any) -> dict[str, int]:
        """What one core's crossbars and buffers must hold at their peak: crossbars of the weight
        block, bytes of the largest (clipped) input window, partial sums alive at once."""
        b = self.cim_block()
        rows, columns = b["g"] * b["c"] * b["kh"] * b["kw"], b["g"] * b["k"]
        window = (b["n"] * b["g"] * b["c"] * max_input_span(spec, "h", b["oh"], b["kh"])
                  * max_input_span(spec, "w", b["ow"], b["kw"]))
        tile = b["n"] * b["g"] * b["k"] * b["oh"] * b["ow"]
        return {"crossbars": cim_crossbars(arch, rows, columns), "weight_rows": rows,
                "weight_columns": columns, "input_bytes": window * arch.input_bytes,
                "psums": cim_live_psums(tile, self.loop_order, self.cim_trips())}

    # -- validity ------------------------------------------------------------
    def problems(self, spec: ConvSpec, target: Target | None = None) -> list[str]:
        """Everything that makes this schedule invalid for `spec` on `target` (empty if valid)."""
        out = self._field_problems()
        if out:
            return out
        n_spatial, n_reduction = LEVELS[self.kind]
        extents = axis_extents(spec)
        for axes, tiles, levels in ((SPATIAL_AXES, self.spatial, n_spatial),
                                    (REDUCTION_AXES, self.reduction, n_reduction)):
            if len(tiles) != len(axes):
                out.append(f"expected tiles for {len(axes)} axes {axes}, got {len(tiles)}")
                continue
            for axis, factors in zip(axes, tiles):
                if len(factors) != levels:
                    out.append(f"axis {axis}: {self.kind} sketch {SKETCHES[self.kind]} needs "
                               f"{levels} factors, got {len(factors)}")
                elif any(not isinstance(f, int) or f < 1 for f in factors):
                    out.append(f"axis {axis}: factors must be positive ints, got {factors}")
                elif prod(factors) != extents[axis]:
                    out.append(f"axis {axis}: factors {factors} multiply to {prod(factors)}, "
                               f"not the extent {extents[axis]}")
        if out:
            return out
        if self.kind == "cim":
            return out + (self._cim_problems(spec, target) if target is not None else [])
        if self.unroll not in UNROLL_STEPS:
            out.append(f"unroll must be one of {UNROLL_STEPS}, got {self.unroll}")
        if self.vector_width < 1 or self.factors(self.vector_axis)[-1] % self.vector_width:
            out.append(f"vector_width {self.vector_width} must divide the register tile of "
                       f"{self.vector_axis} ({self.factors(self.vector_axis)[-1]})")
        if self.kind == "cpu" and not 0 <= self.parallel <= len(SPATIAL_AXES):
            out.append(f"parallel must be in 0..{len(SPATIAL_AXES)}, got {self.parallel}")
        if target is not None:
            if target.kind != self.kind:
                out.append(f"a {self.kind} schedule cannot run on the {target.kind} target {target.name!r}")
            elif self.kind == "cpu":
                if self.vector_width not in (1, target.simd_width):
                    out.append(f"vector_width must be 1 or the target's SIMD width "
                               f"{target.simd_width}, got {self.vector_width}")
                regs = target.level("registers").elements // target.simd_width
                if self.accumulators > regs - REGISTER_RESERVE:
                    out.append(f"register tile needs {self.accumulators} accumulators but only "
                               f"{regs - REGISTER_RESERVE} of {regs} vector registers are free")
            else:
                out += self._gpu_problems(spec, target)
        return out

    def _field_problems(self) -> list[str]:
        """Types and names from fixed sets, checked before anything reads them: a schedule comes
        from files users share, and only validated values may reach generated source."""
        if not isinstance(self.kind, str) or self.kind not in LEVELS:
            return [f"kind must be one of {tuple(LEVELS)}, got {self.kind!r}"]
        out = []
        for name, tiles in (("spatial", self.spatial), ("reduction", self.reduction)):
            if not isinstance(tiles, tuple) or not all(
                    isinstance(f, tuple) and all(_is_int(v) for v in f) for f in tiles):
                out.append(f"{name} tiles must be tuples of ints, got {tiles!r}")
        for name in ("parallel", "vector_width", "unroll"):
            if not _is_int(getattr(self, name)):
                out.append(f"{name} must be an int, got {getattr(self, name)!r}")
        for name, allowed in (("vector_axis", SPATIAL_AXES), ("layout", LAYOUTS),
                              ("weight_packing", WEIGHT_PACKINGS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                out.append(f"{name} must be one of {allowed}, got {value!r}")
        order = self.inner_order
        if not isinstance(order, tuple) or not all(isinstance(a, str) for a in order) \
                or sorted(order) != sorted(REDUCTION_AXES):
            out.append(f"inner_order must be a permutation of {REDUCTION_AXES}, got {order!r}")
        out += extra_problems(self.kind, self.extra)
        loop = self.loop_order
        if not isinstance(loop, tuple) or not all(isinstance(a, str) for a in loop):
            out.append(f"loop_order must be a tuple of axis names, got {short(loop)}")
        elif self.kind == "cim":
            if sorted(loop) != sorted(ALL_AXES):
                out.append(f"loop_order must be a permutation of {ALL_AXES}, got {short(loop)}")
            knobs = (self.parallel, self.vector_axis, self.vector_width, self.unroll, self.inner_order,
                     self.weight_packing)
            if knobs != (1, "k", 1, 0, REDUCTION_AXES, "blocked"):
                out.append("a cim schedule has no parallel, vector, unroll, inner_order or "
                           "weight_packing knobs (leave them at their defaults)")
        elif loop:
            out.append(f"only cim schedules have a loop_order, got {short(loop)}")
        return out

    def _gpu_problems(self, spec: ConvSpec, target: Target) -> list[str]:
        out = []
        opt = self.option
        split, buffers = opt.get("split_c", 1), opt.get("buffers", 2)
        if not isinstance(split, int) or split < 1 or self.factors("c")[1] % split:
            return [f"split_c {split!r} must be a positive int dividing the c1 factor {self.factors('c')[1]}"]
        if buffers not in GPU_BUFFERS:
            return [f"buffers must be one of {GPU_BUFFERS}, got {buffers!r}"]
        if self.gpu_threads > GPU_MAX_THREADS:
            out.append(f"{self.gpu_threads} threads per block exceed {GPU_MAX_THREADS}")
        acc, acc_max = prod(self.gpu_thread_tile().values()), gpu_max_accumulators(target)
        if acc > acc_max:
            out.append(f"thread tile of {acc} accumulators exceeds {acc_max} "
                       f"(half of {target.name}'s per-thread registers, at most {GPU_MAX_ACCUMULATORS})")
        smem, smem_max = self.gpu_shared_bytes(spec), gpu_max_shared_bytes(target)
        if smem > smem_max:
            out.append(f"shared memory {smem} B per block exceeds {smem_max} B")
        return out

    def _cim_problems(self, spec: ConvSpec, target: Target) -> list[str]:
        if target.kind != "cim":
            return [f"a cim schedule cannot run on the {target.kind} target {target.name!r}"]
        arch = target.cim_arch
        out = []
        if self.cim_cores > arch.cores:
            out.append(f"binds {self.cim_cores} cores, the chip has {arch.cores}")
        use = self.cim_footprint(spec, arch)
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

    def validate(self, spec: ConvSpec, target: Target | None = None) -> "Schedule":
        problems = self.problems(spec, target)
        if problems:
            raise MacoError("invalid schedule for " + str(spec) + ": " + "; ".join(problems))
        return self

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind,
                "tiles": {a: list(f) for a, f in zip(SPATIAL_AXES + REDUCTION_AXES,
                                                     self.spatial + self.reduction)},
                "parallel": self.parallel, "vector_axis": self.vector_axis,
                "vector_width": self.vector_width, "unroll": self.unroll,
                "inner_order": list(self.inner_order), "layout": self.layout,
                "weight_packing": self.weight_packing, "extra": dict(self.extra),
                **({"loop_order": list(self.loop_order)} if self.loop_order else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Schedule":
        """A schedule from its dict, with every field's type checked (values against a spec are
        checked by `problems`); MacoError naming the first bad field."""
        if not isinstance(d, dict):
            raise MacoError(f"a schedule must be a JSON object, got {type(d).__name__}")
        unknown = set(d) - SCHEDULE_FIELDS
        if unknown:
            raise MacoError(f"unknown schedule field(s) {sorted(map(str, unknown))[:5]}")
        tiles, extra = d.get("tiles"), d.get("extra", {})
        if not isinstance(tiles, dict):
            raise MacoError(f"schedule tiles must be an object of axis: factors, got {short(tiles)}")
        missing = [a for a in SPATIAL_AXES + REDUCTION_AXES if a not in tiles]
        if missing:
            raise MacoError(f"schedule is missing tiles for axes {missing}")
        if len(tiles) != len(SPATIAL_AXES + REDUCTION_AXES):
            raise MacoError(f"schedule tiles name unknown axes {short(sorted(set(map(str, tiles)) - set(SPATIAL_AXES + REDUCTION_AXES)))}")
        for axis in SPATIAL_AXES + REDUCTION_AXES:
            if not isinstance(tiles[axis], list) or len(tiles[axis]) > 8:
                raise MacoError(f"tiles of axis {axis} must be a short list of ints, got {short(tiles[axis])}")
        if not isinstance(extra, dict):
            raise MacoError(f"schedule extra must be an object of knob: value, got {short(extra)}")
        order = d.get("inner_order", list(REDUCTION_AXES))
        if not isinstance(order, list) or len(order) != len(REDUCTION_AXES):
            raise MacoError(f"inner_order must be a list of {len(REDUCTION_AXES)} axes, got {short(order)}")
        loop = d.get("loop_order", [])
        if not isinstance(loop, list) or len(loop) > len(ALL_AXES):
            raise MacoError(f"loop_order must be a list of at most {len(ALL_AXES)} axes, got {short(loop)}")
        schedule = cls(
            kind=d.get("kind"),
            spatial=tuple(tuple(_strict_int(f"tiles.{a}", f) for f in tiles[a]) for a in SPATIAL_AXES),
            reduction=tuple(tuple(_strict_int(f"tiles.{a}", f) for f in tiles[a]) for a in REDUCTION_AXES),
            parallel=_strict_int("parallel", d.get("parallel", 1)),
            vector_axis=d.get("vector_axis", "k"),
            vector_width=_strict_int("vector_width", d.get("vector_width", 1)),
            unroll=_strict_int("unroll", d.get("unroll", 0)),
            inner_order=tuple(order), layout=d.get("layout", "NCHW"),
            weight_packing=d.get("weight_packing", "blocked"),
            extra=tuple(sorted(extra.items())), loop_order=tuple(loop))
        problems = schedule._field_problems()
        if problems:
            raise MacoError("not a valid schedule: " + "; ".join(problems))
        return schedule

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        return cls.from_dict(load_json(text, "schedule JSON"))

    def describe(self) -> str:
        """One line of this (validated) schedule's fields, for comments in generated source."""
        tiles = " ".join(f"{a}={'x'.join(map(str, f))}" for a, f in
                         zip(SPATIAL_AXES + REDUCTION_AXES, self.spatial + self.reduction))
        knobs = "".join(f" {k}={int(v)}" for k, v in self.extra)
        if self.kind == "cim":
            return f"cim {self.layout} tiles {tiles} loops={','.join(self.loop_order)}"
        return (f"{self.kind} {self.layout} tiles {tiles} parallel={self.parallel} "
                f"vector={self.vector_axis}x{self.vector_width} unroll={self.unroll} "
                f"order={','.join(self.inner_order)} weights={self.weight_packing}{knobs}")


SCHEDULE_FIELDS = {"kind", "tiles", "parallel", "vector_axis", "vector_width", "unroll",
                   "inner_order", "layout", "weight_packing", "extra", "loop_order"}


def extra_problems(kind: str, extra: Any) -> list[str]:
    """`extra` must be (knob, scalar) pairs of the backend's known knobs, each of its type."""
    known = EXTRA_KNOBS[kind]
    if not isinstance(extra, tuple) or not all(isinstance(kv, tuple) and len(kv) == 2 for kv in extra):
        return [f"extra must be (knob, value) pairs, got {short(extra)}"]
    out = []
    for knob, value in extra:
        if not isinstance(knob, str) or knob not in known:
            out.append(f"unknown {kind.upper()} schedule knob {short(knob)}"
                       + (f"; known: {', '.join(known)}" if known else f"; the {kind.upper()} backend has none"))
        elif type(value) is not known[knob]:
            out.append(f"knob {knob} must be a {known[knob].__name__}, got {short(value)}")
    if len({kv[0] for kv in extra if isinstance(kv[0], str)}) != len(extra):
        out.append("extra names a knob twice")
    return out
