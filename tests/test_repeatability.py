"""experiments/repeatability.py's scoring: each label's second run as its first run predicts it,
the fastest-repeat labels only where the rows carry them."""
import pytest

from maco.experiments import repeatability as rep


def _row(first_s, second_s, first_min, second_min, load=1.0):
    return {"first_s": first_s, "second_s": second_s, "first_ratio": first_s / 1e-3, "second_ratio": second_s / 1e-3,
            "second_reference_s": 1e-3, "first_reference_s": 1e-3, "first_min_s": first_min,
            "second_min_s": second_min, "first_load": load, "second_load": load}


def test_the_fastest_repeat_is_scored_beside_the_median():
    """A slow spell in the second run lengthens its medians by 10%, not its fastest repeats."""
    rows = [_row(t, 1.1 * t, 0.9 * t, 0.91 * t) for t in (1e-3, 2e-3, 4e-3, 8e-3)]
    s = rep.scores(rows)
    assert s["seconds"]["within5"] == 0.0 and s["ratio"]["within5"] == 0.0
    assert s["fastest"]["within5"] == 1.0 and s["fastest_ratio"]["within5"] == 1.0
    assert s["fastest"]["median_error"] == pytest.approx(1 - 0.9 / 0.91)


def test_rows_from_before_the_fastest_columns_score_the_other_labels():
    rows = [{k: v for k, v in _row(t, t, t, t).items() if "min" not in k and k != "first_reference_s"}
            for t in (1e-3, 2e-3)]
    assert set(rep.scores(rows)) == {"seconds", "ratio", "rescaled"}
