"""One C call that runs a sequence of generated kernels (maco.layouts.segments): the dispatcher.

A model's MACO kernels are each a C function of pointers (kernels.cpu, depthwise, pool, linear,
winograd). Called one Python module at a time, each costs a module call, its checks and a ctypes
call around it; a run of them in the planned graph is instead one table of steps, each a function
pointer, its kind and its five pointer arguments, walked here in one call:

    long maco_sequence(const void *const *fns, const long *kinds, void *const *args, long start, long n)

runs steps start..n-1 in order and returns n, or the index of the first step that Python must run
(kind PYTHON) or whose checked kernel reported a problem (kind CHECKED: a Winograd kernel whose
outputs were not all finite, an inverted residual that could not allocate its buffers); the
caller handles that step and calls again from the next one.

    long maco_sequence_timed(fns, kinds, args, start, n, long long *ns)

does the same and adds each step's wall time (nanoseconds, CLOCK_MONOTONIC) to ns[i]: what each
kernel takes inside the model, its weights and inputs wherever the steps before left them
(end_to_end.conv_share).
"""
from __future__ import annotations

import ctypes
from typing import Any

from maco.kernels import cpu_build
from maco.kernels.source_text import comment
from maco.core.target import Target

FUNCTION = "maco_sequence"
ARGS = 5  # pointer arguments a step holds (kernels taking fewer ignore the rest)
PYTHON, VOID2, VOID4, VOID5, CHECKED5 = 0, 2, 4, 5, 6  # step kinds

TIMED = "maco_sequence_timed"
STEP = f"""    void *const *a = args + {ARGS} * i;
    switch (kinds[i]) {{
      case {VOID2}: ((void2)fns[i])(a[0], a[1]); break;
      case {VOID4}: ((void4)fns[i])(a[0], a[1], a[2], a[3]); break;
      case {VOID5}: ((void5)fns[i])(a[0], a[1], a[2], a[3], a[4]); break;
      case {CHECKED5}: if (((int5)fns[i])(a[0], a[1], a[2], a[3], a[4])) return i; break;
      default: return i;
    }}"""
SOURCE = f"""{comment("MACO kernel sequence: one call runs a table of kernels in order")}
#include <time.h>
typedef void (*void2)(void *, void *);
typedef void (*void4)(void *, void *, void *, void *);
typedef void (*void5)(void *, void *, void *, void *, void *);
typedef int (*int5)(void *, void *, void *, void *, void *);

long {FUNCTION}(void *const *fns, const long *kinds, void *const *args, long start, long n) {{
  for (long i = start; i < n; i++) {{
{STEP}
  }}
  return n;
}}

static long long maco_now(void) {{
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}}

long {TIMED}(void *const *fns, const long *kinds, void *const *args, long start, long n, long long *ns) {{
  long long t0 = maco_now();
  for (long i = start; i < n; i++) {{
{STEP}
    const long long t1 = maco_now();
    ns[i] += t1 - t0;
    t0 = t1;
  }}
  return n;
}}
"""


def sequence_function(target: Target, timed: bool = False) -> Any:
    """The dispatcher, built for `target` (from the cache when built before): called with the
    addresses of the three tables (ints), start and n (and, `timed`, the address of n long longs
    that each step's nanoseconds are added to); returns where it stopped."""
    shared = cpu_build.pointer_function(SOURCE, target, TIMED if timed else FUNCTION, 3, "sequence")
    # a function object of its own that returns the long (the loader's, shared, says void)
    args = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * timed
    fn = ctypes.CFUNCTYPE(ctypes.c_long, *args)(address(shared))
    fn.library = shared  # keeps the object loaded
    return fn


def address(function: Any) -> int:
    """The address of a ctypes function (a loaded kernel's, or a CFUNCTYPE wrapping one)."""
    return ctypes.cast(function, ctypes.c_void_p).value
