"""One pipeline behind `maco optimize` and the torch.compile backend, reading its records once;
records files that are not regular files, and saving on a full disk, fail with one line."""
from __future__ import annotations

import errno
import os
import signal
import types
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from maco import kernels
from maco.core.errors import MacoError
from maco.core.timing import Timing
from maco.deploy import compile_backend, deployment, optimize, pipeline
from maco.core.spec import ConvSpec
from maco.layouts.networks import conv_layers, distinct_convs, load_model
from maco.tune.records import RecordFile, RecordStore, best_in_files, make_baseline, make_record
from maco.tune.tuning import BUDGETS

TIMING = Timing(1e-3, 1e-3, 1e-3, 0.0, 3, 10, 1e-3, 1.0)

TWO_CONVS = '''
import torch
from torch import nn

class TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))
'''


def _full_records(path, model, x):
    """Records that leave nothing to tune or time: the quick budget and both torch baselines
    for every distinct conv of `model`."""
    host = kernels.host_target()
    file = RecordFile(path)
    for spec, _ in distinct_convs(conv_layers(model, x)):
        file.append([make_record(spec, host, kernels.default_schedule(spec, host, lay), TIMING)
                     for lay in ("NCHW", "NHWC") for _ in range(BUDGETS["quick"] // 2)])
        file.append([make_baseline(spec, host, lay, TIMING) for lay in ("NCHW", "NHWC")])


@pytest.fixture
def reads(monkeypatch):
    """Whole reads of records files (RecordFile.load_entries, or a read_new that read all of a
    file), and every call of run_pipeline
    through each front door's module."""
    seen = {"loads": [], "pipeline": []}
    load_entries, read_new, run = RecordFile.load_entries, RecordFile.read_new, pipeline.run_pipeline

    def counted_load(self, *a, **kw):
        seen["loads"].append(self.path)
        return load_entries(self, *a, **kw)

    def counted_read(self, *a, **kw):
        entries, whole = read_new(self, *a, **kw)
        if whole and self.path.exists() and self.path.stat().st_size:
            seen["loads"].append(self.path)
        return entries, whole

    def spy(*a, **kw):
        seen["pipeline"].append(a[0])
        return run(*a, **kw)
    monkeypatch.setattr(RecordFile, "load_entries", counted_load)
    monkeypatch.setattr(RecordFile, "read_new", counted_read)
    for door in (optimize, compile_backend):
        assert door.run_pipeline is run
        monkeypatch.setattr(door, "run_pipeline", spy)
    return seen


def test_the_backend_reads_its_records_once_through_the_pipeline(tmp_path, reads):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1)).eval()
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "maco_records.jsonl"
    _full_records(path, model, x)
    before = path.read_bytes()
    torch._dynamo.reset()  # a graph cached by an earlier test of the same shapes would skip the backend
    fast = torch.compile(model, backend="maco", options={"records": str(tmp_path), "tune": "quick"})
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    assert reads["loads"] == [path]  # before: once per distinct conv, and three times more
    assert len(reads["pipeline"]) == 1 and path.read_bytes() == before


def test_optimize_reads_its_records_once_through_the_pipeline(tmp_path, reads):
    (tmp_path / "two.py").write_text(TWO_CONVS)
    text = f"{tmp_path / 'two.py'}:TwoConvs"
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "records.jsonl"
    _full_records(path, load_model(text)[1], x)
    before = path.read_bytes()
    result = optimize.optimize(text, out=tmp_path / "out", records=path, input_shape=tuple(x.shape),
                               log=lambda s: None)
    assert reads["loads"] == [path]  # the tuner resumes from the pipeline's read (RecordStore.resume)
    assert len(reads["pipeline"]) == 1 and path.read_bytes() == before
    assert [row.trials for row in result.rows] == [BUDGETS["quick"]] * 2


def test_a_store_refresh_reads_only_what_was_appended(tmp_path):
    host = kernels.host_target()
    spec = ConvSpec(1, 8, 8, 8, 8, 3, 3, padding=1)
    path = tmp_path / "r.jsonl"
    RecordFile(path).append(make_baseline(spec, host, "NCHW", TIMING))
    store = RecordStore([path], host)
    assert set(store.baselines) == {(spec, "NCHW")} and store.best == {}
    record = make_record(spec, host, kernels.default_schedule(spec, host, "NHWC"), TIMING)
    RecordFile(path).append(record)
    store.refresh()
    assert store.best == {(spec, "NHWC"): record} and set(store.baselines) == {(spec, "NCHW")}


@contextmanager
def _deadline(seconds: int):
    """A read that hangs fails the test instead of hanging it."""
    def expire(*_):
        raise TimeoutError(f"still reading after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_records_file_that_is_no_regular_file_is_one_line(tmp_path, kind):
    path = tmp_path / "records.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    host = kernels.host_target()
    readers = [lambda: RecordFile(path).load(), lambda: RecordFile(path).read_new(),
               lambda: best_in_files([path], host), lambda: RecordStore([path], host)]
    for read in readers:
        with _deadline(10), pytest.raises(MacoError, match="records file .* is a .*, not a regular file"):
            read()


def test_saving_on_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    host = kernels.host_target()
    dep = deployment.Deployment("default", [1, 3, 8, 8], host.fingerprint(), torch.get_num_threads())
    saved = types.SimpleNamespace(meta={"maco": dep})
    path = tmp_path / "model.maco"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(MacoError, match=r"cannot write saved model .*model\.maco.*No space left on device"):
        deployment.save(saved, path)
    monkeypatch.undo()
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["model.maco"]


class _Slow(nn.Module):
    """`model` with a sleep after it: any other model of its output is faster end to end."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        import time

        time.sleep(0.03)
        return self.model(x)


class _Cached(nn.Module):
    """The model's output handed back without computing it: faster than any model of it."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


def test_a_kernel_in_every_conv_is_taken_only_where_it_is_faster_end_to_end():
    """pipeline._everywhere_if_faster: the all-NHWC model with a MACO kernel in every conv replaces
    the per-layer choices when it runs faster end to end, with its own plan; not otherwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(1, 3, 24, 24)
    host, lines = kernels.host_target(), []
    taken = pipeline._everywhere_if_faster(model, x, host, _Slow(model), True, False, lines.append)
    assert taken is not None and "taken" in lines[-1]
    assert any("Winograd beats the direct kernel in the model on 0 of 0" in line for line in lines)  # none it computes
    everywhere, plan, blocks, squeeze = taken
    assert squeeze == 0  # no squeeze-excitation in the model
    assert {lp.layout for lp in plan.convs} == {"NHWC"}
    from maco.layouts.maco_modules import MacoConv2d, MacoDepthwise2d, MacoInvertedResidual

    # depthwise -> 1x1 is a block without an expand conv: one kernel where that won
    won = sum(r >= pipeline.MIN_GAIN for r in blocks.values())
    assert len(blocks) == 1 and any("inverted residual on" in line for line in lines)
    kinds = [type(m) for m in everywhere.modules()
             if isinstance(m, (MacoConv2d, MacoDepthwise2d, MacoInvertedResidual))]
    assert kinds.count(MacoConv2d) == 2 - won and kinds.count(MacoInvertedResidual) == won
    assert kinds.count(MacoDepthwise2d) == 1  # registered where it was, called by the block or the graph
    with torch.inference_mode():
        want = model(x)
        assert float((everywhere(x) - want).abs().max() / want.abs().max()) < 1e-4
        assert pipeline._everywhere_if_faster(model, x, host, _Cached(want), True, True, lines.append) is None
    assert "per-layer choices kept" in lines[-1]
