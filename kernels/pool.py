"""Max and average pooling (plain and adaptive), generated in C for one input shape and layout.

A pooling layer does almost no arithmetic: its time is reading its input once. torch's CPU
max_pool2d also computes the argmax indices (even under inference_mode) and walks the window per
channel; on ResNet-18's 112x112x64 NHWC maxpool it took ~225 us, 2% of the optimized model. Here
each output pixel takes the max (or sum) of whole channel rows of its window, which the compiler
vectorises over the contiguous channels in NHWC; in NCHW a window's rows are first reduced down
whole input rows (contiguous, vectorised), then each output reduces its columns of that row.
The output rows (NHWC) or planes (NCHW) are split over the cores.

Every window is a product of a row range and a column range, so a plan is the per-output-row and
per-output-column [start, end) bounds and divisors, computed here the way torch does for
MaxPool2d, AvgPool2d (ceil_mode, count_include_pad) and AdaptiveAvg/MaxPool2d, and written into
the source as integer tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import ceil, floor
from typing import Any

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.source_text import comment
from maco.core.schedule import LAYOUTS
from maco.core.target import Target

FUNCTION = "maco_pool"
KINDS = ("max", "avg")


@dataclass(frozen=True)
class Windows:
    """Along one axis: output index -> input [start, end) and the divisor of an average."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    divisor: tuple[int, ...]


def _out_size(size: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """torch's pooling output size (aten pooling_output_shape)."""
    out = (size + 2 * p - k + ((s - 1) if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def sliding(size: int, k: int, s: int, p: int, ceil_mode: bool = False, count_pad: bool = True) -> Windows:
    """Windows of MaxPool2d/AvgPool2d along one axis (dilation 1)."""
    for name, v, lo in (("size", size, 1), ("kernel", k, 1), ("stride", s, 1), ("padding", p, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise MacoError(f"pooling {name} must be an int >= {lo}, got {v!r}")
    if p > k // 2:
        raise MacoError(f"pooling padding {p} is more than half the kernel {k}")
    out = _out_size(size, k, s, p, ceil_mode)
    if out < 1:
        raise MacoError(f"pooling a size of {size} with kernel {k}, stride {s}, padding {p} leaves nothing")
    starts, ends, divs = [], [], []
    for o in range(out):
        lo = o * s - p
        hi_pad = min(lo + k, size + p)
        a, b = max(lo, 0), min(lo + k, size)
        starts.append(a)
        ends.append(b)
        divs.append(hi_pad - lo if count_pad else b - a)
    return Windows(tuple(starts), tuple(ends), tuple(divs))


def adaptive(size: int, out: int) -> Windows:
    """Windows of AdaptiveAvgPool2d/AdaptiveMaxPool2d along one axis."""
    if isinstance(out, bool) or not isinstance(out, int) or not 1 <= out:
        raise MacoError(f"adaptive pooling output size must be a positive int, got {out!r}")
    starts = tuple(floor(o * size / out) for o in range(out))
    ends = tuple(ceil((o + 1) * size / out) for o in range(out))
    return Windows(starts, ends, tuple(b - a for a, b in zip(starts, ends)))


@dataclass(frozen=True)
class PoolPlan:
    """One pooling layer on an n x c x h x w float32 input stored in `layout`."""

    kind: str
    n: int
    c: int
    h: int
    w: int
    rows: Windows
    cols: Windows
    layout: str = "NHWC"
    threads: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MacoError(f"unknown pooling {self.kind!r}; choose one of {KINDS}")
        if self.layout not in LAYOUTS:
            raise MacoError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        for name in ("n", "c", "h", "w", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MacoError(f"PoolPlan.{name} must be a positive int, got {value!r}")
        for axis, win, size in (("rows", self.rows, self.h), ("cols", self.cols, self.w)):
            if not len(win.start) == len(win.end) == len(win.divisor) >= 1:
                raise MacoError(f"PoolPlan.{axis}: start, end and divisor differ in length")
            for a, b, d in zip(win.start, win.end, win.divisor):
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b, d)) \
                        or not (0 <= a < b <= size and d >= 1):
                    raise MacoError(f"PoolPlan.{axis}: window [{a!r}, {b!r}) / {d!r} outside 0..{size}")

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, len(self.rows.start), len(self.cols.start))

    # A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
    @cached_property
    def source(self) -> str:
        n, c, h, w = self.n, self.c, self.h, self.w
        oh, ow = len(self.rows.start), len(self.cols.start)
        table = lambda name, v: f"static const int {name}[{len(v)}] = {{{', '.join(map(str, v))}}};"  # noqa: E731
        # max keeps a NaN as torch does; avg sums, then divides by the window's divisor
        step = "a = (v > a || v != v) ? v : a" if self.kind == "max" else "a += v"
        init = "-__builtin_inff()" if self.kind == "max" else "0.f"
        scale = "1.f" if self.kind == "max" else "1.f / (float)(rd[i] * cd[j])"
        if self.layout == "NHWC":
            # a block of channels accumulates in registers over the whole window, then is stored
            cb = next(b for b in (64, 32, 16, 8, 4, 2, 1) if c % b == 0)
            body = f"""
  #pragma omp parallel for collapse(2) schedule(static) num_threads({self.threads})
  for (long b = 0; b < {n}; b++)
    for (long i = 0; i < {oh}; i++)
      for (long j = 0; j < {ow}; j++)
        for (long c0 = 0; c0 < {c}; c0 += {cb}) {{
          float acc[{cb}];
          #pragma omp simd
          for (long ch = 0; ch < {cb}; ch++) acc[ch] = {init};
          for (long r = rs[i]; r < re[i]; r++)
            for (long q = cs[j]; q < ce[j]; q++) {{
              const float *restrict xi = x + ((b * {h} + r) * {w} + q) * {c} + c0;
              #pragma omp simd
              for (long ch = 0; ch < {cb}; ch++) {{ float a = acc[ch]; const float v = xi[ch]; {step}; acc[ch] = a; }}
            }}
          const float s = {scale};
          float *restrict yo = y + ((b * {oh} + i) * {ow} + j) * {c} + c0;
          #pragma omp simd
          for (long ch = 0; ch < {cb}; ch++) yo[ch] = acc[ch] * s;
        }}"""
        else:
            # separable: a window's rows reduced down whole input rows, row after row (contiguous,
            # vectorised), then each output's columns along that one reduced row (branch-free)
            vstep = "red[q] = (v > t || v != v) ? v : t" if self.kind == "max" else "red[q] = t + v"
            hstep = "a = v != v ? v : (v > a ? v : a)" if self.kind == "max" else "a += v"
            body = f"""
  #pragma omp parallel for collapse(2) schedule(static) num_threads({self.threads})
  for (long b = 0; b < {n}; b++)
    for (long ch = 0; ch < {c}; ch++) {{
      const float *restrict xp = x + (b * {c} + ch) * {h * w};
      float *restrict yp = y + (b * {c} + ch) * {oh * ow};
      float red[{w}];
      for (long i = 0; i < {oh}; i++) {{
        const float *restrict x0 = xp + rs[i] * {w};
        #pragma omp simd
        for (long q = 0; q < {w}; q++) red[q] = x0[q];
        for (long r = rs[i] + 1; r < re[i]; r++) {{
          const float *restrict xr = xp + r * {w};
          #pragma omp simd
          for (long q = 0; q < {w}; q++) {{ const float v = xr[q], t = red[q]; {vstep}; }}
        }}
        for (long j = 0; j < {ow}; j++) {{
          float a = red[cs[j]];
          for (long q = cs[j] + 1; q < ce[j]; q++) {{ const float v = red[q]; {hstep}; }}
          yp[i * {ow} + j] = a * {scale};
        }}
      }}
    }}"""
        what = f"MACO {self.kind} pool: {n}x{c}x{h}x{w} to {oh}x{ow}, {self.layout}"
        return f"""{comment(what)}
#include <omp.h>
{table("rs", self.rows.start)}
{table("re", self.rows.end)}
{table("rd", self.rows.divisor)}
{table("cs", self.cols.start)}
{table("ce", self.cols.end)}
{table("cd", self.cols.divisor)}

void {FUNCTION}(const float *restrict x, float *restrict y) {{{body}
}}
"""


class PoolKernel:
    """A built pooling kernel; call it with contiguous tensors in the plan's layout."""

    def __init__(self, plan: PoolPlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 2, "pooling")

    def __call__(self, x: Any, y: Any) -> None:
        """y = pool(x); the caller has checked shapes, dtype and memory format."""
        self.function(x.data_ptr(), y.data_ptr())


def plan_for(module: Any, shape: tuple[int, ...], layout: str, threads: int) -> PoolPlan | None:
    """The plan of a torch pooling module (MaxPool2d, AvgPool2d, AdaptiveAvgPool2d,
    AdaptiveMaxPool2d) on an input of `shape`, or None where the module does something this
    kernel does not (dilation, divisor_override, indices, a 3-d input)."""
    from torch import nn  # torch is needed only for the module types

    if len(shape) != 4:
        return None
    n, c, h, w = shape
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        kind = "max" if isinstance(module, nn.MaxPool2d) else "avg"
        if kind == "max" and (module.return_indices or pair(module.dilation) != (1, 1)):
            return None
        if kind == "avg" and module.divisor_override is not None:
            return None
        k, p = pair(module.kernel_size), pair(module.padding)
        s = pair(module.stride if module.stride is not None else module.kernel_size)
        count_pad = kind == "max" or module.count_include_pad
        try:
            rows = sliding(h, k[0], s[0], p[0], module.ceil_mode, count_pad)
            cols = sliding(w, k[1], s[1], p[1], module.ceil_mode, count_pad)
        except MacoError:
            return None
    elif isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
        kind = "avg" if isinstance(module, nn.AdaptiveAvgPool2d) else "max"
        if kind == "max" and module.return_indices:
            return None
        out = pair(module.output_size)
        out = tuple(size if o is None else o for o, size in zip(out, (h, w)))
        rows, cols = adaptive(h, out[0]), adaptive(w, out[1])
    else:
        return None
    return PoolPlan(kind, n, c, h, w, rows, cols, layout, threads)
