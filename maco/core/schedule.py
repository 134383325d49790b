"""A point of the schedule space: multi-level tile sizes plus annotations.

The sketch follows Ansor's multi-level tiling: every axis of the conv's loop nest
(maco.core.axes) is split into a fixed number of levels per target, and the annotations say how
the loops run. Each target's sketch is its own module, which owns the levels, the `extra` knobs,
the rules of its fields and its target-specific quantities: maco.core.sketch_cpu ("SSRSRS"),
maco.core.sketch_cuda ("SSSRRSRS"), maco.core.sketch_cim ("PSB"). `Schedule` is the value they
share: the fields, the checks every sketch needs, and the JSON round trip. Tiles are perfect: the
factors of an axis multiply to its extent.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from types import ModuleType
from typing import Any

from maco.core import sketch_cim, sketch_cpu, sketch_cuda
from maco.core.axes import ALL_AXES, REDUCTION_AXES, SPATIAL_AXES, axis_extents
from maco.core.errors import MacoError
from maco.core.files import load_json, short
from maco.core.spec import ConvSpec
from maco.core.target import Target

SKETCH_MODULES: dict[str, ModuleType] = {"cpu": sketch_cpu, "cuda": sketch_cuda, "cim": sketch_cim}
SKETCHES = {kind: sketch.NAME for kind, sketch in SKETCH_MODULES.items()}
LEVELS = {kind: sketch.LEVELS for kind, sketch in SKETCH_MODULES.items()}  # (spatial, reduction)
LAYOUTS = ("NCHW", "NHWC")
WEIGHT_PACKINGS = ("none", "blocked")  # blocked: [K/v][C][kh][kw][v], v = vector width
UNROLL_STEPS = (0, 16, 64, 512)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strict_int(name: str, value: Any) -> int:
    """An int from JSON as it is (no float, string or bool coerced: 2.5 must not become 2)."""
    if not _is_int(value):
        raise MacoError(f"schedule field {name} must be an int, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Schedule:
    """One schedule: `spatial[i]` / `reduction[j]` hold the factors of SPATIAL_AXES[i] /
    REDUCTION_AXES[j] from the outermost level to the innermost. `kind` names the sketch
    (SKETCH_MODULES) whose rules the fields follow."""

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

    @property
    def sketch(self) -> ModuleType:
        """The module of this schedule's sketch (its kind must be known: see `problems`)."""
        return SKETCH_MODULES[self.kind]

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

    def spatial_tile(self, level: int) -> dict[str, int]:
        """`tile` of every spatial axis at `level`, read off the factors in one pass."""
        return {axis: prod(f[level:]) for axis, f in zip(SPATIAL_AXES, self.spatial)}

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

    # -- validity ------------------------------------------------------------
    def problems(self, spec: ConvSpec, target: Target | None = None) -> list[str]:
        """Everything that makes this schedule invalid for `spec` on `target` (empty if valid):
        the fields, the tiles, the annotations every sketch has, then the sketch's own rules."""
        out = self._field_problems() or self._tile_problems(spec)
        if out:
            return out
        if self.unroll not in UNROLL_STEPS:
            out.append(f"unroll must be one of {UNROLL_STEPS}, got {self.unroll}")
        if self.vector_width < 1 or self.factors(self.vector_axis)[-1] % self.vector_width:
            out.append(f"vector_width {self.vector_width} must divide the register tile of "
                       f"{self.vector_axis} ({self.factors(self.vector_axis)[-1]})")
        out += self.sketch.problems(self, spec)
        if target is None:
            return out
        if target.kind != self.kind:
            return out + [f"a {self.kind} schedule cannot run on the {target.kind} target {target.name!r}"]
        return out + self.sketch.target_problems(self, spec, target)

    def _tile_problems(self, spec: ConvSpec) -> list[str]:
        """Each axis has its sketch's number of levels, whose factors multiply to its extent."""
        out: list[str] = []
        n_spatial, n_reduction = self.sketch.LEVELS
        extents = axis_extents(spec)
        for axes, tiles, levels in ((SPATIAL_AXES, self.spatial, n_spatial),
                                    (REDUCTION_AXES, self.reduction, n_reduction)):
            if len(tiles) != len(axes):
                out.append(f"expected tiles for {len(axes)} axes {axes}, got {len(tiles)}")
                continue
            for axis, factors in zip(axes, tiles):
                if len(factors) != levels:
                    out.append(f"axis {axis}: {self.kind} sketch {self.sketch.NAME} needs "
                               f"{levels} factors, got {len(factors)}")
                elif any(not isinstance(f, int) or f < 1 for f in factors):
                    out.append(f"axis {axis}: factors must be positive ints, got {factors}")
                elif prod(factors) != extents[axis]:
                    out.append(f"axis {axis}: factors {factors} multiply to {prod(factors)}, "
                               f"not the extent {extents[axis]}")
        return out

    def _field_problems(self) -> list[str]:
        """Types and names from fixed sets, checked before anything reads them: a schedule comes
        from files users share, and only validated values may reach generated source."""
        if not isinstance(self.kind, str) or self.kind not in SKETCH_MODULES:
            return [f"kind must be one of {tuple(SKETCH_MODULES)}, got {self.kind!r}"]
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
            return out + [f"loop_order must be a tuple of axis names, got {short(loop)}"]
        return out + self.sketch.field_problems(self)

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
        return f"{self.kind} {self.layout} tiles {tiles} {self.sketch.describe(self)}"

    def loop_annotations(self) -> str:
        """The CPU and CUDA sketches' annotations and knobs, as `describe` writes them."""
        knobs = "".join(f" {k}={int(v)}" for k, v in self.extra)
        return (f"parallel={self.parallel} vector={self.vector_axis}x{self.vector_width} "
                f"unroll={self.unroll} order={','.join(self.inner_order)} "
                f"weights={self.weight_packing}{knobs}")


SCHEDULE_FIELDS = {"kind", "tiles", "parallel", "vector_axis", "vector_width", "unroll",
                   "inner_order", "layout", "weight_packing", "extra", "loop_order"}


def extra_problems(kind: str, extra: Any) -> list[str]:
    """`extra` must be (knob, scalar) pairs of the backend's known knobs, each of its type."""
    known = SKETCH_MODULES[kind].KNOBS
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
