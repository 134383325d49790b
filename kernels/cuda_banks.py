"""Shared-memory bank model of a generated CUDA conv, and the padding it picks.

Why: the staged input patch has rows of PW floats and the weight tile rows of B_K floats. When
the lanes of a warp read along oh (row stride PW*SH) or along k (stride of a thread's run), a
power-of-two stride puts many lanes on one of the 32 banks, and every such read costs several
shared-memory wavefronts (Nsight Compute measured 72% of the loads' wavefronts as conflicts on an
H100 at batch 8). The generator therefore pads the patch rows and skews the weight rows, choosing
the padding that this model says reads in the fewest wavefronts.

The model replays the reads of one stage's first channel by the first warp, the way compute_stage
issues them: a thread's k run in 16-byte loads where it can be, the input register rows one float
at a time (loaded once per (c, kh) and reused across kw). A load costs the larger of the most
distinct words on one bank and its distinct bytes over 128.
"""
from __future__ import annotations

from typing import Any

BANKS = 32
WARP = 32
ROW_PADS = range(8)  # floats added to a patch row
WEIGHT_SKEWS = (0, 4)  # floats inserted after every 32 of a weight row (4: keeps 16-byte loads)


def skewed(kl: int, skew: int) -> int:
    """Where element kl of a weight row sits in shared memory."""
    return kl + skew * (kl // BANKS)


def skewed_row(b_k: int, skew: int) -> int:
    """Shared-memory length of a weight row of b_k elements, skewed."""
    return skewed(b_k - 1, skew) + 1 if b_k else 0


def wavefronts(lanes: list[tuple[int, ...]]) -> tuple[int, int]:
    """(wavefronts, conflict-free wavefronts) of one warp load; `lanes` holds each lane's words."""
    words = {w for ws in lanes for w in ws}
    per_bank: dict[int, int] = {}
    for w in words:
        per_bank[w % BANKS] = per_bank.get(w % BANKS, 0) + 1
    ideal = max(1, -(-len(words) * 4 // 128))
    return max(max(per_bank.values()), ideal), ideal


class _Warp:
    """The first warp's thread coordinates and the LOC index of a plan (as in the CUDA body)."""

    def __init__(self, plan: Any):
        self.plan = plan
        order = ("k", "ow", "oh") if plan.schedule.layout == "NHWC" else ("ow", "oh", "k")
        self.lanes = []
        for t in range(min(WARP, plan.spatial_threads)):
            c = {}
            for a in order:
                f2 = plan.f(a)[2]
                c[a], t = t % f2, t // f2
            c["g"], c["n"] = t % plan.f("g")[2], t // plan.f("g")[2]
            self.lanes.append(c)

    def loc(self, axis: str, r: int, t: int) -> int:
        _, _, f2, f3, f4 = self.plan.f(axis)
        return ((r // (f3 * f4)) * f2 + t) * (f3 * f4) + r % (f3 * f4)


def weight_wavefronts(plan: Any, skew: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one channel's weight reads, weight rows skewed by `skew`."""
    w = _Warp(plan)
    rk, rg = plan.reg_tile("k"), plan.reg_tile("g")
    row = skewed_row(plan.block_tile("k"), skew)
    vec = 4 if rk % 4 == 0 and plan.f("k")[4] % 4 == 0 and row % 4 == 0 else 1
    total = ideal = 0
    for r in range(plan.stage_kh):
        for s in range(plan.stage_kw):
            for ig in range(rg):
                for ik in range(0, rk, vec):
                    lanes = []
                    for L in w.lanes:
                        base = (w.loc("g", ig, L["g"]) * plan.stage_c * plan.stage_kh + r) * plan.stage_kw * row + s * row
                        lanes.append(tuple(base + skewed(w.loc("k", ik + j, L["k"]), skew) for j in range(vec)))
                    a, b = wavefronts(lanes)
                    total, ideal = total + a, ideal + b
    return total, ideal


def input_wavefronts(plan: Any, row_pitch: int, plane: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one channel's input reads with patch rows `row_pitch` floats apart
    and channels `plane` floats apart."""
    w = _Warp(plan)
    sh, sw = plan.spec.stride
    dh, dw = plan.spec.dilation
    cols = sorted({w.loc("ow", iw, 0) * sw + s * dw for iw in range(plan.reg_tile("ow"))
                   for s in range(plan.stage_kw)})
    total = ideal = 0
    for r in range(plan.stage_kh):
        for inn in range(plan.reg_tile("n")):
            for ig in range(plan.reg_tile("g")):
                for ih in range(plan.reg_tile("oh")):
                    for col in cols:
                        lanes = []
                        for L in w.lanes:
                            ch = (w.loc("n", inn, L["n"]) * plan.block_tile("g") + w.loc("g", ig, L["g"])) * plan.stage_c
                            row = w.loc("oh", ih, L["oh"]) * sh + r * dh
                            lanes.append((ch * plane + row * row_pitch + col + (w.loc("ow", 0, L["ow"]) - w.loc("ow", 0, 0)) * sw,))
                        a, b = wavefronts(lanes)
                        total, ideal = total + a, ideal + b
    return total, ideal


def plane_of(plan: Any, row_pitch: int) -> int:
    """Channel stride of the staged patch: odd for NHWC, whose loads store channel-fastest."""
    p = plan.patch[0] * row_pitch
    return p + 1 if plan.schedule.layout == "NHWC" and p % 2 == 0 else p


def choose(plan: Any, fits: Any) -> tuple[int, int]:
    """(row pad, weight skew): the fewest modelled wavefronts, then the least padding, among
    the paddings for which `fits(row_pad, skew)` says the shared memory still suffices."""
    pw = plan.patch[1]
    best_pad = min((p for p in ROW_PADS if fits(p, 0)),
                   key=lambda p: (input_wavefronts(plan, pw + p, plane_of(plan, pw + p))[0], p))
    best_skew = min((s for s in WEIGHT_SKEWS if fits(best_pad, s)),
                    key=lambda s: (weight_wavefronts(plan, s)[0], s))
    return best_pad, best_skew

