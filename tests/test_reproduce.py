"""maco reproduce: figure selection, GPU figures skipped without a GPU, a real figure run as a
subprocess, and the report beside the paper's numbers."""
import pytest

from maco import MacoError
from maco.cli import main
from maco.reproduce import FIGURES, run_figures, select, write_report


def test_select_names_unknown_figures():
    assert [f.name for f in select(["all"])] == [f.name for f in FIGURES]
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
