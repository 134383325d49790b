"""Fully connected layers at small batch, y = act(W x + b), generated in C and read at memory speed.

At batch 1 a classifier layer is a matrix-vector product: every weight is read once and used
once, so its time is the weights' bytes over the memory bandwidth (AlexNet's classifier reads
234 MB per image, VGG-11's 500 MB). torch's linear reached 18-20 GB/s on a host whose cores stream
48 GB/s together; this kernel streams four weight rows at a time per thread, with the input (at
most a few hundred KB) in cache, so the bandwidth is the limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.epilogue import ACTIVATIONS, SMOOTH, scalar_expression, scalar_function
from maco.kernels.source_text import comment
from maco.core.target import Target

FUNCTION = "maco_linear"
ROWS = 4  # weight rows per step: four independent sums share each input load
MAX_BATCH = 64  # beyond it a GEMM (torch) reuses weights better than this kernel


@dataclass(frozen=True)
class LinearPlan:
    """One fully connected layer: batch x in_features -> batch x out_features, row-major."""

    batch: int
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "none"
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("batch", "in_features", "out_features", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MacoError(f"LinearPlan.{name} must be a positive int, got {value!r}")
        if self.batch > MAX_BATCH:
            raise MacoError(f"a batch of {self.batch} is past the {MAX_BATCH} this kernel is for")
        if self.activation not in ACTIVATIONS:
            raise MacoError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")

    @cached_property
    def source(self) -> str:
        n, k, m, rows = self.batch, self.in_features, self.out_features, ROWS
        helper = scalar_function(self.activation) + "\n" if self.activation in SMOOTH else ""
        bias, tail_bias = ("b[o + r]", "b[o]") if self.bias else ("0.f", "0.f")
        return f"""{comment(f"MACO linear: batch {n}, {k} to {m}, bias={self.bias}, activation={self.activation}")}
#include <omp.h>
{helper}static inline float act(float v) {{ return {scalar_expression(self.activation)}; }}

void {FUNCTION}(const float *restrict x, const float *restrict w, const float *restrict b, float *restrict y) {{
  #pragma omp parallel for schedule(static) num_threads({self.threads})
  for (long o = 0; o < {m - m % rows}; o += {rows}) {{
    const float *wo = w + o * {k};
    for (int nn = 0; nn < {n}; nn++) {{
      const float *xn = x + (long)nn * {k};
      {" ".join(f"float s{r} = 0.f;" for r in range(rows))}
      #pragma omp simd reduction(+:{", ".join(f"s{r}" for r in range(rows))})
      for (long i = 0; i < {k}; i++) {{
        const float v = xn[i];
        {" ".join(f"s{r} += wo[{r * k} + i] * v;" for r in range(rows))}
      }}
      const float s[{rows}] = {{{", ".join(f"s{r}" for r in range(rows))}}};
      for (int r = 0; r < {rows}; r++) {{ const float v = s[r] + {bias}; y[(long)nn * {m} + o + r] = act(v); }}
    }}
  }}
  for (long o = {m - m % rows}; o < {m}; o++) {{
    for (int nn = 0; nn < {n}; nn++) {{
      const float *xn = x + (long)nn * {k}, *wo = w + o * {k};
      float s = 0.f;
      #pragma omp simd reduction(+:s)
      for (long i = 0; i < {k}; i++) s += wo[i] * xn[i];
      y[(long)nn * {m} + o] = act(s + {tail_bias});
    }}
  }}
}}
"""


class LinearKernel:
    """A built linear kernel; call it with tensors' data pointers (MacoLinear does)."""

    def __init__(self, plan: LinearPlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 4, "linear")

    def __call__(self, x: Any, w: Any, b: Any, y: Any) -> None:
        """y = act(x @ w.T + b) for contiguous float32 CPU tensors of the plan's shapes."""
        self.function(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr())


def compile_linear(batch: int, in_features: int, out_features: int, *, bias: bool = True,
                   activation: str = "none", target: Target | None = None) -> LinearKernel:
    target = target or Target.host()
    return LinearKernel(LinearPlan(batch, in_features, out_features, bias, activation, target.cores), target)
