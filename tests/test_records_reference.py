"""Records carry the reference timed in the same rounds: they rank by their ratio to it across
spells, records from before it are still read (and ranked on the same scale through their spec's
references), and `maco tune --retime` measures the best again in place, keeping the old timings."""
from __future__ import annotations

import json
import warnings

import pytest

from maco.cli import main
from maco.core.errors import MacoError
from maco.kernels import default_schedule
from maco.tune.records import Record, RecordFile, best_per_layout, make_record, normalized
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing
from maco.tune.tuning import retime

SPEC = ConvSpec.parse("n1_c8_h10_w10_k16_r3_p1")


def _timing(seconds: float, reference: float | None = None) -> Timing:
    ratio = seconds / reference if reference else None
    return Timing(seconds, seconds, seconds, 0.0, 3, 1, reference, ratio)


def _records(host: Target) -> list[Record]:
    nchw, nhwc = (default_schedule(SPEC, host, lay) for lay in ("NCHW", "NHWC"))
    return [make_record(SPEC, host, nchw, _timing(1.0e-3)),  # from before the reference
            make_record(SPEC, host, nhwc, _timing(1.2e-3, 1.0e-3)),  # ratio 1.2
            make_record(SPEC, host, nhwc, _timing(0.9e-3, 0.5e-3))]  # a fast spell: ratio 1.8


def test_records_rank_by_their_ratio_to_the_reference_across_spells() -> None:
    host = Target.host()
    old, slow_spell, fast_spell = _records(host)
    best = best_per_layout([old, slow_spell, fast_spell], host)
    assert best[(SPEC, "NHWC")] is slow_spell  # 1.2 x the reference beats 1.8 x, whatever the seconds
    # the old record is put on the same scale by its spec's references (median 0.75 ms)
    assert normalized([old, slow_spell, fast_spell]) == pytest.approx([1.0 / 0.75, 1.2, 1.8])
    assert not old.referenced and slow_spell.referenced


def test_reference_fields_round_trip_and_are_checked() -> None:
    host = Target.host()
    rec = _records(host)[1]
    again = Record.from_json(rec.to_json())
    assert again.timing == rec.timing and again.referenced
    d = json.loads(rec.to_json())
    del d["timing"]["ratio"]
    with pytest.raises(MacoError, match="both of"):
        Record.from_json(json.dumps(d))
    d["timing"]["ratio"] = -1.0
    with pytest.raises(MacoError, match="ratio must be a positive number"):
        Record.from_json(json.dumps(d))
    d["timing"]["ratio"], d["history"] = 1.2, [{"timing": {"median": 1}, "time": 0}]
    with pytest.raises(MacoError, match="record timing must have the fields"):
        Record.from_json(json.dumps(d))


def test_retime_rewrites_the_best_records_in_place_and_keeps_every_other_line(tmp_path) -> None:
    host = Target.host()
    path = tmp_path / "r.jsonl"
    records = _records(host)
    file = RecordFile(path)
    file.append(records[:2])
    with open(path, "a") as fh:
        fh.write("this line is not a record\n")
    file.append(records[2:])
    before = path.read_text().splitlines()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = retime(path, host, top=1, progress=False)
        assert summary.retimed == 2 and summary.failed == 0 and summary.unreferenced == 1
        after = path.read_text().splitlines()
        assert after[2] == before[2] and after[3] == before[3]  # the bad line; the NHWC runner-up
        for lineno in (0, 1):
            new = Record.from_json(after[lineno])
            old = Record.from_json(before[lineno])
            assert new.referenced and new.schedule == old.schedule
            assert new.history == ({"timing": old.timing.to_dict(), "time": old.time},)
        file.append(records[0])  # appending after the rewrite lands in the new file
        assert len(RecordFile(path).load()) == 4


def test_tune_retime_command(tmp_path, capsys) -> None:
    path = tmp_path / "r.jsonl"
    RecordFile(path).append(_records(Target.host())[:1])
    assert main(["tune", "--retime", "--records", str(path), "--top", "1"]) == 0
    assert "re-timed 1 records" in capsys.readouterr().out
    assert main(["tune", "--records", str(path)]) == 2
    assert "give a network or a layer spec" in capsys.readouterr().err
    assert main(["tune", "resnet18", "--retime", "--records", str(path)]) == 2
    assert main(["tune", "--retime", "--records", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_tune_prints_progress_lines_into_a_log(tmp_path, capsys) -> None:
    """Where stdout is no terminal (a log file, CI), rich draws no live bar: the tuner prints
    plain progress lines instead, the last one when the budget is spent."""
    path = tmp_path / "r.jsonl"
    assert main(["tune", "n1_c4_h6_w6_k8_r3_p1", "--trials", "4", "--round", "2", "--records", str(path),
                 "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "tuning 4/4 measurements; n1_c4_h6_w6_k8_r3x3_p1: " in out
