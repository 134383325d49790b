"""bounds/chain.py: the chain bound of fused blocks, checked against an exact pebbling found by
brute force (tests/pebble_brute.py) on small chains: the lower bounds are never above the
least I/O, and the fused tile's cost is the cost of a pebbling (never below the least I/O)."""
from __future__ import annotations

import pytest
import sympy as sp

from maco.bounds.chain import chain_bound, chains, derive_chain
from maco.core.errors import MacoError
from maco.core.spec import ConvSpec
from maco.layouts.network_floor import network_dag
from tests.pebble_brute import CDAG, conv_vertices, min_io


def conv(c, w, k, kw=1, pad=0, stride=1, groups=1):
    return ConvSpec(1, c, 1, w, k, 1, kw, stride, (0, pad), 1, groups)


CASES = {  # chain, fast memory sizes S to play (each at least what one output's inputs need)
    "1x1_1x1": ([conv(1, 2, 2), conv(2, 2, 1)], (5, 6, 8)),
    "window": ([conv(1, 3, 1, kw=2, pad=0), conv(1, 2, 1, kw=2)], (5, 6)),
    "three": ([conv(1, 2, 1), conv(1, 2, 1), conv(1, 2, 1)], (3, 4, 6)),
    "wide_mid": ([conv(1, 2, 2), conv(2, 2, 1, kw=1)], (5, 7)),
    "spill": ([conv(1, 4, 1), conv(1, 4, 1)], (3, 4)),  # the intermediate (4) does not fit in S = 3
}


def _cdag(specs):
    g = CDAG()
    tensor = [g.add() for _ in range(specs[0].input_elems)]
    for i, spec in enumerate(specs):
        tensor = conv_vertices(g, spec, tensor, i)
    return g


@pytest.mark.parametrize("case", sorted(CASES))
def test_brute_force_agrees_with_the_chain_bound(case):
    specs, sizes = CASES[case]
    g = _cdag(specs)
    for S in sizes:
        b = chain_bound(specs, S)
        if case == "spill" and S == 3:
            assert b.q_unfused == b.q_fused_floor + 2  # one intermediate element stored and loaded
        least = min_io(g, S)
        assert b.q_fused_floor <= least, f"S={S}: statement 2 {b.q_fused_floor} above the least I/O {least}"
        assert b.q_unfused <= min_io(g, S, once=True, layers=True), f"S={S}: statement 1 above a layer-at-a-time pebbling"
        if b.tile is not None:
            assert least <= b.q_tiled, f"S={S}: the tiled cost {b.q_tiled} is below the least I/O {least}"


def test_large_memory_fusion_meets_the_compulsory_traffic():
    specs = [ConvSpec(1, 16, 8, 8, 32, 1, 1), ConvSpec(1, 32, 8, 8, 32, 3, 3, padding=1, groups=32),
             ConvSpec(1, 32, 8, 8, 16, 1, 1)]
    b = chain_bound(specs, 10**7)
    assert b.tile == (8, 8) and b.weights_resident and b.recompute == 0
    assert b.q_tiled == b.q_fused_floor == specs[0].input_elems + specs[-1].output_elems + sum(s.weight_elems for s in specs)
    assert b.q_separate - b.q_tiled == 2 * (specs[0].output_elems + specs[1].output_elems) and b.pays
    assert b.kind == "1x1 -> dw -> 1x1"
    small = chain_bound(specs, 3000)  # weights (16*32 + 32*9 + 32*16 = 1312) beside a small tile
    assert small.tile is not None and small.q_tiled > b.q_tiled and small.recompute > 0 and small.pays
    # priced: recompute at a slow peak against a fast memory does not pay, the other way round it does
    assert not chain_bound(specs, 3000, peak=1e6, bandwidth=1e12).pays
    fast = chain_bound(specs, 3000, peak=1e15, bandwidth=1e6)
    assert fast.pays and fast.saved_s > 0 and fast.priced


def test_sympy_derivation_matches_the_numbers():
    d = derive_chain()
    s = d.symbols
    specs = [ConvSpec(1, 4, 8, 8, 6, 3, 3, padding=1), ConvSpec(1, 6, 8, 8, 5, 3, 3, padding=1)]
    assert chain_bound(specs, 10**7).tile == (8, 8)  # one whole tile: the regions clip to the map, the expression does not
    vals = {s["x"]: 4, s["y"]: 4, s["H"]: 8, s["W"]: 8, s["C"]: 4, s["M"]: 6, s["K"]: 5, s["r1"]: 3, s["r2"]: 3,
            s["W_sum"]: sum(p.weight_elems for p in specs)}
    # 4x4 tiles: interior tiles read (4+4)^2 inputs, the formula counts every tile as interior
    assert d.q_tiled.subs(vals) == 4 * 4 * 8 * 8 + 5 * 64 + vals[s["W_sum"]]
    assert d.footprint.subs(vals) == 4 * 64 + 6 * 36 + 5 * 16
    assert sp.simplify(d.q_tiled.diff(s["x"]).subs(vals)) < 0  # larger tiles move less


def test_chains_of_the_built_in_networks():
    layers, _ = network_dag("resnet18")
    found = chains(layers)
    assert len(found) == 8 and all(len(c) == 2 and c[0].name.endswith("conv1") and c[1].name.endswith("conv2")
                                   for c in found)
    layers, _ = network_dag("mobilenet_v2")
    kinds = [chain_bound([l.spec for l in c], 1 << 17).kind for c in chains(layers)]
    assert kinds.count("1x1 -> dw -> 1x1") == 16
    names = [l.name for c in chains(layers) for l in c]
    assert len(names) == len(set(names))


def test_refuses_what_is_no_chain():
    a, b = ConvSpec(1, 4, 8, 8, 6, 1, 1), ConvSpec(1, 5, 8, 8, 6, 1, 1)
    with pytest.raises(MacoError, match="does not read"):
        chain_bound([a, b], 1000)
    with pytest.raises(MacoError, match="2 or 3 convs"):
        chain_bound([a], 1000)
    with pytest.raises(MacoError, match="positive"):
        chain_bound([a, ConvSpec(1, 6, 8, 8, 6, 1, 1)], 0)
