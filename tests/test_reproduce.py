"""maco reproduce: figure selection, GPU figures skipped without a GPU, a real figure run as a
subprocess, the report beside the paper's numbers, and the experiments found, not written in."""
import importlib
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest

import maco.experiments
import maco.reproduce
from maco import MacoError
from maco.cli import main
from maco.experiments.common import Figure
from maco.reproduce import experiments, figures, names, run_figures, select, write_report

FIGURES = figures()


def test_select_names_unknown_figures():
    assert [f.name for f in select(["all"])] == [f.name for f in FIGURES if f.in_all]  # not peers, repeat
    assert [f.name for f in select(["all", "peers"])][-1] == "peers"  # the optional extra, when named
    assert [f.name for f in select(["fig06", "fig16"])] == ["fig06", "fig16"]
    with pytest.raises(MacoError, match="unknown figure.*fig99"):
        select(["fig99"])


def test_gpu_figure_is_skipped_with_a_reason_and_a_cpu_figure_runs(tmp_path):
    figs = select(["fig15", "fig06"])
    status = run_figures(figs, tmp_path, quick=True, log=lambda _: None, gpu=False)
    assert status["fig15"].startswith("skipped: no usable GPU")
    assert status["fig06"] == "ok"
    assert (tmp_path / "fig06_space_size.csv").is_file() and (tmp_path / "reproduce_fig06.log").is_file()
    report = write_report(tmp_path, status).read_text()
    assert "| fig06 |" in report and "geomean reduction" in report and "tens of millions" in report
    assert "skipped: no usable GPU" in report


def test_report_only_from_the_cli(tmp_path, capsys):
    assert main(["reproduce", "--report-only", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert all(f"| {f.name} |" in text for f in FIGURES)
    assert main(["reproduce", "fig42", "--out", str(tmp_path)]) == 2
    assert "unknown figure" in capsys.readouterr().err


def test_report_summarises_every_figure_from_its_csv(tmp_path):
    """Each summary reads the CSV the figure's script writes (tiny hand-made ones here)."""
    (tmp_path / "fig18_end_to_end.csv").write_text(
        "network,convs,default_ms,planned_torch_ms,speedup_torch,planned_maco_ms,speedup_maco,maco_convs,"
        "max_abs_diff,outputs_equal,paper_speedup,load,note\n"
        "resnet18,20,23,19,1.21,17,1.35,8,3e-08,True,1.07,1,MACO kernels in 8 of 20 convs\n")
    (tmp_path / "fig16_summary.csv").write_text(
        "layer,trials,seeds,pruned_final_gflops,full_final_gflops,metaschedule_final_gflops,default_gflops,"
        "pruned_trials_to_full_best,quarter_met,pruned_trials_to_95pct,full_trials_to_same,ratio\n"
        "l1,64,3,330,240,120,400,3,yes,17,inf,0\nl2,64,3,300,310,,380,inf,no,20,30,0.67\n")
    (tmp_path / "fig13_predictor_r2.csv").write_text(
        "model,target,r2,r2_log,median_rel_error,wrong_picks,wrong_picks_5pct,pick_cost,pairs,test_rows,"
        "train_rows,fit_seconds\nNAS-MLP,log,0.9377,0.9888,0.1,0.118,0.07,0.01,1007,2014,8056,600\n"
        "re-measure,-,0.931,0.99,0.16,0.016,0.016,0.01,60,120,8056,5\n")
    (tmp_path / "winograd_cpu.csv").write_text(
        "network,layer,spec,winograd_gflops,direct_gflops,torch_gflops,torch_layout,peak_gflops,over_direct,"
        "over_torch,winograd_of_peak,direct_of_peak,max_error\n"
        "resnet18,layer1,s1,520,380,320,NHWC,450,1.37,1.6,1.16,0.84,1e-6\n"
        "resnet18,layer4,s4,110,330,150,NHWC,450,0.33,0.7,0.24,0.73,1e-6\n")
    text = write_report(tmp_path, {"fig18": "ok"}).read_text()
    assert "2 layers: Winograd (the faster tile size) over MACO's direct kernel geomean 0.67x, ahead on 1 " \
           "(best 1.37x on " \
           "resnet18:layer1, 116% of the FMA peak in direct-conv flops)" in text
    assert "resnet18: planned torch 1.21x, with MACO kernels in 8 conv(s) 1.35x" in text
    assert "in a quarter of the trials on 1 of 2 layers" in text
    assert "l1: pruned 330 vs full 240 vs MetaSchedule 120 GFLOP/s, default 400" in text
    assert "l2: pruned 300 vs full 310 GFLOP/s, default 380" in text
    assert "NAS-MLP on seconds: R2 0.938 (log 0.989), wrong layout 11.8% of pairs;" in text and "re-timing 60 test convs: R2 0.931" in text
    assert "| fig18 |" in text and "| ok |" in text


def test_every_experiment_declares_its_figure_and_reproduce_finds_exactly_those():
    """Each experiment module owns its report row; reproduce discovers them, in the listed order."""
    modules = [m.name for m in pkgutil.iter_modules(maco.experiments.__path__) if m.name != "common"]
    found = {m: importlib.import_module(f"maco.experiments.{m}") for m in modules}
    assert all(isinstance(mod.FIGURE, Figure) and callable(mod.summarise) for mod in found.values())
    assert sorted(mod.__name__ for mod in experiments().values()) == sorted(
        f"maco.experiments.{m}" for m in modules)
    assert names() == [f.name for f in FIGURES] == [mod.FIGURE.name for mod in experiments().values()]
    assert all(f.csv for f in FIGURES)  # the report knows which file to read


def test_the_library_holds_no_figure_specific_code():
    source = Path(maco.reproduce.__file__).read_text()
    for fig in FIGURES:
        assert f'"{fig.name}"' not in source and fig.paper not in source
        assert not any(pattern in source for pattern in fig.csv)
    assert not re.search(r"^\s*(from|import) maco\.experiments", source, re.M)  # found at run time only


def test_a_discovered_experiment_lands_in_the_report(tmp_path, monkeypatch):
    """A figure reproduce has never heard of: its FIGURE and summarise are all the report needs."""
    fake = types.ModuleType("maco.experiments.fake_figure")
    fake.FIGURE = Figure("fig99", "the paper's 9.9x", "a made-up figure", csv=("fig99_*.csv",))
    fake.summarise = lambda rows: f"{len(rows)} rows, best {max(float(r['speedup']) for r in rows):.1f}x"
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(maco.reproduce, "experiments", lambda: {"fig99": fake})
    (tmp_path / "fig99_gpu.csv").write_text("layer,speedup\na,1.5\nb,3.25\n")
    text = write_report(tmp_path, {"fig99": "ok"}).read_text()
    assert ("| fig99 | the paper's 9.9x | **host not recorded** (no .env.json): 2 rows, best 3.2x<br>`fig99_gpu.csv` "
            "| a made-up figure | ok |") in text


def test_a_figure_measured_on_two_hosts_gets_a_summary_per_host(tmp_path, monkeypatch):
    """Each CSV's .env.json names its machine; a second file from the same machine adds nothing."""
    fake = types.ModuleType("maco.experiments.fake_hosts")
    fake.FIGURE = Figure("fig98", "paper", "why", csv=("fig98.csv", "fig98_again.csv", "fig98_*.csv"),
                         env={"fig98_b.csv": "fig98_run_b.env.json"})
    fake.summarise = lambda rows: f"speedup {rows[0]['speedup']}x"
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(maco.reproduce, "experiments", lambda: {"fig98": fake})
    xeon = '{"cpu": "Intel(R) Xeon(R) Processor", "isa": "avx512", "cores": 2}'
    for name, speedup in [("fig98", 1.5), ("fig98_again", 9.9), ("fig98_b", 1.2)]:
        (tmp_path / f"{name}.csv").write_text(f"speedup\n{speedup}\n")
    (tmp_path / "fig98.env.json").write_text(xeon)
    (tmp_path / "fig98_again.env.json").write_text(xeon)  # the same host: the first file counts
    (tmp_path / "fig98_run_b.env.json").write_text('{"cpu": "AMD EPYC", "isa": "avx512", "cores": 2}')
    row = next(line for line in write_report(tmp_path, {}).read_text().splitlines() if line.startswith("| fig98 |"))
    assert ("**Intel Xeon (avx512, 2 cores)**: speedup 1.5x<br>`fig98.csv`<br><br>"
            "**AMD EPYC (avx512, 2 cores)**: speedup 1.2x<br>`fig98_b.csv`") in row
    assert "9.9" not in row


def test_a_committed_csv_without_env_names_its_host_only_while_unchanged(tmp_path, monkeypatch):
    import hashlib

    fake = types.ModuleType("maco.experiments.fake_pinned")
    csv = tmp_path / "fig97.csv"
    csv.write_text("speedup\n2.0\n")
    digest = hashlib.sha256(csv.read_bytes()).hexdigest()[:16]
    fake.FIGURE = Figure("fig97", "paper", "why", csv=("fig97.csv",), hosts={"fig97.csv": (digest, "Some GPU")})
    fake.summarise = lambda rows: f"speedup {rows[0]['speedup']}x"
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(maco.reproduce, "experiments", lambda: {"fig97": fake})
    assert "**Some GPU**: speedup 2.0x" in write_report(tmp_path, {}).read_text()
    csv.write_text("speedup\n3.0\n")  # re-run elsewhere without a sidecar: no longer that host
    assert "**host not recorded** (no .env.json): speedup 3.0x" in write_report(tmp_path, {}).read_text()


def test_fig06_summary_from_a_hand_made_csv(tmp_path):
    (tmp_path / "fig06_space_size.csv").write_text(
        "network,layer,spec,target,sketch,unpruned,pruned,ratio,relaxed\n"
        "alexnet,features.0,s,host,SSRSRS,1000000,100,10000,\n"
        "alexnet,features.3,s,host,SSRSRS,40000,400,100,\n")
    text = write_report(tmp_path, {}).read_text()
    assert ("host: geomean reduction 1,000x over 2 layers; largest space 1e+06 (alexnet features.0) -> 100"
            "<br>`fig06_space_size.csv`") in text
    assert "| fig06 |" in text and "| not run now |" in text


def test_the_notes_below_the_marker_survive_a_rewrite(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text(f"# old table\n| fig06 | stale |\n\n{maco.reproduce.NOTES}\n\n## Per host\nkept by hand\n")
    text = write_report(tmp_path, {}).read_text()
    assert "stale" not in text and "| fig06 |" in text
    assert text.endswith(f"{maco.reproduce.NOTES}\n\n## Per host\nkept by hand\n")
    assert write_report(tmp_path, {}).read_text().count(maco.reproduce.NOTES) == 1
