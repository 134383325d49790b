"""Runs that share files (issue "Never silently wrong", item 13).

Two tuning runs on one records file read what the other appended and never measure a schedule
twice (claims, RecordFile.read_new); two `maco optimize` runs never write one output folder at
the same time (the second is refused with one line naming it).
"""
from __future__ import annotations

import fcntl
import multiprocessing as mp
import random
import time
from pathlib import Path

import pytest

from maco import ConvSpec, MacoError, Schedule, Target
from maco.tune.cost_model import analytic_seconds
from maco.tune.records import Claims, RecordFile, make_record
from maco.tune.search import SearchConfig
from maco.core.timing import Timing
from maco.tune.tuning import Task, tune
from tests.targets import AVX2

SPEC = ConvSpec.parse("n1_c32_h28_w28_k64_r3_p1")
SMALL = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)


def _slow_synthetic(spec, schedules, target):
    """The analytic time with noise, taking a while per schedule as a real measurement does."""
    rng = random.Random(hash(schedules[0]) if schedules else 0)
    out = []
    for s in schedules:
        time.sleep(0.03)
        out.append((Timing.from_samples([analytic_seconds(spec, target, s) * rng.uniform(0.95, 1.05)], 1), None))
    return out


def _tune_run(path: str, trials: int, start: mp.Barrier, counts: mp.Queue) -> None:
    start.wait(30)
    result = tune([Task("conv", SPEC)], AVX2, trials, _slow_synthetic, records=path,
                  config=SearchConfig(batch=8, population=32, generations=1), seed=3)
    counts.put(result.trials)


def test_two_runs_on_one_records_file_never_measure_a_schedule_twice(tmp_path):
    """Same command, same seed, started together: before, both picked the same schedules and
    the file held each twice (32 records, 16 distinct)."""
    path = tmp_path / "r.jsonl"
    ctx = mp.get_context("spawn")  # no fork: OpenMP (xgboost) in this process hangs a forked child
    start, counts = ctx.Barrier(2), ctx.Queue()
    runs = [ctx.Process(target=_tune_run, args=(str(path), 16, start, counts)) for _ in range(2)]
    for p in runs:
        p.start()
    for p in runs:
        p.join(300)
    assert [p.exitcode for p in runs] == [0, 0]
    records = RecordFile(path).load()
    schedules = [r.schedule for r in records]
    assert len(schedules) >= 16 and len(set(schedules)) == len(schedules)
    measured = [counts.get(timeout=5) for _ in runs]
    assert sum(measured) == len(records) and min(measured) > 0  # each record measured by one run


def _schedule(unroll: int = 0) -> Schedule:
    return Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 8), (2, 5, 1, 1), (1, 2, 1, 5)),
                    reduction=((2, 4), (1, 3), (3, 1)), layout="NCHW", unroll=unroll)


def _record(unroll: int = 0):
    return make_record(SMALL, Target.host(), _schedule(unroll), Timing(1e-3, 1e-3, 1e-3, 0.0, 5, 10))


def test_read_new_reads_what_others_appended_since(tmp_path):
    path = tmp_path / "r.jsonl"
    mine, other = RecordFile(path), RecordFile(path)
    assert mine.read_new() == ([], True)  # no file yet
    other.append(_record(0))
    assert mine.read_new() == ([_record(0)], True)  # the first read of the file: all of it
    other.append(_record(16))
    mine.append(_record(64))  # its own appends it knows already
    assert mine.read_new() == ([_record(16)], False)
    line = _record(512).to_json().encode() + b"\n"
    with open(path, "ab") as fh:
        fh.write(line[:50])  # a line still being written waits for the next read
        fh.flush()
        assert mine.read_new() == ([], False)
        fh.write(line[50:])
    assert mine.read_new() == ([_record(512)], False)
    assert mine.read_new() == ([], False)
    other.replace({1: _record(0)})  # rewritten in place: read whole again
    entries, whole = mine.read_new()
    assert whole and entries == [_record(0), _record(16), _record(64), _record(512)]


def _hold_claim(path: str, held: mp.Event, done: mp.Event) -> None:
    claims = Claims(Path(path))
    assert claims.take(SMALL, Target.host(), _schedule(0))
    held.set()
    done.wait(30)
    claims.close()


def test_a_claim_of_another_process_is_refused_until_released(tmp_path):
    path = tmp_path / "r.jsonl"
    ctx = mp.get_context("spawn")  # no fork: OpenMP (xgboost) in this process hangs a forked child
    held, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_claim, args=(str(path), held, done))
    child.start()
    try:
        assert held.wait(30)
        with Claims(path) as claims:
            assert not claims.take(SMALL, Target.host(), _schedule(0))
            assert claims.take(SMALL, Target.host(), _schedule(16))  # another schedule is free
            done.set()
            child.join(30)
            assert claims.take(SMALL, Target.host(), _schedule(0))  # its run ended: free again
    finally:
        done.set()
        child.join(30)
    assert child.exitcode == 0


# -- one optimize run per output folder ---------------------------------------------------------
def test_a_second_optimize_on_the_same_out_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import maco.deploy.optimize
    from maco.cli import main
    from maco.deploy.optimize_report import LOCK_NAME

    def ran(*args, **kwargs):
        raise AssertionError("optimize went on in a folder another run writes")

    monkeypatch.setattr(maco.deploy.optimize, "load_model", ran)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK_NAME, "w") as other_run:
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["optimize", "alexnet", "--out", str(out), "--engines", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(str(out)) in err and "another maco optimize run" in err, err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, no records


def test_optimize_holds_its_output_folder_until_it_ends(tmp_path, monkeypatch):
    import maco.deploy.optimize
    from maco.deploy.optimize_report import LOCK_NAME

    out, seen = tmp_path / "out", []

    def busy_folder(*args, **kwargs):  # runs while optimize is under way
        with open(out / LOCK_NAME) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("free")
            except BlockingIOError:
                seen.append("held")
        raise MacoError("stop here")

    monkeypatch.setattr(maco.deploy.optimize, "load_model", busy_folder)
    with pytest.raises(MacoError, match="stop here"):
        maco.deploy.optimize.optimize("alexnet", out=out)
    assert seen == ["held"]
    with open(out / LOCK_NAME) as fh:  # released when the run ended, by an error too
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
