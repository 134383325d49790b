"""`maco plan`: the per-layer table, the saved plan, the end-to-end line, and clean errors."""
from __future__ import annotations

import re

from maco.cli import main
from maco.layouts import LayoutPlan
from maco.layouts.networks import build, example_input


def test_plan_alexnet_measured_table_json_and_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "alexnet.plan.json"
    assert main(["plan", "alexnet", "--json", str(out), "--rounds", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for name in ("features_0", "features_3", "features_6", "features_8", "features_10"):
        assert name in text  # every conv layer has a row
    assert "measured with torch" in text and "planner" in text
    assert re.search(r"speedup \d+\.\d\dx", text)
    diff = float(re.search(r"output difference\| ([0-9.e+-]+)", text).group(1))
    assert diff < 1e-4
    p = LayoutPlan.load(out)
    assert len(p.convs) == 5 and all(c.layout in ("NCHW", "NHWC") for c in p.convs)
    p.apply(build("alexnet"))(example_input())


def test_plan_errors_exit_2_with_the_bad_value(capsys, monkeypatch) -> None:
    assert main(["plan", "lenet"]) == 2
    assert "'lenet'" in capsys.readouterr().err
    assert main(["plan", "alexnet", "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert main(["plan", "alexnet", "--layouts", "NCHW,NCDHW", "--rounds", "0"]) == 2
    assert "'NCDHW'" in capsys.readouterr().err
    monkeypatch.setenv("MACO_PREDICTOR", "/nowhere/predictor")
    assert main(["plan", "alexnet", "--latency", "predict", "--rounds", "0"]) == 2
    assert "/nowhere/predictor" in capsys.readouterr().err


def test_plan_with_a_saved_predictor_shows_both_columns(tmp_path, capsys) -> None:
    import numpy as np

    from maco.layouts.latency import ConversionModel
    from maco.layouts.predictor_fit import fit_predictor
    from maco.layouts.predictor_models import MLPConfig
    from maco.core.spec import ConvSpec

    specs = [ConvSpec(1, c, s, s, k, 3, 3, padding=1) for c, s, k in
             ((3, 224, 64), (64, 27, 192), (192, 13, 384), (384, 13, 256))] * 2
    lays = ["NCHW"] * 4 + ["NHWC"] * 4
    conv = ConversionModel.fit([((1, c, 16, 16), a, b, 1e-6 * c) for c in (2, 4, 8, 16, 32, 64)
                                for a, b in (("NCHW", "NHWC"), ("NHWC", "NCHW"))])
    pred = fit_predictor(specs, lays, np.linspace(1e-4, 8e-4, 8), MLPConfig(layers=1, width=8, epochs=2),
                         conversion=conv)
    pred.save(tmp_path / "pred")
    assert main(["plan", "alexnet", "--latency", "predict", "--predictor", str(tmp_path / "pred"),
                 "--rounds", "0", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "predicted by the latency predictor" in text
    row = next(line for line in text.splitlines() if "features_3 " in line)
    numbers = re.findall(r"\d+\.\d", row)
    assert len(numbers) >= 2  # a predicted and a measured time
