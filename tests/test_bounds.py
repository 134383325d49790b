"""maco.bounds: the symbolic derivation (sympy identities), the multi-stage engine on hand-solved
chains, and the numeric bounds against brute-force counts over the layer."""
from __future__ import annotations

import itertools
import random
from math import sqrt

import pytest
import sympy as sp

from maco.core import geometry
from maco import ConvSpec, MacoError
from maco import bounds
from maco.bounds import conv as cb
from maco.bounds.pebble import S_sym, Stage, k_sym, multistage_bound


# -- the derivation ---------------------------------------------------------------------------
_t = sp.Symbol("t", positive=True)


def _scaled(expr: sp.Expr) -> sp.Expr:
    """Every problem size (channels, filters, image) times t."""
    return expr.subs({v: _t * v for v in (cb.C, cb.K, cb.H, cb.W, cb.Ho, cb.Wo)}, simultaneous=True)


@pytest.fixture(scope="module")
def d():
    return bounds.derive_conv()


def test_T_is_the_papers(d):
    S, R = cb.S, cb.R
    assert sp.simplify(d.T - (4 * S * sp.sqrt(R * S) + S - 1)) == 0
    assert sp.simplify(d.T_2S - (8 * S * sp.sqrt(2 * R * S) + 2 * S - 1)) == 0
    # the maximising split puts all of S in the first stage, valid while 4*R*S >= 1
    assert d.pebble.split == (S, 0)
    cond = d.T_conditions[-1]
    assert cond.subs({R: 1, S: 1}) == sp.true and cond.subs({R: sp.Rational(1, 8), S: 1}) == sp.false


def test_numeric_T_matches_symbolic(d):
    for r, s in [(1, 64), (9, 8192), (2.25, 1000), (121, 7)]:
        assert bounds.pebble_T(r, s) == pytest.approx(float(d.T.subs({cb.R: r, cb.S: s})), rel=1e-12)
        assert d.pebble.T_at(s, {cb.R: r}) == pytest.approx(bounds.pebble_T(r, s), rel=1e-12)


def test_leading_term_is_eq8(d):
    C, K, Ho, Wo, kh, kw, R, S = cb.C, cb.K, cb.Ho, cb.Wo, cb.kh, cb.kw, cb.R, cb.S
    eq8 = kh * kw * C * Ho * Wo * K / (4 * sp.sqrt(2 * R * S))
    assert sp.simplify(d.Q_leading - eq8) == 0
    # and it is the limit of the full bound: all sizes grow (by t), then S
    ratio = sp.limit(_scaled(d.Q_lower / eq8), _t, sp.oo)
    assert sp.limit(ratio, S, sp.oo) == 1


def test_against_soap_reference(d):
    """SOAP's conv bound is S*(computed vertices)/T(2S) with mu = stride and R = kh*kw/mu^2: it
    counts only the (2*C*kh*kw - 1)*Ho*Wo*K computed vertices and drops the '- 1'. So the two
    differ by exactly S*(H*W*C + kh*kw*C*K)/T(2S) - S (the input vertices and eq. 7's -S), and
    their ratio tends to 1 as the sizes grow, for every S."""
    C, K, H, W, kh, kw, mu, R, S = cb.C, cb.K, cb.H, cb.W, cb.kh, cb.kw, cb.mu, cb.R, cb.S
    ours = d.Q_lower.subs(R, kh * kw / mu**2)
    T2 = d.T_2S.subs(R, kh * kw / mu**2)
    expected_gap = S * (H * W * C + kh * kw * C * K) / T2 - S
    assert sp.simplify(ours - d.soap - expected_gap) == 0
    assert sp.limit(_scaled(ours / d.soap), _t, sp.oo) == 1
    # numerically too, at a ResNet layer (stride 1, so R = 9 both ways)
    vals = {C: 64, K: 64, H: 56, W: 56, cb.Ho: 56, cb.Wo: 56, kh: 3, kw: 3, mu: 1, S: 8192}
    assert float(ours.subs(vals)) == pytest.approx(float((d.soap + expected_gap).subs(vals)), rel=1e-12)


def test_dataflow_optimum(d):
    x, y, z, R, S, Np = cb.x, cb.y, cb.z, cb.R, cb.S, cb.Np
    assert [sp.simplify(c.lhs - c.rhs) for c in d.conditions] == [x * y - R * z, x * y * z - S / Np]
    assert sp.simplify(d.optimum["xy"] - sp.sqrt(R * S / Np)) == 0
    assert sp.simplify(d.optimum["z"] - sp.sqrt(S / (Np * R))) == 0
    # hand: Q = A*(1/(xy) + 1/(R z)) + Ho*Wo*K with A = Ho*Wo*K*kh*kw*C; at xy = R z = sqrt(RS/Np)
    A = cb.Ho * cb.Wo * cb.K * cb.kh * cb.kw * cb.C
    assert sp.simplify(d.optimum["Q"] - (2 * A / sp.sqrt(R * S / Np) + cb.Ho * cb.Wo * cb.K)) == 0
    # it is a minimum: random feasible points (x*y*z = S/Np) never do better
    rng = random.Random(0)
    vals = {cb.Ho: 28, cb.Wo: 28, cb.K: 128, cb.kh: 3, cb.kw: 3, cb.C: 128, R: 9, S: 8192, Np: 2}
    q = sp.lambdify((x, y, z), d.Q_dataflow.subs(vals))
    best = float(d.optimum["Q"].subs(vals))
    for _ in range(200):
        xv, yv = rng.uniform(0.5, 200), rng.uniform(0.5, 200)
        zv = 4096 / (xv * yv)
        assert q(xv, yv, zv) >= best * (1 - 1e-12)


# -- the engine on hand-solved chains -------------------------------------------------------------
def test_engine_linear_three_stages():
    # phi = 2k, 3k, k; psi = k, k: objective 6*k1 + 4*k2 + k3 -> all of S in k1: T = S + 6S
    st = [Stage(2 * k_sym, k_sym), Stage(3 * k_sym, k_sym), Stage(k_sym)]
    b = multistage_bound(st, sp.Symbol("V"))
    assert sp.simplify(b.T - 7 * S_sym) == 0
    assert sp.simplify(b.Q_lower - S_sym * (sp.Symbol("V") / (14 * S_sym) - 1)) == 0


def test_engine_interior_optimum():
    # f(t) = 4*sqrt(t) + (S - t): stationary at t = 4, so T = S + S + 4 for S >= 4
    st = [Stage(4 * sp.sqrt(k_sym), sp.Integer(0)), Stage(k_sym)]
    b = multistage_bound(st, sp.Symbol("V"))
    assert sp.simplify(b.T - (2 * S_sym + 4)) == 0
    assert b.split == (4, S_sym - 4)


def test_engine_numeric_fallback():
    # three concave stages share S evenly: max 3*sqrt(S/3) = sqrt(3S), no simplex vertex wins
    st = [Stage(sp.sqrt(k_sym), sp.Integer(0)), Stage(sp.sqrt(k_sym), sp.Integer(0)), Stage(sp.sqrt(k_sym))]
    b = multistage_bound(st, sp.Symbol("V"))
    assert b.T is None and b.Q_lower is None
    for s in (3.0, 300.0, 3e4):
        assert b.T_at(s) == pytest.approx(s + sqrt(3 * s), rel=1e-5)
    assert b.Q_at(300.0, {sp.Symbol("V"): 1e6}) == pytest.approx(300 * (1e6 / (600 + sqrt(1800)) - 1), rel=1e-5)


def test_engine_errors():
    with pytest.raises(MacoError):
        multistage_bound([], sp.Symbol("V"))
    with pytest.raises(MacoError, match="psi"):
        multistage_bound([Stage(k_sym, k_sym)], sp.Symbol("V"))
    with pytest.raises(MacoError, match="R"):
        multistage_bound([Stage(sp.Symbol("R") * k_sym)], sp.Symbol("V"))


# -- brute-force references over a layer ----------------------------------------------------------
def _products(spec: ConvSpec):
    """Every (n, g, k, c, oh, ow, i, j, ih, iw) multiply-add that reads a real input."""
    for n, g, k, c, oh, ow, i, j in itertools.product(
            range(spec.n), range(spec.groups), range(spec.k_per_group), range(spec.c_per_group),
            range(spec.out_h), range(spec.out_w), range(spec.kh), range(spec.kw)):
        ih = oh * spec.stride[0] + i * spec.dilation[0] - spec.padding[0]
        iw = ow * spec.stride[1] + j * spec.dilation[1] - spec.padding[1]
        if 0 <= ih < spec.h and 0 <= iw < spec.w:
            yield n, g, k, c, oh, ow, i, j, ih, iw


def random_specs(count: int, seed: int, max_hw: int = 9) -> list[ConvSpec]:
    rng = random.Random(seed)
    out: list[ConvSpec] = []
    while len(out) < count:
        kh = rng.choice([1, 2, 3, 3, 5])
        kw = rng.choice([kh, kh, 1, 3])
        g = rng.choice([1, 1, 2, 3])
        try:
            out.append(ConvSpec(rng.choice([1, 1, 2]), g * rng.randint(1, 3), rng.randint(2, max_hw),
                                rng.randint(2, max_hw), g * rng.randint(1, 3), kh, kw,
                                (rng.choice([1, 1, 2, 3]), rng.choice([1, 2])),
                                (rng.choice([0, 1, 2]), rng.choice([0, 1])),
                                (rng.choice([1, 1, 2]), rng.choice([1, 2])), g))
        except MacoError:
            continue
    return out


@pytest.mark.parametrize("spec", random_specs(25, seed=1), ids=str)
def test_counts_against_brute_force(spec):
    inputs, weights, outputs_read, reuse_count = set(), set(), set(), {}
    products = 0
    for n, g, k, c, oh, ow, i, j, ih, iw in _products(spec):
        products += 1
        cin, kout = g * spec.c_per_group + c, g * spec.k_per_group + k
        inputs.add((n, cin, ih, iw))
        weights.add((kout, c, i, j))
        outputs_read.add((n, kout, oh, ow))
        key = (n, cin, ih, iw, kout)  # outputs of one filter reading one input element
        reuse_count[key] = reuse_count.get(key, 0) + 1
    assert bounds.compulsory_io(spec) == len(inputs) + len(weights) + spec.output_elems
    assert bounds.vertex_count(spec) == 2 * products - len(outputs_read) + len(inputs) + len(weights)
    assert bounds.max_reuse(spec) == max(reuse_count.values(), default=0)


def test_vertex_count_is_the_papers_without_padding():
    spec = ConvSpec(2, 6, 9, 8, 4, 3, 2)
    paper = ((2 * 3 * 2 * 6 - 1) * spec.out_h * spec.out_w * 4 + 9 * 8 * 6) * 2 + 3 * 2 * 6 * 4
    assert bounds.vertex_count(spec) == paper


@pytest.mark.parametrize("shape,expected", [
    (dict(kh=3, kw=3), 9), (dict(kh=3, kw=3, stride=2), 4), (dict(kh=1, kw=1, stride=2), 1),
    (dict(kh=3, kw=3, dilation=2), 9), (dict(kh=3, kw=3, stride=2, dilation=2), 9),
    (dict(kh=7, kw=7, stride=2), 16), (dict(kh=11, kw=11, stride=4), 9), (dict(kh=5, kw=1), 5)])
def test_reuse_by_hand(shape, expected):
    """Per axis: the taps i with i*dilation = r (mod stride) hit one input row r; the most of
    them over r is ceil(k*gcd(d, s)/s) when k*d fits the image."""
    spec = ConvSpec(1, 4, 40, 40, 4, padding=2, **shape)
    assert bounds.max_reuse(spec) == expected
    assert geometry.paper_reuse(ConvSpec(1, 4, 40, 40, 4, kh=3, kw=3, stride=2)) == 2.25


def test_eq7_by_hand():
    spec = ConvSpec(1, 64, 58, 58, 64, 3, 3)  # no padding: the paper's |V|
    S = 2048
    V = (2 * 9 * 64 - 1) * 56 * 56 * 64 + 58 * 58 * 64 + 9 * 64 * 64
    T2 = 8 * S * sqrt(2 * 9 * S) + 2 * S - 1
    assert bounds.conv_io_lower_bound(spec, S) == pytest.approx(S * (V / T2 - 1), rel=1e-12)
    # eq. 8 is its asymptote: within the 2S-1 and |V| lower-order terms
    lead = 9 * 64 * 56 * 56 * 64 / (4 * sqrt(2 * 9 * S))
    assert bounds.bound_report(spec, S).leading == pytest.approx(lead)
    assert 0.9 < bounds.conv_io_lower_bound(spec, S) / lead < 1.0


def test_groups_and_batch():
    dense = ConvSpec(1, 8, 20, 20, 8, 3, 3, padding=1)
    grouped = ConvSpec(1, 32, 20, 20, 32, 3, 3, padding=1, groups=4)
    S = 16
    assert bounds.conv_io_lower_bound(grouped, S) == pytest.approx(4 * bounds.conv_io_lower_bound(dense, S))
    depthwise = ConvSpec(1, 16, 20, 20, 16, 3, 3, padding=1, groups=16)
    assert bounds.compulsory_io(depthwise) == 16 * 400 + 16 * 9 + 16 * 400
    batched = dense.with_batch(3)
    assert bounds.vertex_count(batched) == 3 * bounds.vertex_count(dense) - 2 * 9 * 8 * 8
    assert bounds.conv_io_lower_bound(batched, S) > 3 * bounds.conv_io_lower_bound(dense, S)


def test_gemm_bounds():
    spec = ConvSpec(2, 32, 7, 5, 16, 1, 1)
    assert bounds.conv_as_gemm(spec) == (70, 16, 32)
    assert bounds.conv_as_gemm(ConvSpec(1, 4, 8, 8, 4, 3, 3)) is None
    strided = ConvSpec(1, 8, 9, 9, 4, 1, 1, stride=2, padding=1)  # outputs 5x5; border rows read padding
    assert bounds.conv_as_gemm(strided) == (16, 4, 8)
    S = 64
    rep = bounds.bound_report(spec, S)
    assert rep.gemm_leading == pytest.approx(2 * 70 * 16 * 32 / 8)
    assert bounds.gemm_io_lower_bound(70, 16, 32, S) == max(sqrt(2) * 70 * 16 * 32 / 8 - 4 * S,
                                                            70 * 32 + 32 * 16 + 70 * 16)
    assert rep.gemm == bounds.gemm_io_lower_bound(70, 16, 32, S)
    assert rep.best == max(rep.pebble, rep.compulsory, rep.gemm)
    assert bounds.best_lower_bound(spec, S) == rep.best


@pytest.mark.parametrize("bad", [0, -3, float("nan"), float("inf"), "8192", True, None])
def test_bad_S_is_named(bad):
    with pytest.raises(MacoError, match="S must be a positive"):
        bounds.conv_io_lower_bound(ConvSpec(1, 4, 8, 8, 4, 3, 3), bad)
    with pytest.raises(MacoError, match="S must be a positive"):
        bounds.best_lower_bound(ConvSpec(1, 4, 8, 8, 4, 3, 3), bad)


def test_bad_gemm_size_is_named():
    with pytest.raises(MacoError, match="GEMM size k"):
        bounds.gemm_io_lower_bound(4, 4, 0, 16)
