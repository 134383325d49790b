"""maco optimize's report states one statistic per number and says which: on rounds skewed so that
the median of per-round ratios and the ratio of the median times disagree in direction, the report
prints the medians of the per-round times, the median per-round ratio as the speedup and, marked
as such, the ratio of the printed medians."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from maco.layouts import LayoutPlan
from maco.layouts.end_to_end import ModelTimes
from maco.deploy.optimize_report import OptimizeResult, end_to_end_rows, report_markdown
from maco.core.target import Target
from maco.core.timing import Timing


def _rounds(ms: list[float]) -> list[Timing]:
    return [Timing(m / 1e3, m / 1e3, m / 1e3, 0.0, 3, 1) for m in ms]


def test_report_speedups_and_times_agree_by_their_stated_rule(tmp_path: Path) -> None:
    # a fake timer's rounds: the machine slows down across rounds, the variants less so
    rounds = {"default": [10.0, 20.0, 30.0], "fused": [9.0, 22.0, 25.0], "planned_torch": [12.0, 18.0, 33.0]}
    times = ModelTimes({k: _rounds(v) for k, v in rounds.items()}, {k: 0.0 for k in rounds},
                       {k: 0.0 for k in rounds})
    rows = end_to_end_rows(times, pick="fused")
    plan = LayoutPlan([], ["NCHW", "NHWC"], 0.02, 0.021, "exact", "measured", [[1, 3, 8, 8]])
    result = OptimizeResult("toy", tmp_path, [], plan, rows, 1.0, chosen="fused")
    text = report_markdown(result, Target.host(), tmp_path / "r.jsonl", [])
    for label, ms in rounds.items():
        if label == "default":
            assert "default (the model as given, torch eager): 20.00 ms" in text
            continue
        per_round = statistics.median(d / v for d, v in zip(rounds["default"], ms))
        med = statistics.median(ms)
        line = next(line for line in text.splitlines() if line.startswith("- ") and f"{med:.2f} ms" in line)
        printed_ms, speedup, from_medians = re.search(
            r"(\d+\.\d+) ms, \*\*(\d+\.\d+)x\*\* per round \((\d+\.\d+)x from the medians", line).groups()
        assert float(printed_ms) == round(med, 2)
        assert float(speedup) == round(per_round, 2)
        assert float(from_medians) == round(20.0 / med, 2)
    # the skew was real: for "fused" the two statistics point in opposite directions
    assert rows["fused"]["speedup"] > 1 > rows["fused"]["ratio_of_medians"]
    assert "Speedup (in bold): the median over rounds" in text and "ratio of the two printed medians" in text
    assert "Handed back: **fused**, 1.11x the default per round" in text


def test_the_report_names_the_convs_that_lose_most_inside_the_model() -> None:
    from maco.deploy.optimize_report import _in_model_lines
    from maco.layouts.end_to_end import ConvShare
    alone = {"a": 100e-6, "b": 200e-6, "c": 50e-6, "d": 10e-6}
    inside = {"a": 110e-6, "b": 400e-6, "c": 50e-6}  # d runs outside the segments: no time inside
    share = ConvShare(1e-3, sum(alone.values()), alone, 0.0, {"b": 500e-6}, inside)
    assert abs(share.alone_s - 350e-6) < 1e-12 and abs(share.convs_in_model_s - 560e-6) < 1e-12
    lines = _in_model_lines(share)
    assert "3 of its conv kernels take 0.56 ms against 0.35 ms alone" in lines[1]
    assert "in the model / alone = 1.60" in lines[1]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| conv")]
    assert [r.split(" | ")[0] for r in rows] == ["| b", "| a", "| c"]  # the largest loss first
    assert rows[0] == "| b | 200 | 400 | 500 | 2.00 |" and rows[1].endswith("|  | 1.10 |")
    assert _in_model_lines(ConvShare(1e-3, 1e-4, {"a": 1e-4})) == []


def test_the_report_puts_the_model_and_its_kernels_beside_their_floors() -> None:
    from maco.bounds.network import NetworkFloor
    from maco.deploy.optimize_report import _floor_lines
    from maco.layouts.end_to_end import ConvShare
    from maco.layouts.network_floor import ModelFloor

    alone = {"a": 100e-6, "b": 300e-6, "c": 60e-6}
    share = ConvShare(2e-3, sum(alone.values()), alone, 0.0, {}, {"a": 150e-6, "b": 320e-6})
    network = NetworkFloor(1000, (), 0, 0, 0, 0, 0, flops=int(5e8), flops_direct=int(9e8), peak=5e11,
                           bandwidth=8e10)
    floor = ModelFloor(network, {"a": 50e-6, "b": 280e-6, "c": 20e-6},
                       {"a": "F(4x4,3x3)", "b": "direct", "c": "direct"})
    lines = _floor_lines(share, floor)
    assert "the network floor is 1.00 ms, bound by compute; the model's 2.00 ms is **2.00x** it" in lines[1]
    assert "peak 500 GFLOP/s and DRAM read 80.0 GB/s" in lines[1]
    # a and b timed inside the model, c alone: 150 + 320 + 60 us against 50 + 280 + 20 us
    assert "3 kernels take 0.53 ms" in lines[2] and "against 0.35 ms of floors (1.51x)" in lines[2]
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| conv")]
    assert [r.split(" | ")[0] for r in rows] == ["| a", "| b", "| c"]  # the largest excess first: 100, 40, 40 us
    assert rows[0] == "| a | F(4x4,3x3) | 50 | 150 | 3.00 |"
    assert _floor_lines(share, None) == []


def test_a_busy_machine_is_said_beside_the_ratio_to_the_floor() -> None:
    """The floor takes the host's best FMA peak and DRAM read; where the ones timed beside the model
    ran under 90% of those, or their rounds spread past 1.3x, the ratio is said to read high."""
    from maco.bounds.network import NetworkFloor
    from maco.deploy.optimize_report import _floor_lines
    from maco.layouts.end_to_end import ConvShare
    from maco.layouts.network_floor import ModelFloor

    network = NetworkFloor(1000, (), 0, 0, 0, 0, 0, flops=int(5e8), flops_direct=int(9e8), peak=5e11,
                           bandwidth=8e10)
    share = ConvShare(2e-3, 1e-4, {"a": 1e-4})
    quiet = ModelFloor(network, {}, {}, peak_now=4.9e11, bandwidth_now=7.5e10, spread_now=1.1)
    assert quiet.busy_note() == "" and ModelFloor(network, {}, {}).busy_note() == ""
    busy = ModelFloor(network, {}, {}, peak_now=4e11, bandwidth_now=7.5e10, spread_now=1.1)
    assert busy.busy_note() == " (a busy machine: the FMA loop at 80% of its best; the ratio reads high)"
    both = ModelFloor(network, {}, {}, peak_now=4e11, bandwidth_now=4e10, spread_now=1.5)
    assert both.busy_note() == (" (a busy machine: the FMA loop at 80% of its best, DRAM reads at 50% of its best, "
                                "their rounds 1.5x apart; the ratio reads high)")
    assert _floor_lines(share, both)[1].endswith("is **2.00x** it" + both.busy_note() + ".")
    assert both.to_dict()["peak_now"] == 4e11 and both.to_dict()["spread_now"] == 1.5


def test_optimize_times_the_ceilings_beside_the_model_for_the_busy_note(monkeypatch) -> None:
    import torch

    import maco.deploy.optimize as opt
    from maco.layouts.end_to_end import ConvShare

    ceilings = {"fma_gflops_best": 500.0, "read_gbs_best": 80.0, "fma_gflops": 400.0, "read_gbs": 79.0,
                "fma_spread": 1.1, "read_spread": 1.4}
    monkeypatch.setattr(opt, "measure_ceilings", lambda target, rounds: ceilings)
    conv = torch.nn.Conv2d(3, 16, 3).eval()
    floor = opt._floor(conv, torch.randn(1, 3, 8, 8), ConvShare(1e-3, 1e-3, {"": 1e-3}), Target.host(), print)
    assert floor is not None and floor.network.peak == 5e11 and floor.peak_now == 4e11
    assert floor.bandwidth_now == 7.9e10 and floor.spread_now == 1.4
    assert "the FMA loop at 80% of its best, their rounds 1.4x apart" in floor.busy_note()
