"""Records: round trip, resume, best, and survival of corrupt or torn lines."""
import multiprocessing as mp

import pytest

from maco import ConvSpec, Schedule, Target
from maco.tune.records import RecordFile, make_record
from maco.core.timing import Timing

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def _schedule(layout="NCHW", unroll=0, n=1):
    return Schedule(kind="cpu", spatial=((n, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 8), (2, 5, 1, 1), (1, 2, 1, 5)),
                    reduction=((2, 4), (1, 3), (3, 1)), layout=layout, unroll=unroll)


def _timing(sec):
    return Timing(sec, sec, sec, 0.0, 5, 10)


def test_round_trip_and_best(tmp_path):
    f = RecordFile(tmp_path / "r.jsonl")
    target = Target.host()
    recs = [make_record(SPEC, target, _schedule("NCHW", 0), _timing(3e-3)),
            make_record(SPEC, target, _schedule("NHWC", 16), _timing(2e-3)),
            make_record(SPEC, target, _schedule("NHWC", 64), error="compile error: boom"),
            make_record(SPEC.with_batch(2), target, _schedule(n=2), _timing(1e-3))]
    f.append(recs[:2])
    f.append(recs[2:])
    loaded = f.load()
    assert loaded == recs and f.bad_lines == []
    assert f.best(SPEC, target) == recs[1]
    assert f.best(SPEC, target, layout="NCHW") == recs[0]
    assert f.best(SPEC, Target.h100()) is None
    assert recs[2].gflops == 0.0 and recs[1].gflops == pytest.approx(SPEC.flops / 2e-3 / 1e9)


def test_corrupt_and_torn_lines_are_reported_and_skipped(tmp_path):
    path = tmp_path / "r.jsonl"
    f = RecordFile(path)
    good = make_record(SPEC, Target.host(), _schedule(), _timing(1e-3))
    f.append(good)
    with open(path, "a") as fh:
        fh.write('{"v": 1, "spec": {"n": 1}}\n')  # corrupt: missing fields
        fh.write("not json at all\n")
        fh.write(good.to_json()[:40])  # torn: a crash mid-line, no newline
    f.append(good)  # must start on a fresh line
    with pytest.warns(UserWarning, match="skipped 3 bad record line"):
        loaded = f.load()
    assert loaded == [good, good]
    assert [n for n, _ in f.bad_lines] == [2, 3, 4]


def _append_many(path, worker):
    f = RecordFile(path)
    for i in range(50):
        f.append(make_record(SPEC, Target.host(), _schedule(unroll=(0, 16)[worker]), _timing((i + 1) * 1e-4)))


def test_concurrent_appends_keep_whole_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    procs = [mp.get_context("fork").Process(target=_append_many, args=(path, w)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    f = RecordFile(path)
    assert len(f.load()) == 100 and f.bad_lines == []
