"""The I/O simulator against a naive reference machine, and every lower bound against the
simulated I/O (Belady's OPT) of many tiles, loop orders and schedules on small shapes."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from maco import ConvSpec, MacoError, Schedule
from maco import bounds
from maco.bounds import Tile, simulate_io
from maco.bounds.simulate import DATAFLOW_ORDER, INNER_ORDER

from test_bounds import random_specs


# -- a naive reference machine, written from the simulator's documented semantics -----------------
def naive_accesses(spec: ConvSpec, tile: Tile, order, inner_order):
    """(kind, element) per access, from plain nested loops; no merging of repeats."""
    x, y, z = min(tile.x, spec.out_w), min(tile.y, spec.out_h), min(tile.z, spec.k_per_group)
    outer = {"n": range(spec.n), "g": range(spec.groups), "k": range(0, spec.k_per_group, z),
             "oh": range(0, spec.out_h, y), "ow": range(0, spec.out_w, x), "c": range(spec.c_per_group)}
    for o in itertools.product(*(outer[a] for a in order)):
        base = dict(zip(order, o))
        inner = {"kh": range(spec.kh), "kw": range(spec.kw),
                 "k": range(base["k"], min(base["k"] + z, spec.k_per_group)),
                 "oh": range(base["oh"], min(base["oh"] + y, spec.out_h)),
                 "ow": range(base["ow"], min(base["ow"] + x, spec.out_w))}
        for i in itertools.product(*(inner[a] for a in inner_order)):
            it = {**base, **dict(zip(inner_order, i))}
            ih = it["oh"] * spec.stride[0] + it["kh"] * spec.dilation[0] - spec.padding[0]
            iw = it["ow"] * spec.stride[1] + it["kw"] * spec.dilation[1] - spec.padding[1]
            if not (0 <= ih < spec.h and 0 <= iw < spec.w):
                continue
            cin = it["g"] * spec.c_per_group + it["c"]
            kout = it["g"] * spec.k_per_group + it["k"]
            yield ("w", (kout, it["c"], it["kh"], it["kw"]))
            yield ("i", (it["n"], cin, ih, iw))
            yield ("o", (it["n"], kout, it["oh"], it["ow"]))


def naive_machine(spec: ConvSpec, trace, S: int, policy: str) -> tuple[int, int]:
    trace = list(trace)
    cache: list = []  # LRU order, most recent last
    written: set = set()
    loads = stores = 0
    for t, (kind, e) in enumerate(trace):
        key = (kind, e)
        if key in cache:
            cache.remove(key)
            cache.append(key)
            continue
        if kind != "o" or key in written:
            loads += 1
        written.add(key) if kind == "o" else None
        if len(cache) == S:
            if policy == "lru":
                victim = cache[0]
            else:
                def next_use(k):
                    for u in range(t + 1, len(trace)):
                        if trace[u] == k:
                            return u
                    return len(trace)
                victim = max(cache, key=next_use)
            cache.remove(victim)
            stores += victim[0] == "o"
        cache.append(key)
    stores += sum(1 for kind, _ in cache if kind == "o")
    stores += spec.output_elems - len(written)  # outputs that read only padding: a zero stored
    return loads, stores


ORDERS = [(DATAFLOW_ORDER, INNER_ORDER), (("c", "n", "g", "k", "oh", "ow"), INNER_ORDER),
          (("n", "g", "ow", "oh", "c", "k"), ("k", "oh", "ow", "kh", "kw"))]


@pytest.mark.parametrize("spec", random_specs(10, seed=4, max_hw=5) + [
    ConvSpec(1, 2, 5, 5, 3, 3, 3, padding=1), ConvSpec(2, 2, 4, 5, 2, 2, 2, stride=2, padding=1),
    ConvSpec(1, 4, 6, 6, 4, 3, 3, stride=2, dilation=2, padding=2, groups=2)], ids=str)
def test_against_naive_machine(spec):
    rng = random.Random(str(spec))
    for _ in range(3):
        tile = Tile(rng.randint(1, spec.out_w), rng.randint(1, spec.out_h), rng.randint(1, spec.k_per_group))
        order, inner = rng.choice(ORDERS)
        trace = list(naive_accesses(spec, tile, order, inner))
        assert len(trace) <= 4000  # keep the naive OPT quick
        for S in (3, 7, 20):
            for policy in ("lru", "opt"):
                got = simulate_io(spec, tile, S, policy, order=order, inner_order=inner)
                assert (got.loads, got.stores) == naive_machine(spec, trace, S, policy), (tile, order, S, policy)


@pytest.mark.parametrize("spec", random_specs(12, seed=5, max_hw=8), ids=str)
def test_big_cache_moves_each_element_once(spec):
    tile = bounds.optimal_tile(spec, 64)
    for policy in ("lru", "opt"):
        got = simulate_io(spec, tile, 10**7, policy)
        assert got.loads == bounds.compulsory_io(spec) - spec.output_elems
        assert got.stores == spec.output_elems


@pytest.mark.parametrize("spec", random_specs(12, seed=6, max_hw=8), ids=str)
def test_opt_beats_lru_and_the_explicit_dataflow(spec):
    """Belady needs no more loads than LRU, nor than the dataflow's own management when the
    tile's footprint fits (that management is one demand policy among those OPT beats)."""
    for S in (40, 120):
        tile = bounds.optimal_tile(spec, S)
        opt = simulate_io(spec, tile, S, "opt")
        lru = simulate_io(spec, tile, S, "lru")
        assert opt.loads <= lru.loads
        if tile.fits:
            assert opt.loads <= bounds.dataflow_loads(spec, tile)


def _bounds(spec: ConvSpec, S: int) -> dict[str, float]:
    rep = bounds.bound_report(spec, S)
    out = {"eq7": bounds.conv_io_lower_bound(spec, S), "compulsory": rep.compulsory, "best": rep.best}
    if rep.gemm is not None:
        out["gemm"] = rep.gemm
    return out


def _shapes() -> list[ConvSpec]:
    # random small layers, plus GEMM-like and wide ones where the eq. 7 / GEMM terms are largest
    return random_specs(30, seed=7, max_hw=8) + [
        ConvSpec(1, 16, 4, 4, 16, 1, 1), ConvSpec(1, 16, 6, 6, 8, 1, 1, stride=2, padding=1),
        ConvSpec(1, 8, 8, 8, 8, 3, 3, padding=1), ConvSpec(2, 4, 6, 6, 6, 3, 3, dilation=2, padding=2),
        ConvSpec(1, 12, 6, 6, 12, 3, 3, padding=1, groups=3)]


def test_no_lower_bound_exceeds_simulated_io():
    """On every shape, fast memory, tile and loop order tried: bound <= OPT's loads + stores."""
    rng = random.Random(8)
    checked = exercised_gemm = 0
    worst = {}
    for spec in _shapes():
        for S in (4, 9, 32, 100):
            b = _bounds(spec, S)
            opt_tile = bounds.optimal_tile(spec, S)
            tiles = {opt_tile, Tile(1, 1, 1), Tile(spec.out_w, spec.out_h, spec.k_per_group),
                     Tile(rng.randint(1, spec.out_w), rng.randint(1, spec.out_h),
                          rng.randint(1, spec.k_per_group))}
            for tile in tiles:
                order, inner = rng.choice(ORDERS)
                sim = simulate_io(spec, tile, S, "opt", order=order, inner_order=inner)
                checked += 1
                for name, value in b.items():
                    assert value <= sim.total, (name, value, sim, spec, S, tile, order)
                    worst[name] = max(worst.get(name, 0.0), value / sim.total)
            exercised_gemm += "gemm" in b and b["gemm"] > b["compulsory"]
    assert checked > 400
    assert exercised_gemm > 0  # the sqrt(2)*m*n*k/sqrt(S) - 4S term was the largest somewhere
    assert worst["compulsory"] == pytest.approx(1.0)  # tight where the cache holds a whole tile


def _split(extent: int, levels: int, rng: random.Random) -> tuple[int, ...]:
    factors = []
    for _ in range(levels - 1):
        f = rng.choice([d for d in range(1, extent + 1) if extent % d == 0])
        factors.append(f)
        extent //= f
    return tuple(factors) + (extent,)


def test_schedule_replays_its_nest():
    spec = ConvSpec(1, 6, 7, 6, 8, 3, 3, padding=1)
    # S0 = 1, S1 = the tile loops, R0 = channels, S2 = 1, R1 = kh kw, S3 = the tile: the dataflow
    x, y, z = 3, 7, 4
    sched = Schedule("cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 8 // z, 1, z), (1, 1, 1, y),
                                     (1, 6 // x, 1, x)),
                     reduction=((6, 1), (1, 3), (1, 3)))
    for S in (10, 50):
        for policy in ("lru", "opt"):
            assert simulate_io(spec, sched, S, policy) == simulate_io(spec, Tile(x, y, z), S, policy)
    rng = random.Random(9)
    for _ in range(6):
        extents = {"n": 1, "g": 1, "k": 8, "oh": 7, "ow": 6, "c": 6, "kh": 3, "kw": 3}
        sched = Schedule("cpu", spatial=tuple(_split(extents[a], 4, rng) for a in ("n", "g", "k", "oh", "ow")),
                         reduction=tuple(_split(extents[a], 2, rng) for a in ("c", "kh", "kw")),
                         inner_order=tuple(rng.sample(("c", "kh", "kw"), 3)))
        for S in (6, 40):
            sim = simulate_io(spec, sched, S, "opt")
            assert bounds.best_lower_bound(spec, S) <= sim.total
            assert sim.loads <= simulate_io(spec, sched, S, "lru").loads


def test_small_shapes_are_fast():
    """C = K = 16, 12x12, 3x3: about 0.9 M accesses; well under a second each on an idle core
    (the limit here leaves room for a machine shared with other jobs)."""
    spec = ConvSpec(1, 16, 12, 12, 16, 3, 3, padding=1)
    tile = bounds.optimal_tile(spec, 512)
    for policy in ("lru", "opt"):
        t0 = time.perf_counter()
        got = simulate_io(spec, tile, 512, policy)
        elapsed = time.perf_counter() - t0
        assert got.accesses > 800_000
        assert elapsed < 3.0, f"{policy}: {elapsed:.2f} s"


def test_bad_arguments_are_named():
    spec = ConvSpec(1, 4, 6, 6, 4, 3, 3)
    with pytest.raises(MacoError, match="policy"):
        simulate_io(spec, Tile(2, 2, 2), 16, "fifo")
    with pytest.raises(MacoError, match="cache size S"):
        simulate_io(spec, Tile(2, 2, 2), 0)
    with pytest.raises(MacoError, match="order"):
        simulate_io(spec, Tile(2, 2, 2), 16, order=("n", "g", "k", "oh", "ow"))
    with pytest.raises(MacoError, match="Tile or a Schedule"):
        simulate_io(spec, (2, 2, 2), 16)
    with pytest.raises(MacoError, match="invalid schedule"):
        simulate_io(spec, Schedule("cpu", ((1,) * 4,) * 5, ((1, 1),) * 3), 16)
    with pytest.raises(MacoError, match="at most"):
        simulate_io(ConvSpec(1, 64, 56, 56, 64, 3, 3, padding=1), Tile(8, 8, 8), 1000)
