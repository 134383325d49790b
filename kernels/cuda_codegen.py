"""CUDA C for one direct convolution from a GPU schedule (sketch "SSSRRSRS"). Pure Python: no CuPy.

Mapping of the sketch onto the GPU (per spatial axis a in n, g, k, oh, ow with factors f0..f4):
  f0  blocks (blockIdx.x enumerates all block tiles)        block tile B_a = f1*f2*f3*f4
  f1  virtual threads: the block tile is cut into f1 chunks, every thread owns a piece of each
  f2  threads (threadIdx.x)                                  register tile R_a = f1*f3*f4
  f3, f4  the thread's contiguous run inside one chunk
A thread's local index along a is ((v*f2 + t)*f3 + i3)*f4 + i4, so threads next to each other
own neighbouring outputs (coalesced stores, conflict-free shared reads).

Reduction axes c, kh, kw with factors (r0, r1, r2): the block slides over stages (c0, kh0, kw0);
one stage holds CC = c1*c2 input channels, the kh1*kh2 x kw1*kw2 window slice, the block's input
patch and its filters' weights in shared memory, double buffered with cp.async (alpha = 1: the
output tile stays in registers while the channels stream through). Inside a stage the R1 loops run
with the schedule's unroll, the R2 loops fully unrolled around the register outer product.

extra knobs: ("split_c", s) splits the c1 loop over s groups of threads whose partial sums are
added through shared memory before the epilogue (the block tile then needs fewer threads per
output, the rfactor of Ansor's GPU sketch); ("stage_out", bool) writes outputs through shared
memory so that global stores are coalesced in either layout.

The same source compiles as host C++ (`host_emulation_source`), with one sequential driver that
runs the block's threads phase by phase between barriers, so the index arithmetic is testable
without a GPU.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any

from maco.core.errors import MacoError
from maco.core.geometry import input_window
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES
from maco.core.schedule import Schedule
from maco.core.sketch_cuda import GPU_MAX_ACCUMULATORS, GPU_MAX_SMEM_BYTES, GPU_MAX_THREADS
from maco.kernels import cuda_banks
from maco.kernels.source_text import comment
from maco.core.spec import ConvSpec

INT32_MAX = 2**31 - 1
SM_SHARED_BYTES = 228 << 10  # per SM on sm_90 (1 KiB of it reserved per block)
SM_MAX_BLOCKS, SM_MAX_THREADS = 32, 2048
KERNEL_NAME = "maco_conv"


@dataclass(frozen=True)
class CudaPlan:
    """Everything the source and the launch need, derived once from spec + schedule + epilogue."""

    spec: ConvSpec
    schedule: Schedule
    bias: bool = False
    relu: bool = False
    residual: bool = False

    # -- derived sizes -------------------------------------------------------
    def f(self, axis: str) -> tuple[int, ...]:
        return self.schedule.factors(axis)

    def block_tile(self, axis: str) -> int:
        return prod(self.f(axis)[1:])

    def reg_tile(self, axis: str) -> int:
        f = self.f(axis)
        return f[1] * f[3] * f[4]

    @property
    def split_c(self) -> int:
        return int(self.schedule.option.get("split_c", 1))

    @property
    def stage_out(self) -> bool:
        return bool(self.schedule.option.get("stage_out", self.split_c > 1))

    @property
    def spatial_threads(self) -> int:
        return prod(self.f(a)[2] for a in SPATIAL_AXES)

    @property
    def threads(self) -> int:
        return self.spatial_threads * self.split_c

    @property
    def blocks(self) -> int:
        return prod(self.f(a)[0] for a in SPATIAL_AXES)

    @property
    def accumulators(self) -> int:
        return prod(self.reg_tile(a) for a in SPATIAL_AXES)

    @property
    def unrolled_fmas(self) -> int:
        """FMAs in one unrolled body of the reduction loops (a proxy for code size and compile time)."""
        r2 = prod(self.f(a)[2] for a in REDUCTION_AXES)
        r1 = prod(self.f(a)[1] for a in REDUCTION_AXES) // self.split_c
        return self.accumulators * r2 * max(1, min(r1, self.schedule.unroll // max(r2, 1)))

    @property
    def block_outputs(self) -> int:
        return prod(self.block_tile(a) for a in SPATIAL_AXES)

    @property
    def stage_c(self) -> int:
        return prod(self.f("c")[1:])

    @property
    def stage_kh(self) -> int:
        return prod(self.f("kh")[1:])

    @property
    def stage_kw(self) -> int:
        return prod(self.f("kw")[1:])

    @property
    def stages(self) -> int:
        return self.f("c")[0] * self.f("kh")[0] * self.f("kw")[0]

    @property
    def patch(self) -> tuple[int, int]:
        s = self.spec
        return input_window(s, self.block_tile("oh"), self.block_tile("ow"), self.stage_kh, self.stage_kw)

    @cached_property
    def padding(self) -> tuple[int, int, int, int]:
        """(patch row pad, patch plane pad, weight skew, weight channel pad) that the bank model reads
        fastest with (kernels.cuda_banks), among those that keep the blocks an SM holds at once."""
        cap = min(SM_MAX_BLOCKS, SM_MAX_THREADS // (-(-self.threads // 32) * 32))

        def per_sm(pad: tuple[int, ...]) -> int:
            floats = self._padded_smem_floats(*pad)
            return min(cap, SM_SHARED_BYTES // (4 * floats + 1024)) if 4 * floats <= GPU_MAX_SMEM_BYTES else 0

        least = per_sm((0, 0, 0, 0))
        return cuda_banks.choose(self, lambda *pad: not any(pad) or per_sm(pad) >= max(least, 1))

    def _padded_smem_floats(self, row_pad: int, plane_pad: int, skew: int, channel_pad: int) -> int:
        """Shared memory of one block (floats) with this padding; all zeros: the sketch's layout."""
        plane = cuda_banks.plane_of(self, self.patch[1] + row_pad, plane_pad)
        return self._smem_floats(plane, cuda_banks.weight_channel(self, skew, channel_pad))

    @property
    def row_pitch(self) -> int:
        """Shared-memory stride between the rows of the staged input patch."""
        return self.patch[1] + self.padding[0]

    @property
    def plane(self) -> int:
        """Shared-memory stride between channels of the patch (odd for NHWC, see cuda_banks)."""
        return cuda_banks.plane_of(self, self.row_pitch, self.padding[1])

    @property
    def weight_skew(self) -> int:
        return self.padding[2]

    @property
    def weight_row(self) -> int:
        """Shared-memory stride of the k axis rows of the weight tile (skewed)."""
        return cuda_banks.skewed_row(self.block_tile("k"), self.weight_skew)

    @property
    def weight_channel(self) -> int:
        """Shared-memory stride between the channels of the weight tile (padded)."""
        return cuda_banks.weight_channel(self, self.weight_skew, self.padding[3])

    @property
    def buffers(self) -> int:
        """Shared-memory stages in flight: 2 is the double buffering of the paper; 3-4 hide
        more load latency when a stage's compute is short."""
        return int(self.schedule.option.get("buffers", 2))

    @property
    def weight_flat(self) -> bool:
        """A stage's weights are one contiguous, 16-byte aligned run in global and shared memory
        (blocked packing, whole window per stage, one group per block): copied 16 bytes at a time."""
        return (self.schedule.weight_packing == "blocked" and self.f("kh")[0] == 1
                and self.f("kw")[0] == 1 and self.block_tile("g") == 1 and self.block_tile("k") % 4 == 0)

    @property
    def vec_store(self) -> int:
        """Outputs one thread stores with one instruction (4 when its contiguous run along the
        layout's innermost axis, ow for NCHW or k for NHWC, is a multiple of 4 and aligned)."""
        s, nhwc = self.spec, self.schedule.layout == "NHWC"
        axis, inner = ("k", s.k) if nhwc else ("ow", s.out_w)
        f = self.f(axis)
        if self.stage_out or f[4] % 4 or inner % 4:
            return 1
        if nhwc and s.k_per_group % 4:
            return 1
        return 4

    @property
    def input_stage_floats(self) -> int:
        return self._input_stage_floats(self.plane)

    @property
    def weight_stage_floats(self) -> int:
        return self._weight_stage_floats(self.weight_channel)

    def _input_stage_floats(self, plane: int) -> int:
        return _round4(self.block_tile("n") * self.block_tile("g") * self.stage_c * plane)

    def _weight_stage_floats(self, weight_channel: int) -> int:
        return _round4(self.block_tile("g") * self.stage_c * weight_channel)

    def _smem_floats(self, plane: int, weight_channel: int) -> int:
        main = self.buffers * (self._input_stage_floats(plane) + self._weight_stage_floats(weight_channel))
        return max(main, self.split_c * self.block_outputs if self.stage_out else 0)

    @property
    def input_stage_elems(self) -> int:
        ph, pw = self.patch
        return self.block_tile("n") * self.block_tile("g") * self.stage_c * ph * pw

    @property
    def stage_floats(self) -> int:
        return self.input_stage_floats + self.weight_stage_floats

    @property
    def smem_floats(self) -> int:
        return self._padded_smem_floats(*self.padding)

    @property
    def smem_bytes(self) -> int:
        return 4 * self.smem_floats

    @property
    def packed_weight_shape(self) -> tuple[int, ...]:
        """Weights as the kernel reads them: blocked [G][Kg/Bk][Cg][kh][kw][Bk] or torch's (K, Cg, kh, kw)."""
        s = self.spec
        if self.schedule.weight_packing == "blocked":
            bk = self.block_tile("k")
            return (s.groups, s.k_per_group // bk, s.c_per_group, s.kh, s.kw, bk)
        return s.weight_shape

    # -- validity ------------------------------------------------------------
    def problems(self) -> list[str]:
        out = self.schedule.problems(self.spec)
        if out:
            return out
        if self.schedule.kind != "cuda":
            return [f"the CUDA backend needs a 'cuda' schedule, got kind {self.schedule.kind!r}"]
        extra = self.schedule.option
        unknown = set(extra) - {"split_c", "stage_out", "buffers"}
        if unknown:
            out.append(f"unknown CUDA schedule knob(s) {sorted(unknown)}; known: split_c, stage_out, buffers")
        if extra.get("buffers", 2) not in (2, 3, 4):
            out.append(f"buffers must be 2, 3 or 4, got {extra.get('buffers')!r}")
        s = self.split_c
        if not isinstance(extra.get("split_c", 1), int) or s < 1 or self.f("c")[1] % s:
            out.append(f"split_c {extra.get('split_c')!r} must be a positive int dividing the "
                       f"c1 factor {self.f('c')[1]}")
        if s > 1 and not self.stage_out:
            out.append(f"split_c {s} needs stage_out (the thread groups' partial sums meet in shared memory)")
        if self.threads > GPU_MAX_THREADS:
            out.append(f"{self.threads} threads per block exceed {GPU_MAX_THREADS}")
        if self.accumulators > GPU_MAX_ACCUMULATORS:
            out.append(f"register tile of {self.accumulators} outputs per thread exceeds {GPU_MAX_ACCUMULATORS}")
        unpadded = 4 * self._padded_smem_floats(0, 0, 0, 0)
        if unpadded > GPU_MAX_SMEM_BYTES:  # the padding never takes a block past the limit
            out.append(f"shared memory {unpadded} B per block exceeds {GPU_MAX_SMEM_BYTES} B")
        if self.blocks > INT32_MAX:
            out.append(f"{self.blocks} blocks exceed the grid limit")
        sp = self.spec
        for what, elems in (("input", sp.input_elems), ("output", sp.output_elems),
                            ("weight", sp.weight_elems)):
            if elems > INT32_MAX:
                out.append(f"{what} of {elems} elements exceeds 32-bit indexing")
        return out

    def validate(self) -> "CudaPlan":
        problems = self.problems()
        if problems:
            raise MacoError(f"invalid CUDA schedule for {self.spec}: " + "; ".join(problems))
        return self

    # -- source --------------------------------------------------------------
    def constants(self) -> str:
        self.validate()  # every source starts here: only a checked schedule reaches the text
        sp, sc = self.spec, self.schedule
        ph, pw = self.patch
        lines = [comment(f"{sp}  layout {sc.layout}  bias={int(self.bias)} relu={int(self.relu)} "
                         f"residual={int(self.residual)}"),
                 comment(f"schedule {sc.describe()}")]
        d = dict(N=sp.n, C=sp.c, H=sp.h, W=sp.w, K=sp.k, KH=sp.kh, KW=sp.kw, SH=sp.stride[0],
                 SW=sp.stride[1], PADH=sp.padding[0], PADW=sp.padding[1], DH=sp.dilation[0],
                 DW=sp.dilation[1], G=sp.groups, CG=sp.c_per_group, KG=sp.k_per_group,
                 OH=sp.out_h, OW=sp.out_w, NHWC=int(sc.layout == "NHWC"),
                 BLOCKED=int(sc.weight_packing == "blocked"), HAS_BIAS=int(self.bias),
                 HAS_RELU=int(self.relu), HAS_RES=int(self.residual), SPLIT=self.split_c,
                 STAGE_OUT=int(self.stage_out), NT=self.threads, NTS=self.spatial_threads,
                 CC=self.stage_c, KHC=self.stage_kh, KWC=self.stage_kw, PH=ph, PW=pw,
                 PWP=self.row_pitch, PLANE=self.plane, WROW=self.weight_row, WCH=self.weight_channel,
                 WSKEW=self.weight_skew, IN_ELEMS=self.input_stage_elems,
                 IN_STAGE=self.input_stage_floats, W_STAGE=self.weight_stage_floats,
                 STAGE=self.stage_floats, NSTAGES=self.stages, NACC=self.accumulators,
                 TB=self.block_outputs, NBUF=self.buffers, W_FLAT=int(self.weight_flat),
                 VEC=self.vec_store)
        for axis in SPATIAL_AXES:
            tag = axis.upper()
            for lvl, v in enumerate(self.f(axis)):
                d[f"F{lvl}_{tag}"] = v
            d[f"B_{tag}"] = self.block_tile(axis)
            d[f"R_{tag}"] = self.reg_tile(axis)
        for axis in REDUCTION_AXES:
            for lvl, v in enumerate(self.f(axis)):
                d[f"{axis.upper()}{lvl}"] = v
        d["W_ELEMS"] = d["B_G"] * self.stage_c * self.stage_kh * self.stage_kw * d["B_K"]
        lines += [f"#define {k} {v}" for k, v in d.items()]
        return "\n".join(lines) + "\n"

    def _r1_loops(self) -> tuple[str, str]:
        """Nested R1 loops over (c1, kh1, kw1) in the schedule's inner_order, with unroll pragmas."""
        sc = self.schedule
        ext = {"c": f"{self.f('c')[1] // self.split_c}", "kh": "KH1", "kw": "KW1"}
        ext_val = {"c": self.f("c")[1] // self.split_c, "kh": self.f("kh")[1], "kw": self.f("kw")[1]}
        inner_steps = prod(self.f(a)[2] for a in REDUCTION_AXES)
        open_, close = [], []
        budget = sc.unroll // max(inner_steps, 1)  # Ansor-style max unroll step, in R2 bodies
        for axis in sc.inner_order:
            unroll = 1
            if budget >= 2 and ext_val[axis] > 1:
                unroll = min(ext_val[axis], budget)
                budget //= unroll
            pragma = "#pragma unroll" if unroll >= ext_val[axis] else f"#pragma unroll {unroll}"
            open_.append(f"{pragma}\n    for (int {axis}1 = 0; {axis}1 < {ext[axis]}; ++{axis}1) {{")
            close.append("}")
        return "\n    ".join(open_), "".join(close)

    def body(self) -> str:
        r1_open, r1_close = self._r1_loops()
        return _BODY.replace("$R1_OPEN", r1_open).replace("$R1_CLOSE", r1_close)

    def unit(self, name: str = KERNEL_NAME) -> str:
        """This kernel's part of a translation unit: its constants, its helpers in a namespace of
        their own, the kernel `name`, then every macro undefined, so that units concatenate."""
        defines = [ln.split()[1] for ln in self.constants().splitlines() if ln.startswith("#define")]
        return (self.constants() + f"namespace ns_{name} {{\n" + self.body()
                + _KERNEL.replace("maco_conv(", f"{name}(") + "}\n"
                + "".join(f"#undef {d}\n" for d in defines + ["LOC", "WSK"]))

    def source(self) -> str:
        """The CUDA C translation unit (one extern "C" kernel named maco_conv)."""
        return _PRELUDE_DEVICE + self.unit()

    def host_emulation_source(self) -> str:
        """The same device code compiled as host C++ with a sequential block/thread driver."""
        return _PRELUDE_HOST + self.constants() + self.body() + _HOST_DRIVER

    @property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source().encode()).hexdigest()[:20]


def pack_weight(plan: CudaPlan, weight: Any, xp: Any = None) -> Any:
    """Torch-layout weights (K, Cg, kh, kw) to the layout the kernel reads (any array module)."""
    if xp is None:
        import numpy as xp
    s = plan.spec
    if tuple(weight.shape) != s.weight_shape:
        raise MacoError(f"weight has shape {tuple(weight.shape)}, expected {s.weight_shape} for {s}")
    if plan.schedule.weight_packing != "blocked":
        return xp.ascontiguousarray(weight)
    g, kb, cg, kh, kw, bk = plan.packed_weight_shape
    return xp.ascontiguousarray(weight.reshape(g, kb, bk, cg, kh, kw).transpose(0, 1, 3, 4, 5, 2))


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def batch_source(plans: list[CudaPlan], names: list[str]) -> str:
    """Many kernels in one translation unit (one nvcc call compiles them all)."""
    return _PRELUDE_DEVICE + "".join(p.unit(n) for p, n in zip(plans, names))


def plan(spec: ConvSpec, schedule: Schedule, *, bias: bool = False, relu: bool = False,
         residual: bool = False) -> CudaPlan:
    """A validated plan (raises MacoError naming what is wrong with the schedule)."""
    return CudaPlan(spec, schedule, bias, relu, residual).validate()


# ---------------------------------------------------------------------------------------------
# Source text. Macros keep one body for the device and the host emulation.

_PRELUDE_DEVICE = r"""
#define DEV __device__ __forceinline__
#define RESTRICT __restrict__
#if __CUDA_ARCH__ >= 800
DEV void cp_async4(float* dst, const float* src, bool ok) {
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(s), "l"(src), "r"(ok ? 4 : 0));
}
DEV void cp_async16(float* dst, const float* src) {
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src));
}
DEV void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> DEV void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
#else
DEV void cp_async4(float* dst, const float* src, bool ok) { *dst = ok ? __ldg(src) : 0.0f; }
DEV void cp_async16(float* dst, const float* src) { *(float4*)dst = __ldg((const float4*)src); }
DEV void cp_commit() {}
template <int N> DEV void cp_wait() {}
#endif
"""

_PRELUDE_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define DEV static inline
#define RESTRICT
static inline void cp_async4(float* dst, const float* src, bool ok) { *dst = ok ? *src : 0.0f; }
static inline void cp_async16(float* dst, const float* src) { for (int i = 0; i < 4; ++i) dst[i] = src[i]; }
struct float4 { float x, y, z, w; };
"""

_BODY = r"""
// local index of register r of a thread t along an axis with factors f1 f2 f3 f4
#define LOC(r, t, F2, F3, F4) ((((r) / ((F3) * (F4))) * (F2) + (t)) * ((F3) * (F4)) + (r) % ((F3) * (F4)))
// where element kl of a weight row sits in shared memory: WSKEW floats after every 32 (cuda_banks)
#define WSK(kl) ((kl) + WSKEW * ((kl) / 32))

struct Coord { int n, g, k, h, w; };

// Thread coordinates inside the block: NCHW puts ow fastest (coalesced rows), NHWC k fastest.
DEV Coord thread_coord(int t) {
  Coord c;
#if NHWC
  c.k = t % F2_K; t /= F2_K; c.w = t % F2_OW; t /= F2_OW; c.h = t % F2_OH; t /= F2_OH;
#else
  c.w = t % F2_OW; t /= F2_OW; c.h = t % F2_OH; t /= F2_OH; c.k = t % F2_K; t /= F2_K;
#endif
  c.g = t % F2_G; c.n = t / F2_G;
  return c;
}

// Block coordinates (in block tiles): ow fastest, so co-resident blocks share filters.
DEV Coord block_coord(int b) {
  Coord c;
  c.w = b % F0_OW; b /= F0_OW; c.h = b % F0_OH; b /= F0_OH; c.k = b % F0_K; b /= F0_K;
  c.g = b % F0_G; c.n = b / F0_G;
  return c;
}

// Copy stage st (c0, kh0, kw0) of the block's input patch and weights into shared memory.
DEV void load_stage(const float* RESTRICT x, const float* RESTRICT w, float* sI, float* sW,
                    int st, int tid, Coord b) {
  const int c0 = st / (KH0 * KW0), h0 = (st / KW0) % KH0, w0 = st % KW0;
  const int ih0 = b.h * B_OH * SH - PADH + h0 * KHC * DH;
  const int iw0 = b.w * B_OW * SW - PADW + w0 * KWC * DW;
  for (int e = tid; e < IN_ELEMS; e += NT) {
    int t = e;
#if NHWC
    const int cl = t % CC; t /= CC; const int gl = t % B_G; t /= B_G;
    const int pw = t % PW; t /= PW; const int ph = t % PH; const int nl = t / PH;
#else
    const int pw = t % PW; t /= PW; const int ph = t % PH; t /= PH;
    const int cl = t % CC; t /= CC; const int gl = t % B_G; const int nl = t / B_G;
#endif
    const int n = b.n * B_N + nl, ch = (b.g * B_G + gl) * CG + c0 * CC + cl;
    const int ih = ih0 + ph, iw = iw0 + pw;
    const bool ok = (unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W;
#if NHWC
    const long src = ((long)(n * H + ih) * W + iw) * C + ch;
#else
    const long src = ((long)(n * C + ch) * H + ih) * W + iw;
#endif
    cp_async4(sI + ((nl * B_G + gl) * CC + cl) * PLANE + ph * PWP + pw, x + (ok ? src : 0), ok);
  }
#if W_FLAT
  {  // the stage's weights: one contiguous run [CC][KH][KW][B_K] of the blocked packing
    const float* src = w + ((long)(b.g * F0_K + b.k) * CG + c0 * CC) * (KH * KW * B_K);
    for (int e = tid * 4; e < W_ELEMS; e += NT * 4) {
      const int row = e / B_K;  // (channel, kh, kw) of the stage
      cp_async16(sW + (row / (KH * KW)) * WCH + (row % (KH * KW)) * WROW + WSK(e % B_K), src + e);
    }
  }
#else
  for (int e = tid; e < W_ELEMS; e += NT) {
    int t = e;
#if BLOCKED
    const int kl = t % B_K; t /= B_K; const int s = t % KWC; t /= KWC;
    const int r = t % KHC; t /= KHC; const int cl = t % CC; const int gl = t / CC;
    const int g = b.g * B_G + gl;
    const long src = ((((long)(g * F0_K + b.k) * CG + c0 * CC + cl) * KH + h0 * KHC + r) * KW
                      + w0 * KWC + s) * B_K + kl;
#else
    const int s = t % KWC; t /= KWC; const int r = t % KHC; t /= KHC;
    const int cl = t % CC; t /= CC; const int kl = t % B_K; const int gl = t / B_K;
    const int g = b.g * B_G + gl;
    const long src = (((long)(g * KG + b.k * B_K + kl) * CG + c0 * CC + cl) * KH + h0 * KHC + r) * KW
                     + w0 * KWC + s;
#endif
    cp_async4(sW + (gl * CC + cl) * WCH + (r * KWC + s) * WROW + WSK(kl), w + src, true);
  }
#endif
}

// One stage of the reduction: the R1 loops, the R2 loops unrolled around the register outer product.
DEV void compute_stage(const float* RESTRICT sI, const float* RESTRICT sW, float* acc, Coord t, int grp) {
  $R1_OPEN
#pragma unroll
    for (int c2 = 0; c2 < C2; ++c2) {
#pragma unroll
    for (int kh2 = 0; kh2 < KH2; ++kh2) {
#pragma unroll
    for (int kw2 = 0; kw2 < KW2; ++kw2) {
      const int c = (grp * (C1 / SPLIT) + c1) * C2 + c2, r = kh1 * KH2 + kh2, s = kw1 * KW2 + kw2;
      float wr[R_G * R_K];
      float xr[R_N * R_G * R_OH * R_OW];
#pragma unroll
      for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
        for (int ik = 0; ik < R_K; ++ik)
          wr[ig * R_K + ik] = sW[(LOC(ig, t.g, F2_G, F3_G, F4_G) * CC + c) * WCH + (r * KWC + s) * WROW
                                 + WSK(LOC(ik, t.k, F2_K, F3_K, F4_K))];
#pragma unroll
      for (int in = 0; in < R_N; ++in)
#pragma unroll
        for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
          for (int ih = 0; ih < R_OH; ++ih)
#pragma unroll
            for (int iw = 0; iw < R_OW; ++iw)
              xr[((in * R_G + ig) * R_OH + ih) * R_OW + iw] =
                  sI[((LOC(in, t.n, F2_N, F3_N, F4_N) * B_G + LOC(ig, t.g, F2_G, F3_G, F4_G)) * CC + c) * PLANE
                     + (LOC(ih, t.h, F2_OH, F3_OH, F4_OH) * SH + r * DH) * PWP
                     + LOC(iw, t.w, F2_OW, F3_OW, F4_OW) * SW + s * DW];
#pragma unroll
      for (int in = 0; in < R_N; ++in)
#pragma unroll
        for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
          for (int ik = 0; ik < R_K; ++ik)
#pragma unroll
            for (int ih = 0; ih < R_OH; ++ih)
#pragma unroll
              for (int iw = 0; iw < R_OW; ++iw)
                acc[(((in * R_G + ig) * R_K + ik) * R_OH + ih) * R_OW + iw] +=
                    xr[((in * R_G + ig) * R_OH + ih) * R_OW + iw] * wr[ig * R_K + ik];
    }}}
  $R1_CLOSE
}

// Global index of output (n, g, k, oh, ow) in the layout.
DEV long out_index(int n, int g, int k, int oh, int ow) {
#if NHWC
  return ((long)(n * OH + oh) * OW + ow) * K + g * KG + k;
#else
  return ((long)(n * K + g * KG + k) * OH + oh) * OW + ow;
#endif
}

DEV void store_one(float v, int n, int g, int k, int oh, int ow, const float* RESTRICT bias,
                   const float* RESTRICT res, float* RESTRICT y) {
  const long o = out_index(n, g, k, oh, ow);
#if HAS_BIAS
  v += bias[g * KG + k];
#endif
#if HAS_RES
  v += res[o];
#endif
#if HAS_RELU
  v = v < 0.0f ? 0.0f : v;  // keeps NaN, as torch.relu does
#endif
  y[o] = v;
}

// Block-local linear index of an output in the layout's order (for staged stores).
DEV int tile_index(int nl, int gl, int kl, int hl, int wl) {
#if NHWC
  return (((nl * B_OH + hl) * B_OW + wl) * B_G + gl) * B_K + kl;
#else
  return (((nl * B_G + gl) * B_K + kl) * B_OH + hl) * B_OW + wl;
#endif
}

// Epilogue straight from registers; VEC outputs contiguous in memory go out in one store.
DEV void epilogue_direct(const float* acc, Coord t, Coord b, const float* RESTRICT bias,
                         const float* RESTRICT res, float* RESTRICT y) {
#if VEC == 4
#pragma unroll
  for (int in = 0; in < R_N; ++in)
#pragma unroll
  for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
  for (int ik = 0; ik < R_K; ik += (NHWC ? 4 : 1))
#pragma unroll
  for (int ih = 0; ih < R_OH; ++ih)
#pragma unroll
  for (int iw = 0; iw < R_OW; iw += (NHWC ? 1 : 4)) {
    const int n = b.n * B_N + LOC(in, t.n, F2_N, F3_N, F4_N), g = b.g * B_G + LOC(ig, t.g, F2_G, F3_G, F4_G);
    const int k = b.k * B_K + LOC(ik, t.k, F2_K, F3_K, F4_K), oh = b.h * B_OH + LOC(ih, t.h, F2_OH, F3_OH, F4_OH);
    const int ow = b.w * B_OW + LOC(iw, t.w, F2_OW, F3_OW, F4_OW);
    const long o = out_index(n, g, k, oh, ow);
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = acc[(((in * R_G + ig) * R_K + ik + (NHWC ? j : 0)) * R_OH + ih) * R_OW + iw + (NHWC ? 0 : j)];
#if HAS_BIAS
      v[j] += bias[g * KG + k + (NHWC ? j : 0)];
#endif
    }
#if HAS_RES
    const float4 r = *(const float4*)(res + o);
    v[0] += r.x; v[1] += r.y; v[2] += r.z; v[3] += r.w;
#endif
#if HAS_RELU
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = v[j] < 0.0f ? 0.0f : v[j];
#endif
    float4 q; q.x = v[0]; q.y = v[1]; q.z = v[2]; q.w = v[3];
    *(float4*)(y + o) = q;
  }
#else
#pragma unroll
  for (int in = 0; in < R_N; ++in)
#pragma unroll
  for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
  for (int ik = 0; ik < R_K; ++ik)
#pragma unroll
  for (int ih = 0; ih < R_OH; ++ih)
#pragma unroll
  for (int iw = 0; iw < R_OW; ++iw)
    store_one(acc[(((in * R_G + ig) * R_K + ik) * R_OH + ih) * R_OW + iw],
              b.n * B_N + LOC(in, t.n, F2_N, F3_N, F4_N), b.g * B_G + LOC(ig, t.g, F2_G, F3_G, F4_G),
              b.k * B_K + LOC(ik, t.k, F2_K, F3_K, F4_K), b.h * B_OH + LOC(ih, t.h, F2_OH, F3_OH, F4_OH),
              b.w * B_OW + LOC(iw, t.w, F2_OW, F3_OW, F4_OW), bias, res, y);
#endif
}

// Staged epilogue, first half: each thread group parks its partial sums in shared memory.
DEV void epilogue_park(const float* acc, Coord t, int grp, float* red) {
#pragma unroll
  for (int in = 0; in < R_N; ++in)
#pragma unroll
  for (int ig = 0; ig < R_G; ++ig)
#pragma unroll
  for (int ik = 0; ik < R_K; ++ik)
#pragma unroll
  for (int ih = 0; ih < R_OH; ++ih)
#pragma unroll
  for (int iw = 0; iw < R_OW; ++iw)
    red[grp * TB + tile_index(LOC(in, t.n, F2_N, F3_N, F4_N), LOC(ig, t.g, F2_G, F3_G, F4_G),
                              LOC(ik, t.k, F2_K, F3_K, F4_K), LOC(ih, t.h, F2_OH, F3_OH, F4_OH),
                              LOC(iw, t.w, F2_OW, F3_OW, F4_OW))]
        = acc[(((in * R_G + ig) * R_K + ik) * R_OH + ih) * R_OW + iw];
}

// Staged epilogue, second half: sum the groups' partials, store in layout order (coalesced).
DEV void epilogue_flush(int tid, Coord b, const float* red, const float* RESTRICT bias,
                        const float* RESTRICT res, float* RESTRICT y) {
  for (int e = tid; e < TB; e += NT) {
    float v = red[e];
#pragma unroll
    for (int j = 1; j < SPLIT; ++j) v += red[j * TB + e];
    int t = e;
#if NHWC
    const int kl = t % B_K; t /= B_K; const int gl = t % B_G; t /= B_G;
    const int wl = t % B_OW; t /= B_OW; const int hl = t % B_OH; const int nl = t / B_OH;
#else
    const int wl = t % B_OW; t /= B_OW; const int hl = t % B_OH; t /= B_OH;
    const int kl = t % B_K; t /= B_K; const int gl = t % B_G; const int nl = t / B_G;
#endif
    store_one(v, b.n * B_N + nl, b.g * B_G + gl, b.k * B_K + kl, b.h * B_OH + hl, b.w * B_OW + wl,
              bias, res, y);
  }
}
"""

_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(NT)
maco_conv(const float* RESTRICT x, const float* RESTRICT w, const float* RESTRICT bias,
          const float* RESTRICT res, float* RESTRICT y) {
  extern __shared__ __align__(16) float smem[];
  const int tid = threadIdx.x;
  const int grp = tid / NTS;
  const Coord t = thread_coord(tid % NTS);
  const Coord b = block_coord(blockIdx.x);
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int s = 0; s < NBUF - 1; ++s) {  // prologue: the first NBUF-1 stages in flight
    if (s < NSTAGES) load_stage(x, w, smem + s * STAGE, smem + s * STAGE + IN_STAGE, s, tid, b);
    cp_commit();
  }
  for (int st = 0; st < NSTAGES; ++st) {
    float* cur = smem + (st % NBUF) * STAGE;
    if (st + NBUF - 1 < NSTAGES) {
      float* nxt = smem + ((st + NBUF - 1) % NBUF) * STAGE;
      load_stage(x, w, nxt, nxt + IN_STAGE, st + NBUF - 1, tid, b);
    }
    cp_commit();  // possibly empty: keeps one group per stage, so the wait below is exact
    cp_wait<NBUF - 1>();
    __syncthreads();
    compute_stage(cur, cur + IN_STAGE, acc, t, grp);
    __syncthreads();
  }
#if STAGE_OUT
  epilogue_park(acc, t, grp, smem);
  __syncthreads();
  epilogue_flush(tid, b, smem, bias, res, y);
#else
  epilogue_direct(acc, t, b, bias, res, y);
#endif
}
"""

_HOST_DRIVER = r"""
// Sequential emulation: per block, each phase between two barriers runs for every thread in turn.
int main(int argc, char** argv) {
  if (argc != 5) { fprintf(stderr, "usage: x w bias res (raw fp32 files, - for none); y goes to stdout\n"); return 2; }
  auto load = [](const char* path, long n) {
    std::vector<float> v(n > 0 ? n : 1, 0.0f);
    if (strcmp(path, "-") != 0) {
      FILE* f = fopen(path, "rb");
      if (!f || fread(v.data(), 4, n, f) != (size_t)n) { fprintf(stderr, "cannot read %s\n", path); exit(3); }
      fclose(f);
    }
    return v;
  };
  const long xe = (long)N * C * H * W, oe = (long)N * K * OH * OW;
  const long we = (long)K * CG * KH * KW;
  std::vector<float> x = load(argv[1], xe), w = load(argv[2], we), bias = load(argv[3], K),
                     res = load(argv[4], HAS_RES ? oe : 0);
  std::vector<float> y(oe, __builtin_nanf(""));
  const int smem_floats = (NBUF * STAGE > SPLIT * TB * STAGE_OUT) ? NBUF * STAGE : SPLIT * TB;
  std::vector<float> smem(smem_floats);
  std::vector<float> acc((size_t)NT * NACC);
  const int nblocks = F0_N * F0_G * F0_K * F0_OH * F0_OW;
  for (int blk = 0; blk < nblocks; ++blk) {
    const Coord b = block_coord(blk);
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(smem.begin(), smem.end(), __builtin_nanf(""));
    for (int s = 0; s < NBUF - 1 && s < NSTAGES; ++s)
      for (int tid = 0; tid < NT; ++tid)
        load_stage(x.data(), w.data(), smem.data() + s * STAGE, smem.data() + s * STAGE + IN_STAGE, s, tid, b);
    for (int st = 0; st < NSTAGES; ++st) {
      float* cur = smem.data() + (st % NBUF) * STAGE;
      float* nxt = smem.data() + ((st + NBUF - 1) % NBUF) * STAGE;
      if (st + NBUF - 1 < NSTAGES)
        for (int tid = 0; tid < NT; ++tid) load_stage(x.data(), w.data(), nxt, nxt + IN_STAGE, st + NBUF - 1, tid, b);
      for (int tid = 0; tid < NT; ++tid)
        compute_stage(cur, cur + IN_STAGE, &acc[(size_t)tid * NACC], thread_coord(tid % NTS), tid / NTS);
    }
    for (int tid = 0; tid < NT; ++tid) {
#if STAGE_OUT
      epilogue_park(&acc[(size_t)tid * NACC], thread_coord(tid % NTS), tid / NTS, smem.data());
#else
      epilogue_direct(&acc[(size_t)tid * NACC], thread_coord(tid % NTS), b, bias.data(), res.data(), y.data());
#endif
    }
#if STAGE_OUT
    for (int tid = 0; tid < NT; ++tid) epilogue_flush(tid, b, smem.data(), bias.data(), res.data(), y.data());
#endif
  }
  fwrite(y.data(), 4, oe, stdout);
  return 0;
}
"""
