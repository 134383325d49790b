"""The data set: sensible random convs, rows that survive a round trip, resumable collection,
corrupt and torn lines reported and skipped, and the `maco collect` command."""
import time

import pytest

from maco.cli import main
from maco.core.errors import MacoError
from maco.layouts.canary import Canary
from maco.layouts.collection import collect
from maco.layouts.dataset import COLUMNS, REFERENCE, Dataset, Row, best_rows, load_rows, reference_of
from maco.layouts.random_convs import network_specs, random_specs
from maco.core.spec import ConvSpec
from maco.core.timing import Timing

TINY = [("t", ConvSpec.parse(s)) for s in
        ("n1_c4_h8_w8_k8_r3_p1", "n1_c8_h6_w6_k8_r1", "n1_c8_h9_w9_k8_r3_s2_p1_g8")]


def test_random_specs_are_valid_varied_capped_and_prefix_stable():
    specs = random_specs(300, seed=1, max_flops=5e8)
    assert specs[:50] == random_specs(50, seed=1, max_flops=5e8)
    assert specs != random_specs(300, seed=2, max_flops=5e8)
    assert all(s.flops <= 5e8 for s in specs)
    assert any(s.is_depthwise for s in specs) and any(1 < s.groups < s.c for s in specs)
    assert any(s.stride != (1, 1) for s in specs) and any(s.dilation != (1, 1) for s in specs)
    assert {s.kh for s in specs} >= {1, 3, 5, 7} and sum(s.n == 1 for s in specs) > 200
    with pytest.raises(MacoError, match="-1"):
        random_specs(-1)


def test_network_specs():
    specs = network_specs(["alexnet"])
    assert len(specs) == 5 and specs[0][0] == "alexnet:features.0"
    with pytest.raises(MacoError, match="'lenet'"):
        network_specs(["lenet"])


def _row(spec, layout="NCHW", seconds=1e-3, stdev=0.0):
    return Row(spec, layout, "cpu", "t", Timing(seconds, seconds * 0.9, seconds * 1.1, stdev, 3, 2), "e", 1.5)


def test_row_round_trip_and_best_rows():
    spec = ConvSpec.parse("n2_c8_h10_w9_k8_r1x3_s2x1_p0x1_d1_g2")
    row = _row(spec, "NHWC", 2.5e-4)
    again = Row.from_fields([str(v) for v in row.fields()])
    assert again == row and again.key == (str(spec), "NHWC", "cpu")
    quiet = _row(spec, "NHWC", 3e-4, stdev=1e-6)
    noisy = _row(spec, "NHWC", 9e-4, stdev=5e-4)
    assert best_rows([noisy, quiet]) == [quiet]
    loaded = Row(spec, "NHWC", "cpu", "t", quiet.timing, "e", 2.0, load=3.0)
    assert best_rows([loaded, noisy]) == [noisy]  # a steady timing under load is no good
    spell = Row(spec, "NHWC", "cpu", "t", quiet.timing, "e", 2.0, load=1.4)  # quiet, but in a spell
    settled = Row(spec, "NHWC", "cpu", "t", noisy.timing, "e", 3.0, load=1.02)
    assert best_rows([spell, settled]) == [settled]


def test_best_rows_keep_one_measurement_for_all_layouts_of_a_spec():
    """Two measurements of one spec: the first's NCHW agreed best, the second's NHWC did. Each
    layout on its own would keep a different one; the layouts are only compared in the same rounds."""
    spec = ConvSpec.parse("n1_c16_h14_w14_k16_r3x3_s1x1_p1x1_d1_g1")

    def row(layout, time, stdev):
        return Row(spec, layout, "cpu", "t", Timing(1e-4, 9e-5, 1.1e-4, stdev, 3, 2), "e", time)

    first = [row("NCHW", 1.0, 1e-7), row("NHWC", 1.0, 2e-5)]
    second = [row("NCHW", 2.0, 4e-6), row("NHWC", 2.0, 5e-6)]
    assert sorted(best_rows(first + second), key=lambda r: r.layout) == second
    assert sorted(best_rows(second + first), key=lambda r: r.layout) == second
    alone = [row("NHWC", 3.0, 1e-7)]  # timed again in one layout only: it stands for that layout
    assert {r.time for r in best_rows(first + second + alone)} == {2.0, 3.0}


def test_a_spec_timed_in_a_spell_is_timed_again_at_the_end(tmp_path, monkeypatch):
    from maco.layouts import collection

    real, calls = collection.time_spec, []

    def spell_on_first(canary, spec, lays, dev, **kw):  # the first spec's first timing reads a spell
        timings, _ = real(canary, spec, lays, dev, **kw)
        calls.append(spec)
        return timings, 1.4 if calls == [TINY[0][1]] else 1.0
    monkeypatch.setattr(collection, "time_spec", spell_on_first)
    summary = collect(tmp_path / "d.csv", TINY, rounds=1, repeats=2, min_run_time=1e-4, patience=0,
                      attempts=1, progress=False)
    assert summary.deferred == 1 and calls == [s for _, s in TINY] + [TINY[0][1]]  # last, after the rest
    rows = Dataset(tmp_path / "d.csv").load()
    assert sorted(r.load for r in rows if r.spec == TINY[0][1]) == [1.0, 1.0, 1.4, 1.4]  # both kept
    assert all(r.load == 1.0 for r in load_rows(tmp_path / "d.csv"))  # the settled ones count


def test_a_spell_that_outlasts_patience_ends_each_pass_at_its_first_spec(tmp_path, monkeypatch):
    from maco.layouts import collection

    calls = []

    def always_a_spell(canary, spec, lays, dev, **kw):
        calls.append((spec, kw.get("settle", False)))
        timing = Timing(median=1e-4, min=1e-4, max=1e-4, stdev=0.0, repeats=2, number=1)
        return {lay: timing for lay in lays}, 1.3
    monkeypatch.setattr(collection, "time_spec", always_a_spell)
    summary = collect(tmp_path / "d.csv", TINY, rounds=1, repeats=2, min_run_time=1e-4, patience=0,
                      attempts=1, progress=False)
    first = TINY[0][1]
    assert calls == [(s, False) for _, s in TINY] + [(first, True)] * collection.SETTLE_PASSES
    assert summary.deferred == 1 and summary.unsettled == len(TINY)


def test_canary_measures_load_relative_to_its_quietest():
    canary = Canary(calls=2)
    assert canary.best > 0 and 0 < canary.load() < 50
    start = time.perf_counter()
    assert canary.wait_quiet(patience=0.0) >= 1.0 and time.perf_counter() - start < 1.0


def test_corrupt_and_torn_lines_are_reported_and_skipped(tmp_path):
    path = tmp_path / "d.csv"
    ds = Dataset(path)
    ds.append([_row(TINY[0][1]), _row(TINY[1][1])])
    good = path.read_text()
    lines = good.splitlines()
    bad_spec = lines[1].replace("n1_c4_h8", "n1_c5_h8", 1)
    path.write_text("\n".join([lines[0], lines[1], "garbage,1,2", bad_spec, lines[2]]) + "\n" + lines[1][:30])
    ds.append([_row(TINY[2][1])])  # after a torn last line
    with pytest.warns(UserWarning, match="corrupt"):
        rows = ds.load()
    assert [r.spec for r in rows] == [TINY[0][1], TINY[1][1], TINY[2][1]]
    assert [n for n, _ in ds.bad_lines] == [3, 4, 6]


def test_bad_header_and_missing_file(tmp_path):
    (tmp_path / "x.csv").write_text("a,b,c\n1,2,3\n")
    with pytest.raises(MacoError, match="not a MACO latency data set"):
        Dataset(tmp_path / "x.csv").load()
    with pytest.raises(MacoError, match="maco collect"):
        load_rows(tmp_path / "none.csv")


def test_collect_resumes_without_losing_rows(tmp_path):
    path = tmp_path / "d.csv"
    first = collect(path, TINY[:2], rounds=1, repeats=2, min_run_time=1e-4, patience=0,
                    attempts=1, progress=False)
    assert (first.measured, first.skipped, first.rows) == (2, 0, 4)
    text = path.read_text()
    again = collect(path, TINY, rounds=1, repeats=2, min_run_time=1e-4, patience=0,
                    attempts=1, progress=False)
    assert (again.measured, again.skipped, again.rows) == (1, 2, 6)
    assert path.read_text().startswith(text)  # appended, never rewritten
    rows = load_rows(path)
    assert {r.key for r in rows} == {(str(s), lay, "cpu") for _, s in TINY for lay in ("NCHW", "NHWC")}
    assert all(r.seconds > 0 for r in rows)
    envs = Dataset(path).environments()
    assert len(envs) == 1 and rows[0].env_id in envs and "torch" in envs[rows[0].env_id]
    with open(path) as f:
        assert f.readline().strip() == ",".join(COLUMNS)


def test_collect_command(tmp_path, capsys):
    out = tmp_path / "d.csv"
    assert main(["collect", "--out", str(out), "--random", "2", "--networks", "", "--max-gflop", "0.02",
                 "--rounds", "1", "--patience", "0", "--attempts", "1", "--no-progress"]) == 0
    assert len(load_rows(out)) == 4 and "rows" in capsys.readouterr().out
    assert main(["collect", "--out", str(out), "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert main(["collect", "--out", str(out), "--layouts", "NCWH", "--random", "1", "--networks", ""]) == 2
    assert "'NCWH'" in capsys.readouterr().err


def test_rows_carry_the_reference_timed_in_the_same_rounds(tmp_path):
    path = tmp_path / "d.csv"
    collect(path, TINY[:1], rounds=2, repeats=2, min_run_time=1e-4, patience=0, attempts=1, progress=False)
    rows = load_rows(path)
    assert len(rows) == 2 and all(r.timing.referenced and r.ratio > 0 for r in rows)
    assert len({r.timing.reference for r in rows}) == 1  # one reference per conv, beside both layouts
    for r in rows:  # the ratio is a per-round median: near seconds / reference, not far from it
        assert 0.25 < r.ratio / (r.seconds / r.timing.reference) < 4
    assert {reference_of(Dataset(path).environments(), r) for r in rows} == {REFERENCE}


def test_rows_name_their_reference_and_older_rows_read_as_the_fma_loop(tmp_path):
    from maco.layouts import conv_timing

    spec = TINY[0][1]
    assert conv_timing._reference(spec, "cuda") is None and callable(conv_timing._reference(spec, "cpu"))
    old = Row(spec, "NHWC", "cpu", "t", Timing(1e-3, 1e-3, 1e-3, 0.0, 1, 1), env_id="before")
    assert reference_of({}, old) == "fma" == REFERENCE  # rows from before name no reference
    assert reference_of({"before": {"reference": "fma+copy"}}, old) == "fma+copy"


def test_a_file_from_before_the_reference_is_read_and_upgraded_keeping_every_line(tmp_path):
    from maco.layouts.dataset import UNREFERENCED_COLUMNS

    path = tmp_path / "old.csv"
    spec = ConvSpec.parse("n1_c4_h8_w8_k8_r3_p1")
    old = _row(spec).fields()[:len(UNREFERENCED_COLUMNS)]
    path.write_text(",".join(UNREFERENCED_COLUMNS) + "\n" + ",".join(map(str, old)) + "\nnot,a,row\n")
    with pytest.warns(UserWarning, match="1 corrupt line"):
        rows = Dataset(path).load()
    assert len(rows) == 1 and rows[0].ratio is None
    referenced = Row(spec, "NHWC", "cpu", "t", Timing(2e-4, 1e-4, 3e-4, 0.0, 3, 1, 5e-5, 4.0), "e", 2.0)
    Dataset(path).append([referenced])
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and lines[2] == "not,a,row"  # the corrupt line as it was
    with pytest.warns(UserWarning, match="1 corrupt line"):
        got = {r.layout: r for r in Dataset(path).load()}
    assert got["NCHW"].ratio is None and got["NHWC"].ratio == 4.0 and got["NHWC"].timing.reference == 5e-5
