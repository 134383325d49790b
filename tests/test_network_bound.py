"""The network floor (maco.bounds.network): its sympy derivation against the numbers, the live-set
dynamic program against brute force over boundary sets, and soundness against an exact pebbling
of small networks found by brute force (tests/pebble_brute.py): never below the floor."""
from __future__ import annotations

import itertools
import math
import time

import pytest
import sympy as sp

from maco.bounds.network import (INPUT, WINOGRAD_TILES, NetLayer, cheapest, derive_network, layer_macs,
                                 live_sets, network_floor, spill, winograd_applies)
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from tests.pebble_brute import CDAG, conv_vertices, min_io


# -- small networks, as NetLayers and as CDAGs ----------------------------------------------------
def build(net: list[tuple[str, str, tuple[str, ...], ConvSpec | None]], image_shape: tuple[int, int, int]):
    """net: (name, "conv" or "add", inputs, spec); returns (NetLayers, image elements, CDAG)."""
    g = CDAG()
    c, h, w = image_shape
    tensors = {INPUT: [g.add() for _ in range(c * h * w)]}
    layers = []
    for i, (name, kind, inputs, spec) in enumerate(net):
        if kind == "conv":
            outs = conv_vertices(g, spec, tensors[inputs[0]], i)
        else:  # element-wise add of equal tensors
            a, b = (tensors[s] for s in inputs)
            outs = [g.add((u, v), i) for u, v in zip(a, b)]
        tensors[name] = outs
        layers.append(NetLayer(name, inputs, len(outs), spec if kind == "conv" else None, kind))
    return layers, c * h * w, g


def conv(c, h, w, k, kh=1, kw=1, pad=0, stride=1, groups=1):
    return ConvSpec(1, c, h, w, k, kh, kw, stride, (0, pad), 1, groups)


CHAIN = [("a", "conv", (INPUT,), conv(1, 1, 4, 1)), ("b", "conv", ("a",), conv(1, 1, 4, 1))]
WINDOW = [("a", "conv", (INPUT,), conv(1, 1, 3, 1)), ("b", "conv", ("a",), conv(1, 1, 3, 1, kw=2))]
SKIP = [("a", "conv", (INPUT,), conv(1, 1, 4, 1)), ("b", "conv", ("a",), conv(1, 1, 4, 1)),
        ("s", "add", ("a", "b"), None)]
THREE = [("a", "conv", (INPUT,), conv(1, 1, 4, 1)), ("b", "conv", ("a",), conv(1, 1, 4, 1)),
         ("c", "conv", ("b",), conv(1, 1, 4, 1))]
WIDE = [("a", "conv", (INPUT,), conv(1, 1, 2, 2)), ("b", "conv", ("a",), conv(2, 1, 2, 1))]
CASES = {"chain": (CHAIN, (1, 1, 4), 3), "window": (WINDOW, (1, 1, 3), 5), "skip": (SKIP, (1, 1, 4), 3),
         "three": (THREE, (1, 1, 4), 3), "wide": (WIDE, (1, 1, 2), 5), "chain_S4": (CHAIN, (1, 1, 4), 4)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_pebbling_is_never_below_the_floor(case):
    net, image_shape, S = CASES[case]
    layers, image, g = build(net, image_shape)
    floor = network_floor(layers, S, image)
    assert floor.q_any == floor.weights + image + floor.output == len(g.sources) + len(g.sinks)
    # statement 1: any schedule, recomputation included; cold and warm (the free game's states
    # grow fast: the two larger networks take minutes, so they check statement 2 only)
    if case not in ("three", "skip"):
        assert min_io(g, S) >= floor.q_any
        assert min_io(g, S, warm=True) >= max(0, floor.weights + image - S) + floor.output
    # statement 2: compute once, a layer at a time
    exact = min_io(g, S, once=True, layers=True)
    assert exact >= floor.q_cold
    assert min_io(g, S, once=True, layers=True, warm=True) >= floor.q_warm


def test_the_live_set_term_is_charged_where_it_must_be():
    """CHAIN at S = 3: four live elements before layer b, so one must be stored and loaded again
    (the floor charges 2 more than compulsory); with S = 4 nothing more: both as brute force says."""
    layers, image, g = build(CHAIN, (1, 1, 4))
    f3, f4 = network_floor(layers, 3, image), network_floor(layers, 4, image)
    assert (f3.spill, f4.spill) == (1, 0)
    assert f3.q_cold == f3.q_any + 2
    assert min_io(g, 3, once=True, layers=True) >= f3.q_cold
    # SKIP: a and b live before... only b's boundary is heavy: a is live there (4 elements)
    layers, image, g = build(SKIP, (1, 1, 4))
    assert network_floor(layers, 3, image).spill == 1
    # THREE: boundaries before b and c hold disjoint tensors, both charged
    layers, image, g = build(THREE, (1, 1, 4))
    f = network_floor(layers, 3, image)
    assert f.spill == 2 and sum(lf.spill for lf in f.layers) == 2
    assert min_io(g, 3, once=True, layers=True) >= f.q_cold


def _spill_by_brute_force(layers, S):
    live, tensors = live_sets(layers)
    bounds = sorted(live)
    best = 0
    for r in range(len(bounds) + 1):
        for chosen in itertools.combinations(bounds, r):
            if all(not any(b < p and e >= q for b, e, _ in tensors) for p, q in itertools.combinations(chosen, 2)):
                best = max(best, sum(max(0, live[p] - S) for p in chosen))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_spill_program_finds_the_best_disjoint_boundaries(seed):
    import random

    rnd = random.Random(seed)
    layers = []
    for i in range(rnd.randint(2, 9)):
        srcs = [INPUT] + [lyr.name for lyr in layers]
        picks = tuple(dict.fromkeys(rnd.sample(srcs[-3:], rnd.randint(1, min(2, len(srcs[-3:]))))))
        heavy = rnd.random() < 0.7
        layers.append(NetLayer(f"l{i}", picks, rnd.randint(1, 20),
                               conv(1, 1, 1, 1) if heavy else None, "conv" if heavy else "add"))
    for S in (1, 5, 12, 30):
        assert spill(layers, S)[0] == _spill_by_brute_force(layers, S)


def test_sympy_derivation_matches_the_numbers():
    d = derive_network()
    s = d.symbols
    for spec in (ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec(1, 32, 15, 15, 48, 5, 5, 1, 2)):
        macs = layer_macs(spec)
        assert macs["direct"] == d.macs_direct.subs({s["H_o"]: spec.out_h, s["W_o"]: spec.out_w, s["K"]: spec.k,
                                                     s["C"]: spec.c, s["r"]: spec.kh})
        for m in WINOGRAD_TILES[spec.kh]:
            want = d.macs_winograd.subs({s["H_o"]: spec.out_h, s["W_o"]: spec.out_w, s["K"]: spec.k,
                                         s["C"]: spec.c, s["r"]: spec.kh, s["m"]: m})
            assert macs[f"F({m}x{m},{spec.kh}x{spec.kh})"] == want
    # 3x3: F(2x2) 2.25x, F(4x4) 4x fewer multiplies; 5x5: 2.78x and 6.25x
    assert [d.winograd_ratio.subs({s["r"]: r, s["m"]: m}) for r, m in ((3, 2), (3, 4), (5, 2), (5, 4))] == \
        [sp.Rational(9, 4), 4, sp.Rational(25, 9), sp.Rational(25, 4)]
    layers, image, _ = build(THREE, (1, 1, 4))
    f = network_floor(layers, 3, image, peak=1e9, bandwidth=1e9)
    vals = {s["W"]: f.weights, s["X"]: image, s["Y"]: f.output, s["S"]: 3, s["Spill"]: f.spill,
            s["F"]: f.flops, s["P"]: 1e9, s["B"]: 1e9}
    assert d.q_cold.subs(vals) == f.q_cold and d.q_warm.subs(vals) == f.q_warm
    assert math.isclose(float(d.t_floor.subs(vals)), f.t)


def test_cheapest_algorithm_and_the_winograd_rule():
    three = ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1)
    assert cheapest(three) == ("F(4x4,3x3)", 14 * 14 * 36 * 64 * 64)
    assert cheapest(three, {}) == ("direct", three.macs)
    for spec in (ConvSpec(1, 64, 56, 56, 64, 3, 3, 2, 1), ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1, 1, 64),
                 ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 0), ConvSpec(1, 64, 56, 56, 64, 1, 1),
                 ConvSpec(1, 64, 56, 56, 64, 7, 7, 1, 3)):
        assert not winograd_applies(spec) and cheapest(spec)[0] == "direct"
    assert winograd_applies(ConvSpec(1, 3, 20, 20, 8, 5, 5, 1, 2))  # no vector-width condition: a floor


def test_winograd_tiles_are_the_kernels():
    from maco.kernels.winograd import TILE_SIZES, winograd_can_run

    assert dict(WINOGRAD_TILES) == dict(TILE_SIZES)
    for spec in (ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1), ConvSpec(1, 64, 14, 14, 64, 5, 5, 1, 2),
                 ConvSpec(1, 64, 56, 56, 64, 3, 3, 2, 1), ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1, 1, 64)):
        if winograd_can_run(spec, 16):  # where MACO runs it, the floor counts it
            assert winograd_applies(spec)


def test_refuses_bad_networks():
    a = NetLayer("a", (INPUT,), 4, conv(1, 1, 4, 1))
    with pytest.raises(MacoError, match="topological"):
        network_floor([NetLayer("b", ("a",), 4, conv(1, 1, 4, 1)), a], 3, 4)
    with pytest.raises(MacoError, match="repeated"):
        network_floor([a, a], 3, 4)
    with pytest.raises(MacoError, match="S"):
        network_floor([a], 0, 4)
    with pytest.raises(MacoError, match="peak"):
        network_floor([a], 3, 4, peak=-1.0)
    with pytest.raises(MacoError, match="at least one"):
        network_floor([], 3, 4)


def test_built_in_networks_floor():
    """The DAG the command builds: ResNet-18's weights are its parameters less BatchNorm's, every
    live set fits 32 MiB at batch 1, and the floor's flops count Winograd on its 3x3 stride-1 convs."""
    from maco.core.target import Target
    from maco.layouts.network_floor import fast_memory, floor_of, network_dag

    layers, image = network_dag("resnet18")
    assert image == 3 * 224 * 224
    assert sum(lyr.weights for lyr in layers) == 11_678_912  # convs + fc weights, no biases or BN
    assert sum(1 for lyr in layers if lyr.kind == "conv") == 20
    f = floor_of("resnet18", Target.host(), peak=1e11, bandwidth=2e10, S=8 << 20)
    assert f.spill == 0 and f.max_live == 2 * 64 * 56 * 56
    assert f.flops < f.flops_direct / 2
    assert f.t == max(f.flops / 1e11, 4 * f.q_warm / 2e10)
    small = floor_of("resnet18", Target.host(), S=100_000)  # a tiny cache: the live sets spill
    assert small.spill > 0 and small.q_cold > f.q_cold
    assert fast_memory(Target.host()) > 0


def test_the_brute_force_is_exact_on_a_hand_count():
    """The reference itself: CHAIN at S = 3, a layer at a time, computing once: load w_a, then per
    input load x_i and compute a_i; three of the four a_i must be stored and loaded back (the last
    step of layer a holds w_a, x_4, a_4), w_b loaded, four outputs stored: 6 + 4 + 2*3 = 16."""
    _, _, g = build(CHAIN, (1, 1, 4))
    t0 = time.perf_counter()
    assert min_io(g, 3, once=True, layers=True) == 16
    assert min_io(g, 4, once=True, layers=True) == 6 + 4 + 2 * 2  # one more red: a_1..a_2 spill
    assert time.perf_counter() - t0 < 60


def test_a_conv_floor_is_its_cheapest_multiplies_or_its_weights_from_memory():
    from maco.bounds.network import conv_floor
    peak, bw = 500e9, 80e9
    wino = ConvSpec.parse("n1_c64_h56_w56_k64_r3x3_p1")  # compute binds: F(4x4)'s multiplies
    algo, t = conv_floor(wino, peak, bw)
    assert (algo, t) == (cheapest(wino)[0], 2 * cheapest(wino)[1] / peak)
    assert algo == "F(4x4,3x3)" and t < 2 * wino.macs / peak
    fc = ConvSpec.parse("n1_c2048_h1_w1_k1000_r1x1")  # a classifier: its weights bind
    assert conv_floor(fc, peak, bw) == ("direct", 4 * fc.weight_elems / bw)
    assert conv_floor(wino, peak, bw, tiles={}) == ("direct", 2 * wino.macs / peak)
    for bad in (0, -1.0, float("inf"), True, "5e11"):
        with pytest.raises(MacoError, match="peak must be a positive number"):
            conv_floor(wino, bad, bw)
    with pytest.raises(MacoError, match="bandwidth must be a positive number"):
        conv_floor(wino, peak, 0)


def test_a_models_floor_and_its_kernels_own_floors():
    import torch
    from torch import nn

    from maco.bounds.network import conv_floor
    from maco.core.target import Target
    from maco.layouts.network_floor import dag_of, fast_memory, model_floor

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, stride=2, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()
    x = torch.randn(1, 16, 20, 20)
    a, b = ConvSpec.parse("n1_c16_h20_w20_k32_r3x3_p1"), ConvSpec.parse("n1_c32_h20_w20_k32_r3x3_s2_p1")
    target = Target.host()
    f = model_floor(model, x, {"0": (a,), "block": (a, b)}, target, 4e11, 6e10)
    layers, image = dag_of(model, x)
    assert f.seconds == network_floor(layers, fast_memory(target), image, peak=4e11, bandwidth=6e10).t > 0
    assert f.per_conv["0"] == conv_floor(a, 4e11, 6e10)[1]
    assert f.per_conv["block"] == conv_floor(a, 4e11, 6e10)[1] + conv_floor(b, 4e11, 6e10)[1]
    assert f.algorithms == {"0": "F(4x4,3x3)", "block": "F(4x4,3x3)+direct"}
    assert f.to_dict()["per_conv_s"] == f.per_conv and f.to_dict()["network_s"] == f.seconds
    assert f.reach is None and f.to_dict()["reach_s"] is None  # no shares timed: no reach
    from maco.bounds.winograd import network_reach

    shares = {(2, 3): 0.8, (4, 3): 0.7}
    r = model_floor(model, x, {}, target, 4e11, 6e10, shares, 0.4)
    assert r.reach == network_reach(layers, 4e11, 6e10, shares, depthwise_share=0.4) >= r.seconds > 0
    assert r.to_dict()["reach_s"] == r.reach
