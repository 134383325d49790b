"""Winograd F(2x2, 3x3) convolution, generated in C with its epilogue fused (NHWC, stride 1).

A 3x3 stride-1 conv computes each 2x2 output tile from a 4x4 input tile; Winograd's transform
does it with 16 multiplies per (input, output) channel pair instead of 36, 2.25x fewer, at the
cost of adding transforms of the input tile (B^T d B), the filters (G g G^T, once, when the
weights are packed) and the outputs (A^T m A). The direct kernels already run 3x3 layers near
the FMA peak, so this is the only way left to do them faster.

The kernel works on blocks of TILES output tiles at a time, in one core's caches: it transforms
the block's input tiles into V (16 x tiles x C), multiplies each of the 16 elements' tile x C
matrix by the filters' C x K matrix U (a register-tiled GEMM: ROWS tiles x KV vectors of k
accumulate while the channels stream past; U is packed so that each register block's C x KV
vectors panel is contiguous and streams in order), and transforms the products back into
outputs, adding bias and residual and applying the activation before the store. A work item is
a block and a part of the filters: with at least as many blocks as threads the blocks are shared
out; a deep layer with fewer blocks (7x7x512: one) splits its filters instead, so that every core
works and reads only its share of U. The block buffers are per thread, allocated on the first
call and kept.

U is 16/9 of the weights: a deep layer reads it from memory on every call, which kernel_choice
weighs by timing the kernel in the model.
"""
from __future__ import annotations

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

FUNCTION = "maco_winograd"
TILES = {2: 36, 4: 16}  # output tiles per block at most, per tile size: its V and M stay in the core's L2
ROWS = 6  # tiles of one register block; ROWS x KV accumulators, KV filter vectors and a broadcast
KV = 4  # filter vectors (of k) of one register block with 32 vector registers (AVX-512); half with 16
# Winograd F(m x m, 3x3) (Lavin and Gray, 2016): U = G g G^T, V = B^T d B, Y = A^T (U * V) A, for output
# tiles of m x m from input tiles of (m + 2) x (m + 2); B^T and A^T hold small integers (exact in C)
TRANSFORMS = {
    2: {"BT": [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        "G": [[1, 0, 0], [1 / 2, 1 / 2, 1 / 2], [1 / 2, -1 / 2, 1 / 2], [0, 0, 1]],
        "AT": [[1, 1, 1, 0], [0, 1, -1, -1]]},
    4: {"BT": [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
               [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        "G": [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
              [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        "AT": [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]},
}
TILE_SIZES = tuple(TRANSFORMS)


def filter_vectors(lanes: int) -> int:
    """Filter vectors of one register block: KV with 16-lane vectors (32 registers), else half."""
    return KV if lanes == 16 else KV // 2


def winograd_can_run(spec: ConvSpec, lanes: int = 16) -> bool:
    """Whether this kernel computes `spec`: a 3x3 conv, stride 1, no dilation or groups, zero
    padding 1 (output as large as the input), channels in whole vectors of `lanes` and filters
    in whole register blocks."""
    return (spec.kh == 3 and spec.kw == 3 and spec.stride == (1, 1) and spec.dilation == (1, 1)
            and spec.padding == (1, 1) and spec.groups == 1 and spec.c % lanes == 0
            and spec.k % (lanes * filter_vectors(lanes)) == 0)


@dataclass(frozen=True)
class Split:
    """How the output tiles and filters are shared out: `blocks` blocks of at most `tiles` tiles,
    each block's filters in `k_parts` parts; one work item is a block and a part."""

    tiles: int
    blocks: int
    k_parts: int


@dataclass(frozen=True)
class WinogradPlan:
    """One conv (spec) in NHWC, its epilogue and threads, on vectors of `lanes` floats, in output
    tiles of m x m (2: 16 multiplies per 4 outputs; 4: 36 per 16, with U 4x the weights).
    `tiles_per_block` and `k_parts` override the work split (see `split`)."""

    spec: ConvSpec
    bias: bool = True
    activation: str = "none"
    residual: bool = False
    threads: int = 1
    lanes: int = 16
    tiles_per_block: int | None = None
    k_parts: int | None = None
    m: int = 2  # output tile size: F(m x m, 3x3)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ConvSpec):
            raise MacoError(f"a Winograd plan needs a maco.ConvSpec, got {type(self.spec).__name__}")
        if type(self.m) is not int or self.m not in TILE_SIZES:
            raise MacoError(f"Winograd output tiles of {self.m!r}: the kernel knows {TILE_SIZES}")
        if self.lanes not in (4, 8, 16):
            raise MacoError(f"vectors of {self.lanes!r} floats: the kernel knows 4, 8 and 16")
        if not winograd_can_run(self.spec, self.lanes):
            raise MacoError(f"Winograd F(m x m,3x3) computes 3x3 stride-1 convs with padding 1, no groups, "
                            f"C a multiple of {self.lanes} and K of {self.lanes * filter_vectors(self.lanes)}; "
                            f"not {self.spec}")
        if self.activation not in ACTIVATIONS:
            raise MacoError(f"unknown activation {self.activation!r}; choose one of {ACTIVATIONS}")
        for name in ("threads", "tiles_per_block", "k_parts"):
            value = getattr(self, name)
            if (value is not None or name == "threads") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise MacoError(f"WinogradPlan.{name} must be a positive int, got {value!r}")
        if self.k_parts is not None and self.spec.k % (self.k_parts * self.lanes * filter_vectors(self.lanes)):
            raise MacoError(f"WinogradPlan.k_parts={self.k_parts} does not split {self.spec.k} filters into "
                            f"whole register blocks of {self.lanes * filter_vectors(self.lanes)}")

    @cached_property
    def split(self) -> Split:
        """The work split. Blocks of at most TILES[m] tiles keep a block's V and M in the core's L2;
        with at least as many blocks as threads, the blocks are shared out (as many per thread);
        with fewer, each block's filters are split into parts so that every thread works, and each
        thread reads only its part of U."""
        s = self.spec
        tiles = s.n * -(-s.h // self.m) * -(-s.w // self.m)
        blocks = -(-tiles // (self.tiles_per_block or TILES[self.m]))
        parts = self.k_parts
        if parts is None:
            parts = 1
            if blocks < self.threads:
                whole = s.k // (self.lanes * filter_vectors(self.lanes))  # register blocks of filters
                parts = max(p for p in range(1, self.threads // blocks + 1) if whole % p == 0)
        if self.tiles_per_block is None and parts == 1 and blocks > 1:
            blocks = -(-blocks // self.threads) * self.threads  # as many per thread
        per_block = -(-tiles // blocks)
        return Split(per_block, -(-tiles // per_block), parts)

    @property
    def elements(self) -> int:
        """Elements of a transformed tile, (m + 2)^2: the GEMMs per block."""
        return (self.m + 2) ** 2

    def transformed_weight(self, w: np.ndarray) -> np.ndarray:
        """(K, C, 3, 3) -> U = G g G^T as (elements, C, K): per element, the C x K matrix the GEMM
        multiplies by (computed in float64)."""
        s, g = self.spec, np.array(TRANSFORMS[self.m]["G"], dtype=np.float64)
        w = np.asarray(w, dtype=np.float64).reshape(s.k, s.c, 3, 3)
        return np.einsum("ia,kcab,jb->ijck", g, w, g).reshape(self.elements, s.c, s.k)

    def pack_weight(self, w: np.ndarray) -> np.ndarray:
        """U as the kernel reads it, float32 (elements, K / B, C, B) for register blocks of B
        filters: each block's C x B panel is contiguous, so the GEMM streams it in order."""
        s, block = self.spec, self.lanes * filter_vectors(self.lanes)
        u = self.transformed_weight(w).reshape(self.elements, s.c, s.k // block, block).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(u, dtype=np.float32)

    @cached_property
    def source(self) -> str:
        what = (f"MACO Winograd F({self.m}x{self.m},3x3) conv: {self.spec}, NHWC, bias={self.bias}, "
                f"activation={self.activation}, residual={self.residual}, threads={self.threads}")
        return f"{comment(what)}\n{_source(self)}"


def _combination(terms: list[tuple[float, str]]) -> str:
    """sum(coefficient * vector) as C, the zero terms left out and +-1 as a plain add or subtract
    (the coefficients are B^T's and A^T's small integers, written exactly)."""
    out = ""
    for coef, name in terms:
        if coef == 0:
            continue
        sign, mag = ("-" if coef < 0 else "+"), abs(coef)
        term = name if mag == 1 else f"{float(mag)!r}f * {name}"
        out += f" {sign} {term}" if out else (f"-{term}" if sign == "-" else term)
    return out or "zero"


def _source(plan: WinogradPlan) -> str:
    s, lanes, kv, m = plan.spec, plan.lanes, filter_vectors(plan.lanes), plan.m
    n, c, h, w, k = s.n, s.c, s.h, s.w, s.k
    a, els = m + 2, plan.elements  # input tile side, transformed elements
    bt, at = TRANSFORMS[m]["BT"], TRANSFORMS[m]["AT"]
    nty, ntx = -(-h // m), -(-w // m)
    tiles = n * nty * ntx
    split = plan.split
    per_block, blocks, parts = split.tiles, split.blocks, split.k_parts
    kp = k // parts  # filters of one part
    act = {"none": "v", "relu": "vmax(v, zero)", "relu6": "vmin(vmax(v, zero), six)"}[plan.activation]
    L: list[str] = []
    e = L.append
    e("#include <stdlib.h>")
    e("#include <omp.h>")
    e(f"typedef float vf __attribute__((vector_size({4 * lanes}), aligned(4)));")
    e(f"typedef int vi __attribute__((vector_size({4 * lanes}), aligned(4)));")
    e("static inline vf ld(const float *p) { return *(const vf *)p; }")
    e("static inline void st(float *p, vf v) { *(vf *)p = v; }")
    e("static inline vf vmax(vf a, vf b) { vi m = a > b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }")
    e("static inline vf vmin(vf a, vf b) { vi m = a < b; return (vf)(((vi)a & m) | ((vi)b & ~m)); }")
    # per-thread block buffers, kept between calls (thread-local pointers: no static TLS blocks)
    e("static __thread float *block_buffer;")
    e(f"void {FUNCTION}(const float *restrict x, const float *restrict u, const float *restrict b, "
      "const float *restrict r, float *restrict y) {")
    e("  const vf zero = {0}; const vf six = zero + 6.f; (void)six; (void)r; (void)b;")
    e(f"  #pragma omp parallel num_threads({plan.threads})")
    e("  {")
    e("  if (!block_buffer)")
    e(f"    block_buffer = aligned_alloc(64, sizeof(float) * {els} * {per_block} * {c + kp});")
    e("  float *restrict V = block_buffer;")
    e(f"  float *restrict M = block_buffer + {els * per_block * c};")
    e("  long done = -1;  /* the block whose V this thread holds */")
    # items run part-major within a block, so a thread with several items of one block transforms it once
    e("  #pragma omp for schedule(static)")
    e(f"  for (long item = 0; item < {blocks * parts}; item++) {{")
    e(f"    const long blk = item / {parts}, k1 = item % {parts} * {kp};")
    e(f"    const long t0 = blk * {per_block};")
    e(f"    const long nt = t0 + {per_block} <= {tiles} ? {per_block} : {tiles} - t0;")
    e("    if (blk != done) { done = blk;")
    e("    for (long t = 0; t < nt; t++) {  /* V = B^T d B */")
    e(f"      const long img = (t0 + t) / {nty * ntx}, ty = (t0 + t) / {ntx} % {nty}, tx = (t0 + t) % {ntx};")
    e(f"      const long r0 = {m} * ty - 1, q0 = {m} * tx - 1;")
    e(f"      int rin[{a}], qin[{a}];")
    e(f"      for (int i = 0; i < {a}; i++) {{ rin[i] = r0 + i >= 0 && r0 + i < {h}; "
      f"qin[i] = q0 + i >= 0 && q0 + i < {w}; }}")
    e(f"      const float *restrict xi = x + img * {h * w * c};")
    e(f"      for (long c0 = 0; c0 < {c}; c0 += {lanes}) {{")
    e(f"        vf d[{a}][{a}], s[{a}][{a}];")
    e(f"        for (int i = 0; i < {a}; i++) for (int j = 0; j < {a}; j++)")
    e(f"          d[i][j] = rin[i] && qin[j] ? ld(xi + ((r0 + i) * {w} + q0 + j) * {c} + c0) : zero;")
    e(f"        for (int j = 0; j < {a}; j++) {{")
    for i in range(a):
        e(f"          s[{i}][j] = {_combination([(bt[i][q], f'd[{q}][j]') for q in range(a)])};")
    e("        }")
    e(f"        float *restrict vt = V + t * {c} + c0;")
    e(f"        for (int i = 0; i < {a}; i++) {{")
    for j in range(a):
        e(f"          st(vt + (i * {a} + {j}) * {per_block * c}, {_combination([(bt[j][q], f's[i][{q}]') for q in range(a)])});")
    e("        }")
    e("      }")
    e("    }")
    e("    }")
    e(f"    for (int el = 0; el < {els}; el++) {{  /* M = V U, element by element, this part's filters */")
    e(f"      const float *restrict ve = V + (long)el * {per_block * c};")
    e(f"      float *restrict me = M + (long)el * {per_block * kp};")
    e(f"      for (long k0 = 0; k0 < {kp}; k0 += {lanes * kv}) {{")
    e(f"      const float *restrict ue = u + (long)el * {c * k} + (k1 + k0) * {c};  /* this block's panel */")
    e(f"      for (long ti = 0; ti < nt; ti += {ROWS}) {{")
    e(f"        switch (nt - ti < {ROWS} ? nt - ti : {ROWS}) {{  /* the last rows of a block too */")
    for rows in range(ROWS, 0, -1):
        e(f"        case {rows}: {{")
        _register_block(e, rows, kv, c, kp, lanes)
        e("          break; }")
    e("        }")
    e("      }")
    e("      }")
    e("    }")
    e("    for (long t = 0; t < nt; t++) {  /* Y = A^T M A, then the epilogue */")
    e(f"      const long img = (t0 + t) / {nty * ntx}, ty = (t0 + t) / {ntx} % {nty}, tx = (t0 + t) % {ntx};")
    e(f"      for (long k0 = 0; k0 < {kp}; k0 += {lanes}) {{")
    e(f"        vf mm[{els}], p[{m}][{a}];")
    e(f"        for (int el = 0; el < {els}; el++) mm[el] = ld(M + el * {per_block * kp} + t * {kp} + k0);")
    e(f"        for (int j = 0; j < {a}; j++) {{")
    for i in range(m):
        e(f"          p[{i}][j] = {_combination([(at[i][q], f'mm[{q * a} + j]') for q in range(a)])};")
    e("        }")
    e(f"        const vf bv = {'ld(b + k1 + k0)' if plan.bias else 'zero'};")
    e(f"        for (int i = 0; i < {m} && {m} * ty + i < {h}; i++) {{")
    e(f"          const vf o[{m}] = {{" + ", ".join(
        _combination([(at[j][q], f"p[i][{q}]") for q in range(a)]) + " + bv" for j in range(m)) + "};")
    e(f"          const long at = ((img * {h} + {m} * ty + i) * {w} + {m} * tx) * {k} + k1 + k0;")
    e(f"          for (int j = 0; j < {m} && {m} * tx + j < {w}; j++) {{")
    e(f"            vf v = o[j]{f' + ld(r + at + j * {k})' if plan.residual else ''};")
    e(f"            st(y + at + j * {k}, {act});")
    e("          }")
    e("        }")
    e("      }")
    e("    }")
    e("  }")
    e("  }")
    e("}")
    return "\n".join(L) + "\n"


def _register_block(e: Any, rows: int, kv: int, c: int, kp: int, lanes: int) -> None:
    """`rows` tiles x `kv` filter vectors accumulated in registers while the C channels stream past
    (a panel of U, rows kv vectors long; M rows kp floats apart)."""
    for i in range(rows):
        e("          vf " + ", ".join(f"a{i}_{j} = zero" for j in range(kv)) + ";")
    e(f"          for (long cc = 0; cc < {c}; cc++) {{")
    for j in range(kv):
        e(f"            const vf u{j} = ld(ue + cc * {lanes * kv} + {lanes * j});")
    for i in range(rows):
        e(f"            {{ const vf v = zero + ve[(ti + {i}) * {c} + cc]; "
          + " ".join(f"a{i}_{j} += v * u{j};" for j in range(kv)) + " }")
    e("          }")
    for i in range(rows):
        e("          " + " ".join(f"st(me + (ti + {i}) * {kp} + k0 + {lanes * j}, a{i}_{j});" for j in range(kv)))


class WinogradKernel:
    """A built Winograd kernel; call it with channels_last tensors of the spec's shapes."""

    def __init__(self, plan: WinogradPlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 5, "Winograd")

    def __call__(self, x: Any, u: np.ndarray, b: np.ndarray | None, residual: Any, y: Any) -> None:
        """y = act(conv(x) + b + residual); the caller has checked shapes, dtype and memory
        format, and packed u with plan.pack_weight."""
        self.function(x.data_ptr(), u.ctypes.data, None if b is None else b.ctypes.data,
                      None if residual is None else residual.data_ptr(), y.data_ptr())
