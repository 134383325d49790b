"""A lower bound on the weight updates of a conv on a compute-in-memory chip (maco.core.target.CimArch).

The red-blue pebble game with two fast memories per core: the crossbars hold at most S_w weights
(red pebbles on weights) and the psum buffer at most S_p partial sums. What the chip cannot do is
demote a partial sum: it stays in its core's buffer from the first to the last of its R
multiply-adds (R = c_per_group * kh * kw), then leaves complete. Inputs have their own buffer and
are not counted here. Two arguments bound the cells written:

1. Every nonzero weight is written at least once: Q >= K * R weights (the compulsory writes).
2. Take an output o and the interval I_o in which its partial sum is alive. At the start of I_o at
   most S_w of its column's R weights sit in its core's crossbars, so at least R - S_w of them are
   written during I_o. Summing over the M * K outputs (M = n * out_h * out_w): the writes, each
   counted once per output alive on its core when it happens, number at least M * K * (R - S_w).
   A write is counted by at most S_p outputs, so Q >= M * K * (R - S_w) / S_p.

Q >= max of the two, in weights; times cells_per_weight in cells. The argument holds for any
placement of weights in cells. Where each crossbar holds at most one row segment of an output
channel (it feeds one input vector to its rows per activation, and MACO's schedules map a block's
reduction rows to distinct crossbars), at most S_col = crossbars * rows weights of a column are
resident, and the same argument with S_col in place of S_w bounds those schedules
(`cim_weight_bound(..., mapped=True)`): the gap between the two bounds is what folding several
segments of a column into one crossbar (one activation per segment) could still save.

The tile conditions that follow
(maco.space.prune's CIM rules): a schedule meets (1) exactly when no weight is written twice, so the
crossbars of different cores must not hold the same weights (bind cores to output channels and
groups, not to images or pixels), and each block is written once per sweep of the outputs whose
partial sums stay alive: the loops over images and pixels run inside the weight loops except for
as many outer chunks as the psum buffer forces, F >= M_core * t_k / S_p when the reduction takes
more than one block.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from maco.core.spec import ConvSpec
from maco.core.target import CimArch

M, K, R, S_w, S_p = sp.symbols("M K R S_w S_p", positive=True)


@dataclass(frozen=True)
class CimDerivation:
    """The bound in sympy: `compulsory` (every weight once), `psum_limited` (partial sums cannot
    leave the buffer) and `Q` = the larger, all in weights."""

    compulsory: sp.Expr
    psum_limited: sp.Expr
    Q: sp.Expr


def derive_cim() -> CimDerivation:
    compulsory = K * R
    psum_limited = M * K * sp.Max(R - S_w, 0) / S_p
    return CimDerivation(compulsory, psum_limited, sp.Max(compulsory, psum_limited))


def cim_weight_bound(spec: ConvSpec, arch: CimArch, mapped: bool = False) -> int:
    """Fewest cells any schedule of `spec` writes into the crossbars of `arch` (mapped: any schedule
    that keeps one row segment of an output channel per crossbar, as MACO's space does)."""
    d = derive_cim()
    resident = arch.crossbars * arch.rows if mapped else arch.core_weights
    values = {M: spec.n * spec.out_h * spec.out_w, K: spec.k, R: spec.c_per_group * spec.kh * spec.kw,
              S_w: resident, S_p: arch.psum_capacity}
    return int(sp.ceiling(d.Q.subs(values))) * arch.cells_per_weight
