"""time_with_reference: rounds beside a reference, a round whose reference reads slow measured again."""
from __future__ import annotations

import pytest

from maco.core import timing
from maco.core.timing import Timing, time_with_reference


def _t(seconds: float) -> Timing:
    return Timing(seconds, seconds, seconds, 0.0, 1, 1)


def test_a_slow_reference_round_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # (reference, candidate) per attempt: the second round's reference runs at half speed, so
    # that round is measured again; its candidate time (4.0) must not count
    readings = iter([_t(1.0), _t(2.0), _t(2.0), _t(4.0), _t(1.0), _t(2.2), _t(1.0), _t(1.8)])
    monkeypatch.setattr(timing, "time_callable", lambda fn, **kw: next(readings))
    monkeypatch.setattr(timing, "_BEST_RATE", {})
    got = time_with_reference(lambda: None, lambda: None, work=1.0, rounds=3)
    assert got.referenced and got.reference == 1.0
    assert got.ratio == pytest.approx(2.0)  # median of 2.0, 2.2, 1.8
    assert got.median == pytest.approx(2.0) and got.max == pytest.approx(2.2)
    assert next(readings, None) is None


def test_a_machine_that_stays_slow_keeps_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """After SLOW_RETRIES the round is kept: the ratio still holds, since both ran slow together."""
    slow = [_t(2.0), _t(4.0)] * (timing.SLOW_RETRIES + 1)
    readings = iter([_t(1.0), _t(2.0)] + slow)
    monkeypatch.setattr(timing, "time_callable", lambda fn, **kw: next(readings))
    monkeypatch.setattr(timing, "_BEST_RATE", {})
    got = time_with_reference(lambda: None, lambda: None, work=1.0, rounds=2)
    assert got.ratio == pytest.approx(2.0) and got.reference == pytest.approx(1.5)


def test_plain_timings_keep_their_dict_and_referenced_ones_round_trip() -> None:
    plain = _t(1.0)
    assert set(plain.to_dict()) == {"median", "min", "max", "stdev", "repeats", "number"}
    ref = Timing(2.0, 1.9, 2.1, 0.1, 6, 3, reference=1.0, ratio=2.0)
    assert Timing(**ref.to_dict()) == ref
    with pytest.raises(ValueError, match="work must be positive"):
        time_with_reference(lambda: None, lambda: None, work=0)


def test_what_runs_before_each_call_stays_off_the_clock() -> None:
    """time_callable(before=...): each call is timed alone, `before` (a cache eviction, here a
    sleep 20x as long as the call) first and off the clock."""
    import time

    calls: list[str] = []

    def fn() -> None:
        calls.append("fn")
        time.sleep(0.001)

    def before() -> None:
        calls.append("before")
        time.sleep(0.02)

    got = timing.time_callable(fn, repeats=5, warmup=1, min_run_time=1e-3, before=before)
    assert got.number == 1 and got.repeats >= 5
    assert 0.001 <= got.median < 0.01  # the call's time, not the eviction's
    assert calls[0] == "fn" and calls[1:] == ["before", "fn"] * got.repeats  # the warm-up, then each call
