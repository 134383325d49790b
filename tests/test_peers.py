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
    from maco.core.spec import ConvSpec

    res = peers.run_halide(ConvSpec.parse(TINY), "Adams2019", 0, True, tmp_path)
    assert res["seconds"] > 0  # run_halide raises if the output differs from torch


@pytest.mark.skipif(importlib.util.find_spec("halide") is None,
                    reason="halide not installed (pip install halide==21.0.0, the [peers] extra; CI has none)")
@pytest.mark.parametrize("layer", ["n1_c6_h9_w11_k40_r3_p1", TINY])
def test_halide_hand_schedule_matches_torch(tmp_path, layer):
    """The apps/conv_layer-style hand schedule on a couple of tiles, tails included (40 output
    channels, 11 and 5 output columns split by 2 and 3): run_halide_hand checks every tile of
    the sweep against torch and raises on a wrong one."""
    import halide as hl
    import numpy as np
    import torch

    from maco.core.spec import ConvSpec

    spec = ConvSpec.parse(layer)
    res = peers.run_halide_hand(spec, 0, True, tmp_path, grid=[(1, 2), (1, 3)])
    assert res["trials"] == 2 and res["seconds"] > 0
    assert "tile_w 1 tile_h" in res["note"]

    # and independently of the sweep's own check: one tile against torch
    x, w, ref = peers._inputs(spec, seed=1)
    xs, ws = peers._nhwc_padded(spec, x, w)
    out = np.zeros((spec.n, spec.out_h, spec.out_w, spec.k), np.float32)
    peers.halide_hand(spec, 1, 3)(hl.Buffer(xs), hl.Buffer(ws), hl.Buffer(out))
    torch.testing.assert_close(torch.from_numpy(out).permute(0, 3, 1, 2), torch.from_numpy(ref),
                               rtol=1e-4, atol=1e-4)


def test_hand_grid_keeps_the_tiles_that_fit():
    from maco.core.spec import ConvSpec

    grid = peers.hand_grid(ConvSpec.parse("n1_c192_h13_w13_k384_r3_p1"), 16, 32)
    assert (2, 13) in grid and (4, 7) in grid  # the width's divisor, the largest 4-wide tile
    assert all(th <= 13 and tw * th <= 28 for tw, th in grid)
    assert peers.hand_grid(ConvSpec.parse("n1_c8_h9_w9_k16_r3_p1"), 16, 32) == [
        (1, h) for h in (2, 3, 4, 5, 7, 8, 9)]
    assert all(tw * th <= 12 for tw, th in peers.hand_grid(ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1"), 8, 16))


def test_runs_keep_the_fastest_and_list_every_run(tmp_path, monkeypatch):
    secs = iter([2e-3, 1e-3, 4e-3])  # torch-nchw run 1, run 2, run 3
    monkeypatch.setattr(peers, "_run_worker", lambda *a, **k: {
        "ok": True, "trials": 0, "tuning_seconds": 0.0, "seconds": next(secs), "note": "torch"})
    assert peers.main(["--layers", TINY, "--tuners", "torch-nchw", "--runs", "3", "--lock", "",
                       "--out", str(tmp_path)]) == 0
    (row,) = _rows(tmp_path)
    from maco.core.spec import ConvSpec

    assert float(row["gflops"]) == pytest.approx(ConvSpec.parse(TINY).flops / 1e-3 / 1e9, rel=1e-2)
    assert row["note"].startswith("fastest of 3 runs (") and row["note"].count(" / ") == 2
    assert row["note"].endswith("; torch")


def test_summary_names_the_halide_a_user_would_ship():
    rows = [dict(layer="L", tuner="torch-nhwc", gflops="300", tuning_seconds="0", note=""),
            dict(layer="L", tuner="halide-adams2019", gflops="40", tuning_seconds="20", note=""),
            dict(layer="L", tuner="halide-adams2019-nhwc", gflops="60", tuning_seconds="2", note=""),
            dict(layer="L", tuner="halide-hand", gflops="310", tuning_seconds="15",
                 note="hand schedule, best tile_w 2 tile_h 7 (vector 16)"),
            dict(layer="L", tuner="maco", gflops="330", tuning_seconds="90", note="")]
    text = peers.summarise(rows)
    assert "Halide hand 310 (tile 2x7" in text and "autoscheduler 60 (adams2019-nhwc)" in text
    assert "ship the hand schedule (fastest Halide on 1 of 1 layers)" in text


def test_metaschedule_curve_is_the_best_so_far_in_commit_order(tmp_path):
    import json

    db = tmp_path / "database_tuning_record.json"
    lines = [[0, ["trace", [2e-3, 2e-3], "llvm", []]], [0, ["trace", [1e10], "llvm", []]],  # a failed run
             [0, ["trace", None, "llvm", []]], [0, ["trace", [1e-3], "llvm", []]], [0, ["trace", [3e-3], "llvm", []]]]
    db.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert peers.metaschedule_curve(db, 2e6) == [1.0, 1.0, 1.0, 2.0, 2.0]


def test_name_picks_the_output_stem_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "_run_worker", lambda *a, **k: {
        "ok": True, "trials": 0, "tuning_seconds": 0.0, "seconds": 1e-3, "note": "torch"})
    assert peers.main(["--layers", TINY, "--tuners", "torch-nchw", "--lock", "", "--name", "ms1000",
                       "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ms1000.csv").exists() and not (tmp_path / "peers_cpu.csv").exists()
    with pytest.raises(SystemExit):
        peers.main(["--layers", TINY, "--name", "../x", "--out", str(tmp_path)])
