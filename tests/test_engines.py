"""experiments/engines_cpu.py: the report line reads its CSV; a failing or missing engine is a row
with a reason, never a crash; a real engine runs through the subprocess path; ONNX Runtime and
OpenVINO (where installed) compute what torch eager does."""
import argparse
import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

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


def test_csv_and_plot_are_written(tmp_path):
    eng.write_csv(tmp_path / "engines_cpu.csv", ROWS, eng.COLUMNS)
    eng.plot(ROWS, tmp_path / "engines_cpu.png")
    assert (tmp_path / "engines_cpu.png").stat().st_size > 1000
    with open(tmp_path / "engines_cpu.csv", newline="") as fh:
        assert [r["engine"] for r in csv.DictReader(fh)] == [r["engine"] for r in ROWS]


def test_failing_engine_becomes_a_row(tmp_path):
    args = argparse.Namespace(engine="no-such-engine", network="resnet18", json=str(tmp_path / "row.json"))
    assert eng.worker(args) == 0
    row = json.loads((tmp_path / "row.json").read_text())
    assert not row["ok"] and "no-such-engine" in row["note"]


def test_worker_that_does_not_start_is_a_row(monkeypatch):
    monkeypatch.setattr(eng.sys, "executable", sys.executable + "-does-not-exist")
    args = eng.argparse.Namespace(rounds=1, repeats=1, min_run_time=0.001, warmup=1, patience=0.0, budget="quick",
                                  inductor_mode="default", records=None, lock="", timeout=60.0)
    row = eng.run_engine("channels_last", "resnet18", args)
    assert row["engine"] == "channels_last" and "speedup" not in row and row["note"]


@pytest.mark.slow
def test_channels_last_through_the_subprocess(tmp_path):
    assert eng.main(["--networks", "resnet18", "--engines", "channels_last", "--rounds", "1", "--repeats", "1",
                     "--min-run-time", "0.001", "--warmup", "1", "--patience", "0", "--lock", "",
                     "--out", str(tmp_path)]) == 0
    with open(tmp_path / "engines_cpu.csv", newline="") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["engine"] == "channels_last" and row["outputs_ok"] == "True", row["note"]
    assert float(row["speedup"]) > 0 and float(row["eager_ms"]) > 0 and row["rounds"] == "1"
    env = json.loads((tmp_path / "engines_cpu.env.json").read_text())
    assert env["torch_version"] == torch.__version__
    assert (tmp_path / "engines_cpu.png").is_file()


def _eager_output(net: str, x: torch.Tensor) -> torch.Tensor:
    from maco.layouts.networks import build

    with torch.inference_mode():
        return build(net)(x)


@pytest.mark.slow
@pytest.mark.parametrize("engine,module", [("onnxruntime", "onnxruntime"), ("openvino", "openvino")])
def test_engine_matches_eager(engine, module, tmp_path):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (pip install -e '.[engines]')")
    from maco.layouts.networks import example_input

    x = example_input(1)
    args = argparse.Namespace(inductor_mode="default")
    run, compile_s, note = eng.SETUP[engine]("resnet18", x, args, Path(tmp_path))
    want, got = _eager_output("resnet18", x), eng._tensor(run())
    assert compile_s > 0 and note
    assert float((want - got).abs().max()) < eng.RTOL * float(want.abs().max())
    if engine == "openvino":
        assert "precision f32" in note  # forced: AMX hosts would pick bf16
