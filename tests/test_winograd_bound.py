"""Winograd inside the bound (maco.bounds.winograd): its counts against the kernel's own packed
filters and a direct count of tiles, the sympy crossover against the numeric model, and the tile
size it predicts (F(4x4) on large feature maps, F(2x2) on 7x7 deep layers)."""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from maco.bounds.winograd import crossover, predict_tile, winograd_cost
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


def test_crossover_is_the_model():
    d = crossover()
    s = {str(x): x for x in d["t2"].free_symbols | d["t4"].free_symbols}
    P, B = 96e9, 20e9
    area = float(d["area"].subs({s["P"]: P, s["B"]: B}))
    assert d["area"] == sp.Rational(160, 7) * s["P"] / s["B"]
    for side in (7, 14, 28, 56):  # compute- and memory-sides of each tile: the model's pick
        spec = ConvSpec(1, 256, side, side, 256, 3, 3, 1, 1)
        m, times = predict_tile(spec, P, B)
        vals = {s["C"]: 256, s["K"]: 256, s["H_o"]: side, s["W_o"]: side, s["P"]: P, s["B"]: B}
        if side % 4 == 0:  # whole tiles: the symbolic times are the numeric ones
            assert float(d["t2"].subs(vals)) == pytest.approx(times[2])
            assert float(d["t4"].subs(vals)) == pytest.approx(times[4])
        assert m == (2 if side * side < area else 4)


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
