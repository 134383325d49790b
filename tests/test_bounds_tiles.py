"""Tiles: dataflow_io against a set-based count of the dataflow, optimal_tile against brute force
over every integer tile, tiles per memory level, and the `maco bound` command and table script."""
from __future__ import annotations

import csv
import itertools
import json
import time

import pytest

from maco.core import geometry
from maco import ConvSpec, MacoError, Target
from maco import bounds
from maco.bounds import Tile
from maco.cli import main

from test_bounds import random_specs

_NETS: dict = {}


def net_convs(name: str, batch: int = 1):
    """network_convs, built once per test session (a forward pass costs a second or two)."""
    from maco.layouts.networks import network_convs

    if (name, batch) not in _NETS:
        _NETS[name, batch] = network_convs(name, batch)
    return _NETS[name, batch]


def reference_loads(spec: ConvSpec, tile: Tile) -> int:
    """The dataflow by its definition: per image, group, tile and channel, the distinct real input
    positions its outputs read plus z filters' weights at the taps some output reads for real."""
    x, y, z = min(tile.x, spec.out_w), min(tile.y, spec.out_h), min(tile.z, spec.k_per_group)
    loads = 0
    for n, g, k0, oh0, ow0, c in itertools.product(
            range(spec.n), range(spec.groups), range(0, spec.k_per_group, z),
            range(0, spec.out_h, y), range(0, spec.out_w, x), range(spec.c_per_group)):
        patch, taps = set(), set()
        for oh, ow, i, j in itertools.product(range(oh0, min(oh0 + y, spec.out_h)),
                                              range(ow0, min(ow0 + x, spec.out_w)),
                                              range(spec.kh), range(spec.kw)):
            ih = oh * spec.stride[0] + i * spec.dilation[0] - spec.padding[0]
            iw = ow * spec.stride[1] + j * spec.dilation[1] - spec.padding[1]
            if 0 <= ih < spec.h and 0 <= iw < spec.w:
                patch.add((ih, iw))
                taps.add((i, j))
        filters = min(k0 + z, spec.k_per_group) - k0
        loads += len(patch) + filters * len(taps)
    return loads


def tiles_of(spec: ConvSpec):
    ow, oh, kg = spec.out_w, spec.out_h, spec.k_per_group
    return {Tile(1, 1, 1), Tile(ow, oh, kg), Tile(max(1, ow // 2), min(oh, 3), max(1, kg - 1)),
            Tile(min(ow, 3), 1, min(kg, 2)), Tile(ow + 5, oh + 1, kg + 2)}


@pytest.mark.parametrize("spec", random_specs(12, seed=2, max_hw=8), ids=str)
def test_dataflow_io_against_definition(spec):
    for tile in tiles_of(spec):
        assert bounds.dataflow_loads(spec, tile) == reference_loads(spec, tile)
        assert bounds.dataflow_io(spec, tile) == reference_loads(spec, tile) + spec.output_elems


def test_dataflow_io_by_hand():
    # 3x3, pad 1 on 8x8, 4 channels, 8 filters; tile 4x4x8: four tiles, each reads a 5x5 patch
    # (the 6x6 window minus its padded border row and column) and 8*9 weights per channel
    spec = ConvSpec(1, 4, 8, 8, 8, 3, 3, padding=1)
    assert bounds.dataflow_io(spec, Tile(4, 4, 8)) == 4 * 4 * (25 + 72) + 8 * 64
    # the paper's formula without edges: (HoWoK/(xyz)) kh kw C (z + xy/R) counts (x+2)(y+2) patches
    assert bounds.dataflow_io(spec, Tile(4, 4, 8)) < (64 * 8 / 128) * 9 * 4 * (8 + 36 / 9) + 512


@pytest.mark.parametrize("spec", random_specs(14, seed=3, max_hw=9), ids=str)
def test_optimal_tile_is_the_brute_force_best(spec):
    """optimal_tile searches every (x, y) and takes the largest z that fits, which is exact for
    this dataflow: its I/O must equal the best over all integer tiles (factor 1.0; the issue
    allows a small factor)."""
    for S, Np in [(40, 1), (64, 2), (150, 1), (600, 3), (5000, 1)]:
        tile = bounds.optimal_tile(spec, S, Np)
        cap = S // Np
        feasible = [Tile(x, y, z) for x in range(1, spec.out_w + 1) for y in range(1, spec.out_h + 1)
                    for z in range(1, spec.k_per_group + 1) if geometry.footprint(spec, x, y, z) <= cap]
        if not feasible:
            assert not tile.fits and (tile.x, tile.y, tile.z) == (1, 1, 1)
            continue
        best = min(bounds.dataflow_io(spec, t) for t in feasible)
        assert tile.fits and tile.footprint(spec) <= cap
        assert bounds.dataflow_io(spec, tile) == best


def test_continuous_tile_meets_the_conditions():
    spec = ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1)
    tile = bounds.optimal_tile(spec, 8192)
    x, y, z = tile.continuous
    R = bounds.max_reuse(spec)
    assert x * y == pytest.approx(R * z) and x * y * z == pytest.approx(8192)
    x2, y2, z2 = bounds.optimal_tile(spec, 8192, 2).continuous
    assert x2 * y2 * z2 == pytest.approx(4096) and x2 * y2 == pytest.approx(R * z2)
    # the integer tile is near the continuous one: same order of magnitude on every side
    assert tile.footprint(spec) <= 8192 and 0.25 < tile.x * tile.y / (x * y) < 4


def test_tile_that_cannot_fit():
    alexnet1 = ConvSpec(1, 3, 224, 224, 64, 11, 11, stride=4, padding=2)
    tile = bounds.optimal_tile(alexnet1, 128)  # 1 + 121 + 121 > 128
    assert not tile.fits and (tile.x, tile.y, tile.z) == (1, 1, 1)
    assert bounds.optimal_tile(alexnet1, 243).fits


def test_tiles_per_level():
    spec = ConvSpec(1, 128, 28, 28, 128, 3, 3, padding=1)
    for target in (Target.host(), Target.h100()):
        tiles = bounds.tiles_for_target(spec, target)
        assert list(tiles) == [lvl.name for lvl in target.levels]
        for lvl in target.levels:
            t = tiles[lvl.name]
            assert t == bounds.optimal_tile(spec, lvl.elements, lvl.processors)
            assert not t.fits or t.footprint(spec) <= lvl.elements_per_processor
        ios = [bounds.dataflow_io(spec, tiles[lvl.name]) for lvl in target.levels if tiles[lvl.name].fits]
        assert ios == sorted(ios, reverse=True) or target.kind == "cuda"  # more memory, less I/O


def test_grouped_tile_stays_in_a_group():
    spec = ConvSpec(1, 32, 14, 14, 32, 3, 3, padding=1, groups=32)
    tile = bounds.optimal_tile(spec, 8192)
    assert tile.z == 1
    assert bounds.dataflow_io(spec, tile) == bounds.compulsory_io(spec)


def test_optimal_tile_is_fast():
    """Pruning and default schedules call it per layer and level: < 50 ms a call on average,
    cold caches included (timings on a shared machine: the budget is checked on the mean)."""
    from maco.bounds.axis import _block_tables, _positions

    specs = {spec for net in ("resnet18", "vgg11") for _, spec in net_convs(net)}
    _block_tables.cache_clear()
    _positions.cache_clear()
    times = []
    for spec in specs:
        for S in (8192, 131072):
            t0 = time.perf_counter()
            bounds.optimal_tile(spec, S)
            times.append(time.perf_counter() - t0)
    assert sum(times) / len(times) < 0.05, f"mean {sum(times) / len(times):.3f} s, max {max(times):.3f} s"


def test_bad_tiles_and_np():
    with pytest.raises(MacoError, match="Tile.z"):
        Tile(1, 2, 0)
    with pytest.raises(MacoError, match="Tile.x"):
        Tile(1.5, 2, 3)
    with pytest.raises(MacoError, match="Np"):
        bounds.optimal_tile(ConvSpec(1, 4, 8, 8, 4, 3, 3), 100, 0)
    with pytest.raises(MacoError, match="Tile"):
        bounds.dataflow_io(ConvSpec(1, 4, 8, 8, 4, 3, 3), (1, 1, 1))


# -- the command and the table script -------------------------------------------------------------
def test_cli_bound_shape_json(capsys):
    assert main(["bound", "--c", "64", "--h", "56", "--w", "56", "--k", "64", "--kernel", "3",
                 "--padding", "1", "--S", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["symbolic"]["conditions"] == ["x*y = R*z", "x*y*z = S/N_p"]
    (layer,) = out["layers"]
    (lvl,) = layer["levels"]
    spec = ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1)
    tile = bounds.optimal_tile(spec, 8192)
    assert (lvl["tile"]["x"], lvl["tile"]["y"], lvl["tile"]["z"]) == (tile.x, tile.y, tile.z)
    assert lvl["dataflow_io"] == bounds.dataflow_io(spec, tile)
    assert lvl["ratio"] == pytest.approx(lvl["dataflow_io"] / bounds.best_lower_bound(spec, 8192))


def test_cli_bound_network_table(capsys):
    assert main(["bound", "alexnet", "--target", "h100"]) == 0
    out = capsys.readouterr().out
    assert "T(S) = 4*sqrt(R)*S**(3/2) + S - 1" in out
    for name in ("registers", "shared", "L2", "features.0", "features.10"):
        assert name in out


@pytest.mark.parametrize("argv,message", [
    (["bound"], "give a network"),
    (["bound", "resnet18", "--c", "3"], "not both"),
    (["bound", "--c", "3", "--h", "8", "--w", "8", "--k", "4", "--S", "0"], "--S: must be >= 1"),
    (["bound", "nosuchnet"], "neither a network"),
    (["bound", "--c", "3", "--h", "2", "--w", "2", "--k", "4", "--kernel", "5"], "kernel extent 5"),
    (["bound", "resnet18", "--target", "tpu"], "unknown target"),
])
def test_cli_bound_errors(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a value its type cannot take
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_bounds_table_script(tmp_path, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "bounds_table.py"
    spec = importlib.util.spec_from_file_location("bounds_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "network_convs", net_convs)
    assert mod.main(["--levels", "L1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bounds_table.csv")))
    assert len(rows) == sum(len(net_convs(net)) for net in mod.NETWORKS)
    for r in rows:
        assert float(r["ratio_best"]) >= 1.0 and int(r["footprint"]) <= int(r["S"])
    assert "L1 I/O / best bound" in capsys.readouterr().out
    assert (tmp_path / "bounds_table.png").stat().st_size > 0
