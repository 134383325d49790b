"""Never silently wrong (14): a figure that cannot be true (a kernel at 145% of the FMA peak timed in
the same rounds, a model spending -156% of its time outside its conv kernels) or that comes from
rounds in which the reference says the machine was busy is printed with the reason beside it, not
bare; a sane figure stays bare. Synthetic timings only: nothing here is timed."""
from __future__ import annotations

from pathlib import Path

import pytest

from maco.commands.bench import table_row
from maco.commands.tune import peak_column, print_results
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import Timing
from maco.deploy.optimize_report import OptimizeResult, outside_note, report_markdown
from maco.kernels import default_schedule
from maco.kernels.cpu_peak import BUSY_SPREAD, PEAK_NOISE, peak_share_note, spread
from maco.layouts import LayoutPlan
from maco.layouts.end_to_end import ConvShare
from maco.tune.benchmark import BenchRow
from maco.tune.records import Record
from maco.tune.tuning import LayerResult

SPEC = ConvSpec.parse("n1_c16_h14_w14_k32_r3x3_p1")
HOST = Target.host()
UNRELIABLE = "figure unreliable"


def test_the_note_names_what_makes_a_share_of_peak_unbelievable() -> None:
    assert peak_share_note(0.5) == peak_share_note(0.5, 1.05) == peak_share_note(1 + PEAK_NOISE / 2, 1.1) == ""
    over = peak_share_note(1.45)
    assert over.startswith(" (impossible: over 110% of the peak") and over.endswith("; figure unreliable)")
    busy = peak_share_note(0.5, 1.4)
    assert busy == " (the machine was busy: reference spread 1.4x; figure unreliable)"
    assert "impossible" in peak_share_note(1.45, 1.4) and "busy" in peak_share_note(1.45, 1.4)
    assert "its times spread 2.0x" in peak_share_note(None, 2.0, spread_of="its times")
    assert spread([1.0, 1.2, 1.4]) == pytest.approx(1.4) and spread([0.0, 1.0]) == float("inf")
    assert peak_share_note(0.5, BUSY_SPREAD) == ""  # at the threshold: still quiet


def _record(ratio: float | None, lo: float = 1e-3, hi: float = 1.05e-3) -> Record:
    timing = Timing(median=(lo + hi) / 2, min=lo, max=hi, stdev=0.0, repeats=6, number=10,
                    reference=None if ratio is None else (lo + hi) / 2 / ratio, ratio=ratio)
    return Record(SPEC, HOST.fingerprint(), default_schedule(SPEC, HOST, "NHWC"), timing)


def _layer(record: Record | None) -> LayerResult:
    return LayerResult("conv", SPEC, 1, record, 8, None, None)


def test_tune_prints_an_impossible_or_busy_share_of_peak_with_its_reason(capsys) -> None:
    assert peak_column(_layer(_record(2.0)), HOST) == "50%"  # sane: bare
    over = peak_column(_layer(_record(0.69)), HOST)  # "145% of peak"
    assert over.startswith("145% (impossible: over 110% of the peak") and UNRELIABLE in over
    busy = peak_column(_layer(_record(2.0, 1e-3, 1.6e-3)), HOST)  # its rounds lay 1.6x apart
    assert busy == "50% (the machine was busy: its times spread 1.6x; figure unreliable)"
    assert peak_column(_layer(None), HOST) == "-"
    print_results([_layer(_record(0.69)), _layer(_record(2.0))], HOST, "synthetic")
    out = capsys.readouterr().out
    assert out.count("unreliable") == 1 and "145%" in out and "50%" in out
    nominal = Target.host()
    if nominal.peak_gflops:  # a record from before the reference: the nominal peak, marked "~"
        rec = _record(None)
        share = rec.gflops / nominal.peak_gflops
        cell = peak_column(_layer(rec), nominal)
        assert cell.startswith(f"~{100 * share:.0f}%") and (UNRELIABLE in cell) == (share > 1 + PEAK_NOISE)


def _bench(maco: list[float], fma: list[float]) -> BenchRow:
    torch_s = [2 * m for m in maco]
    return BenchRow("conv", SPEC, {"maco": maco, "FMA peak": fma, "torch NCHW": torch_s, "torch NHWC": torch_s},
                    1e-6)


def test_bench_prints_an_impossible_or_busy_share_of_peak_with_its_reason() -> None:
    sane = table_row(_bench([2.0, 2.1, 2.0], [1.0, 1.05, 1.0]), "NHWC")
    assert sane[3] == "50%"
    over = table_row(_bench([1.0, 1.0, 1.0], [1.45, 1.45, 1.45]), "NHWC")[3]  # the kernel beat the FMA loop
    assert over.startswith("145% (impossible") and UNRELIABLE in over
    busy = table_row(_bench([2.0, 2.8, 2.0], [1.0, 1.4, 1.0]), "NHWC")[3]  # a spell hit round 2: ratios hold
    assert busy == "50% (the machine was busy: the FMA loop's rounds spread 1.4x; figure unreliable)"


def test_bench_measures_again_once_where_the_first_rounds_were_busy(monkeypatch, capsys) -> None:
    """Where the note is not empty, `maco bench` measures the layer once more (a busy spell may
    have passed) and prints the second measurement, with its own note if it has one."""
    import maco.tune.benchmark as benchmark
    from maco.cli import main

    calls = []
    results = [_bench([2.0, 2.8, 2.0], [1.0, 1.4, 1.0]), _bench([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])]

    def fake(name, spec, schedules, target, **kw):
        calls.append(name)
        r = results[min(len(calls) - 1, len(results) - 1)]
        return BenchRow(name, spec, r.rounds, r.error)

    monkeypatch.setattr(benchmark, "bench_layer", fake)
    assert main(["bench", str(SPEC)]) == 0
    assert len(calls) == 2 and "unreliable" not in capsys.readouterr().out
    calls.clear()
    results[1] = results[0]  # busy both times: printed with the note
    assert main(["bench", str(SPEC)]) == 0
    assert len(calls) == 2 and "unreliable" in capsys.readouterr().out
    calls.clear()
    results[0] = _bench([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])  # quiet at once: measured once
    assert main(["bench", str(SPEC)]) == 0
    assert len(calls) == 1 and "unreliable" not in capsys.readouterr().out


def _result(tmp_path: Path, share: ConvShare) -> str:
    plan = LayoutPlan([], ["NCHW", "NHWC"], 0.02, 0.021, "exact", "measured", [[1, 3, 8, 8]])
    result = OptimizeResult("toy", tmp_path, [], plan, {}, 1.0, share=share)
    return report_markdown(result, HOST, tmp_path / "r.jsonl", [])


def test_optimize_report_says_a_negative_time_outside_the_kernels_is_impossible(tmp_path: Path) -> None:
    bad = ConvShare(model_s=1e-3, convs_s=2.56e-3, per_conv={"a": 1.28e-3, "b": 1.28e-3}, rest_s=2e-4)
    assert bad.outside == pytest.approx(-1.56)
    text = _result(tmp_path, bad)
    line = next(line for line in text.splitlines() if "outside them" in line)
    assert "**-156%** (impossible: the kernels alone took 2.56x the whole model" in line and UNRELIABLE in line
    good = ConvShare(model_s=1e-3, convs_s=0.7e-3, per_conv={"a": 0.7e-3}, rest_s=2e-4)
    text = _result(tmp_path, good)
    assert "**30%** of the model's time is spent outside them" in text and UNRELIABLE not in text
    assert outside_note(good) == "" and outside_note(ConvShare(1e-3, 1e-3, {"a": 1e-3})) == ""
