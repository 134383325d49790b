"""Depthwise convolution (one filter per channel), generated in C with its epilogue fused.

A depthwise layer does 9 multiply-adds per output for a 3x3 window, so it is bound by moving its
input and output, not by arithmetic. The schedule space's nest (maco.schedule) vectorises over
filters within a group (k) or output columns (ow); a depthwise group has one filter, so its
kernels there run on one lane in NHWC, and MobileNetV2's 17 depthwise layers took 2.6 ms of a
5 ms model. Here, in NHWC, a block of channels (contiguous) is the vector: its 9 weight vectors
stay in registers while the block slides along an output row, and each output is one pass over
the window's inputs, finished with bias and activation before it is stored. In NCHW the output
columns are the vector. Rows are split over the cores.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from maco.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.epilogue import ACTIVATIONS
from maco.kernels.source_text import comment
from maco.spec import ConvSpec
from maco.target import Target

FUNCTION = "maco_depthwise"
LAYOUTS = ("NCHW", "NHWC")
MAX_TAPS = 64  # kh * kw whose weights a channel block keeps in registers (beyond: torch)


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

    def pack_weight(self, w: np.ndarray) -> np.ndarray:
        """(C, 1, kh, kw) -> the order the kernel reads: (kh, kw, C) in NHWC, (C, kh, kw) in NCHW."""
        s = self.spec
        w = np.asarray(w, dtype=np.float32).reshape(s.c, s.kh, s.kw)
        return np.ascontiguousarray(w.transpose(1, 2, 0) if self.layout == "NHWC" else w)

    @cached_property
    def source(self) -> str:
        s = self.spec
        n, c, h, w, oh, ow = s.n, s.c, s.h, s.w, s.out_h, s.out_w
        (sh, sw), (ph, pw), (dh, dw) = s.stride, s.padding, s.dilation
        act = {"none": "v", "relu": "(v > 0.f ? v : 0.f)",
               "relu6": "(v > 0.f ? (v < 6.f ? v : 6.f) : 0.f)"}[self.activation]
        init = "b[ch]" if self.bias else "0.f"
        if self.layout == "NHWC":
            cb = next(b for b in (16, 8, 4, 2, 1) if c % b == 0)
            body = f"""
  #pragma omp parallel for collapse(2) schedule(static) num_threads({self.threads})
  for (long img = 0; img < {n}; img++)
    for (long i = 0; i < {oh}; i++)
      for (long c0 = 0; c0 < {c}; c0 += {cb}) {{
        float wr[{s.kh * s.kw}][{cb}];
        for (int t = 0; t < {s.kh * s.kw}; t++)
          for (int ch = 0; ch < {cb}; ch++) wr[t][ch] = w[t * {c} + c0 + ch];
        for (long j = 0; j < {ow}; j++) {{
          float acc[{cb}];
          #pragma omp simd
          for (int ch = 0; ch < {cb}; ch++) acc[ch] = {init.replace("ch]", "c0 + ch]")};
          #pragma GCC unroll {s.kh}
          for (int r = 0; r < {s.kh}; r++) {{
            const long ih = i * {sh} - {ph} + r * {dh};
            if (ih < 0 || ih >= {h}) continue;
            #pragma GCC unroll {s.kw}
            for (int q = 0; q < {s.kw}; q++) {{
              const long iw = j * {sw} - {pw} + q * {dw};
              if (iw < 0 || iw >= {w}) continue;
              const float *restrict xi = x + ((img * {h} + ih) * {w} + iw) * {c} + c0;
              #pragma omp simd
              for (int ch = 0; ch < {cb}; ch++) acc[ch] += xi[ch] * wr[r * {s.kw} + q][ch];
            }}
          }}
          float *restrict yo = y + ((img * {oh} + i) * {ow} + j) * {c} + c0;
          #pragma omp simd
          for (int ch = 0; ch < {cb}; ch++) {{ const float v = acc[ch]; yo[ch] = {act}; }}
        }}
      }}"""
        else:
            body = f"""
  #pragma omp parallel for collapse(2) schedule(static) num_threads({self.threads})
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
    }}"""
        what = f"MACO depthwise conv: {s}, {self.layout}, bias={self.bias}, activation={self.activation}"
        return f"""{comment(what)}
#include <omp.h>

void {FUNCTION}(const float *restrict x, const float *restrict w, const float *restrict b, float *restrict y) {{{body}
}}
"""


class DepthwiseKernel:
    """A built depthwise kernel; call it with contiguous tensors in the plan's layout."""

    def __init__(self, plan: DepthwisePlan, target: Target):
        if target.kind != "cpu":
            raise MacoError(f"generated depthwise kernels are CPU code, not for {target.name!r}")
        self.plan = plan
        self.function = cpu_build.load(cpu_build.build(plan.source, cpu_build.flags_for(target)), FUNCTION)
        self.function.argtypes = [ctypes.c_void_p] * 4

    def __call__(self, x: Any, w: np.ndarray, b: np.ndarray | None, y: Any) -> None:
        """y = act(depthwise(x, w) + b); the caller has checked shapes, dtype and memory format,
        and packed w with plan.pack_weight."""
        self.function(x.data_ptr(), w.ctypes.data, None if b is None else b.ctypes.data, y.data_ptr())
