"""I/O of a schedule's whole loop nest at every level of a memory hierarchy, and what each level
must reach so that it is not the bottleneck.

The one-level bounds (maco.bounds.conv, .tiles) treat a level as the only fast memory in front
of DRAM, and its optimum tile balances x*y = R*z at footprint S. In a CPU nest every level sits
between two others: the register tile below it already reuses each weight x_r*y_r times and each
input z_r times, so a cache level only has to supply its operands at the rate the cores consume
them. Two statements follow:

1. Traffic of a nest at a level of S elements (`nest_traffic`): walking the loops from the
   innermost out, the first loop body whose footprint (inputs + weights + outputs it touches)
   exceeds S bounds the reuse. Inside it everything is reused; each tensor is loaded once per
   visit of that body, except across the directly enclosing loops that do not index it (the
   tensor stays while they run: filters while positions go by, outputs while channels slide).
   Outputs are loaded and stored per visit after the first. This is the red-blue game at that
   level with the nest's own tiles as the computation order; tests check it against the
   exact replay of the nest through an LRU cache (maco.bounds.simulate) on small layers.

2. A level is no bottleneck when the flops per element crossing its boundary reach the
   machine's balance there: F / Q_level >= peak flop rate / the level's bandwidth
   (`level_balance`, sympy). The one-level optimum (x*y = R*z) is the most a level can reach;
   a level whose balance is far below that has slack, and any tile meeting the balance is as
   good as the optimum for speed. The bound-derived default schedules reach 89-99% of the FMA
   peak, so they meet every level's balance, which a condition that asks for the optimum at
   every level (the pruning before this module) does not accept.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import sympy as sp

from maco.bounds.simulate import schedule_loops
from maco.errors import MacoError
from maco.geometry import input_window
from maco.schedule import INPUT_AXES, SPATIAL_AXES, WEIGHT_AXES, Schedule
from maco.spec import ConvSpec

OUTPUT_AXES = SPATIAL_AXES


@dataclass(frozen=True)
class Traffic:
    """Elements crossing a level's boundary: loads of inputs and weights, loads + stores of outputs."""

    inputs: float
    weights: float
    outputs: float

    @property
    def total(self) -> float:
        return self.inputs + self.weights + self.outputs


def _spans(spec: ConvSpec, loops: list[tuple[str, int, int]]) -> list[dict[str, int]]:
    """spans[j][axis]: the index range each axis covers inside loops[j:] (clipped to the layer)."""
    extent = {"n": spec.n, "g": spec.groups, "k": spec.k_per_group, "oh": spec.out_h, "ow": spec.out_w,
              "c": spec.c_per_group, "kh": spec.kh, "kw": spec.kw}
    span = {a: 1 for a in extent}
    out = [dict(span)]
    for axis, count, step in reversed(loops):
        span[axis] = min(extent[axis], span[axis] + (count - 1) * step)
        out.append(dict(span))
    return out[::-1]


def footprints(spec: ConvSpec, span: dict[str, int]) -> dict[str, int]:
    """Elements of each tensor that a loop body with these index spans touches."""
    ih, iw = input_window(spec, span["oh"], span["ow"], span["kh"], span["kw"])
    return {"outputs": prod(span[a] for a in OUTPUT_AXES),
            "weights": prod(span[a] for a in WEIGHT_AXES),
            "inputs": span["n"] * span["g"] * span["c"] * min(spec.h, ih) * min(spec.w, iw)}


def nest_traffic(spec: ConvSpec, schedule: Schedule, S: float) -> Traffic:
    """Elements the schedule's loop nest moves across the boundary of a level of S elements
    (statement 1 of the module docstring). S is what one core has of the level (S / Np)."""
    if not S > 0:
        raise MacoError(f"level size must be positive, got {S!r}")
    loops = [loop for loop in schedule_loops(spec, schedule) if loop[1] > 1]
    spans = _spans(spec, loops)
    fits = next((j for j, span in enumerate(spans) if sum(footprints(spec, span).values()) <= S), len(loops))
    visits = prod(count for _, count, _ in loops[:fits])
    fp = footprints(spec, spans[fits])
    moved = {}
    for name, axes in (("inputs", INPUT_AXES), ("weights", WEIGHT_AXES), ("outputs", OUTPUT_AXES)):
        stays = 1
        for axis, count, _ in reversed(loops[:fits]):
            if axis in axes:
                break
            stays *= count
        moved[name] = fp[name] * visits / stays
    outputs = max(float(spec.output_elems), 2 * moved["outputs"] - spec.output_elems)
    return Traffic(float(moved["inputs"]), float(moved["weights"]), outputs)


def intensity(spec: ConvSpec, schedule: Schedule, S: float) -> float:
    """Multiply-adds per element crossing the level's boundary (higher: more reuse)."""
    return spec.macs / nest_traffic(spec, schedule, S).total


# -- statement 2: the balance a level must reach ------------------------------------------------
x, y, z, R, S_, beta = sp.symbols("x y z R S beta", positive=True)
#: multiply-adds per element moved by an output tile x*y*z sliding over channels (one level):
#: each channel step loads ~x*y inputs (R-fold reuse of a window) and z*R weights for x*y*z*R MACs
TILE_INTENSITY = (x * y * z * R) / (x * y + z * R)


def level_balance() -> dict[str, sp.Expr]:
    """The one-level optimum and the balance condition, derived with sympy:

    optimum     maximise TILE_INTENSITY at footprint x*y*z = S: x*y = R*z, intensity sqrt(R*S)/2
    condition   TILE_INTENSITY >= beta (the machine balance of the level, MACs per element):
                the tiles that keep the level off the critical path, a region around the optimum
                that is wide where sqrt(R*S)/2 >> beta
    """
    p = sp.symbols("p", positive=True)  # p = x*y
    on_capacity = TILE_INTENSITY.subs(x * y, p).subs(z, S_ / p)
    best_p = sp.solve(sp.diff(on_capacity, p), p)[0]
    best = sp.simplify(on_capacity.subs(p, best_p))
    return {"optimal_xy": best_p, "optimal_intensity": best,
            "condition": sp.Ge(TILE_INTENSITY, beta)}
