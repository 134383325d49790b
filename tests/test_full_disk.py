"""A full disk is one line and loses nothing (issue "Never silently wrong", items 10 and 11).

Appending records to a full disk rolls the partial line back and says so (the records before are
kept whole); an output folder that fills up names the folder and keeps what could be written;
a kernel cache that fills up stops the run, records no trial as failed, so a rerun measures them.
Short writes are simulated in-process (os.write patched); the command-line runs use a 64 KiB
tmpfs (mounting one needs root: skipped with the reason otherwise).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maco import ConvSpec, MacoError, Schedule, Target
from maco.tune.records import RecordFile, make_record
from maco.core.timing import Timing

SPEC = ConvSpec(1, 8, 10, 10, 16, 3, 3, padding=1)
LAYER = "n1_c4_h6_w6_k8_r3x3_p1"  # what the command-line runs tune: a few milliseconds per build


def _record(unroll: int = 0, sec: float = 1e-3):
    schedule = Schedule(kind="cpu", spatial=((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 2, 8), (2, 5, 1, 1), (1, 2, 1, 5)),
                        reduction=((2, 4), (1, 3), (3, 1)), layout="NCHW", unroll=unroll)
    return make_record(SPEC, Target.host(), schedule, Timing(sec, sec, sec, 0.0, 5, 10))


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[-3000:]
    assert lines and lines[-1].startswith("maco "), err[-3000:]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


# -- records: a short write, then no space ----------------------------------------------------
def test_a_short_write_then_enospc_rolls_back_and_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    before = [_record(0), _record(16)]
    RecordFile(path).append(before)
    kept = path.read_bytes()
    real_write, calls = os.write, []

    def full_disk(fd, data):  # what a filling disk does: part of the line, then ENOSPC
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:len(data) // 3]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(MacoError) as info:
        RecordFile(path).append([_record(64), _record(128)])
    monkeypatch.undo()
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "No space left on device" in message
    assert path.read_bytes() == kept  # the partial line is gone, the records before are whole
    f = RecordFile(path)
    assert f.load() == before and f.bad_lines == []


def test_a_short_write_is_finished_not_left_torn(tmp_path, monkeypatch):
    """os.write may write less than asked without an error: the rest is written too."""
    path = tmp_path / "r.jsonl"
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:max(1, len(data) // 2)])))
    recs = [_record(0), _record(16)]
    RecordFile(path).append(recs)
    monkeypatch.undo()
    f = RecordFile(path)
    assert f.load() == recs and f.bad_lines == []


def test_rewriting_records_on_a_full_disk_keeps_the_file(tmp_path, monkeypatch):
    import maco.tune.records

    path = tmp_path / "r.jsonl"
    RecordFile(path).append([_record(0)])
    kept = path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(maco.tune.records, "write_atomic", full)
    with pytest.raises(MacoError, match="cannot rewrite records file.*No space left on device"):
        RecordFile(path).replace({1: _record(0, 2e-3)})
    assert path.read_bytes() == kept


# -- a real full disk: a tiny tmpfs -----------------------------------------------------------
@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 64 KiB tmpfs (root only), unmounted afterwards."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up here: {run.stderr.strip() or run.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(folder: Path) -> None:
    """Take every free block of the file system `folder` is on."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            while fh.write(b"\0" * 4096):
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def _maco(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def test_maco_tune_on_a_full_disk_is_one_line_and_keeps_the_records(tiny_disk, tmp_path):
    path = tiny_disk / "r.jsonl"
    before = [_record(0), _record(16)]
    RecordFile(path).append(before)
    with open(path, "ab") as fh:  # blank lines (skipped by load) up to 96 bytes short of a page:
        fh.write(b"\n" * ((4000 - path.stat().st_size) % 4096))  # the next line is written in part
    _fill(tiny_disk)
    kept = path.read_bytes()
    run = _maco("tune", LAYER, "--trials", "2", "--no-baseline", "--records", str(path),
                env={"MACO_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 2, run.stderr[-3000:]
    line = _one_line_error(run.stderr)
    assert "cannot append to records file" in line and str(path) in line and "No space left" in line
    assert path.read_bytes() == kept
    f = RecordFile(path)
    assert f.load() == before and f.bad_lines == []


def test_a_full_kernel_cache_stops_the_run_and_records_no_trial(tiny_disk, tmp_path):
    _fill(tiny_disk)
    records = tmp_path / "r.jsonl"
    run = _maco("tune", LAYER, "--trials", "4", "--no-baseline", "--records", str(records),
                env={"MACO_CACHE": str(tiny_disk)})
    assert run.returncode == 2, run.stderr[-3000:]
    line = _one_line_error(run.stderr)
    assert "No space left on device" in line and str(tiny_disk) in line, line
    assert RecordFile(records).load() == []  # no trial spent: a rerun with space measures them all
    again = _maco("tune", LAYER, "--trials", "4", "--no-baseline", "--records", str(records),
                  env={"MACO_CACHE": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(RecordFile(records).load()) == 4


def test_a_cache_write_that_hits_enospc_is_a_no_space_error(tmp_path, monkeypatch):
    """ENOSPC from Python (writing the object's digest), not from gcc: the same one line."""
    from maco.kernels import cpu_build

    monkeypatch.setenv("MACO_CACHE", str(tmp_path))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cpu_build, "write_atomic", full)
    with pytest.raises(cpu_build.NoSpaceError, match="No space left on device") as info:
        cpu_build.build("void f(float *x) { x[0] = 3; }", cpu_build.flags_for(Target.host()))
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


# -- the output folder of maco optimize -------------------------------------------------------
def _result(out: Path):
    from maco.layouts import LayoutPlan
    from maco.deploy.optimize_report import LayerRow, OptimizeResult

    spec = ConvSpec.parse("n1_c16_h20_w20_k16_r3_p1")
    rows = [LayerRow("conv1", spec, 1, 4, maco={"NCHW": 1e-4}, torch={"NCHW": 2e-4, "NHWC": 1.5e-4},
                     planned="NCHW", uses_maco=True)]
    plan = LayoutPlan([], ["NCHW", "NHWC"], 1e-3, 2e-3, "backtracking", "records", [[1, 16, 20, 20]])
    e2e = {"fused": {"default_s": 2e-3, "planned_s": 1e-3, "speedup": 2.0, "ratio_of_medians": 2.0,
                     "max_abs_diff": 0.0, "chosen": True}}
    return OptimizeResult("Small", out, rows, plan, e2e, 1.0, chosen="fused")


def test_an_output_file_that_does_not_fit_is_one_line_and_the_rest_is_written(tmp_path, monkeypatch):
    import maco.deploy.optimize_report as report
    from maco.core.files import write_atomic

    out = tmp_path / "out"
    out.mkdir()

    def png_does_not_fit(path, data):
        if Path(path).name == "layers.png":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_atomic(path, data)

    monkeypatch.setattr(report, "write_atomic", png_does_not_fit)
    with pytest.raises(MacoError) as info:
        report.write_outputs(_result(out), Target.host(), tmp_path / "r.jsonl", [])
    message = str(info.value)
    assert "\n" not in message and str(out) in message and "layers.png" in message
    assert "No space left on device" in message
    assert (out / "report.md").is_file() and (out / "layers.csv").is_file()
    assert json.loads((out / "end_to_end.json").read_text())["fused"]["speedup"] == 2.0
    assert not (out / "layers.png").exists() and [p.name for p in out.glob(".*.tmp")] == []


def test_a_full_output_folder_is_one_line_naming_it(tiny_disk):
    from maco.deploy.optimize_report import save_output, write_outputs

    _fill(tiny_disk)
    with pytest.raises(MacoError) as info:
        write_outputs(_result(tiny_disk), Target.host(), tiny_disk / "r.jsonl", [])
    message = str(info.value)
    assert "\n" not in message and str(tiny_disk) in message and "No space left on device" in message
    assert "report.md" in message and "layers.png" in message
    with pytest.raises(MacoError, match="plan.json.*No space left on device"):
        save_output(tiny_disk, "plan.json", "{}" * 100_000)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]  # nothing half-written
