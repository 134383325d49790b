"""MobileNet's inverted residual as one kernel: 1x1 expand, depthwise, 1x1 project (+ the block's input).

Run as three kernels, the expanded tensor (6x the block's channels) is written to memory by the
expand conv, read and written again by the depthwise conv, and read by the project conv; at
MobileNetV2's early resolutions it outgrows the L2 (bounds/chain.py counts what that costs). Here
each thread takes a band of output rows (or, split by channels, all rows of its share of the
expanded channels) and computes it in groups of G rows, with the intermediates in two buffers of
its own sized for its share of L2:

    E  a ring of the expanded input rows the group's windows cover ((G-1)*s + r rows of W + 2p
       pixels, the p zero columns either side written once), kept from one group to the next,
       so a row is expanded once per band; rows above or below the image are zeros;
    D  the group's depthwise outputs (G * Wo pixels), read at once by the project GEMM, which
       adds the bias and the block's input (the residual) and writes the block's output; split
       by channels, each thread's project GEMM is a partial sum over its channels, and the
       threads add them (then the activation) after a barrier.

The two 1x1 convs are one register-tiled GEMM (PT pixels x VB vectors of accumulators, an input
value broadcast against the filter vectors), the depthwise conv one pass per channel vector over
the ring's rows with its r*r weight vectors named. Where the block's output channels are not a
whole number of vectors (24 or 40 of AVX-512's 16 lanes), the project GEMM's last columns are half
a vector, loaded into and stored from a whole one (BlockPlan.tail); where its expanded channels
are not (72 to 200 in MobileNetV3), so are the expand GEMM's and the depthwise conv's last ones
(BlockPlan.m_tail). The rest of the block keeps the wide vectors. Layout NHWC throughout; bias and activation of
each conv fused (kernels.epilogue), so NaN and infinities land where torch puts them. A block
without an expand conv (expansion 1) copies its input rows into the ring; one without a project
conv (the front half of a block with squeeze-excitation) writes its depthwise rows as its output.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import numpy as np

from maco.core.errors import MacoError
from maco.kernels import cpu_build
from maco.kernels.aligned import L1_BYTES, LINE_BYTES, LINE_FLOATS, aligned_empty
from maco.kernels.epilogue import ACTIVATIONS, SMOOTH, vector_expression, vector_function, vector_type
from maco.kernels.source_text import comment
from maco.core.target import Target

FUNCTION = "maco_inverted_residual"
ALIGN = 16  # floats: each packed weight array starts on a 64-byte line
MAX_TAPS = 49
MAX_PIXELS = 8  # pixels of a GEMM register tile
SPLITS = ("auto", "rows", "channels")
W_AHEAD = 16  # rows of a column panel of W that its GEMM prefetches ahead
DW_TILE = 4  # depthwise outputs of a row computed together (independent sums in flight)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MacoError(f"BlockPlan.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class BlockPlan:
    """One inverted residual on an (n, c, h, w) input: expand to m channels (none when `expand` is
    False: then m == c), an r x r depthwise conv of stride s and padding r // 2, project to k (none
    when `project` is False: then k == m, the block's front half, where squeeze-excitation reads
    the depthwise output); each conv's activation; `residual` adds the block's input to the
    output (s == 1, c == k)."""

    n: int
    c: int
    h: int
    w: int
    m: int
    k: int
    r: int = 3
    s: int = 1
    expand: bool = True
    project: bool = True  # False: the block ends with its depthwise conv (k == m), as where SE follows it
    act_expand: str = "relu6"
    act_depthwise: str = "relu6"
    act_project: str = "none"
    residual: bool = False
    threads: int = 1
    lanes: int = 8  # fp32 lanes of the target's vectors
    registers: int = 16  # vector registers
    cache_bytes: int = 256 << 10  # what one thread's E and D may take
    split: str = "auto"  # "rows": threads take bands of rows; "channels": shares of m; "auto": channel_split

    def __post_init__(self) -> None:
        for name in ("n", "c", "h", "w", "m", "k", "r", "s", "threads", "lanes", "registers", "cache_bytes"):
            _positive(name, getattr(self, name))
        if self.r % 2 == 0 or self.r * self.r > MAX_TAPS:
            raise MacoError(f"the block's depthwise window must be odd and at most 7x7, got {self.r}x{self.r}")
        if self.s not in (1, 2):
            raise MacoError(f"the block's depthwise stride must be 1 or 2, got {self.s}")
        if not self.expand and self.m != self.c:
            raise MacoError(f"a block without an expand conv keeps its {self.c} channels, got m={self.m}")
        if not self.expand and not self.project:
            raise MacoError("a block without expand and project convs is a depthwise conv: kernels.depthwise runs it")
        if not self.project and (self.k != self.m or self.residual or self.act_project != "none"):
            raise MacoError(f"a block without a project conv hands back its {self.m} depthwise channels, with no "
                            f"residual or project activation; got k={self.k}, residual={self.residual}, "
                            f"act_project={self.act_project!r}")
        if self.residual and (self.s != 1 or self.c != self.k):
            raise MacoError(f"a residual needs stride 1 and as many outputs as inputs, got stride {self.s}, "
                            f"{self.c} -> {self.k} channels")
        if self.split not in SPLITS:
            raise MacoError(f"BlockPlan.split must be one of {SPLITS}, got {self.split!r}")
        if self.split == "channels" and not self.can_split_channels:
            raise MacoError(f"{self.threads} threads cannot share {self.m} channels in vectors of {self.vector}")
        for name in ("act_expand", "act_depthwise", "act_project"):
            if getattr(self, name) not in ACTIVATIONS:
                raise MacoError(f"unknown activation {getattr(self, name)!r}; choose one of {ACTIVATIONS}")
        smooth = {self.act_expand, self.act_depthwise, self.act_project} & set(SMOOTH)
        if len(smooth) > 1:
            raise MacoError(f"one block kernel computes one smooth activation, got {sorted(smooth)}")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def pad(self) -> int:
        return self.r // 2

    @property
    def out_h(self) -> int:
        return (self.h + 2 * self.pad - self.r) // self.s + 1

    @property
    def out_w(self) -> int:
        return (self.w + 2 * self.pad - self.r) // self.s + 1

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.k, self.out_h, self.out_w)

    @property
    def vector(self) -> int:
        """The lanes of the C vectors: the widest the target has that divides m and k, or leaves
        half a vector of either (`m_tail`, `tail`: their last channels in half a vector).
        MobileNet's 24- and 40-channel outputs then keep AVX-512's 16 lanes for their 96 to 240
        expanded channels, and its 72 to 200 expanded channels most of theirs, where one vector
        width for all would halve them to 8. The output planes split over threads by whole vectors
        (channel_split), so they must divide by it too; split by channels on request, the widest
        that gives every thread whole vectors."""
        def fits(v: int) -> bool:
            planes = self.out_h * self.out_w * self.k
            return (v <= self.lanes and (self.m % v == 0 or (v >= 8 and self.m % (v // 2) == 0))
                    and (self.k % v == 0 or (v >= 8 and self.k % (v // 2) == 0 and planes % v == 0)))
        widths = [v for v in (16, 8, 4, 2, 1) if fits(v)]
        if self.split == "channels":  # asked for: vectors narrow enough that every thread gets whole ones
            widths = [v for v in widths if self.m % (self.threads * v) == 0] or widths
        return widths[0]

    @property
    def tail(self) -> int:
        """Output channels of the project conv computed in half vectors (its last k % vector)."""
        return self.k % self.vector if self.project else 0

    @property
    def m_tail(self) -> int:
        """Expanded channels computed in half vectors (the last m % vector, by the expand GEMM and
        the depthwise conv)."""
        return self.m % self.vector

    @property
    def can_split_channels(self) -> bool:
        return self.threads > 1 and self.m % (self.threads * self.vector) == 0

    @property
    def channel_split(self) -> bool:
        """Whether the threads share each image's expanded channels (else its rows). Split by rows,
        every thread reads all the weights and recomputes the expanded rows at its band's edges;
        by channels, each thread reads its share of the weights and the project convs' partial
        sums meet in memory. "auto": by channels where fewer images than threads would split
        rows and the block's output is under four times its weights (the deep MobileNetV2
        blocks: timing chooses in the model, deploy.kernel_choice.faster_blocks)."""
        if self.split != "auto":
            return self.split == "channels"
        weights = self.c * self.m * self.expand + self.m * self.k * self.project
        return self.can_split_channels and self.n < self.threads and self.out_h * self.out_w * self.k < 4 * weights

    @property
    def ms(self) -> int:
        """Expanded channels one thread computes."""
        return self.m // self.threads if self.channel_split else self.m

    @property
    def bands(self) -> int:
        """Parts each image's output rows are split into, so that every thread has work."""
        return 1 if self.channel_split else min(self.out_h, -(-self.threads // self.n))

    def ring_rows(self, g: int) -> int:
        return (g - 1) * self.s + self.r

    def scratch_floats(self, g: int) -> int:
        return self.ring_rows(g) * (self.w + 2 * self.pad) * self.ms + (g * self.out_w * self.ms if self.project else 0)

    @property
    def group(self) -> int:
        """G: output rows computed together, the most whose E and D fit in cache_bytes (at least 1)."""
        band = -(-self.out_h // self.bands)
        g = 1
        while g < band and 4 * self.scratch_floats(g + 1) <= self.cache_bytes:
            g += 1
        return g

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Where each packed array starts in the one weight buffer (floats)."""
        sizes = {"we": self.c * self.m if self.expand else 0, "be": self.m if self.expand else 0,
                 "wd": self.r * self.r * self.m, "bd": self.m, "wp": self.m * self.k if self.project else 0,
                 "bp": self.k if self.project else 0}
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = at
            at += -(-size // ALIGN) * ALIGN
        out["end"] = at
        return out

    def pack(self, expand: tuple[Any, Any] | None, depthwise: tuple[Any, Any],
             project: tuple[Any, Any] | None) -> np.ndarray:
        """The (weight, bias) of each conv (torch shapes; a bias may be None) in the order the
        kernel reads them: expand (c, m), depthwise (r*r, m), project (m, k), each bias after."""
        out = aligned_empty((self.offsets["end"],))
        out[...] = 0  # the padding between the arrays too
        o = self.offsets

        def put(name: str, a: Any) -> None:
            a = np.asarray(a, dtype=np.float32).reshape(-1)
            out[o[name]:o[name] + a.size] = a

        def bias(name: str, b: Any, size: int) -> None:
            put(name, np.zeros(size, np.float32) if b is None else np.asarray(b, dtype=np.float32).reshape(size))

        if self.expand:
            if expand is None:
                raise MacoError("this block plan has an expand conv: pack needs its weights")
            put("we", np.asarray(expand[0], dtype=np.float32).reshape(self.m, self.c).T)
            bias("be", expand[1], self.m)
        put("wd", np.asarray(depthwise[0], dtype=np.float32).reshape(self.m, self.r * self.r).T)
        bias("bd", depthwise[1], self.m)
        if self.project:
            if project is None:
                raise MacoError("this block plan has a project conv: pack needs its weights")
            put("wp", np.asarray(project[0], dtype=np.float32).reshape(self.k, self.m).T)
            bias("bp", project[1], self.k)
        return out

    @property
    def summary(self) -> str:
        """The block in words: its convs, their activations, and how its threads share the work."""
        return (f"{'expand to ' + str(self.m) if self.expand else 'no expand'} ({self.act_expand}), "
                f"depthwise {self.r}x{self.r} stride {self.s} ({self.act_depthwise}), "
                f"{'project to ' + str(self.k) if self.project else 'no project'} ({self.act_project}), "
                f"residual={self.residual}, {self.threads} threads by {'channels' if self.channel_split else 'rows'}, "
                f"G={self.group}")

    @cached_property
    def source(self) -> str:
        what = f"MACO inverted residual: n{self.n} c{self.c} h{self.h} w{self.w}, {self.summary}"
        return f"{comment(what)}\n{_source(self)}"


def _tile(plan: BlockPlan, n: int) -> tuple[int, int]:
    """(PT, VB): pixels and vectors of a GEMM register tile for n output channels. Its
    accumulators, VB filter vectors, a broadcast and the epilogue's three constants (zero, six and
    a temporary) stay within the target's registers: with fewer, gcc reloads the filter vectors
    for every FMA and the loop waits on loads. The most accumulators, then the fewest loads."""
    vectors = n // plan.vector
    tiles = [(min(MAX_PIXELS, (plan.registers - 4 - vb) // vb), vb) for vb in range(1, 5)
             if vectors % vb == 0 and plan.registers - 4 - vb >= vb]
    return max(tiles, key=lambda t: (t[0] * t[1], -(t[0] + t[1])))


def _gemm(plan: BlockPlan, name: str, red: int, n: int, act: str, residual: bool, row_pixels: int | None,
          w_stride: int | None = None) -> list[str]:
    """C of `static void name(in, W, b, res, out, rows, P)`: for P pixels, out[p][:n] = act(in[p][:red]
    . W + b (+ res[p])), inputs and residual contiguous; the output contiguous at `out`, or (with
    row_pixels) pixel p at rows[p / row_pixels] + p % row_pixels; W's rows w_stride apart (n: all
    of them; more: W is a thread's columns of a wider matrix). Each register tile sweeps all n
    columns while its inputs sit in L1; where W outgrows half of L1, each column panel of W sweeps
    all pixels instead (a panel stays in L1, the pixels come from L2)."""
    L = plan.vector
    full = n - n % L  # columns in whole vectors; the rest (half a vector, BlockPlan.tail) after them
    pt, vb = _tile(plan, full or L)  # no whole vectors: the tile of the one half vector
    # a few whole vectors and a half one (MobileNet's 24 or 40 outputs): one tile takes them all,
    # each broadcast input feeding every vector, where two passes would load the inputs twice
    together = 0 < full < n and full // L + 1 <= 4
    if together:
        nv = full // L + 1
        pt = min(MAX_PIXELS, (plan.registers - 4 - nv) // nv)
    columns_outer = 4 * red * n > L1_BYTES // 2 and not together
    out = [f"static void {name}(const float *restrict in, const float *restrict W, const float *restrict b, "
           "const float *restrict res, float *restrict out, float *const *rows, long P) {",
           "  (void)res; (void)out; (void)rows; const vf zero = {0}; const vf six = zero + 6.f; (void)six;"]
    e = out.append

    def where(pixel: str) -> str:
        if row_pixels is None:
            return f"out + ({pixel}) * {n}"
        return f"rows[({pixel}) / {row_pixels}] + ({pixel}) % {row_pixels} * {n}"

    def tile(count: int, indent: str, whole: int, half: bool = False, fetch: bool = False) -> None:
        """Pixels q .. q + count - 1, `whole` vectors of columns from n0, then (`half`) one vector
        whose upper half is never stored (ldh/sth read and write L / 2 floats: nothing past the
        arrays). `fetch`: each step prefetches W's row W_AHEAD rows ahead in this column panel
        (the panel's first pixel tile reads it from memory inside a model)."""
        vectors = [(v * L, "ld", "st") for v in range(whole)] + ([(whole * L, "ldh", "sth")] if half else [])
        e(f"{indent}{{")
        for p in range(count):
            e(f"{indent}  float *restrict o{p} = {where(f'q + {p}')} + n0;")
        e(f"{indent}  vf " + ", ".join(f"a{p}_{v} = {ld}(b + n0 + {at})" for p in range(count)
                                       for v, (at, ld, _) in enumerate(vectors)) + ";")
        e(f"{indent}  const float *restrict ip = in + q * {red};")
        e(f"{indent}  for (long c = 0; c < {red}; c++) {{")
        e(f"{indent}    const float *restrict wr = W + c * {w_stride or n} + n0;")
        for line in range(0, whole * L, LINE_FLOATS) if fetch else ():
            e(f"{indent}    __builtin_prefetch(wr + {W_AHEAD * (w_stride or n) + line}, 0, 3);")
        for v, (at, ld, _) in enumerate(vectors):
            e(f"{indent}    const vf w{v} = {ld}(wr + {at});")
        for p in range(count):
            e(f"{indent}    {{ const float x = ip[{p * red} + c];")
            for v in range(len(vectors)):
                e(f"{indent}      a{p}_{v} += x * w{v};")
            e(f"{indent}    }}")
        e(f"{indent}  }}")
        for p in range(count):
            for v, (at, ld, st) in enumerate(vectors):
                add = f" + {ld}(res + (q + {p}) * {n} + n0 + {at})" if residual else ""
                e(f"{indent}  {{ const vf v = a{p}_{v}{add}; {st}(o{p} + {at}, {vector_expression(act)}); }}")
        e(f"{indent}}}")

    columns = f"for (long n0 = 0; n0 < {full}; n0 += {vb * L})"

    def pixels(indent: str, body: Callable[[int, str], None]) -> None:
        """Every full pixel tile, then the last pixels in one tile of their count; `body(count,
        indent)` emits what each tile computes."""
        heads = [(pt, f"for (; q + {pt} <= P; q += {pt})")] + [(r, f"if (P - q == {r})") for r in range(1, pt)]
        e(f"{indent}long q = 0;")
        for count, head in heads:
            e(f"{indent}{head} {{")
            body(count, indent + "  ")
            e(f"{indent}}}")

    def last_columns(count: int, indent: str) -> None:  # the half vector after the whole ones
        e(f"{indent}{{ const long n0 = {full};")
        tile(count, indent + "  ", 0, half=True)
        e(f"{indent}}}")

    def vb_columns(count: int, indent: str) -> None:
        tile(count, indent, vb, fetch=columns_outer)

    def all_columns(count: int, indent: str) -> None:  # columns inner: whole vectors, then the rest
        if together:
            e(f"{indent}{{ const long n0 = 0;")
            tile(count, indent + "  ", full // L, half=True)
            e(f"{indent}}}")
            return
        if full:
            e(f"{indent}{columns}")
            vb_columns(count, indent + "  ")
        if full < n:
            last_columns(count, indent)

    if columns_outer:
        if full:
            e(f"  {columns} {{")
            pixels("    ", vb_columns)
            e("  }")
        if full < n:
            e("  {")
            pixels("    ", last_columns)
            e("  }")
    else:
        pixels("  ", all_columns)
    e("}")
    return out


def _depthwise(p: BlockPlan, ms: int) -> list[str]:
    """C of `static void depthwise(rows, wd, bd, d, stride)`: one output row of `ms` channels from
    the ring rows rows[0..r-1] (pixels of ms channels) into d (pixels `stride` floats apart); the
    weights are (r*r, m), offset to the thread's channels. Channels past the last whole vector
    (BlockPlan.m_tail) in half a vector after the rest."""
    L = p.vector
    full = ms - ms % L
    taps = [(a, b) for a in range(p.r) for b in range(p.r)]
    out = ["static void depthwise(const float *const *rows, const float *restrict wd, const float *restrict bd, "
           "float *restrict d, long stride) {",
           "  const vf zero = {0}; const vf six = zero + 6.f; (void)six;"]
    e = out.append

    def channels(head: str, half: bool) -> None:  # one vector of channels from c0, for every output column
        ld, st = ("ldh", "sth") if half else ("ld", "st")
        e(f"  {head} {{")
        for t in range(len(taps)):
            e(f"    const vf w{t} = {ld}(wd + {t * p.m} + c0);")
        e(f"    const vf bv = {ld}(bd + c0);")
        for a in range(p.r):
            e(f"    const float *restrict x{a} = rows[{a}] + c0;")

        def outputs(count: int, indent: str) -> None:  # `count` outputs from column j: independent sums
            for u in range(count):
                e(f"{indent}vf v{u} = bv;")
            for t, (a, b) in enumerate(taps):
                for u in range(count):
                    e(f"{indent}v{u} += {ld}(x{a} + ((j + {u}) * {p.s} + {b}) * {ms}) * w{t};")
            for u in range(count):
                e(f"{indent}{{ const vf v = v{u}; {st}(d + (j + {u}) * stride + c0, "
                  f"{vector_expression(p.act_depthwise)}); }}")

        e("    long j = 0;")
        e(f"    for (; j + {DW_TILE} <= {p.out_w}; j += {DW_TILE}) {{")
        outputs(DW_TILE, "      ")
        e("    }")
        e(f"    for (; j < {p.out_w}; j++) {{")
        outputs(1, "      ")
        e("    }")
        e("  }")

    if full:
        channels(f"for (long c0 = 0; c0 < {full}; c0 += {L})", False)
    if full < ms:
        channels(f"{{ const long c0 = {full};", True)
        e("  }")
    e("}")
    return out


# A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
def _rows(p: BlockPlan, e: Any, lo: str, hi: str, cs: str, out: str) -> None:
    """C of one thread's output rows lo..hi of image img, channels cs..cs + ms of the expanded
    tensor, in groups of G rows: the new ring rows expanded (zeros above and below the image), the
    depthwise rows, then `out` (gi rows done: a C statement, the project GEMM) or, without a
    project conv, the depthwise rows written to the output."""
    ms, pad, g = p.ms, p.pad, p.group
    nr, row, o = p.ring_rows(g), (p.w + 2 * p.pad) * p.ms, p.offsets
    e("        long have = -1000000;  /* one past the last input row in the ring */")
    e(f"        for (long i0 = {lo}; i0 < {hi}; i0 += {g}) {{")
    e(f"          const long gr = {hi} - i0 < {g} ? {hi} - i0 : {g};")
    e(f"          const long need_lo = i0 * {p.s} - {pad}, need_hi = (i0 + gr - 1) * {p.s} - {pad} + {p.r};")
    e(f"          float *fresh[{nr}]; long first = -1, count = 0;  /* the new rows inside the image */")
    e("          for (long ih = need_lo > have ? need_lo : have; ih < need_hi; ih++) {")
    e(f"            float *restrict er = ring + ((ih % {nr} + {nr}) % {nr}) * {row} + {pad * ms};")
    e(f"            if (ih < 0 || ih >= {p.h}) {{ memset(er, 0, sizeof(float) * {p.w * ms}); continue; }}")
    if p.expand:
        e("            if (first < 0) first = ih;")
        e("            fresh[count++] = er;")
    else:
        if ms == p.c:
            e(f"            memcpy(er, xi + ih * {p.w * p.c}, sizeof(float) * {p.w * p.c});")
        else:
            e(f"            for (long j = 0; j < {p.w}; j++)")
            e(f"              memcpy(er + j * {ms}, xi + (ih * {p.w} + j) * {p.c} + {cs}, sizeof(float) * {ms});")
    e("          }")
    if p.expand:
        e(f"          if (count) expand(xi + first * {p.w * p.c}, w + {o['we']} + {cs}, w + {o['be']} + {cs}, 0, 0, "
          f"fresh, count * {p.w});")
    else:
        e("          (void)fresh; (void)first; (void)count;")
    e("          have = need_hi;")
    e("          for (long gi = 0; gi < gr; gi++) {")
    e(f"            const float *rows[{p.r}];")
    e(f"            for (long a = 0; a < {p.r}; a++) {{")
    e(f"              const long ih = (i0 + gi) * {p.s} - {pad} + a;")
    e(f"              rows[a] = ring + ((ih % {nr} + {nr}) % {nr}) * {row};")
    e("            }")
    if p.project:
        e(f"            depthwise(rows, w + {o['wd']} + {cs}, w + {o['bd']} + {cs}, d + gi * {p.out_w * ms}, {ms});")
    else:
        e(f"            depthwise(rows, w + {o['wd']} + {cs}, w + {o['bd']} + {cs}, "
          f"y + (img * {p.out_h} + i0 + gi) * {p.out_w * p.m} + {cs}, {p.m});")
    e("          }")
    if p.project:
        e(f"          {out}")
    e("        }")


# A code generator kept whole (past 60 lines): the C it emits reads top to bottom here.
def _source(plan: BlockPlan) -> str:
    p = plan
    L, pad, ms = p.vector, p.pad, p.ms
    row, g = (p.w + 2 * pad) * ms, p.group
    nr, o = p.ring_rows(g), p.offsets
    acts = {p.act_expand, p.act_depthwise, p.act_project} & set(SMOOTH)
    lines = [vector_function(acts.pop(), L)] if acts else []
    e = lines.append
    e("#include <stdlib.h>")
    e("#include <string.h>")
    e("#include <omp.h>")
    e("/* buffers on cache lines: their vectors then never straddle two */")
    e(f"static void *lines(size_t bytes) {{ return aligned_alloc({LINE_BYTES}, "
      f"(bytes + {LINE_BYTES - 1}) / {LINE_BYTES} * {LINE_BYTES}); }}")
    e(vector_type(L))
    if p.tail or p.m_tail:  # the last channels: half a vector loaded into (and stored from) a whole one
        h = L // 2
        e(f"typedef float vh __attribute__((vector_size({4 * h}), aligned(4)));")
        e("static inline vf ldh(const float *p) { const vh v = *(const vh *)p; return __builtin_shufflevector(v, v, "
          + ", ".join(str(i % h) for i in range(L)) + "); }")
        e("static inline void sth(float *p, vf v) { *(vh *)p = __builtin_shufflevector(v, v, "
          + ", ".join(map(str, range(h))) + "); }")
    if p.expand:
        lines.extend(_gemm(p, "expand", p.c, ms, p.act_expand, False, p.w, w_stride=p.m))
    split = p.channel_split
    if p.project:  # split over channels, each thread's project is a partial sum: the activation comes after
        lines.extend(_gemm(p, "project", ms, p.k, "none" if split else p.act_project, p.residual, None))
    if p.project and split:  # the other threads' partial sums: no bias, no residual
        lines.extend(_gemm(p, "project_part", ms, p.k, "none", False, None))
    lines.extend(_depthwise(p, ms))
    e(f"int {FUNCTION}(const float *restrict x, const float *restrict w, const void *unused1, "
      "const void *unused2, float *restrict y) {")
    e("  (void)unused1; (void)unused2;")
    e("  int failed = 0;")
    if split:
        e(f"  float *parts[{p.threads}]; int ok[{p.threads}];")
    e(f"  #pragma omp parallel num_threads({p.threads}) reduction(|:failed)")
    e("  {")
    e(f"    float *ring = lines(sizeof(float) * {nr * row}), *d = lines(sizeof(float) * {g * p.out_w * ms if p.project else 1});")
    if pad:
        e(f"    for (long i = 0; ring && i < {nr}; i++) {{")
        e(f"      memset(ring + i * {row}, 0, sizeof(float) * {pad * ms});")
        e(f"      memset(ring + i * {row} + {(pad + p.w) * ms}, 0, sizeof(float) * {pad * ms});")
        e("    }")
    if not split:
        e("      #pragma omp for schedule(static)")
        e(f"      for (long item = 0; item < {p.n * p.bands}; item++) {{")
        e("        if (!ring || !d) { failed = 1; continue; }")
        e(f"        const long img = item / {p.bands}, band = item % {p.bands};")
        e(f"        const long lo = band * {p.out_h} / {p.bands}, hi = (band + 1) * {p.out_h} / {p.bands};")
        e(f"        const float *restrict xi = x + img * {p.h * p.w * p.c};")
        res = f"xi + i0 * {p.w * p.c}" if p.residual else "0"
        _rows(p, e, "lo", "hi", "0", f"project(d, w + {o['wp']}, w + {o['bp']}, {res}, "
                                       f"y + (img * {p.out_h} + i0) * {p.out_w * p.k}, 0, gr * {p.out_w});")
        e("      }")
    else:
        # each thread its share of the expanded channels over whole images; the project convs'
        # partial sums meet after a barrier: thread 0's (bias and residual in) in y, the others'
        # in buffers of their own, added (then the activation) by all threads over pixel ranges
        planes = p.out_h * p.out_w * p.k
        e("    const int t = omp_get_thread_num();")
        e(f"    const long cs = (long)t * {ms};")
        e(f"    float *part = t && {int(p.project)} ? lines(sizeof(float) * {planes}) : 0;")
        e(f"    parts[t] = part; ok[t] = ring && d && (t == 0 || !{int(p.project)} || part);")
        e("    #pragma omp barrier")
        e("    int all = 1;")
        e(f"    for (int u = 0; u < {p.threads}; u++) all &= ok[u];")
        e("    if (!all) failed = 1;")
        e(f"    for (long img = 0; all && img < {p.n}; img++) {{")
        e(f"        const float *restrict xi = x + img * {p.h * p.w * p.c};")
        if not p.project:
            _rows(p, e, "0", str(p.out_h), "cs", "")
        else:
            e(f"        float *restrict yi = y + img * {planes};")
            e(f"        static const float nothing[{p.k}];")
            res = f"xi + i0 * {p.w * p.c}" if p.residual else "0"
            _rows(p, e, "0", str(p.out_h), "cs",
                  f"if (t == 0) project(d, w + {o['wp']}, w + {o['bp']}, {res}, yi + i0 * {p.out_w * p.k}, 0, "
                  f"gr * {p.out_w}); else project_part(d, w + {o['wp']} + cs * {p.k}, nothing, 0, "
                  f"part + i0 * {p.out_w * p.k}, 0, gr * {p.out_w});")
            e("        #pragma omp barrier")
            e(f"        const long lo = (long)t * {planes // L} / {p.threads} * {L}, "
              f"hi = (long)(t + 1) * {planes // L} / {p.threads} * {L};")
            e("        const vf zero = {0}; const vf six = zero + 6.f; (void)six;")
            e(f"        for (long q = lo; q < hi; q += {L}) {{")
            e("          vf v = ld(yi + q);")
            e(f"          for (int u = 1; u < {p.threads}; u++) v += ld(parts[u] + q);")
            e(f"          st(yi + q, {vector_expression(p.act_project)});")
            e("        }")
            e("        #pragma omp barrier")
        e("    }")
        e("    free(part);")
    e("    free(ring); free(d);")
    e("  }")
    e("  return failed;")
    e("}")
    return "\n".join(lines) + "\n"


class BlockKernel:
    """A built inverted-residual kernel; call it with contiguous NHWC tensors."""

    def __init__(self, plan: BlockPlan, target: Target):
        self.plan = plan
        self.function = cpu_build.pointer_function(plan.source, target, FUNCTION, 5, "inverted residual")
        self.function.restype = ctypes.c_int

    def __call__(self, x: Any, packed: np.ndarray, y: Any) -> bool:
        """y = the block of x; False where a thread could not allocate its buffers (y then holds
        garbage). The caller has checked shapes, dtype and memory format, and packed the weights
        with plan.pack."""
        return self.function(x.data_ptr(), packed.ctypes.data, None, None, y.data_ptr()) == 0
