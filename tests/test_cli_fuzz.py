"""No user input gives a traceback: spec strings, flag values and file contents drawn by hypothesis
go through `maco ...` in process, and every outcome is a clean exit (0, or 2 with one line)."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maco.cli import main
from maco.core.errors import MacoError
from maco.layouts import LayoutPlan
from maco.tune.records import RecordFile

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SPEC_TEXT = st.one_of(
    st.text(alphabet="nchwkrspdgx_0123456789", max_size=40),
    st.builds(lambda n, c, h, w, k, r, s, p, d: f"n{n}_c{c}_h{h}_w{w}_k{k}_r{r}_s{s}_p{p}_d{d}",
              *[st.integers(-2, 10**12)] * 9),
    st.text(max_size=30))
NUMBER_TEXT = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str),
                        st.sampled_from(["", "nan", "inf", "-inf", "1e400", "0x10", "3.5", " 2"]),
                        st.text(max_size=8))
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                 max_size=4),
                       max_leaves=20)


def _run(argv, capsys):
    """main(argv) -> (exit status, stderr); any exception but SystemExit fails the test."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 1, 2, None), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert err.strip(), argv
    return code, err


@SETTINGS
@given(text=SPEC_TEXT)
def test_spec_strings(text, capsys):
    _run(["layers", text], capsys)
    _run(["bound", text, "--S", "4096"], capsys)


@SETTINGS
@given(flag=st.sampled_from([
    ("tune", "--trials"), ("tune", "--timeout"), ("tune", "--round"), ("tune", "--batch"),
    ("bench", "--repeats"), ("bench", "--batch"), ("space", "--tolerance"),
    ("space", "--samples"), ("bound", "--S"), ("bound", "--np"), ("plan", "--rounds"),
    ("plan", "--time-limit"), ("collect", "--rounds"), ("collect", "--max-gflop"), ("layers", "--batch")]),
    value=NUMBER_TEXT)
def test_flag_values(flag, value, capsys, tmp_path_factory, monkeypatch):
    """Each flag with odd values beside a layer that does not exist: argparse refuses the value or
    the command refuses the layer, before any work starts."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    command, name = flag
    positional = {"collect": ["--networks", "nosuchnet", "--random", "0"], "plan": ["nosuchnet"]}
    _run([command, *positional.get(command, ["nosuchnet"]), f"{name}={value}"], capsys)


@SETTINGS
@given(content=st.one_of(JSONISH.map(json.dumps), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                         st.integers(1, 3000).map(lambda d: "[" * d * 40 + "]" * d * 40)))
def test_file_contents(content, capsys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    path = folder / "f.json"
    path.write_text(content)
    code, _ = _run(["bench", "n1_c4_h6_w6_k8_r3_p1", "--schedule", str(path)], capsys)
    assert code == 2
    RecordFile(path).load(warn=False)  # bad lines are reported, never raised
    with pytest.raises(MacoError):
        LayoutPlan.load(path)


def test_paths_a_user_can_give(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    spec = "n1_c4_h6_w6_k8_r3_p1"
    for argv, words in (
            (["tune", spec, "--records", str(tmp_path)], "is a directory"),
            (["tune", spec, "--records", str(blocker / "r.jsonl")], "is not a folder"),
            (["bench", spec, "--schedule", str(tmp_path)], "is a directory"),
            (["bench", spec, "--schedule", str(tmp_path / "missing.json")], "does not exist"),
            (["optimize", "--out", str(blocker / "out")], "is not a folder"),
            (["optimize", "--records", str(tmp_path)], "is a directory"),
            (["plan", "resnet18", "--json", str(blocker / "p.json")], "is not a folder"),
            (["collect", "--out", str(tmp_path)], "is a directory"),
            (["reproduce", "--report-only", "--out", str(blocker)], "is a file"),
            (["bench", "n100000_c64_h56_w56_k64_r3_p1"], "GiB of memory"),
            (["optimize", "--input-shape", "1,3,100000,100000"], "GiB of memory")):
        code, err = _run(argv, capsys)
        assert code == 2 and words in err, (argv, err)


def test_a_model_whose_forward_fails_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "m.py"
    model.write_text("import torch\nclass M(torch.nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n"
                     "        self.c = torch.nn.Conv2d(3, 8, 3)\n"
                     "    def forward(self, x):\n        return self.c(x).view(7, -1)\n")
    code, err = _run(["optimize", f"{model}:M"], capsys)
    assert code == 2 and "forward failed on an input of shape (1, 3, 224, 224)" in err


def test_nonsense_arguments_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, words in ((["tune", "n1_c4_h6_w6_k8_r3_p1", "--timeout", "-1"], "--timeout: must be > 0"),
                        (["tune", "n1_c4_h6_w6_k8_r3_p1", "--trials", "-5"], "--trials: must be >= 0"),
                        (["bench", "n1_c4_h6_w6_k8_r3_p1", "--repeats", "0"], "--repeats: must be >= 1"),
                        (["collect", "--max-gflop", "nan"], "--max-gflop: must be > 0")):
        code, err = _run(argv, capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "maco_records.jsonl").exists()


def test_plans_and_records_have_a_size_cap(tmp_path):
    from maco.core.files import MAX_JSON_BYTES
    from maco.tune.records import Record

    huge = tmp_path / "plan.json"
    with open(huge, "wb") as fh:
        fh.truncate(MAX_JSON_BYTES + 1)  # sparse: no time or disk spent
    with pytest.raises(MacoError, match="byte limit"):
        LayoutPlan.load(huge)
    with pytest.raises(MacoError, match="byte limit"):
        Record.from_json("[" + " " * (2 << 20) + "]")
