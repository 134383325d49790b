"""experiments/peers_cpu.py: a failing or missing peer is a row with a reason, never a crash;
the peers that are installed produce kernels that match torch."""
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from maco.experiments import peers_cpu as peers

TINY = "n1_c8_h9_w9_k16_r3_p1_s2"


def _rows(out: Path) -> list[dict]:
    with open(out / "peers_cpu.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_speedup_is_against_the_faster_torch_layout():
    rows = [dict(layer="L", tuner="torch-nchw", gflops="10"),
            dict(layer="L", tuner="torch-nhwc", gflops="20"),
            dict(layer="L", tuner="tvm-ms", gflops="30"),
            dict(layer="L", tuner="maco", gflops="")]
    peers.finish_rows(rows)
    assert [r["speedup_vs_torch_best"] for r in rows] == ["0.50", "1.00", "1.50", ""]


def test_failing_peer_becomes_a_row(tmp_path, monkeypatch):
    # grouped convs are not written for Halide: the worker reports it instead of crashing
    assert peers.main(["--layers", "n1_c8_h9_w9_k8_r3_p1_g2", "--tuners", "torch-nchw,halide-li2018",
                       "--lock", "", "--out", str(tmp_path), "--quick"]) == 0
    rows = {r["tuner"]: r for r in _rows(tmp_path)}
    assert float(rows["torch-nchw"]["gflops"]) > 0
    assert rows["halide-li2018"]["gflops"] == ""
    assert rows["halide-li2018"]["note"]  # why: not installed, or groups unsupported
    assert (tmp_path / "peers_cpu.png").exists()


def test_worker_that_dies_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.sys, "executable", sys.executable + "-does-not-exist")
    res = peers._run_worker("torch-nchw", TINY, 1, True, None, 60)
    assert not res["ok"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("halide") is None, reason="halide not installed")
def test_halide_adams2019_matches_torch(tmp_path):
    from maco.spec import ConvSpec

    res = peers.run_halide(ConvSpec.parse(TINY), "Adams2019", 0, True, tmp_path)
    assert res["seconds"] > 0  # run_halide raises if the output differs from torch
