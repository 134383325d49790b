"""The predictor: features, spec-grouped splits, metrics checked by hand and against
scikit-learn, an MLP that learns a known latency law (in seconds and as a ratio to the reference),
NAS plumbing and save/load."""
import json

import numpy as np
import pytest

from maco.core.errors import MacoError
from maco.layouts.random_convs import random_specs
from maco.layouts.dataset import Row
from maco.layouts.predictor import LatencyPredictor, ReferenceSpeed
from maco.layouts.predictor_baselines import baseline_models, fit_baseline
from maco.layouts.predictor_features import FEATURES, features
from maco.layouts.predictor_fit import fit_predictor
from maco.layouts.predictor_metrics import evaluate, r2_score, split_by_spec
from maco.layouts.predictor_models import MLPConfig, TreeConfig
from maco.layouts.predictor_search import search_config
from maco.layouts.predictor_training import row_labels
from maco.core.spec import ConvSpec
from maco.core.timing import Timing


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


@pytest.mark.parametrize("text", ["n1_c64_h56_w56_k64_r3_p1", "n1_c3_h10_w10_k4_r3", "n1_c16_h10_w10_k16_r3_p2_d2",
                                  "n2_c32_h14_w14_k64_r3_s2_p1_g2", "n1_c32_h28_w28_k32_r3_p1_g32"])
def test_backend_features_name_what_torch_runs(text):
    """The torch_* features say which implementation torch's conv2d ran, as its profiler saw it."""
    import torch

    from maco.kernels.baselines import torch_conv

    ops = {"Mkldnn": "aten::mkldnn_convolution", "Slow2d": "aten::_slow_conv2d_forward",
           "SlowDilated2d": "aten::slow_conv_dilated2d"}
    spec, col = ConvSpec.parse(text), {f: i for i, f in enumerate(FEATURES)}
    for layout in ("NCHW", "NHWC"):
        run = torch_conv(spec, torch.randn(spec.input_shape), torch.randn(spec.weight_shape), layout)
        with torch.profiler.profile() as prof:
            run()
        ran = [name for name, op in ops.items() if op in {e.key for e in prof.key_averages()}]
        x = features([spec], [layout])[0]
        picked = [name for f, name in (("torch_onednn", "Mkldnn"), ("torch_im2col", "Slow2d"),
                                       ("torch_dilated", "SlowDilated2d")) if x[col[f]] == 1]
        assert len(ran) == 1 and picked == ran, (layout, ran, picked)


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
    assert m.clear_pairs == 2 and m.wrong_clear == 0.5  # a: 2.0 vs 1.0, b: 4.0 vs 3.0
    assert m.within_10pct == pytest.approx(3 / 5)  # b's two rows (7.5%, 6.7% off) and c
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
    config, study = search_config(specs[:300], lays[:300], secs[:300], trials=4, epochs=20, progress=False,
                                  families=["mlp"])
    assert isinstance(study.sampler, optuna.samplers.TPESampler)
    assert isinstance(study.pruner, optuna.pruners.HyperbandPruner)
    assert len(study.trials) == 4 and config.epochs == 20 and 1 <= config.layers <= 5
    assert np.isfinite(study.best_value)


def test_nas_chooses_the_family_too(synthetic):
    specs, lays, secs = synthetic
    config, study = search_config(specs[:300], lays[:300], secs[:300], trials=2, progress=False,
                                  families=["trees"])
    assert isinstance(config, TreeConfig) and 3 <= config.depth <= 10 and 300 <= config.trees <= 4000
    _, study = search_config(specs[:300], lays[:300], secs[:300], trials=6, epochs=10, progress=False)
    assert {t.params["family"] for t in study.trials} <= {"mlp", "trees"}
    best = study.best_trial.params["family"]
    assert best == min(("mlp", "trees"), key=lambda f: min(
        (t.value for t in study.trials if t.params["family"] == f and t.value is not None), default=np.inf))
    with pytest.raises(MacoError, match="'forest'"):
        search_config(specs[:40], lays[:40], secs[:40], trials=1, progress=False, families=["forest"])


def test_trees_learn_a_latency_law_and_round_trip(synthetic, tmp_path):
    specs, lays, secs = synthetic
    tr, te = split_by_spec(specs, 0.2, seed=0)
    sub = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    cfg = TreeConfig(depth=6, trees=400, lr=0.05)
    pred = fit_predictor(sub(specs, tr), sub(lays, tr), secs[tr], cfg, ensemble=2)
    p = pred.predict_many(sub(specs, te), sub(lays, te))
    m = evaluate(sub(specs, te), sub(lays, te), secs[te], p)
    assert pred.family == "trees" and m.r2_log > 0.95 and m.median_rel_error < 0.2, m
    pred.save(tmp_path / "t")
    assert (tmp_path / "t" / "model.json.gz").is_file() and not (tmp_path / "t" / "model.pt").exists()
    again = LatencyPredictor.load(tmp_path / "t")
    assert np.array_equal(again.predict_many(sub(specs, te), sub(lays, te)), p)
    assert again.config == cfg and len(again.models) == 1  # one booster, whatever the ensemble


def test_load_refuses_foreign_tree_files(synthetic, tmp_path):
    import gzip
    import hashlib

    specs, lays, secs = synthetic
    fit_predictor(specs[:40], lays[:40], secs[:40], TreeConfig(depth=2, trees=5)).save(tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "predictor.json").read_text())

    def save(text: bytes, cut: int = 0, **changes) -> None:
        blob = gzip.compress(text)
        blob = blob[:len(blob) - cut]
        (tmp_path / "t" / "model.json.gz").write_bytes(blob)
        (tmp_path / "t" / "predictor.json").write_text(
            json.dumps({**doc, "model_sha256": hashlib.sha256(blob).hexdigest(), **changes}))

    save(b'["not a model"]', cut=4)
    with pytest.raises(MacoError, match="model.json.gz is cut"):
        LatencyPredictor.load(tmp_path / "t")
    save(b'["not a model"]')
    with pytest.raises(MacoError, match="not a valid latency predictor: an XGBoost model does not load"):
        LatencyPredictor.load(tmp_path / "t")
    save(b'{"learner": 1}')
    with pytest.raises(MacoError, match="a list of XGBoost JSON models"):
        LatencyPredictor.load(tmp_path / "t")
    with pytest.raises(MacoError, match="exceed 131072 leaves"):
        TreeConfig(depth=10, trees=200)
    save(b"[]", family="forest")
    with pytest.raises(MacoError, match="unknown model family 'forest'"):
        LatencyPredictor.load(tmp_path / "t")



def test_load_refuses_tree_files_xgboost_would_misread_or_crash_on(synthetic, tmp_path):
    """Checked in Python before XGBoost sees them (maco.core.xgb_check): a NaN leaf XGBoost loads and
    predicts NaN from; a feature count other than FEATURES'; a split on a feature the model does not
    read. (Crashing ones run in child processes: tests/test_untrusted_files.py.)"""
    import gzip
    import hashlib

    specs, lays, secs = synthetic
    fit_predictor(specs[:40], lays[:40], secs[:40], TreeConfig(depth=2, trees=5)).save(tmp_path / "t")
    doc = json.loads((tmp_path / "t" / "predictor.json").read_text())
    booster = json.loads(json.loads(gzip.decompress((tmp_path / "t" / "model.json.gz").read_bytes()))[0])

    def save(change) -> None:
        b = json.loads(json.dumps(booster))
        change(b)
        blob = gzip.compress(json.dumps([json.dumps(b)]).encode())
        (tmp_path / "t" / "model.json.gz").write_bytes(blob)
        (tmp_path / "t" / "predictor.json").write_text(
            json.dumps({**doc, "model_sha256": hashlib.sha256(blob).hexdigest()}))

    tree = lambda b: b["learner"]["gradient_booster"]["model"]["trees"][0]  # noqa: E731
    save(lambda b: tree(b)["split_conditions"].__setitem__(tree(b)["left_children"].index(-1), float("nan")))
    with pytest.raises(MacoError, match="not a valid latency predictor: an XGBoost model does not load: .*nan"):
        LatencyPredictor.load(tmp_path / "t")
    save(lambda b: b["learner"]["learner_model_param"].__setitem__("num_feature", "40"))
    with pytest.raises(MacoError, match=f"reads 40 features, not {len(FEATURES)}"):
        LatencyPredictor.load(tmp_path / "t")
    save(lambda b: b["learner"]["gradient_booster"]["model"]["tree_info"].append(0))
    with pytest.raises(MacoError, match="tree_info must be a list of 5 integers"):
        LatencyPredictor.load(tmp_path / "t")
    save(lambda b: None)
    assert len(LatencyPredictor.load(tmp_path / "t").models) == 1

def test_baselines_raw_and_log(synthetic):
    specs, lays, secs = synthetic
    tr, te = split_by_spec(specs, 0.2, seed=0)
    sub = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    models = baseline_models()
    assert set(models) == {"SVR", "linear", "GBRT", "XGBoost"}
    # log latency of a pure power law is linear in the log features: linear regression nails it
    power = np.array([s.flops / 1e11 for s in specs])
    f = fit_baseline(models["linear"], sub(specs, tr), sub(lays, tr), power[tr], "log")
    assert r2_score(np.log(power[te]), np.log(f(sub(specs, te), sub(lays, te)))) > 0.999
    g = fit_baseline(models["GBRT"], sub(specs, tr), sub(lays, tr), secs[tr], "raw")
    assert g(sub(specs, te), sub(lays, te)).shape == (len(te),)
    x = fit_baseline(models["XGBoost"], sub(specs, tr), sub(lays, tr), secs[tr], "log")
    assert r2_score(np.log(secs[te]), np.log(x(sub(specs, te), sub(lays, te)))) > 0.9
    with pytest.raises(MacoError, match="'cubic'"):
        fit_baseline(models["SVR"], specs, lays, secs, "cubic")


def _row(spec: ConvSpec, layout: str, seconds: float, reference: float | None) -> Row:
    ratio = None if reference is None else seconds / reference
    return Row(spec, layout, "cpu", "random", Timing(seconds, seconds, seconds, 0.0, 3, 1, reference, ratio))


def test_a_ratio_label_turns_into_seconds_at_the_speed_measured_now(synthetic, tmp_path):
    """Rows timed in a fast spell and a slow one (the reference slows alike) give one ratio law;
    the predictor trained on it gives seconds at whatever reference speed it is handed."""
    specs, lays, _ = synthetic
    speed = ReferenceSpeed(gflops=400.0, overhead=10e-6)
    rows = []
    for i, (s, lay) in enumerate(zip(specs, lays)):
        slow = 1.0 if (i // 2) % 2 else 1.6  # both layouts of a conv share their spell
        reference = float(speed.seconds(s.flops)) * slow
        rows.append(_row(s, lay, _law(s, lay) / _law(s, "NHWC") * 3.0 * reference, reference))
    label, labels, fitted = row_labels(rows)
    assert label == "ratio" and labels[1] == pytest.approx(3.0)
    # half the rows ran 1.6x slower: the fit lands between the two spells' speeds
    assert 400 / 1.6 < fitted.gflops < 400 and fitted.overhead >= 0
    tr, te = split_by_spec(specs, 0.2, seed=0)
    sub = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    cfg = MLPConfig(layers=3, width=128, activation="silu", lr=3e-3, batch_size=32, epochs=100)
    pred = fit_predictor(sub(specs, tr), sub(lays, tr), labels[tr], cfg, label=label, reference=fitted)
    ratios = pred.predict_labels(sub(specs, te), sub(lays, te))
    m = evaluate(sub(specs, te), sub(lays, te), labels[te], ratios)
    assert m.median_rel_error < 0.05 and m.wrong_clear < 0.05, m
    big = max(sub(specs, te), key=lambda s: s.flops)
    fast, slow = pred.at_speed(800.0), pred.at_speed(200.0)
    assert fast.predict(big, "NCHW") == pytest.approx(
        pred.predict_labels([big], ["NCHW"])[0] * (fitted.overhead + big.flops / 800e9))
    assert slow.predict(big, "NCHW") > 3.5 * fast.predict(big, "NCHW")
    pred.save(tmp_path / "p")
    again = LatencyPredictor.load(tmp_path / "p")
    assert again.label == "ratio" and again.reference == fitted
    assert np.array_equal(again.predict_many(sub(specs, te), sub(lays, te)),
                          pred.predict_many(sub(specs, te), sub(lays, te)))


def test_rows_without_the_reference_train_on_seconds_and_a_ratio_needs_one(synthetic, tmp_path):
    specs, lays, secs = synthetic
    rows = [_row(s, lay, t, None if i == 0 else t / 2) for i, (s, lay, t) in enumerate(zip(specs, lays, secs))]
    label, labels, reference = row_labels(rows)
    assert label == "seconds" and reference is None and labels[0] == secs[0]
    with pytest.raises(MacoError, match="1 of 800 rows were timed without the reference"):
        row_labels(rows, "ratio")
    with pytest.raises(MacoError, match="needs the reference speed"):
        fit_predictor(specs[:40], lays[:40], secs[:40], MLPConfig(layers=1, width=8, epochs=2), label="ratio")
    with pytest.raises(MacoError, match="gflops=-1"):
        ReferenceSpeed(gflops=-1.0)
    # a predictor saved before labels existed reads as one trained on seconds
    pred = fit_predictor(specs[:40], lays[:40], secs[:40], MLPConfig(layers=1, width=8, epochs=2))
    pred.save(tmp_path / "p")
    doc = json.loads((tmp_path / "p" / "predictor.json").read_text())
    del doc["label"], doc["reference"]
    (tmp_path / "p" / "predictor.json").write_text(json.dumps(doc))
    old = LatencyPredictor.load(tmp_path / "p")
    assert old.label == "seconds" and old.at_speed(1.0) is old
    doc["label"] = "joules"
    (tmp_path / "p" / "predictor.json").write_text(json.dumps(doc))
    with pytest.raises(MacoError, match="'joules'"):
        LatencyPredictor.load(tmp_path / "p")


def test_at_speed_now_times_the_reference_on_this_cpu(synthetic):
    from maco.layouts.latency_sources import at_speed_now

    specs, lays, secs = synthetic
    cfg = MLPConfig(layers=1, width=8, epochs=2)
    ratio = fit_predictor(specs[:40], lays[:40], secs[:40] * 1e3, cfg, label="ratio",
                          reference=ReferenceSpeed(gflops=1e-3, overhead=0.0))
    now = at_speed_now(ratio)
    # a real core runs the FMA loop at GFLOP/s, not at a millionth of one
    assert 1.0 < now.reference.gflops < 1e5 and now.reference.overhead == 0.0
    seconds = fit_predictor(specs[:40], lays[:40], secs[:40], cfg)
    assert at_speed_now(seconds) is seconds


def test_a_predictor_trained_on_another_cpu_warns_where_it_plans(synthetic, tmp_path):
    import warnings

    from maco.layouts.latency_sources import at_speed_now
    from maco.core.target import Target

    specs, lays, secs = synthetic
    here = Target.host().model
    pred = fit_predictor(specs[:40], lays[:40], secs[:40], TreeConfig(depth=2, trees=5),
                         meta={"cpus": ["Some Other CPU 9000"]})
    pred.save(tmp_path / "p")
    pred = LatencyPredictor.load(tmp_path / "p")
    assert pred.meta["cpus"] == ["Some Other CPU 9000"]
    why = pred.foreign_to(here)
    assert "Some Other CPU 9000" in why and here in why and "maco collect" in why
    with pytest.warns(UserWarning, match="trained on convs timed on Some Other CPU 9000"):
        at_speed_now(pred)
    # trained here, or saved without its CPUs (predictors from before): no warning
    for cpus in ([here, "Some Other CPU 9000"], None):
        same = fit_predictor(specs[:40], lays[:40], secs[:40], TreeConfig(depth=2, trees=5),
                             meta={"cpus": cpus} if cpus else {})
        assert same.foreign_to(here) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            at_speed_now(same)


def test_load_refuses_cpus_that_are_not_a_list_of_names(synthetic, tmp_path):
    specs, lays, secs = synthetic
    fit_predictor(specs[:40], lays[:40], secs[:40], TreeConfig(depth=2, trees=5)).save(tmp_path / "p")
    doc = json.loads((tmp_path / "p" / "predictor.json").read_text())
    for bad in ("Intel Xeon", [1, 2]):
        (tmp_path / "p" / "predictor.json").write_text(json.dumps({**doc, "meta": {"cpus": bad}}))
        with pytest.raises(MacoError, match="meta.cpus must be a list of CPU names"):
            LatencyPredictor.load(tmp_path / "p")


def test_each_shipped_predictor_names_its_cpu_and_plans_there():
    from pathlib import Path

    from maco.layouts.dataset import cpus_of, load_rows
    from maco.layouts.latency_sources import DEFAULT_PREDICTOR, shipped_predictor

    shipped = sorted(Path(DEFAULT_PREDICTOR).parent.glob("predictor_cpu*"))
    assert len(shipped) >= 2
    for folder in shipped:
        pred = LatencyPredictor.load(folder)
        data = pred.meta["data"]
        assert pred.meta["cpus"] == cpus_of(data, [r for r in load_rows(data) if r.device == "cpu"])
        assert [shipped_predictor(cpu) for cpu in pred.meta["cpus"]] == [str(folder)] * len(pred.meta["cpus"])
    assert shipped_predictor("Some Other CPU 9000") == DEFAULT_PREDICTOR
