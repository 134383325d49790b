"""experiments/bounds_table.py's network rows: the floor per network and each engine's time over
it, written with the host's .env.json and summarised for REPORT.md (timing replaced by fakes)."""
from __future__ import annotations

import json

from maco.experiments import bounds_table
from maco.experiments.common import read_rows


def test_network_rows_and_summary(tmp_path, monkeypatch):
    import maco.deploy.engines as engines
    import maco.kernels.cpu_peak as cpu_peak

    monkeypatch.setattr(cpu_peak, "measure_ceilings", lambda target, rounds: {
        "fma_gflops": 60.0, "read_gbs": 15.0, "fma_spread": 1.01, "read_spread": 1.02, "rounds": 5.0,
        "read_bytes": 1e9, "fma_gflops_best": 100.0, "read_gbs_best": 20.0})
    monkeypatch.setattr(cpu_peak, "winograd_ceilings", lambda target, rounds: {(2, 3): 0.8, (4, 3): 0.5})
    monkeypatch.setattr(cpu_peak, "depthwise_ceiling", lambda target, rounds: 0.4)
    seen = []

    def fake_run(engine, job):
        seen.append((engine, job.model, job.saved))
        return {"engine": engine, "eager_ms": 40.0, "engine_ms": 20.0, "rounds": 5, "note": "fake"}
    monkeypatch.setattr(engines, "run_engine", fake_run)
    model = tmp_path / "r18.maco"
    model.write_text("x")
    assert bounds_table.main(["--out", str(tmp_path), "--floor-networks", "resnet18", "--engines",
                              "channels_last,maco", "--maco-model", f"resnet18={model}", "--floor-only"]) == 0
    assert seen == [("channels_last", "resnet18", None), ("maco", "resnet18", str(model))]
    rows = read_rows(tmp_path / "bounds_network.csv")
    assert [r["engine"] for r in rows] == ["floor", "channels_last", "maco"]
    floor = float(rows[0]["floor_ms"])
    assert rows[0]["binds"] == "compute" and abs(floor - float(rows[0]["gflop"]) * 1e9 / 100e9 * 1e3) < 0.01
    assert abs(float(rows[2]["of_floor"]) - 20.0 / floor) < 0.01
    # the kernel families at the ceilings given: above the floor, F(4x4) at half the peak
    assert float(rows[0]["ceiling_f4x3"]) == 0.5 and 1.0 < float(rows[0]["reach_of_floor"]) < 2.0
    assert float(rows[0]["ceiling_depthwise"]) == 0.4
    assert abs(float(rows[0]["reach_ms"]) / floor - float(rows[0]["reach_of_floor"])) < 0.01
    assert (tmp_path / "bounds_network.png").stat().st_size > 0
    env = json.loads((tmp_path / "bounds_network.env.json").read_text())
    assert env["cpu"] and env["networks"] == ["resnet18"]
    text = bounds_table.summarise(rows)
    assert text.startswith("network floor at batch 1: resnet18 floor") and "maco" in text
    assert "kernels at their ceilings" in text


def test_network_plot_has_a_bar_per_engine_and_network(tmp_path, monkeypatch):
    """The plot of the network rows (as read back from the CSV: strings, '' where an engine has no
    time): a bar per (engine, network) at time / floor, the reach marked per network."""
    seen = {}

    def keep(fig, path):
        ax = fig.axes[0]
        seen["bars"] = sorted(round(p.get_height(), 3) for p in ax.patches)
        seen["reach"] = [list(line.get_ydata()) for line in ax.lines if line.get_label().startswith("MACO")]
        seen["labels"] = [t.get_text() for t in ax.get_xticklabels()]
    monkeypatch.setattr(bounds_table, "save_plot", keep)
    rows = [{"network": "resnet18", "engine": "floor", "of_floor": "", "reach_of_floor": "1.7"},
            {"network": "resnet18", "engine": "onnxruntime", "of_floor": "4.2"},
            {"network": "resnet18", "engine": "maco", "of_floor": "2.2"},
            {"network": "resnet50", "engine": "floor", "of_floor": "", "reach_of_floor": "1.17"},
            {"network": "resnet50", "engine": "onnxruntime", "of_floor": "1.9"},
            {"network": "resnet50", "engine": "maco", "of_floor": ""}]
    bounds_table.plot_network(tmp_path / "p.png", rows)
    assert seen["labels"] == ["resnet18", "resnet50"]
    assert [b for b in seen["bars"] if b == b] == [1.9, 2.2, 4.2]  # MACO's missing resnet50 time: no bar
    assert seen["reach"] == [[1.7, 1.17]]
