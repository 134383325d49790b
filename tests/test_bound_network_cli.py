"""`maco bound NET --network`: the network floor's tables and JSON (given ceilings: nothing timed)."""
from __future__ import annotations

import json

from maco.cli import main


def test_network_floor_json(capsys):
    assert main(["bound", "resnet18", "--network", "--peak", "100", "--bandwidth", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    f = out["floor"]
    assert out["peak_gflops"] == 100 and out["read_gbs"] == 20 and out["measured"] is None
    assert out["winograd_ceilings"] == {}  # given ceilings: the tile model prices ideal kernels
    assert round(f["weights"] * 4 / 1e6) == 47  # ResNet-18 reads 46.7 MB of weights
    assert f["spill"] == 0 and f["binds"] == "compute"
    assert abs(f["t"] - f["flops"] / 100e9) < 1e-12
    assert any(lf["algorithm"] == "F(4x4,3x3)" for lf in f["layers"])


def test_network_floor_tables_and_direct_only(capsys):
    # a fast memory of 32 MiB, whatever this host's caches: AlexNet's 244 MB of weights outgrow it
    # (a VM reporting a 300 MiB L3 holds them all, and there the compute binds)
    assert main(["bound", "alexnet", "--network", "--peak", "100", "--bandwidth", "5", "--direct",
                 "--S", str(8 << 20)]) == 0
    out = capsys.readouterr().out
    assert "the network floor" in out and "memory binds" in out and "F(4x4" not in out
    assert main(["bound", "resnet18", "--network", "--peak", "100", "--bandwidth", "20", "--S", "1000",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["floor"]["spill"] > 0  # a tiny cache spills live sets


def test_network_floor_refuses(capsys):
    assert main(["bound", "n1_c64_h56_w56_k64_r3_p1", "--network", "--peak", "1", "--bandwidth", "1"]) == 2
    assert "built-in network" in capsys.readouterr().err
    assert main(["bound", "resnet18", "--network", "--target", "h100"]) == 2
    assert "--peak and --bandwidth" in capsys.readouterr().err
