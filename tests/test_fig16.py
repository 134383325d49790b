"""experiments/fig16_search.py's bookkeeping: curves padded and summarised per layer, rows of other
layers kept, the quarter-of-the-budget rule (the searches themselves are timed, not tested here)."""
import math

from maco.experiments import fig16_search as fig16
from maco.experiments.common import read_rows


def _rows(name, space, curves, trials, seconds=1.0):
    return [{k: str(v) for k, v in r.items()} for r in fig16.curve_rows(name, space, curves, trials, seconds)]


def test_curves_are_padded_and_averaged_over_seeds():
    rows = fig16.curve_rows("L", "pruned", [[1.0, 3.0], [2.0, 2.0, 4.0]], 3, 5.0)
    assert [r["best_gflops_mean"] for r in rows] == [1.5, 2.5, 3.5]  # the first seed stopped at 2 trials
    assert [r["best_gflops_min"] for r in rows] == [1.0, 2.0, 3.0] and rows[0]["seeds"] == 2


def test_quarter_rule_and_the_paper_s_ratio():
    rows = (_rows("L", "pruned", [[90, 99, 100, 100, 100, 100, 100, 100]], 8)
            + _rows("L", "full", [[10, 20, 50, 60, 70, 80, 90, 101]], 8)
            + _rows("L", "default", [[95]], 1) + _rows("L", "metaschedule", [[5] * 8], 8, 30.0))
    s = fig16.summarise_layer("L", rows)
    assert s["pruned_trials_to_full_best"] == 2 and s["quarter_met"] == "yes"  # 99 >= 0.98 * 101 at trial 2
    assert s["pruned_trials_to_95pct"] == 2 and s["full_trials_to_same"] == 8
    assert s["default_gflops"] == 95 and s["metaschedule_final_gflops"] == 5 and s["metaschedule_seconds"] == 30
    late = _rows("M", "pruned", [[10, 20, 30, 99, 100, 100, 100, 100]], 8) + _rows("M", "full", [[100] * 8], 8)
    s = fig16.summarise_layer("M", late)
    assert s["quarter_met"] == "no" and s["metaschedule_final_gflops"] == "" and math.isfinite(s["full_trials_to_same"])
    assert fig16.summarise_layer("N", _rows("N", "pruned", [[1.0]], 1)) is None  # no full search: no summary


def test_a_run_of_some_layers_keeps_the_others(tmp_path):
    path = tmp_path / "fig16_search.csv"
    rows = fig16._merged([], fig16.curve_rows("A", "pruned", [[1.0, 2.0]], 2, 1.0)
                         + fig16.curve_rows("A", "full", [[1.0, 1.0]], 2, 1.0), path)
    rows = fig16._merged(rows, fig16.curve_rows("B", "pruned", [[3.0]], 1, 1.0), path)
    rows = fig16._merged(rows, fig16.curve_rows("A", "pruned", [[5.0, 6.0]], 2, 1.0), path)  # A's pruned redone
    saved = read_rows(path)
    assert saved == rows and {(r["layer"], r["space"]) for r in saved} == {("A", "pruned"), ("A", "full"), ("B", "pruned")}
    assert [r["best_gflops_mean"] for r in saved if (r["layer"], r["space"]) == ("A", "pruned")] == ["5", "6"]


def test_plot_only_rebuilds_the_summary_from_the_csv(tmp_path):
    fig16._merged([], fig16.curve_rows("resnet18.layer1.conv", "pruned", [[2.0] * 4], 4, 1.0)
                  + fig16.curve_rows("resnet18.layer1.conv", "full", [[1.0, 1.0, 1.0, 1.5]], 4, 1.0),
                  tmp_path / "fig16_search.csv")
    assert fig16.main(["--plot-only", "--out", str(tmp_path)]) == 0
    (row,) = read_rows(tmp_path / "fig16_summary.csv")
    assert row["layer"] == "resnet18.layer1.conv" and row["quarter_met"] == "yes"
    assert (tmp_path / "fig16_search.png").exists()
