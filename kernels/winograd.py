"""Winograd F(m x m, r x r) convolution, generated in C with its epilogue fused (NHWC, stride 1).

An r x r stride-1 conv computes each m x m output tile from an (m + r - 1)^2 input tile;
Winograd's transform does it with (m + r - 1)^2 multiplies per (input, output) channel pair
instead of m^2 r^2: for 3x3 filters 2.25x fewer in 2x2 tiles and 4x in 4x4 tiles, for 5x5 2.8x
and 6.25x, at the cost of transforms of the input tile (B^T d B), the filters (U = G g G^T,
once, when the weights are packed) and the outputs (A^T M A). The transforms are derived exactly
(`transforms`, Cook-Toom) and their integer coefficients written into the source. The direct
kernels already run these layers near the FMA peak, so fewer multiplies are the way left to
run them faster.

The kernel works on blocks of TILES output tiles at a time, in one core's caches: it transforms
the block's input tiles into V (elements x tiles x C), multiplies each element's tile x C matrix
by the filters' C x K matrix U (a register-tiled GEMM: ROWS tiles x KV vectors of k accumulate
while the channels stream past; U is packed so that each register block's C x KV vectors panel
is contiguous and streams in order, in chunks of channels that all of a block's register blocks
take in turn where a panel outgrows L1), and transforms the products back into outputs, adding bias
and residual and applying the activation before the store. A work item is a block and a part of
the filters: with at least as many blocks as threads the blocks are shared out; a deep layer
with fewer blocks (7x7x512: one) splits its filters instead, so that every core works and reads
only its share of U. The block buffers are each thread's scratch, shared by all kernels of the
process (kernels.cpu_build.RUNTIME): a model's Winograd layers find them in cache.

U is elements / r^2 times the weights (16/9 in F(2x2, 3x3), 4x in F(4x4, 3x3)): a deep layer
reads it from memory on every call inside a model, so kernel_choice picks the tile size by timing
each with its U and input dropped from the caches first (kernels.cache_flush). Larger tiles also
round off more: F(4x4, 3x3) is ~1e-5 of the output's magnitude where F(2x2) is ~1e-6.

NaN and infinities: where eager torch gives an infinity, the transforms subtract infinities (NaN),
and one NaN reaches every output of its tile. The kernel therefore reports whether any output of
the conv was not finite (each output row adds o * 0 into a vector, NaN from the first NaN or
infinity on: a few vector operations per tile), and the caller recomputes such a call with torch's
direct conv (`direct`), so that NaN and infinities land exactly where eager's do. A NaN or
infinity in the input always reaches an output it feeds (the transforms' nonzero coefficients
connect every input to each output whose window holds it), so none goes unseen.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.aligned import L1_BYTES, LINE_FLOATS, aligned_copy
from maco.kernels.epilogue import (ACTIVATIONS, SMOOTH, torch_activation, vector_expression, vector_function,
                                   vector_type)
from maco.kernels.source_text import comment
from maco.core.spec import ConvSpec
from maco.core.target import Target

FUNCTION = "maco_winograd"
TILES = {4: 36, 6: 16, 8: 9}  # output tiles per block at most, per input tile side: V and M stay in L2
BLOCK_BYTES = 4 << 20  # V and M of one larger F(4x4, 3x3) block, at most (see WinogradPlan.split)
ROWS = 6  # tiles of one register block; ROWS x KV accumulators, KV filter vectors and a broadcast
# The GEMM prefetches U one chunk ahead into L2, each of a block's register blocks its share of the
# lines: issued all in the first one's pass, the prefetches filled the core's few outstanding
# misses, that pass waited for memory and the others' multiplies overlapped none of it
# (results/REPORT.md, 2026-11-29)
U_PREFETCH_HINT = 2  # __builtin_prefetch's locality: 2 is prefetcht1, into L2
# A panel of U larger than an L1d is read in chunks of U_CHUNK channels, each taken by all of a
# block's register blocks in turn: read from memory once, its stream spread over all their work
# rather than all of it in the first one's pass (the others then reread it from L2)
U_CHUNK = 32
KV = 4  # filter vectors (of k) of one register block with 32 vector registers (AVX-512); half with 16
TILE_SIZES = {3: (2, 4), 5: (2, 4)}  # filter size r -> the output tile sizes m of F(m x m, r x r)
POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))  # interpolation points, then infinity


@lru_cache(maxsize=None)
def transforms(m: int, r: int) -> dict[str, tuple[tuple[Fraction, ...], ...]]:
    """B^T, G and A^T of Winograd's F(m, r) (Lavin and Gray, 2016), exact: Y = A^T ((G g) * (B^T d))
    is the correlation of an input row d of m + r - 1 with a filter g of r. A^T and G follow from
    Cook-Toom interpolation at POINTS and infinity (A^T[i][j] = p_j^i, G[j][k] = p_j^k / prod(p_j - p_l));
    B^T is solved for from that identity. With the first points these are Lavin's F(2,3) up to
    signs and his F(4,3) exactly; B^T and A^T hold integers or halves and quarters (exact in C)."""
    import sympy as sp

    n = m + r - 1
    if not (isinstance(m, int) and isinstance(r, int) and m >= 1 and r >= 1 and n - 1 <= len(POINTS)):
        raise MacoError(f"no Winograd transform F({m!r}, {r!r}) with {len(POINTS)} interpolation points")
    p = [sp.Rational(v.numerator, v.denominator) if isinstance(v, Fraction) else sp.Integer(v) for v in POINTS[:n - 1]]
    at = sp.Matrix(m, n, lambda i, j: p[j] ** i if j < n - 1 else int(i == m - 1))
    g = sp.Matrix(n, r, lambda j, k: (p[j] ** k / sp.prod([p[j] - q for q in p if q != p[j]])) if j < n - 1
                  else int(k == r - 1))
    # sum_j A^T[i][j] G[j][k] B^T[j][l] = [l == i + k] for every i, k, l: one linear system per column l of B^T
    system = sp.Matrix(m * r, n, lambda row, j: at[row // r, j] * g[j, row % r])
    target = sp.Matrix(m * r, n, lambda row, col: int(col == row // r + row % r))
    bt, free = system.gauss_jordan_solve(target)  # raises where the system has no solution
    if free.rows:
        raise MacoError(f"Winograd F({m}, {r}): the points leave B^T undetermined")
    def exact(mat: Any) -> tuple[tuple[Fraction, ...], ...]:
        return tuple(tuple(Fraction(int(v.p), int(v.q)) for v in mat.row(i)) for i in range(mat.rows))
    return {"BT": exact(bt), "G": exact(g), "AT": exact(at)}


def filter_vectors(lanes: int) -> int:
    """Filter vectors of one register block: KV with 16-lane vectors (32 registers), else half."""
    return KV if lanes == 16 else KV // 2


def winograd_can_run(spec: ConvSpec, lanes: int = 16) -> bool:
    """Whether this kernel computes `spec`: a square conv of a filter size in TILE_SIZES, stride
    1, no dilation or groups, zero padding r // 2 (output as large as the input), channels in
    whole vectors of `lanes` and filters in whole register blocks."""
    return (spec.kh == spec.kw and spec.kh in TILE_SIZES and spec.stride == (1, 1) and spec.dilation == (1, 1)
            and spec.padding == (spec.kh // 2,) * 2 and spec.groups == 1 and spec.c % lanes == 0
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
    m: int = 2  # output tile size: F(m x m, r x r)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ConvSpec):
            raise MacoError(f"a Winograd plan needs a maco.ConvSpec, got {type(self.spec).__name__}")
        if self.lanes not in (4, 8, 16):
            raise MacoError(f"vectors of {self.lanes!r} floats: the kernel knows 4, 8 and 16")
        if not winograd_can_run(self.spec, self.lanes):
            raise MacoError(f"Winograd F(m x m, r x r) computes r x r stride-1 convs (r in {tuple(TILE_SIZES)}) "
                            f"with padding r // 2, no groups, "
                            f"C a multiple of {self.lanes} and K of {self.lanes * filter_vectors(self.lanes)}; "
                            f"not {self.spec}")
        if type(self.m) is not int or self.m not in TILE_SIZES.get(self.spec.kh, ()):
            raise MacoError(f"Winograd output tiles of {self.m!r} for {self.spec.kh}x{self.spec.kw} filters: "
                            f"the kernel knows {TILE_SIZES.get(self.spec.kh)}")
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
        """The work split. Blocks of at most TILES[side] tiles keep a block's V and M in the core's L2;
        with at least as many blocks as threads, the blocks are shared out (as many per thread);
        with fewer, each block's filters are split into parts so that every thread works, and each
        thread reads only its part of U; where whole register blocks of filters still leave threads
        idle, the blocks get smaller. F(4x4, 3x3) with more tiles than one block holds takes
        blocks of up to a thread's share of the tiles, their V and M at most BLOCK_BYTES: its U
        (4x the weights) comes from beyond L2 again for every block, and read fewer times it
        costs less than V and M outgrowing L2 (only one element's rows of them are worked on at
        a time)."""
        s = self.spec
        tiles = s.n * -(-s.h // self.m) * -(-s.w // self.m)
        per_block = self.tiles_per_block or TILES[self.side]
        if self.tiles_per_block is None and (self.m, s.kh) == (4, 3) and tiles > per_block:
            fits = BLOCK_BYTES // (4 * self.elements * (s.c + s.k))
            per_block = max(per_block, min(-(-tiles // self.threads), fits))
        blocks = -(-tiles // per_block)
        parts = self.k_parts
        if parts is None:
            parts = 1
            if blocks < self.threads:
                whole = s.k // (self.lanes * filter_vectors(self.lanes))  # register blocks of filters
                parts = max(p for p in range(1, self.threads // blocks + 1) if whole % p == 0)
        if self.tiles_per_block is None and blocks * parts < self.threads:
            # still fewer work items than threads (a deep layer's few tiles, its filters in whole
            # register blocks): smaller blocks, so that every thread works
            blocks = min(tiles, -(-self.threads // parts))
        if self.tiles_per_block is None and parts == 1 and blocks > 1:
            blocks = -(-blocks // self.threads) * self.threads  # as many per thread
        per_block = -(-tiles // blocks)
        return Split(per_block, -(-tiles // per_block), parts)

    @property
    def side(self) -> int:
        """The input tile's side, m + r - 1."""
        return self.m + self.spec.kh - 1

    @property
    def elements(self) -> int:
        """Elements of a transformed tile, side^2: the GEMMs per block."""
        return self.side ** 2

    def transformed_weight(self, w: np.ndarray) -> np.ndarray:
        """(K, C, r, r) -> U = G g G^T as (elements, C, K): per element, the C x K matrix the GEMM
        multiplies by (computed in float64)."""
        s = self.spec
        g = np.array(transforms(self.m, s.kh)["G"], dtype=np.float64)
        w = np.asarray(w, dtype=np.float64).reshape(s.k, s.c, s.kh, s.kw)
        return np.einsum("ia,kcab,jb->ijck", g, w, g).reshape(self.elements, s.c, s.k)

    def pack_weight(self, w: np.ndarray) -> np.ndarray:
        """U as the kernel reads it, float32 (elements, K / B, C, B) for register blocks of B
        filters: each block's C x B panel is contiguous, so the GEMM streams it in order."""
        s, block = self.spec, self.lanes * filter_vectors(self.lanes)
        u = self.transformed_weight(w).reshape(self.elements, s.c, s.k // block, block).transpose(0, 2, 1, 3)
        return aligned_copy(u)

    @cached_property
    def source(self) -> str:
        what = (f"MACO Winograd F({self.m}x{self.m},{self.spec.kh}x{self.spec.kw}) conv: {self.spec}, NHWC, "
                f"bias={self.bias}, activation={self.activation}, residual={self.residual}, threads={self.threads}")
        return f"{comment(what)}\n{_source(self)}"


def _combination(terms: list[tuple[Fraction, str]]) -> str:
    """sum(coefficient * vector) as C, the zero terms left out and +-1 as a plain add or subtract
    (the coefficients are B^T's and A^T's integers and halves, written exactly)."""
    out = ""
    for coef, name in terms:
        if coef == 0:
            continue
        sign, mag = ("-" if coef < 0 else "+"), abs(coef)
        if Fraction(float(mag)) != mag:
            raise MacoError(f"a Winograd transform coefficient {coef} is not exact in a float")
        term = name if mag == 1 else f"{float(mag)!r}f * {name}"
        out += f" {sign} {term}" if out else (f"-{term}" if sign == "-" else term)
    return out or "zero"


# A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
def _source(plan: WinogradPlan) -> str:
    s, lanes, kv, m = plan.spec, plan.lanes, filter_vectors(plan.lanes), plan.m
    n, c, h, w, k = s.n, s.c, s.h, s.w, s.k
    a, els, pad = plan.side, plan.elements, s.kh // 2  # input tile side, transformed elements, padding
    bt, at = transforms(m, s.kh)["BT"], transforms(m, s.kh)["AT"]
    nty, ntx = -(-h // m), -(-w // m)
    tiles = n * nty * ntx
    split = plan.split
    per_block, blocks, parts = split.tiles, split.blocks, split.k_parts
    kp = k // parts  # filters of one part
    chunk = c if c * lanes * kv * 4 <= L1_BYTES else next(n for n in (U_CHUNK, lanes) if c % n == 0)
    # one element's V and M rows, a cache line more than they hold: the transforms read and write
    # all elements at once, and at a power-of-two stride (16 tiles x 256 channels: 16 KiB) those
    # 36 streams all map to the same set of the L1 cache and evict each other
    vstride, mstride = per_block * c + LINE_FLOATS, per_block * kp + LINE_FLOATS
    act = vector_expression(plan.activation)
    L: list[str] = []
    e = L.append
    e("#include <stdlib.h>")
    e("#include <omp.h>")
    e(vector_type(lanes))
    if plan.activation in SMOOTH:
        e(vector_function(plan.activation, lanes))
    # the block buffers: each thread's scratch, shared by all kernels (kernels.cpu_build.RUNTIME)
    e("float *maco_thread_scratch(long floats);")
    # returns 1 where an output of the conv (before residual and activation) was not finite: a NaN or
    # infinity in x (or an overflow) that the transforms may have spread over whole tiles
    e(f"int {FUNCTION}(const float *restrict x, const float *restrict u, const float *restrict b, "
      "const float *restrict r, float *restrict y) {")
    e("  const vf zero = {0}; const vf six = zero + 6.f; (void)six; (void)r; (void)b;")
    e("  int nonfinite = 0;")
    e(f"  #pragma omp parallel num_threads({plan.threads}) reduction(|:nonfinite)")
    e("  {")
    e("  vf check = zero;  /* += o * 0 for every output row: NaN from the first NaN or infinity on */")
    e(f"  float *restrict V = maco_thread_scratch({els * (vstride + mstride)});")
    e("  if (!V) nonfinite = 1;  /* out of memory: reported as not finite, the caller recomputes */")
    e(f"  float *restrict M = V + {els * vstride};")
    e("  long done = -1;  /* the block whose V this thread holds */")
    # items run part-major within a block, so a thread with several items of one block transforms it once
    # nowait: the check after the loop needs no barrier (the region's end joins the threads anyway)
    e("  #pragma omp for schedule(static) nowait")
    e(f"  for (long item = 0; item < {blocks * parts}; item++) {{")
    e("    if (!V) continue;")
    e(f"    const long blk = item / {parts}, k1 = item % {parts} * {kp};")
    e(f"    const long t0 = blk * {per_block};")
    e(f"    const long nt = t0 + {per_block} <= {tiles} ? {per_block} : {tiles} - t0;")
    e("    if (blk != done) { done = blk;")
    e("    for (long t = 0; t < nt; t++) {  /* V = B^T d B */")
    e(f"      const long img = (t0 + t) / {nty * ntx}, ty = (t0 + t) / {ntx} % {nty}, tx = (t0 + t) % {ntx};")
    e(f"      const long r0 = {m} * ty - {pad}, q0 = {m} * tx - {pad};")
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
        value = _combination([(bt[j][q], f"s[i][{q}]") for q in range(a)])
        e(f"          st(vt + (i * {a} + {j}) * {vstride}, {value});")
    e("        }")
    e("      }")
    e("    }")
    e("    }")
    e(f"    for (int el = 0; el < {els}; el++) {{  /* M = V U, element by element, this part's filters */")
    e(f"      const float *restrict ve = V + (long)el * {vstride};")
    e(f"      float *restrict me = M + (long)el * {mstride};")
    e(f"      for (long k0 = 0; k0 < {kp}; k0 += {lanes * kv}) {{")
    e(f"      const float *restrict ue = u + (long)el * {c * k} + (k1 + k0) * {c};  /* this block's panel */")
    e(f"      for (long c0 = 0; c0 < {c}; c0 += {chunk}) {{  /* a chunk of the panel, taken by every row block */")
    # what to prefetch: the next chunk's rows (less c0's, as the register blocks add cc); the next
    # panel of this part follows this one, and after the part's last comes the next element's first
    e(f"      const float *un = c0 + {chunk} < {c} || k0 + {lanes * kv} < {kp} || el + 1 == {els} ? ue + {chunk * lanes * kv}"
      f" : u + (long)(el + 1) * {c * k} + k1 * {c} - c0 * {lanes * kv};")
    # the block's tiles in as few register blocks as ROWS allows, their rows as even as can be
    # (16 tiles: 6 + 5 + 5, not 6 + 6 + 4; 25: five of 5, not four of 6 and a 1-row block whose
    # every filter vector load feeds one FMA)
    e(f"      const long groups = (nt + {ROWS - 1}) / {ROWS};")
    e("      for (long g = 0, ti = 0, rows; g < groups; g++, ti += rows) {")
    e("        rows = nt / groups + (g < nt % groups);")
    e("        switch (rows) {")
    for rows in range(ROWS, 0, -1):
        e(f"        case {rows}: {{")
        _register_block(e, rows, kv, chunk, c, kp, lanes)
        e("          break; }")
    e("        }")
    e("      }")
    e("      }")
    e("      }")
    e("    }")
    e("    for (long t = 0; t < nt; t++) {  /* Y = A^T M A, then the epilogue */")
    e(f"      const long img = (t0 + t) / {nty * ntx}, ty = (t0 + t) / {ntx} % {nty}, tx = (t0 + t) % {ntx};")
    e(f"      for (long k0 = 0; k0 < {kp}; k0 += {lanes}) {{")
    e(f"        vf mm[{els}], p[{m}][{a}];")
    e(f"        for (int el = 0; el < {els}; el++) mm[el] = ld(M + el * {mstride} + t * {kp} + k0);")
    e(f"        for (int j = 0; j < {a}; j++) {{")
    for i in range(m):
        e(f"          p[{i}][j] = {_combination([(at[i][q], f'mm[{q * a} + j]') for q in range(a)])};")
    e("        }")
    e(f"        const vf bv = {'ld(b + k1 + k0)' if plan.bias else 'zero'};")
    e(f"        for (int i = 0; i < {m} && {m} * ty + i < {h}; i++) {{")
    e(f"          const vf o[{m}] = {{" + ", ".join(
        _combination([(at[j][q], f"p[i][{q}]") for q in range(a)]) + " + bv" for j in range(m)) + "};")
    e(f"          check += ({' + '.join(f'o[{j}]' for j in range(m))}) * zero;")
    e(f"          const long at = ((img * {h} + {m} * ty + i) * {w} + {m} * tx) * {k} + k1 + k0;")
    e(f"          for (int j = 0; j < {m} && {m} * tx + j < {w}; j++) {{")
    e(f"            vf v = o[j]{f' + ld(r + at + j * {k})' if plan.residual else ''};")
    e(f"            st(y + at + j * {k}, {act});")
    e("          }")
    e("        }")
    e("      }")
    e("    }")
    e("  }")
    e(f"  for (int l = 0; l < {lanes}; l++) nonfinite |= check[l] != check[l];")
    e("  }")
    e("  return nonfinite;")
    e("}")
    return "\n".join(L) + "\n"


def _register_block(e: Any, rows: int, kv: int, chunk: int, c: int, kp: int, lanes: int) -> None:
    """`rows` tiles x `kv` filter vectors accumulated in registers while `chunk` of the C channels
    stream past from c0 (a panel of U, rows kv vectors long; M rows kp floats apart, holding the
    sums of the channels before c0)."""
    for i in range(rows):
        e("          vf " + ", ".join(f"a{i}_{j} = c0 ? ld(me + (ti + {i}) * {kp} + k0 + {lanes * j}) : zero"
                              for j in range(kv)) + ";")
    e(f"          for (long cc = c0; cc < c0 + {chunk}; cc++) {{")
    lines = max(1, lanes * kv // LINE_FLOATS)  # of one channel's row of the panel
    # U comes from memory inside a model: the next chunk's row of channel cc (un), its lines shared
    # out over the `groups` register blocks (g, the one running) that each read this chunk
    e(f"            for (long l = g; l < {lines}; l += groups) "
      f"__builtin_prefetch(un + cc * {lanes * kv} + l * {LINE_FLOATS}, 0, {U_PREFETCH_HINT});")
    for j in range(kv):
        e(f"            const vf u{j} = ld(ue + cc * {lanes * kv} + {lanes * j});")
    for i in range(rows):
        e(f"            {{ const vf v = ve[(ti + {i}) * {c} + cc] - zero; "
          + " ".join(f"a{i}_{j} += v * u{j};" for j in range(kv)) + " }")
    e("          }")
    for i in range(rows):
        e("          " + " ".join(f"st(me + (ti + {i}) * {kp} + k0 + {lanes * j}, a{i}_{j});" for j in range(kv)))


class WinogradKernel:
    """A built Winograd kernel; call it with channels_last tensors of the spec's shapes."""

    def __init__(self, plan: WinogradPlan, target: Target):
        self.plan = plan
        shared = cpu_build.pointer_function(plan.source, target, FUNCTION, 5, "Winograd")
        # a function object of its own that returns the kernel's int (the loader's says void)
        self.function = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 5)(
            ctypes.cast(shared, ctypes.c_void_p).value)
        self._library = shared  # keeps the object loaded

    def __call__(self, x: Any, u: np.ndarray, b: np.ndarray | None, residual: Any, y: Any) -> bool:
        """y = act(conv(x) + b + residual); the caller has checked shapes, dtype and memory
        format, and packed u with plan.pack_weight. Returns whether every output of the conv
        (before residual and activation) was finite: where not (a NaN or infinity in x, or an
        overflow), the transforms may have put NaN where torch has an infinity or a number
        (inf - inf, and a NaN spreads over its whole output tile), so the caller recomputes the
        call with `direct`."""
        return not self.function(x.data_ptr(), u.ctypes.data, None if b is None else b.ctypes.data,
                                 None if residual is None else residual.data_ptr(), y.data_ptr())


def direct(plan: WinogradPlan, x: Any, weight: Any, bias: Any, residual: Any, y: Any) -> Any:
    """y = act(conv(x) + bias + residual) by torch's direct conv (the weights the Winograd kernel
    packed, as tensors): what a call whose outputs were not all finite is recomputed with, so that
    NaN and infinities land where eager torch puts them. Returns y."""
    import torch
    from torch.nn import functional as F

    with torch.no_grad():
        out = F.conv2d(x, weight, bias, padding=plan.spec.padding)
        if residual is not None:
            out = out + residual
        return y.copy_(torch_activation(plan.activation, out))
