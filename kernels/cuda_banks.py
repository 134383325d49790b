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

import numpy as np

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


def wavefronts(words: np.ndarray) -> tuple[int, int]:
    """(wavefronts, conflict-free wavefronts) summed over warp loads: row i of `words` holds every
    word load i's lanes read. A load costs the most distinct words on one bank, at least its
    distinct bytes over 128."""
    words = np.sort(words.reshape(len(words), -1), axis=1)
    first = np.ones(words.shape, dtype=bool)
    first[:, 1:] = words[:, 1:] != words[:, :-1]
    ideal = np.maximum(1, -(-first.sum(axis=1) * 4 // 128))
    load = np.nonzero(first)[0]
    per_bank = np.bincount(load * BANKS + words[first] % BANKS, minlength=len(words) * BANKS)
    worst = per_bank.reshape(len(words), BANKS).max(axis=1)
    return int(np.maximum(worst, ideal).sum()), int(ideal.sum())


class _Warp:
    """The first warp's thread coordinates (one array per axis, a value per lane) and the LOC
    index of a plan, as in the CUDA body. With split_c the warp may reach into the next thread
    group, which reads other channels."""

    def __init__(self, plan: Any):
        self.f = {a: plan.f(a) for a in ("n", "g", "k", "oh", "ow", "c")}
        order = ("k", "ow", "oh") if plan.schedule.layout == "NHWC" else ("ow", "oh", "k")
        _, c1, c2 = self.f["c"]
        tid = np.arange(min(WARP, plan.threads))
        t = tid % plan.spatial_threads
        self.lane = {"c": tid // plan.spatial_threads * (c1 // plan.split_c) * c2}
        for a in order:
            f2 = self.f[a][2]
            self.lane[a], t = t % f2, t // f2
        self.lane["g"], self.lane["n"] = t % self.f["g"][2], t // self.f["g"][2]

    def loc(self, axis: str, r: Any, t: Any) -> Any:
        """LOC of register index r (int or array) for thread coordinate t (int or array)."""
        _, _, f2, f3, f4 = self.f[axis]
        return ((r // (f3 * f4)) * f2 + t) * (f3 * f4) + r % (f3 * f4)

    def locs(self, axis: str, regs: int) -> np.ndarray:
        """LOC of each register index (rows) for each lane (columns)."""
        return self.loc(axis, np.arange(regs)[:, None], self.lane[axis][None, :])


def weight_wavefronts(plan: Any, skew: int, channel: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one channel's weight reads, weight rows skewed by `skew`, channels
    `channel` floats apart."""
    w = _Warp(plan)
    rk, rg = plan.reg_tile("k"), plan.reg_tile("g")
    row = skewed_row(plan.block_tile("k"), skew)
    vec = 4 if rk % 4 == 0 and plan.f("k")[4] % 4 == 0 and row % 4 == 0 else 1
    taps = np.arange(plan.stage_kh * plan.stage_kw) * row  # (r, s) in the loop's order
    g = (w.locs("g", rg) * plan.stage_c + w.lane["c"]) * channel  # (ig, lane)
    k = skewed(w.locs("k", rk), skew)  # (ik + j, lane)
    k = k.reshape(rk // vec, vec, -1).transpose(0, 2, 1)  # (load, lane, word)
    words = taps[:, None, None, None, None] + g[None, :, None, :, None] + k[None, None, :, :, :]
    return wavefronts(words.reshape(-1, words.shape[3] * vec))


def _input_reads(plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The input reads of one stage's first channel, one row per warp load and one column per
    lane, as (channel, patch row, column) whose word is channel*plane + row*row_pitch + column."""
    w = _Warp(plan)
    sh, sw = plan.spec.stride
    dh, dw = plan.spec.dilation
    cols = sorted({int(w.loc("ow", iw, 0)) * sw + s * dw for iw in range(plan.reg_tile("ow"))
                   for s in range(plan.stage_kw)})
    ch = (w.locs("n", plan.reg_tile("n"))[:, None] * plan.block_tile("g")
          + w.locs("g", plan.reg_tile("g"))[None, :]) * plan.stage_c + w.lane["c"]  # (inn, ig, lane)
    rows = (w.locs("oh", plan.reg_tile("oh"))[None, :] * sh
            + (np.arange(plan.stage_kh) * dh)[:, None, None])  # (r, ih, lane)
    lane_col = (w.loc("ow", 0, w.lane["ow"]) - w.loc("ow", 0, 0)) * sw
    col = np.asarray(cols)[:, None] + lane_col[None, :]  # (col, lane)
    shape = (plan.stage_kh, plan.reg_tile("n"), plan.reg_tile("g"), plan.reg_tile("oh"), len(cols), len(lane_col))
    ch = np.broadcast_to(ch[None, :, :, None, None, :], shape)
    rows = np.broadcast_to(rows[:, None, None, :, None, :], shape)
    col = np.broadcast_to(col[None, None, None, None, :, :], shape)
    return tuple(a.reshape(-1, shape[-1]) for a in (ch, rows, col))


def input_wavefronts(plan: Any, row_pitch: int, plane: int,
                     reads: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[int, int]:
    """(wavefronts, ideal) of one channel's input reads with patch rows `row_pitch` floats apart
    and channels `plane` floats apart (`reads`: _input_reads(plan), when already at hand)."""
    ch, rows, col = reads if reads is not None else _input_reads(plan)
    return wavefronts(ch * plane + rows * row_pitch + col)


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
    reads = _input_reads(plan)

    def reads_in(row: int, plane: int) -> int:
        return input_wavefronts(plan, pw + row, plane_of(plan, pw + row, plane), reads)[0]

    def reads_w(skew: int, pad: int) -> int:
        return weight_wavefronts(plan, skew, weight_channel(plan, skew, pad))[0]

    row = min((p for p in PADS if fits(p, 0, 0, 0)), key=lambda p: (reads_in(p, 0), p))
    plane = min((p for p in PADS if fits(row, p, 0, 0)), key=lambda p: (reads_in(row, p), p))
    skew = min((k for k in WEIGHT_SKEWS if fits(row, plane, k, 0)), key=lambda k: (reads_w(k, 0), k))
    wpad = min((p for p in WEIGHT_CHANNEL_PADS if fits(row, plane, skew, p)), key=lambda p: (reads_w(skew, p), p))
    return row, plane, skew, wpad
