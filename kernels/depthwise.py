"""Depthwise convolution (one filter per channel), generated in C with its epilogue fused.

A depthwise layer does 9 multiply-adds per output for a 3x3 window, so it is bound by moving its
input and output, not by arithmetic. The schedule space's nest (maco.core.schedule) vectorises over
filters within a group (k) or output columns (ow); a depthwise group has one filter, so its
kernels there run on one lane in NHWC, and MobileNetV2's 17 depthwise layers took 2.6 ms of a
5 ms model. Here, in NHWC, a block of channels (contiguous) is the vector: its 9 weight vectors
stay in registers while the block slides along an output row, and each output is one pass over
the window's inputs, finished with bias and activation before it is stored. In NCHW the output
columns are the vector. Rows are split over the cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.aligned import aligned_copy
from maco.kernels.epilogue import (ACTIVATIONS, SMOOTH, scalar_expression, scalar_function, vector_expression,
                                   vector_function, vector_type)
from maco.kernels.source_text import comment
from maco.core.schedule import LAYOUTS
from maco.core.spec import ConvSpec
from maco.core.target import Target

FUNCTION = "maco_depthwise"
MAX_TAPS = 64  # kh * kw a channel block names as weight vectors (past ~25 they spill; timing decides)
TILE = 4  # NHWC: outputs of a row computed together (stride 1: they share most input vectors)


def is_depthwise(spec: ConvSpec) -> bool:
    """One input and one output channel per group: what this kernel computes."""
    return spec.groups > 1 and spec.c_per_group == 1 and spec.k_per_group == 1


@dataclass(frozen=True)
class DepthwisePlan:
    """One depthwise conv (spec), its memory layout, bias and activation."""

    spec: ConvSpec
    layout: str = "NHWC"
    bias: bool = True
    activation: str = "none"
    threads: int = 1
    lanes: int = 16  # fp32 lanes of the target's vectors: a channel block is at most one vector

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ConvSpec) or not is_depthwise(self.spec):
            raise MacoError(f"a depthwise kernel needs one channel and one filter per group, got {self.spec}")
        if self.spec.kh * self.spec.kw > MAX_TAPS:
            raise MacoError(f"a {self.spec.kh}x{self.spec.kw} window is past the {MAX_TAPS} taps this kernel keeps")
        if self.layout not in LAYOUTS:
            raise MacoError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        if self.activation not in ACTIVATIONS:
            raise MacoError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise MacoError(f"DepthwisePlan.threads must be a positive int, got {self.threads!r}")
        if self.lanes not in (1, 2, 4, 8, 16):
            raise MacoError(f"DepthwisePlan.lanes must be 1, 2, 4, 8 or 16, got {self.lanes!r}")

    def pack_weight(self, w: np.ndarray) -> np.ndarray:
        """(C, 1, kh, kw) -> the order the kernel reads: (kh, kw, C) in NHWC, (C, kh, kw) in NCHW."""
        s = self.spec
        w = np.asarray(w, dtype=np.float32).reshape(s.c, s.kh, s.kw)
        return aligned_copy(w.transpose(1, 2, 0) if self.layout == "NHWC" else w)

    @cached_property
    def source(self) -> str:
        what = f"MACO depthwise conv: {self.spec}, {self.layout}, bias={self.bias}, activation={self.activation}"
        return f"{comment(what)}\n{(_nhwc if self.layout == 'NHWC' else _nchw)(self)}"


def _nchw(plan: DepthwisePlan) -> str:
    """NCHW: per channel and output row, the row's outputs are the vector (the compiler's), each
    tap one pass over them."""
    s = plan.spec
    n, c, h, w, oh, ow = s.n, s.c, s.h, s.w, s.out_h, s.out_w
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    act = scalar_expression(plan.activation)
    init = "b[ch]" if plan.bias else "0.f"
    helper = scalar_function(plan.activation) + "\n" if plan.activation in SMOOTH else ""
    return f"""{helper}void {FUNCTION}(const float *restrict x, const float *restrict w, const float *restrict b,
                    float *restrict y) {{
  #pragma omp parallel for collapse(2) schedule(static) num_threads({plan.threads})
  for (long img = 0; img < {n}; img++)
    for (long ch = 0; ch < {c}; ch++) {{
      const float *restrict xc = x + (img * {c} + ch) * {h * w};
      const float *restrict wc = w + ch * {s.kh * s.kw};
      float *restrict yc = y + (img * {c} + ch) * {oh * ow};
      for (long i = 0; i < {oh}; i++) {{
        float acc[{ow}];
        #pragma omp simd
        for (long j = 0; j < {ow}; j++) acc[j] = {init};
        for (int r = 0; r < {s.kh}; r++) {{
          const long ih = i * {sh} - {ph} + r * {dh};
          if (ih < 0 || ih >= {h}) continue;
          const float *restrict xr = xc + ih * {w};
          for (int q = 0; q < {s.kw}; q++) {{
            const float wv = wc[r * {s.kw} + q];
            #pragma omp simd
            for (long j = 0; j < {ow}; j++) {{
              const long iw = j * {sw} - {pw} + q * {dw};
              acc[j] += (iw >= 0 && iw < {w}) ? xr[iw] * wv : 0.f;
            }}
          }}
        }}
        #pragma omp simd
        for (long j = 0; j < {ow}; j++) {{ const float v = acc[j]; yc[i * {ow} + j] = {act}; }}
      }}
    }}
}}
"""


# A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
def _nhwc(plan: DepthwisePlan) -> str:
    """NHWC: per output row and block of `cb` channels (one vector), the window's weights as named
    vector variables (registers); the interior of the row (every tap inside the image) in steps
    of TILE outputs, whose shared input vectors the compiler loads once; the border one output at
    a time with each tap checked."""
    s = plan.spec
    n, c, h, w, oh, ow = s.n, s.c, s.h, s.w, s.out_h, s.out_w
    (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
    # a block wider than the target's vectors is split by gcc's generic-vector lowering, and its
    # compare-and-select (vmax, vmin) lowered lane by lane: MobileNetV2's 3x3 layers ran at ~5 GFLOP/s
    # on an AVX2 host with 16-float blocks
    cb = next(b for b in (16, 8, 4, 2, 1) if b <= plan.lanes and c % b == 0)
    taps = [(r, q) for r in range(s.kh) for q in range(s.kw)]
    lo = -(-pw // sw)  # first output column whose whole window is inside the image
    hi = max(lo, (w - 1 - (s.kw - 1) * dw + pw) // sw + 1)  # one past the last
    hi = min(hi, ow)
    lo = min(lo, hi)
    act = vector_expression(plan.activation)
    L = [vector_function(plan.activation, cb)] if plan.activation in SMOOTH else []
    e = L.append
    e(vector_type(cb))
    e(f"void {FUNCTION}(const float *restrict x, const float *restrict w, const float *restrict b, "
      "float *restrict y) {")
    e("  const vf zero = {0}; const vf six = zero + 6.f; (void)six;")
    e(f"  #pragma omp parallel for collapse(3) schedule(static) num_threads({plan.threads})")
    e(f"  for (long img = 0; img < {n}; img++)")
    e(f"  for (long i = 0; i < {oh}; i++)")
    e(f"  for (long c0 = 0; c0 < {c}; c0 += {cb}) {{")
    for t, (r, q) in enumerate(taps):
        e(f"    const vf w{t} = ld(w + {t * c} + c0);")
    e(f"    const vf bv = {'ld(b + c0)' if plan.bias else 'zero'};")
    e(f"    float *restrict yr = y + (img * {oh} + i) * {ow * c} + c0;")
    for r in range(s.kh):
        e(f"    const long ih{r} = i * {sh} - {ph} + {r * dh};")
        e(f"    const int in{r} = ih{r} >= 0 && ih{r} < {h};")
        e(f"    const float *restrict x{r} = x + (img * {h} + (in{r} ? ih{r} : 0)) * {w * c} + c0;")

    def output(j: str, checked: bool) -> None:
        e(f"      {{ vf v = bv; const long iw = {j} * {sw} - {pw};")
        for t, (r, q) in enumerate(taps):
            cond = f"in{r}" + (f" && iw + {q * dw} >= 0 && iw + {q * dw} < {w}" if checked else "")
            e(f"        if ({cond}) v += ld(x{r} + (iw + {q * dw}) * {c}) * w{t};")
        e(f"        st(yr + {j} * {c}, {act}); }}")

    e(f"    for (long j = 0; j < {lo}; j++)")
    output("j", True)
    e(f"    long j = {lo};")
    e(f"    for (; j + {TILE} <= {hi}; j += {TILE}) {{")
    e(f"      vf {', '.join(f'a{u} = bv' for u in range(TILE))};")
    for r in range(s.kh):
        e(f"      if (in{r}) {{")
        for q in range(s.kw):
            t = r * s.kw + q
            for u in range(TILE):
                e(f"        a{u} += ld(x{r} + ((j + {u}) * {sw} - {pw} + {q * dw}) * {c}) * w{t};")
        e("      }")
    for u in range(TILE):
        e(f"      {{ const vf v = a{u}; st(yr + (j + {u}) * {c}, {act}); }}")
    e("    }")
    e(f"    for (; j < {hi}; j++)")
    output("j", False)
    e(f"    for (j = {hi}; j < {ow}; j++)")
    output("j", True)
    e("  }")
    e("}")
    return "\n".join(L) + "\n"


class DepthwiseKernel:
    """A built depthwise kernel; call it with contiguous tensors in the plan's layout."""

    def __init__(self, plan: DepthwisePlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 4, "depthwise")

    def __call__(self, x: Any, w: np.ndarray, b: np.ndarray | None, y: Any) -> None:
        """y = act(depthwise(x, w) + b); the caller has checked shapes, dtype and memory format,
        and packed w with plan.pack_weight."""
        self.function(x.data_ptr(), w.ctypes.data, None if b is None else b.ctypes.data, y.data_ptr())
