"""maco.deploy.engines and experiments/engines_cpu.py: the report line reads its CSV; a failing or missing
engine is a row with a reason, never a crash; a real engine runs through the subprocess path; ONNX
Runtime and OpenVINO (where installed) compute what torch eager does; `maco optimize` times the
model it hands back beside the engines it is given."""
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from maco.deploy import engines
from maco.core.errors import MacoError
from maco.experiments import engines_cpu as eng

ROWS = [  # as read back from a CSV: every cell a string
    dict(network="resnet18", engine="channels_last", speedup="1.22", outputs_ok="True", eager_ms="30"),
    dict(network="resnet18", engine="onnxruntime", speedup="1.85", outputs_ok="True", eager_ms="30"),
    dict(network="resnet18", engine="maco", speedup="1.30", outputs_ok="True", eager_ms="31"),
    dict(network="resnet18", engine="openvino", speedup="", outputs_ok="", note="openvino not installed"),
    dict(network="alexnet", engine="maco", speedup="1.02", outputs_ok="False", eager_ms="60"),
]


def test_summary_ranks_engines_per_network():
    text = eng.summarise(ROWS)
    assert text.startswith("resnet18: onnxruntime 1.85x, maco 1.30x, channels_last 1.22x, openvino failed; "
                           "fastest onnxruntime, MACO 2 of 3; alexnet: maco 1.02x (outputs differ)")


def test_the_report_names_the_fastest_by_ratio_and_by_milliseconds_per_batch():
    rows = [dict(network="resnet50", batch="8", engine="onnxruntime", speedup="1.80", engine_ms="250", outputs_ok="True"),
            dict(network="resnet50", batch="8", engine="maco", speedup="1.90", engine_ms="260", outputs_ok="True"),
            dict(network="resnet50", batch="1", engine="maco", speedup="1.50", engine_ms="40", outputs_ok="True")]
    text = eng.summarise(rows)
    assert text.startswith("resnet50 b8: maco 1.90x 260.00 ms, onnxruntime 1.80x 250.00 ms; fastest by ratio maco, "
                           "by ms onnxruntime, MACO 1 of 2; resnet50: maco 1.50x 40.00 ms; fastest maco")


def test_an_engines_row_is_the_median_over_its_passes():
    passes = [dict(engine="maco", engine_ms=10.0, eager_ms=30.0, speedup=3.0, speedup_min=2.9, speedup_max=3.1,
                   rounds=7, outputs_ok=True, max_rel_err=1e-6, max_abs_diff=1e-5),
              dict(engine="maco", engine_ms=12.0, eager_ms=33.0, speedup=2.75, speedup_min=2.5, speedup_max=2.8,
                   rounds=7, outputs_ok=True, max_rel_err=2e-6, max_abs_diff=1e-5),
              dict(engine="maco", note="worker died (exit 1)")]
    row = eng.passes_row("maco", passes)
    assert row["engine_ms"] == 11.0 and row["speedup"] == 2.875 and row["passes"] == 2 and row["rounds"] == 14
    assert (row["speedup_min"], row["speedup_max"], row["max_rel_err"]) == (2.5, 3.1, 2e-6)
    assert row["engine_ms_passes"] == "10.000 12.000" and row["outputs_ok"] is True
    passes[1]["outputs_ok"] = False  # one pass that differs marks the row
    assert eng.passes_row("maco", passes)["outputs_ok"] is False
    assert eng.passes_row("maco", passes[2:]) == {"engine": "maco", "passes": 0, "note": "worker died (exit 1)"}
    assert eng.passes_row("maco", [], "maco optimize failed: X")["note"] == "maco optimize failed: X"


def test_csv_and_plot_are_written(tmp_path):
    eng.write_csv(tmp_path / "engines_cpu.csv", ROWS, eng.COLUMNS)
    eng.plot(ROWS, tmp_path / "engines_cpu.png")
    assert (tmp_path / "engines_cpu.png").stat().st_size > 1000
    with open(tmp_path / "engines_cpu.csv", newline="") as fh:
        assert [r["engine"] for r in csv.DictReader(fh)] == [r["engine"] for r in ROWS]


def _worker_row(tmp_path: Path, engine: str, job: engines.Job) -> dict:
    (tmp_path / "job.json").write_text(json.dumps(engines.asdict(job)))
    assert engines.main(["--engine", engine, "--job", str(tmp_path / "job.json"), "--json",
                         str(tmp_path / "row.json")]) == 0
    return json.loads((tmp_path / "row.json").read_text())


def test_a_failing_engine_becomes_a_row(tmp_path):
    row = _worker_row(tmp_path, "channels_last", engines.Job("no-such-net"))
    assert not row["ok"] and "no-such-net" in row["note"]
    row = _worker_row(tmp_path, "maco", engines.Job("resnet18"))  # no saved model to time
    assert not row["ok"] and "saved file" in row["note"]


def test_a_worker_that_does_not_start_is_a_row(monkeypatch):
    monkeypatch.setattr(engines.sys, "executable", sys.executable + "-does-not-exist")
    row = engines.run_engine("channels_last", engines.Job("resnet18"), timeout=60.0)
    assert row["engine"] == "channels_last" and "speedup" not in row and row["note"]


@pytest.mark.slow
def test_channels_last_through_the_subprocess(tmp_path):
    assert eng.main(["--networks", "resnet18", "--engines", "channels_last", "--rounds", "1", "--passes", "1", "--repeats", "1",
                     "--min-run-time", "0.001", "--warmup", "1", "--patience", "0", "--lock", "",
                     "--out", str(tmp_path)]) == 0
    with open(tmp_path / "engines_cpu.csv", newline="") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["engine"] == "channels_last" and row["outputs_ok"] == "True", row["note"]
    assert float(row["speedup"]) > 0 and float(row["eager_ms"]) > 0 and row["rounds"] == "1"
    env = json.loads((tmp_path / "engines_cpu.env.json").read_text())
    assert env["torch_version"] == torch.__version__
    assert (tmp_path / "engines_cpu.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("engine,module", [("onnxruntime", "onnxruntime"), ("openvino", "openvino")])
def test_engine_matches_eager(engine, module, tmp_path):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (pip install -e '.[engines]')")
    job = engines.Job("resnet18")
    x = engines.example(job)
    run, compile_s, note = engines.SETUP[engine](job, x, Path(tmp_path))
    with torch.inference_mode():
        want = engines.build(job)(x)
    got = engines._tensor(run())
    assert compile_s > 0 and note
    assert float((want - got).abs().max()) < engines.RTOL * float(want.abs().max())
    if engine == "openvino":
        assert "precision f32" in note  # forced: AMX hosts would pick bf16


MODEL = '''
import torch
from torch import nn


class Tiny(nn.Module):  # random weights: the worker must get the parent's
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
'''


@pytest.mark.slow
def test_optimize_times_its_model_beside_the_engines(tmp_path, capsys):
    """The report's engine table: each engine asked for and MACO's own model, loaded from the file
    optimize saved, in a worker that rebuilds the model with the parent's weights (a model file's
    random init differs between processes: a wrong load would show as outputs that differ)."""
    from maco.cli import main

    (tmp_path / "tiny.py").write_text(MODEL)
    out = tmp_path / "out"
    assert main(["optimize", f"{tmp_path / 'tiny.py'}:Tiny", "--input-shape", "1,3,16,16", "--out", str(out),
                 "--engines", "channels_last"]) == 0
    printed = capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "## Beside other engines" in report and "| channels_last |" in report and "| maco |" in report
    assert "MACO is " in report and "by the speedup over eager" in report
    assert "channels_last: " in printed and "maco: " in printed
    maco_row = report.split("| maco |")[1].split("\n")[0]
    assert "OUTPUTS DIFFER" not in maco_row and "worker died" not in maco_row, maco_row
    assert main(["optimize", "--engines", "tensorrt", "--out", str(tmp_path / "o2")]) == 2
    assert "unknown engine 'tensorrt'" in capsys.readouterr().err


def test_auto_engines_are_the_installed_ones():
    from maco.commands.optimize import engines_to_time

    assert engines_to_time("none") == []
    assert engines_to_time("inductor, onnxruntime") == ["inductor", "onnxruntime"]
    assert engines_to_time("auto") == [e for e in ("onnxruntime", "openvino") if engines.installed(e)]
    with pytest.raises(MacoError, match="unknown engine 'maco'"):
        from maco.deploy.optimize import optimize
        optimize("resnet18", engines=["maco"])


class _Opens:  # unpickled, it creates a file: what a weights file from elsewhere could do
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_jobs_weights_load_as_tensors_only(tmp_path):
    """Job.weights comes from `maco optimize` (a state_dict it saved) or from the JSON a worker is
    given: it is read with torch.load(weights_only=True), so a pickle that runs code is refused
    before it runs, and a state_dict loads."""
    import pickle

    (tmp_path / "tiny.py").write_text(MODEL)
    model = f"{tmp_path / 'tiny.py'}:Tiny"
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"conv.weight": _Opens(str(marker))}, evil)
    with pytest.raises(pickle.UnpicklingError):
        engines.build(engines.Job(model, weights=str(evil)))
    assert not marker.exists()
    good = tmp_path / "good.pt"
    state = {k: torch.full_like(v, 0.5) for k, v in engines.build(engines.Job(model)).state_dict().items()}
    torch.save(state, good)
    built = engines.build(engines.Job(model, weights=str(good)))
    assert torch.equal(built.conv.weight, state["conv.weight"]) and not built.training
