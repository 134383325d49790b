"""The layout experiments: fig14's wrong-pick statistics by hand, fig12 and fig18 in a reduced
quick run (real torch timing, outputs checked), and the saved predictor's size cap."""
from __future__ import annotations

import csv
import importlib
from pathlib import Path

import numpy as np
import pytest


def load(name: str):
    return importlib.import_module(f"maco.experiments.{name}")


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_fig13_re_times_only_labels_of_this_cpu(tmp_path):
    """Re-timing test convs bounds a predictor only where the labels were timed: a ratio to the
    FMA loop is still its machine's (oneDNN is relatively faster on some CPUs than others)."""
    from maco.layouts.dataset import Dataset, Row
    from maco.core.spec import ConvSpec
    from maco.core.target import Target
    from maco.core.timing import Timing, environment

    fig13 = load("fig13_predictor_r2")
    spec, path = ConvSpec.parse("n1_c8_h8_w8_k8_r3"), tmp_path / "d.csv"
    ds = Dataset(path)

    def row(env: dict) -> Row:
        return Row(spec, "NHWC", "cpu", "t", Timing(1e-4, 1e-4, 1e-4, 0.0, 3, 1), ds.record_environment(env))

    here = row(environment())
    assert fig13.timed_elsewhere(str(path), [here]) is None
    there = row({**environment(), "cpu": "Another CPU"})
    said = fig13.timed_elsewhere(str(path), [here, there])
    assert said is not None and "Another CPU" in said and said.endswith(f"this host is {Target.host().model}")


def test_fig14_pick_stats_by_hand(tmp_path):
    fig14 = load("fig14_error_threshold")
    # conv a: layouts 1.0 vs 1.01 (1% apart), predicted the wrong way round;
    # conv b: 1.0 vs 3.0, predicted right; conv c: 2.0 vs 1.0, predicted wrong (costs 1.0).
    specs = ["a", "a", "b", "b", "c", "c"]
    measured = np.array([1.0, 1.01, 1.0, 3.0, 2.0, 1.0])
    predicted = np.array([2.0, 1.0, 1.0, 2.0, 1.0, 1.5])
    st = fig14.pick_stats(specs, measured, predicted)
    assert st[0.0] == pytest.approx((2 / 3, (0.01 + 1.0) / 3.0, 3))
    assert st[0.02] == pytest.approx((1 / 2, 1.0 / 2.0, 2))  # conv a's 1% gap no longer counts
    assert st[0.5][2] == 2 and st[0.5][0] == pytest.approx(0.5)

    pred = tmp_path / "fig13_test_predictions.csv"
    with open(pred, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["spec", "layout", "measured", "NAS-MLP_log", "always_slow"])
        for s, lay, m, p in zip(specs, ["NCHW", "NHWC"] * 3, measured, predicted):
            w.writerow([s, lay, m, p, -m])
    assert fig14.main(["--out", str(tmp_path), "--quick"]) == 0
    got = {r["model"]: r for r in rows(tmp_path / "fig14_error_threshold.csv")}
    assert float(got["NAS-MLP_log"]["wrong_picks_gap_0"]) == pytest.approx(2 / 3, abs=1e-4)
    assert float(got["always_slow"]["wrong_picks_gap_0"]) == 1.0
    assert float(got["NAS-MLP_log"]["within_0.01"]) == pytest.approx(2 / 6, abs=1e-4)  # 1.01 vs 1.0, b's NCHW
    assert (tmp_path / "fig14_error_threshold.png").stat().st_size > 0


def test_fig12_quick_alexnet_plans_and_keeps_outputs(tmp_path, capsys):
    fig12 = load("fig12_layout_plan")
    rc = fig12.main(["--quick", "--networks", "alexnet", "--latency", "measure,all-NHWC",
                     "--rounds", "1", "--out", str(tmp_path)])
    assert rc == 0
    got = rows(tmp_path / "fig12_layout_plan.csv")
    assert [r["latency"] for r in got] == ["measure", "all-NHWC"]
    for r in got:
        assert r["outputs_equal"] == "True" and float(r["max_abs_diff"]) < 1e-3
        assert r["convs"] == "5" and float(r["measured_speedup"]) > 0
    measured, policy = got
    assert float(measured["predicted_planned_ms"]) <= float(measured["predicted_default_ms"])
    assert policy["nhwc_convs"] == "5" and policy["predicted_speedup"] == ""
    assert (tmp_path / "fig12_layout_plan.png").stat().st_size > 0
    assert "alexnet" in capsys.readouterr().out


def test_fig18_without_records_leaves_the_maco_column_empty(tmp_path):
    fig18 = load("fig18_end_to_end")
    assert fig18.main(["--networks", "alexnet", "--rounds", "1", "--out", str(tmp_path)]) == 0
    (r,) = rows(tmp_path / "fig18_end_to_end.csv")
    assert r["speedup_maco"] == "" and "no tuning records" in r["note"]
    assert float(r["speedup_torch"]) > 0 and r["outputs_equal"] == "True"
    with pytest.raises(SystemExit):
        fig18.main(["--records", str(tmp_path / "nowhere.jsonl"), "--out", str(tmp_path)])


def test_largest_nas_predictor_saves_under_5_mb(tmp_path):
    from maco.layouts.predictor import LatencyPredictor
    from maco.layouts.predictor_fit import fit_predictor
    from maco.layouts.predictor_models import MLPConfig
    from maco.layouts.predictor_search import MAX_WIDTH
    from maco.core.spec import ConvSpec

    specs = [ConvSpec(1, c, 14, 14, 32, 3, 3, 1, 1) for c in (8, 16, 32, 64)]
    config = MLPConfig(layers=5, width=MAX_WIDTH, epochs=1)
    pred = fit_predictor(specs * 2, ["NCHW"] * 4 + ["NHWC"] * 4, np.linspace(1e-4, 1e-3, 8), config,
                         ensemble=3)
    pred.save(tmp_path / "p")
    size = sum(f.stat().st_size for f in (tmp_path / "p").iterdir())
    assert size < 5 << 20
    assert LatencyPredictor.load(tmp_path / "p").predict(specs[0], "NHWC") > 0
