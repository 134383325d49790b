"""Winograd inside the bound (maco.bounds.winograd): its counts against the kernel's own packed
filters and a direct count of tiles, the sympy crossover against the numeric model (each tile
size's time the longer of its compute and its DRAM traffic), and the tile
size it predicts (F(4x4) on large feature maps, F(2x2) on 7x7 deep layers)."""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from maco.bounds.winograd import crossover, layer_reach, network_reach, predict_tile, winograd_cost
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec


@pytest.mark.parametrize("m", [2, 4])
def test_counts_match_the_kernel(m):
    from maco.kernels.winograd import WinogradPlan

    spec = ConvSpec(1, 16, 9, 11, 64, 3, 3, 1, 1)
    cost = winograd_cost(spec, m)
    u = WinogradPlan(spec, m=m).pack_weight(np.ones(spec.weight_shape, dtype=np.float32))
    assert u.size == cost.u == (m + 2) ** 2 * 16 * 64
    tiles = len(range(0, spec.out_h, m)) * len(range(0, spec.out_w, m))
    assert cost.tiles == tiles and cost.macs == tiles * (m + 2) ** 2 * 16 * 64
    assert cost.block_footprint(6) == 6 * (m + 2) ** 2 * (16 + 64)
    assert cost.dram() == cost.u + spec.input_elems + spec.output_elems


@pytest.mark.parametrize("e2,e4", [(1.0, 1.0), (0.86, 0.67), (0.9, 0.5)])
def test_crossover_is_the_model(e2, e4):
    d = crossover()
    s = {str(x): x for x in d["t2"].free_symbols | d["t4"].free_symbols}
    P, B = 96e9, 20e9
    ceil = {s["e_2"]: e2, s["e_4"]: e4}
    area = float(d["area"].subs({s["C"]: 256, s["K"]: 256, s["P"]: P, s["B"]: B, **ceil}))
    x = sp.Symbol("x", positive=True)  # many channels: the area tends to 18 * e_2 * P / B
    assert sp.simplify(sp.limit(d["area"].subs({s["C"]: x, s["K"]: x}), x, sp.oo) - d["area_limit"]) == 0
    assert area == pytest.approx(float(d["area_limit"].subs({s["P"]: P, s["B"]: B, **ceil})), rel=0.05)
    picks = set()
    for side in (4, 8, 12, 16, 20, 28, 56):  # whole tiles both: the model's pick on either side of the crossover
        spec = ConvSpec(1, 256, side, side, 256, 3, 3, 1, 1)
        m, times = predict_tile(spec, P, B, {(2, 3): e2, (4, 3): e4})
        vals = {s["C"]: 256, s["K"]: 256, s["H_o"]: side, s["W_o"]: side, s["P"]: P, s["B"]: B, **ceil}
        assert float(d["t2"].subs(vals)) == pytest.approx(times[2])
        assert float(d["t4"].subs(vals)) == pytest.approx(times[4])
        # where F(4x4) computes no faster (16 e_4 <= 9 e_2), F(2x2) wins everywhere
        assert m == (4 if 16 * e4 > 9 * e2 and side * side > area else 2)
        picks.add(m)
    assert picks == ({2, 4} if 16 * e4 > 9 * e2 else {2})


def test_ceilings_price_the_multiplies():
    spec = ConvSpec(1, 128, 28, 28, 128, 3, 3, 1, 1)
    cost = winograd_cost(spec, 4)
    P, B = 100e9, 20e9
    assert cost.seconds(P, B) == pytest.approx(max(2 * cost.macs / P, 4 * cost.dram() / B))
    assert cost.seconds(P, 1e15, 0.5) == pytest.approx(2 * 2 * cost.macs / P)  # compute-bound
    assert cost.seconds(P, 1e9, 0.5) == pytest.approx(4 * cost.dram() / 1e9)  # memory-bound
    # a compute-bound layer: F(4x4) at full peak, F(2x2) where F(4x4) reaches too little of it
    assert predict_tile(spec, P, 1e15)[0] == 4
    assert predict_tile(spec, P, 1e15, {(2, 3): 1.0, (4, 3): 0.5})[0] == 2
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(MacoError, match="share of the FMA peak"):
            cost.seconds(P, B, bad)


def test_predicted_tiles_on_resnet_layers():
    P, B = 96e9, 20e9
    assert predict_tile(ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1), P, B)[0] == 4
    assert predict_tile(ConvSpec(1, 512, 7, 7, 512, 3, 3, 1, 1), P, B)[0] == 2
    # faster memory moves the crossover down: F(4x4) on the 7x7 layer too
    assert predict_tile(ConvSpec(1, 512, 7, 7, 512, 3, 3, 1, 1), P, 200e9)[0] == 4
    with pytest.raises(MacoError, match="does not apply"):
        predict_tile(ConvSpec(1, 64, 56, 56, 64, 3, 3, 2, 1), P, B)
    with pytest.raises(MacoError, match="does not apply"):
        winograd_cost(ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1), 3)


def test_winograd_ceilings_are_timed_shares_of_the_peak():
    from maco.core.target import Target
    from maco.kernels.cpu_peak import winograd_ceilings

    host = Target.host()
    if host.isa not in ("avx2", "avx512"):
        pytest.skip(f"generated Winograd kernels need AVX2 or AVX-512; this host has {host.isa}")
    shares = winograd_ceilings(host, rounds=1)
    assert set(shares) == {(2, 3), (4, 3), (2, 5), (4, 5)}
    # each does work, and none is above the peak: a round where a busy core slowed the FMA loop
    # gave a share of 1.0002, which the tile model (and `maco bound --network`) refused
    assert all(0.02 < e <= 1.0 for e in shares.values()), shares
    with pytest.raises(MacoError, match="rounds"):
        winograd_ceilings(host, rounds=0)


def test_depthwise_ceiling_is_a_timed_share_of_the_peak():
    from maco.core.target import Target
    from maco.kernels.cpu_peak import depthwise_ceiling

    share = depthwise_ceiling(Target.host(), rounds=1)
    assert 0.01 < share <= 1.0, share
    with pytest.raises(MacoError, match="rounds"):
        depthwise_ceiling(Target.host(), rounds=0)


def test_reach_prices_a_depthwise_conv_at_the_depthwise_share():
    """A depthwise conv is priced at the depthwise kernel's share of the peak, not the direct
    convs': its multiplies each load their own input, so it reaches a fraction of the peak."""
    P, B = 100e9, 1e15
    dw = ConvSpec(1, 144, 56, 56, 144, 3, 3, 1, 1, groups=144)
    full = 2 * dw.macs / P
    assert layer_reach(dw, P, B) == ("depthwise", pytest.approx(full))
    assert layer_reach(dw, P, B, depthwise_share=0.25) == ("depthwise", pytest.approx(4 * full))
    assert layer_reach(dw, P, B, direct_share=0.25) == ("depthwise", pytest.approx(full))
    with pytest.raises(MacoError, match="depthwise's ceiling is a share of the FMA peak"):
        layer_reach(dw, P, B, depthwise_share=0.0)
    from maco.layouts.network_floor import network_dag
    layers = network_dag("mobilenet_v2", 1)[0]
    assert network_reach(layers, P, B, depthwise_share=0.25) > network_reach(layers, P, B)
    plain = network_dag("resnet18", 1)[0]  # no depthwise conv: the share changes nothing
    assert network_reach(plain, P, B, depthwise_share=0.25) == network_reach(plain, P, B)


def test_reach_takes_each_layers_fastest_family_at_its_ceiling():
    P, B = 100e9, 20e9
    pointwise = ConvSpec(1, 256, 14, 14, 1024, 1, 1)
    assert layer_reach(pointwise, P, B) == ("direct", max(2 * pointwise.macs / P, 4 * pointwise.weight_elems / B))
    assert layer_reach(pointwise, P, B, direct_share=0.5)[1] == pytest.approx(2 * 2 * pointwise.macs / P)
    early = ConvSpec(1, 64, 56, 56, 64, 3, 3, 1, 1)
    assert layer_reach(early, P, 1e15)[0] == "F(4x4,3x3)"
    # F(4x4) at too small a share of the peak: F(2x2) is faster; both far below it: direct
    assert layer_reach(early, P, 1e15, {(2, 3): 0.9, (4, 3): 0.4})[0] == "F(2x2,3x3)"
    assert layer_reach(early, P, 1e15, {(2, 3): 0.3, (4, 3): 0.1})[0] == "direct"
    # a deep layer reads U from DRAM: at a low bandwidth, the smaller U of F(2x2) or the weights win
    deep = ConvSpec(1, 512, 7, 7, 512, 3, 3, 1, 1)
    assert layer_reach(deep, P, 5e9)[0] in ("F(2x2,3x3)", "direct")
    assert layer_reach(deep, P, 5e9)[1] < 4 * winograd_cost(deep, 4).u / 5e9
    for bad in (0.0, 1.5):
        with pytest.raises(MacoError, match="share of the FMA peak"):
            layer_reach(pointwise, P, B, direct_share=bad)


def test_network_reach_sums_the_layers_and_sits_over_the_floor():
    from maco.bounds.network import network_floor
    from maco.layouts.network_floor import network_dag

    P, B = 100e9, 20e9
    layers, image = network_dag("resnet18")
    shares = {(2, 3): 0.8, (4, 3): 0.65}
    reach = network_reach(layers, P, B, shares)
    assert reach == pytest.approx(sum(layer_reach(l.spec, P, B, shares)[1] for l in layers if l.spec is not None))
    floor = network_floor(layers, 8 << 20, image, peak=P, bandwidth=B)
    assert floor.t_compute < network_reach(layers, P, B) <= reach  # full shares: nearer the floor
    assert reach > 1.2 * floor.t  # F(4x4) at 65% of the peak on most 3x3 convs
