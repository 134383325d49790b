"""The cost model's prior: trained on other convs' measurements (each on the machine it was
measured on), used for a conv until it has records of its own, and only where it fits."""
import gzip
from dataclasses import replace

import numpy as np
import pytest

from maco import ConvSpec, MacoError, Target, space
from maco.tune.cost_model import (MIN_TRAINING_RECORDS, PRIOR_FILE, CostModel, analytic_score, analytic_seconds,
                                  prior_fits, shipped_prior)
from maco.tune.cost_prior_train import train_prior
from maco.tune.records import RecordFile, make_record
from tests.test_search import synthetic
from tests.targets import AVX2

SEEN = [ConvSpec.parse("n1_c32_h28_w28_k64_r3_p1"), ConvSpec.parse("n1_c64_h14_w14_k64_r3_p1")]
UNSEEN = ConvSpec.parse("n1_c48_h20_w20_k96_r3_p1")


def _records(specs, target, n=80, seed=1):
    out = []
    for i, spec in enumerate(specs):
        scheds = space.sample_many(spec, target, n, seed + i)
        out += [make_record(spec, target, s, t, e) for s, (t, e) in zip(scheds, synthetic()(spec, scheds, target))]
    return out


def _rank_corr(a, b):
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    return np.corrcoef(rank(a), rank(b))[0, 1]


def test_a_prior_trained_on_other_convs_ranks_an_unseen_conv_until_it_has_records():
    prior = train_prior(_records(SEEN, AVX2))
    assert prior.attr("isas") == "avx2" and prior.attr("convs") == "2" and prior_fits(prior, AVX2)
    model = CostModel(AVX2, prior=prior)
    test = space.sample_many(UNSEEN, AVX2, 60, 9)
    score = model.predict(UNSEEN, test)
    assert list(score) != [analytic_score(UNSEEN, AVX2, s) for s in test]
    assert _rank_corr(score, [1 / analytic_seconds(UNSEEN, AVX2, s) for s in test]) > 0.5
    own = _records([UNSEEN], AVX2, n=MIN_TRAINING_RECORDS + 4, seed=5)
    model.fit(own)  # enough records of its own: the model trained on them ranks it
    assert UNSEEN in model.trained_on
    assert list(model.predict(UNSEEN, test)) == list(CostModel(AVX2, prior=False).fit(own).predict(UNSEEN, test))


def test_a_prior_holds_out_the_convs_it_is_told_to_and_refuses_too_little_data():
    recs = _records(SEEN, AVX2, n=30)
    assert train_prior(recs, exclude=[SEEN[0]]).attr("convs") == "1"
    with pytest.raises(MacoError, match="at least 8 measured CPU schedules, got 0"):
        train_prior(recs, exclude=SEEN)


def test_a_prior_is_not_used_on_another_isa_nor_with_another_feature_vector():
    prior = train_prior(_records(SEEN, AVX2, n=30))
    avx512 = replace(AVX2, isa="avx512", simd_width=16)
    assert not prior_fits(prior, avx512)
    test = space.sample_many(UNSEEN, avx512, 10, 3)
    assert list(CostModel(avx512, prior=prior).predict(UNSEEN, test)) == [analytic_score(UNSEEN, avx512, s)
                                                                         for s in test]
    import xgboost as xgb

    few = xgb.train({"verbosity": 0}, xgb.DMatrix(np.zeros((4, 3)), label=np.zeros(4)), 1)  # 3 features
    few.set_attr(isas="avx2")
    assert not prior_fits(few, AVX2) and CostModel(AVX2, prior=few).prior is None


def test_the_shipped_prior_loads_and_fits_todays_features_on_avx512():
    """A change to the feature vector must come with a rebuilt prior (python -m maco.tune.cost_prior_train)."""
    assert PRIOR_FILE.is_file()
    prior = shipped_prior()
    avx512 = replace(AVX2, isa="avx512", simd_width=16,
                     levels=tuple(replace(lvl, vector_width=16) for lvl in AVX2.levels))
    assert prior.attr("isas") == "avx512" and int(prior.attr("schedules")) > 5000
    assert prior_fits(prior, avx512) and CostModel(avx512).prior is prior
    assert CostModel(AVX2).prior is None  # trained on AVX-512 machines only


def test_a_cpu_target_comes_back_from_its_fingerprint():
    host = Target.host()
    assert Target.from_fingerprint(host.fingerprint()).fingerprint() == host.fingerprint()
    assert Target.from_fingerprint(AVX2.fingerprint()).simd_width == 8
    with pytest.raises(MacoError, match="not a CPU fingerprint MACO knows: kind 'cuda'"):
        Target.from_fingerprint(Target.h100().fingerprint())


def test_records_are_read_from_a_gzip_file_and_a_cut_one_is_named(tmp_path):
    recs = _records(SEEN[:1], AVX2, n=5)
    path = tmp_path / "r.jsonl.gz"
    data = "".join(r.to_json() + "\n" for r in recs).encode()
    path.write_bytes(gzip.compress(data))
    assert [r.schedule for r in RecordFile(path).load()] == [r.schedule for r in recs]
    path.write_bytes(gzip.compress(data)[:-20])
    with pytest.raises(MacoError, match="cannot read records file .*r.jsonl.gz"):
        RecordFile(path).load()


def test_the_shipped_prior_is_checked_against_its_checksum_before_xgboost_reads_it(tmp_path):
    """The prior holds the sha256 of its content (learner attribute `sha256`, written by
    `python -m maco.tune.cost_prior_train`): an edited leaf, which XGBoost would load and use without a word,
    is named as damage; a copy loads and predicts as the shipped one does."""
    import json

    from maco.tune.cost_model import load_prior

    doc = json.loads(PRIOR_FILE.read_text())
    assert doc["learner"]["attributes"]["sha256"]
    (tmp_path / "copy.json").write_text(json.dumps(doc))
    x = np.random.default_rng(0).random((16, 79))
    assert np.array_equal(load_prior(tmp_path / "copy.json").inplace_predict(x), shipped_prior().inplace_predict(x))
    tree = doc["learner"]["gradient_booster"]["model"]["trees"][3]
    leaf = tree["left_children"].index(-1)
    tree["split_conditions"][leaf] *= 2
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    with pytest.raises(MacoError, match="cost-model prior .*edited.json.* is damaged"):
        load_prior(tmp_path / "edited.json")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(MacoError, match="is a directory"):
        load_prior(tmp_path / "dir.json")
