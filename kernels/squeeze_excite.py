"""Squeeze-excitation as one generated kernel: y = x * gate(fc2(act(fc1(mean over h, w of x)))).

EfficientNet and MobileNetV3 scale each channel of a block's depthwise output by a gate computed
from the channel means. torch runs that as six calls (the pooling, two 1x1 convs on a 1x1 image,
the activation, the gate, the multiply) plus layout conversions around the gate; at batch 1 each
costs more in calls than in arithmetic. Here it is one C call, one OpenMP region: threads share
the channels for the means, the rows of the two small matrix-vector products, then the pixels
for the scale. The input is read twice, and at these networks' sizes it is still in cache from
the conv that wrote it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.aligned import aligned_copy
from maco.kernels.epilogue import scalar_expression, scalar_function
from maco.kernels.source_text import comment
from maco.core.schedule import LAYOUTS
from maco.core.target import Target

FUNCTION = "maco_squeeze_excite"
ACTS = ("relu", "silu")  # after fc1: MobileNetV3's, EfficientNet's
GATES = ("sigmoid", "hardsigmoid")  # after fc2: EfficientNet's, MobileNetV3's
MAX_SCRATCH = 1 << 16  # floats of means, hidden units and gates on the caller's stack (256 KiB)

# NaN stays NaN through both gates (a compare with a NaN fails), as in torch; the sigmoid takes
# silu's exp (epilogue), so sigmoid(-inf) = 0 and sigmoid(inf) = 1
_GATE = {"sigmoid": "1.f / (1.f + maco_exp(-v))",
         "hardsigmoid": "(v + 3.f < 0.f ? 0.f : (v + 3.f > 6.f ? 6.f : v + 3.f)) / 6.f"}


@dataclass(frozen=True)
class SqueezePlan:
    """Squeeze-excitation on an n x c x h x w float32 input in `layout`: `squeeze` hidden units."""

    n: int
    c: int
    h: int
    w: int
    squeeze: int
    act: str = "relu"
    gate: str = "hardsigmoid"
    layout: str = "NHWC"
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "squeeze", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MacoError(f"SqueezePlan.{name} must be a positive int, got {value!r}")
        if self.act not in ACTS:
            raise MacoError(f"squeeze-excitation activation {self.act!r}; the kernel runs {', '.join(ACTS)}")
        if self.gate not in GATES:
            raise MacoError(f"squeeze-excitation gate {self.gate!r}; the kernel runs {', '.join(GATES)}")
        if self.layout not in LAYOUTS:
            raise MacoError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        if self.n * (2 * self.c + self.squeeze) > MAX_SCRATCH:
            raise MacoError(f"squeeze-excitation on {self.n} x {self.c} channels needs more than "
                            f"{MAX_SCRATCH} floats of scratch; torch runs it")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    def pack(self, w1: Any, b1: Any, w2: Any, b2: Any) -> tuple[np.ndarray, np.ndarray]:
        """fc1's (S, C, 1, 1) and fc2's (C, S, 1, 1) weights and their biases (None: zeros) as the
        kernel reads them: weights fc1 (S, C) then fc2 transposed (S, C); biases fc1's then fc2's."""
        c, s = self.c, self.squeeze
        w1 = np.asarray(w1, dtype=np.float32).reshape(s, c)
        w2 = np.asarray(w2, dtype=np.float32).reshape(c, s)
        b1 = np.zeros(s, np.float32) if b1 is None else np.asarray(b1, dtype=np.float32).reshape(s)
        b2 = np.zeros(c, np.float32) if b2 is None else np.asarray(b2, dtype=np.float32).reshape(c)
        return aligned_copy(np.concatenate([w1.ravel(), w2.T.ravel()])), aligned_copy(np.concatenate([b1, b2]))

    # A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
    @cached_property
    def source(self) -> str:
        n, c, h, w, s = self.n, self.c, self.h, self.w, self.squeeze
        hw = h * w
        cb = next(b for b in (64, 32, 16, 8, 4, 2, 1) if c % b == 0)  # channels a thread sums together
        if self.layout == "NHWC":
            mean = f"""
          const float *restrict xb = x + b * {hw * c} + c0;
          for (long p = 0; p < {hw}; p++) {{
            #pragma omp simd
            for (long i = 0; i < {cb}; i++) acc[i] += xb[p * {c} + i];
          }}"""
            scale = f"""
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < {n}; b++)
      for (long p = 0; p < {hw}; p++) {{
        const float *restrict g = gate + b * {c};
        const float *restrict xp = x + (b * {hw} + p) * {c};
        float *restrict yp = y + (b * {hw} + p) * {c};
        #pragma omp simd
        for (long ch = 0; ch < {c}; ch++) yp[ch] = xp[ch] * g[ch];
      }}"""
        else:
            mean = f"""
          for (long i = 0; i < {cb}; i++) {{
            const float *restrict xc = x + (b * {c} + c0 + i) * {hw};
            float a = 0.f;
            for (long p = 0; p < {hw}; p++) a += xc[p];
            acc[i] = a;
          }}"""
            scale = f"""
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < {n}; b++)
      for (long ch = 0; ch < {c}; ch++) {{
        const float g = gate[b * {c} + ch];
        const float *restrict xc = x + (b * {c} + ch) * {hw};
        float *restrict yc = y + (b * {c} + ch) * {hw};
        #pragma omp simd
        for (long p = 0; p < {hw}; p++) yc[p] = xc[p] * g;
      }}"""
        what = f"MACO squeeze-excitation: {n}x{c}x{h}x{w}, {self.layout}, {s} hidden, {self.act}, {self.gate}"
        return f"""{comment(what)}
#include <omp.h>
{scalar_function("silu")}

void {FUNCTION}(const float *restrict x, const float *restrict wt, const float *restrict bias, float *restrict y) {{
  float mean[{n * c}], hidden[{n * s}], gate[{n * c}];
  const float *restrict w1 = wt, *restrict w2t = wt + {s * c};
  const float *restrict b1 = bias, *restrict b2 = bias + {s};
  #pragma omp parallel num_threads({self.threads})
  {{
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < {n}; b++)
      for (long c0 = 0; c0 < {c}; c0 += {cb}) {{
          float acc[{cb}] = {{0}};{mean}
          for (long i = 0; i < {cb}; i++) mean[b * {c} + c0 + i] = acc[i] / {hw}.f;
      }}
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < {n}; b++)
      for (long r = 0; r < {s}; r++) {{
        const float *restrict wr = w1 + r * {c};
        const float *restrict m = mean + b * {c};
        float a = 0.f;
        #pragma omp simd reduction(+:a)
        for (long ch = 0; ch < {c}; ch++) a += wr[ch] * m[ch];
        const float v = a + b1[r];
        hidden[b * {s} + r] = {scalar_expression(self.act)};
      }}
    #pragma omp for collapse(2) schedule(static)
    for (long b = 0; b < {n}; b++)
      for (long c0 = 0; c0 < {c}; c0 += {cb}) {{
        float acc[{cb}];
        #pragma omp simd
        for (long i = 0; i < {cb}; i++) acc[i] = b2[c0 + i];
        for (long r = 0; r < {s}; r++) {{
          const float hr = hidden[b * {s} + r];
          const float *restrict wr = w2t + r * {c} + c0;
          #pragma omp simd
          for (long i = 0; i < {cb}; i++) acc[i] += wr[i] * hr;
        }}
        for (long i = 0; i < {cb}; i++) {{ const float v = acc[i]; gate[b * {c} + c0 + i] = {_GATE[self.gate]}; }}
      }}{scale}
  }}
}}
"""


class SqueezeKernel:
    """A built squeeze-excitation kernel: call it with contiguous tensors in the plan's layout."""

    def __init__(self, plan: SqueezePlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 4, "squeeze-excitation")

    def __call__(self, x: Any, weight: np.ndarray, bias: np.ndarray, y: Any) -> None:
        """y = squeeze-excitation of x; the caller has checked shapes, dtype and memory format."""
        self.function(x.data_ptr(), weight.ctypes.data, bias.ctypes.data, y.data_ptr())
