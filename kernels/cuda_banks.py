"""Shared-memory bank model of a generated CUDA conv, and the padding it picks.

Why: the staged input patch has rows of PW floats and the weight tile rows of B_K floats. When
the lanes of a warp read along oh (row stride PW*SH) or along k (stride of a thread's run), a
power-of-two stride puts many lanes on one of the 32 banks, and every such read costs several
shared-memory wavefronts (Nsight Compute measured 72% of the loads' wavefronts as conflicts on an
H100 at batch 8). The generator therefore pads the patch rows and planes and the weight channels,
and skews wide weight rows, choosing the padding that this model says reads in the fewest wavefronts.
That took the H100 kernel's conflicts to zero without making it faster by itself: its warps then
waited on instruction fetch (kernels.cuda_schedule.MAX_UNROLLED_FMAS).

The model replays the reads of one stage's first channel by the first warp, the way compute_stage
issues them: a thread's k run in 16-byte loads where it can be, the input register rows one float
at a time (loaded once per (c, kh) and reused across kw); with split_c, lanes of the next thread
group read its own channel. A load costs the larger of the most distinct words on one bank and
its distinct bytes over 128.
"""
from __future__ import annotations

from typing import Any

BANKS = 32
WARP = 32
PADS = range(8)  # floats added to a patch row, or to a patch plane
WEIGHT_SKEWS = (0, 4)  # floats inserted after every 32 of a weight row (4: keeps 16-byte loads)
WEIGHT_CHANNEL_PADS = (0, 4, 8, 12)  # floats added to a weight channel (multiples of 4: 16-byte loads)


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
    """The first warp's thread coordinates and the LOC index of a plan (as in the CUDA body).
    With split_c the warp may reach into the next thread group, which reads other channels."""

    def __init__(self, plan: Any):
        self.plan = plan
        order = ("k", "ow", "oh") if plan.schedule.layout == "NHWC" else ("ow", "oh", "k")
        _, c1, c2 = plan.f("c")
        self.lanes = []
        for tid in range(min(WARP, plan.threads)):
            t = tid % plan.spatial_threads
            c = {"c": tid // plan.spatial_threads * (c1 // plan.split_c) * c2}
            for a in order:
                f2 = plan.f(a)[2]
                c[a], t = t % f2, t // f2
            c["g"], c["n"] = t % plan.f("g")[2], t // plan.f("g")[2]
            self.lanes.append(c)

    def loc(self, axis: str, r: int, t: int) -> int:
        _, _, f2, f3, f4 = self.plan.f(axis)
        return ((r // (f3 * f4)) * f2 + t) * (f3 * f4) + r % (f3 * f4)


def weight_wavefronts(plan: Any, skew: int, channel: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one channel's weight reads, weight rows skewed by `skew`, channels
    `channel` floats apart."""
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
                        base = (w.loc("g", ig, L["g"]) * plan.stage_c + L["c"]) * channel + (r * plan.stage_kw + s) * row
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
                            ch = (w.loc("n", inn, L["n"]) * plan.block_tile("g") + w.loc("g", ig, L["g"])) * plan.stage_c + L["c"]
                            row = w.loc("oh", ih, L["oh"]) * sh + r * dh
                            lanes.append((ch * plane + row * row_pitch + col + (w.loc("ow", 0, L["ow"]) - w.loc("ow", 0, 0)) * sw,))
                        a, b = wavefronts(lanes)
                        total, ideal = total + a, ideal + b
    return total, ideal


def plane_of(plan: Any, row_pitch: int, plane_pad: int = 0) -> int:
    """Channel stride of the staged patch: odd for NHWC, whose loads store channel-fastest."""
    p = plan.patch[0] * row_pitch + plane_pad
    return p + 1 if plan.schedule.layout == "NHWC" and p % 2 == 0 else p


def weight_channel(plan: Any, skew: int, pad: int = 0) -> int:
    """Shared-memory stride between the weight tile's channels (kh*kw rows of k)."""
    return plan.stage_kh * plan.stage_kw * skewed_row(plan.block_tile("k"), skew) + pad


def choose(plan: Any, fits: Any) -> tuple[int, int, int, int]:
    """(patch row pad, patch plane pad, weight skew, weight channel pad): the fewest modelled
    wavefronts, then the least padding, among the paddings `fits(*padding)` accepts. The input's
    and the weights' reads are independent; each takes its row layout first, then the stride
    between channels (which the thread groups of split_c read at once)."""
    pw = plan.patch[1]

    def reads_in(row: int, plane: int) -> int:
        return input_wavefronts(plan, pw + row, plane_of(plan, pw + row, plane))[0]

    def reads_w(skew: int, pad: int) -> int:
        return weight_wavefronts(plan, skew, weight_channel(plan, skew, pad))[0]

    row = min((p for p in PADS if fits(p, 0, 0, 0)), key=lambda p: (reads_in(p, 0), p))
    plane = min((p for p in PADS if fits(row, p, 0, 0)), key=lambda p: (reads_in(row, p), p))
    skew = min((k for k in WEIGHT_SKEWS if fits(row, plane, k, 0)), key=lambda k: (reads_w(k, 0), k))
    wpad = min((p for p in WEIGHT_CHANNEL_PADS if fits(row, plane, skew, p)), key=lambda p: (reads_w(skew, p), p))
    return row, plane, skew, wpad
