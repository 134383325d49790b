"""Records carry torch's baselines: a line of its own kind that round-trips, is checked as strictly
as a kernel record (a bad one skipped and reported with its line number), is never mistaken for a
schedule by anything that reads records, and is what the tuner plans with instead of timing torch
again; files from before baselines still load."""
import json

import pytest

from maco import ConvSpec, Target, kernels
from maco.core.errors import MacoError
from maco.core.files import MAX_LINE_BYTES
from maco.tune.records import (Baseline, RecordFile, baselines_in_files, best_in_files, latest_baselines,
                          make_baseline, make_record, parse_line)
from maco.core.timing import Timing, environment
from maco.tune.tuning import measure_baselines, tune_layers

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)
HOST = Target.host()


def _timing(seconds, reference=None):
    return Timing(seconds, seconds, seconds, 0.0, 3, 10, reference, seconds / reference if reference else None)


def _record(seconds=1e-3):
    return make_record(SPEC, HOST, kernels.default_schedule(SPEC, HOST, "NHWC"), _timing(seconds))


def _baseline(layout="NHWC", seconds=2e-3, when=None, spec=SPEC):
    b = make_baseline(spec, HOST, layout, _timing(seconds, 1e-3))
    return b if when is None else Baseline(b.spec, b.target, b.layout, b.timing, b.env, when)


def test_a_baseline_round_trips_and_stays_out_of_the_kernel_records(tmp_path):
    path = tmp_path / "r.jsonl"
    rec, nchw, nhwc = _record(), _baseline("NCHW", 3e-3), _baseline("NHWC", 2e-3)
    RecordFile(path).append([rec, nchw])
    RecordFile(path).append(nhwc)
    f = RecordFile(path)
    assert f.load_baselines() == [nchw, nhwc] and f.bad_lines == []
    assert f.load() == [rec] and [n for n, _ in f.load_numbered()] == [1]
    assert [type(e).__name__ for _, e in f.load_entries()] == ["Record", "Baseline", "Baseline"]
    again = parse_line(nhwc.to_json())
    assert again == nhwc and again.timing.ratio == 2.0 and again.env == environment()
    line = json.loads(nhwc.to_json())
    assert line["baseline"] == "torch" and line["layout"] == "NHWC" and "schedule" not in line
    # nothing that ranks schedules sees them: best per layout, a task's records, the best record
    assert best_in_files([path], HOST) == {(SPEC, "NHWC"): rec}
    assert f.for_task(SPEC, HOST) == [rec] and f.best(SPEC, HOST) == rec
    assert baselines_in_files([path], HOST) == {(SPEC, "NCHW"): nchw, (SPEC, "NHWC"): nhwc}


def test_records_from_before_baselines_load_as_before(tmp_path):
    path = tmp_path / "old.jsonl"
    RecordFile(path).append([_record(1e-3), _record(2e-3)])
    f = RecordFile(path)
    assert f.load_baselines() == [] and len(f.load()) == 2 and f.bad_lines == []
    assert baselines_in_files([path], HOST) == {}


def _bad_baselines(good: Baseline, record_line: str):
    """(what is wrong, the line) for each kind of nonsense a shared file may hold."""
    d = json.loads(good.to_json())

    def change(key, value=None, drop=False):
        out = json.loads(json.dumps(d))
        if drop:
            del out[key]
        else:
            out[key] = value
        return json.dumps(out)

    yield "another kind", change("baseline", "onednn")
    yield "a kind that is not text", change("baseline", ["torch"])
    yield "layout NCWH", change("layout", "NCWH")
    yield "no layout", change("layout", drop=True)
    yield "no timing", change("timing", None)
    yield "timing missing", change("timing", drop=True)
    yield "time 0", change("timing", dict(d["timing"], median=0.0, min=0.0))
    yield "NaN time", change("timing", dict(d["timing"], median=float("nan")))
    yield "negative reference", change("timing", dict(d["timing"], reference=-1.0))
    yield "a ratio without its reference", change("timing", {k: v for k, v in d["timing"].items() if k != "reference"})
    yield "a spec with 0 channels", change("spec", dict(d["spec"], c=0))
    yield "a target that is not a fingerprint", change("target", "host")
    yield "a schedule beside it", change("schedule", json.loads(record_line)["schedule"])
    yield "an error beside it", change("error", "failed")
    yield "env not an object", change("env", [1])
    yield "time as text", change("time", "yesterday")
    yield "a kernel record marked baseline", json.dumps(dict(json.loads(record_line), baseline="torch"))
    yield "a line of 2 MB", change("env", {"pad": "x" * (2 * MAX_LINE_BYTES)})
    yield "version 2", change("v", 2)


def test_each_bad_baseline_is_skipped_and_reported_with_its_line(tmp_path):
    good, rec = _baseline(), _record()
    path = tmp_path / "r.jsonl"
    RecordFile(path).append([rec, good])
    variants = list(_bad_baselines(good, rec.to_json()))
    with open(path, "a") as fh:
        for _, line in variants:
            fh.write(line + "\n")
    RecordFile(path).append(good)
    before = path.read_bytes()
    f = RecordFile(path)
    with pytest.warns(UserWarning, match=f"skipped {len(variants)} bad record line"):
        assert f.load_baselines() == [good, good]
    assert [n for n, _ in f.bad_lines] == list(range(3, len(variants) + 3))
    with pytest.warns(UserWarning):
        assert f.load() == [rec]
    for (what, line), (_, reason) in zip(variants, f.bad_lines):
        assert reason, what
        if len(line) < MAX_LINE_BYTES:
            with pytest.raises(MacoError):
                parse_line(line)
    assert path.read_bytes() == before


def test_the_newest_baseline_of_this_target_and_torch_is_the_one_planned_with():
    old, new = _baseline(seconds=5e-3, when=100.0), _baseline(seconds=2e-3, when=200.0)
    other = make_baseline(SPEC, Target.host(1) if HOST.cores > 1 else Target.host(2), "NHWC", _timing(1e-4))
    older_torch = Baseline(SPEC, HOST.fingerprint(), "NHWC", _timing(1e-4), dict(environment(), torch="0.1"), 300.0)
    assert latest_baselines([new, old, other, older_torch], HOST) == {(SPEC, "NHWC"): new}


class FakeMeasurer:
    def __init__(self, fail=()):
        self.asked, self.fail = [], fail

    def baseline(self, spec, layout):
        self.asked.append((spec, layout))
        return (None, "torch failed") if layout in self.fail else (_timing(4e-3, 1e-3), None)


def test_measure_baselines_times_only_what_the_records_lack_and_appends_it(tmp_path):
    path = tmp_path / "r.jsonl"
    other = ConvSpec(1, 8, 10, 10, 8, 1, 1)
    RecordFile(path).append([_record(), _baseline("NHWC", 2e-3)])
    m = FakeMeasurer(fail=("NCHW",))
    got = measure_baselines([SPEC, other], HOST, path, measurer=m)
    assert m.asked == [(SPEC, "NCHW"), (other, "NCHW"), (other, "NHWC")]
    assert got == {(SPEC, "NHWC"): 2e-3, (other, "NHWC"): 4e-3}  # a failed layout is left out
    assert len(RecordFile(path).load_baselines()) == 2
    m = FakeMeasurer()
    assert measure_baselines([other], HOST, path, layouts=("NHWC",), measurer=m) == {(other, "NHWC"): 4e-3}
    assert m.asked == []  # in the records now: not timed again


def test_retime_rewrites_records_around_baseline_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    base = _baseline()
    RecordFile(path).append([base, _record(1e-3)])
    f = RecordFile(path)
    (n, rec), = f.load_numbered()
    f.replace({n: _record(2e-3)})
    assert f.load_baselines() == [base] and f.load()[0].seconds == 2e-3


def test_the_tuner_records_torch_baselines_and_reuses_them(tmp_path):
    path = tmp_path / "r.jsonl"
    tiny = ConvSpec(1, 4, 6, 6, 8, 3, 3, padding=1)
    first = tune_layers([("tiny", tiny)], HOST, 2, records=path, round_size=2)[0]
    stored = baselines_in_files([path], HOST)
    assert set(stored) == {(tiny, "NCHW"), (tiny, "NHWC")}
    assert all(b.timing.referenced for b in stored.values())
    assert (first.torch_nchw, first.torch_nhwc) == (stored[(tiny, "NCHW")].seconds, stored[(tiny, "NHWC")].seconds)
    lines = path.read_text().count("\n")
    again = tune_layers([("tiny", tiny)], HOST, 2, records=path, round_size=2)[0]
    assert path.read_text().count("\n") == lines  # nothing to tune, baselines read back, not timed
    assert (again.torch_nchw, again.torch_nhwc) == (first.torch_nchw, first.torch_nhwc)
