"""The measured fp32 FMA peak of a CPU: a generated loop of independent vector FMAs on every
core, timed in C. Nominal peaks use the base clock; this is what the cores really sustain."""
from __future__ import annotations

import ctypes
import json
import os
from functools import lru_cache

from maco.kernels import cpu_build
from maco.kernels.cpu_codegen import ISA
from maco.target import Target

CHAINS = 24  # independent accumulators: > latency x pipes on every x86 core


def source(target: Target) -> str:
    isa = target.isa if target.isa in ISA else None
    if isa:
        vt, lanes, zero, _, set1, fma = ISA[isa][:6]
        decl = f"const {vt} x = {set1}(1.0000001f), y = {set1}(0.9999999f);"
        init = " ".join(f"{vt} a{j} = {set1}({j}.f);" for j in range(CHAINS))
        step = " ".join(f"a{j} = {fma}(a{j}, x, y);" for j in range(CHAINS))
        total = " ".join(f"s = {ISA[isa][8]}(s, a{j});" for j in range(CHAINS))
        sink = (f"float t[{lanes}]; {vt} s = {zero}; {total} {ISA[isa][6]}(t, s); "
                "sink[omp_get_thread_num()] = t[0];")
        head = "#include <immintrin.h>\n"
    else:
        lanes = target.simd_width
        decl = f"float a[{CHAINS}][{lanes}]; const float x = 1.0000001f, y = 0.9999999f;"
        init = f"for (int j = 0; j < {CHAINS}; j++) for (int l = 0; l < {lanes}; l++) a[j][l] = j;"
        step = (f"for (int j = 0; j < {CHAINS}; j++)\n#pragma omp simd\n"
                f"for (int l = 0; l < {lanes}; l++) a[j][l] = a[j][l] * x + y;")
        sink = "float s = 0; for (int j = 0; j < %d; j++) s += a[j][0]; sink[omp_get_thread_num()] = s;" % CHAINS
        head = ""
    return f"""{head}#include <omp.h>
/* flops per thread per iteration: {CHAINS} * {lanes} * 2 */
double maco_peak(long iters, int threads, float *sink) {{
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {{
    double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {{
      {decl}
      {init}
      for (long i = 0; i < iters; i++) {{
        {step}
      }}
      {sink}
    }}
    double t = omp_get_wtime() - t0;
    double gf = (double)iters * threads * {CHAINS} * {lanes} * 2 / t / 1e9;
    if (gf > best) best = gf;
  }}
  return best;
}}
"""


def _cache_file(target: Target) -> str:
    return str(cpu_build.cache_dir() / "peak.json")


@lru_cache(maxsize=8)
def measure_peak(target: Target, fresh: bool = False) -> float:
    """GFLOP/s of back-to-back FMAs on target.cores threads (best of 5 runs of ~0.1 s), cached
    on disk per CPU model, ISA and thread count. `fresh` measures again and keeps the best seen
    (a busy machine measures low, never high)."""
    host = Target.host()
    key = f"{host.model}|{target.isa}|{target.cores}"
    path = _cache_file(target)
    try:
        with open(path) as fh:
            known = json.load(fh)
    except (OSError, ValueError):
        known = {}
    if key in known and not fresh:
        return float(known[key])
    so = cpu_build.build(source(target), cpu_build.flags_for(target))
    lib = ctypes.CDLL(str(so))
    lib.maco_peak.restype = ctypes.c_double
    lib.maco_peak.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    sink = (ctypes.c_float * 256)()
    lanes = ISA[target.isa][1] if target.isa in ISA else target.simd_width
    iters = int(2e8 / (CHAINS * lanes))  # ~2e8 flops... scaled to ~0.1-0.3 s per run
    iters = max(iters, 10_000) * 64
    gf = float(lib.maco_peak(iters, target.cores, ctypes.addressof(sink)))
    gf = max(gf, float(known.get(key, 0.0)))
    known[key] = gf
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(known, fh, indent=1)
    os.replace(tmp, path)
    return gf
