"""C source of one CPU convolution kernel for a Schedule of the "SSRSRS" sketch.

Loop nest (every bound a compile-time constant):

    S0 (the first `parallel` axes fused into one OpenMP loop)  S1  R0  S2  | R1  S3

The part after `|` is the micro-kernel: the S3 register tile stays in accumulators for its
whole R1 reduction (MACO's alpha = 1); between R0 steps the partial sums live in the output
(initialised on the first step, epilogue bias + residual + activation on the last).

Every operand is addressed as base + sum(index * stride), so one micro-kernel body serves two
call sites: interior tiles read the input tensor directly, border tiles (padding) first copy
their input patch, zero-filled, into a small per-thread buffer and read that. There is no
padded copy of the whole input.

Micro-kernel flavours, all from the same accumulator list:
  * intrinsics (AVX-512 __m512 / AVX2 __m256 with FMA) when the vector axis is k with blocked
    weights (weight vector load, input broadcast) or ow with a unit-stride input row (input
    vector load, weight broadcast); on an AVX-512 CPU a schedule of 8-lane vectors (24 or 40
    filters: no whole number of 16) runs AVX2's;
  * portable C (per-accumulator float arrays, `#pragma omp simd` over the lanes) otherwise:
    any vector axis, width 1, weight packing "none", isa "generic".
The intrinsics flavours prefetch blocked weights WEIGHT_PREFETCH_AHEAD floats ahead of the stream.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from itertools import product
from math import prod

import numpy as np

from maco.core.errors import MacoError
from maco.kernels.aligned import LINE_FLOATS, aligned_copy
from maco.core.geometry import input_window
from maco.kernels.epilogue import ACTIVATIONS, SMOOTH, VACT_WAYS, scalar_function, vector_function
from maco.kernels.source_text import comment
from maco.core.axes import REDUCTION_AXES, SPATIAL_AXES
from maco.core.schedule import Schedule
from maco.core.sketch_cpu import vector_widths
from maco.core.spec import ConvSpec
from maco.core.target import Target

FUNCTION = "maco_conv"
# Unrolled statements the portable micro-kernel may hold: past a few hundred, gcc's alias
# analysis over the accumulator arrays goes superlinear (a 7x7 stem tile took 30-100 s to build).
PORTABLE_UNROLLED_BODY = 256
# and the intrinsics one: fully unrolled 144-step reductions (unroll 512) of 28 or 14 accumulators
# (4032 / 2016 FMAs) took gcc 45-160 s where an S2 border patch feeds the micro-kernel, past the
# tuner's 30 s build limit; bodies of up to 1024 FMAs build in 1-3 s
INTRINSICS_UNROLLED_BODY = 1024
MAX_PATCH_SLOTS = 16  # R0 steps up to which border patches may hold S2 windows (CpuPlan.patch_level)
# How far ahead (floats) the intrinsics micro-kernel prefetches its blocked weights, which it
# reads as one contiguous stream: inside a model a layer's weights come from memory (the model's
# outgrow the caches), and the hardware prefetchers alone leave the loop waiting on them.
WEIGHT_PREFETCH_AHEAD = 1024

# isa -> (vector type, lanes, setzero, loadu, broadcast(ptr), fma(a, b, acc), storeu, max, add)
ISA = {
    "avx512": ("__m512", 16, "_mm512_setzero_ps()", "_mm512_loadu_ps", "_mm512_set1_ps",
               "_mm512_fmadd_ps", "_mm512_storeu_ps", "_mm512_max_ps", "_mm512_add_ps"),
    "avx2": ("__m256", 8, "_mm256_setzero_ps()", "_mm256_loadu_ps", "_mm256_set1_ps",
             "_mm256_fmadd_ps", "_mm256_storeu_ps", "_mm256_max_ps", "_mm256_add_ps"),
}

VMIN = {"avx512": "_mm512_min_ps", "avx2": "_mm256_min_ps"}


def _expr(terms: list[tuple[int, str]]) -> str:
    """'3*sN + sC' from [(3, 'sN'), (1, 'sC'), (0, 'sH')]; '0' when empty."""
    parts = []
    for coef, name in terms:
        if coef == 0:
            continue
        parts.append(name if coef == 1 else f"{coef}*{name}" if name else str(coef))
    return " + ".join(parts) if parts else "0"


def intrinsics_isa(spec: ConvSpec, schedule: Schedule, target: Target) -> str | None:
    """The ISA whose intrinsics the micro-kernel uses, or None for portable C: the target's
    vectors (or, on an AVX-512 CPU, AVX2's half-width ones: sketch_cpu.vector_widths) along k
    over blocked weights, or along ow of an NCHW input read at stride 1."""
    if target.isa not in ISA or schedule.vector_width not in vector_widths(target):
        return None
    isa = next((name for name, entry in ISA.items() if entry[1] == schedule.vector_width), None)
    if isa is None:
        return None
    if schedule.vector_axis == "k" and schedule.weight_packing == "blocked":
        return isa
    if schedule.vector_axis == "ow" and schedule.layout == "NCHW" and spec.stride[1] == 1:
        return isa
    return None


@dataclass(frozen=True)
class CpuPlan:
    """Everything the generator derives from (spec, schedule, target, epilogue)."""

    spec: ConvSpec
    schedule: Schedule
    target: Target
    bias: bool = False
    activation: str = "none"  # one of kernels.epilogue.ACTIVATIONS, after bias and residual
    residual: bool = False
    # the layout the input is read in, where it differs from the schedule's (the output's): an NHWC
    # conv reading the model's NCHW input itself, with no conversion before it
    input_layout: str | None = None

    def __post_init__(self) -> None:
        if self.input_layout not in (None, "NCHW", "NHWC"):
            raise MacoError(f"input_layout must be 'NCHW' or 'NHWC', got {self.input_layout!r}")
        if self.activation not in ACTIVATIONS:
            raise MacoError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if self.schedule.kind != "cpu":
            raise MacoError(f"the CPU backend needs a cpu schedule, got kind {self.schedule.kind!r}")
        problems = self.schedule.problems(self.spec, self.target)
        if problems:
            raise MacoError(f"invalid schedule for {self.spec}: " + "; ".join(problems))

    # -- derived sizes ------------------------------------------------------------------
    @property
    def nhwc(self) -> bool:
        return self.schedule.layout == "NHWC"

    @property
    def reads(self) -> str:
        """The layout the input is read in."""
        return self.input_layout or self.schedule.layout

    @property
    def input_nhwc(self) -> bool:
        return self.reads == "NHWC"

    @cached_property
    def f(self) -> dict[str, tuple[int, ...]]:
        s = self.schedule
        return {a: s.factors(a) for a in SPATIAL_AXES + REDUCTION_AXES}

    def tile(self, axis: str, level: int) -> int:
        return prod(self.f[axis][level:])

    @property
    def lanes(self) -> int:
        return self.schedule.vector_width

    @property
    def vaxis(self) -> str:
        return self.schedule.vector_axis

    @cached_property
    def in_strides(self) -> dict[str, int]:
        s = self.spec
        if self.input_nhwc:
            st = {"n": s.h * s.w * s.c, "c": 1, "h": s.w * s.c, "w": s.c}
        else:
            st = {"n": s.c * s.h * s.w, "c": s.h * s.w, "h": s.w, "w": 1}
        st["g"] = s.c_per_group * st["c"]
        return st

    @cached_property
    def out_strides(self) -> dict[str, int]:
        s = self.spec
        if self.nhwc:
            return {"n": s.out_h * s.out_w * s.k, "k": 1, "h": s.out_w * s.k, "w": s.k}
        return {"n": s.k * s.out_h * s.out_w, "k": s.out_h * s.out_w, "h": s.out_w, "w": 1}

    def window_dims(self, level: int) -> tuple[int, int]:
        """Rows and columns of the input that one tile of `level` reads in one R0 step."""
        return input_window(self.spec, self.tile("oh", level), self.tile("ow", level),
                            self.f["kh"][1], self.f["kw"][1])

    def window_elems(self, level: int) -> int:
        """Input elements of that window: its images, groups and one R0 step's channels."""
        rows, cols = self.window_dims(level)
        return self.tile("n", level) * self.tile("g", level) * self.f["c"][1] * rows * cols

    @property
    def r0_steps(self) -> int:
        return self.f["c"][0] * self.f["kh"][0] * self.f["kw"][0]

    @cached_property
    def patch_level(self) -> int:
        """Tile level whose input window a border patch holds: the S2 tile's (one patch per R0
        step, built once however many filter blocks or overlapping register tiles use it) where
        that copies fewer elements than the register tiles' own patches, which filter loops
        outside the S2 positions rebuild block after block (VGG-11's features.13 ran 3-4% faster
        on S2 patches; ResNet-18 layer1 schedules that copied whole S2 windows for a few border
        tiles ran 5-20% slower). S2 patches need at most MAX_PATCH_SLOTS R0 steps (thin chunks'
        short micro-kernel calls ran 14-16% slower on them) and half of L2 for all of them."""
        s, f = self.spec, self.f
        rows, cols = self.window_dims(3)

        def inside(oh: int, ow: int) -> bool:
            ih, iw = oh * s.stride[0] - s.padding[0], ow * s.stride[1] - s.padding[1]
            return 0 <= ih and ih + rows <= s.h and 0 <= iw and iw + cols <= s.w

        # the S2 tile at the image's top-left corner has the most border register tiles
        border = f["n"][2] * f["g"][2] * sum(not inside(i * f["oh"][3], j * f["ow"][3])
                                             for i in range(f["oh"][2]) for j in range(f["ow"][2]))
        positions = f["n"][2] * f["g"][2] * f["oh"][2] * f["ow"][2]
        reuse = f["k"][2] if positions > 1 else 1  # filter blocks around the positions rebuild
        if all(f[a][1] == 1 for a in ("n", "g", "oh", "ow")):
            reuse *= f["k"][1]  # S1 filter blocks find the same S2 window again (one per R0 step)
        fits = 4 * self.window_elems(2) * self.r0_steps <= self.target.level_bytes("L2", 1 << 20) // 2
        cheaper = self.window_elems(2) < border * reuse * self.window_elems(3)
        return 2 if cheaper and fits and self.r0_steps <= MAX_PATCH_SLOTS else 3

    @property
    def patch_slots(self) -> int:
        """Patches each thread keeps: one per R0 step for S2 windows, else one."""
        return self.r0_steps if self.patch_level == 2 else 1

    @cached_property
    def patch_strides(self) -> dict[str, int]:
        """Strides of the zero-filled border patch: the input's layout, cut to the window."""
        rows, cols = self.window_dims(self.patch_level)
        c1, g = self.f["c"][1], self.tile("g", self.patch_level)
        if self.nhwc:
            st = {"c": 1, "g": c1, "w": g * c1}
            st["h"] = cols * st["w"]
            st["n"] = rows * st["h"]
        else:
            st = {"w": 1, "h": cols, "c": rows * cols}
            st["g"] = c1 * st["c"]
            st["n"] = g * st["g"]
        return st

    @property
    def patch_elems(self) -> int:
        return self.window_elems(self.patch_level)

    @property
    def patch_slot_elems(self) -> int:
        """Floats between patch slots: each starts on a cache line."""
        return -(-self.patch_elems // 16) * 16

    @property
    def padded(self) -> bool:
        return any(self.spec.padding)

    @cached_property
    def w_strides(self) -> dict[str, int]:
        """Weight strides inside one micro-kernel call (k within the register tile, R1 axes)."""
        s = self.spec
        taps = s.kh * s.kw
        if self.schedule.weight_packing == "none":  # torch order (K, C/g, kh, kw)
            return {"g": s.k_per_group * s.c_per_group * taps, "k": s.c_per_group * taps,
                    "c": taps, "kh": s.kw, "kw": 1}
        # blocked: [G][KPG/k3][C0][KH0][KW0][R1 axes in inner_order][k3]
        st = {"g": s.k_per_group * s.c_per_group * taps, "k": 1}
        inner = self.f["k"][3]
        for axis in reversed(self.schedule.inner_order):
            st[axis] = inner
            inner *= self.f[axis][1]
        return st

    def pack_weight(self, w: np.ndarray) -> np.ndarray:
        """(K, C/g, kh, kw) float32 -> the layout the kernel reads (a new, cache-line aligned array)."""
        if self.schedule.weight_packing == "none":
            v = w
        else:
            s, f = self.spec, self.f
            k3 = f["k"][3]
            v = w.reshape(s.groups, s.k_per_group // k3, k3, f["c"][0], f["c"][1], f["kh"][0],
                          f["kh"][1], f["kw"][0], f["kw"][1])
            pos = {"c": 4, "kh": 6, "kw": 8}
            v = v.transpose((0, 1, 3, 5, 7) + tuple(pos[a] for a in self.schedule.inner_order) + (2,))
        return aligned_copy(v)

    # -- micro-kernel flavour -------------------------------------------------------------
    @property
    def intrinsics(self) -> str | None:
        """'avx512' / 'avx2' when the fast path applies, else None (portable C)."""
        if self.schedule.vector_axis == "ow" and self.input_nhwc:
            return None  # its vectors are input rows read at stride 1: NCHW only
        return intrinsics_isa(self.spec, self.schedule, self.target)

    @property
    def threads(self) -> int:
        return self.target.cores

    # -- source -----------------------------------------------------------------------------
    @cached_property
    def source(self) -> str:
        return _Generator(self).source()

    @cached_property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


class _Generator:
    def __init__(self, plan: CpuPlan):
        self.p = plan
        self.s = plan.spec
        self.sch = plan.schedule

    # accumulators: tuples (n, g, k, oh, ow) of S3 coordinates, the vector axis in steps of lanes
    def accumulators(self) -> list[tuple[int, ...]]:
        f, w = self.p.f, self.p.lanes
        return list(product(*[range(0, f[a][3], w if a == self.p.vaxis else 1) for a in SPATIAL_AXES]))

    def source(self) -> str:
        p = self.p
        isa = p.intrinsics
        head = [comment(f"MACO CPU kernel: {p.spec}  schedule {self.sch.describe()}"),
                comment(f"flavour: {isa or 'portable'}, bias={p.bias}, activation={p.activation}, "
                        f"residual={p.residual}" + (f", input read in {p.input_layout}" if p.input_layout else "")),
                "#include <stdlib.h>", "#include <string.h>"]
        if isa:
            head.append("#include <immintrin.h>")
        if p.activation in SMOOTH:
            head += [scalar_function(p.activation)] + ([vector_function(p.activation, p.lanes)] if isa else [])
        return "\n".join(head + ["", self.micro_kernel(), "", self.tile_fn(), "", self.driver(), ""])

    # -- micro-kernel ---------------------------------------------------------------------
    # A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
    def micro_kernel(self) -> str:
        p, s = self.p, self.s
        isa = p.intrinsics
        accs = self.accumulators()
        L, V = p.lanes, p.vaxis
        ws = p.w_strides
        sh, sw, dh, dw = s.stride[0], s.stride[1], s.dilation[0], s.dilation[1]
        os_ = p.out_strides
        kpg = s.k_per_group
        body: list[str] = []
        emit = body.append

        def in_off(n: int, g: int, oh: int, ow: int) -> str:
            return _expr([(n, "sN"), (g, "sG"), (oh * sh, "sH"), (ow * sw, "sW")])

        def w_const(g: int, k: int) -> int:
            return g * ws["g"] + k * ws["k"]

        def out_off(a: tuple[int, ...]) -> int:
            n, g, k, oh, ow = a
            return n * os_["n"] + (g * kpg + k) * os_["k"] + oh * os_["h"] + ow * os_["w"]

        lane_out = {"n": os_["n"], "g": kpg * os_["k"], "k": os_["k"], "oh": os_["h"], "ow": os_["w"]}[V]
        lane_bias = {"g": kpg, "k": 1}.get(V, 0)

        def bias_off(a: tuple[int, ...]) -> int:
            return a[1] * kpg + a[2]

        if isa:
            vt, _, zero, loadu, set1, fma, storeu, vmax, vadd = ISA[isa]
            for i, _a in enumerate(accs):
                emit(f"{vt} a{i};")
        else:
            for i, _a in enumerate(accs):
                emit(f"float a{i}[{L}];")
        # -- init: zero on the first R0 step, else the partial sums from the output
        emit("if (first) {")
        for i, _a in enumerate(accs):
            emit(f"  a{i} = {zero};" if isa else f"  for (int l = 0; l < {L}; l++) a{i}[l] = 0.f;")
        emit("} else {")
        for i, a in enumerate(accs):
            off = out_off(a)
            if isa and lane_out == 1:
                emit(f"  a{i} = {loadu}(out + {off});")
            elif isa:
                emit(f"  {{ float t[{L}]; for (int l = 0; l < {L}; l++) t[l] = out[{off} + l*{lane_out}]; "
                     f"a{i} = {loadu}(t); }}")
            else:
                emit(f"  for (int l = 0; l < {L}; l++) a{i}[l] = out[{off} + l*{lane_out}];")
        emit("}")
        # -- R1 loops
        depth = 0
        order = self.sch.inner_order
        extents = {a: p.f[a][1] for a in REDUCTION_AXES}
        unroll = self.sch.unroll
        if unroll:
            cap = INTRINSICS_UNROLLED_BODY if isa else PORTABLE_UNROLLED_BODY
            unroll = max(1, min(unroll, cap // len(accs)))
        inner_prod = 1
        pragmas = {}
        for axis in reversed(order):
            inner_prod *= extents[axis]
            if unroll and extents[axis] > 1:
                pragmas[axis] = min(unroll, extents[axis]) if inner_prod <= unroll else None
        innermost_loop = next((a for a in reversed(order) if extents[a] > 1), None)
        if unroll and innermost_loop and all(v is None for v in pragmas.values()):
            pragmas[innermost_loop] = min(unroll, extents[innermost_loop])
        for axis in order:
            var = {"c": "rc", "kh": "rh", "kw": "rw"}[axis]
            if extents[axis] == 1:
                emit("  " * depth + f"{{ const int {var} = 0;")
            else:
                if pragmas.get(axis) or not unroll:  # unroll 0: none (keeps gcc from merging steps)
                    emit("  " * depth + f"#pragma GCC unroll {pragmas.get(axis) or 1}")
                emit("  " * depth + f"for (int {var} = 0; {var} < {extents[axis]}; {var}++) {{")
            depth += 1
        ind = "  " * depth
        emit(ind + f"const float *ip = in + rc*sC + rh*{dh}*sH + rw*{dw}*sW;")
        emit(ind + f"const float *wq = w + rc*{ws['c']} + rh*{ws['kh']} + rw*{ws['kw']};")
        if isa:
            self._fma_intrinsics(emit, ind, accs, isa, in_off, w_const)
        else:
            lane_in = {"n": "sN", "g": "sG", "k": "0", "oh": f"{sh}*sH", "ow": f"{sw}*sW"}[V]
            lane_w = {"g": ws["g"], "k": ws["k"]}.get(V, 0)
            for i, (n, g, k, oh, ow) in enumerate(accs):
                ioff, woff = in_off(n, g, oh, ow), w_const(g, k)
                if L == 1:
                    emit(ind + f"a{i}[0] += ip[{ioff}] * wq[{woff}];")
                else:
                    emit(ind + "#pragma omp simd")
                    emit(ind + f"for (int l = 0; l < {L}; l++) a{i}[l] += ip[{ioff} + l*({lane_in})] "
                         f"* wq[{woff} + l*{lane_w}];")
        for d in range(depth, 0, -1):
            emit("  " * (d - 1) + "}")
        # -- store: raw partial sums, or the epilogue on the last step
        emit("if (!last) {")
        for i, a in enumerate(accs):
            off = out_off(a)
            if isa and lane_out == 1:
                emit(f"  {storeu}(out + {off}, a{i});")
            elif isa:
                emit(f"  {{ float t[{L}]; {storeu}(t, a{i}); for (int l = 0; l < {L}; l++) "
                     f"out[{off} + l*{lane_out}] = t[l]; }}")
            else:
                emit(f"  for (int l = 0; l < {L}; l++) out[{off} + l*{lane_out}] = a{i}[l];")
        emit("} else {")
        if isa and lane_out == 1:
            emit(f"  const {vt} zero = {zero}; (void)zero;")
        for i, a in enumerate(accs):
            off, boff = out_off(a), bias_off(a)
            if isa and lane_out == 1:
                v = f"a{i}"
                if p.bias:
                    b = f"{loadu}(bias + {boff})" if lane_bias == 1 else f"{set1}(bias[{boff}])"
                    emit(f"  {v} = {vadd}({v}, {b});")
                if p.residual:
                    emit(f"  {v} = {vadd}({v}, {loadu}(res + {off}));")
                # max/min return their second operand where either is NaN: v second keeps a NaN
                # (torch's relu and hardtanh do); a smooth activation runs below, on groups
                if p.activation in SMOOTH:
                    continue
                if p.activation != "none":
                    emit(f"  {v} = {vmax}(zero, {v});")
                if p.activation == "relu6":
                    emit(f"  {v} = {VMIN[isa]}({set1}(6.f), {v});")
                emit(f"  {storeu}(out + {off}, {v});")
                continue
            src = "t[l]" if isa else f"a{i}[l]"
            line = "  { "
            if isa:
                line += f"float t[{L}]; {storeu}(t, a{i}); "
            line += f"for (int l = 0; l < {L}; l++) {{ float v = {src};"
            if p.bias:
                line += f" v += bias[{boff} + l*{lane_bias}];"
            if p.residual:
                line += f" v += res[{off} + l*{lane_out}];"
            if p.activation in SMOOTH:
                line += " v = maco_act(v);"
            elif p.activation != "none":  # a NaN fails both tests and passes, as in torch
                line += " v = v < 0.f ? 0.f : v;"
            if p.activation == "relu6":
                line += " v = v > 6.f ? 6.f : v;"
            line += f" out[{off} + l*{lane_out}] = v; }} }}"
            emit(line)
        if isa and lane_out == 1 and p.activation in SMOOTH:
            self._smooth_activation(emit, [out_off(a) for a in accs], isa)
        emit("}")
        sig = ("static inline __attribute__((always_inline)) void micro(const float *restrict in, "
               "const long sN, const long sG, const long sC, const long sH, const long sW, "
               "const float *restrict w, const float *bias, const float *res, float *out, "
               "const int first, const int last)")
        return sig + " {\n" + "\n".join("  " + line for line in body) + "\n}"

    @staticmethod
    def _smooth_activation(emit, offsets: list[int], isa: str) -> None:
        """The SMOOTH activation on the accumulators a0, a1, ... (stored at `offsets`), VACT_WAYS at
        a time through maco_vact4, whose chains overlap, then each stored. They stay in registers:
        storing the tile first and activating it from L1 doubled the stores to cold output lines."""
        vt, storeu = ISA[isa][0], ISA[isa][6]
        numbered = list(enumerate(offsets))
        for g in range(0, len(numbered), VACT_WAYS):
            group = numbered[g:g + VACT_WAYS]
            if len(group) < VACT_WAYS:
                for i, off in group:
                    emit(f"  {storeu}(out + {off}, ({vt})maco_vact((maco_vf)a{i}));")
                continue
            emit("  { " + " ".join(f"maco_vf v{j} = (maco_vf)a{i};" for j, (i, _) in enumerate(group))
                 + f" maco_vact4({', '.join(f'&v{j}' for j in range(VACT_WAYS))}); "
                 + " ".join(f"{storeu}(out + {off}, ({vt})v{j});" for j, (_, off) in enumerate(group)) + " }")

    def _fma_intrinsics(self, emit, ind, accs, isa, in_off, w_const) -> None:
        p = self.p
        vt, L, _, loadu, set1, fma = ISA[isa][:6]
        by_a: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
        for i, (n, g, k, oh, ow) in enumerate(accs):
            by_a.setdefault((n, g, oh, ow), []).append((i, (g, k)))
        # blocked weights are read in order, k3 floats per step of the innermost R1 loop
        for line in range(0, p.f["k"][3] if self.sch.weight_packing == "blocked" else 0, LINE_FLOATS):
            emit(ind + f"_mm_prefetch((const char *)(wq + {WEIGHT_PREFETCH_AHEAD + line}), _MM_HINT_T0);")
        if p.vaxis == "k":  # weight vectors first, then each input broadcast feeds them
            bs = sorted({b for lst in by_a.values() for _, b in lst})
            for g, k in bs:
                emit(ind + f"const {vt} b{g}_{k} = {loadu}(wq + {w_const(g, k)});")
            for (n, g, oh, ow), lst in by_a.items():
                emit(ind + f"{{ const {vt} x = {set1}(ip[{in_off(n, g, oh, ow)}]);")
                for i, (bg, bk) in lst:
                    emit(ind + f"  a{i} = {fma}(x, b{bg}_{bk}, a{i});")
                emit(ind + "}")
        else:  # ow: input row vectors first, then each weight broadcast feeds them
            by_b: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
            for key, lst in by_a.items():
                emit(ind + f"const {vt} x{'_'.join(map(str, key))} = {loadu}(ip + {in_off(*key)});")
                for i, b in lst:
                    by_b.setdefault(b, []).append((i, key))
            for (g, k), lst in by_b.items():
                emit(ind + f"{{ const {vt} b = {set1}(wq[{w_const(g, k)}]);")
                for i, key in lst:
                    emit(ind + f"  a{i} = {fma}(x{'_'.join(map(str, key))}, b, a{i});")
                emit(ind + "}")

    # -- one call of the micro-kernel at a tile origin ----------------------------------
    # A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
    def tile_fn(self) -> str:
        p, s = self.p, self.s
        st, ps, os_ = p.in_strides, p.patch_strides, p.out_strides
        f = p.f
        rows, cols = p.window_dims(3)
        level = p.patch_level
        prows, pcols = p.window_dims(level)
        kpg, cpg = s.k_per_group, s.c_per_group
        taps = s.kh * s.kw
        k3 = f["k"][3]
        r1 = f["c"][1] * f["kh"][1] * f["kw"][1]
        lines = [
            "static inline __attribute__((always_inline)) void tile(const float *restrict in, "
            "const float *restrict w, const float *bias, const float *res, float *out, "
            "float *restrict patch, int *restrict key, int n0, int g0, int k0, int oh0, int ow0, int c0, "
            "int kh0, int kw0) {",
            "  const int first = c0 == 0 && kh0 == 0 && kw0 == 0;",
            f"  const int last = c0 == {f['c'][0] - 1} && kh0 == {f['kh'][0] - 1} && kw0 == {f['kw'][0] - 1};",
            f"  const int cb = c0*{f['c'][1]}, khb = kh0*{f['kh'][1]}, kwb = kw0*{f['kw'][1]};",
            f"  const int ih0 = oh0*{s.stride[0]} - {s.padding[0]} + khb*{s.dilation[0]};",
            f"  const int iw0 = ow0*{s.stride[1]} - {s.padding[1]} + kwb*{s.dilation[1]};",
            f"  const long ooff = (long)n0*{os_['n']} + (long)(g0*{kpg} + k0)*{os_['k']} + (long)oh0*{os_['h']} + (long)ow0*{os_['w']};",
        ]
        if p.schedule.weight_packing == "none":
            lines.append(f"  const float *wt = w + ((long)(g0*{kpg} + k0)*{cpg} + cb)*{taps} + khb*{s.kw} + kwb;")
        else:
            lines.append(f"  const float *wt = w + (long)g0*{kpg * cpg * taps} + (long)(k0/{k3})*{cpg * taps * k3}"
                         f" + (long)((c0*{f['kh'][0]} + kh0)*{f['kw'][0]} + kw0)*{r1 * k3};")
        lines += [
            f"  const float *bt = bias ? bias + g0*{kpg} + k0 : 0;",
            "  const float *rt = res ? res + ooff : 0;",
            "  float *ot = out + ooff;",
        ]
        direct = (f"    micro(in + (long)n0*{st['n']} + (long)g0*{st['g']} + (long)cb*{st['c']} + "
                  f"(long)ih0*{st['h']} + (long)iw0*{st['w']}, {st['n']}, {st['g']}, {st['c']}, {st['h']}, "
                  f"{st['w']}, wt, bt, rt, ot, first, last);")
        if not p.padded:
            lines += ["  (void)patch; (void)key;", "  {", direct, "  }", "}"]
            return "\n".join(lines)
        lines += [
            f"  if (ih0 >= 0 && ih0 + {rows} <= {s.h} && iw0 >= 0 && iw0 + {cols} <= {s.w}) {{",
            direct,
            "  } else {",
        ]
        # the patch holds the window of the enclosing tile of `level` (whose origin is this tile's,
        # rounded down), zeroed where it leaves the image
        if level == 3:
            lines.append("    const int np0 = n0, gp0 = g0, ihp = ih0, iwp = iw0;")
        else:
            lines += [
                f"    const int np0 = n0 - n0 % {p.tile('n', level)}, gp0 = g0 - g0 % {p.tile('g', level)};",
                f"    const int ihp = (oh0 - oh0 % {p.tile('oh', level)})*{s.stride[0]} - {s.padding[0]} + khb*{s.dilation[0]};",
                f"    const int iwp = (ow0 - ow0 % {p.tile('ow', level)})*{s.stride[1]} - {s.padding[1]} + kwb*{s.dilation[1]};",
            ]
        if p.patch_slots > 1:
            lines.append(f"    const int slot = (c0*{f['kh'][0]} + kh0)*{f['kw'][0]} + kw0;")
            lines.append(f"    patch += (long)slot*{p.patch_slot_elems}; key += slot*5;")
        lines += [
            # border tiles in the same window (other filters, other positions) reuse its patch
            "    if (key[0] != np0 || key[1] != gp0 || key[2] != cb || key[3] != ihp || key[4] != iwp) {",
            "    key[0] = np0; key[1] = gp0; key[2] = cb; key[3] = ihp; key[4] = iwp;",
            f"    memset(patch, 0, {p.patch_elems}*sizeof(float));",
            f"    const int r_lo = ihp < 0 ? -ihp : 0, r_hi = ihp + {prows} > {s.h} ? {s.h} - ihp : {prows};",
            f"    const int q_lo = iwp < 0 ? -iwp : 0, q_hi = iwp + {pcols} > {s.w} ? {s.w} - iwp : {pcols};",
        ]
        # zero the patch, then copy the rows and columns that exist: no test per element
        nest = [("n", "0", p.tile("n", level)), ("g", "0", p.tile("g", level)), ("c", "0", f["c"][1]),
                ("r", "r_lo", "r_hi"), ("q", "q_lo", "q_hi")]
        if p.input_nhwc:  # the copy walks the input in its own order
            nest = [nest[0], nest[3], nest[4], nest[1], nest[2]]
        ind = "    "
        for var, lo, hi in nest:
            lines.append(ind + f"for (int {var} = {lo}; {var} < {hi}; {var}++)")
            ind += "  "
        lines += [
            ind + f"patch[n*{ps['n']} + g*{ps['g']} + c*{ps['c']} + r*{ps['h']} + q*{ps['w']}] = "
            f"in[(long)(np0 + n)*{st['n']} + (long)(gp0 + g)*{st['g']} + (long)(cb + c)*{st['c']} + "
            f"(long)(ihp + r)*{st['h']} + (long)(iwp + q)*{st['w']}];",
            "    }",
            f"    micro(patch + (long)(n0 - np0)*{ps['n']} + (long)(g0 - gp0)*{ps['g']} + (long)(ih0 - ihp)*{ps['h']}"
            f" + (long)(iw0 - iwp)*{ps['w']}, {ps['n']}, {ps['g']}, {ps['c']}, {ps['h']}, {ps['w']}, "
            "wt, bt, rt, ot, first, last);",
            "  }",
            "}",
        ]
        return "\n".join(lines)

    def work_item(self, par_axes: tuple[str, ...], ind: str) -> list[str]:
        """C that decodes work item p of the fused parallel loop into its outer tile index a_0 of
        each parallel axis."""
        f = self.p.f
        return ([ind + "long rest = p;"]
                + [ind + f"const int {a}_0 = rest % {f[a][0]}; rest /= {f[a][0]};" for a in reversed(par_axes)]
                + [ind + "(void)rest;"])

    def fetch_input(self, par_axes: tuple[str, ...], fused: int) -> list[str]:
        """A first loop over the same work items as the main one (schedule(static): each thread
        gets the same items) that reads one byte of every line of the input each item reads, row
        by row, so that the lines sit in the thread's caches. The model's NCHW input comes from
        DRAM, and the tiles read it as many short rows of several channel planes at once, each
        line a miss the hardware prefetchers do not see coming; read in order they do (software
        prefetches in place of the loads recovered half as much: results/REPORT.md)."""
        p, s = self.p, self.p.spec
        st = p.in_strides
        (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
        out = ["  int sink = 0; (void)sink;  /* volatile reads: kept, their values unused */",
               "  #pragma omp for schedule(static) nowait", f"  for (long p = 0; p < {fused}; p++) {{"]
        out += self.work_item(par_axes, "    ")
        extent = {"n": s.n, "g": s.groups, "oh": s.out_h, "ow": s.out_w}
        for a in extent:  # this item's range of each axis: one outer tile where parallel, else all
            lo = f"{a}_0 * {p.tile(a, 1)}" if a in par_axes else "0"
            hi = f"{a}_0 * {p.tile(a, 1)} + {p.tile(a, 1)}" if a in par_axes else str(extent[a])
            out.append(f"    const int {a}_lo = {lo}, {a}_hi = {hi};")
        out += [f"    const int h_lo = oh_lo * {sh} - {ph} > 0 ? oh_lo * {sh} - {ph} : 0;",
                f"    const int h_hi = (oh_hi - 1) * {sh} - {ph} + {(s.kh - 1) * dh + 1} < {s.h} ? "
                f"(oh_hi - 1) * {sh} - {ph} + {(s.kh - 1) * dh + 1} : {s.h};",
                f"    const int w_lo = ow_lo * {sw} - {pw} > 0 ? ow_lo * {sw} - {pw} : 0;",
                f"    const int w_hi = (ow_hi - 1) * {sw} - {pw} + {(s.kw - 1) * dw + 1} < {s.w} ? "
                f"(ow_hi - 1) * {sw} - {pw} + {(s.kw - 1) * dw + 1} : {s.w};",
                "    for (int n = n_lo; n < n_hi; n++)",
                f"    for (int c = g_lo * {s.c_per_group}; c < g_hi * {s.c_per_group}; c++)",
                "    for (int h = h_lo; h < h_hi; h++) {",
                f"      const char *row = (const char *)(in + (long)n * {st['n']} + (long)c * {st['c']} + "
                f"(long)h * {st['h']});",
                "      for (const char *q = (const char *)((unsigned long)(row + 4 * w_lo) & ~63ul); "
                "q < row + 4 * w_hi; q += 64)",
                "        sink += *(const volatile char *)q;",
                "    }",
                "  }"]
        return out

    # -- the loop nest ---------------------------------------------------------------------
    def driver(self) -> str:
        p = self.p
        f = p.f
        par = p.schedule.parallel
        par_axes = SPATIAL_AXES[:par]
        fused = prod(f[a][0] for a in par_axes)
        out = [f"void {FUNCTION}(const float *restrict in, const float *restrict w, const float *bias, "
               "const float *res, float *out) {"]
        patch = (f"(float *)aligned_alloc(64, {p.patch_slot_elems * p.patch_slots * 4})"
                 if p.padded else "0")
        if par:
            out.append(f"  #pragma omp parallel num_threads({p.threads})")
        out.append("  {")
        out.append(f"  float *patch = {patch};")
        out.append(f"  int key[{5 * p.patch_slots}];")
        out.append(f"  for (int i = 0; i < {5 * p.patch_slots}; i++) key[i] = -1 << 30;")
        ind = "  "
        if par and p.input_layout == "NCHW":
            out += self.fetch_input(par_axes, fused)
        if par:
            out.append(ind + "#pragma omp for schedule(static)")
            out.append(ind + f"for (long p = 0; p < {fused}; p++) {{")
            ind += "  "
            out += self.work_item(par_axes, ind)
        depth = 0
        loops = [(f"{a}_0", f[a][0]) for a in SPATIAL_AXES[par:]]
        loops += [(f"{a}_1", f[a][1]) for a in SPATIAL_AXES]
        loops += [(f"{a}_r", f[a][0]) for a in REDUCTION_AXES]
        loops += [(f"{a}_2", f[a][2]) for a in SPATIAL_AXES]
        for var, ext in loops:
            if ext == 1:
                out.append(ind + f"{{ const int {var} = 0;")
            else:
                out.append(ind + f"for (int {var} = 0; {var} < {ext}; {var}++) {{")
            ind += "  "
            depth += 1
        origin = ", ".join(f"{a}_0*{p.tile(a, 1)} + {a}_1*{p.tile(a, 2)} + {a}_2*{p.tile(a, 3)}"
                           for a in SPATIAL_AXES)
        out.append(ind + f"tile(in, w, bias, res, out, patch, key, {origin}, c_r, kh_r, kw_r);")
        for _ in range(depth):
            ind = ind[:-2]
            out.append(ind + "}")
        if par:
            out.append("  }")
        out.append("  free(patch);")
        out.append("  }")
        out.append("}")
        return "\n".join(out)

