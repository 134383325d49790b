"""The predictor: features, spec-grouped splits, metrics checked by hand and against
scikit-learn, an MLP that learns a known latency law, NAS plumbing and save/load."""
import json

import numpy as np
import pytest

from maco.errors import MacoError
from maco.layouts.dataset import random_specs
from maco.layouts.predictor import (FEATURES, LatencyPredictor, MLPConfig, baseline_models,
                                    evaluate, features, fit_baseline, fit_predictor, r2_score,
                                    search_config, split_by_spec)
from maco.spec import ConvSpec


def _law(spec: ConvSpec, layout: str) -> float:
    """A made-up but conv-like latency: compute at a rate that depends on the layout and (for
    NCHW) on the channel count, plus memory traffic and a fixed overhead."""
    rate = 2e11 if layout == "NHWC" else 0.6e11 * (spec.c / 8) ** 0.4
    return 5e-6 + spec.flops / rate + (spec.input_bytes + spec.output_bytes) / 2e10


@pytest.fixture(scope="module")
def synthetic():
    specs = random_specs(400, seed=3, max_flops=3e8)
    s2 = [s for s in specs for _ in (0, 1)]
    lays = ["NCHW", "NHWC"] * len(specs)
    secs = np.array([_law(s, lay) for s, lay in zip(s2, lays)])
    return s2, lays, secs


def test_features():
    spec = ConvSpec.parse("n2_c32_h14_w14_k64_r3_s2_p1_g2")
    x = features([spec, spec], ["NCHW", "NHWC"])
    raw = features([spec], ["NHWC"], log=False)
    assert x.shape == (2, len(FEATURES)) and list(x[:, 0]) == [0, 1]
    col = {f: i for i, f in enumerate(FEATURES)}
    assert raw[0, col["flops"]] == spec.flops and raw[0, col["groups"]] == 2
    assert x[0, col["flops"]] == pytest.approx(np.log(spec.flops)) and x[0, col["kh"]] == 3
    with pytest.raises(MacoError, match="'NCWH'"):
        features([spec], ["NCWH"])


def test_split_keeps_layouts_together(synthetic):
    specs, _, _ = synthetic
    tr, te = split_by_spec(specs, 0.25, seed=1)
    assert len(set(tr) | set(te)) == len(specs) and not set(tr) & set(te)
    assert not {str(specs[i]) for i in tr} & {str(specs[i]) for i in te}
    assert 0.2 < len(te) / len(specs) < 0.3
    with pytest.raises(MacoError, match="1.5"):
        split_by_spec(specs, 1.5)


def test_metrics_by_hand_and_against_sklearn():
    from sklearn.metrics import r2_score as sk_r2

    a, b, c = (ConvSpec.parse(t) for t in ("n1_c8_h8_w8_k8_r3", "n1_c8_h8_w8_k16_r3", "n1_c8_h9_w9_k8_r1"))
    specs = [a, a, b, b, c]
    lays = ["NCHW", "NHWC"] * 2 + ["NCHW"]
    measured = np.array([1.0, 2.0, 4.0, 3.0, 5.0])
    predicted = np.array([1.5, 1.2, 3.7, 3.2, 5.0])  # a: wrong pick (costs 1.0), b: right
    m = evaluate(specs, lays, measured, predicted)
    assert m.pairs == 2 and m.wrong_picks == 0.5 and m.wrong_picks_5pct == 0.5
    assert m.pick_cost == pytest.approx(1.0 / (1.0 + 3.0))
    assert m.r2 == pytest.approx(sk_r2(measured, predicted))
    assert m.r2_log == pytest.approx(sk_r2(np.log(measured), np.log(predicted)))
    assert r2_score(measured, measured) == 1.0


def test_mlp_learns_a_latency_law_and_round_trips(synthetic, tmp_path):
    specs, lays, secs = synthetic
    tr, te = split_by_spec(specs, 0.2, seed=0)
    sub = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    cfg = MLPConfig(layers=3, width=128, activation="silu", lr=3e-3, batch_size=32, epochs=100)
    pred = fit_predictor(sub(specs, tr), sub(lays, tr), secs[tr], cfg, ensemble=2)
    p = pred.predict_many(sub(specs, te), sub(lays, te))
    m = evaluate(sub(specs, te), sub(lays, te), secs[te], p)
    assert m.r2_log > 0.99 and m.r2 > 0.98 and m.median_rel_error < 0.1, m
    assert m.wrong_picks < 0.1 and m.wrong_picks_5pct < 0.05, m
    # a model that ignored the layout would pick wrongly about half the time; it has learned it
    assert pred.predict(specs[te[0]], "NHWC") != pred.predict(specs[te[0]], "NCHW")
    pred.save(tmp_path / "p")
    again = LatencyPredictor.load(tmp_path / "p")
    assert np.array_equal(again.predict_many(sub(specs, te), sub(lays, te)), p)
    assert again.config == cfg and len(again.models) == 2


def test_load_refuses_torn_or_foreign_files(synthetic, tmp_path):
    specs, lays, secs = synthetic
    pred = fit_predictor(specs[:40], lays[:40], secs[:40], MLPConfig(layers=1, width=8, epochs=2))
    pred.save(tmp_path / "p")
    blob = (tmp_path / "p" / "model.pt").read_bytes()
    (tmp_path / "p" / "model.pt").write_bytes(blob[:-10] + b"0123456789")
    with pytest.raises(MacoError, match="does not match"):
        LatencyPredictor.load(tmp_path / "p")
    pred.save(tmp_path / "q")
    doc = json.loads((tmp_path / "q" / "predictor.json").read_text())
    doc["features"] = doc["features"][:-1]
    (tmp_path / "q" / "predictor.json").write_text(json.dumps(doc))
    with pytest.raises(MacoError, match="other features"):
        LatencyPredictor.load(tmp_path / "q")
    with pytest.raises(MacoError, match="cannot read"):
        LatencyPredictor.load(tmp_path / "missing")


def test_nas_uses_tpe_and_hyperband_and_returns_a_config(synthetic):
    import optuna

    specs, lays, secs = synthetic
    config, study = search_config(specs[:300], lays[:300], secs[:300], trials=4, epochs=20, progress=False)
    assert isinstance(study.sampler, optuna.samplers.TPESampler)
    assert isinstance(study.pruner, optuna.pruners.HyperbandPruner)
    assert len(study.trials) == 4 and config.epochs == 20 and 1 <= config.layers <= 5
    assert np.isfinite(study.best_value)


def test_baselines_raw_and_log(synthetic):
    specs, lays, secs = synthetic
    tr, te = split_by_spec(specs, 0.2, seed=0)
    sub = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    models = baseline_models()
    assert set(models) == {"SVR", "linear", "GBRT"}
    # log latency of a pure power law is linear in the log features: linear regression nails it
    power = np.array([s.flops / 1e11 for s in specs])
    f = fit_baseline(models["linear"], sub(specs, tr), sub(lays, tr), power[tr], "log")
    assert r2_score(np.log(power[te]), np.log(f(sub(specs, te), sub(lays, te)))) > 0.999
    g = fit_baseline(models["GBRT"], sub(specs, tr), sub(lays, tr), secs[tr], "raw")
    assert g(sub(specs, te), sub(lays, te)).shape == (len(te),)
    with pytest.raises(MacoError, match="'cubic'"):
        fit_baseline(models["SVR"], specs, lays, secs, "cubic")
