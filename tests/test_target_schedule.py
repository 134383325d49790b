"""Target detection and the Schedule's validity checks and JSON form."""
import pytest

from maco import ConvSpec, MacoError, MemoryLevel, Schedule, Target
from maco.core.axes import axis_extents
from tests.targets import AVX2


def test_host_target_reads_the_machine():
    host = Target.host()
    assert host.kind == "cpu" and host.cores >= 1
    assert host.simd_width in (4, 8, 16)
    assert host.levels[0].name == "registers"
    caps = [lvl.capacity for lvl in host.levels]
    assert caps == sorted(caps), "levels must grow outwards"
    assert host.level("L1").elements == host.level("L1").capacity // 4
    assert Target.from_dict(host.to_dict()) == host
    one = Target.host(threads=1)  # the thread count is part of the fingerprint records are matched on
    assert one.cores == 1 and one.fingerprint()["cores"] == 1 and one.model == host.model
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(MacoError, match="threads must be a positive int"):
            Target.host(threads=bad)


def test_h100_and_errors():
    gpu = Target.h100()
    assert gpu.kind == "cuda" and gpu.cores == 132
    assert gpu.level("shared").elements_per_processor == (228 << 10) // 4 // 2
    assert 60_000 < gpu.peak_gflops < 70_000  # ~67 TFLOP/s fp32
    with pytest.raises(MacoError, match="no memory level 'L9'"):
        gpu.level("L9")
    with pytest.raises(MacoError, match="unknown target 'tpu'"):
        Target.named("tpu")
    with pytest.raises(MacoError, match="capacity must be positive, got 0"):
        MemoryLevel("L1", 0)


SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def _cpu(**kw):
    base = dict(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 8), (2, 5, 1, 1), (1, 2, 1, 5)),
                reduction=((2, 4), (1, 3), (3, 1)), vector_axis="k", vector_width=8)
    base.update(kw)
    return Schedule(**base)


def test_valid_schedule_round_trips():
    s = _cpu()
    assert s.problems(SPEC, AVX2) == []
    assert Schedule.from_json(s.to_json()) == s
    assert s.register_tile() == {"n": 1, "g": 1, "k": 8, "oh": 1, "ow": 5}
    assert s.tile("k", 2) == 16 and s.tile("ow", 1) == 10
    assert axis_extents(SPEC) == {"n": 1, "g": 1, "k": 16, "oh": 10, "ow": 10, "c": 8, "kh": 3, "kw": 3}


def test_invalid_schedules_are_explained():
    bad = _cpu(spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 8), (2, 5, 1, 1), (1, 2, 1, 3)))
    assert any("ow: factors (1, 2, 1, 3) multiply to 6, not the extent 10" in p for p in bad.problems(SPEC))
    assert any("axis c: cpu sketch SSRSRS needs 2 factors, got 1" in p for p in _cpu(reduction=((8,), (1, 3), (3, 1))).problems(SPEC))
    assert any("layout must be one of" in p for p in _cpu(layout="NCWH").problems(SPEC))
    assert any("vector_width 3 must divide" in p for p in _cpu(vector_width=3).problems(SPEC))
    assert any("inner_order" in p for p in _cpu(inner_order=("c", "c", "kw")).problems(SPEC))
    big = _cpu(spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 16), (1, 1, 1, 10), (1, 1, 1, 10)), vector_width=1)
    assert any("accumulators" in p for p in big.problems(SPEC, Target.host()))
    assert any("cannot run on the cuda target" in p for p in _cpu().problems(SPEC, Target.h100()))
    with pytest.raises(MacoError, match="invalid schedule"):
        bad.validate(SPEC)
    with pytest.raises(MacoError, match="missing tiles"):
        Schedule.from_dict({"kind": "cpu", "tiles": {"n": [1, 1, 1, 1]}})
    with pytest.raises(MacoError, match="not a schedule JSON"):
        Schedule.from_json("[")
