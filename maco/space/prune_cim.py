"""MACO pruning of the compute-in-memory space: the tile conditions of the weight-update bound.

maco.bounds.cim bounds the cells written by K * R (every weight once) and says when a schedule
meets it: no two cores hold the same weights, and each weight block is written once per sweep of
the outputs whose partial sums the buffer keeps. Two rules follow:

  cores   the cores are bound to the weight axes only (g, k): binding images or pixels would
          copy every block into several cores' crossbars;
  sweep   the loops over images and pixels with more than one trip run either inside every
          weight loop or outside all of them, as chunks of the output sweep, and there are at
          most `max_chunks` chunks: 1 when the reduction fits one block of the crossbars (its
          partial sums then live for one block only), else the fewest chunks whose pixels fit
          the psum buffer one output channel at a time (the most a chunk can hold).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from maco.core.axes import WEIGHT_AXES
from maco.core.schedule import Schedule
from maco.core import sketch_cim
from maco.core.sketch_cim import cim_crossbars
from maco.core.factors import divisors
from maco.core.spec import ConvSpec
from maco.core.target import Target

STREAM_AXES = ("n", "oh", "ow")  # spatial axes that only stream pixels past a weight block
OUTPUT_BLOCK_AXES = ("g", "k")  # spatial axes a weight block depends on


@dataclass(frozen=True)
class CimRules:
    max_chunks: int  # most outer chunks of the output sweep

    def describe(self) -> str:
        return (f"cores bound to g/k only; image and pixel loops inside the weight loops, or outside "
                f"them in at most {self.max_chunks} chunk(s)")


def one_block_fits(spec: ConvSpec, target: Target) -> bool:
    """Whether the whole reduction of one output channel fits one core's crossbars."""
    arch = target.cim_arch
    return cim_crossbars(arch, spec.c_per_group * spec.kh * spec.kw, 1) <= arch.crossbars


def fewest_chunks(spec: ConvSpec, target: Target) -> int:
    """Fewest outer chunks (o_n * o_oh * o_ow, each dividing its axis) whose pixels fit the psum
    buffer one output channel at a time."""
    cap = target.cim_arch.psum_capacity
    best = None
    for on, oh, ow in product(divisors(spec.n), divisors(spec.out_h), divisors(spec.out_w)):
        if (spec.n // on) * (spec.out_h // oh) * (spec.out_w // ow) <= cap:
            best = on * oh * ow if best is None else min(best, on * oh * ow)
    return best if best is not None else spec.n * spec.out_h * spec.out_w


def cim_rules(spec: ConvSpec, target: Target) -> CimRules:
    return CimRules(1 if one_block_fits(spec, target) else fewest_chunks(spec, target))


def sweep_chunks(schedule: Schedule) -> int | None:
    """Outer chunks of the output sweep: the product of the stream loops with trips that run
    outside every weight loop with trips; None when a stream loop sits between weight loops."""
    trips = sketch_cim.trips(schedule)
    active = [a for a in schedule.loop_order if trips[a] > 1]
    blocks = [i for i, a in enumerate(active) if a in WEIGHT_AXES]
    if not blocks:
        return 1
    first, last = blocks[0], blocks[-1]
    if any(a in STREAM_AXES for a in active[first:last + 1]):
        return None
    chunks = 1
    for a in active[:first]:
        chunks *= trips[a]
    return chunks


def cim_reasons(schedule: Schedule, rules: CimRules) -> list[str]:
    """Which CIM rules `schedule` breaks (empty: it is in the pruned space)."""
    out = []
    bound = [a for a in STREAM_AXES if schedule.factors(a)[0] > 1]
    if bound:
        out.append(f"cores bound to {', '.join(bound)}: every core would write the same weights")
    chunks = sweep_chunks(schedule)
    if chunks is None:
        out.append("an image or pixel loop runs between weight loops: each block is written again "
                   "for each of its trips")
    elif chunks > rules.max_chunks:
        out.append(f"the output sweep runs in {chunks} chunks, each writing every block again; "
                   f"the psum buffer needs only {rules.max_chunks}")
    return out
