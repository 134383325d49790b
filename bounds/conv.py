"""I/O lower bounds of direct convolution: the paper's symbolic derivation and numeric bounds.

All sizes are fp32 elements; S is the fast memory of one processor. The numeric bounds count
vertices exactly: a product that would read a padding position is never computed (padding is
not loaded), so |V| = 2*products - (outputs with a product) + (inputs read) + (weights used),
which is the paper's (2*kh*kw*C - 1)*Ho*Wo*K + H*W*C + kh*kw*C*K when nothing is padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import sqrt
from typing import Any

import sympy as sp

from maco.bounds.axis import spec_axes
from maco.bounds.pebble import PebbleBound, Stage, k_sym, multistage_bound
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec

# -- the symbolic derivation --------------------------------------------------------------------
C, K, H, W = sp.symbols("C K H W", positive=True)
Ho, Wo = sp.symbols("H_o W_o", positive=True)
kh, kw = sp.symbols("k_h k_w", positive=True)
R, S, Np, mu = sp.symbols("R S N_p mu", positive=True)
x, y, z = sp.symbols("x y z", positive=True)
lam = sp.Symbol("lambda_", real=True)
SYMBOLS = {str(s): s for s in (C, K, H, W, Ho, Wo, kh, kw, R, S, Np, mu, x, y, z)}


@dataclass(frozen=True)
class ConvDerivation:
    """Everything the paper derives for one direct conv, as sympy expressions.

    T / T_2S: largest subcomputation with a dominator of S / 2S vertices (eq. 6).
    Q_lower: S*(|V|/T(2S) - 1) (eq. 7); Q_leading: its leading term (eq. 8).
    Q_dataflow: loads + stores of the alpha=1 dataflow with an x*y*z output tile.
    conditions: x*y = R*z and x*y*z = S/Np, where Q_dataflow is least (Lagrange).
    optimum: x*y, z, Q_dataflow and the multiplier at that point.
    soap: the conv bound SOAP (spcl/dace) keeps as its reference, mu = stride.
    """

    V: sp.Expr
    stages: tuple[Stage, ...]
    pebble: PebbleBound
    T: sp.Expr
    T_2S: sp.Expr
    T_conditions: tuple[sp.Basic, ...]
    Q_lower: sp.Expr
    Q_leading: sp.Expr
    Q_dataflow: sp.Expr
    conditions: tuple[sp.Eq, ...]
    optimum: dict[str, sp.Expr]
    soap: sp.Expr
    symbols: dict[str, sp.Symbol] = field(default_factory=lambda: dict(SYMBOLS))


def _leading_in_S(expr: sp.Expr) -> sp.Expr:
    """The term of a sum with the highest power of S."""
    terms = sp.Add.make_args(sp.expand(expr))
    return max(terms, key=lambda t: t.as_coeff_exponent(S)[1])


def _leading_in_sizes(expr: sp.Expr) -> sp.Expr:
    """The terms of |V| of highest total degree in the problem sizes C, K, H, W, Ho, Wo."""
    poly = sp.Poly(sp.expand(expr), C, K, H, W, Ho, Wo)
    top = max(sum(m) for m in poly.monoms())
    return sum((coeff * sp.prod([g**e for g, e in zip(poly.gens, m)])
                for m, coeff in poly.terms() if sum(m) == top), sp.Integer(0))


@lru_cache(maxsize=1)
def derive_conv() -> ConvDerivation:
    """Derive the direct-conv bound and the dataflow's optimal tile conditions with sympy."""
    V = (2 * kh * kw * C - 1) * Ho * Wo * K + H * W * C + kh * kw * C * K
    phi1 = 2 * S * sp.sqrt(R * k_sym)
    stages = (Stage(phi1, phi1), Stage(k_sym - 1))
    pebble = multistage_bound(stages, V, S, samples={R: [1, 2.25, 4, 9, 49, 121]})
    if pebble.T is None:  # pragma: no cover - would mean sympy or scipy changed under us
        raise RuntimeError("no closed form found for the conv T(S)")
    T = pebble.T
    T_2S = sp.expand(T.subs(S, 2 * S))
    Q_lower = S * (V / T_2S - 1)
    Q_leading = sp.simplify(S * _leading_in_sizes(V) / _leading_in_S(T_2S))

    reads = (Ho * Wo * K / (x * y * z)) * kh * kw * C * (z + x * y / R)
    Q_dataflow = reads + Ho * Wo * K
    lagrangian = Q_dataflow - lam * (x * y * z - S / Np)
    solutions = sp.solve([sp.diff(lagrangian, x), sp.diff(lagrangian, z), x * y * z - S / Np],
                         [y, z, lam], dict=True)
    if len(solutions) != 1:  # pragma: no cover
        raise RuntimeError(f"expected one stationary point, sympy found {solutions}")
    sol = solutions[0]
    conditions = (sp.Eq(x * y, R * z), sp.Eq(x * y * z, S / Np))
    for cond in conditions + (sp.Eq(sp.diff(lagrangian, y), 0),):
        if sp.simplify((cond.lhs - cond.rhs).subs(sol)) != 0:  # pragma: no cover
            raise RuntimeError(f"the stationary point {sol} violates {cond}")
    optimum = {"xy": sp.simplify((x * y).subs(sol)), "z": sp.simplify(sol[z]),
               "Q": sp.simplify(Q_dataflow.subs(sol)), "lambda": sp.simplify(sol[lam])}
    soap = (K * Ho * Wo * S * mu * (2 * C * kh * kw - 1)
            / (2 * S * mu - mu + 8 * sp.sqrt(2) * sp.sqrt(kh) * S**sp.Rational(3, 2) * sp.sqrt(kw)))
    return ConvDerivation(V, stages, pebble, T, T_2S, tuple(pebble.conditions), Q_lower,
                          Q_leading, Q_dataflow, conditions, optimum, soap)


# -- numeric bounds ----------------------------------------------------------------------------
def _check_S(S_value: float) -> float:
    if isinstance(S_value, bool) or not isinstance(S_value, (int, float)) or not S_value > 0 \
            or S_value != S_value or S_value == float("inf"):
        raise MacoError(f"fast memory S must be a positive number of elements, got {S_value!r}")
    return float(S_value)


def max_reuse(spec: ConvSpec) -> float:
    """R: the most outputs of one filter that read one input element, counted exactly over the
    layer (dilation, stride, padding and borders included). For stride 1 it is kh*kw, the paper's
    R; for stride s > 1 it can exceed the paper's average kh*kw/s^2 (3x3, s=2: 4, not 2.25)."""
    rows, cols = spec_axes(spec)
    return float(rows.max_reuse * cols.max_reuse)


def pebble_T(R_value: float, S_value: float) -> float:
    """T(S) = 4*S*sqrt(R*S) + S - 1 for direct conv (derive_conv().T, checked in the tests)."""
    return 4 * S_value * sqrt(R_value * S_value) + S_value - 1


def vertex_count(spec: ConvSpec, per_group: bool = False) -> int:
    """|V| of the conv's CDAG, counted exactly (see the module docstring); one group if asked."""
    rows, cols = spec_axes(spec)
    cg, kg = spec.c_per_group, spec.k_per_group
    products = spec.n * kg * cg * rows.products * cols.products
    sums = spec.n * kg * rows.outputs_reading * cols.outputs_reading
    inputs = spec.n * cg * rows.inputs_read * cols.inputs_read
    weights = kg * cg * rows.taps_used * cols.taps_used
    one = 2 * products - sums + inputs + weights
    return one if per_group else one * spec.groups


def conv_io_lower_bound(spec: ConvSpec, S: float) -> float:
    """Eq. (7): S*(|V|/T(2S) - 1) loads + stores, per group (clipped at 0) and summed over groups.

    Summing per group is sound: the groups share no vertex, and restricting a pebbling of the
    whole conv to one group's vertices is a pebbling of that group with no more red pebbles."""
    s = _check_S(S)
    r = max(max_reuse(spec), 1.0)
    per_group = s * (vertex_count(spec, per_group=True) / pebble_T(r, 2 * s) - 1)
    return spec.groups * max(per_group, 0.0)


def compulsory_io(spec: ConvSpec) -> int:
    """Every input and weight that is read must be loaded once, every output stored once."""
    rows, cols = spec_axes(spec)
    inputs = spec.n * spec.c * rows.inputs_read * cols.inputs_read
    weights = spec.k * spec.c_per_group * rows.taps_used * cols.taps_used
    return inputs + weights + spec.output_elems


def gemm_io_leading(m: int, n: int, k: int, S: float) -> float:
    """2*m*n*k/sqrt(S): the leading term of the tight GEMM bound (Smith et al. 2019; COSMA,
    Kwasniewski et al. SC'19). An asymptote for large m, n, k, not a bound for every shape:
    an outer product (k = 1) with n < sqrt(S) moves only m + n + m*n elements."""
    return 2 * m * n * k / sqrt(_check_S(S))


def gemm_io_lower_bound(m: int, n: int, k: int, S: float) -> float:
    """A valid lower bound on the loads + stores of (m x k) @ (k x n) with S fast elements:
    max(sqrt(2)*m*n*k/sqrt(S) - 4*S, m*k + k*n + m*n).

    Proof of the first term: cut the run into phases of t = 4S loads + stores. An element a
    phase touches was in fast memory at its start, or is loaded, or (an output) is created in it
    and then stored or left in fast memory at its end: at most 2S + t elements. By Loomis-Whitney
    a phase does at most ((2S + t)/3)^(3/2) = (2S)^(3/2) multiply-adds, so there are at least
    m*n*k/(2S)^(3/2) - 1 full phases. The second term: every element is moved once."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise MacoError(f"GEMM size {name} must be a positive int, got {v!r}")
    s = _check_S(S)
    return max(sqrt(2) * m * n * k / sqrt(s) - 4 * s, float(m * k + k * n + m * n))


def conv_as_gemm(spec: ConvSpec) -> tuple[int, int, int] | None:
    """(m, n, k) of one group when the conv is a GEMM (a 1x1 kernel): m = output positions that
    read an input (all images), n = filters, k = channels of the group; None otherwise."""
    if spec.kh != 1 or spec.kw != 1:
        return None
    rows, cols = spec_axes(spec)
    m = spec.n * rows.outputs_reading * cols.outputs_reading
    return (m, spec.k_per_group, spec.c_per_group) if m else None


@dataclass(frozen=True)
class BoundReport:
    """Every lower bound MACO knows for one conv at one S (elements, loads + stores)."""

    S: float
    R: float
    V: int
    pebble: float  # eq. (7), per group summed
    compulsory: int
    gemm: float | None  # 1x1 conv: gemm_io_lower_bound per group, summed, + outputs reading no input
    gemm_leading: float | None  # 1x1 conv: the tight GEMM bound's 2mnk/sqrt(S) per group, summed
    leading: float  # eq. (8), kh*kw*C*Ho*Wo*K/(4*sqrt(2*R*S)) per group summed, for reference

    @property
    def best(self) -> float:
        """The largest valid bound (eq. 8's leading term is an asymptote, not a bound)."""
        return float(max(self.pebble, self.compulsory, self.gemm or 0.0))

    @property
    def best_kind(self) -> str:
        values = {"pebble": self.pebble, "compulsory": float(self.compulsory),
                  "gemm": self.gemm or 0.0}
        return max(values, key=values.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        return {"S": self.S, "R": self.R, "V": self.V, "pebble": self.pebble,
                "compulsory": self.compulsory, "gemm": self.gemm, "gemm_leading": self.gemm_leading,
                "leading": self.leading, "best": self.best, "best_kind": self.best_kind}


def bound_report(spec: ConvSpec, S: float) -> BoundReport:
    s = _check_S(S)
    r = max(max_reuse(spec), 1.0)
    gemm = gemm_leading = None
    shape = conv_as_gemm(spec)
    if shape is not None:
        m, n, k = shape
        gemm_leading = spec.groups * gemm_io_leading(m, n, k, s)
        gemm = spec.groups * gemm_io_lower_bound(m, n, k, s) + spec.output_elems - spec.groups * m * n
    leading = (spec.groups * spec.kh * spec.kw * spec.c_per_group * spec.k_per_group * spec.n
               * spec.out_h * spec.out_w / (4 * sqrt(2 * r * s)))
    return BoundReport(s, r, vertex_count(spec), conv_io_lower_bound(spec, s), compulsory_io(spec),
                       gemm, gemm_leading, leading)


def best_lower_bound(spec: ConvSpec, S: float) -> float:
    """The largest valid lower bound on loads + stores: eq. (7), compulsory, and GEMM for 1x1
    (eq. 8's and GEMM's leading terms are asymptotes and are left out)."""
    return bound_report(spec, S).best
