"""kernels.cpu_peak.measure_peak's disk cache: a value measured while the host was busy does not
stay forever (a quick check that beats it re-measures), a quick check below it changes nothing,
and the cache only ever rises; measure_ceilings times the FMA loop and DRAM reads together."""
from __future__ import annotations

import json

import pytest

from maco.core.errors import MacoError
from maco.core.target import Target
from maco.kernels import cpu_peak

HOST = Target.host()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The cache in a temporary file, and GFLOP/s handed out by a script instead of timed."""
    path = tmp_path / "peak.json"
    monkeypatch.setattr(cpu_peak, "_cache_file", lambda target: str(path))
    monkeypatch.setattr(cpu_peak, "flops_runner", lambda target, kind="fma": (lambda flops: None))
    script: dict[str, list[float]] = {"quick": [], "full": []}
    calls: list[str] = []

    def best(run, flops, repeats):
        which = "quick" if repeats == 3 else "full"
        calls.append(which)
        return script[which].pop(0)
    monkeypatch.setattr(cpu_peak, "best_gflops", best)
    cpu_peak.measure_peak.cache_clear()
    yield path, script, calls
    cpu_peak.measure_peak.cache_clear()


def _key() -> str:
    return f"{Target.host().model}|{HOST.isa}|{HOST.cores}"


def test_a_busy_cached_peak_is_measured_again(fake):
    path, script, calls = fake
    path.write_text(json.dumps({_key(): 34.0}))
    script["quick"], script["full"] = [88.0], [95.0]
    assert cpu_peak.measure_peak(HOST) == 95.0
    assert calls == ["quick", "full"]
    assert json.loads(path.read_text())[_key()] == 95.0


def test_a_quick_check_below_the_cache_keeps_it(fake):
    path, script, calls = fake
    path.write_text(json.dumps({_key(): 95.0}))
    script["quick"] = [40.0]  # the host is busy now: the cached value stands
    assert cpu_peak.measure_peak(HOST) == 95.0
    assert calls == ["quick"]
    cpu_peak.measure_peak.cache_clear()
    script["quick"] = [97.0]  # within RECHECK of the cache: no full run
    assert cpu_peak.measure_peak(HOST) == 95.0 and calls == ["quick", "quick"]


def test_the_cache_never_falls(fake):
    path, script, calls = fake
    script["full"] = [90.0]
    assert cpu_peak.measure_peak(HOST) == 90.0 and calls == ["full"]  # nothing cached: measured
    cpu_peak.measure_peak.cache_clear()
    script["full"] = [50.0]
    assert cpu_peak.measure_peak(HOST, fresh=True) == 90.0  # a busy fresh run keeps the best
    assert json.loads(path.read_text())[_key()] == 90.0
    path.write_text("{not json")  # damaged: measured again
    cpu_peak.measure_peak.cache_clear()
    script["full"] = [91.0]
    assert cpu_peak.measure_peak(HOST) == 91.0


def test_measure_ceilings_times_both_in_the_same_rounds(monkeypatch, tmp_path):
    if HOST.isa not in ("avx2", "avx512"):
        pytest.skip(f"the read probe needs AVX2 or AVX-512 intrinsics; this host is {HOST.isa}")
    path = tmp_path / "peak.json"
    path.write_text(json.dumps({_key(): 90.0}))
    monkeypatch.setattr(cpu_peak, "_cache_file", lambda target: str(path))
    order = []
    real_read = cpu_peak.read_bandwidth
    monkeypatch.setattr(cpu_peak, "best_gflops", lambda run, flops, repeats: order.append("fma") or 50.0)
    monkeypatch.setattr(cpu_peak, "read_bandwidth",
                        lambda target, nbytes, seconds, repeats: order.append("read") or 2.5e9)
    got = cpu_peak.measure_ceilings(HOST, rounds=3)
    assert order == ["fma", "read"] * 3
    assert got["fma_gflops"] == 50.0 and got["read_gbs"] == 10.0 and got["fma_spread"] == 1.0
    assert got["read_bytes"] >= 8 * (32 << 10)
    # the best ever measured: the cached peak beats this (busy) round, the bandwidth is new
    assert got["fma_gflops_best"] == 90.0 and got["read_gbs_best"] == 10.0
    assert json.loads(path.read_text())[_key() + "|dram_read_gbs"] == 10.0
    with pytest.raises(MacoError, match="rounds"):
        cpu_peak.measure_ceilings(HOST, rounds=0)
    # the probe itself, small: a buffer in L2 reads faster than one from DRAM would not be
    # asserted here (that is timing); it runs and gives a positive rate
    assert real_read(HOST, 256 << 10, seconds=0.005, repeats=2) > 0


def test_the_read_probe_names_a_buffer_it_cannot_map() -> None:
    if HOST.isa not in ("avx2", "avx512"):
        pytest.skip(f"the read probe needs AVX2 or AVX-512 intrinsics; this host is {HOST.isa}")
    with open("/proc/sys/vm/overcommit_memory") as fh:
        if fh.read().strip() == "1":
            pytest.skip("the kernel maps any size here (vm.overcommit_memory = 1): the touch would be killed instead")
    # 1 PiB per core: more than any host's memory, refused by mmap, reported instead of crashing
    with pytest.raises(MacoError, match="could not map 1125899906842624 bytes per core"):
        cpu_peak.read_bandwidth(HOST, 1 << 50, seconds=0.001, repeats=1)


def test_best_prices_come_from_the_cache_and_measure_only_what_it_lacks(fake, monkeypatch):
    """The tuner's prices: the cached best peak (checked by the quick run) and bandwidth; where the
    cache has no bandwidth yet, measure_ceilings times both and its best values are returned."""
    path, script, calls = fake
    path.write_text(json.dumps({_key(): 95.0, _key() + "|dram_read_gbs": 31.0}))
    script["quick"] = [90.0]
    assert cpu_peak.best_prices(HOST) == (95.0e9, 31.0e9) and calls == ["quick"]
    path.write_text(json.dumps({_key(): 95.0}))
    measured = {"fma_gflops_best": 96.0, "read_gbs_best": 40.0}
    monkeypatch.setattr(cpu_peak, "measure_ceilings", lambda target, rounds: calls.append("ceilings") or measured)
    assert cpu_peak.best_prices(HOST) == (96.0e9, 40.0e9) and calls == ["quick", "ceilings"]
