"""A multi-stage red-blue pebble bound (the MACO paper, eq. 2-7).

A computation is a chain of stages. Stage j computes at most phi_j(a) of its vertices from a
inputs; psi_j(a) of those feed stage j+1. A subcomputation whose dominator holds S vertices
(k_j of them fresh inputs of stage j) therefore contains at most

    T(S) = S + max_{k_1 + ... + k_m <= S, k_j >= 0} sum_j phi_j(a_j),
    a_1 = k_1,   a_j = k_j + psi_{j-1}(a_{j-1}),

vertices (eq. 6), and any pebbling of |V| vertices with S red pebbles needs
Q >= S * (|V| / T(2S) - 1) loads and stores (eq. 7).

The maximum over the split of S is found symbolically where sympy can (candidate splits:
simplex vertices and, for two stages, the critical points on the face sum = S), and every
symbolic answer is checked against a numeric maximisation at sample points; otherwise T is
evaluated numerically (`PebbleBound.T_at`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import sympy as sp
from scipy.optimize import minimize

from maco.core.errors import MacoError

k_sym = sp.Symbol("k", nonnegative=True)
S_sym = sp.Symbol("S", positive=True)

DEFAULT_S_SAMPLES = (4.0, 64.0, 4096.0, 2.0**20)


@dataclass(frozen=True)
class Stage:
    """phi: most vertices of this stage computable from k inputs; psi: how many of them feed
    the next stage (None for the last stage). Both are sympy expressions of `k` and `S`."""

    phi: sp.Expr
    psi: sp.Expr | None = None


@dataclass
class PebbleBound:
    """T(S) and the bound Q(S) >= S*(|V|/T(2S) - 1); T is None when no closed form was found."""

    stages: tuple[Stage, ...]
    V: sp.Expr
    S: sp.Symbol
    T: sp.Expr | None  # closed form of T(S), or None
    split: tuple[sp.Expr, ...] | None  # the maximising k_1..k_m (closed form)
    conditions: list[sp.Basic] = field(default_factory=list)  # where the closed form holds
    checked_at: list[dict[str, float]] = field(default_factory=list)  # numeric checks passed

    @property
    def Q_lower(self) -> sp.Expr | None:
        """S*(|V|/T(2S) - 1) in closed form (None if T has none)."""
        if self.T is None:
            return None
        return self.S * (self.V / self.T.subs(self.S, 2 * self.S) - 1)

    def T_at(self, S: float, values: Mapping[sp.Symbol, float] | None = None) -> float:
        """T(S) at a number, through the closed form when there is one, else numerically."""
        values = dict(values or {})
        if self.T is not None:
            return float(self.T.subs({**values, self.S: S}))
        return S + _numeric_max(self.stages, self.S, S, values)[0]

    def Q_at(self, S: float, values: Mapping[sp.Symbol, float] | None = None) -> float:
        values = dict(values or {})
        V = float(self.V.subs({**values, self.S: S}))
        return S * (V / self.T_at(2 * S, values) - 1)


def _objective(stages: Sequence[Stage], ks: Sequence[sp.Expr]) -> sp.Expr:
    """sum_j phi_j(a_j) with a_1 = k_1, a_j = k_j + psi_{j-1}(a_{j-1})."""
    total, carry = sp.Integer(0), sp.Integer(0)
    for stage, kj in zip(stages, ks):
        a = kj + carry
        total += stage.phi.subs(k_sym, a)
        carry = stage.psi.subs(k_sym, a) if stage.psi is not None else sp.Integer(0)
    return total


def _numeric_max(stages: Sequence[Stage], S_symbol: sp.Symbol, S: float,
                 values: Mapping[sp.Symbol, float]) -> tuple[float, np.ndarray]:
    """max of the objective over {k >= 0, sum k <= S}: vertices, a grid, then SLSQP from the best."""
    m = len(stages)
    ks = sp.symbols(f"k1:{m + 1}", nonnegative=True)
    expr = _objective(stages, ks).subs({**values, S_symbol: S})
    free = expr.free_symbols - set(ks)
    if free:
        raise MacoError(f"give numeric values for {sorted(map(str, free))} to evaluate T(S)")
    f = sp.lambdify(ks, expr, "numpy")

    def value(v: np.ndarray) -> float:
        with np.errstate(all="ignore"):
            out = float(np.real(f(*np.maximum(v, 0.0))))
        return out if np.isfinite(out) else -np.inf

    # search over the unit simplex u = k/S, the objective scaled to about 1, so SLSQP's
    # tolerances mean the same at S = 4 and S = 2^20
    steps = 24 if m <= 2 else (10 if m == 3 else 4)
    grid = [np.array(c, dtype=float) / steps
            for c in itertools.product(range(steps + 1), repeat=m) if sum(c) <= steps]
    scored = sorted(grid, key=lambda u: value(u * S), reverse=True)
    best = scored[0]
    scale = max(abs(value(best * S)), 1.0)
    for start in scored[:3]:
        res = minimize(lambda u: -value(u * S) / scale, start, method="SLSQP",
                       bounds=[(0.0, 1.0)] * m, options={"ftol": 1e-14, "maxiter": 500},
                       constraints=[{"type": "ineq", "fun": lambda u: 1.0 - np.sum(u)}])
        u = np.clip(res.x, 0.0, 1.0)
        if np.sum(u) > 1.0:
            u = u / np.sum(u)
        if value(u * S) > value(best * S):
            best = u
    return value(best * S), best * S


def _candidates(stages: Sequence[Stage], S: sp.Symbol) -> list[tuple[sp.Expr, ...]]:
    """Splits that may maximise the objective: all vertices of the simplex and, for two stages,
    the stationary points of k_1 -> objective(k_1, S - k_1)."""
    m = len(stages)
    out: list[tuple[sp.Expr, ...]] = [tuple(sp.Integer(0) for _ in range(m))]
    for j in range(m):
        out.append(tuple(S if i == j else sp.Integer(0) for i in range(m)))
    if m == 2:
        t = sp.Symbol("t", positive=True)
        g = _objective(stages, (t, S - t))
        try:
            for root in sp.solve(sp.diff(g, t), t):
                out.append((root, S - root))
        except (NotImplementedError, ValueError, TypeError):
            pass
    return out


def multistage_bound(stages: Sequence[Stage], V: sp.Expr, S: sp.Symbol = S_sym,
                     samples: Mapping[sp.Symbol, Sequence[float]] | None = None,
                     S_samples: Sequence[float] = DEFAULT_S_SAMPLES,
                     feasible: Sequence[sp.Basic] = ()) -> PebbleBound:
    """T(S) and Q >= S*(|V|/T(2S) - 1) for a chain of stages.

    `samples` gives values of the other symbols (e.g. R) at which a closed-form candidate is
    checked against a numeric maximisation; `feasible` lists assumptions on the symbols
    (e.g. R >= 1) that the returned conditions may use."""
    stages = tuple(stages)
    if not stages:
        raise MacoError("a pebble bound needs at least one stage")
    if stages[-1].psi is not None:
        raise MacoError("the last stage feeds nothing: its psi must be None")
    samples = dict(samples or {})
    others = sorted(set().union(*(st.phi.free_symbols | (st.psi.free_symbols if st.psi is not None
                                                         else set()) for st in stages))
                    - {k_sym, S}, key=str)
    missing = [s for s in others if s not in samples]
    if missing:
        raise MacoError(f"give sample values for {[str(s) for s in missing]}")
    points = [{**dict(zip(others, combo)), S: s_val}
              for combo in itertools.product(*(samples[s] for s in others)) for s_val in S_samples]
    reference = [_numeric_max(stages, S, float(p[S]), {s: p[s] for s in others})[0]
                 for p in points]
    ks = sp.symbols(f"k1:{len(stages) + 1}", nonnegative=True)
    for split in _candidates(stages, S):
        value = _objective(stages, split)
        ok = True
        for point, ref in zip(points, reference):
            num_split = [complex(sp.N(c.subs(point))) for c in split]
            if any(abs(c.imag) > 1e-9 or c.real < -1e-9 for c in num_split) or \
                    sum(c.real for c in num_split) > float(point[S]) * (1 + 1e-9):
                ok = False
                break
            got = float(sp.N(value.subs(point)))
            if got < ref * (1 - 1e-6) - 1e-9:
                ok = False
                break
        if ok:
            T = sp.simplify(S + value)
            conditions = _optimality_conditions(stages, split, S, feasible, ks)
            return PebbleBound(stages, V, S, T, split, conditions,
                               [{str(k): float(v) for k, v in p.items()} for p in points])
    return PebbleBound(stages, V, S, None, None, [], [])


def _optimality_conditions(stages: Sequence[Stage], split: tuple[sp.Expr, ...], S: sp.Symbol,
                           feasible: Sequence[sp.Basic], ks: Sequence[sp.Symbol]) -> list[sp.Basic]:
    """For two stages at the vertex k_1 = S: the objective along k_1 + k_2 = S rises up to S,
    i.e. d/dk_1 objective(k_1, S - k_1) >= 0 at k_1 = S (sufficient when it is concave)."""
    out: list[sp.Basic] = [sp.Eq(kj, sj) for kj, sj in zip(ks, split)]
    if len(stages) == 2 and split[0] == S:
        t = sp.Symbol("t", positive=True)
        slope = sp.simplify(sp.diff(_objective(stages, (t, S - t)), t).subs(t, S))
        out.append(sp.simplify(slope >= 0))
    return out + list(feasible)
