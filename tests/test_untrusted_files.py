"""Files users share (a latency predictor, the cost model's prior, a saved model, schedules,
records) never crash, hang or exhaust the process: a crafted XGBoost model is refused in Python
before XGBoost's native code reads out of bounds, a FIFO or a link to /dev/zero is refused
before it is read, and a number or nesting Python's parser refuses is one line.

Whatever can crash or hang runs in a child process (with a timeout and a memory limit), so a
regression shows as a failed test (a negative return code is a signal: -11 a segfault) instead
of taking pytest down with it."""
import copy
import gzip
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from maco import ConvSpec
from maco.core.errors import MacoError
from maco.core.files import MAX_JSON_DEPTH, json_depth, load_json, load_json_file, read_bytes, read_text
from maco.core.xgb_check import CHECKSUM_ATTR, check_booster, content_sha256

ROOT = Path(__file__).resolve().parents[1]
DEEP = 300_000  # nesting levels that overflow XGBoost's recursive JSON parser


def _limit_memory() -> None:  # a regression that reads /dev/zero stops at 4 GiB, not at the machine's end
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _run(code: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter; a MacoError it lets out is printed as one line, exit 2."""
    wrapped = ("import sys\nfrom maco.core.errors import MacoError\ntry:\n" + textwrap.indent(textwrap.dedent(code), "    ")
               + "\nexcept MacoError as exc:\n    print(exc, file=sys.stderr)\n    sys.exit(2)\n")
    try:
        return subprocess.run([sys.executable, "-c", wrapped, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})},
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s (a FIFO read, or an endless loop in native code)")


def _one_line(proc: subprocess.CompletedProcess, *phrases: str) -> str:
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode} (139 / -11: a segfault)"
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warning" not in ln.lower()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


# -- crafted boosters ------------------------------------------------------------------------------
def _trees(doc: dict) -> list[dict]:
    return doc["learner"]["gradient_booster"]["model"]["trees"]


def _inner_and_leaf(tree: dict) -> tuple[int, int]:
    """An internal node other than the root, and a leaf."""
    left = tree["left_children"]
    inner = next(i for i in range(1, len(left)) if left[i] != -1)
    return inner, left.index(-1)


def _child_1e9(doc):
    _trees(doc)[0]["left_children"][0] = 10**9


def _child_is_root(doc):  # a cycle back to the root
    inner, _ = _inner_and_leaf(_trees(doc)[0])
    _trees(doc)[0]["left_children"][inner] = 0


def _cycle_below(doc):  # a leaf turned into a node whose children are its own ancestors
    tree = _trees(doc)[0]
    _, leaf = _inner_and_leaf(tree)
    tree["left_children"][leaf], tree["right_children"][leaf] = tree["left_children"][0], tree["right_children"][0]


def _split_1e9(doc):
    _trees(doc)[0]["split_indices"][0] = 10**9


def _nan_leaf(doc):
    _, leaf = _inner_and_leaf(_trees(doc)[0])
    _trees(doc)[0]["split_conditions"][leaf] = float("nan")


def _bad_indptr(doc):
    model = doc["learner"]["gradient_booster"]["model"]
    model["iteration_indptr"] = [0, 10**6] + model["iteration_indptr"][2:]


def _deep(doc):
    doc["x"] = "DEEP"  # replaced in the text: json.dumps itself would recurse too deeply


MUTATIONS = {  # name -> (change, a phrase of the one line that refuses it)
    "child index 1e9": (_child_1e9, "left child 1000000000 is neither -1"),
    "a child pointing at the root": (_child_is_root, "child 0 is neither -1"),
    "a cycle below the root": (_cycle_below, "is the child of 2 nodes"),
    "split on feature 1e9": (_split_1e9, "splits on feature 1000000000"),
    "NaN leaf": (_nan_leaf, "nan"),
    "iteration_indptr past the trees": (_bad_indptr, "iteration_indptr"),
    f"{DEEP:,} levels of nesting": (_deep, f"nested too deeply (more than {MAX_JSON_DEPTH} levels)"),
}


def _mutated_text(doc: dict, change) -> str:
    doc = copy.deepcopy(doc)
    change(doc)
    text = json.dumps(doc)
    return text.replace('"DEEP"', "[" * DEEP + "]" * DEEP)


@pytest.fixture(scope="module")
def tree_predictor(tmp_path_factory):
    """A small boosted-tree predictor saved to a folder, and its booster as parsed JSON."""
    from maco.layouts.random_convs import random_specs
    from maco.layouts.predictor_fit import fit_predictor
    from maco.layouts.predictor_models import TreeConfig

    specs = [s for s in random_specs(30, seed=1, max_flops=1e8) for _ in (0, 1)]
    lays = ["NCHW", "NHWC"] * 30
    secs = np.array([1e-6 + s.flops / (1e11 if lay == "NHWC" else 6e10) for s, lay in zip(specs, lays)])
    folder = tmp_path_factory.mktemp("pred") / "good"
    fit_predictor(specs, lays, secs, TreeConfig(depth=3, trees=4)).save(folder)
    texts = json.loads(gzip.decompress((folder / "model.json.gz").read_bytes()))
    return folder, json.loads(texts[0])


def _predictor_with(src: Path, dst: Path, booster_text: str) -> Path:
    """A copy of the predictor at `src` holding `booster_text`, its sha256 made to match."""
    dst.mkdir(parents=True, exist_ok=True)
    blob = gzip.compress(json.dumps([booster_text]).encode(), mtime=0)
    doc = json.loads((src / "predictor.json").read_text())
    doc["model_sha256"] = hashlib.sha256(blob).hexdigest()
    (dst / "model.json.gz").write_bytes(blob)
    (dst / "predictor.json").write_text(json.dumps(doc))
    return dst


LOAD_PREDICTOR = """
from maco import ConvSpec
from maco.layouts import load_predictor
pred = load_predictor()  # XGBoost loads a crafted tree without a word; it reads out of bounds predicting
print(pred.predict_many([ConvSpec.parse(f"n1_c{c}_h{h}_w{h}_k{c}_r3_p1") for c in (8, 64) for h in (7, 56)],
                        ["NCHW", "NHWC"] * 2))
"""


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_crafted_predictor_through_MACO_PREDICTOR_is_one_line_not_a_crash(tree_predictor, tmp_path, name):
    good, doc = tree_predictor
    change, phrase = MUTATIONS[name]
    bad = _predictor_with(good, tmp_path / "bad", _mutated_text(doc, change))
    _one_line(_run(LOAD_PREDICTOR, env={"MACO_PREDICTOR": str(bad)}), str(bad), "not a valid latency predictor",
              phrase)


def test_the_untouched_predictor_loads_and_predicts(tree_predictor, tmp_path):
    """The control: the same copy, unmutated, loads through the same path and predicts."""
    good, doc = tree_predictor
    same = _predictor_with(good, tmp_path / "same", json.dumps(doc))
    proc = _run(LOAD_PREDICTOR, env={"MACO_PREDICTOR": str(same)})
    assert proc.returncode == 0 and "e-" in proc.stdout, proc.stderr[-2000:]


def test_a_crafted_predictor_given_to_maco_plan_is_one_line(tree_predictor, tmp_path):
    good, doc = tree_predictor
    bad = _predictor_with(good, tmp_path / "bad", _mutated_text(doc, _child_1e9))
    proc = subprocess.run([sys.executable, "-m", "maco.cli", "plan", "alexnet", "--latency", "predict",
                           "--predictor", str(bad), "--rounds", "0", "--no-progress"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = _one_line(proc, "left child 1000000000")
    assert line.startswith("maco plan: error: ")


def test_a_deeply_nested_model_list_or_predictor_json_is_one_line(tree_predictor, tmp_path):
    good, _ = tree_predictor
    bad = _predictor_with(good, tmp_path / "list", "x")
    blob = gzip.compress(b"[" * DEEP + b"]" * DEEP, mtime=0)
    (bad / "model.json.gz").write_bytes(blob)
    doc = json.loads((bad / "predictor.json").read_text())
    (bad / "predictor.json").write_text(json.dumps({**doc, "model_sha256": hashlib.sha256(blob).hexdigest()}))
    _one_line(_run(LOAD_PREDICTOR, env={"MACO_PREDICTOR": str(bad)}), "nested too deeply")
    (bad / "predictor.json").write_text('{"format": 1, "meta": ' + "[" * DEEP + "]" * DEEP + "}")
    _one_line(_run(LOAD_PREDICTOR, env={"MACO_PREDICTOR": str(bad)}), "nested too deeply")


def test_the_checks_take_the_shipped_models_and_name_each_flaw(tree_predictor):
    """In-process: every shipped booster passes; each mutation is refused before XGBoost is asked."""
    from maco.tune.cost_model import PRIOR_FILE

    for folder in sorted((ROOT / "results").glob("predictor_cpu*")):
        for text in json.loads(gzip.decompress((folder / "model.json.gz").read_bytes())):
            assert check_booster(load_json(text, "booster"), str(folder), 33) == 33
    assert check_booster(json.loads(PRIOR_FILE.read_text()), "prior") == 79
    _, doc = tree_predictor
    for name, (change, phrase) in MUTATIONS.items():
        with pytest.raises(MacoError, match="not a usable XGBoost model|nested too deeply") as err:
            text = _mutated_text(doc, change)
            check_booster(load_json(text, "booster"), "booster")
        assert phrase in str(err.value), (name, str(err.value))
    wrong = copy.deepcopy(doc)
    wrong["learner"]["learner_model_param"]["base_score"] = "[inf]"
    with pytest.raises(MacoError, match="base_score must be one finite number"):
        check_booster(wrong, "booster")
    with pytest.raises(MacoError, match="reads 33 features, not 79"):
        check_booster(doc, "booster", 79)


def test_a_pickle_where_a_predictor_keeps_its_weights_is_one_line(tmp_path):
    """model.pt is read with torch's weights-only unpickler; a pickle of anything else (here a
    function) whose sha256 predictor.json names is refused in one line, not an UnpicklingError."""
    import pickle

    from maco.layouts.random_convs import random_specs
    from maco.layouts.predictor import LatencyPredictor
    from maco.layouts.predictor_fit import fit_predictor
    from maco.layouts.predictor_models import MLPConfig

    specs = [s for s in random_specs(10, seed=2, max_flops=1e8) for _ in (0, 1)]
    pred = fit_predictor(specs, ["NCHW", "NHWC"] * 10, np.full(20, 1e-3), MLPConfig(layers=1, width=4, epochs=1))
    pred.save(tmp_path / "m")
    blob = pickle.dumps(os.getcwd)
    (tmp_path / "m" / "model.pt").write_bytes(blob)
    doc = json.loads((tmp_path / "m" / "predictor.json").read_text())
    (tmp_path / "m" / "predictor.json").write_text(json.dumps({**doc, "model_sha256": hashlib.sha256(blob).hexdigest()}))
    with pytest.raises(MacoError, match="not a valid latency predictor") as err:
        LatencyPredictor.load(tmp_path / "m")
    assert "\n" not in str(err.value)


# -- the cost model's prior ------------------------------------------------------------------------
LOAD_PRIOR = """
from pathlib import Path
import maco.tune.cost_model as cm
cm.PRIOR_FILE = Path(sys.argv[1])  # the shipped prior's path, pointed at a damaged copy
import numpy as np
prior = cm.shipped_prior()  # XGBoost loads a crafted tree without a word; it reads out of bounds predicting
print(prior.inplace_predict(np.random.default_rng(0).random((64, 79)) * 8).mean(), prior.num_features())
"""


def _prior_doc() -> dict:
    from maco.tune.cost_model import PRIOR_FILE

    return json.loads(PRIOR_FILE.read_text())


def _with_checksum(doc: dict) -> dict:
    """A crafted prior whose checksum fits it: the checksum finds damage, the structure check the rest."""
    doc["learner"]["attributes"][CHECKSUM_ATTR] = content_sha256(doc)
    return doc


def test_the_shipped_prior_carries_a_checksum_of_its_content():
    doc = _prior_doc()
    assert doc["learner"]["attributes"][CHECKSUM_ATTR] == content_sha256(doc)


def test_a_copy_of_the_prior_loads_and_a_damaged_one_is_named(tmp_path):
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(_prior_doc()))
    proc = _run(LOAD_PRIOR, str(path))
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "79", proc.stderr[-2000:]
    damaged = _prior_doc()  # one leaf changed, still a booster XGBoost would load and use
    tree = _trees(damaged)[7]
    _, leaf = _inner_and_leaf(tree)
    tree["split_conditions"][leaf] += 0.25
    path.write_text(json.dumps(damaged))
    _one_line(_run(LOAD_PRIOR, str(path)), str(path), "is damaged")
    path.write_text(json.dumps(_prior_doc())[:-1000])  # cut
    _one_line(_run(LOAD_PRIOR, str(path)), "not a cost-model prior")
    missing = _prior_doc()
    del missing["learner"]["attributes"][CHECKSUM_ATTR]
    path.write_text(json.dumps(missing))
    _one_line(_run(LOAD_PRIOR, str(path)), "has no checksum")


@pytest.mark.parametrize("name", ["child index 1e9", "a cycle below the root", "NaN leaf", "split on feature 1e9",
                                  f"{DEEP:,} levels of nesting"])
def test_a_crafted_prior_is_one_line_not_a_crash(tmp_path, name):
    change, phrase = MUTATIONS[name]
    doc = _prior_doc()
    change(doc)
    if name != f"{DEEP:,} levels of nesting":
        _with_checksum(doc)
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(doc).replace('"DEEP"', "[" * DEEP + "]" * DEEP))
    _one_line(_run(LOAD_PRIOR, str(path)), "cost-model prior", phrase)


def test_save_prior_writes_a_checksum_load_prior_accepts(tmp_path):
    import xgboost as xgb

    from maco.tune.cost_model import load_prior
    from maco.tune.cost_prior_train import save_prior

    rng = np.random.default_rng(0)
    booster = xgb.train({"max_depth": 2, "nthread": 1, "verbosity": 0},
                        xgb.DMatrix(rng.random((40, 5)), label=rng.random(40)), 3)
    booster.set_attr(isas="avx2")
    save_prior(booster, tmp_path / "p.json")
    again = load_prior(tmp_path / "p.json")
    x = rng.random((4, 5))
    assert np.array_equal(again.inplace_predict(x), booster.inplace_predict(x)) and again.attr("isas") == "avx2"


# -- special files, sizes, numbers -----------------------------------------------------------------
def test_a_saved_model_linked_to_dev_zero_is_refused_before_it_is_read(tmp_path):
    link = tmp_path / "model.maco"
    link.symlink_to("/dev/zero")
    start = time.perf_counter()
    proc = _run("import maco, torch\nmaco.load(sys.argv[1], torch.nn.Linear(2, 2))", str(link), timeout=60)
    _one_line(proc, str(link), "is a character device, not a regular file")
    assert time.perf_counter() - start < 60
    with pytest.raises(MacoError, match="character device"):
        read_bytes(link, "saved MACO model")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "schedule.json"
    os.mkfifo(fifo)
    _one_line(_run("from maco.core.files import load_json_file\nload_json_file(sys.argv[1], 'schedule file')",
                   str(fifo), timeout=30), "named pipe (FIFO), not a regular file")
    proc = subprocess.run([sys.executable, "-m", "maco.cli", "bench", "n1_c8_h10_w10_k16_r3_p1", "--schedule",
                           str(fifo)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert _one_line(proc, str(fifo), "named pipe").startswith("maco bench: error: ")


def test_reads_stop_at_the_cap_and_name_folders_and_missing_files(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('{"a": [1, 2]}')
    assert load_json_file(f, "plan") == {"a": [1, 2]} and read_text(f, "plan", max_bytes=13) == '{"a": [1, 2]}'
    with pytest.raises(MacoError, match="is 13 bytes, more than the 12-byte limit"):
        read_text(f, "plan", max_bytes=12)
    with pytest.raises(MacoError, match="is a directory, not a file"):
        read_text(tmp_path, "plan")
    with pytest.raises(MacoError, match="does not exist"):
        read_text(tmp_path / "nope", "plan")
    f.write_bytes(b"\x80\x81")
    with pytest.raises(MacoError, match="cannot read plan .*utf-8"):
        read_text(f, "plan")


def test_a_pickled_model_where_a_saved_model_is_expected_is_one_line(tmp_path):
    import pickle

    import torch

    import maco

    for name, write in (("torch.save", lambda p: torch.save(torch.nn.Linear(2, 2), p)),
                        ("pickle", lambda p: p.write_bytes(pickle.dumps({"a": 1}))),
                        ("pickle protocol 0", lambda p: p.write_bytes(pickle.dumps({"a": 1}, protocol=0)))):
        path = tmp_path / f"{name}.maco"
        write(path)
        with pytest.raises(MacoError, match="saved MACO model") as err:
            maco.load(path, torch.nn.Linear(2, 2))
        assert "\n" not in str(err.value), name


def test_an_integer_of_more_than_4300_digits_is_one_line_and_one_skipped_record(tmp_path):
    with pytest.raises(MacoError, match="not a plan: it holds an integer of more than 4300 digits"):
        load_json('{"a": 1' + "0" * 5000 + "}", "plan")
    with pytest.raises(MacoError, match="integer of more than"):
        ConvSpec.from_json('{"n": 1, "c": 1' + "0" * 5000 + ', "h": 8, "w": 8, "k": 8, "kh": 3, "kw": 3}')
    from maco import Target, kernels
    from maco.tune.records import RecordFile, make_record
    from maco.core.timing import Timing

    spec, target = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1), Target.host()
    good = make_record(spec, target, kernels.default_schedule(spec, target, "NHWC"),
                       Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 10)).to_json()
    huge = re.sub(r'"repeats": ?3', '"repeats": 1' + "0" * 5000, good)
    assert huge != good
    path = tmp_path / "r.jsonl"
    path.write_text(good + "\n" + huge + "\n" + good + "\n")
    records = RecordFile(path)
    with pytest.warns(UserWarning, match="skipped 1 bad record line"):
        assert len(records.load()) == 2
    assert [n for n, _ in records.bad_lines] == [2] and "4300 digits" in records.bad_lines[0][1]


def test_nesting_is_counted_outside_strings_without_recursion():
    assert json_depth('[[1], {"a": [2]}]') == 3 and json_depth("") == 0
    assert json_depth('["[[[[", {"a\\"[[": "]]]"}]') == 2
    assert load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "plan") is not None
    with pytest.raises(MacoError, match=fr"not a plan: nested too deeply \(more than {MAX_JSON_DEPTH} levels\)"):
        load_json("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "plan")
    with pytest.raises(MacoError, match="nested too deeply"):
        load_json(b"{\"a\": " * DEEP + b"1" + b"}" * DEEP, "plan")


# -- huge specs ------------------------------------------------------------------------------------
def test_a_spec_past_a_c_int_is_refused_where_it_is_parsed():
    for text, field in (("n1_c64_h1000000000000000000000_w56_k64_r3x3", "ConvSpec.h="),
                        ("n1_c64_h2147483647_w56_k64_r3x3_p1", "the padded input 2147483647 + 2*1 along h"),
                        ("n1_c64_h56_w56_k64_r3x3_d4294967296", "ConvSpec.dilation=")):
        with pytest.raises(MacoError, match="past 2147483647") as err:
            ConvSpec.parse(text)
        assert field in str(err.value)
    assert ConvSpec.parse("n1_c64_h2147483647_w56_k64_r3x3").h == 2**31 - 1  # the largest still fits
    proc = subprocess.run([sys.executable, "-m", "maco.cli", "bound", "n1_c64_h1000000000000000000000_w56_k64_r3x3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    _one_line(proc, "past 2147483647")


def test_predicting_a_conv_torch_cannot_allocate_is_one_line():
    """The predictor asks torch which conv it runs, on untouched tensors of the conv's shapes; a
    conv whose input is larger than any address space (2^80 bytes) is a MacoError, not torch's
    RuntimeError, and so is h = 1e9 where the machine cannot reserve its 14 TB."""
    from maco.layouts.predictor_features import features

    with pytest.raises(MacoError, match="cannot predict n1_c65536_h2147483647_w2147483647"):
        features([ConvSpec.parse("n1_c65536_h2147483647_w2147483647_k1_r1")], ["NHWC"])
    try:
        features([ConvSpec.parse("n1_c64_h1000000000_w56_k64_r3x3")], ["NHWC"])
    except MacoError as exc:
        assert "cannot predict n1_c64_h1000000000" in str(exc)
