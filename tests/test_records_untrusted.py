"""Records from elsewhere: every line is checked like a schedule, its timing for sense, and a bad
line is skipped with its line number; a passing failure (timeout, dead worker) is retried once."""
import json

import pytest

from maco import ConvSpec, Target, space
from maco.tune.cost_model import CostModel
from maco.core.errors import MacoError
from maco.core.files import MAX_LINE_BYTES
from maco.tune.records import best_in_files, Record, RecordFile, TransientError, make_record
from maco.core.schedule import Schedule
from maco.tune.search import SearchConfig
from maco.core.timing import Timing
from maco.tune.tuning import Task, tune
from tests.targets import AVX2

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def _good(seconds=1e-3, target=None):
    from maco import kernels

    target = target or Target.host()
    return make_record(SPEC, target, kernels.default_schedule(SPEC, target, "NHWC"),
                       Timing(seconds, seconds, seconds, 0.0, 3, 10))


def _variants(good: Record):
    """(what is wrong, the line) for each kind of nonsense seen in shared records files."""
    d = json.loads(good.to_json())

    def change(path, value):
        out = json.loads(json.dumps(d))
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return json.dumps(out)

    tiles = dict(d["schedule"]["tiles"], k=[1, 1, 1, 32])  # 32 filters: SPEC has 16
    yield "tiles that do not fit the spec", change(("schedule", "tiles"), tiles)
    yield "layout NCWH", change(("schedule", "layout"), "NCWH")
    yield "time 0", change(("timing",), dict(d["timing"], median=0.0, min=0.0))
    yield "negative time", change(("timing",), dict(d["timing"], median=-1e-3, min=-1e-3, max=-1e-3))
    yield "NaN time", change(("timing",), dict(d["timing"], median=float("nan")))
    yield "median above max", change(("timing",), dict(d["timing"], median=1.0))
    yield "zero repeats", change(("timing",), dict(d["timing"], repeats=0))
    yield "extra holding a list", change(("schedule", "extra"), {"buffers": [2, 3]})
    yield "a float tile", change(("schedule", "tiles"), dict(d["schedule"]["tiles"], c=[1.5, 8]))
    yield "a target that is not a fingerprint", change(("target",), "host")
    yield "a gpu schedule on a cpu target", change(("target",), dict(d["target"], kind="cuda"))
    yield "an error that is not text", change(("error",), {"a": 1})
    yield "neither timing nor error", change(("timing",), None)
    yield "deeply nested JSON", change(("env",), json.loads("[" * 50 + "]" * 50)).replace(
        "[" * 50, "[" * 100_000).replace("]" * 50, "]" * 100_000)
    yield "a line of 2 MB", change(("env",), {"pad": "x" * (2 * MAX_LINE_BYTES)})
    yield "a JSON array", "[1, 2, 3]"


def test_each_bad_record_is_skipped_and_reported_with_its_line(tmp_path):
    good = _good()
    path = tmp_path / "r.jsonl"
    RecordFile(path).append(good)
    variants = list(_variants(good))
    with open(path, "a") as fh:
        for _, line in variants:
            fh.write(line + "\n")
    RecordFile(path).append(good)
    before = path.read_bytes()
    f = RecordFile(path)
    with pytest.warns(UserWarning, match=f"skipped {len(variants)} bad record line"):
        assert f.load() == [good, good]
    assert [n for n, _ in f.bad_lines] == list(range(2, len(variants) + 2))
    for (what, _), (_, reason) in zip(variants, f.bad_lines):
        assert reason, what
    assert path.read_bytes() == before  # good lines are never rewritten


def test_each_bad_record_alone_raises_a_clear_error():
    for what, line in _variants(_good()):
        if len(line) > MAX_LINE_BYTES:
            continue
        with pytest.raises(MacoError):
            Record.from_json(line)


def test_bad_records_never_reach_the_ranking_or_the_cost_model(tmp_path):
    good = _good(2e-3)
    path = tmp_path / "r.jsonl"
    RecordFile(path).append(good)
    with open(path, "a") as fh:
        fh.write("\n".join(line for _, line in _variants(good)) + "\n")
    with pytest.warns(UserWarning):
        best = best_in_files([path], Target.host())
    assert [r.seconds for r in best.values()] == [2e-3]
    with pytest.warns(UserWarning):
        records = RecordFile(path).load()
    CostModel(Target.host()).fit(records)  # no ValueError, ZeroDivisionError or TypeError


def test_a_records_path_that_is_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(MacoError, match="is a directory"):
        RecordFile(tmp_path).load()
    with pytest.raises(MacoError, match="cannot write records"):
        RecordFile(tmp_path).append(_good())


def _flaky(transient_for: dict):
    """A measurer whose schedules in `transient_for` fail transiently that many times first."""
    calls: list[Schedule] = []

    def measure(spec, schedules, target):
        out = []
        for s in schedules:
            calls.append(s)
            if transient_for.get(s, 0) > 0:
                transient_for[s] -= 1
                out.append((None, TransientError("worker died (exit code -9)")))
            else:
                out.append((Timing.from_samples([1e-3], 1), None))
        return out
    measure.calls = calls
    return measure


def test_a_transient_failure_is_retried_once_in_a_later_round(tmp_path):
    path = tmp_path / "r.jsonl"
    flaky, always = space.sample(SPEC, AVX2, 1), space.sample(SPEC, AVX2, 2)
    assert flaky != always
    measure = _flaky({flaky: 1, always: 10})
    config = SearchConfig(batch=4, population=16, generations=1)
    tune([Task("c", SPEC, seeds=(flaky, always))], AVX2, 12, measure, records=path, config=config)
    assert measure.calls.count(flaky) == 2 and measure.calls.count(always) == 2
    assert measure.calls.index(flaky, 1) >= 4  # not in the round that failed
    recs = RecordFile(path).load()
    assert [r.transient for r in recs if r.schedule == flaky] == [True, False]
    assert [r.ok for r in recs if r.schedule == flaky] == [False, True]
    # resumed: the twice-failed schedule is not measured a third time
    more = _flaky({always: 10})
    tune([Task("c", SPEC, seeds=(flaky, always))], AVX2, 16, more, records=path, config=config)
    assert always not in more.calls and flaky not in more.calls


def test_a_transient_failure_from_a_killed_run_is_retried_on_resume(tmp_path):
    path = tmp_path / "r.jsonl"
    s = space.sample(SPEC, AVX2, 3)
    RecordFile(path).append(make_record(SPEC, AVX2, s, error=TransientError("timed out after 30 s")))
    measure = _flaky({})
    tune([Task("c", SPEC)], AVX2, 5, measure, records=path,
         config=SearchConfig(batch=4, population=16, generations=1))
    assert measure.calls[0] == s


def test_deterministic_failures_stay_failures(tmp_path):
    path = tmp_path / "r.jsonl"
    s = space.sample(SPEC, AVX2, 4)
    RecordFile(path).append(make_record(SPEC, AVX2, s, error="wrong result: max error 0.5"))
    measure = _flaky({})
    tune([Task("c", SPEC, seeds=(s,))], AVX2, 5, measure, records=path,
         config=SearchConfig(batch=4, population=16, generations=1))
    assert s not in measure.calls


def test_the_measurer_marks_timeouts_and_dead_workers_transient():
    from maco.tune.measure import MeasureConfig, Measurer

    with pytest.raises(MacoError, match="timeout must be a positive"):
        MeasureConfig(timeout=-1)
    with Measurer(Target.host(), MeasureConfig(repeats=50, min_run_time=1.0, timeout=1.0)) as m:
        timing, error = m.baseline(ConvSpec.parse("n8_c256_h56_w56_k256_r3_p1"), "NCHW")
    assert timing is None and isinstance(error, TransientError) and "timed out" in error
